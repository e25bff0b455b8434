"""The stage run's spool (vlmexp.tracking.spool) against a real `mlflow server`: a stage process killed with
SIGKILL while the server is down loses nothing it logged, and what it kept is sent once, in order, by the
next process that opens the same run (a resume); a record sent again after a crash between sending and
marking it sent is taken once; the end of a run sends every record logged before it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# One stage process: opens the run, logs steps FIRST..LAST (a table, an image and a file at LAST), then either
# dies by SIGKILL (as a lost node) or ends the run FINISHED.
STAGE = """
import os, signal, sys
from pathlib import Path
from PIL import Image
from vlmexp.tracking.stage_run import MlflowStageRun

uri, run_id, stage_dir, first, last, end = sys.argv[1:]
first, last = int(first), int(last)
run = MlflowStageRun(uri, run_id, Path(stage_dir), "spool-grpo")
if run.last_logged_step() != first - 1:
    sys.exit(f"last logged step {run.last_logged_step()}, expected {first - 1}")
run.log_params({"learning_rate": "0.1"})
for step in range(first, last + 1):
    run.log_metrics({"loss": 1.0 / step, "reward(mean)": step / 10}, step)
picture = Image.new("RGB", (16, 8), (0, 200, 0))
run.log_table({"step": [last, last], "completion": ["a", "b"], "image": [picture, picture]},
              f"completions/step_{last:06d}.json")
run.log_image(picture, key="validation/record_00", step=last)
(Path(stage_dir) / f"difficulty-{last}.json").write_text("{}")
run.log_artifact(Path(stage_dir) / f"difficulty-{last}.json", "difficulty")
if end == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
run.close("FINISHED")
"""


def _stage(uri: str, run_id: str, stage_dir: Path, first: int, last: int, end: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
           "MLFLOW_HTTP_REQUEST_TIMEOUT": "2"}
    command = [sys.executable, "-c", STAGE, uri, run_id, str(stage_dir), str(first), str(last), end]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert done.returncode == (-9 if end == "kill" else 0), done.stderr[-3000:]


def _rows(client, run_id: str, table: str, dest: Path) -> int:
    """The rows of an MLflow table artifact (json, pandas' "split" layout)."""
    return len(json.loads(Path(client.download_artifacts(run_id, table, str(dest))).read_text())["data"])


def test_a_stage_killed_during_an_outage_sends_its_spool_once_when_resumed(tmp_path):
    from mlflow.tracking import MlflowClient
    from mlflow_server import free_port, kill_server, start_server

    from vlmexp.tracking.spool import RunSender

    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    stage_dir = tmp_path / "grpo"
    server = start_server(tmp_path, port)
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("spool", str(tmp_path / "artifacts"))).info.run_id
    kill_server(server)  # the outage: the first process logs steps 1-5 and is killed before it ends
    _stage(uri, run_id, stage_dir, 1, 5, "kill")
    folder = stage_dir / "mlflow_spool" / run_id
    assert RunSender(folder).pending_count() == 10  # open, params, 5 steps, table, image, file: all kept

    server = start_server(tmp_path, port)
    try:
        _stage(uri, run_id, stage_dir, 6, 8, "close")  # the resume: sends 1-5 first, then its own 6-8
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED" and run.info.run_name == "spool-grpo"
        assert run.data.params == {"learning_rate": "0.1"}
        for key, value in (("loss", lambda s: 1.0 / s), ("reward_mean_", lambda s: s / 10)):
            history = client.get_metric_history(run_id, key)
            assert [(m.step, m.value) for m in history] == [(s, value(s)) for s in range(1, 9)], key
            assert [m.timestamp for m in history] == sorted(m.timestamp for m in history)
        tables = sorted(a.path for a in client.list_artifacts(run_id, "completions"))
        assert tables == ["completions/step_000005.json", "completions/step_000008.json"]
        assert _rows(client, run_id, "completions/step_000005.json", tmp_path / "dl") == 2
        images = sorted(a.path.split("+")[2] for a in client.list_artifacts(run_id, "images"))
        assert images == ["5", "5", "8", "8"]  # each step's png and its compressed webp
        assert sorted(a.path for a in client.list_artifacts(run_id, "difficulty")) == [
            "difficulty/difficulty-5.json", "difficulty/difficulty-8.json"]
        assert RunSender(folder).pending_count() == 0 and not list((folder / "files").iterdir())

        # A crash between sending records and marking them sent: the next process sends them again
        sent = json.loads((folder / "sent.json").read_text())
        _stage(uri, run_id, stage_dir, 9, 9, "kill")
        while RunSender(folder).pending_count():  # the killed process's sender may have sent some already
            RunSender(folder).send_all()
        RunSender(folder).mark(sent["offset"])  # as if none had been marked
        RunSender(folder).send_all()
        assert [m.step for m in client.get_metric_history(run_id, "loss")] == list(range(1, 10))
        assert _rows(client, run_id, "completions/step_000009.json", tmp_path / "dl") == 2
        assert sorted(a.path.split("+")[2] for a in client.list_artifacts(run_id, "images")).count("9") == 2
        assert [a.path for a in client.list_artifacts(run_id, "difficulty")].count(
            "difficulty/difficulty-9.json") == 1
    finally:
        kill_server(server)


def test_close_sends_every_record_logged_just_before_it(tmp_path):
    """The sender's last pass starts after the run's last record (its end): whatever was appended while it
    was sending is sent too. Five runs against a sqlite store, each logging 20 steps then closing at once."""
    from mlflow.tracking import MlflowClient

    from vlmexp.tracking.stage_run import MlflowStageRun

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("close", str(tmp_path / "artifacts"))
    for attempt in range(5):
        run_id = client.create_run(experiment).info.run_id
        run = MlflowStageRun(uri, run_id, tmp_path / f"stage{attempt}", "close")
        for step in range(1, 21):
            run.log_metrics({f"k{i}": step for i in range(40)}, step)
        run.close("FINISHED")
        assert [m.step for m in client.get_metric_history(run_id, "k39")] == list(range(1, 21)), attempt
        assert client.get_run(run_id).info.status == "FINISHED"


def test_clearing_a_run_folder_another_process_clears_at_once_does_not_fail(tmp_path, monkeypatch):
    """Two processes ending on one run folder each empty it (their records all sent): the second's
    `files/` made again between the first's removal and its own is no error, and a file spooled after
    that finds its folder."""
    import shutil

    from vlmexp.tracking import spool as spool_module
    from vlmexp.tracking.spool import RunSender, Spool

    folder = tmp_path / "mlflow_spool" / "run"
    writer = Spool(folder, "sqlite:///x.db")
    writer.new_file("a.png").write_bytes(b"x")
    rmtree = shutil.rmtree

    def the_other_process_clears_first(path, ignore_errors=False):
        rmtree(path, ignore_errors=ignore_errors)
        (folder / "files").mkdir()  # the other process's `clear`, between this one's two steps

    monkeypatch.setattr(spool_module.shutil, "rmtree", the_other_process_clears_first)
    RunSender(folder).clear()
    assert (folder / "files").is_dir() and not any((folder / "files").iterdir())
    monkeypatch.setattr(spool_module.shutil, "rmtree", rmtree)
    shutil.rmtree(folder / "files")  # and a clear that removed files/ just before the writer spools a file
    writer.new_file("b.png").write_bytes(b"y")
    writer.close()
