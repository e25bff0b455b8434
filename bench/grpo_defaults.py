"""What the GRPO defaults cost or save: vlmexp's GRPO trainer at the demo's step with one setting changed.

    .venv/bin/python bench/grpo_defaults.py [--rounds 3] [--steps 12] [--prompts-per-step 8]
        [--out bench/results/grpo_defaults.json] [--shared DIR]

Variants (VARIANTS): the defaults (beta 0: no reference model; activation checkpointing on, which TRL
sets under its older name gradient_checkpointing), beta 0.04 (TRL loads a reference model and runs it on
every batch) and activation checkpointing off. Their trainers
(vlmexp.train.grpo.build_grpo_trainer) are built once in this process and take turns one optimizer step
at a time (bench/grpo_overhead.py's train_in_turns), `--rounds` runs of `--steps` steps each. Reported per
variant: the median and spread of TRL's `step_time` and of whole turns (first two steps of a run
dropped), the ratio to the defaults, and the mean completion length (the work done). Same data, model and
ARGS as bench/grpo_overhead.py. Memory is not compared here (one process holds every variant); at the
tiny model's size it would say nothing anyway.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_overhead import (
    ARGS,
    bench_parser,
    parse_bench_args,
    prepare_shared,
    summary,
    train_in_turns,
    vlmexp_config,
)

DEFAULT = "defaults (beta 0, activation checkpointing on)"
VARIANTS = {
    DEFAULT: (),
    "beta 0.04 (reference model)": ("grpo.args.beta=0.04",),
    "activation checkpointing off": ("grpo.args.activation_checkpointing=false",),
}


def main() -> None:
    args = parse_bench_args(bench_parser(__doc__, "grpo_defaults.json"))
    from vlmexp.train.grpo import build_grpo_trainer

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prepare_shared(work, args.shared)
        trainers = {name: build_grpo_trainer(vlmexp_config(work, args.steps, extra))[0]
                    for name, extra in VARIANTS.items()}
        times, walls = train_in_turns(trainers, args.rounds)
    default, default_turn = statistics.median(times[DEFAULT][0]), statistics.median(walls[DEFAULT])
    result = {"rounds": args.rounds, "steps_per_run": args.steps, "args": ARGS, "variants": {
        name: {"overrides": list(VARIANTS[name]), "step_s": summary(times[name][0]),
               "ratio_to_default": statistics.median(times[name][0]) / default,
               "turn_s": summary(walls[name]),
               "turn_ratio_to_default": statistics.median(walls[name]) / default_turn,
               "completion_length": statistics.mean(times[name][1])}
        for name in VARIANTS}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
