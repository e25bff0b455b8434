"""What the GRPO pairing guard costs per optimizer step (vlmexp/train/grpo_pairing.py).

    .venv/bin/python bench/grpo_guard.py [--steps 8] [--prompts-per-step 8] [--new-tokens 48]
        [--out bench/results/grpo_guard.json]

The demo's GRPO step (8 prompts x G 8, 48 new tokens, T 0.7) from the tiny random model on demo scenes of
mixed sizes (width and height drawn from 80-160 pixels: several image grids in every generation batch),
tracking off, no saves. The trainer is `build_grpo_trainer`'s (the one `vlmexp train grpo` trains); the
guard times itself (`guard_seconds`: the expected grids and pixel checksums per generation batch, the
per-sample checks per micro-batch). Reported: guard seconds per optimizer step, TRL's `step_time`
(generation, rewards, forward and backward of every micro-batch; first step dropped) and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from transformers import TrainerCallback

REPO = Path(__file__).resolve().parents[1]
MIXED = ["data.demo.train=128", "data.demo.val=8", "data.demo.width=[80,160]", "data.demo.height=[80,160]"]
STEP = ["grpo.args.per_device_train_batch_size=8", "grpo.args.num_generations=8", "grpo.args.temperature=0.7",
        "grpo.args.logging_steps=1", 'grpo.args.save_strategy="no"']


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=8, help="gradient_accumulation_steps")
    parser.add_argument("--new-tokens", type=int, default=48, help="max_completion_length")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "grpo_guard.json"))
    args = parser.parse_args()
    from vlmexp.checks.loader import load_config
    from vlmexp.data.record import read_sampled
    from vlmexp.train.grpo import build_grpo_trainer

    overrides = [*MIXED, *STEP, f"grpo.args.gradient_accumulation_steps={args.prompts_per_step}",
                 f"grpo.args.max_completion_length={args.new_tokens}", f"grpo.args.max_steps={args.steps}"]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(REPO / "configs" / "demo.yaml", [f"run.output_dir={tmp}", "tracking.backend=none",
                                                           *overrides])
        trainer, inputs, _ = build_grpo_trainer(cfg)
        grids = {tuple(inputs.family.image_layout(r.image_sizes, inputs.budget).flatten().tolist())
                 for r in read_sampled(inputs.train_path)}
        per_step = []
        trainer.add_callback(_GuardPerStep(trainer, per_step))
        trainer.train()
    steps = [h["step_time"] for h in trainer.state.log_history if "step_time" in h][1:]
    guard = per_step[1:]
    result = {"steps": args.steps, "overrides": overrides,
              "guard_s_per_step": {"median": statistics.median(guard), "max": max(guard)},
              "step_time_s": {"median": statistics.median(steps), "min": min(steps), "max": max(steps)},
              "guard_share_of_step": statistics.median(guard) / statistics.median(steps),
              "image_grids_in_data": len(grids)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


class _GuardPerStep(TrainerCallback):
    """Records the guard's seconds spent in each optimizer step."""

    def __init__(self, trainer, out: list[float]):
        self.trainer, self.out, self.last = trainer, out, 0.0

    def on_step_end(self, args, state, control, **kwargs):
        self.out.append(self.trainer.guard_seconds - self.last)
        self.last = self.trainer.guard_seconds


if __name__ == "__main__":
    main()
