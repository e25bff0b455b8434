"""GRPO per-step cost: a plain TRL GRPOTrainer script against `vlmexp train grpo`, same model, data and args.

    .venv/bin/python bench/grpo_overhead.py [--rounds 3] [--steps 12] [--prompts-per-step 8] [--in-process]
        [--out bench/results/grpo_overhead.json]

Alternates A (plain TRL, bench/plain_trl_grpo.py) and B (vlmexp) `--rounds` times in one run and reports the
median and spread of TRL's own `step_time` per optimizer step (first two steps of each run dropped as
warm-up), and the ratio B / A. Each run is a fresh process (`vlmexp train grpo` for B); with --in-process
both trainers (B: vlmexp.train.grpo.build_grpo_trainer, what `vlmexp train grpo` trains) are built once in
this process and trained in turn, which takes process-to-process spread out of the comparison. Both sides
train the tiny Qwen2.5-VL on the demo data with the IoU reward, tracking off, at the demo's GRPO step
(ARGS: 8 prompts x G 8, 48 new tokens) and from vlmexp's prompt text, so the work per step is the same;
the mean completion length of each side is reported to show it.
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
# the demo's GRPO step (configs/demo.yaml): 8 prompts x G 8 per optimizer step, 48 new tokens
ARGS = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 8, "num_generations": 8,
        "max_completion_length": 48, "temperature": 0.7, "learning_rate": 1e-4, "warmup_steps": 15, "beta": 0.0,
        "logging_steps": 1, "save_strategy": "no", "report_to": [], "seed": 42}
# set on vlmexp's side too, whatever configs/demo.yaml says
SAME = ("per_device_train_batch_size", "gradient_accumulation_steps", "num_generations", "max_completion_length",
        "temperature", "learning_rate", "warmup_steps", "beta")


def call(command: list[str], env: dict[str, str] | None = None) -> None:
    r = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env={**os.environ, **(env or {})})
    if r.returncode != 0:
        raise SystemExit(f"{command[:4]} failed ({r.returncode}):\n{r.stderr[-3000:]}")


def step_times(history: list[dict]) -> tuple[list[float], list[float]]:
    """(seconds, mean completion length) per optimizer step, the first two steps dropped as warm-up."""
    steps = [h for h in history if "step_time" in h][2:]
    return [h["step_time"] for h in steps], [h["completions/mean_length"] for h in steps]


def prompt_template() -> str:
    """vlmexp's grounding prompt for Qwen2.5-VL, so both sides generate from prompts of the same length."""
    from vlmexp.config import DEFAULT_PROMPT_TEMPLATES, FRAME_HINTS
    from vlmexp.families import get_family

    frame = FRAME_HINTS[get_family("qwen2_5_vl").box_frame]
    return DEFAULT_PROMPT_TEMPLATES["rec"].replace("{frame}", frame)


def vlmexp_side(work: Path, steps: int) -> tuple[Path, list[str]]:
    """A stage folder that shares the built model and sampled data (both sides read the same files), and
    the `vlmexp train grpo` overrides that pin ARGS."""
    out = work / f"vlmexp-{time.monotonic_ns()}"
    out.mkdir()
    shared = work / "shared"
    for src in (shared / "models", shared / "data", next(shared.glob("demo_data-*"))):
        (out / src.name).symlink_to(src)
    overrides = [f"run.output_dir={out}", "tracking.backend=none", f"grpo.args.max_steps={steps}",
                 f"grpo.args.save_steps={steps}", "grpo.args.logging_steps=1", "grpo.rewards=[{name: iou}]",
                 *(f"grpo.args.{k}={ARGS[k]}" for k in SAME)]
    return out, overrides


# as under the pipeline: the data is sampled already, the stage does not sample it again
SAMPLED = {"VLMEXP_DATA_SAMPLED": "1"}


def run_plain(model: str, train: str, work: Path, steps: int) -> tuple[list[float], list[float]]:
    out = work / f"plain-{time.monotonic_ns()}"
    out.mkdir()
    call([sys.executable, str(REPO / "bench" / "plain_trl_grpo.py"), model, train, str(out),
          json.dumps({**ARGS, "max_steps": steps}), prompt_template()])
    return step_times(json.loads((out / "log_history.json").read_text()))


