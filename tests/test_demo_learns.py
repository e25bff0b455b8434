"""A cheap check that the demo recipe learns, on a quarter of its data and half of its SFT steps.

The full claim (GRPO and DPO beat SFT on every seed and CPU arithmetic) is bench/demo_matrix.py's, recorded in
bench/results/demo_matrix/ and checked against the README by test_readme_demo_table_is_the_recorded_matrix.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlmexp.checks.loader import load_config

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _area_ratio(samples: Path) -> float:
    """Mean area of the predicted box over the exact box's, over the answers that hold a box."""
    from vlmexp.coords import parse_box

    ratios = []
    for row in map(json.loads, samples.read_text().splitlines()):
        box, gold = parse_box(row["answer"] or ""), json.loads(row["solution"])
        if box is not None:
            ratios.append((box[2] - box[0]) * (box[3] - box[1]) / ((gold[2] - gold[0]) * (gold[3] - gold[1])))
    return sum(ratios) / len(ratios)


def test_demo_recipe_grounds_like_its_loose_annotator_and_gives_grpo_a_signal(tmp_path):
    from vlmexp.data.run_data import prepare_data
    from vlmexp.evaluate import evaluate
    from vlmexp.train.grpo import run_grpo
    from vlmexp.train.sft import run_sft

    cfg = load_config(REPO / "configs/demo.yaml", [
        f"run.output_dir={tmp_path}", "tracking.backend=none", "data.demo.train=256", "data.demo.val=64",
        "sft.args.max_steps=150", "sft.args.save_steps=150", "grpo.args.max_steps=4",
        "grpo.args.save_steps=4", "grpo.args.per_device_train_batch_size=32", "grpo.args.warmup_steps=0",
        "grpo.args.logging_steps=1"])
    data = prepare_data(cfg)
    sft = run_sft(cfg)
    metrics = evaluate(cfg, str(sft), data.val, tmp_path / "eval").metrics
    # the untrained model scores 0; 150 steps learn the answer format and where the shape is, roughly
    assert metrics["format_rate"] >= 0.9 and metrics["rec_mean_iou"] > 0.05, metrics
    # ... and SFT copies the annotator, whose boxes are a quarter of the side too loose on each edge
    assert _area_ratio(tmp_path / "eval" / "samples.jsonl") > 1.2
    grpo = run_grpo(cfg, str(sft))
    [state] = (Path(grpo).parent).glob("checkpoint-*/trainer_state.json")
    logs = [h for h in json.loads(state.read_text())["log_history"] if "reward_std" in h]
    # the exact-box IoU tells the samples of a prompt apart: GRPO has something to learn from
    assert len(logs) == 4 and all(h["frac_reward_zero_std"] < 0.5 and h["reward_std"] > 0.02
                                  for h in logs), logs
