"""What a new Python process pays before it does any work: the imports of a training stage, of the pipeline
and of the tracking, each in a fresh process, with the packages whose own import time dominates.

    python bench/process_start.py [--runs 3] [--top 12] [--out F.json]

Every stage the pipeline or a test starts is such a process (and each torchrun rank, each Ray worker), so
this is the floor under every slow test and every stage. Per statement: the wall seconds and the CPU seconds
(user + system, what the process cost the machine whatever else ran) of `python -c STATEMENT`, the median of
`--runs`; then, from one `python -X importtime` run of TRL's trainers' import (what a stage imports once it
trains), the top-level packages by the time spent in their own modules (self time, summed). Results:
bench/RESULTS.md, "What a process start costs".
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STATEMENTS = {
    "python": "pass",
    "torch": "import torch",
    "transformers": "import transformers",
    "trl trainers": "from trl import DPOTrainer, GRPOTrainer, SFTTrainer",
    "mlflow": "import mlflow",
    "prefect": "import prefect",
    "a stage (vlmexp.train.grpo)": "import vlmexp.train.grpo",
    "the pipeline (flows.pipeline)": "import flows.pipeline",
}


def timed(statement: str) -> tuple[float, float]:
    """(wall, user + system CPU) seconds of one fresh `python -c statement`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", statement], check=True, cwd=REPO)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def own_time_by_package(statement: str) -> dict[str, float]:
    """Seconds spent in each top-level package's own modules (`-X importtime`'s self column, summed)."""
    err = subprocess.run([sys.executable, "-X", "importtime", "-c", statement], check=True, cwd=REPO,
                         capture_output=True, text=True).stderr
    total: collections.Counter[str] = collections.Counter()
    for line in err.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        own, _, name = line.removeprefix("import time:").split("|")
        total[name.strip().split(".")[0]] += int(own) / 1e6
    return dict(total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = {}
    for label, statement in STATEMENTS.items():
        runs = [timed(statement) for _ in range(args.runs)]
        rows[label] = {"statement": statement, "wall_s": round(statistics.median(r[0] for r in runs), 2),
                       "cpu_s": round(statistics.median(r[1] for r in runs), 2)}
        row = rows[label]
        print(f"{label:32s} wall {row['wall_s']:6.2f} s  cpu {row['cpu_s']:6.2f} s", flush=True)
    packages = own_time_by_package(STATEMENTS["trl trainers"])  # what a stage imports once it trains
    top = dict(sorted(packages.items(), key=lambda kv: -kv[1])[:args.top])
    print("TRL's trainers' imports, own time by package:",
          ", ".join(f"{k} {v:.2f} s" for k, v in top.items()))
    result = {"cpu_count": os.cpu_count(), "load_average": os.getloadavg(), "runs": args.runs,
              "statements": rows, "trainers_own_time_by_package_s": {k: round(v, 2) for k, v in top.items()}}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
