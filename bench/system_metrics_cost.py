"""What MLflow's system-metrics sampling costs a training step (`tracking.system_metrics`).

    .venv/bin/python bench/system_metrics_cost.py [--sft-steps 48] [--grpo-steps 16] [--block 4]
        [--seconds 10] [--out bench/results/system_metrics_cost.json]

Three measurements, on configs/demo.yaml's SFT and GRPO steps (its batch sizes; 256 generated records):

1. Steps with and without the sampler, in one process: the stage is trained in-process (`run_sft` /
   `run_grpo`, tracking on, the sampler under this script's control) and a callback starts MLflow's monitor
   (the class `mlflow.start_run(log_system_metrics=True)` starts) for some blocks of `--block` steps and stops
   it for others, in the order on, off, off, on (repeated): a minute in which the shared machine runs slow
   falls on both sides alike. Per step: wall seconds from `on_step_begin` to `on_step_end`.
2. The sampler's own CPU time in those runs: every monitor thread's user + system seconds (psutil, read before
   it stops), per second of sampling.
3. One sample timed alone, 100 times in this process: every monitor's `collect_metrics` and
   `aggregate_metrics`, the batch logged to a sqlite store and the run status read, as the thread does it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PATTERN = (True, False, False, True)  # sampler on / off per block


def toggling_callback(seconds: float, block: int):
    """A TrainerCallback that runs MLflow's monitor during the `on` blocks and times every step."""
    import psutil
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
    from transformers import TrainerCallback

    class Toggle(TrainerCallback):
        def __init__(self):
            self.steps: list[tuple[bool, float]] = []
            self.monitor, self.cpu, self.sampled = None, 0.0, 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            import mlflow

            on = PATTERN[(state.global_step // block) % len(PATTERN)]
            if on and self.monitor is None:
                self.monitor = SystemMetricsMonitor(mlflow.active_run().info.run_id,
                                                    sampling_interval=seconds)
                self.monitor.start()
                self.since = time.monotonic()
            elif not on and self.monitor is not None:
                self.stop()
            self.on, self.start = on, time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append((self.on, time.perf_counter() - self.start))

        def on_train_end(self, args, state, control, **kwargs):
            if self.monitor is not None:
                self.stop()

        def stop(self):
            native = self.monitor._process.native_id
            times = [t for t in psutil.Process().threads() if t.id == native]
            self.cpu += sum(t.user_time + t.system_time for t in times)
            self.sampled += time.monotonic() - self.since
            self.monitor.finish()
            self.monitor = None

    return Toggle()


def train(stage: str, steps: int, seconds: float, block: int, folder: Path) -> dict:
    """One in-process stage with the sampler toggled in blocks; per-step seconds on and off."""
    from vlmexp.checks.loader import load_config

    cfg = load_config(REPO / "configs/demo.yaml", [
        f"run.output_dir={folder}", f"tracking.tracking_uri=sqlite:///{folder / 'mlflow.db'}",
        "tracking.system_metrics=false", "data.demo.train=256", "data.demo.val=8",
        f"{stage}.args.max_steps={steps}", f"{stage}.args.save_steps={steps * 10}", "sft.enabled=true"])
    toggle = toggling_callback(seconds, block)
    if stage == "sft":
        from vlmexp.train.sft import run_sft

        run_sft(cfg, callbacks=[toggle])
    else:
        from vlmexp.train.grpo import run_grpo

        run_grpo(cfg, callbacks=[toggle])
    on = [s for flag, s in toggle.steps if flag]
    off = [s for flag, s in toggle.steps if not flag]
    return {"stage": stage, "steps": steps, "block": block, "on_s": on, "off_s": off,
            "on_median_s": statistics.median(on), "off_median_s": statistics.median(off),
            "on_mean_s": statistics.mean(on), "off_mean_s": statistics.mean(off),
            "ratio_of_means": statistics.mean(on) / statistics.mean(off),
            "sampler_cpu_s": toggle.cpu, "sampled_s": toggle.sampled,
            "sampler_cpu_share": toggle.cpu / toggle.sampled if toggle.sampled else None}


def sampler_alone(folder: Path, repeats: int = 100) -> dict:
    """Seconds one sample of MLflow's monitor takes, as its thread takes it, against a sqlite store."""
    import mlflow
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{folder / 'sampler.db'}"
    mlflow.set_tracking_uri(store)
    client = MlflowClient(store)
    run = client.create_run(client.create_experiment("sampler"))
    monitor = SystemMetricsMonitor(run.info.run_id, tracking_uri=store)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        monitor.collect_metrics()
        monitor.publish_metrics(monitor.aggregate_metrics())
        monitor.mlflow_logger.flush()
        MlflowClient(store).get_run(run.info.run_id)
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "p90_s": sorted(times)[int(0.9 * repeats)],
            "monitors": [type(m).__name__ for m in monitor.monitors]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-steps", type=int, default=48)
    parser.add_argument("--grpo-steps", type=int, default=16)
    parser.add_argument("--block", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "system_metrics_cost.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for stage, steps in (("sft", args.sft_steps), ("grpo", args.grpo_steps)):
            runs.append(train(stage, steps, args.seconds, args.block, Path(tmp) / stage))
            print(json.dumps({k: v for k, v in runs[-1].items() if not k.endswith("_s")}), flush=True)
        sampler = sampler_alone(Path(tmp))
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "args": vars(args), "runs": runs, "sampler_alone": sampler}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(sampler))


if __name__ == "__main__":
    main()