def run_vlmexp(work: Path, steps: int) -> tuple[list[float], list[float]]:
    out, overrides = vlmexp_side(work, steps)
    call([sys.executable, "-m", "vlmexp.cli", "train", "grpo", "--config", "configs/demo.yaml", *overrides],
         env=SAMPLED)
    state = json.loads((out / "grpo" / f"checkpoint-{steps}" / "trainer_state.json").read_text())
    return step_times(state["log_history"])


def in_process(model: str, train: str, work: Path, steps: int, rounds: int) -> dict[str, tuple[list, list]]:
    """Both trainers in this process, trained in turn (the order swaps every round)."""
    sys.path.insert(0, str(REPO / "bench"))
    from plain_trl_grpo import build
    from transformers import set_seed

    from vlmexp.config_loader import load_config
    from vlmexp.train.grpo import build_grpo_trainer

    os.environ.update(SAMPLED)
    out, overrides = vlmexp_side(work, steps)
    cfg = load_config(REPO / "configs" / "demo.yaml", [*overrides, 'grpo.args.save_strategy="no"'])
    trainers = {"plain": build(model, train, str(work / "plain"), {**ARGS, "max_steps": steps}, prompt_template()),
                "vlmexp": build_grpo_trainer(cfg)[0]}
    times: dict[str, tuple[list, list]] = {"plain": ([], []), "vlmexp": ([], [])}
    for i in range(rounds):
        for side in ("plain", "vlmexp") if i % 2 == 0 else ("vlmexp", "plain"):
            set_seed(ARGS["seed"])  # both sides sample from the same random stream, as in fresh processes
            trainers[side].train()  # a new TrainerState, optimizer and schedule each time
            seconds, lengths = step_times(trainers[side].state.log_history)
            times[side][0].extend(seconds)
            times[side][1].extend(lengths)
        print(f"round {i + 1}: plain median {statistics.median(times['plain'][0]):.3f}s, vlmexp median "
              f"{statistics.median(times['vlmexp'][0]):.3f}s", flush=True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts-per-step", type=int, default=ARGS["gradient_accumulation_steps"],
                        help="gradient_accumulation_steps: prompts per optimizer step (default: the demo's)")
    parser.add_argument("--in-process", action="store_true",
                        help="build both trainers once in this process and train them in turn")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "grpo_overhead.json"))
    args = parser.parse_args()
    ARGS["gradient_accumulation_steps"] = args.prompts_per_step
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        call([sys.executable, "-m", "vlmexp.cli", "train", "sft", "--config", "configs/demo.yaml",
              f"run.output_dir={work / 'shared'}", "tracking.backend=none", "sft.args.max_steps=1",
              "sft.args.save_steps=1"])  # builds the model and samples the data
        [model] = (work / "shared" / "models").glob("tiny-*")
        train = str(work / "shared" / "data" / "train.jsonl")
        if args.in_process:
            times = in_process(str(model), train, work, args.steps, args.rounds)
        else:
            times = {"plain": ([], []), "vlmexp": ([], [])}
            for i in range(args.rounds):
                for side, run in (("plain", lambda: run_plain(str(model), train, work, args.steps)),
                                  ("vlmexp", lambda: run_vlmexp(work, args.steps))):
                    seconds, lengths = run()
                    times[side][0].extend(seconds)
                    times[side][1].extend(lengths)
                print(f"round {i + 1}: plain median {statistics.median(times['plain'][0]):.3f}s, vlmexp median "
                      f"{statistics.median(times['vlmexp'][0]):.3f}s", flush=True)
    (plain, plain_len), (ours, our_len) = times["plain"], times["vlmexp"]
    result = {"mode": "in-process" if args.in_process else "processes", "rounds": args.rounds,
              "steps_per_run": args.steps, "args": ARGS, "plain_trl_step_s": summary(plain),
              "vlmexp_step_s": summary(ours), "ratio": statistics.median(ours) / statistics.median(plain),
              # the same work on both sides: tokens generated per completion
              "plain_completion_length": statistics.mean(plain_len),
              "vlmexp_completion_length": statistics.mean(our_len)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def summary(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4)
    return {"median": statistics.median(values), "p25": q[0], "p75": q[2], "n": len(values)}


if __name__ == "__main__":
    main()
