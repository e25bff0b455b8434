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
from conftest import SMALL_BATCHES

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
SAVE_STEPS, MAX_STEPS = 2, 10
OUTAGE_STEPS = 20
GRPO = ["tracking.backend=mlflow", "data.demo.train=16", "data.demo.val=4",
        f"grpo.args.max_steps={MAX_STEPS}", f"grpo.args.save_steps={SAVE_STEPS}", "grpo.args.logging_steps=1",
        "grpo.args.per_device_train_batch_size=4", "grpo.args.num_generations=4",
        "grpo.args.max_completion_length=8", "grpo.args.temperature=1.5",
        "grpo.rewards=[{name: 'rewards_for_tests:char_variety'}]", *SMALL_BATCHES]
# One training, crashed by each fault in turn: every run after the first resumes the one before it, and is
# itself crashed by the next fault, until the last run finishes. (fault, exit code of the crashed run, newest
# complete checkpoint the next run resumes from)
FAULTS = [("kill_at_step:3", -signal.SIGKILL, 2),   # preempted between checkpoints
          ("kill_in_save:6", -signal.SIGKILL, 4),   # killed while checkpoint-6 is half written
          ("enospc_in_save:8", 1, 6)]               # disk full while writing checkpoint-8


def _train(out: Path, env: dict[str, str], uri: str, run_id: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vlmexp.cli", "train", "grpo", "--config",
                           "configs/demo.yaml", "--mlflow-run-id", run_id, f"run.output_dir={out}",
                           f"tracking.tracking_uri={uri}", *GRPO],
                          capture_output=True, text=True, cwd=REPO, env=env)


def _resumed_from(run: subprocess.CompletedProcess) -> int:
    return int(run.stderr.split("(resume: ")[1].split(")")[0].rsplit("-", 1)[1])


