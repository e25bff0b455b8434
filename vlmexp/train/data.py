"""Sampled records -> TRL datasets. One prompt builder and one pixel budget for SFT, GRPO and evaluation.

SFT rows: conversational `prompt` / `completion` plus `images` (PIL); TRL's collator inserts the image
parts and computes the loss on the completion only. GRPO rows: conversational `prompt` plus `images`;
`solution`, `task`, `image_sizes` and `source_row` reach the reward functions as keyword columns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vlmexp.config import FRAME_HINTS, DataConfig
from vlmexp.coords import format_box, to_frame
from vlmexp.data.formats import parse_record
from vlmexp.families import Family


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def build_prompt(record: dict[str, Any], data: DataConfig, family: Family) -> list[dict[str, Any]]:
    """The chat prompt for a sampled record (text only; TRL adds one image part per image)."""
    example = parse_record(record, record["record_format"], record["task"])
    text = data.prompt_templates[example.task].format(problem=example.problem, frame=FRAME_HINTS[family.box_frame])
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    return messages + [{"role": "user", "content": text}]


def target_text(record: dict[str, Any], family: Family, budget) -> str:
    """The SFT answer: reasoning stub + the solution, boxes in the family's frame."""
    example = parse_record(record, record["record_format"], record["task"])
    if example.task == "rec":
        width, height = record["image_sizes"][0]
        box = to_frame(example.solution, width, height, family.box_frame, budget)
        return f"<think>{example.problem} is here.</think><answer>{format_box(box)}</answer>"
    return f"<think>Solve it.</think><answer>{example.solution}</answer>"


def load_images(record: dict[str, Any]) -> list:
    from PIL import Image

    out = []
    for path in record["image_paths"]:
        with Image.open(path) as im:
            out.append(im.convert("RGB"))  # decoded once, here
    return out


def build_dataset(path: str | Path, data: DataConfig, family: Family, budget, stage: str):
    """A datasets.Dataset for `stage` ("sft" or "grpo") from a sampled JSONL file."""
    from datasets import Dataset

    rows = []
    for record in read_jsonl(path):
        row: dict[str, Any] = {"prompt": build_prompt(record, data, family), "images": load_images(record)}
        if stage == "sft":
            row["completion"] = [{"role": "assistant", "content": target_text(record, family, budget)}]
        else:
            example = parse_record(record, record["record_format"], record["task"])
            solution = json.dumps(example.solution) if example.task == "rec" else str(example.solution)
            row.update(solution=solution, task=example.task, image_sizes=record["image_sizes"],
                       source_row=record.get("source_row"),
                       image_path=record["image_paths"][0] if record["image_paths"] else "")
        rows.append(row)
    return Dataset.from_list(rows)


def check_sequence_lengths(path: str | Path, data: DataConfig, family: Family, budget, processor,
                           max_length: int | None, field: str) -> None:
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
    for n, record in enumerate(read_jsonl(path), start=1):
        image_tokens = 0
        for width, height in record.get("image_sizes") or []:
            h, w = smart_resize(height, width, budget.factor, budget.min_pixels, budget.max_pixels)
            image_tokens += (h // budget.patch_size) * (w // budget.patch_size) // budget.merge_size ** 2
        text = "".join(m["content"] for m in build_prompt(record, data, family)) + target_text(record, family, budget)
        total = image_tokens + len(tokenizer(text)["input_ids"]) + 16  # + chat template and vision markers
        if total > max_length:
            problems.append(Problem(
                f"{path}:{n}", field, f"record from {record.get('source')} row {record.get('source_row')} needs about "
                f"{total} tokens ({image_tokens} for its image(s) of {record.get('image_sizes')} at max_pixels "
                f"{budget.max_pixels}), over {field} = {max_length}: truncation would cut the image tokens or the "
                f"answer; raise {field} or lower model.max_pixels"))
            if len(problems) >= 20:
                break
    if problems:
        raise DataError(problems, title="sequences longer than the training limit")
