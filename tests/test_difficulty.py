"""GRPO's difficulty filter (dynamic sampling, offline): the verdict by hand, config refusals, and a real run
on the tiny model whose GRPO then sees only prompts with signal (frac_reward_zero_std 0 at every step, read
from MLflow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SMALL_BATCHES

from vlmexp.checks.loader import load_config
from vlmexp.config.stages import DifficultyFilterConfig
from vlmexp.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def test_verdict_by_hand():
    from vlmexp.train.difficulty import verdict

    plain = DifficultyFilterConfig(enabled=True)
    assert verdict([0.5, 0.5, 0.5, 0.5], plain) == "zero_std"
    assert verdict([0.0, 0.0, 0.0, 0.0], plain) == "zero_std"
    assert verdict([0.0, 1.0, 0.0, 0.0], plain) == "kept"
    bounded = DifficultyFilterConfig(enabled=True, low=0.01, high=0.99)  # EasyR1's defaults, 0/1 accuracy
    assert verdict([1.0, 1.0, 0.0, 1.0], bounded) == "kept"
    assert verdict([0.2, 0.4, 0.0, 0.2], DifficultyFilterConfig(low=0.2)) == "low"  # mean 0.2: not above low
    assert verdict([0.9, 1.0, 0.8, 0.9], DifficultyFilterConfig(high=0.9)) == "high"


def test_config_refusals():
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "configs/demo.yaml", ["grpo.difficulty_filter.reward=accuracy"])
    assert "difficulty_filter.reward 'accuracy'" in str(e.value) and "['format', 'iou']" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "configs/demo.yaml", ["grpo.difficulty_filter.low=0.5",
                                                 "grpo.difficulty_filter.high=0.5"])
    assert "low (0.5) must be below high (0.5)" in str(e.value)
    cfg = load_config(REPO / "configs/demo.yaml", ["grpo.difficulty_filter.reward=iou"])
    # off by default
    assert cfg.grpo.difficulty_filter.reward == "iou" and not cfg.grpo.difficulty_filter.enabled


@pytest.mark.slow
def test_grpo_trains_only_on_prompts_with_signal(tmp_path, run_inputs):
    """`odd_rows_vary` gives the records of even source_row the same score for every completion and odd ones a
    spread: the filter keeps exactly the odd rows, and each GRPO step then has a group with signal."""
    from mlflow.tracking import MlflowClient

    model = run_inputs(tmp_path)  # the shared tiny model, and an empty store as tmp_path/mlflow.db
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    r = subprocess.run([sys.executable, "-m", "vlmexp.cli", "train", "grpo", "--config", "configs/demo.yaml",
                        f"run.output_dir={tmp_path}", *model, "tracking.backend=mlflow",
                        f"tracking.tracking_uri={store}", "data.demo.train=12", "data.demo.val=2",
                        *SMALL_BATCHES, "grpo.args.max_steps=4", "grpo.args.save_steps=4",
                        "grpo.args.logging_steps=1", "grpo.args.per_device_train_batch_size=4",
                        "grpo.args.num_generations=4", "grpo.args.max_completion_length=8",
                        "grpo.rewards=[{name: 'rewards_for_tests:odd_rows_vary'}]",
                        "grpo.difficulty_filter.enabled=true", "grpo.difficulty_filter.num_samples=4"],
                       capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line)["source_row"]
            for line in (tmp_path / "data" / "train.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "grpo" / "difficulty.json").read_text())
    assert [rows[i] for i in summary["kept_rows"]] == [row for row in rows if row % 2]
    assert summary["dropped_zero_std"] == sum(row % 2 == 0 for row in rows) == 6 and summary["prompts"] == 12

    client = MlflowClient(store)
    [run] = client.search_runs([client.get_experiment_by_name("demo").experiment_id])
    assert (run.data.metrics["difficulty/kept"] == 6
            and run.data.metrics["difficulty/frac_reward_zero_std"] == 0.5)
    zero = client.get_metric_history(run.info.run_id, "frac_reward_zero_std")
    assert [m.step for m in zero] == [1, 2, 3, 4] and all(m.value == 0.0 for m in zero)
