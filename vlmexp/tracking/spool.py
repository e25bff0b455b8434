"""A stage run's MLflow writes on disk before they are sent: training never waits for the tracking server and
loses nothing while it is away.

Every write of a stage process (`vlmexp.tracking.stage_run.MlflowStageRun`) is appended to
`<stage folder>/mlflow_spool/<run id>/records.jsonl`, one JSON line each, in the order it was made, with its
timestamp; images, tables and artifact files are copied beside it (`files/`) first. A background thread
(`Sender`) sends the lines in that order (consecutive metric lines in batches of up to 1,000 points through
`MlflowClient.log_batch`) and records in `sent.json`, after each batch, how far it got. While the server does
not answer it tries again every few seconds; the training loop only appends lines. What is still unsent when
the process ends stays on disk and is sent, first and in order, by the next process that opens the same stage
folder (a resume or a task's retry), or by the pipeline's step after the stage (`send_spooled`).

Each point is sent once: a line is marked sent only after the store took it, and one sent again after a crash
between the two is taken once all the same (the store keeps one row per key, step, timestamp and value;
tables and images are looked for before they are sent again).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("vlmexp.tracking")

SPOOL_DIR = "mlflow_spool"
RECORDS, SENT, STORE = "records.jsonl", "sent.json", "store.json"
BATCH = 1000  # MLflow's most metrics in one log_batch
RETRY_SECONDS = (1, 2, 4, 8)  # waits between tries while the store does not answer, the last repeated


def now_ms() -> int:
    return int(time.time() * 1000)


class Spool:
    """One run's spool folder: the writer's side (the training loop) appends records and files."""

    def __init__(self, folder: Path, uri: str):
        self.folder = folder
        (folder / "files").mkdir(parents=True, exist_ok=True)
        store = folder / STORE
        if not store.is_file():
            store.write_text(json.dumps({"uri": uri}) + "\n")
        records = folder / RECORDS
        if records.is_file():  # a process killed mid-write may have left half a line: it never happened
            data = records.read_bytes()
            if data and not data.endswith(b"\n"):
                os.truncate(records, data.rfind(b"\n") + 1)
        self.fd = os.open(records, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.lock = threading.Lock()

    def append(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, default=plain) + "\n").encode()
        with self.lock:
            os.write(self.fd, line)  # one write of a whole line on an O_APPEND file

    def new_file(self, name: str) -> Path:
        """A fresh path files/<random>/`name` for a copy that a record points to (the name is kept: MLflow
        uploads a file under its own name)."""
        folder = self.folder / "files" / uuid.uuid4().hex[:12]
        folder.mkdir(parents=True)  # files/ itself again, if another process's `clear` has just removed it
        return folder / name

    def close(self) -> None:
        os.close(self.fd)


def plain(value: Any) -> Any:
    """JSON for numpy and torch scalars and arrays, paths, anything else as its text."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    return str(value)


class Sender:
    """The thread that sends every run folder under a spool folder, oldest records first, trying again every
    few seconds while the store does not answer; `finish` gives it a bounded time to send the rest."""

    def __init__(self, spool_dir: Path):
        self.spool_dir = spool_dir
        # wake: a record was appended (heeded while the store answers); stopping: `finish` was called;
        # abandoned: `finish` waited long enough
        self.wake, self.stopping, self.abandoned = threading.Event(), threading.Event(), threading.Event()
        self.deadline = float("inf")
        self.senders: dict[Path, RunSender] = {}
        # what the thread imports, imported here first: two threads importing mlflow at once can each find
        # the other's half-initialised modules (ImportError "partially initialized module 'mlflow.tracking'")
        import mlflow.entities  # noqa: F401
        import mlflow.tracking  # noqa: F401
        import pandas  # noqa: F401
        import PIL.Image  # noqa: F401

        import vlmexp.tracking.logged_models  # noqa: F401

        self.thread = threading.Thread(target=self.loop, name="vlmexp-mlflow-sender", daemon=True)
        self.thread.start()

    def loop(self) -> None:
        failures = 0
        while not self.abandoned.is_set():
            self.wake.clear()
            last = self.stopping.is_set()  # set after the last record: this pass sees every record
            try:
                for folder in run_folders(self.spool_dir):
                    self.senders.setdefault(folder, RunSender(folder)).send_all()
            except Exception as e:  # noqa: BLE001 - a store that does not answer: kept on disk, tried again
                if not failures:
                    log.warning("MLflow store does not answer (%s); training goes on, its records wait in %s "
                                "and are sent when it answers", short(e), self.spool_dir)
                failures += 1
                delay = RETRY_SECONDS[min(failures, len(RETRY_SECONDS)) - 1]
                if self.stopping.is_set():
                    if time.monotonic() >= self.deadline:
                        return
                    delay = min(delay, self.deadline - time.monotonic())
                self.abandoned.wait(delay)  # new records do not hurry a try while the store is away
                continue
            if failures:
                log.info("MLflow answers again: the records kept while it did not are sent")
            failures = 0
            if last:
                return
            self.wake.wait(1)

    def poke(self) -> None:
        """A record was appended: send it now (while the store answers)."""
        self.wake.set()

    def finish(self, seconds: float) -> int:
        """Send what is left, waiting at most `seconds`; the number of records still unsent (none: the spool
        is emptied)."""
        self.deadline = time.monotonic() + seconds
        self.stopping.set()
        self.wake.set()
        self.thread.join(seconds + 0.5)
        self.abandoned.set()
        left = sum(RunSender(folder).pending_count() for folder in run_folders(self.spool_dir))
        if not left and not self.thread.is_alive():
            for folder in run_folders(self.spool_dir):
                RunSender(folder).clear()
        return left