def test_grpo_faults_resume_from_the_newest_complete_checkpoint(tmp_path):
    """A kill between checkpoints, a kill while a checkpoint is half written, a full disk while writing one:
    after each, the same command resumes from the newest complete checkpoint (a resumed run crashed by the
    next fault), recomputing at most save_steps steps; the last run finishes with each step in MLflow once."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("faults")).info.run_id
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "faults"), str(REPO / "tests"),
                                                        str(REPO)])}
    grpo = tmp_path / "grpo"

    resumed_from = None  # the first run starts from the start
    for fault, crash, newest in FAULTS:
        run = _train(tmp_path, {**env, "VLMEXP_FAULT": fault}, uri, run_id)
        assert run.returncode == crash, (fault, run.stderr[-3000:])
        if resumed_from is not None:
            assert _resumed_from(run) == resumed_from, (fault, run.stderr[-3000:])
        if crash == 1:
            assert "No space left on device (planted)" in run.stderr
        step = int(fault.split(":")[1])
        assert not (grpo / "final").exists()
        if "save" in fault:  # the half-written checkpoint is there but has no trainer_state.json
            assert ((grpo / f"checkpoint-{step}").is_dir()
                    and not (grpo / f"checkpoint-{step}" / "trainer_state.json").exists()), fault
        assert (grpo / f"checkpoint-{newest}" / "trainer_state.json").is_file(), fault
        assert step - newest <= SAVE_STEPS  # at most save_steps steps recomputed
        resumed_from = newest

    last = _train(tmp_path, env, uri, run_id)
    assert last.returncode == 0, last.stderr[-3000:]
    assert _resumed_from(last) == resumed_from, last.stderr[-3000:]
    state = json.loads((grpo / f"checkpoint-{MAX_STEPS}" / "trainer_state.json").read_text())
    assert state["global_step"] == MAX_STEPS and (grpo / "final" / "model.safetensors").is_file()

    for key in ("loss", "reward", "rewards/rewards_for_tests:char_variety/mean"):
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        assert steps == list(range(1, MAX_STEPS + 1)), (key, steps)


def test_killed_pipeline_reruns_without_redoing_finished_stages(tmp_path, prefect_home, run_inputs):
    """SIGKILL the whole `vlmexp run` process group (flow, temporary server, training) during GRPO; the same
    command then finishes: SFT comes from the cache, GRPO resumes from its checkpoint."""
    import time

    import psutil

    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests"),
           "PREFECT_LOCAL_STORAGE_PATH": str(prefect_home / "storage")}
    command = [sys.executable, "-m", "vlmexp.cli", "run", "configs/demo.yaml", f"run.output_dir={out}",
               "data.demo.train=16", "data.demo.val=4", "sft.args.max_steps=4", "sft.args.save_steps=4",
               "grpo.args.max_steps=10", "grpo.args.save_steps=2", "grpo.args.per_device_train_batch_size=4",
               "grpo.args.num_generations=4", "grpo.args.max_completion_length=8", "eval.enabled=false",
               "grpo.rewards=[{name: 'rewards_for_tests:char_variety'}]", *SMALL_BATCHES, *run_inputs(out)]
    first_log = tmp_path / "first.log"
    first = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                             stderr=first_log.open("w"), start_new_session=True)
    deadline = time.monotonic() + 600  # a shared 2-core machine under load
    while not (out / "grpo" / "checkpoint-2" / "trainer_state.json").is_file():
        assert first.poll() is None and time.monotonic() < deadline, \
            f"GRPO never wrote checkpoint-2 (exit {first.poll()}):\n{first_log.read_text()[-3000:]}"
        time.sleep(0.5)
    # Prefect's temporary server and the stage run in sessions of their own (a terminal's Ctrl-C reaches only
    # `vlmexp run`, which records the stop and passes it on): the group's SIGKILL misses them, and they still
    # go with the run
    tied = psutil.Process(first.pid).children()
    assert sorted("uvicorn" in " ".join(p.cmdline()) for p in tied) == [False, True], [
        p.cmdline() for p in tied]
    tied += [p for p in tied[0].children(recursive=True) + tied[1].children(recursive=True)]
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    _, alive = psutil.wait_procs(tied, timeout=15)
    for p in alive:
        p.kill()
    assert not alive, f"outlived the killed run: {[p.cmdline() for p in alive]}"
    assert not (out / "grpo" / "final").exists()

    second = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    log = second.stdout + second.stderr
    assert "| sft | skipped: inputs unchanged" in log  # finished before the kill: not redone
    assert "(resume: " in log and "/grpo/checkpoint-" in log.split("(resume: ")[1].split(")")[0]
    assert ((out / "grpo" / "final" / "model.safetensors").is_file()
            and (out / "export" / "manifest.json").is_file())


def _step_seconds(history, start: float, end: float) -> list[float]:
    """The time each step took (its log's timestamp minus the previous step's) for the steps logged between
    `start` and `end` (epoch seconds)."""
    points = sorted((m.step, m.timestamp / 1000) for m in history)
    return [t - before for (_, before), (_, t) in zip(points, points[1:], strict=False) if start <= before and
            t <= end]


def test_an_mlflow_outage_longer_than_its_retries_neither_slows_grpo_nor_loses_a_metric(tmp_path):
    """A real MLflow server, SIGKILLed once GRPO has written checkpoint-4 and started again on the same
    port and store once checkpoint-12 is written and at least 12 s have passed, six times the client's retry
    budget (about 2 s here): the steps during the outage take about as long as those before it, the stage
    ends 0, and afterwards every step of every metric, the completion tables and validation images logged
    during the outage, and the system metric samples are in the run, each once and in order."""
    import statistics
    import time

    from mlflow.tracking import MlflowClient
    from mlflow_server import free_port, kill_server, start_server

    from vlmexp.tracking.tracker import MlflowTracker

    def wait_for(step: int) -> None:
        while not (tmp_path / "grpo" / f"checkpoint-{step}" / "trainer_state.json").is_file():
            assert train.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)

    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = start_server(tmp_path, port)
    try:
        tracker = MlflowTracker(uri, "faults", (tmp_path / "artifacts").as_uri())
        run_id = tracker.start_pipeline("stage", {}, {})
        log = tmp_path / "train.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]),
               "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "2"}  # a retry budget of about 2 s
        train = subprocess.Popen([sys.executable, "-m", "vlmexp.cli", "train", "grpo", "--config",
                                  "configs/demo.yaml", "--mlflow-run-id", run_id,
                                  f"tracking.tracking_uri={uri}", f"run.output_dir={tmp_path}", *GRPO[:3],
                                  f"grpo.args.max_steps={OUTAGE_STEPS}", "grpo.args.save_steps=4", *GRPO[5:],
                                  "tracking.completions_every=3", "tracking.system_metrics_seconds=0.5",
                                  "eval.every_steps=10", "eval.during_training_samples=2",
                                  "eval.during_training_pictures=1", "eval.max_new_tokens=8"],
                                 cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log.open("w"))
        wait_for(4)
    finally:
        kill_server(server)
    down = time.time()
    try:
        wait_for(12)
        time.sleep(max(0.0, down + 12 - time.time()))
        back = time.time()  # the server's start (seconds of CPU) is not counted as outage
        server = start_server(tmp_path, port)
        train.wait(timeout=600)
        stderr = log.read_text()
        assert train.returncode == 0, stderr[-3000:]
        assert "MLflow store does not answer" in stderr and "MLflow answers again" in stderr, stderr[-3000:]
        client = MlflowClient(uri)
        loss = client.get_metric_history(run_id, "loss")
        before, during = _step_seconds(loss, 0, down), _step_seconds(loss, down, back)
        assert len(during) >= 6 and len(before) >= 2, (before, during)
        assert statistics.median(during) <= 2 * statistics.median(before), (before, during)
        for key in ("loss", "reward", "Summary/reward", "rewards/rewards_for_tests:char_variety/mean"):
            steps = [m.step for m in client.get_metric_history(run_id, key)]
            assert steps == list(range(1, OUTAGE_STEPS + 1)), (key, steps)
        system = [m.step for m in client.get_metric_history(run_id, "system/cpu_utilization_percentage")]
        assert system == list(range(len(system))) and len(system) > (back - down) / 0.5 / 2, system
        in_outage = [m.step for m in loss if down <= m.timestamp / 1000 <= back]
        tables = {a.path for a in client.list_artifacts(run_id, "completions")}
        assert {f"completions/step_{s:06d}.json" for s in in_outage if s % 3 == 0} <= tables, (
            in_outage, tables)
        images = [a.path for a in client.list_artifacts(run_id, "images") if a.path.endswith(".png")]
        assert sorted(int(p.split("+")[2]) for p in images) == [10, 20], images
        assert client.get_run(run_id).info.status == "FINISHED"
        assert not list((tmp_path / "grpo" / "mlflow_spool" / run_id / "files").iterdir())  # all sent
    finally:
        train.kill()
        kill_server(server)


def test_a_resume_skips_the_training_steps_in_mlflow_not_the_system_metric_samples(tmp_path):
    """MLflow's system metrics count their samples in `step`: a slow run's count passes its training steps,
    and taking it for the last logged step would leave the resumed steps unlogged."""
    from mlflow.tracking import MlflowClient

    from vlmexp.tracking.stage_run import last_logged_step

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("faults")).info.run_id
    for step in range(1, 4):
        client.log_metric(run_id, "loss", 1.0 / step, step=step)
    for sample in range(30):
        client.log_metric(run_id, "system/cpu_utilization_percentage", 50.0, step=sample)
    assert last_logged_step(uri, run_id) == 3
