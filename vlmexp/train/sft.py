"""SFT stage entry point: seed, data, processor, model, trainer, train (resuming), save. Reads top to
bottom."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlmexp.config.schema import Config
from vlmexp.train.stage import load_model, prepare_stage, train_and_save, trl_args


def run_sft(cfg: Config, callbacks: Sequence[Any] = (), mlflow_run_id: str | None = None) -> Path:
    """Train with trl.SFTTrainer; return the folder holding the final model (or adapter) and processor."""
    from trl import SFTTrainer

    from vlmexp.data.record import read_sampled
    from vlmexp.prompts import check_sft_targets
    from vlmexp.train.data import build_dataset, check_sequence_lengths, require_assistant_masks

    inputs = prepare_stage(cfg, "sft", mlflow_run_id=mlflow_run_id)
    check_sft_targets(inputs.train_path, cfg.sft.target_template)
    args = trl_args(inputs)
    check_sequence_lengths(inputs.train_path, cfg.data, inputs.family, inputs.budget, inputs.processor,
                           args.max_length, "sft.args.max_length", cfg.sft.target_template)
    train_dataset = build_dataset(inputs.train_path, cfg.data, inputs.family, inputs.budget, "sft",
                                  cfg.sft.target_template)
    if any(r.tool_turns for r in read_sampled(inputs.train_path)):  # rendered as GRPO's rollouts render them
        inputs.family.use_tools(inputs.processor)
    if "messages" in train_dataset.column_names:  # multi-turn records: the loss on every assistant turn
        require_assistant_masks(args, inputs.processor)
    model, peft_config = load_model(inputs)
    trainer = SFTTrainer(model=model, args=args, train_dataset=train_dataset,
                         processing_class=inputs.processor, peft_config=peft_config,
                         callbacks=list(callbacks))
    return train_and_save(trainer, inputs, len(train_dataset))
