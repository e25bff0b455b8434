"""Sampled records -> chat prompts, SFT targets and images: one prompt builder and one pixel budget for SFT,
GRPO, DPO and evaluation (training and evaluation both read them from here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vlmexp.config import FRAME_HINTS, DataConfig
from vlmexp.coords import format_box, parse_box, to_frame
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
    """The SFT answer: reasoning stub + the solution, boxes in the family's frame.

    A rec record's `demonstration` box, where present, is what SFT imitates (an annotator's box); the reward
    and evaluation still score against its `solution`.
    """
    example = parse_record(record, record["record_format"], record["task"])
    if example.task == "rec":
        width, height = record["image_sizes"][0]
        shown = parse_box(record["demonstration"]) if record.get("demonstration") is not None else example.solution
        box = to_frame(shown, width, height, family.box_frame, budget)
        return f"<think>{example.problem} is here.</think><answer>{format_box(box)}</answer>"
    return f"<think>Solve it.</think><answer>{example.solution}</answer>"


def load_images(record: dict[str, Any]) -> list:
    from PIL import Image

    out = []
    for path in record["image_paths"]:
        with Image.open(path) as im:
            out.append(im.convert("RGB"))  # decoded once, here
    return out
