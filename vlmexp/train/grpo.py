"""GRPO stage entry point: seed, data, processor, model, rewards, trainer, train (resuming), save."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlmexp.config import Config
from vlmexp.train.common import (
    load_model,
    prepare_stage,
    train_and_save,
    trl_args,
    vision_token_ids,
    with_callbacks,
)


def run_grpo(cfg: Config, model_path: str | None = None, callbacks: Sequence[Any] = ()) -> Path:
    """Train with trl.GRPOTrainer from the base model or `model_path` (the SFT stage's model or adapter)."""
    trainer, inputs, rows = build_grpo_trainer(cfg, model_path, callbacks)
    return train_and_save(trainer, inputs, rows)


def build_grpo_trainer(cfg: Config, model_path: str | None = None, callbacks: Sequence[Any] = ()):
    """(trainer, stage inputs, training rows): the GRPOTrainer `run_grpo` trains, with the pipeline's rewards,
    generation settings and callbacks. Apart so a benchmark can time it against a plain TRL script's trainer."""
    from trl import GRPOTrainer

    from vlmexp.rewards import build_reward
    from vlmexp.train.callbacks import CompletionTable, RewardFailureMetrics
    from vlmexp.train.data import build_dataset

    inputs = prepare_stage(cfg, "grpo", model_path)
    generation = dict(cfg.grpo.args.get("generation_kwargs") or {})
    if not cfg.grpo.args.get("use_vllm"):  # HF generate: keep vision placeholders out of completions
        generation.setdefault("suppress_tokens", vision_token_ids(inputs.processor))
    args = trl_args(inputs, reward_weights=[r.weight for r in cfg.grpo.rewards], generation_kwargs=generation)
    check_one_prompt_per_generation_batch(args, inputs.train_path)
    train_dataset = build_dataset(inputs.train_path, cfg.data, inputs.family, inputs.budget, "grpo")
    model, peft_config = load_model(inputs)
    rewards = [build_reward(r.name, r.kwargs, inputs.family.box_frame, inputs.budget) for r in cfg.grpo.rewards]
    trainer = GRPOTrainer(model=model, reward_funcs=rewards, args=args, train_dataset=train_dataset,
                          processing_class=inputs.processor, peft_config=peft_config, callbacks=list(callbacks))
    with_callbacks(trainer, first=[RewardFailureMetrics(rewards)],
                   last=[CompletionTable(rewards, cfg.tracking.completions_every, cfg.tracking.completions_per_table)])
    return trainer, inputs, len(train_dataset)


def check_one_prompt_per_generation_batch(args, train_path: Path) -> None:
    """Refuse, before any step, a layout TRL 1.16 cannot train with images of different sizes.

    When one generation batch holds several prompts (per_device_train_batch_size x
    gradient_accumulation_steps > num_generations) and their images differ in size, GRPOTrainer's
    re-split of the batch pairs completions with the wrong image grids and the forward pass fails in
    Qwen-VL's get_rope_index ("shape mismatch: value tensor of shape [3, N] cannot be broadcast").
    Measured on transformers 5.23 / trl 1.16 (tests/test_train_modes.py).
    """
    from vlmexp.errors import ConfigError, Problem
    from vlmexp.train.data import read_jsonl

    # TRL resolves the generation batch per device: per_device_train_batch_size x steps_per_generation
    per_generation = args.per_device_train_batch_size * args.steps_per_generation
    if per_generation <= args.num_generations:
        return
    sizes = {tuple(map(tuple, r.get("image_sizes") or [])) for r in read_jsonl(train_path)}
    if len(sizes) > 1:
        raise ConfigError(Problem("grpo.args", "per_device_train_batch_size", (
            f"{per_generation} completions per generation batch mix the prompts of {len(sizes)} different image "
            "sizes, which TRL's GRPOTrainer pairs with the wrong image grids (Qwen-VL get_rope_index shape "
            "mismatch); set per_device_train_batch_size to num_generations with gradient_accumulation_steps: 1 "
            "(one prompt per step), or resize the images to one size"), per_generation))
