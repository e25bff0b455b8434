"""The stage process's one logger: the MLflow run a training stage logs into (the pipeline's child run, or a
run of its own when started by hand), through which every module of the stage process logs its metrics,
params, artifacts, tables, images and models, closed when training ends. Tracking off (`tracking.backend:
none`) and every process but global rank 0 get a `NullStageRun`, which logs nothing; nothing else in the
stage process imports mlflow.

The MLflow run never makes training wait: each write is a record on disk, sent by a background thread
(`vlmexp.tracking.spool`), so a tracking server that is away for any length of time costs neither a step's
time nor a metric."""

from __future__ import annotations

import atexit
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from vlmexp.config.schema import Config
from vlmexp.errors import ConfigError, Problem
from vlmexp.provenance import run_tags
from vlmexp.tracking.spool import SPOOL_DIR, RunSender, Sender, Spool, now_ms, short
from vlmexp.tracking.tracker import make_tracker, sanitize_metric_name, store_uri

log = logging.getLogger("vlmexp.tracking")

# How long the end of a stage waits for its records to reach a store that does not answer: a finished
# stage (its next step needs the run), a stopped or failed one (a stop must end within 15 s). What is left is
# sent by the next start of the stage or the pipeline's next step.
CLOSE_SECONDS = {"FINISHED": 30.0, "FAILED": 5.0, "KILLED": 5.0}


class StageRun(ABC):
    """What a stage process logs, wherever it logs it. `enabled` says whether anything is recorded."""

    enabled: bool
    uri: str
    run_id: str

    @abstractmethod
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Scalars at a training step (0 when None)."""

    @abstractmethod
    def log_params(self, params: Mapping[str, Any]) -> None:
        """The run's params (values as strings)."""

    @abstractmethod
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """A file, under `artifact_path` of the run's artifacts."""

    @abstractmethod
    def log_table(self, table: Mapping[str, list], artifact_file: str) -> None:
        """Columns of equal length (a column of PIL images is shown as pictures) as an MLflow table."""

    @abstractmethod
    def log_image(self, image: Any, key: str, step: int) -> None:
        """A PIL image as the run's image `key` at `step` (the run page's image slider)."""

    @abstractmethod
    def log_model(self, folder: Path, model_type: str, step: int, keys: Iterable[str] = ()) -> None:
        """`folder` as a logged model of the run at `step`, with the run's metrics `keys` of that step;
        a checkpoint also removes the models of checkpoints the Trainer rotated away."""

    @abstractmethod
    def last_logged_step(self) -> int:
        """The highest training step of any metric the run already has (0 when none)."""

    @abstractmethod
    def close(self, status: str) -> None:
        """End the run as FINISHED, FAILED or KILLED (stopped)."""


class NullStageRun(StageRun):
    """Tracking off, or a process other than global rank 0: every call does nothing."""

    enabled, uri, run_id = False, "", ""

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None: ...
    def log_params(self, params: Mapping[str, Any]) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_table(self, table: Mapping[str, list], artifact_file: str) -> None: ...
    def log_image(self, image: Any, key: str, step: int) -> None: ...
    def log_model(self, folder: Path, model_type: str, step: int, keys: Iterable[str] = ()) -> None: ...
    def close(self, status: str) -> None: ...

    def last_logged_step(self) -> int:
        return 0


