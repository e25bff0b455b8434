"""Boxes between original pixels and each family's frame, and parsing boxes out of text.

Qwen2.5-VL answers in absolute pixels of the image *after* smart_resize; Qwen2-VL and Qwen3-VL answer
on a 0-1000 grid. Ground truth stays in original pixels; everything maps through here, with the pixel
budget read from the loaded processor (`Family.image_budget`), so SFT targets, GRPO rewards
and evaluation agree. `smart_resize` (the Qwen-VL image processor's resize, `vlmexp.families.qwen`) gives
the resized size.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

from vlmexp.errors import short
from vlmexp.families.base import BoxFrame
from vlmexp.families.qwen import smart_resize

Box = list[float]  # [x1, y1, x2, y2]

def _scale(frame: BoxFrame, width: int, height: int, budget) -> tuple[float, float]:
    """Multipliers (sx, sy) from original pixels to the frame."""
    if frame == "grid1000":
        return 1000.0 / width, 1000.0 / height
    if budget is None:
        raise ValueError("the 'pixels' frame needs the processor's pixel budget "
                         "(patch/merge size, min/max pixels)")
    h, w = smart_resize(height, width, budget.factor, budget.min_pixels, budget.max_pixels)
    return w / width, h / height


def to_frame(box: Sequence[float], width: int, height: int, frame: BoxFrame, budget=None) -> Box:
    """Original-pixel box -> the family's frame."""
    sx, sy = _scale(frame, width, height, budget)
    x1, y1, x2, y2 = box
    return [x1 * sx, y1 * sy, x2 * sx, y2 * sy]


def from_frame(box: Sequence[float], width: int, height: int, frame: BoxFrame, budget=None) -> Box:
    """A box in the family's frame -> original pixels."""
    sx, sy = _scale(frame, width, height, budget)
    x1, y1, x2, y2 = box
    return [x1 / sx, y1 / sy, x2 / sx, y2 / sy]


def format_box(box: Sequence[float]) -> str:
    """How a target box is written in answers: integers, as the models emit them."""
    return "[" + ", ".join(str(int(round(v))) for v in box) + "]"


def iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two [x1, y1, x2, y2] boxes (0 for degenerate boxes)."""
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def giou(a: Sequence[float], b: Sequence[float]) -> float:
    """Generalized IoU (Rezatofighi et al., 2019): IoU minus the share of the smallest enclosing box that
    neither box covers. In [-1, 1]; unlike IoU it still ranks boxes that do not overlap by how far apart
    they are, which gives GRPO a signal before any sampled box touches the target."""
    enclose = (max(a[2], b[2]) - min(a[0], b[0])) * (max(a[3], b[3]) - min(a[1], b[1]))
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - ix * iy
    if enclose <= 0 or union <= 0:
        return -1.0
    return iou(a, b) - (enclose - union) / enclose


_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_NUMBERS = re.compile(r"\[\s*(-?\d+(?:\.\d+)?)\s*,\s*(-?\d+(?:\.\d+)?)\s*,\s*(-?\d+(?:\.\d+)?)\s*,"
                      r"\s*(-?\d+(?:\.\d+)?)\s*\]")


def parse_box(value: Any, _depth: int = 0) -> Box | None:
    """A box from a list, a string holding a list, `<answer>...</answer>`, or Qwen's {"bbox_2d": [...]}.

    Returns None when no box can be read; never guesses. Raises ValueError (the reason and the fix) when a
    box is there but a coordinate is NaN or infinite (JSON's NaN/Infinity, a number over 1.8e308): such a
    box would pass every comparison-based check and reach the sampled data.
    """
    if _depth > 3:  # [[{"bbox_2d": ...}]] at most; deeper nesting holds no box
        return None
    if isinstance(value, dict):
        return parse_box(value.get("bbox_2d", value.get("bbox")), _depth + 1)
    if isinstance(value, (list, tuple)):
        if len(value) == 1 and isinstance(value[0], (dict, list, tuple)):
            return parse_box(value[0], _depth + 1)
        if len(value) == 4 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            return _finite(value)
        return None
    if not isinstance(value, str):
        return None
    m = _ANSWER.search(value)
    text = m.group(1) if m else value
    try:
        parsed = json.loads(text.strip())
    except (ValueError, RecursionError):  # not JSON, an integer of over 4300 digits, thousands of brackets
        parsed = None
    if parsed is not None:
        box = parse_box(parsed, _depth + 1)
        if box is not None:
            return box
    m = _NUMBERS.search(text)
    return _finite(m.groups()) if m else None


def _finite(values: Sequence[Any]) -> Box:
    try:
        box = [float(v) for v in values]
    except OverflowError:  # an integer too large for a float
        box = [math.inf]
    if not all(math.isfinite(v) for v in box):
        shown = ", ".join(short(v, 24, text=True) for v in values)
        raise ValueError(f"box [{shown}] has a coordinate that is not a finite number (NaN or infinity); "
                         f"write four finite numbers [x1, y1, x2, y2] in original pixels")
    return box
