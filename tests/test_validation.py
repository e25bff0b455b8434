"""Validation during training (eval.every_steps) and the best checkpoint: metrics by hand, config refusals,
and real SFT / GRPO runs on the tiny model (MLflow read back, resume keeping the best, rotation sparing
it). Validation under torchrun with 2 processes (the main one validates, the other takes its decisions):
tests/test_qwen3_5_runs.py, on the tiny Qwen3.5-MoE."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SMALL_BATCHES, make_png, write_jsonl
from test_flow import prefect  # noqa: F401 - the module-scoped Prefect test harness

from vlmexp.checks.loader import load_config
from vlmexp.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))  # rewards_for_tests


def _rec_scorer(tmp_path, n_records: int):
    """`score` over `n_records` copies of a 1000x500 rec record (GT [100, 50, 200, 100], [100.8, 50.4, 201.6,
    100.8] in Qwen2.5-VL's frame at the released pixel budget), as validation builds it."""
    from vlmexp.evaluate import read_predictions
    from vlmexp.families.qwen import RELEASED_PIXELS
    from vlmexp.processor import PixelBudget
    from vlmexp.scoring import score_records

    make_png(tmp_path / "wide.png", size=(1000, 500))
    rec = {"image": "wide.png", "problem": "the box", "solution": [100, 50, 200, 100], "task": "rec",
           "completion": ""}
    records, _ = read_predictions(write_jsonl(tmp_path / "p.jsonl", [rec] * n_records))
    budget = PixelBudget(14, 2, *RELEASED_PIXELS)
    return lambda completions: score_records(records, completions, "pixels", budget)


EXACT, THIRD, NONE = ("<think>x</think><answer>[100.8, 50.4, 201.6, 100.8]</answer>",  # IoU 1
                      "<think>x</think><answer>[151.2, 50.4, 252, 100.8]</answer>",  # IoU 1/3
                      "<think>x</think><answer>no box</answer>")  # 0


def test_mean_and_best_of_n_by_hand(tmp_path):
    from vlmexp.train.validation import validation_metrics

    score = _rec_scorer(tmp_path, 2)
    greedy = validation_metrics([[EXACT], [NONE]], score)
    assert greedy["val/rec_mean_iou"] == pytest.approx(0.5) and greedy["val/format_rate"] == 1.0
    assert "val/count" not in greedy and not any("_at_" in k for k in greedy)

    sampled = validation_metrics([[EXACT, THIRD], [NONE, THIRD]], score)
    # sample sets: (1 + 0) / 2 and (1/3 + 1/3) / 2; each record's best: 1 and 1/3
    assert sampled["val/rec_mean_iou/mean_at_2"] == pytest.approx((0.5 + 1 / 3) / 2)
    assert sampled["val/rec_mean_iou/best_at_2"] == pytest.approx((1 + 1 / 3) / 2)
    assert sampled["val/rec_acc50/mean_at_2"] == pytest.approx(0.25)
    assert sampled["val/rec_acc50/best_at_2"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="same number of completions"):
        validation_metrics([[EXACT, THIRD], [NONE]], score)


def _problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "configs/demo.yaml", list(overrides))
    return [str(p) for p in e.value.problems]


def test_refusals_at_config_load():
    [best] = _problems("export.checkpoint=best")
    assert "export.checkpoint" in best and "eval.every_steps" in best and "override" in best
    [no_val] = _problems("data={datasets: [{json_path: x.jsonl}]}", "eval.every_steps=5")
    assert "eval.every_steps" in no_val and "held-out" in no_val
    [greedy] = _problems("eval.every_steps=5", "eval.during_training_n=4")
    assert "during_training_temperature" in greedy
    [unsaved] = _problems("eval.every_steps=5", "export.checkpoint=best", "grpo.args.save_strategy=no")
    assert "grpo.args.save_strategy" in unsaved
    cfg = load_config(REPO / "configs/demo.yaml", ["eval.every_steps=5", "export.checkpoint=best"])
    assert cfg.eval.every_steps == 5 and cfg.export.checkpoint == "best"
    assert load_config(REPO / "configs/demo.yaml").eval.every_steps is None  # the demo: off


SFT_RUNS = """
import json, sys
from vlmexp.cli import main
for argv in json.loads(sys.argv[1]):
    rc = main(argv)
    if rc:
        sys.exit(rc)
"""


