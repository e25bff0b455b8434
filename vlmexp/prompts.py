"""Sampled records -> chat prompts, SFT targets and images: one prompt builder and one pixel budget for SFT,
GRPO, DPO and evaluation (training and evaluation both read them from here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmexp.config import FRAME_HINTS, DataConfig
from vlmexp.coords import format_box, parse_box, to_frame
from vlmexp.data.formats import ANSWER_TEXT, parse_record
from vlmexp.families import Family
from vlmexp.files import read_jsonl


def build_prompt(record: dict[str, Any], data: DataConfig, family: Family) -> list[dict[str, Any]]:
    """The chat prompt for a sampled record (text only; TRL adds one image part per image)."""
    example = parse_record(record, record["record_format"], record["task"])
    text = data.prompt_templates[example.task].format(problem=example.problem, frame=FRAME_HINTS[family.box_frame])
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    return messages + [{"role": "user", "content": text}]


def target_text(record: dict[str, Any], family: Family, budget, template: str | None = None) -> str:
    """The SFT answer, or ValueError (`no_target_reason`) for a record that carries none.

    A rec record's target is built from its box, in the family's frame: its `demonstration` box where present
    (an annotator's box; the reward and evaluation still score against its `solution`). Other records train
    on `template` (sft.target_template) when given, else on the answer text their format carries
    (formats.ANSWER_TEXT: a pairs record's chosen answer, a conversation's gpt turn), as written.
    """
    example = parse_record(record, record["record_format"], record["task"])
    if example.task == "rec":
        width, height = record["image_sizes"][0]
        shown = parse_box(record["demonstration"]) if record.get("demonstration") is not None else example.solution
        box = to_frame(shown, width, height, family.box_frame, budget)
        return f"<think>{example.problem} is here.</think><answer>{format_box(box)}</answer>"
    if template is not None:
        return template.format(answer=example.solution, problem=example.problem)
    if not carries_target(record):
        raise ValueError(no_target_reason(record))
    return example.solution


def carries_target(record: dict[str, Any]) -> bool:
    """Whether a sampled record holds what SFT trains on without sft.target_template: a box, or an answer text."""
    return record["task"] == "rec" or record["record_format"] in ANSWER_TEXT


def no_target_reason(record: dict[str, Any]) -> str:
    """Why SFT has nothing to train on in `record`, and the fix."""
    carried = "; ".join(f"{fmt} records carry {text}" for fmt, text in ANSWER_TEXT.items())
    return (f"this record (format {record['record_format']!r}, task {record['task']!r}) holds only a ground-truth "
            f"answer, no answer text for SFT to imitate (rec records build theirs from the box; {carried}); set "
            f"sft.target_template to what SFT should train on, e.g. '<think>...</think><answer>{{answer}}</answer>', "
            f"or sft.enabled: false")


def check_sft_targets(path: str | Path, template: str | None) -> None:
    """Refuse, before any training step, SFT on sampled records that carry no answer text (`target_text`)
    while sft.target_template is not set: one problem per source, naming its first such record."""
    from vlmexp.errors import DataError, Problem

    if template is not None:
        return
    first: dict[str, tuple[int, dict[str, Any]]] = {}
    count: dict[str, int] = {}
    for record in read_jsonl(path):
        if not carries_target(record):
            source = str(record.get("source"))
            first.setdefault(source, (record.get("source_row"), record))
            count[source] = count.get(source, 0) + 1
    problems = [Problem(f"{source} row {row}", "sft.target_template", f"{no_target_reason(record)} "
                        f"({count[source]} such record(s) from this source)")
                for source, (row, record) in first.items()]
    if problems:
        raise DataError(problems, title="SFT has no answer text to train on")


def load_images(record: dict[str, Any]) -> list:
    from PIL import Image

    out = []
    for path in record["image_paths"]:
        with Image.open(path) as im:
            out.append(im.convert("RGB"))  # decoded once, here
    return out
