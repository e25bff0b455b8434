"""DPO on the tiny model (CPU): pairs from data and from the model's own samples, resume, bad pair records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import make_png, write_jsonl
from test_flow import prefect  # noqa: F401 - the module-scoped Prefect test harness

from vlmexp.checks.loader import load_config

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
DPO_ARGS = ["dpo.enabled=true", "sft.enabled=false", "grpo.enabled=false",
            "dpo.args.per_device_train_batch_size=4", "dpo.args.learning_rate=1e-3",
            "dpo.args.logging_steps=1", "dpo.args.max_length=256"]


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def _changed(before: dict, after: dict) -> list[str]:
    return [k for k in before if not (before[k] == after[k]).all()]


def _sampled_cfg(tmp_path, *overrides):
    return load_config(REPO / "configs/demo.yaml", [
        f"run.output_dir={tmp_path}", "tracking.backend=none", "data.demo.train=8", "data.demo.val=4",
        "dpo.pairs.from=samples", "dpo.pairs.num_samples=3", "dpo.pairs.max_new_tokens=12",
        "dpo.pairs.min_margin=0.05",
        "grpo.rewards=[{name: 'rewards_for_tests:char_variety'}]", *DPO_ARGS, *overrides])


def _pair_data(tmp_path: Path, rows: list[dict]) -> Path:
    for i in range(2):
        make_png(tmp_path / f"img{i}.png", color=("red", "blue")[i])
    return write_jsonl(tmp_path / "pairs.jsonl", rows)


def test_dpo_from_samples_trains_and_writes_pairs(tmp_path):
    from vlmexp.train.dpo import run_dpo

    cfg = _sampled_cfg(tmp_path, "dpo.args.max_steps=3", "dpo.args.save_steps=3")
    final = run_dpo(cfg)
    [base] = (tmp_path / "models").glob("tiny-*")
    assert any(k.startswith("model.layers.") for k in _changed(_weights(base), _weights(final)))
    pairs = [json.loads(line) for line in (tmp_path / "dpo" / "pairs.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "dpo" / "pairs.json").read_text())
    assert summary["prompts"] == 8 and summary["pairs"] == len(pairs) > 0
    assert summary["prompts_without_pair"] == 8 - len(pairs)
    assert all(p["chosen_score"] - p["rejected_score"] >= 0.05 and p["chosen"] != p["rejected"]
               for p in pairs)
    [ckpt] = (tmp_path / "dpo").glob("checkpoint-*")
    history = json.loads((ckpt / "trainer_state.json").read_text())["log_history"]
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                "logps/chosen"):
        assert any(key in h for h in history), key


def test_dpo_resume_gives_the_same_weights(tmp_path):
    from vlmexp.train.dpo import run_dpo

    # a constant learning rate, so the run that stops at step 2 follows the same schedule as the whole one
    steps = ["dpo.args.save_steps=2", "dpo.args.lr_scheduler_type=constant"]
    whole = run_dpo(_sampled_cfg(tmp_path / "whole", "dpo.args.max_steps=4", *steps))
    split = tmp_path / "split"
    run_dpo(_sampled_cfg(split, "dpo.args.max_steps=2", *steps))  # stops at step 2
    resumed = run_dpo(_sampled_cfg(split, "dpo.args.max_steps=4", *steps))
    assert (split / "dpo" / "checkpoint-4").is_dir()
    texts = [[(p["chosen"], p["rejected"]) for p in map(json.loads, (root / "dpo" / "pairs.jsonl").open())]
             for root in (split, tmp_path / "whole")]
    assert texts[0] == texts[1]  # same seed, same sampled pairs
    a, b = _weights(whole), _weights(resumed)
    assert not [k for k in a if not (a[k] - b[k]).abs().max() <= 1e-6]


def test_dpo_from_pair_data_with_lora(tmp_path, tiny_models):
    from vlmexp.train.dpo import run_dpo

    rows = [{"image": f"img{i % 2}.png", "question": f"What color is shape {i}?",
             "chosen": ("red", "blue")[i % 2], "rejected": ("blue", "red")[i % 2]} for i in range(8)]
    data = _pair_data(tmp_path, rows)
    cfg = load_config(REPO / "configs/demo.yaml", [
        f"run.output_dir={tmp_path / 'out'}", "tracking.backend=none", "data.demo=null",
        f"data.datasets=[{{json_path: '{data}', image_root: '{tmp_path}'}}]", "dpo.peft={r: 4, alpha: 8}",
        "dpo.args.max_steps=2", "dpo.args.save_steps=2", *DPO_ARGS])
    final = run_dpo(cfg)
    from safetensors.torch import load_file

    adapter = load_file(final / "adapter_model.safetensors")
    assert any("lora_B" in k and adapter[k].abs().sum() > 0 for k in adapter)  # B starts at zero: it trained


def test_bad_pair_records_are_rejected_with_file_and_line(tmp_path):
    from vlmexp.errors import DataError
    from vlmexp.train.dpo import run_dpo

    rows = [{"image": "img0.png", "question": "q1", "chosen": "a", "rejected": "b"},
            {"image": "img0.png", "question": "q2", "chosen": "same", "rejected": "same"},
            {"image": "img1.png", "question": "q3", "chosen": "a"},
            {"image": "img1.png", "question": "q4", "chosen": "", "rejected": "b"}]
    data = _pair_data(tmp_path, rows)
    cfg = load_config(REPO / "configs/demo.yaml", [
        f"run.output_dir={tmp_path / 'out'}", "tracking.backend=none", "data.demo=null",
        f"data.datasets=[{{json_path: '{data}', image_root: '{tmp_path}'}}]", "dpo.args.max_steps=2",
        *DPO_ARGS])
    with pytest.raises(DataError) as err:
        run_dpo(cfg)
    text = str(err.value)
    assert f"{data}:2" in text and "chosen and rejected are the same" in text
    assert f"{data}:3" in text and "'rejected'" in text
    assert f"{data}:4" in text and "'chosen' must be a non-empty" in text
    assert (not (tmp_path / "out" / "dpo").exists()
            or not list((tmp_path / "out" / "dpo").glob("checkpoint-*")))


def test_pipeline_sft_dpo_tracks_dpo_in_mlflow_and_exports_it(prefect, tmp_path, run_inputs):  # noqa: F811
    from test_flow import DEMO, SMALL, _artifacts, _mlflow, _run

    out = tmp_path / "run"
    dpo = ["dpo.enabled=true", "dpo.pairs.from=samples", "dpo.pairs.num_samples=3",
           "dpo.pairs.max_new_tokens=12", "dpo.pairs.min_margin=0.05", "dpo.args.max_steps=3",
           "dpo.args.save_steps=3", "dpo.args.logging_steps=1", "dpo.args.per_device_train_batch_size=4",
           "dpo.args.max_length=256", "grpo.enabled=false",
           "grpo.rewards=[{name: 'rewards_for_tests:char_variety'}]"]
    result = _run(DEMO, [f"run.output_dir={out}", *SMALL, *run_inputs(out), *dpo])

    client, _, runs = _mlflow(out)
    assert set(runs) == {"demo-pipeline", "demo-sft", "demo-dpo", "eval"}
    run_id = runs["demo-dpo"].info.run_id
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                "logps/chosen", "logps/rejected"):
        assert [m.step for m in client.get_metric_history(run_id, key)] == [1, 2, 3], key
    metrics = runs["demo-dpo"].data.metrics
    assert (metrics["pairs/prompts"] == 32
            and metrics["pairs/pairs"] + metrics["pairs/prompts_without_pair"] == 32)
    assert {"pairs/pairs.jsonl", "pairs/pairs.json", "plots/curves.png"} <= set(_artifacts(client, run_id))
    assert [row["model"] for row in result.evaluation] == ["base", "sft", "dpo"]
    # the run page's first charts: the reward margin and the main evaluation metric (tests/test_flow.py:
    # GRPO's)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "Summary/reward_margin")] == [
        (m.step, m.value) for m in client.get_metric_history(run_id, "rewards/margins")]
    dpo_iou = client.get_run(runs["eval"].info.run_id).data.metrics["dpo/rec_mean_iou"]
    assert [(m.step, m.value)
            for m in client.get_metric_history(run_id, "Summary/rec_mean_iou")] == [(3, dpo_iou)]
    manifest = json.loads((out / "export" / "manifest.json").read_text())
    assert manifest["evaluation"][-1]["model"] == "dpo" and "dpo" in manifest["mlflow_stage_run_ids"]
    assert result.model.endswith("dpo/final")
