"""GRPO per-step cost: a plain TRL GRPOTrainer script against `vlmexp train grpo`, same model, data and args.

    .venv/bin/python bench/grpo_overhead.py [--rounds 3] [--steps 12] [--prompts-per-step 8] [--in-process]
        [--out bench/results/grpo_overhead.json] [--shared DIR]

Alternates A (plain TRL, bench/plain_trl_grpo.py) and B (vlmexp) `--rounds` times in one run and reports the
median and spread of TRL's own `step_time` per optimizer step (first two steps of each run dropped as
warm-up), and the ratio B / A. Each run is a fresh process (`vlmexp train grpo` for B); with --in-process
both trainers (B: vlmexp.train.grpo.build_grpo_trainer, what `vlmexp train grpo` trains) are built once in
this process and take turns one optimizer step at a time (see Turns), which takes the machine's drift out
of the comparison, and each side's whole turn (logging, callbacks, optimizer update) is timed too. Both sides
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
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# the GRPO step its recorded results measured: 8 prompts x G 8 per optimizer step as 8 micro-batches of one
# prompt, 48 new tokens (the demo's step until 2026-11-23; configs/demo.yaml now takes the 64 in one
# micro-batch)
ARGS = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 8, "num_generations": 8,
        "max_completion_length": 48, "temperature": 0.7, "learning_rate": 1e-4, "warmup_steps": 15,
        "beta": 0.0, "logging_steps": 1, "save_strategy": "no", "report_to": [], "seed": 42}
# set on vlmexp's side too, whatever configs/demo.yaml says
SAME = ("per_device_train_batch_size", "gradient_accumulation_steps", "num_generations",
        "max_completion_length", "temperature", "learning_rate", "warmup_steps", "beta")


def call(command: list[str], env: dict[str, str] | None = None) -> None:
    r = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env={**os.environ, **(env or {})},
                       check=False)
    if r.returncode != 0:
        raise SystemExit(f"{command[:4]} failed ({r.returncode}):\n{r.stderr[-3000:]}")


def step_times(history: list[dict]) -> tuple[list[float], list[float]]:
    """(seconds, mean completion length) per optimizer step, the first two steps dropped as warm-up."""
    steps = [h for h in history if "step_time" in h][2:]
    return [h["step_time"] for h in steps], [h["completions/mean_length"] for h in steps]


def prepare_shared(work: Path, built: str | None = None) -> tuple[str, str]:
    """Build the tiny model and sample the demo data once under work/shared (a one-step `vlmexp train sft`),
    or link `built`, a shared folder this function made before, there; (model folder, train.jsonl)."""
    if built:
        (work / "shared").symlink_to(Path(built).resolve(), target_is_directory=True)
    else:
        call([sys.executable, "-m", "vlmexp.cli", "train", "sft", "--config", "configs/demo.yaml",
              f"run.output_dir={work / 'shared'}", "tracking.backend=none", "sft.args.max_steps=1",
              "sft.args.save_steps=1"])
    [model] = (work / "shared" / "models").glob("tiny-*")
    return str(model), str(work / "shared" / "data" / "train.jsonl")


def prompt_template() -> str:
    """vlmexp's grounding prompt for Qwen2.5-VL, so both sides generate from prompts of the same length."""
    from vlmexp.config.schema import DEFAULT_PROMPT_TEMPLATES, FRAME_HINTS
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


class Turns:
    """Trainers, each in its own thread, take turns one optimizer step at a time, round robin in `order`:
    a step runs only while its side holds the turn, so the sides never share the CPU, and whatever slows
    the machine down for a minute slows every side alike. Each side keeps its own random state across
    the turns, so all sample the same completions from the same seed, as in fresh processes."""

    def __init__(self, order: list[str]):
        self.cond, self.order, self.turn, self.finished = threading.Condition(), order, order[0], set()
        self.rng: dict[str, tuple] = {}
        self.walls: dict[str, list[float]] = {side: [] for side in order}

    def acquire(self, side: str) -> None:
        import random

        import numpy as np
        import torch
        from transformers import set_seed

        with self.cond:
            self.cond.wait_for(lambda: self.turn == side)
        if side in self.rng:
            py, npy, pt = self.rng[side]
            random.setstate(py), np.random.set_state(npy), torch.set_rng_state(pt)
        else:
            set_seed(ARGS["seed"])
        self.started = time.perf_counter()

    def release(self, side: str, finished: bool = False) -> None:
        import random

        import numpy as np
        import torch

        if self.turn == side:
            self.walls[side].append(time.perf_counter() - self.started)
        self.rng[side] = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        with self.cond:
            if finished:
                self.finished.add(side)
            i = self.order.index(side)
            waiting = [s for s in self.order[i + 1:] + self.order[:i + 1] if s not in self.finished]
            self.turn = waiting[0] if waiting else None
            self.cond.notify_all()