def _sft_runs(*runs: tuple[Path, list[str]]) -> subprocess.CompletedProcess:
    """`vlmexp train sft` of the demo for 5 steps into each (output folder, overrides) of `runs`, one after
    the other in one fresh process (one import of the training stack for all of them)."""
    argv = [["train", "sft", "--config", "configs/demo.yaml", f"run.output_dir={out}", "data.demo.train=16",
             "data.demo.val=6", *SMALL_BATCHES, "sft.args.max_steps=5", "sft.args.save_steps=100",
             "sft.args.logging_steps=1", "eval.max_new_tokens=12", *overrides] for out, overrides in runs]
    return subprocess.run([sys.executable, "-c", SFT_RUNS, json.dumps(argv)], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.slow
def test_sft_validates_into_mlflow_and_leaves_training_unchanged(tmp_path):
    """Greedy validation every 2 steps and at the last (5): val/* in the stage's MLflow run at those steps;
    the trained weights are byte-identical to a run without validation (both runs in one process, the plain
    one first, so nothing validation does could be missing from it)."""
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    store = f"sqlite:///{tmp_path / 'store.db'}"
    r = _sft_runs((tmp_path / "plain", ["tracking.backend=none"]),
                  (tmp_path / "val", ["tracking.backend=mlflow", f"tracking.tracking_uri={store}",
                                      "eval.every_steps=2", "eval.during_training_samples=4"]))
    assert r.returncode == 0, r.stderr[-4000:]
    a, b = (load_file(tmp_path / d / "sft" / "final" / "model.safetensors") for d in ("plain", "val"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)

    client = MlflowClient(store)
    [run] = client.search_runs([client.get_experiment_by_name("demo").experiment_id])
    for key in ("val/rec_mean_iou", "val/rec_acc50", "val/format_rate", "val/seconds"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [2, 4, 5], key
    assert "val/count" not in run.data.metrics
    # the Trainer's own log of a validation step is still there
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3, 4, 5]
    summary = json.loads((tmp_path / "val" / "sft" / "validation.json").read_text())
    assert summary["metric"] == "val/rec_mean_iou" and [s for s, _ in summary["history"]] == [2, 4, 5]
    assert not (tmp_path / "plain" / "sft" / "validation.json").exists()
    assert r.stderr.count("validation on 4 held-out records x 1") == 3  # steps 2, 4, 5 of the second run
    _assert_validation_pictures(client, run.info.run_id, tmp_path / "val", tmp_path / "dl")


def _assert_validation_pictures(client, run_id: str, out: Path, dest: Path) -> None:
    """eval.during_training_pictures (4) held-out records as MLflow images `validation/record_<i>` at each
    validation step (the image slider's steps), each at most 512 px a side, the ground truth green on its
    box's edges."""
    from PIL import Image

    from vlmexp.data.record import read_sampled
    from vlmexp.pictures import COLOURS, MAX_SIDE, PANEL

    names = [a.path.split("/")[-1] for a in client.list_artifacts(run_id, "images")]
    logged = sorted((n.split("+")[0], int(n.split("+")[2])) for n in names
                    if not n.endswith("compressed.webp"))
    assert logged == sorted((f"validation~record_{i:02d}", step) for i in range(4)
                            for step in (2, 4, 5)), names
    assert client.get_run(run_id).data.tags.get("mlflow.loggedImages") == "True"
    first = next(n for n in names if n.startswith("validation~record_00+step+5+") and n.endswith(".png"))
    picture = Image.open(client.download_artifacts(run_id, f"images/{first}", str(dest))).convert("RGB")
    record = read_sampled(out / "data" / "val.jsonl")[0]
    width, height = record.image_sizes[0]
    scale = (MAX_SIDE - PANEL) / max(width, height)
    assert max(picture.size) <= MAX_SIDE and picture.width == round(width * scale) + PANEL
    x1, y1, x2, y2 = (v * scale for v in record.solution)
    for xy in ((int(x1) + 1, int((y1 + y2) / 2)), (int((x1 + x2) / 2), int(y1) + 1)):
        assert picture.getpixel(xy) == COLOURS["truth"][1], xy


@pytest.mark.slow
def test_grpo_best_checkpoint_survives_rotation_and_resume(tmp_path):
    """Sampled validation (N 2) every 2 steps; stopped after step 4, resumed to 6. The best so far (step 2:
    the tiny random model scores 0 throughout, and a tie keeps the earlier step) survives the resume, and its
    checkpoint survives save_total_limit 2, which deletes checkpoint-4."""
    from stop_at_step import StopAtStep

    from vlmexp.train.grpo import run_grpo

    overrides = [f"run.output_dir={tmp_path}", "tracking.backend=none", "data.demo.train=16",
                 "data.demo.val=4", *SMALL_BATCHES, "grpo.args.max_steps=6", "grpo.args.save_steps=2",
                 "grpo.args.save_total_limit=2", "grpo.args.logging_steps=1",
                 "grpo.args.per_device_train_batch_size=4", "grpo.args.num_generations=4",
                 "grpo.args.max_completion_length=8", "grpo.args.temperature=1.5",
                 "grpo.rewards=[{name: 'rewards_for_tests:char_variety'}, {name: iou}]", "eval.every_steps=2",
                 "eval.during_training_n=2", "eval.during_training_temperature=1.0", "eval.max_new_tokens=8",
                 "export.checkpoint=best"]
    run_grpo(load_config(REPO / "configs/demo.yaml", overrides), None, [StopAtStep(4)])
    stage = tmp_path / "grpo"
    state = json.loads((stage / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["best_global_step"] == 2 and state["best_model_checkpoint"] == str(stage / "checkpoint-2")

    run_grpo(load_config(REPO / "configs/demo.yaml", overrides))
    assert sorted(p.name for p in stage.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-6"]
    summary = json.loads((stage / "validation.json").read_text())
    assert summary["metric"] == "val/rec_mean_iou/mean_at_2"
    assert [s for s, _ in summary["history"]] == [2, 4, 6]  # the steps before the stop are kept
    assert (summary["best_step"], summary["best_checkpoint"]) == (2, str(stage / "checkpoint-2"))
    last = json.loads((stage / "checkpoint-6" / "trainer_state.json").read_text())["log_history"]
    validations = [h for h in last if "val/format_rate/best_at_2" in h]
    assert [h["step"] for h in validations] == [2, 4, 6]
    assert all(h["val/format_rate/best_at_2"] >= h["val/format_rate/mean_at_2"] for h in validations)


@pytest.mark.slow
def test_pipeline_exports_and_registers_the_best_checkpoint(prefect, tmp_path, run_inputs):  # noqa: F811
    """SFT validating every 2 of 4 steps, export.checkpoint: best: the best checkpoint (step 2, a tie with
    step 4 keeps the earlier) is evaluated as sft-best, exported (its weights, not final's), registered with
    its metric, and the manifest says which step and why."""
    from safetensors.torch import load_file
    from test_flow import DEMO, SMALL, _mlflow, _run

    out = tmp_path / "run"
    result = _run(DEMO, [f"run.output_dir={out}", *SMALL, *run_inputs(out), "grpo.enabled=false",
                         "sft.args.save_steps=100",
                         "eval.every_steps=2", "eval.during_training_samples=4", "export.checkpoint=best"])
    assert [row["model"] for row in result.evaluation] == ["base", "sft", "sft-best"]
    manifest = json.loads((out / "export" / "manifest.json").read_text())
    chosen = manifest["checkpoint"]
    assert (chosen["choice"], chosen["stage"], chosen["step"], chosen["metric"]) == ("best", "sft", 2,
                                                                                     "val/rec_mean_iou")
    assert "at step 2" in chosen["reason"] and manifest["source"].endswith("sft/checkpoint-2")
    exported, best = (load_file(p / "model.safetensors")
                      for p in (out / "export", out / "sft" / "checkpoint-2"))
    final = load_file(out / "sft" / "final" / "model.safetensors")
    assert (all((exported[k] == best[k]).all() for k in best)
            and any((best[k] != final[k]).any() for k in best))
    sft_best = next(e for e in result.evaluations if e.name == "sft-best")
    assert result.promotion.value == sft_best.metrics["rec_mean_iou"]

    client, _, runs = _mlflow(out)
    assert [m.step for m in client.get_metric_history(runs["demo-sft"].info.run_id,
                                                      "val/rec_mean_iou")] == [2, 4]


@pytest.mark.parametrize(("launch", "scheme", "processes"), [
    (["launch.launcher=torchrun", "launch.nproc_per_node=2", "launch.deepspeed=configs/deepspeed/zero3.json"],
     "DeepSpeed ZeRO-3", 2),
    (["launch.launcher=torchrun", "launch.nnodes=2", "launch.rdzv_endpoint=node0:29500",
      "sft.args.fsdp=full_shard"], "FSDP", 2),
])
def test_sharded_parameters_over_several_processes_are_refused_before_the_launcher_starts(
        tmp_path, vlmexp_main, launch, scheme, processes):
    """Validation during training with ZeRO-3 or FSDP over several processes (over the nodes too): `vlmexp
    train` refuses it from the config, naming the field and the fix, before the launcher starts any process
    (each rank would refuse it after its start-up, as `check_sharding` does)."""
    rc, out, err = vlmexp_main("train", "sft", "--config", "configs/demo.yaml", f"run.output_dir={tmp_path}",
                               "tracking.backend=none", "data.demo.train=16", "data.demo.val=4",
                               "eval.every_steps=1", *launch)
    assert rc == 2, err
    assert "eval.every_steps" in err
    assert f"{scheme} shards the parameters over the {processes} processes" in err
    assert "zero2.json" in err and "eval.every_steps: 0" in err
    assert "launching: " not in out + err and not (tmp_path / "sft").exists()
