"""Faults during training: a killed or disk-full GRPO process resumes from its newest complete checkpoint,
recomputes at most save_steps steps, and leaves MLflow a history without duplicated or backwards steps.

The faults are real (SIGKILL of the training process, an ENOSPC OSError inside the checkpoint save),
planted by tests/faults/sitecustomize.py in the subprocess; the rerun is what the pipeline's retried
task runs: the same command, the same stage folder, the same MLflow run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
SAVE_STEPS, MAX_STEPS = 2, 6
GRPO = ["tracking.backend=mlflow", "data.demo.train=16", "data.demo.val=4", f"grpo.args.max_steps={MAX_STEPS}",
        f"grpo.args.save_steps={SAVE_STEPS}", "grpo.args.logging_steps=1", "grpo.args.per_device_train_batch_size=4",
        "grpo.args.num_generations=4", "grpo.args.max_completion_length=8", "grpo.args.temperature=1.5",
        "grpo.rewards=[{name: 'rewards_for_tests:char_variety'}]"]


def _train(out: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vlmexp.cli", "train", "grpo", "--config", "configs/demo.yaml",
                           f"run.output_dir={out}", *GRPO], capture_output=True, text=True, cwd=REPO, env=env)


@pytest.mark.parametrize(("fault", "crash"), [
    ("kill_at_step:3", -signal.SIGKILL),   # preempted between checkpoints
    ("kill_in_save:4", -signal.SIGKILL),   # killed while checkpoint-4 is half written
    ("enospc_in_save:4", 1),               # disk full while writing checkpoint-4
])
def test_grpo_fault_resumes_from_the_newest_complete_checkpoint(tmp_path, fault, crash):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("faults")).info.run_id
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "MLFLOW_RUN_ID": run_id,
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "faults"), str(REPO / "tests")])}

    first = _train(tmp_path, {**env, "VLMEXP_FAULT": fault})
    assert first.returncode == crash, first.stderr[-3000:]
    if crash == 1:
        assert "No space left on device (planted)" in first.stderr
    step = int(fault.split(":")[1])
    grpo = tmp_path / "grpo"
    assert not (grpo / "final").exists()
    if "save" in fault:  # the half-written checkpoint is there but has no trainer_state.json
        assert (grpo / f"checkpoint-{step}").is_dir() and not (grpo / f"checkpoint-{step}" / "trainer_state.json").exists()

    second = _train(tmp_path, env)
    assert second.returncode == 0, second.stderr[-3000:]
    resumed_from = int(second.stderr.split("(resume: ")[1].split(")")[0].rsplit("-", 1)[1])
    assert resumed_from == 2 and step - resumed_from <= SAVE_STEPS  # at most save_steps steps recomputed
    state = json.loads((grpo / f"checkpoint-{MAX_STEPS}" / "trainer_state.json").read_text())
    assert state["global_step"] == MAX_STEPS and (grpo / "final" / "model.safetensors").is_file()

    for key in ("loss", "reward", "rewards/rewards_for_tests:char_variety/mean"):
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        assert steps == list(range(1, MAX_STEPS + 1)), (key, steps)
