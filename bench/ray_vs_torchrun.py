"""The same GRPO stage with 2 workers on CPU under `launch.launcher: ray` (a 2-node Ray cluster of `ray start`
processes on this machine, started and ended by this script) and under torchrun (2 processes), in one run:
the step time and the time from the command's start to the end of the first step.

    python bench/ray_vs_torchrun.py OUT_DIR [--steps 10] [--runs 1] [--client] [--cpus 2]

The Ray driver connects with the head's GCS address (HEAD:PORT: it runs on a node of the cluster, as a
driver on the head does); `--client` adds a third launcher per run, `ray-client`, through Ray Client
(ray://HEAD:PORT). Each node declares `--cpus` CPUs (the default, 2, is what `ray start` declares on a
2-core machine; the raylet starts at most that many of the node's worker processes at once). Every step
saves its checkpoint (weights only, the same save under every launcher). Step time: from checkpoint-1's
trainer_state.json to the last checkpoint's, over the steps between. Time to the first step: from the
command's start to checkpoint-1's trainer_state.json. Prints one line per run and launcher, and the
machine's load average at the start and the end. Results: bench/RESULTS.md, "Ray against torchrun".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.ray_cluster import ray_test_cluster  # noqa: E402

GRPO = ["tracking.backend=none", "data.demo.train=64", "data.demo.val=8", "sft.enabled=false",
        "grpo.args.per_device_train_batch_size=8", "grpo.args.gradient_accumulation_steps=1",
        "grpo.args.num_generations=8", "grpo.args.logging_steps=1",
        "grpo.args.save_steps=1", "grpo.args.save_only_model=true", "grpo.resume=false", "eval.every_steps=0"]


def launch(name: str, cluster) -> list[str]:
    if name == "torchrun":
        return ["launch.launcher=torchrun", "launch.nproc_per_node=2"]
    address = cluster.client if name == "ray-client" else cluster.gcs
    ray = {"address": address, "num_workers": 2, "placement_strategy": "STRICT_SPREAD"}
    return ["launch.launcher=ray", f"launch.ray={json.dumps(ray)}"]


def one_run(name: str, out: Path, steps: int, tokens: int, cluster, model: str) -> tuple[float, float]:
    """(seconds a step, seconds from the command's start to the end of step 1) for one GRPO stage."""
    start = time.time()
    r = subprocess.run([sys.executable, "-m", "vlmexp.cli", "train", "grpo", "--config", "configs/demo.yaml",
                        f"run.output_dir={out}", f"model.path={model}", f"grpo.args.max_steps={steps}",
                        f"grpo.args.max_completion_length={tokens}",
                        *GRPO, *launch(name, cluster)], cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{name}: the stage failed ({r.returncode}):\n{r.stderr[-3000:]}")
    saved = [(out / "grpo" / f"checkpoint-{n}" / "trainer_state.json").stat().st_mtime for n in (1, steps)]
    return (saved[1] - saved[0]) / (steps - 1), saved[0] - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="a folder for the runs' output folders")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=16, help="each completion's length in tokens")
    parser.add_argument("--client", action="store_true", help="also run the driver through Ray Client")
    parser.add_argument("--cpus", type=int, default=2, help="the CPUs each Ray node declares")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    model = out / "tiny"
    if not model.is_dir():
        subprocess.run([sys.executable, "-m", "vlmexp.cli", "make-tiny-model", str(model)], check=True,
                       cwd=REPO)
    launchers = ["torchrun", "ray", *(["ray-client"] if args.client else [])]
    print("load average (1, 5, 15 min) at the start: %.2f %.2f %.2f" % os.getloadavg(), flush=True)
    with ray_test_cluster(args.cpus, grpc_env=args.client) as cluster:
        for i in range(args.runs):
            times = {}
            for name in launchers:  # alternating, so a change in the machine's load hits each alike
                times[name] = one_run(name, out / f"{name}{i}", args.steps, args.tokens, cluster, str(model))
                print(f"run {i + 1} {name}: {times[name][0]:.3f} s a step, first step done "
                      f"{times[name][1]:.1f} s after the start", flush=True)
            base = times["torchrun"]
            for name in launchers[1:]:
                print(f"run {i + 1}: {name} / torchrun step time {times[name][0] / base[0]:.3f}; "
                      f"first step {times[name][1] - base[1]:+.1f} s", flush=True)
    print("load average (1, 5, 15 min) at the end: %.2f %.2f %.2f" % os.getloadavg(), flush=True)


if __name__ == "__main__":
    main()
