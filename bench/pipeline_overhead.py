"""Where the demo pipeline's wall time goes: training and evaluation against orchestration and tracking.

    .venv/bin/python bench/pipeline_overhead.py [k=v overrides ...]
        [--out bench/results/pipeline_overhead.json]

Runs `vlmexp run configs/demo.yaml` in a fresh output folder (own MLflow store, own Prefect home whose
database is created by one start of the temporary server beforehand, timed apart as the one-off cost of a
machine's first run), then
reads the run back from MLflow: each training stage's `train_runtime` (TRL's own timer of the training
loop) and `stage_seconds` (the stage's subprocess, start-up and model loading included), its peak
memory, and each evaluation's seconds. Orchestration and tracking = wall time - training loops -
evaluations: Prefect start-up, task bookkeeping, subprocess start, model loading, MLflow calls, export.

It also times one MLflow metric-logging call of a GRPO-sized log entry against the store, synchronous and
asynchronous (what transformers' MLflowCallback uses), as a share of the demo's GRPO step time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "pipeline_overhead.json"))
    args = parser.parse_args()
    from mlflow.tracking import MlflowClient

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "demo"
        env = {**os.environ, "PREFECT_HOME": f"{tmp}/prefect",
               "PREFECT_LOCAL_STORAGE_PATH": f"{tmp}/prefect/storage"}
        # A user's Prefect home holds its database from the first run on; the first start creates it
        # (migrations, block types). Time that once, apart, so the pipeline is measured the way it runs every
        # later time.
        cold = time.monotonic()
        subprocess.run([sys.executable, "-c",
                        "from prefect.server.api.server import SubprocessASGIServer as S; "
                        "s = S(); s.start(); s.stop()"], check=True, env=env, capture_output=True)
        cold = time.monotonic() - cold
        start, started_at = time.monotonic(), time.time()
        proc = subprocess.run([sys.executable, "-m", "vlmexp.cli", "run", "configs/demo.yaml",
                               f"run.output_dir={out}", *args.overrides], check=True, cwd=REPO, env=env,
                              capture_output=True, text=True)
        wall = time.monotonic() - start
        phases = prefect_phases(proc.stdout + proc.stderr, started_at, started_at + wall)
        uri = f"sqlite:///{out / 'mlflow.db'}"
        client = MlflowClient(uri)
        exp = client.get_experiment_by_name("demo")
        runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
        stages = {}
        for name in ("demo-sft", "demo-grpo"):
            m = runs[name].data.metrics
            stages[name] = {k: m[k] for k in ("train_runtime", "stage_seconds", "peak_rss_mib") if k in m}
        ev = runs["eval"].data.metrics
        table = {k.split("/")[0]: v for k, v in ev.items() if k.endswith("/rec_mean_iou")}
        eval_seconds = {k.split("/")[0]: v for k, v in ev.items() if k.endswith("/seconds")}
        steps = [s.value for s in client.get_metric_history(runs["demo-grpo"].info.run_id, "step_time")]
        logging = time_metric_logging(uri, runs["demo-grpo"].info.run_id, runs["demo-grpo"].data.metrics)
    training = sum(s["train_runtime"] for s in stages.values())
    evaluation = sum(eval_seconds.values())
    grpo_step = statistics.median(steps)
    result = {
        "overrides": args.overrides, "wall_s": wall, "training_loops_s": training, "evaluation_s": evaluation,
        "orchestration_and_tracking_s": wall - training - evaluation,
        "orchestration_share": (wall - training - evaluation) / wall,
        "phases_s": phases, "prefect_first_start_s": cold, "rec_mean_iou": table,
        "stages": stages, "evaluations_s": eval_seconds, "grpo_median_step_s": grpo_step,
        "metric_logging": {**logging, "share_of_grpo_step_sync": logging["sync_s"] / grpo_step,
                           "share_of_grpo_step_async": logging["async_s"] / grpo_step},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def prefect_phases(log: str, started_at: float, ended_at: float) -> dict[str, float]:
    """Seconds from one logged event to the next, from the timestamps Prefect prints (HH:MM:SS.mmm): the
    process start to the temporary server, the server's start-up, then each task up to its "Finished"
    line (tasks run one after another, so the span includes Prefect's bookkeeping before the task)."""
    import datetime
    import re

    day = datetime.datetime.fromtimestamp(started_at).replace(hour=0, minute=0, second=0, microsecond=0)
    phases, last = {}, started_at
    for line in log.splitlines():
        m = re.match(r"(\d\d):(\d\d):(\d\d\.\d+) \| \w+ +\| (.*)", line)
        if not m:
            continue
        h, mi, sec, text = int(m[1]), int(m[2]), float(m[3]), m[4]
        at = (day + datetime.timedelta(hours=h, minutes=mi, seconds=sec)).timestamp()
        if at < started_at - 1:  # past midnight
            at += 86400
        event = None
        if "Starting temporary server" in text:
            event = "python and prefect import"
        elif "Beginning flow run" in text:
            event = "temporary server start"
        elif (t := re.match(r"Task run '(.+)-[0-9a-f]{3}' - Finished in state", text)):
            event = t[1]
        elif re.match(r"Flow run '.+' - Finished in state", text):
            event = "flow end"
        elif "Stopping temporary server" in text:
            event = "stopping"
        if event:
            phases[event] = phases.get(event, 0.0) + at - last
            last = at
    phases["exit after the last log line"] = ended_at - last
    return phases


def time_metric_logging(uri: str, run_id: str, example: dict[str, float],
                        repeats: int = 20) -> dict[str, float]:
    """Median seconds one log entry (all of a GRPO step's metrics) costs the caller, sync and async."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    sync, asynchronous = [], []
    with mlflow.start_run(run_id=run_id):
        for step in range(repeats):
            t = time.perf_counter()
            mlflow.log_metrics({f"bench/{k}": v for k, v in example.items()}, step=10_000 + step,
                               synchronous=True)
            sync.append(time.perf_counter() - t)
            t = time.perf_counter()
            mlflow.log_metrics({f"bench/{k}": v for k, v in example.items()}, step=20_000 + step,
                               synchronous=False)
            asynchronous.append(time.perf_counter() - t)
        mlflow.flush_async_logging()
    return {"keys": len(example), "sync_s": statistics.median(sync),
            "async_s": statistics.median(asynchronous)}


if __name__ == "__main__":
    main()
