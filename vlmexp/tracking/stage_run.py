"""The stage process's one logger: the MLflow run a training stage logs into (the pipeline's child run, or a
run of its own when started by hand), through which every module of the stage process logs its metrics,
params, artifacts, tables, images and models, closed when training ends. Tracking off (`tracking.backend:
none`) and every process but global rank 0 get a `NullStageRun`, which logs nothing; nothing else in the
stage process imports mlflow."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from vlmexp.config.schema import Config
from vlmexp.errors import ConfigError, Problem
from vlmexp.provenance import run_tags
from vlmexp.tracking.tracker import make_tracker

log = logging.getLogger("vlmexp.tracking")


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
    """The stage's MLflow run, the active run of this process (transformers' MLflowCallback logs the Trainer's
    metrics into it). Every write goes through one guard: a store that is unreachable costs that write (a
    warning), never the training."""

    enabled = True

    def __init__(self, uri: str, run_id: str):
        self.uri, self.run_id = uri, run_id
        self._client = self._experiment = None

    def guarded(self, what: str, step: int | None, write: Callable[[], Any]) -> None:
        try:
            write()
        except Exception as e:  # noqa: BLE001 - an unreachable store must not end a training run
            log.warning("step %s: %s not logged, MLflow store unreachable (%s); training goes on", step, what,
                        str(e).splitlines()[0][:300] if str(e) else type(e).__name__)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        import mlflow

        self.guarded("metrics", step, lambda: mlflow.log_metrics(dict(metrics), step=step))

    def log_params(self, params: Mapping[str, Any]) -> None:
        import mlflow

        self.guarded("params", None, lambda: mlflow.log_params(dict(params)))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        import mlflow

        self.guarded(str(path), None, lambda: mlflow.log_artifact(str(path), artifact_path))

    def log_table(self, table: Mapping[str, list], artifact_file: str) -> None:
        import mlflow
        import pandas as pd

        self.guarded(f"table {artifact_file}", None,
                     lambda: mlflow.log_table(pd.DataFrame(dict(table)), artifact_file=artifact_file))

    def log_image(self, image: Any, key: str, step: int) -> None:
        import mlflow

        self.guarded(f"image {key}", step, lambda: mlflow.log_image(image, key=key, step=step))

    def log_model(self, folder: Path, model_type: str, step: int, keys: Iterable[str] = ()) -> None:
        self.guarded(f"{folder} as an MLflow model", step,
                     lambda: self._log_model(folder, model_type, step, keys))

    def _log_model(self, folder: Path, model_type: str, step: int, keys: Iterable[str]) -> None:
        import mlflow
        from mlflow.tracking import MlflowClient

        from vlmexp.tracking.logged_models import forget_rotated_checkpoints, log_folder_model

        mlflow.flush_async_logging()  # this step's metrics, queued by MLflowCallback, are in the store
        if self._client is None:
            self._client = MlflowClient(self.uri)
            self._experiment = self._client.get_run(self.run_id).info.experiment_id
        log_folder_model(self._client, self._experiment, self.run_id, folder, model_type, step, keys)
        if model_type == "checkpoint":  # the Trainer rotates old checkpoints away before on_save
            gone = forget_rotated_checkpoints(self._client, self._experiment, self.run_id)
            if gone:
                log.info("step %d: removed the MLflow models of rotated-away %s", step, ", ".join(gone))

    def last_logged_step(self) -> int:
        return last_logged_step(self.uri, self.run_id)

    def close(self, status: str) -> None:
        """A store that went away mid-run must not cost the finished model: the failure is logged and the
        model is saved (the pipeline closes the run itself)."""
        import mlflow
        from mlflow.exceptions import MlflowException

        try:
            mlflow.end_run(status)
        except (MlflowException, OSError) as e:
            finished = status == "FINISHED"
            log.warning("training ended %s, but MLflow could not close the run (%s)%s", status,
                        str(e).splitlines()[0][:300], "; saving the model" if finished else "")


def open_stage_run(cfg: Config, stage: str, run_id: str | None) -> StageRun:
    """Make `run_id` (else a new run in the config's experiment) this process's active MLflow run, in the
    store the config names; transformers' MLflowCallback then logs the Trainer's metrics into it and leaves
    it open (`StageRun.close` ends it). A `NullStageRun` with `tracking.backend: none` (mlflow is not
    imported)."""
    if cfg.tracking.backend == "none":
        return NullStageRun()
    import os

    import mlflow

    tracker = make_tracker(cfg)  # the configured store and experiment, created with its artifact location
    if not run_id:  # a stage run by hand: a run of its own
        run_id = tracker.start_pipeline(f"{cfg.run.name}-{stage}", {}, run_tags({"stage": stage}))
    # MLflowCallback reads these settings from this process's environment only: the model config's nested
    # dicts become one param per key. Asynchronous logging: TRL logs its profiling timings with a bare
    # mlflow.log_metrics on every profiled call (43 ms each against a sqlite store, measured:
    # bench/RESULTS.md); queued they cost the step ~1 ms, and a store that goes away mid-run loses
    # metrics (logged as errors) instead of stopping training.
    os.environ.setdefault("MLFLOW_FLATTEN_PARAMS", "TRUE")
    mlflow.config.enable_async_logging(True)
    mlflow.set_tracking_uri(tracker.uri)
    system_metrics = start_system_metrics(cfg)
    mlflow.start_run(run_id=run_id, run_name=f"{cfg.run.name}-{stage}", log_system_metrics=system_metrics)
    log.info("logging to MLflow run %s in %s%s", run_id, tracker.uri, " with system metrics" * system_metrics)
    return MlflowStageRun(tracker.uri, run_id)


def start_system_metrics(cfg: Config) -> bool:
    """Whether the stage's run samples system metrics (`tracking.system_metrics`), with MLflow's own monitor:
    a thread that every `tracking.system_metrics_seconds` logs `system/cpu_utilization_percentage`,
    `system/system_memory_usage_megabytes`, disk and network use and, through nvidia-ml-py,
    `system/gpu_<i>_...` (utilization, memory, power) until the run ends; a resumed run continues its steps. A
    CUDA GPU without nvidia-ml-py is refused here, before any step: MLflow would leave the GPU out with only
    an info line."""
    if not cfg.tracking.system_metrics:
        return False
    import importlib.util

    import mlflow
    import torch
    from mlflow.environment_variables import MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL

    if torch.cuda.is_available() and torch.version.cuda and importlib.util.find_spec("pynvml") is None:
        raise ConfigError(Problem("tracking.system_metrics", "", "a CUDA GPU is here but nvidia-ml-py is not "
                                  "installed, so MLflow would record no GPU use: pip install nvidia-ml-py "
                                  "(in the gpu extra), or set tracking.system_metrics: false", True))
    if MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL.get() is None:  # the variable, MLflow's own setting, wins
        mlflow.set_system_metrics_sampling_interval(cfg.tracking.system_metrics_seconds)
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
