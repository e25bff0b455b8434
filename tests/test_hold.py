"""One run per output folder: a holder process really holds the folder (its file, its heartbeat thread); a
second run is refused at once naming it, or waits for it; a holder killed, or whose machine stopped beating,
is taken over with a warning; only the owner removes its file; a stage the pipeline starts checks it runs in
its pipeline's hold. The pipeline's own runs (two `vlmexp run`s on one folder) are in tests/test_faults.py."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vlmexp.pipeline import hold
from vlmexp.pipeline.hold import HOLD_NAME, FolderBusy, acquire, holding, read_holder

REPO = Path(__file__).resolve().parents[1]
HOLDER = """
import sys, time
from vlmexp.pipeline.hold import holding
with holding(sys.argv[1], "test holder", sys.argv[2]):
    print("held", flush=True)
    time.sleep(float(sys.argv[3]))
"""


def _holder(folder: Path, run_id: str, seconds: float) -> subprocess.Popen:
    """A process of its own that holds `folder` as `run_id` for `seconds`, once it has said so."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), run_id, str(seconds)], cwd=REPO,
                         stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_held_folder_refuses_waits_and_is_taken_over_when_its_holder_dies(tmp_path, caplog, monkeypatch,
                                                                             vlmexp_main):
    folder = tmp_path / "out"
    first = _holder(folder, "run-a", 60)
    try:
        holder = read_holder(folder)
        assert (holder.run_id, holder.pid, holder.host) == ("run-a", first.pid, socket.gethostname())
        # refused at once, naming the holder and the fix: the library, and `vlmexp train` by hand
        start = time.monotonic()
        with pytest.raises(FolderBusy, match=f"held by test holder run-a \\(process {first.pid} on "
                                             f"{socket.gethostname()}, started .*run.on_busy=wait"):
            acquire(folder, "second")
        assert time.monotonic() - start < 2
        rc, _, err = vlmexp_main("train", "grpo", "--config", "configs/demo.yaml", f"run.output_dir={folder}")
        assert rc == 2 and f"held by test holder run-a (process {first.pid}" in err, err
        # waiting, up to a limit
        with pytest.raises(FolderBusy, match="still held by test holder run-a .* after waiting 1 s"):
            acquire(folder, "second", on_busy="wait", wait_seconds=1)
        # the heartbeat thread renews the file while the holder lives
        monkeypatch.setattr(hold, "HEARTBEAT_SECONDS", 0.2)
        beat = read_holder(folder).heartbeat
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # killed: its file is still there, its process gone; taken over with a warning, the old file kept aside
    with caplog.at_level(logging.WARNING, logger="vlmexp.hold"):
        with holding(folder, "second", "run-b") as second:
            assert read_holder(folder).run_id == "run-b" and second.run_id == "run-b"
            time.sleep(0.5)
            assert read_holder(folder).heartbeat > read_holder(folder).started  # renewed
    assert f"held by test holder run-a (process {first.pid}" in caplog.text
    assert f"its process {first.pid} is gone: taking it over" in caplog.text
    assert json.loads((folder / f"{HOLD_NAME}.stale-run-a").read_text())["heartbeat"] >= beat
    assert not (folder / HOLD_NAME).exists()  # released when the block ended

    # a waiting run gets the folder once its holder ends
    ending = _holder(folder, "run-c", 1.5)
    start = time.monotonic()
    with holding(folder, "waiter", "run-d", on_busy="wait", wait_seconds=60):
        assert time.monotonic() - start > 0.5 and read_holder(folder).run_id == "run-d"
    assert ending.wait(10) == 0


def test_another_machines_holder_is_stale_only_when_its_heartbeat_stopped(tmp_path, caplog):
    folder = tmp_path / "shared"
    folder.mkdir()
    now = time.time()
    other = {"host": "gpu-node-7", "pid": 1, "run_id": "run-x", "what": "vlm-pipeline flow run",
             "started": now - 600, "heartbeat": now - 2}
    (folder / HOLD_NAME).write_text(json.dumps(other))
    with pytest.raises(FolderBusy, match="held by vlm-pipeline flow run run-x \\(process 1 on gpu-node-7"):
        acquire(folder, "here")
    (folder / HOLD_NAME).write_text(json.dumps({**other, "heartbeat": now - 120}))
    with caplog.at_level(logging.WARNING, logger="vlmexp.hold"), holding(folder, "here", "run-y"):
        assert read_holder(folder).run_id == "run-y"
    assert "its heartbeat stopped 12" in caplog.text and "taking it over" in caplog.text


