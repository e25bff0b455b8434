"""What the GRPO defaults cost or save: vlmexp's GRPO trainer at the demo's step with one setting changed.

    .venv/bin/python bench/grpo_defaults.py [--rounds 3] [--steps 12] [--prompts-per-step 8]
        [--out bench/results/grpo_defaults.json]

Variants (VARIANTS): the defaults (beta 0: no reference model; TRL's gradient checkpointing on), beta 0.04
(TRL loads a reference model and runs it on every batch) and gradient checkpointing off. Their trainers
(vlmexp.train.grpo.build_grpo_trainer) are built once in this process and take turns one optimizer step
at a time (bench/grpo_overhead.py's train_in_turns), `--rounds` runs of `--steps` steps each. Reported per
variant: the median and spread of TRL's `step_time` and of whole turns (first two steps of a run
dropped), the ratio to the defaults, and the mean completion length (the work done). Same data, model and
ARGS as bench/grpo_overhead.py. Memory is not compared here (one process holds every variant); at the
tiny model's size it would say nothing anyway.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_overhead import ARGS, REPO, prepare_shared, summary, train_in_turns, vlmexp_config

DEFAULT = "defaults (beta 0, gradient checkpointing on)"
VARIANTS = {
    DEFAULT: (),
    "beta 0.04 (reference model)": ("grpo.args.beta=0.04",),
    "gradient checkpointing off": ("grpo.args.gradient_checkpointing=false",),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts-per-step", type=int, default=ARGS["gradient_accumulation_steps"],
                        help="gradient_accumulation_steps: prompts per optimizer step (default: the demo's)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "grpo_defaults.json"))
    args = parser.parse_args()
    ARGS["gradient_accumulation_steps"] = args.prompts_per_step  # vlmexp_config pins ARGS
    from vlmexp.train.grpo import build_grpo_trainer

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prepare_shared(work)
        trainers = {name: build_grpo_trainer(vlmexp_config(work, args.steps, extra))[0]
                    for name, extra in VARIANTS.items()}
        times, walls = train_in_turns(trainers, args.rounds)
    default, default_turn = statistics.median(times[DEFAULT][0]), statistics.median(walls[DEFAULT])
    result = {"rounds": args.rounds, "steps_per_run": args.steps, "args": ARGS, "variants": {
        name: {"overrides": list(VARIANTS[name]), "step_s": summary(times[name][0]),
               "ratio_to_default": statistics.median(times[name][0]) / default,
               "turn_s": summary(walls[name]), "turn_ratio_to_default": statistics.median(walls[name]) / default_turn,
               "completion_length": statistics.mean(times[name][1])}
        for name in VARIANTS}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
