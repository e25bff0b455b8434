"""The one place a stage process opens MLflow: the run it logs into (the pipeline's child run, or a run of
its own when started by hand), closed when training ends, and the steps already logged there before a resume.
transformers' MLflowCallback logs the Trainer's metrics into the active run this module starts."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from vlmexp.config.schema import Config
from vlmexp.errors import ConfigError, Problem
from vlmexp.provenance import run_tags
from vlmexp.tracking.tracker import make_tracker

log = logging.getLogger("vlmexp.tracking")


@dataclass(frozen=True)
class StageRun:
    """The MLflow run a stage process logs into (only the process of global rank 0 has one)."""

    uri: str
    run_id: str


def open_stage_run(cfg: Config, stage: str, run_id: str | None) -> StageRun | None:
    """Make `run_id` (else a new run in the config's experiment) this process's active MLflow run, in the
    store the config names; transformers' MLflowCallback then logs the Trainer's metrics into it and leaves
    it open (`close_stage_run` ends it). None with `tracking.backend: none` (mlflow is not imported)."""
    if cfg.tracking.backend == "none":
        return None
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
    return StageRun(tracker.uri, run_id)


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


def close_stage_run(run: StageRun | None, status: str) -> None:
    """End the stage's MLflow run as FINISHED, FAILED or KILLED (stopped). A store that went away mid-run must
    not cost the finished model: the failure is logged and the model is saved (the pipeline closes the run
    itself)."""
    if run is None:
        return
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        mlflow.end_run(status)
    except (MlflowException, OSError) as e:
        finished = status == "FINISHED"
        log.warning("training ended %s, but MLflow could not close the run (%s)%s", status,
                    str(e).splitlines()[0][:300], "; saving the model" if finished else "")


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


def log_stage_metrics(metrics: dict[str, float], run: StageRun | None,
                      step: int | None = None) -> dict[str, float]:
    """`metrics` logged to the stage's active MLflow run when it has one (`run`); returned either way."""
    if run:
        import mlflow

        mlflow.log_metrics(metrics, step=step)
    return metrics
