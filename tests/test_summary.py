"""The pipeline's typed results and the summary built from them, without Prefect: what the flow returns, what
Prefect pickles into its cache, and the markdown a person reads."""

from __future__ import annotations

import pickle

from vlmexp.results import Evaluation, PipelineResult, Promotion, SampledData, StageResult, comparison_table
from vlmexp.summary import render_summary, summary_tags

DATA = SampledData(resolved="o/config.resolved.yaml", train="o/data/train.jsonl", val="o/data/val.jsonl",
                   hash="ab" * 32, base_model="o/models/tiny")


def _run() -> PipelineResult:
    sft = StageResult(stage="sft", final="o/sft/final", key="k-sft", run_id="r1", seconds=12.34,
                      flow_run_id="now")
    grpo = StageResult(stage="grpo", final="o/grpo/final", key="k-grpo", run_id="r2", seconds=5.0,
                       flow_run_id="1234567890abcdef")  # from the cache of an earlier flow run
    run = PipelineResult(name="demo", config="configs/demo.yaml", data=DATA, flow_run_id="now",
                         mlflow_run_id="p", stages={"sft": sft, "dpo": None, "grpo": grpo})
    run.evaluations = [Evaluation(name=name, model=path,
                                  metrics={"count": 8, "rec_mean_iou": iou, "extra": 1.0},
                                  samples=f"o/eval/{name}/samples.jsonl", key=f"e-{name}", seconds=1.0)
                       for (name, path, _), iou in zip(run.candidates(), (0.0, 0.312345, 0.35))]
    run.evaluation = comparison_table(run.evaluations)
    run.export = "o/export"
    run.promotion = Promotion("vlmexp-demo", "2", "rec_mean_iou", 0.35, "1", 0.3, True,
                              "0.3500 > champion's 0.3000")
    return run


def test_the_run_knows_its_models_keys_and_metric():
    run = _run()
    assert run.model == "o/grpo/final" and run.upstream_key == "k-grpo"
    assert run.candidates() == [("base", "o/models/tiny", ""), ("sft", "o/sft/final", "k-sft"),
                                ("grpo", "o/grpo/final", "k-grpo")]
    assert run.start_model("sft") is None and run.start_model("grpo") == "o/grpo/final"
    assert run.metric("rec_mean_iou") == 0.35 and run.metric("typo") is None
    empty = PipelineResult(name="demo", config="c", data=DATA, flow_run_id="now", mlflow_run_id="")
    assert (empty.model == DATA.base_model and empty.start_model("grpo") is None
            and empty.metric("count") is None)
    # METRIC_KEYS only, rounded
    assert run.evaluation[1] == {"model": "sft", "count": 8, "rec_mean_iou": 0.3123}
    assert run.provenance()["mlflow_stage_run_ids"] == {"sft": "r1", "grpo": "r2"}


def test_results_survive_pickling_as_prefect_caches_them():
    run = _run()
    assert pickle.loads(pickle.dumps(run)) == run
    assert pickle.loads(pickle.dumps(run.stages["sft"])).output == "o/sft/final"


def test_the_summary_lists_each_stage_the_evaluation_and_the_promotion():
    text = render_summary(_run(), "sqlite:///o/mlflow.db experiment 1 run p", "sqlite:///o/mlflow.db")
    assert text == """# demo

config `configs/demo.yaml`, data manifest `abababababab`

| stage | status | seconds | output |
|---|---|---|---|
| sft | trained | 12.3 | `o/sft/final` |
| dpo | disabled | | |
| grpo | skipped: inputs unchanged since flow run 12345678 | 5.0 | `o/grpo/final` |

## Evaluation

| model | count | rec_mean_iou |
|---|---|---|
| base | 8 | 0.0 |
| sft | 8 | 0.3123 |
| grpo | 8 | 0.35 |

Exported: `o/export`
Registered `vlmexp-demo` version 2: **promoted to `champion`** on rec_mean_iou: 0.3500 > champion's 0.3000

MLflow: `sqlite:///o/mlflow.db experiment 1 run p` (browse: `vlmexp ui --store sqlite:///o/mlflow.db`)

Every metric of each logging step: the stages' MLflow runs, and `o/sft/metrics.jsonl`, `o/grpo/metrics.jsonl`
"""
    assert summary_tags(_run()) == {"stage.sft": "trained", "stage.grpo": "skipped",
                                    "export.promoted": "true"}
    # with the evaluation's grid beside summary.md in the parent run: shown under the table
    pictured = render_summary(_run(), "", "", "evaluation/grid.png")
    assert ("| grpo | 8 | 0.35 |\n\nThe first held-out records, ground truth green, each model in its colour:"
            "\n\n![held-out records with each model's boxes](evaluation/grid.png)\n\nExported") in pictured