def run_folders(spool_dir: Path) -> list[Path]:
    """The run folders under `spool_dir`, the one written longest ago first."""
    if not spool_dir.is_dir():
        return []
    found = [p for p in spool_dir.iterdir() if (p / STORE).is_file()]
    return sorted(found, key=lambda p: (p / STORE).stat().st_mtime)


def short(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:300]


def permanent(e: BaseException) -> bool:
    """Whether the store refused the request itself (a 4xx: a param changed, a bad name), so that sending it
    again cannot help, rather than not answering."""
    from mlflow.exceptions import MlflowException

    return isinstance(e, MlflowException) and 400 <= e.get_http_status_code() < 500


class RunSender:
    """The reader's side of one run folder: sends its unsent records in order."""

    def __init__(self, folder: Path):
        self.folder, self.run_id = folder, folder.name
        self.state = json.loads((folder / SENT).read_text()) if (folder / SENT).is_file() else {"offset": 0}
        self._client = None

    @property
    def client(self):
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(json.loads((self.folder / STORE).read_text())["uri"])
        return self._client

    def pending(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """(offset after the line, record) of each whole unsent line."""
        path = self.folder / RECORDS
        if not path.is_file():
            return
        with path.open("rb") as f:
            f.seek(self.state["offset"])
            for line in f:
                if not line.endswith(b"\n"):
                    return  # being written
                yield f.tell(), json.loads(line)

    def pending_count(self) -> int:
        return sum(1 for _ in self.pending())

    def mark(self, offset: int) -> None:
        from vlmexp.files import atomic_write

        self.state["offset"] = offset
        atomic_write(self.folder / SENT, json.dumps(self.state) + "\n")

    def send_all(self) -> None:
        """Send every unsent record in order, marking each as sent once the store took it; raises when the
        store does not answer."""
        batch: list[dict[str, Any]] = []
        points, end = 0, 0
        for offset, record in self.pending():
            if record["t"] == "metrics":
                if batch and points + len(record["m"]) > BATCH:
                    self.send_metrics(batch, end)
                    batch, points = [], 0
                batch.append(record)
                points, end = points + len(record["m"]), offset
                continue
            if batch:
                self.send_metrics(batch, end)
                batch, points = [], 0
            self.send_one(record)
            self.mark(offset)
        if batch:
            self.send_metrics(batch, end)

    def send_metrics(self, records: list[dict[str, Any]], end: int) -> None:
        from mlflow.entities import Metric

        if not records:
            return
        points = [Metric(k, float(v), r["ts"], r["step"]) for r in records for k, v in r["m"].items()]
        self.guard(lambda: self.client.log_batch(self.run_id, metrics=points), f"{len(points)} metric points")
        self.mark(end)

    def send_one(self, record: dict[str, Any]) -> None:
        kind = record["t"]
        send = getattr(self, f"send_{kind}")
        self.guard(lambda: send(record), kind)

    def guard(self, send, what: str) -> None:
        try:
            send()
        except Exception as e:
            if not permanent(e):
                raise
            log.warning("MLflow refused the stage's %s for run %s (%s); left out", what, self.run_id,
                        short(e))

    def send_open(self, record: dict[str, Any]) -> None:
        self.client.update_run(self.run_id, status="RUNNING", name=record.get("name"))

    def send_end(self, record: dict[str, Any]) -> None:
        self.client.set_terminated(self.run_id, record["status"], end_time=record["ts"])

    def send_params(self, record: dict[str, Any]) -> None:
        """Params the run does not hold yet (a resumed stage logs the same ones again; a value MLflow holds
        already cannot change, as with transformers' MLflowCallback)."""
        from mlflow.entities import Param

        held = self.client.get_run(self.run_id).data.params
        changed = sorted(k for k, v in record["p"].items() if k in held and held[k] != v)
        if changed:
            log.warning("params %s keep the values run %s already holds", ", ".join(changed[:10]),
                        self.run_id)
        items = [Param(k, v) for k, v in record["p"].items() if k not in held]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def send_artifact(self, record: dict[str, Any]) -> None:
        self.client.log_artifact(self.run_id, str(self.folder / record["file"]), record.get("path"))

    def send_table(self, record: dict[str, Any]) -> None:
        import pandas as pd
        from PIL import Image

        if self.already_there(record["artifact_file"]):
            return
        table = json.loads((self.folder / record["file"]).read_text())
        for column in record["images"]:
            table[column] = [Image.open(self.folder / name) for name in table[column]]
        self.client.log_table(self.run_id, pd.DataFrame(table), record["artifact_file"])

    def send_image(self, record: dict[str, Any]) -> None:
        from PIL import Image

        name = f"images/{record['key'].replace('/', '~')}+step+{record['step']}+timestamp+{record['ts']}+"
        if self.already_there(name):
            return
        with Image.open(self.folder / record["file"]) as image:
            self.client.log_image(self.run_id, image.copy(), key=record["key"], step=record["step"],
                                  timestamp=record["ts"], synchronous=True)

    def already_there(self, name: str) -> bool:
        """Whether the run's artifacts hold a file whose path starts with `name` (sent before a crash)."""
        folder = os.path.dirname(name) or None
        return any(f.path.startswith(name) for f in self.client.list_artifacts(self.run_id, folder))

    def send_model(self, record: dict[str, Any]) -> None:
        from vlmexp.tracking.logged_models import forget_rotated_checkpoints, log_folder_model

        experiment = self.client.get_run(self.run_id).info.experiment_id
        log_folder_model(self.client, experiment, self.run_id, record["folder"], record["type"],
                         record["step"], record["keys"])
        if record["type"] == "checkpoint":  # the Trainer rotates old checkpoints away before on_save
            gone = forget_rotated_checkpoints(self.client, experiment, self.run_id)
            if gone:
                log.info("step %d: removed the MLflow models of rotated-away %s", record["step"],
                         ", ".join(gone))

    def last_step(self, system: bool = False) -> int:
        """The highest step of the training metrics (`system`: of the system metric samples) this run's
        spool ever held; -1 when none."""
        name = "last_system_step" if system else "last_step"
        steps = [r["step"] for _, r in self.records()
                 if r["t"] == "metrics" and r.get("system", False) == system]
        return max([self.state.get(name, -1), *steps])

    def records(self) -> Iterator[tuple[int, dict[str, Any]]]:
        offset, self.state["offset"] = self.state["offset"], 0
        try:
            yield from self.pending()
        finally:
            self.state["offset"] = offset

    def clear(self) -> None:
        """All sent: the records and their files go, the offset with them; the last step stays."""
        self.state["last_step"], self.state["last_system_step"] = self.last_step(), self.last_step(True)
        self.mark(0)  # first: a crash before the records go sends them again, which the store takes once
        (self.folder / RECORDS).unlink(missing_ok=True)
        shutil.rmtree(self.folder / "files", ignore_errors=True)
        # another process ending on the same run folder may have emptied and made it again in between
        (self.folder / "files").mkdir(exist_ok=True)


def send_spooled(stage_dir: Path, seconds: float = 60) -> None:
    """Send what a stage process left unsent in `stage_dir` (its store did not answer before it ended); raise
    ConnectionError, saying what waits where, when the store still does not answer after `seconds`."""
    spool_dir = stage_dir / SPOOL_DIR
    if not any(RunSender(f).pending_count() for f in run_folders(spool_dir)):
        return
    left = Sender(spool_dir).finish(seconds)
    if left:
        raise ConnectionError(f"the MLflow store did not take {left} records the stage kept in {spool_dir} "
                              f"within {seconds:.0f} s; they are sent when it answers (a retry sends them)")