class MlflowStageRun(StageRun):
    """The stage's MLflow run. Every write becomes a record in the run's spool, `<stage
    folder>/mlflow_spool/`, which a background thread sends in order; each goes through one guard (`record`):
    a write that cannot even be kept on disk costs that write (a warning), never the training."""

    enabled = True

    def __init__(self, uri: str, run_id: str, stage_dir: Path, name: str):
        self.uri, self.run_id, self.stage_dir, self.name = uri, run_id, stage_dir, name
        self.spool_folder = stage_dir / SPOOL_DIR / run_id
        self.spool: Spool | None = None  # made at the first write: a stage refused before any work has none
        self.sender = Sender(stage_dir / SPOOL_DIR)  # first sends what an earlier process left unsent
        self.monitor, self.closed = None, False
        atexit.register(self.send_at_exit)

    def open_spool(self) -> Spool:
        """The run's spool, made at the first write with the run's start as its first record; a stage folder
        that does not exist yet is made and marked as vlmexp's (vlmexp.files), as the stage marks it."""
        if not self.stage_dir.exists():
            from vlmexp.files import mark_folder

            self.stage_dir.mkdir(parents=True)
            mark_folder(self.stage_dir, f"{self.stage_dir.name} stage")
        spool = Spool(self.spool_folder, self.uri)
        spool.append({"t": "open", "name": self.name})
        return spool

    def send_at_exit(self) -> None:
        """A process that ends before `close` (a refusal after the run opened, say the difficulty filter's)
        gives the sender a few seconds for what it logged; the rest waits on disk."""
        if not self.closed and (left := self.sender.finish(CLOSE_SECONDS["FAILED"])):
            log.warning("%d MLflow records stay in %s for the next start of this stage", left,
                        self.spool_folder)

    def record(self, what: str, make) -> None:
        """Append the record `make()` builds (copying its files into the spool) and wake the sender."""
        try:
            self.spool = self.spool or self.open_spool()
            self.spool.append(make())
        except Exception as e:  # noqa: BLE001 - a write that cannot be kept must not end a training run
            log.warning("%s not logged to MLflow: it could not be kept in %s (%s); training goes on", what,
                        self.spool_folder, short(e))
            return
        self.sender.poke()

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None,
                    system: bool = False) -> None:
        """`system`: MLflow's system metric samples (`vlmexp.tracking.system_metrics`), whose step counts
        samples, not training steps."""
        def make() -> dict[str, Any]:
            points = {sanitize_metric_name(k): float(v) for k, v in metrics.items()}
            return {"t": "metrics", "step": step or 0, "ts": now_ms(), "m": points,
                    **({"system": True} if system else {})}

        if metrics:
            self.record(f"metrics of step {step}", make)

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.record("params", lambda: {"t": "params", "p": {k: str(v) for k, v in params.items()}})

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        def make() -> dict[str, Any]:
            import shutil

            copy = self.spool.new_file(Path(path).name)
            shutil.copyfile(path, copy)
            return {"t": "artifact", "file": str(copy.relative_to(self.spool.folder)), "path": artifact_path}

        self.record(str(path), make)

    def log_table(self, table: Mapping[str, list], artifact_file: str) -> None:
        def make() -> dict[str, Any]:
            import json

            columns, images = dict(table), []
            for name, values in table.items():
                if values and all(hasattr(v, "save") and hasattr(v, "resize") for v in values):
                    columns[name] = [self.save_image(v) for v in values]
                    images.append(name)
            file = self.spool.new_file("table.json")
            file.write_text(json.dumps(columns, default=plain_value))
            return {"t": "table", "file": str(file.relative_to(self.spool.folder)), "images": images,
                    "artifact_file": artifact_file}

        self.record(f"table {artifact_file}", make)

    def log_image(self, image: Any, key: str, step: int) -> None:
        self.record(f"image {key} of step {step}", lambda: {"t": "image", "file": self.save_image(image),
                                                              "key": key, "step": step, "ts": now_ms()})

    def save_image(self, image: Any) -> str:
        self.spool = self.spool or self.open_spool()
        path = self.spool.new_file("image.png")
        image.save(path)
        return str(path.relative_to(self.spool.folder))

    def log_model(self, folder: Path, model_type: str, step: int, keys: Iterable[str] = ()) -> None:
        self.record(f"{folder} as an MLflow model", lambda: {
            "t": "model", "folder": str(Path(folder).resolve()), "type": model_type, "step": step,
            "keys": sorted(keys)})

    def last_logged_step(self) -> int:
        """The highest training step in the spool, or in the store where it answers (0 when none)."""
        spooled = RunSender(self.spool_folder).last_step()
        try:
            stored = last_logged_step(self.uri, self.run_id)
        except Exception as e:  # noqa: BLE001 - the spool holds every step this stage ever logged
            log.warning("MLflow store does not answer (%s); the steps already logged are read from %s",
                        short(e), self.spool_folder)
            stored = 0
        return max(spooled, stored, 0)

    def close(self, status: str) -> None:
        """Record the run's end and give the sender a bounded time to send what is left; what a store that
        does not answer did not take stays on disk for the next start of the stage or the pipeline's next
        step."""
        self.closed = True
        if self.monitor is not None:
            self.monitor.finish()
        self.record(f"the run's end ({status})", lambda: {"t": "end", "status": status, "ts": now_ms()})
        if self.spool is not None:
            self.spool.close()
        seconds = CLOSE_SECONDS.get(status, 5.0)
        left = self.sender.finish(seconds)
        if left:
            log.warning("training ended %s, but the MLflow store did not take %d records within %.0f s: they "
                        "stay in %s and are sent by the next start of this stage or the pipeline's next step",
                        status, left, seconds, self.spool_folder)


