"""GRPO stage entry point: seed, data, processor, model, rewards, trainer, train (resuming), save."""

from __future__ import annotations

from pathlib import Path

from vlmexp.config import Config
from vlmexp.train.common import load_model, prepare_stage, report_to, train_and_save


def run_grpo(cfg: Config, model_path: str | None = None) -> Path:
    """Train with trl.GRPOTrainer from the base model (or `model_path`, e.g. SFT's output)."""
    from trl import GRPOTrainer

    from vlmexp.rewards import build_reward
    from vlmexp.train.data import build_dataset
    from vlmexp.trl_args import build_trl_config

    inputs = prepare_stage(cfg, "grpo", model_path)
    train_dataset = build_dataset(inputs.train_path, cfg.data, inputs.family, inputs.budget, "grpo")
    model = load_model(cfg, inputs.model_path, inputs.family)
    rewards = [build_reward(r.name, r.kwargs, inputs.family.box_frame, inputs.budget) for r in cfg.grpo.rewards]
    args = build_trl_config("grpo", cfg.grpo.args, str(inputs.stage_dir), seed=cfg.run.seed,
                            report_to=report_to(cfg), run_name=f"{cfg.run.name}-grpo",
                            reward_weights=[r.weight for r in cfg.grpo.rewards])
    trainer = GRPOTrainer(model=model, reward_funcs=rewards, args=args, train_dataset=train_dataset,
                          processing_class=inputs.processor)
    return train_and_save(trainer, inputs, "GRPO", len(train_dataset))
