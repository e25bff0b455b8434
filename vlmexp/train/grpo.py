"""GRPO stage entry point: seed, data, processor, model, rewards, trainer, train (resuming), save."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlmexp.config import Config
from vlmexp.train.common import load_model, prepare_stage, train_and_save, trl_args, with_callbacks


def run_grpo(cfg: Config, model_path: str | None = None, callbacks: Sequence[Any] = ()) -> Path:
    """Train with trl.GRPOTrainer from the base model or `model_path` (the SFT stage's model or adapter)."""
    from trl import GRPOTrainer

    from vlmexp.rewards import build_reward
    from vlmexp.train.callbacks import CompletionTable, RewardFailureMetrics
    from vlmexp.train.data import build_dataset

    inputs = prepare_stage(cfg, "grpo", model_path)
    train_dataset = build_dataset(inputs.train_path, cfg.data, inputs.family, inputs.budget, "grpo")
    model, peft_config = load_model(inputs)
    rewards = [build_reward(r.name, r.kwargs, inputs.family.box_frame, inputs.budget) for r in cfg.grpo.rewards]
    args = trl_args(inputs, reward_weights=[r.weight for r in cfg.grpo.rewards])
    trainer = GRPOTrainer(model=model, reward_funcs=rewards, args=args, train_dataset=train_dataset,
                          processing_class=inputs.processor, peft_config=peft_config, callbacks=list(callbacks))
    with_callbacks(trainer, first=[RewardFailureMetrics(rewards)],
                   last=[CompletionTable(rewards, cfg.tracking.completions_every, cfg.tracking.completions_per_table)])
    return train_and_save(trainer, inputs, len(train_dataset))