def plain_value(value: Any) -> Any:
    """JSON for numpy and torch values in a table."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def open_stage_run(cfg: Config, stage: str, run_id: str | None) -> StageRun:
    """The stage's run in the store the config names: `run_id` (the pipeline's child run; nothing asks the
    store, so a stage starts while it is away), else a new run in the config's experiment (the store must
    answer). A `NullStageRun` with `tracking.backend: none` (mlflow is not imported)."""
    if cfg.tracking.backend == "none":
        return NullStageRun()
    uri = store_uri(cfg)
    if not run_id:  # a stage run by hand: a run of its own
        tracker = make_tracker(cfg)  # the configured store and experiment, created with its artifact location
        uri, run_id = tracker.uri, tracker.start_pipeline(f"{cfg.run.name}-{stage}", {},
                                                          run_tags({"stage": stage}))
    system_metrics = start_system_metrics(cfg)
    from vlmexp.tracking.system_metrics import sample_system_metrics  # before the run's sender thread starts

    run = MlflowStageRun(uri, run_id, Path(cfg.run.output_dir) / stage, f"{cfg.run.name}-{stage}")
    if system_metrics:
        run.monitor = sample_system_metrics(run, cfg.tracking.system_metrics_seconds)
    log.info("logging to MLflow run %s in %s%s", run_id, uri, " with system metrics" * system_metrics)
    return run


def start_system_metrics(cfg: Config) -> bool:
    """Whether the stage's run samples system metrics (`tracking.system_metrics`; see
    `vlmexp.tracking.system_metrics`). A CUDA GPU without nvidia-ml-py is refused here, before any step:
    MLflow would leave the GPU out with only an info line."""
    if not cfg.tracking.system_metrics:
        return False
    import importlib.util

    import torch

    if torch.cuda.is_available() and torch.version.cuda and importlib.util.find_spec("pynvml") is None:
        raise ConfigError(Problem("tracking.system_metrics", "", "a CUDA GPU is here but nvidia-ml-py is not "
                                  "installed, so MLflow would record no GPU use: pip install nvidia-ml-py "
                                  "(in the gpu extra), or set tracking.system_metrics: false", True))
    return True


def last_logged_step(tracking_uri: str | None, run_id: str | None) -> int:
    """The highest training step of any metric already in MLflow run `run_id` (0 when none or no run).
    MLflow's system metrics (`system/...`) are left out: their step counts samples (one every few seconds),
    not training steps, and a slow run's count passes the training steps it logged."""
    if not tracking_uri or not run_id:
        return 0
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    keys = [key for key in client.get_run(run_id).data.metrics if not key.startswith("system/")]
    return max((m.step for k in keys for m in client.get_metric_history(run_id, k)), default=0)
