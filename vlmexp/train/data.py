"""Sampled records -> TRL datasets (prompts and targets from vlmexp.prompts, shared with evaluation).

SFT rows: conversational `prompt` / `completion` plus `images` (PIL); TRL's collator inserts the image
parts and computes the loss on the completion only. GRPO rows: conversational `prompt` plus `images`;
`solution`, `task`, `accu_reward_method`, `image_sizes` and `source_row` reach the reward functions as keyword
columns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vlmexp.config import DataConfig
from vlmexp.data.formats import parse_record
from vlmexp.families import Family
from vlmexp.files import read_jsonl
from vlmexp.prompts import build_prompt, load_images, target_text


def build_dataset(path: str | Path, data: DataConfig, family: Family, budget, stage: str,
                  target_template: str | None = None):
    """A datasets.Dataset for `stage` ("sft" or "grpo") from a sampled JSONL file; SFT's targets per
    `target_template` (sft.target_template, `vlmexp.prompts.target_text`)."""
    from datasets import Dataset

    rows = []
    for record in read_jsonl(path):
        row: dict[str, Any] = {"prompt": build_prompt(record, data, family), "images": load_images(record)}
        if stage == "sft":
            row["completion"] = [{"role": "assistant", "content": target_text(record, family, budget, target_template)}]
        else:
            example = parse_record(record, record["record_format"], record["task"])
            solution = json.dumps(example.solution) if example.task == "rec" else str(example.solution)
            row.update(solution=solution, task=example.task, accu_reward_method=example.method,
                       image_sizes=record["image_sizes"],
                       source_row=record.get("source_row"),
                       image_path=record["image_paths"][0] if record["image_paths"] else "")
        rows.append(row)
    return Dataset.from_list(rows)


def check_sequence_lengths(path: str | Path, data: DataConfig, family: Family, budget, processor,
                           max_length: int | None, field: str, target_template: str | None = None) -> None:
    """Refuse, before any step, records whose image tokens plus prompt and answer do not fit `max_length`.

    TRL truncates such a sequence: cut inside the image placeholders, the model then fails with "Image
    features and image tokens do not match"; cut after them, the answer the loss is computed on is lost.
    """
    from vlmexp.errors import DataError, Problem

    if not max_length:
        return
    tokenizer = getattr(processor, "tokenizer", processor)
    limit = family.budget_knobs[-1]  # the knob that caps an image's tokens: max_pixels, max_patches
    problems = []
    for n, record in enumerate(read_jsonl(path), start=1):
        image_tokens = sum(family.image_tokens(w, h, budget) for w, h in record.get("image_sizes") or [])
        target = target_text(record, family, budget, target_template)
        text = "".join(m["content"] for m in build_prompt(record, data, family)) + target
        total = image_tokens + len(tokenizer(text)["input_ids"]) + 16  # + chat template and vision markers
        if total > max_length:
            problems.append(Problem(
                f"{path}:{n}", field, f"record from {record.get('source')} row {record.get('source_row')} needs about "
                f"{total} tokens ({image_tokens} for its image(s) of {record.get('image_sizes')} at {limit} "
                f"{getattr(budget, limit)}), over {field} = {max_length}: truncation would cut the image tokens or "
                f"the answer; raise {field} or lower model.{limit}"))
            if len(problems) >= 20:
                break
    if problems:
        raise DataError(problems, title="sequences longer than the training limit")