def test_only_the_owner_removes_its_hold_and_a_pipeline_stage_checks_its_pipelines_hold(tmp_path,
                                                                                         vlmexp_main):
    from vlmexp.pipeline.keys import resolve_config

    folder = tmp_path / "out"
    mine = acquire(folder, "mine", "run-a")
    taken = {**json.loads((folder / HOLD_NAME).read_text()), "run_id": "run-b"}
    (folder / HOLD_NAME).write_text(json.dumps(taken))  # another run took it over meanwhile
    mine.release()
    assert read_holder(folder).run_id == "run-b"
    # a stage started inside run-a's hold refuses to run in a folder run-b holds
    rc, _, err = vlmexp_main("train", "grpo", "--config", "configs/demo.yaml", f"run.output_dir={folder}",
                             "--held-by", "run-a")
    assert rc == 2 and "this stage runs inside the hold of run run-a, but the folder is held by" in err, err
    # each run's pending config is its own
    _, one = resolve_config(str(REPO / "configs/demo.yaml"), [f"run.output_dir={folder}"], "run-a")
    _, two = resolve_config(str(REPO / "configs/demo.yaml"), [f"run.output_dir={folder}"], "run-b")
    assert one != two and one.is_file() and two.is_file()


FILLED = """
import logging, sys, time
from pathlib import Path
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from sqlalchemy.exc import SQLAlchemyError
from vlmexp.disk import DiskFull, said_as_disk_full
from vlmexp.pipeline.hold import holding

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
folder = Path(sys.argv[1])
client = MlflowClient(f"sqlite:///{folder}/mlflow.db")  # MLflow's store on the run's disk
run_id = client.create_run(client.create_experiment("e")).info.run_id
try:
    with said_as_disk_full(folder), holding(folder, "vlmexp train grpo"):
        print("filling", file=sys.stderr, flush=True)
        with open(folder / "filler", "wb") as f:  # the disk fills
            try:
                while True:
                    f.write(bytes(1 << 16))
                    f.flush()
            except OSError:
                pass
        try:
            client.log_metric(run_id, "loss", 1.0, step=1)
        except (MlflowException, SQLAlchemyError, OSError):  # the store's ways of saying the disk is full
            print("store refused", flush=True)
        time.sleep(6)  # a heartbeat of the hold (hold.HEARTBEAT_SECONDS) meets the full disk
        (folder / "checkpoint-2.bin").write_bytes(bytes(1 << 20))  # the save
except DiskFull as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
"""


def test_a_full_disk_is_said_first_then_the_rest_once_briefly(tmp_path):
    """A real small disk that fills while a stage holds its folder and logs to an sqlite MLflow store on it:
    the first thing on stderr is the clear message naming the folder, the file and the room left; the hold's
    renewal and MLflow's SQLAlchemy error follow once each, one line and no traceback; the stage's error is
    said last."""
    from test_faults import small_disk

    with small_disk(tmp_path / "disk", 4) as disk:
        done = subprocess.run([sys.executable, "-c", FILLED, str(disk)], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert done.returncode == 1 and "store refused" in done.stdout, done.stderr[-3000:]
    said = done.stderr.partition("filling\n")[2]
    lines = [line for line in said.splitlines() if line.strip()]
    first = lines[0]  # MLflow's store or the hold meets the full disk first
    assert any(f"{name}: the disk holding {disk} is full: writing " in first
               for name in ("mlflow.store.db.utils", "vlmexp.hold")), lines
    assert " free there. Free space on that disk" in first, first
    save = disk / "checkpoint-2.bin"
    assert lines[-1].startswith(f"error: the disk holding {disk} is full: writing {save}"), lines
    assert "Traceback" not in done.stderr and "[SQL:" not in done.stderr, done.stderr[-3000:]
    assert sum("could not renew the hold" in line for line in lines) == 0, lines  # said as a full disk
    assert sum(line.startswith("ERROR vlmexp.hold") for line in lines) <= 1
    assert sum("mlflow.store.db.utils" in line for line in lines) <= 1, lines
