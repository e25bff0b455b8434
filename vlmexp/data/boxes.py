"""The targets' boxes a record carries (`bbox`), read in the form its source writes them, and V* Bench's
per-image annotations turned into the lettered question its test_questions.jsonl asks.

Two box forms, both in original pixels:
- `xyxy`: [x1, y1, x2, y2], the corners (VLM-R1's REC solutions, Qwen's bbox_2d, vlmexp's own `bbox`);
- `xywh`: [x, y, w, h], the top-left corner, the width and the height (V* Bench's annotations:
  penghao-wu/vstar README, "Benchmark"; vstar_bench_eval.py, `normalize_bbox`, adds w and h; COCO's).

A format that publishes its form names it (FORMAT_BOX_FORM); a source's `box_form` names it for a source
whose format does not, and is then the form of every box the source's records carry (`bbox`, a rec record's
solution and demonstration). A `bbox` that lists boxes ([[...], ...], as V* writes them) in a format that
names no form, with no `box_form`, cannot be told apart and is refused, naming the field. A single box in
vlmexp's own `bbox` field is xyxy, as docs/data-formats.md has always said. Every box leaves here as xyxy.
"""

from __future__ import annotations

from typing import Any

from vlmexp.coords import parse_box

BOX_FORMS = ("xyxy", "xywh")
FORMAT_BOX_FORM = {"vstar_annotation": "xywh"}  # formats whose publisher names the form of their boxes
# test_questions.jsonl's instruction after the options (craigwu/vstar_bench)
VSTAR_INSTRUCTION = "Answer with the option's letter from the given choices directly."
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def to_xyxy(box: list[float], form: str, what: str) -> list[float]:
    """`box` as [x1, y1, x2, y2]; ValueError naming `what` where an xywh box has no width or height."""
    if form == "xyxy":
        return box
    x, y, w, h = box
    if w <= 0 or h <= 0:
        raise ValueError(f"{what} {box} is [x, y, w, h] (box_form xywh) with a width or height of 0 or less; "
                         "fix the box")
    return [x, y, x + w, y + h]


def _box_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, (list, tuple)) for v in value)


def target_boxes(record: dict[str, Any], fmt: str, form: str | None) -> list[list[float]] | None:
    """The record's targets' boxes (`bbox`) as xyxy, or None where it has none; ValueError naming the field
    where a box is malformed or its form cannot be told."""
    from vlmexp.data.images import describe

    value = record.get("bbox")
    if value is None:
        return None
    form = form or FORMAT_BOX_FORM.get(fmt)
    if _box_list(value):
        if form is None:
            raise ValueError(f"bbox {describe(value)} lists {len(value)} box(es), as V* Bench's annotations "
                             f"do ([x, y, w, h] each), but the {fmt!r} format names no box form, so "
                             "[x, y, w, h] and [x1, y1, x2, y2] cannot be told apart; set the source's "
                             "`box_form: xywh` (top-left, width, height) or `box_form: xyxy` (corners)")
        boxes = [parse_box(list(b)) if len(b) == 4 else None for b in value]
        if any(b is None for b in boxes):
            raise ValueError(f"bbox {describe(value)} holds an item that is not four numbers; write each "
                             f"target's box as {'[x, y, w, h]' if form == 'xywh' else '[x1, y1, x2, y2]'}")
    else:
        box = parse_box(value)
        if box is None:
            raise ValueError(f"bbox {describe(value)} holds no box; write the target's [x1, y1, x2, y2] "
                             "in original pixels or drop the field")
        boxes, form = [box], form or "xyxy"
    names = record.get("target_object")
    if fmt == "vstar_annotation" and isinstance(names, list) and len(names) != len(boxes):
        raise ValueError(f"bbox lists {len(boxes)} box(es) for {len(names)} target_object name(s); V* gives "
                         "one box per target: fix the annotation")
    return [to_xyxy(b, form, "bbox") for b in boxes]  # type: ignore[arg-type]


def vstar_question(record: dict[str, Any], need) -> tuple[str, str]:
    """(the question, the right option's letter) of a V* Bench annotation: the question, then its options
    lettered (A), (B), ... and the letter instruction, as test_questions.jsonl writes them; options[0] is the
    right one (penghao-wu/vstar README: "the first one is the correct option by default";
    vstar_bench_eval.py scores `option_chosen == 0`), so the answer is (A), the options in published order."""
    question, options = need("question"), need("options")
    if (not isinstance(options, list) or not 2 <= len(options) <= len(LETTERS)
            or not all(isinstance(o, str) and o.strip() for o in options)):
        raise ValueError(f"field 'options' must list 2 to {len(LETTERS)} non-empty answers, the right one "
                         f"first (V*'s layout), got {str(options)[:120]}")
    if not isinstance(question, str) or not question.strip():
        raise ValueError("field 'question' is empty; give each annotation its question")
    lettered = "\n".join(f"({letter}) {option.strip()}" for letter, option in zip(LETTERS, options))
    return f"{question.strip()}\n{lettered}\n{VSTAR_INSTRUCTION}", "A"
