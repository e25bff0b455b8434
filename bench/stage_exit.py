"""How long a stage process takes to exit after its last line: `vlmexp.cli.entry` (exit_without_teardown)
against Python's normal exit (main() then sys.exit), on a 2-step SFT stage of configs/demo.yaml.

    python bench/stage_exit.py OUT_DIR [--runs 3]

Prints one line per run: the variant, the whole run and the seconds from "sft: final model in ..." to the
end of the process. Results: bench/RESULTS.md, "Exit of a stage process".
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

VARIANTS = {
    "entry": [sys.executable, "-m", "vlmexp.cli"],
    "plain": [sys.executable, "-c", "import sys; from vlmexp.cli import main; sys.exit(main())"],
}


def exit_seconds(variant: str, out: str) -> tuple[float, float]:
    """(whole run, last line to process end) in seconds for one SFT stage run as `variant`."""
    start = time.monotonic()
    proc = subprocess.Popen([*VARIANTS[variant], "train", "sft", "--config", "configs/demo.yaml",
                             f"run.output_dir={out}", "tracking.backend=none", "sft.args.max_steps=2",
                             "sft.args.save_steps=2"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    last = None
    for line in proc.stdout:
        if "final model in" in line:
            last = time.monotonic()
    if proc.wait() != 0 or last is None:
        raise SystemExit(f"{variant}: the stage failed (exit status {proc.returncode})")
    end = time.monotonic()
    return end - start, end - last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="a folder for the runs' output folders")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    for i in range(args.runs):
        for variant in VARIANTS:  # alternating, so a change in the machine's load hits both alike
            total, tail = exit_seconds(variant, f"{args.out}/{variant}{i}")
            print(f"{variant} run {i + 1}: total {total:.2f} s, exit after the last line {tail:.2f} s",
                  flush=True)


if __name__ == "__main__":
    main()
