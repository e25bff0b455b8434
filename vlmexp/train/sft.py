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
    trainer, inputs, rows = build_sft_trainer(cfg, callbacks, mlflow_run_id)
    return train_and_save(trainer, inputs, rows)


def build_sft_trainer(cfg: Config, callbacks: Sequence[Any] = (), mlflow_run_id: str | None = None):
    """(trainer, stage inputs, training rows): the SFTTrainer `run_sft` trains. Apart so a test can read the
    batches its collator renders."""
    from trl import SFTTrainer

    from vlmexp.data.record import read_sampled
    from vlmexp.prompts import check_sft_targets
    from vlmexp.tools import offered_tools
    from vlmexp.train.data import build_dataset, check_sequence_lengths, require_assistant_masks

    inputs = prepare_stage(cfg, "sft", mlflow_run_id=mlflow_run_id)
    check_sft_targets(inputs.train_path, cfg.sft.target_template)
    args = trl_args(inputs)
    check_sequence_lengths(inputs.train_path, cfg.data, inputs.family, inputs.budget, inputs.processor,
                           args.max_length, "sft.args.max_length", cfg.sft.target_template)
    train_dataset = build_dataset(inputs.train_path, cfg.data, inputs.family, inputs.budget, "sft",
                                  cfg.sft.target_template)
    tools: list = []
    if any(r.tool_turns for r in read_sampled(inputs.train_path)):  # rendered as GRPO's rollouts render them
        inputs.family.use_tools(inputs.processor)
        tools = offered_tools(cfg.grpo.tools, inputs.family, inputs.budget)
    if "messages" in train_dataset.column_names:  # multi-turn records: the loss on every assistant turn
        require_assistant_masks(args, inputs.processor)
    model, peft_config = load_model(inputs)
    trainer = SFTTrainer(model=model, args=args, train_dataset=train_dataset,
                         processing_class=inputs.processor, peft_config=peft_config,
                         callbacks=list(callbacks))
    if tools:  # TRL's vision collator renders no tools block: the prompts would differ from GRPO's
        trainer.data_collator.processor = ToolsShown(trainer.data_collator.processor, tools)
    return trainer, inputs, len(train_dataset)


class ToolsShown:
    """A processor whose chat template is given `tools` for each conversation that uses them (a tool turn), so
    SFT's tool demonstrations open with the tools block that GRPO's rollouts and evaluation with the tool
    show, and records answered without a tool have none, as evaluation without the tool prompts (TRL 1.16's
    DataCollatorForVisionLanguageModeling passes no tools). A batch of both is rendered as two batches and
    joined: the demonstrations first, then the rest."""

    # the batch's per-token tensors, and what pads each: the rest (pixel values, grids) concatenate
    TOKEN_KEYS = {"input_ids": None, "attention_mask": 0, "assistant_masks": 0, "mm_token_type_ids": 0}

    def __init__(self, processor: Any, tools: list):
        self._processor, self._tools = processor, tools

    def __getattr__(self, name: str) -> Any:
        return getattr(self._processor, name)

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        batch = conversation if conversation and isinstance(conversation[0], list) else [conversation]
        shown = [c for c in batch if _uses_tools(c)]
        plain = [c for c in batch if not _uses_tools(c)]
        if not plain or not shown:  # one conversation, or a batch of one kind
            return self._processor.apply_chat_template(conversation, tools=self._tools if shown else None,
                                                       **kwargs)
        if not kwargs.get("tokenize"):  # texts, in the batch's order
            return [self.apply_chat_template(c, **kwargs) for c in conversation]
        return self._joined([self._processor.apply_chat_template(shown, tools=self._tools, **kwargs),
                             self._processor.apply_chat_template(plain, **kwargs)])

    def _joined(self, parts: list) -> Any:
        import torch
        from transformers import BatchFeature

        tokenizer = self._processor.tokenizer
        width = max(p["input_ids"].shape[1] for p in parts)
        joined = {}
        for key in parts[0].keys():
            tensors = [p[key] for p in parts]
            if key in self.TOKEN_KEYS:
                pad = tokenizer.pad_token_id if self.TOKEN_KEYS[key] is None else self.TOKEN_KEYS[key]
                tensors = [_padded(t, width, pad, tokenizer.padding_side) for t in tensors]
            joined[key] = torch.cat(tensors)
        return BatchFeature(joined)


def _uses_tools(conversation: list[dict[str, Any]]) -> bool:
    return any(message.get("role") == "tool" for message in conversation)


def _padded(tensor: Any, width: int, value: int, side: str) -> Any:
    import torch.nn.functional as F

    extra = width - tensor.shape[1]
    return F.pad(tensor, (extra, 0) if side == "left" else (0, extra), value=value) if extra else tensor
