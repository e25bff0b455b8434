"""MLflow's system metrics for a stage's run, kept through the run's spool like its other metrics.

MLflow's own monitor (`mlflow.system_metrics`) samples CPU, memory, disk, network and, through nvidia-ml-py,
each GPU's utilization, memory and power, and logs them as `system/...` every sampling interval, a step per
sample. It sends them to the store itself, and before each sample asks the store whether the run still runs,
ending for good the first time the store does not answer. Here its samples go into the spool instead
(`vlmexp.tracking.spool`), and it samples until the stage ends, so an outage of the store leaves no hole.
"""

from __future__ import annotations

from typing import Any

from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

from vlmexp.tracking.spool import RunSender


class SpooledSamples:
    """What the monitor calls its logger (`record_metrics`, `flush`): each sample a record of the run."""

    data: list = []
    total_training_time = total_log_batch_time = 0.0

    def __init__(self, run):
        self.run = run

    def record_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log_metrics(metrics, step, system=True)

    def flush(self) -> None: ...


class SpooledMonitor(SystemMetricsMonitor):
    """MLflow's monitor with its samples spooled; its loop (`monitor`, overridden) samples without asking the
    store, until `finish`."""

    def __init__(self, run, seconds: float):
        super().__init__(run.run_id, sampling_interval=seconds, tracking_uri=run.uri)
        self._logging_step = RunSender(run.spool_folder).last_step(system=True) + 1  # a resumed run goes on
        self.mlflow_logger: Any = SpooledSamples(run)

    def monitor(self) -> None:
        while not self._shutdown_event.is_set():
            for _ in range(self.samples_before_logging):
                self.collect_metrics()
                if self._shutdown_event.wait(self.sampling_interval):
                    return
            self.publish_metrics(self.aggregate_metrics())


def sample_system_metrics(run, seconds: float) -> SpooledMonitor:
    """Start sampling into `run` (an MlflowStageRun) every `seconds` (MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL,
    MLflow's own setting, wins); `finish()` stops it."""
    monitor = SpooledMonitor(run, seconds)
    monitor.start()
    return monitor