def turn_callback(turns: Turns, side: str):
    from transformers import TrainerCallback

    class TakeTurns(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            turns.acquire(side)

        def on_step_end(self, args, state, control, **kwargs):  # after this step's optimizer update
            turns.release(side)
            turns.acquire(side)  # this side's next turn starts with the log of the step just done

        def on_train_end(self, args, state, control, **kwargs):
            turns.release(side, finished=True)

    return TakeTurns()


def train_in_turns(trainers: dict[str, Any], rounds: int):
    """Train every trainer `rounds` times, taking turns step by step (the side that starts rotates every
    round). Returns each side's per-step (times, lengths) and its turn walls: TRL's step_time leaves out
    the optimizer step, the callbacks and the logging; a turn includes them (the previous step's logging,
    fetching the batch, the step, the update)."""
    names = list(trainers)
    times: dict[str, tuple[list, list]] = {side: ([], []) for side in names}
    walls: dict[str, list[float]] = {side: [] for side in names}
    for i in range(rounds):
        turns = Turns(names[i % len(names):] + names[:i % len(names)])
        errors: list[BaseException] = []
        threads, callbacks = [], {side: turn_callback(turns, side) for side in trainers}
        for side, trainer in trainers.items():
            trainer.add_callback(callbacks[side])

            def train(trainer=trainer, side=side, turns=turns, errors=errors):
                try:
                    trainer.train()  # a new TrainerState, optimizer and schedule each time
                except Exception as e:  # noqa: BLE001 - re-raised below, once the other sides have finished
                    errors.append(e)
                    turns.release(side, finished=True)  # the other sides must not wait for this one

            threads.append(threading.Thread(target=train, name=side))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        for side, trainer in trainers.items():
            trainer.remove_callback(callbacks[side])
            seconds, lengths = step_times(trainer.state.log_history)
            times[side][0].extend(seconds)
            times[side][1].extend(lengths)
            # the steps step_times keeps (the last turn only logs)
            walls[side].extend(turns.walls[side][2:-1])
        print(f"round {i + 1}: " + ", ".join(f"{side} median {statistics.median(t[0]):.3f}s"
                                              for side, t in times.items()), flush=True)
    return times, walls


def in_process(model: str, train: str, work: Path, steps: int, rounds: int):
    """The plain trainer and vlmexp's, built once in this process, trained in turns (train_in_turns)."""
    sys.path.insert(0, str(REPO / "bench"))
    from plain_trl_grpo import build

    from vlmexp.train.grpo import build_grpo_trainer

    trainers = {"plain": build(model, train, str(work / "plain"), {**ARGS, "max_steps": steps},
                               prompt_template()),
                "vlmexp": build_grpo_trainer(vlmexp_config(work, steps))[0]}
    return train_in_turns(trainers, rounds)


def vlmexp_config(work: Path, steps: int, extra: tuple[str, ...] = ()):
    """The config `vlmexp train grpo` would load for a bench run in this process (ARGS pinned, no saves)."""
    from vlmexp.checks.loader import load_config

    os.environ.update(SAMPLED)
    _, overrides = vlmexp_side(work, steps)
    return load_config(REPO / "configs" / "demo.yaml", [*overrides, 'grpo.args.save_strategy="no"', *extra])


def bench_parser(doc: str, out: str) -> argparse.ArgumentParser:
    """The options every GRPO bench here takes; parse with parse_bench_args."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts-per-step", type=int, default=ARGS["gradient_accumulation_steps"],
                        help="gradient_accumulation_steps: prompts per optimizer step (default: the demo's)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / out))
    parser.add_argument("--shared", default=None, metavar="DIR",
                        help="train from the model and data of this shared folder, made by an earlier "
                        "prepare_shared, instead of building them (default: built for this run)")
    return parser


def parse_bench_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    args = parser.parse_args()
    ARGS["gradient_accumulation_steps"] = args.prompts_per_step  # both sides pin ARGS
    return args


def main() -> None:
    parser = bench_parser(__doc__, "grpo_overhead.json")
    parser.add_argument("--in-process", action="store_true",
                        help="build both trainers once in this process and train them in turn")
    args = parse_bench_args(parser)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, train = prepare_shared(work, args.shared)
        if args.in_process:
            times, walls = in_process(model, train, work, args.steps, args.rounds)
        else:
            walls = None
            times = {"plain": ([], []), "vlmexp": ([], [])}
            for i in range(args.rounds):
                for side, run in (("plain", lambda: run_plain(model, train, work, args.steps)),
                                  ("vlmexp", lambda: run_vlmexp(work, args.steps))):
                    seconds, lengths = run()
                    times[side][0].extend(seconds)
                    times[side][1].extend(lengths)
                print(f"round {i + 1}: plain median {statistics.median(times['plain'][0]):.3f}s, "
                      f"vlmexp median {statistics.median(times['vlmexp'][0]):.3f}s", flush=True)
    (plain, plain_len), (ours, our_len) = times["plain"], times["vlmexp"]
    result = {"mode": "in-process" if args.in_process else "processes", "rounds": args.rounds,
              "steps_per_run": args.steps, "args": ARGS, "plain_trl_step_s": summary(plain),
              "vlmexp_step_s": summary(ours), "ratio": statistics.median(ours) / statistics.median(plain),
              # the same work on both sides: tokens generated per completion
              "plain_completion_length": statistics.mean(plain_len),
              "vlmexp_completion_length": statistics.mean(our_len)}
    if walls:  # each step's whole turn: the previous step's logging, the batch, the step, the update
        result.update(turn_s={side: summary(w) for side, w in walls.items()},
                      turn_ratio=statistics.median(walls["vlmexp"]) / statistics.median(walls["plain"]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def summary(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4)
    return {"median": statistics.median(values), "p25": q[0], "p75": q[2], "n": len(values)}


if __name__ == "__main__":
    main()
