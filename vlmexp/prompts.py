"""Sampled records -> chat prompts, SFT targets and images: one prompt builder and one pixel budget for SFT,
GRPO, DPO and evaluation (training and evaluation both read them from here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmexp.config.schema import FRAME_HINTS, DataConfig
from vlmexp.coords import format_box, to_frame
from vlmexp.data.formats import ANSWER_TEXT
from vlmexp.data.record import SampledRecord, read_sampled
from vlmexp.families import Family


def build_prompt(record: SampledRecord, data: DataConfig, family: Family) -> list[dict[str, Any]]:
    """The chat prompt for a sampled record, text only (TRL puts one image part per image at the start of the
    first user turn, and so does evaluation): the record's system message, else data.system_prompt; the
    earlier turns as written; the last user turn through the task's prompt template."""
    text = data.prompt_templates[record.task].format(problem=record.problem,
                                                     frame=FRAME_HINTS[family.box_frame])
    system = record.system if record.system is not None else data.system_prompt
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [dict(turn) for turn in record.history] + [{"role": "user", "content": text}]


def target_text(record: SampledRecord, family: Family, budget, template: str | None = None) -> str:
    """The SFT answer, or ValueError (`no_target_reason`) for a record that carries none.

    A rec record's target is built from its box, in the family's frame: its `demonstration` box where present
    (an annotator's box; the reward and evaluation still score against its `solution`). Other records train
    on `template` (sft.target_template) when given, else on the answer text they carry (`record.target`: a
    chosen answer, a conversation's last assistant turn, a completion), as written.
    """
    if record.task == "rec":
        width, height = record.image_sizes[0]
        shown = record.demonstration if record.demonstration is not None else record.solution
        box = to_frame(shown, width, height, family.box_frame, budget)
        return f"<think>{record.problem} is here.</think><answer>{format_box(box)}</answer>"
    if template is not None:
        return template.format(answer=record.solution, problem=record.problem)
    if record.target is None:
        raise ValueError(no_target_reason(record))
    return record.target


def carries_target(record: SampledRecord) -> bool:
    """Whether a sampled record holds what SFT trains on without sft.target_template: a box, or an answer
    text."""
    return record.task == "rec" or record.target is not None


def no_target_reason(record: SampledRecord) -> str:
    """Why SFT has nothing to train on in `record`, and the fix."""
    carried = "; ".join(f"{fmt} records carry {text}" for fmt, text in ANSWER_TEXT.items())
    return (f"this record (format {record.record_format!r}, task {record.task!r}) holds only a ground-truth "
            f"answer, no answer text for SFT to imitate (rec records build theirs from the box; "
            f"{carried}); set sft.target_template to what SFT should train on, e.g. "
            f"'<think>...</think><answer>{{answer}}</answer>', or sft.enabled: false")


def check_sft_targets(path: str | Path, template: str | None) -> None:
    """Refuse, before any training step, SFT on sampled records that carry no answer text (`target_text`)
    while sft.target_template is not set: one problem per source, naming its first such record."""
    from vlmexp.errors import DataError, Problem

    if template is not None:
        return
    first: dict[str, SampledRecord] = {}
    count: dict[str, int] = {}
    for record in read_sampled(path):
        if not carries_target(record):
            first.setdefault(record.source, record)
            count[record.source] = count.get(record.source, 0) + 1
    problems = [Problem(record.where, "sft.target_template", f"{no_target_reason(record)} "
                        f"({count[source]} such record(s) from this source)")
                for source, record in first.items()]
    if problems:
        raise DataError(problems, title="SFT has no answer text to train on")


def load_images(paths: list[str]) -> list:
    """The images at `paths` (a record's `images`), decoded as RGB."""
    from PIL import Image

    out = []
    for path in paths:
        with Image.open(path) as im:
            out.append(im.convert("RGB"))  # decoded once, here
    return out
