"""What MLflow's system-metrics sampling costs a training step (`tracking.system_metrics`).

    .venv/bin/python bench/system_metrics_cost.py [--rounds 3] [--sft-steps 60] [--grpo-steps 12] [--seconds 10]
        [--out bench/results/system_metrics_cost.json]

Two measurements:

1. End to end: `vlmexp train sft` and `vlmexp train grpo` on configs/demo.yaml (its batch sizes, 256 generated
   records), each a fresh process with its own MLflow store, with the sampling on and off, alternating (the
   order flips every round, so a slow minute of the machine does not land on one side). Per run: the
   Trainer's `train_runtime` (the training loop, read back from the run) per optimizer step, and how many
   samples the run holds.
2. The sampler alone: one sample as MLflow's monitor thread takes it (every monitor's `collect_metrics`,
   `aggregate_metrics`, the batch logged to a sqlite store, the run status read), timed 100 times in this
   process. Its share of a step = the sample's time / the interval: the thread's work per second of training.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train(stage: str, steps: int, on: bool, seconds: float, folder: Path) -> dict:
    """One `vlmexp train STAGE` process; its seconds per step and the samples its run holds."""
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{folder / 'mlflow.db'}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    cmd = [sys.executable, "-m", "vlmexp.cli", "train", stage, "--config", "configs/demo.yaml",
           f"run.output_dir={folder}", f"tracking.tracking_uri={store}", "data.demo.train=256", "data.demo.val=8",
           f"{stage}.args.max_steps={steps}", f"{stage}.args.save_steps={steps * 10}",
           f"tracking.system_metrics={str(on).lower()}", f"tracking.system_metrics_seconds={seconds}"]
    subprocess.run(cmd, check=True, cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True)
    client = MlflowClient(store)
    [run] = client.search_runs([client.get_experiment_by_name("demo").experiment_id])
    metrics = run.data.metrics
    samples = len(client.get_metric_history(run.info.run_id, "system/cpu_utilization_percentage"))
    return {"stage": stage, "system_metrics": on, "steps": steps, "s_per_step": metrics["train_runtime"] / steps,
            "samples": samples, "system_keys": sorted(k for k in metrics if k.startswith("system/"))}


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
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sft-steps", type=int, default=60)
    parser.add_argument("--grpo-steps", type=int, default=12)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "system_metrics_cost.json"))
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for stage, steps in (("sft", args.sft_steps), ("grpo", args.grpo_steps)):
                for on in ((True, False) if r % 2 == 0 else (False, True)):
                    runs.append(train(stage, steps, on, args.seconds, Path(tmp) / f"{stage}-{r}-{on}"))
                    print(json.dumps(runs[-1]), flush=True)
        sampler = sampler_alone(Path(tmp))
    summary = {}
    for stage in ("sft", "grpo"):
        on = statistics.median(x["s_per_step"] for x in runs if x["stage"] == stage and x["system_metrics"])
        off = statistics.median(x["s_per_step"] for x in runs if x["stage"] == stage and not x["system_metrics"])
        summary[stage] = {"on_s_per_step": on, "off_s_per_step": off, "ratio": on / off,
                          "sampler_share": sampler["median_s"] / args.seconds}
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores", "args": vars(args), "runs": runs, "sampler": sampler, "summary": summary}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
