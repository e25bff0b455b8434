"""GRPO's online filter (grpo.online_filter) on the demo: held-out IoU at an equal generation budget.

    .venv/bin/python bench/online_filter.py [--seeds 42] [--arithmetic avx512 avx2] [--threads 1]
        [--filter grpo.online_filter.key=iou ...] [--out-dir DIR] [k=v ...]

Per cell (seed x CPU arithmetic, one child process each, as bench/demo_matrix.py runs its cells, tracking
off): the demo's data and tiny model, one SFT, then GRPO from that SFT model twice: `plain`
(configs/demo.yaml's GRPO: max_steps x groups per step generated) and `filtered` (--filter's settings), which
stops once it has generated as many groups as plain did (its steps then fewer: each extra round generates a
whole batch). Every model is evaluated on the held-out records; the JSON holds each arm's held-out metrics,
the gain over SFT and filtered against plain with paired standard errors over the records, steps, GRPO wall
seconds, groups generated, the filter's counts, and plain's frac_reward_zero_std (what key std would
drop).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from demo_matrix import ARITHMETIC, NEEDS_FLAG, cpu_flags, machine, paired  # bench/ is not a package

REPO = Path(__file__).resolve().parents[1]
FILTER = ["grpo.online_filter.enabled=true", "grpo.online_filter.key=iou", "grpo.online_filter.low=0.05",
          "grpo.online_filter.high=0.9"]


def budget_stop(budget: int):
    """A callback that stops training once the trainer it is given has generated `budget` groups."""
    from transformers import TrainerCallback

    class BudgetStop(TrainerCallback):
        trainer = None

        def on_step_end(self, args, state, control, **kwargs):
            if self.trainer.groups_generated_total >= budget:
                control.should_training_stop = True

    return BudgetStop()


def train_arm(cfg, sft: str, budget: int | None) -> dict:
    """GRPO from `sft`; with `budget`, stopped at that many groups generated. The arm's model and figures."""
    from vlmexp.train.grpo import build_grpo_trainer
    from vlmexp.train.stage import train_and_save

    start = time.monotonic()
    stop = [budget_stop(budget)] if budget else []
    trainer, inputs, rows = build_grpo_trainer(cfg, sft, callbacks=stop)
    for callback in stop:
        callback.trainer = trainer
    model = train_and_save(trainer, inputs, rows)
    logs = trainer.state.log_history
    zero = [h["frac_reward_zero_std"] for h in logs if "frac_reward_zero_std" in h]
    record = {"model": str(model), "steps": trainer.state.global_step,
              "seconds": round(time.monotonic() - start, 1),
              "frac_reward_zero_std_mean": sum(zero) / max(1, len(zero))}
    if budget:
        record["groups_generated"] = trainer.groups_generated_total
        record["online_filter"] = {key.removeprefix("online_filter/"): [h[key] for h in logs if key in h]
                                   for key in {k for h in logs for k in h if k.startswith("online_filter/")}}
    return record


def run_cell(seed: int, filter_overrides: list[str], overrides: list[str]) -> dict:
    """One cell in this process (its environment already set)."""
    import torch

    from vlmexp.checks.loader import load_config
    from vlmexp.data.run_data import prepare_data
    from vlmexp.evaluate import evaluate
    from vlmexp.files import read_jsonl
    from vlmexp.modeling import resolve_model
    from vlmexp.train.sft import run_sft

    with tempfile.TemporaryDirectory() as tmp:
        common = ["tracking.backend=none", f"run.seed={seed}", *overrides]
        plain_cfg = load_config(REPO / "configs/demo.yaml", [f"run.output_dir={tmp}/plain", *common])
        filtered_cfg = load_config(REPO / "configs/demo.yaml",
                                   [f"run.output_dir={tmp}/filtered", *common, *filter_overrides])
        data = prepare_data(plain_cfg)
        prepare_data(filtered_cfg)
        resolve_model(plain_cfg.model, Path(tmp) / "plain")
        resolve_model(filtered_cfg.model, Path(tmp) / "filtered")
        start = time.monotonic()
        sft = str(run_sft(plain_cfg))
        arms = {"sft": {"model": sft, "seconds": round(time.monotonic() - start, 1)}}
        arms["plain"] = train_arm(plain_cfg, sft, None)
        args = plain_cfg.grpo.args
        budget = args["max_steps"] * args["per_device_train_batch_size"] * args.get(
            "gradient_accumulation_steps", 1) // args["num_generations"]
        arms["filtered"] = train_arm(filtered_cfg, sft, budget)
        scores = {}
        for name, arm in arms.items():
            result = evaluate(plain_cfg, arm["model"], data.val, Path(tmp) / "eval" / name)
            arm["metrics"] = result.metrics
            scores[name] = [row["score"] for row in read_jsonl(result.samples_path)]
    return {"seed": seed, "budget_groups": budget, "arms": arms,
            "gains_over_sft": {a: paired(scores["sft"], scores[a]) for a in ("plain", "filtered")},
            "filtered_over_plain": paired(scores["plain"], scores["filtered"]),
            "filter": filter_overrides, "torch_threads": torch.get_num_threads(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}


def launch(args: argparse.Namespace, seed: int, arithmetic: str) -> None:
    out = Path(args.out_dir) / f"seed{seed}-{arithmetic}.json"
    env = {**os.environ, **ARITHMETIC[arithmetic], "OMP_NUM_THREADS": str(args.threads),
           "MKL_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, __file__, "--cell", str(seed), "--cell-out", str(out), "--filter", *args.filter,
           "--", *args.overrides]
    with open(out.with_suffix(".log"), "w") as log:
        if subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO).returncode:
            raise SystemExit(f"cell seed {seed} {arithmetic} failed; see {out.with_suffix('.log')}")
    record = json.loads(out.read_text())
    record.update(arithmetic=arithmetic, threads=args.threads, machine=machine(), overrides=args.overrides,
                  commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True, cwd=REPO).stdout.strip())
    out.write_text(json.dumps(record, indent=2) + "\n")
    gain = record["filtered_over_plain"]
    print(f"seed {seed} {arithmetic}: filtered - plain {gain['gain']:+.4f} (SE {gain['se']:.4f})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[42])
    parser.add_argument("--arithmetic", nargs="+", choices=list(ARITHMETIC), default=["avx512", "avx2"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--filter", nargs="+", default=FILTER, help="the filtered arm's overrides")
    parser.add_argument("--out-dir", default=str(REPO / "bench" / "results" / "online_filter"))
    parser.add_argument("--cell", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cell-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.cell is not None:
        record = run_cell(args.cell, args.filter, args.overrides)
        Path(args.cell_out).write_text(json.dumps(record, indent=2) + "\n")
        return
    missing = [a for a in args.arithmetic if NEEDS_FLAG[a] not in cpu_flags()]
    if missing:
        raise SystemExit(f"this CPU cannot compute as {', '.join(missing)}; leave it out of --arithmetic")
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        for arithmetic in args.arithmetic:
            launch(args, seed, arithmetic)


if __name__ == "__main__":
    main()
