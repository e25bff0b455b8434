"""Sampled records -> TRL datasets (prompts and targets from vlmexp.prompts, shared with evaluation).

SFT rows: conversational `prompt` / `completion` plus `images` (PIL); TRL's collator inserts the image
parts and computes the loss on the completion only. GRPO rows: conversational `prompt` plus `images`;
the record's `reward_columns` (solution, task, accu_reward_method, image_sizes, source_row, image_path) reach
the reward functions as keyword columns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmexp.config import DataConfig
from vlmexp.data.record import read_sampled, reward_columns
from vlmexp.families import Family
from vlmexp.prompts import build_prompt, load_images, target_text


def build_dataset(path: str | Path, data: DataConfig, family: Family, budget, stage: str,
                  target_template: str | None = None):
    """A datasets.Dataset for `stage` ("sft" or "grpo") from a sampled JSONL file; SFT's targets per
    `target_template` (sft.target_template, `vlmexp.prompts.target_text`)."""
    from datasets import Dataset

    rows = []
    for record in read_sampled(path):
        row: dict[str, Any] = {"prompt": build_prompt(record, data, family), "images": load_images(record.images)}
        if stage == "sft":
            row["completion"] = [{"role": "assistant", "content": target_text(record, family, budget, target_template)}]
        else:
            row.update(reward_columns(record))
        rows.append(row)
    return Dataset.from_list(rows)


def check_sequence_lengths(path: str | Path, data: DataConfig, family: Family, budget, processor,
                           max_length: int | None, field: str, target_template: str | None = None) -> None:
    """Refuse, before any step, records whose image tokens plus prompt and answer do not fit `max_length`.

    TRL truncates such a sequence: cut inside the image placeholders, the model then fails with "Image
    features and image tokens do not match"; cut after them, the answer the loss is computed on is lost.
    """
    from vlmexp.coords import smart_resize
    from vlmexp.errors import DataError, Problem

    if not max_length:
        return
    tokenizer = getattr(processor, "tokenizer", processor)
    problems = []
    for n, record in enumerate(read_sampled(path), start=1):
        image_tokens = 0
        for width, height in record.image_sizes:
            h, w = smart_resize(height, width, budget.factor, budget.min_pixels, budget.max_pixels)
            image_tokens += (h // budget.patch_size) * (w // budget.patch_size) // budget.merge_size ** 2
        target = target_text(record, family, budget, target_template)
        text = "".join(m["content"] for m in build_prompt(record, data, family)) + target
        total = image_tokens + len(tokenizer(text)["input_ids"]) + 16  # + chat template and vision markers
        if total > max_length:
            problems.append(Problem(
                f"{path}:{n}", field, f"record from {record.where} needs about "
                f"{total} tokens ({image_tokens} for its image(s) of {record.image_sizes} at max_pixels "
                f"{budget.max_pixels}), over {field} = {max_length}: truncation would cut the image tokens or the "
                f"answer; raise {field} or lower model.max_pixels"))
            if len(problems) >= 20:
                break
    if problems:
        raise DataError(problems, title="sequences longer than the training limit")
