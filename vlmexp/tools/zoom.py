"""The zoom tool ("thinking with images", DeepEyes' `image_zoom_in_tool`): the model names a box of its image
in its family's box frame and gets the crop of the original image back as an image in a tool turn.

One `ZoomEnvironment` per rollout (TRL's `environment_factory`; evaluation makes its own): `reset` takes
the record's row and keeps its first image; `image_zoom_in_tool` maps the box from the family's frame to
original pixels (vlmexp/coords.py), clamps it to the image, grows a side shorter than `min_crop_side` around
its centre, and returns `[{"type": "image", "image": crop}]`. The processor then sizes the crop within
the model's image budget as it does any image. A box it cannot crop raises `ZoomRefused`: TRL hands the
message back to the model as the tool's answer ({"error": ...}) and counts a failed call; the message opens
with the problem's name, which `zoom_counts` reads back out of the conversation.

`zoom_counts` reads what a completion (TRL's list of messages) did with the tool: zooms, refused calls by
problem, a call left unanswered (past max_turns, or cut because its result would not fit the completion
length), a call the parser could not read (malformed). The tool reward, GRPO's zoom metrics, evaluation and
the pictures all count from it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from vlmexp.coords import from_frame

TOOL_NAME = "image_zoom_in_tool"  # DeepEyes' name; the data's tool conversations use it too
TOOL_CALL_OPEN = "<tool_call>"
# why a call did not zoom: the model's arguments could not be read as a box / the box misses the image
PROBLEMS = ("malformed", "outside")


class ZoomRefused(ValueError):
    """A zoom the tool cannot make; the message (opening with the problem's name) goes back to the model."""

    def __init__(self, problem: str, detail: str):
        super().__init__(f"{problem}: {detail}")
        self.problem = problem


def crop_box(bbox: Any, width: int, height: int, frame: str, budget, min_side: int) -> list[int]:
    """The crop (original pixels, integers, inside the image, each side >= min(min_side, the image's)) for a
    box the model gave in `frame`; ZoomRefused when it is not four numbers x1 < x2, y1 < y2 or misses the
    image."""
    if (not isinstance(bbox, (list, tuple)) or len(bbox) != 4
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in bbox)):
        raise ZoomRefused("malformed", f"bbox_2d must be four numbers [x1, y1, x2, y2], got {bbox!r}")
    if not (bbox[0] < bbox[2] and bbox[1] < bbox[3]):
        raise ZoomRefused("malformed", f"bbox_2d {list(bbox)} needs x1 < x2 and y1 < y2")
    x1, y1, x2, y2 = from_frame(bbox, width, height, frame, budget)
    x1, y1, x2, y2 = max(0.0, x1), max(0.0, y1), min(float(width), x2), min(float(height), y2)
    if x1 >= x2 or y1 >= y2:
        raise ZoomRefused("outside", f"bbox_2d {list(bbox)} lies outside the image; give a box inside it")
    # floor the start, ceil the end (a hair of float error, as 56 / 1.12, is not a pixel more)
    box = [math.floor(x1 + 1e-6), math.floor(y1 + 1e-6), math.ceil(x2 - 1e-6), math.ceil(y2 - 1e-6)]
    for lo, hi, side in ((0, 2, width), (1, 3, height)):
        want = min(min_side, side)
        if box[hi] - box[lo] < want:  # grow around the centre, then shift inside the image
            start = (box[lo] + box[hi] - want) // 2
            start = min(max(0, start), side - want)
            box[lo], box[hi] = start, start + want
    return box


@dataclass
class ZoomEnvironment:
    """One rollout's zoom tool (TRL offers every public method but reset as a tool: others stay private)."""

    frame: str  # the family's box frame: "pixels" (of the resized image) or "grid1000"
    budget: Any  # the processor's image budget (the "pixels" frame needs it)
    min_crop_side: int = 28
    # per rollout: the record's first image and the boxes cropped (original pixels), in order
    _image: Any = field(default=None, repr=False)
    crops: list[list[int]] = field(default_factory=list)

    def reset(self, images: Any = None, image: Any = None, **row: Any) -> None:
        """Keep the record's first image; TRL passes the dataset row."""
        shown = images or ([image] if image is not None else [])
        self._image = shown[0].convert("RGB") if shown else None
        self.crops = []

    def image_zoom_in_tool(self, bbox_2d: list[float], label: str = "") -> list[dict[str, Any]]:
        """Zoom in on a region of the image: crop it and look at it more closely.

        Args:
            bbox_2d: The region to zoom in on, [x1, y1, x2, y2], in the same coordinates as boxes in answers.
            label: What the region holds (optional).
        """
        if self._image is None:
            raise ZoomRefused("malformed", "this record has no image to zoom in on")
        box = crop_box(bbox_2d, *self._image.size, self.frame, self.budget, self.min_crop_side)
        self.crops.append(box)
        return [{"type": "image", "image": self._image.crop(tuple(box))}]


@dataclass
class ZoomCounts:
    """What one completion did with the zoom tool."""

    zooms: int = 0  # crops returned
    problems: dict[str, int] = field(default_factory=dict)  # refused calls by problem (PROBLEMS)
    unanswered: bool = False  # ends on a call that was not run (past max_turns, or its result did not fit)
    malformed_text: bool = False  # a turn holds a tool-call tag the parser could not read as a call

    @property
    def calls(self) -> int:
        """Calls the tool ran (zooms and refusals)."""
        return self.zooms + sum(self.problems.values())

    @property
    def malformed(self) -> int:
        return self.problems.get("malformed", 0) + int(self.malformed_text)


_ERROR = re.compile(r"'error':\s*['\"](\w+):")


def zoom_counts(completion: Any) -> ZoomCounts:
    """Count a completion's zooms and failed calls from its messages (a plain string: none)."""
    counts = ZoomCounts()
    if not isinstance(completion, list):
        return counts
    for message in completion:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if message.get("role") == "tool":
            if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image"
                                                 for p in content):
                counts.zooms += 1
            else:
                m = _ERROR.search(str(content))
                problem = m.group(1) if m and m.group(1) in PROBLEMS else "malformed"
                counts.problems[problem] = counts.problems.get(problem, 0) + 1
        elif message.get("role") == "assistant" and isinstance(content, str) and TOOL_CALL_OPEN in content:
            counts.malformed_text = True
    last = completion[-1] if completion else {}
    counts.unanswered = isinstance(last, dict) and bool(last.get("tool_calls"))
    return counts


def holds(crop: list[int], box: list[float]) -> bool:
    """Whether `crop` holds the whole of `box` (both in original pixels)."""
    return crop[0] <= box[0] and crop[1] <= box[1] and crop[2] >= box[2] and crop[3] >= box[3]


def held_targets(crops: list[list[int]], targets: list[list[float]]) -> bool:
    """Whether an answer's zooms held its targets: every target whole inside at least one of the crops (one
    crop holding them all, or one crop each). A question about two objects' relative position (V*'s) needs
    both seen, so holding one of them does not count."""
    return all(any(holds(c, box) for c in crops) for box in targets)


def answer_zoom_metrics(counts: list[ZoomCounts], crops: list[list[list[int]]],
                        targets: list[list[list[float]] | None]) -> dict[str, float]:
    """Evaluation's and validation's zoom metrics over one conversation a record: zooms_per_answer,
    zoomed_share and, where records carry their targets' boxes (V*-style `bbox`, one box or several),
    zoom_on_target: the share of those whose zooms held every target (`held_targets`)."""
    n = max(1, len(counts))
    metrics = {"zooms_per_answer": sum(c.zooms for c in counts) / n,
               "zoomed_share": sum(c.zooms > 0 for c in counts) / n}
    boxed = [(shown, boxes) for shown, boxes in zip(crops, targets, strict=True) if boxes]
    if boxed:
        held = sum(held_targets(shown, boxes) for shown, boxes in boxed)
        metrics["zoom_on_target"] = held / len(boxed)
    return metrics


def replayed_zooms(completion: Any, width: int, height: int, frame: str, budget,
                   min_side: int) -> list[list[int]]:
    """The crops (original pixels, in order) a completion's calls got back, found again from its calls: each
    call answered by an image, mapped as the tool maps it (`crop_box`)."""
    if not isinstance(completion, list):
        return []
    calls = [c for m in completion if isinstance(m, dict) and m.get("role") == "assistant"
             for c in m.get("tool_calls") or []]
    answers = [m for m in completion if isinstance(m, dict) and m.get("role") == "tool"]
    out = []
    for call, answer in zip(calls, answers, strict=False):
        if isinstance(answer.get("content"), list):
            args = call.get("function", call).get("arguments") or {}
            out.append(crop_box(args.get("bbox_2d"), width, height, frame, budget, min_side))
    return out


def report_zoom_metrics(log_metric, counts: list[ZoomCounts], max_turns: int | None) -> None:
    """GRPO's zoom metrics through TRL's `log_metric`: zoom/zooms_per_completion and zoom/zoomed_share (means
    over the generation batch); zoom/malformed, zoom/outside, zoom/over_limit (a call past max_turns, not run)
    and zoom/cut (a call whose result would not fit max_completion_length): counts per generation batch."""
    if log_metric is None or not counts:
        return
    n = len(counts)
    log_metric("zoom/zooms_per_completion", sum(c.zooms for c in counts) / n)
    log_metric("zoom/zoomed_share", sum(c.zooms > 0 for c in counts) / n)
    log_metric("zoom/malformed", float(sum(c.malformed for c in counts)))
    log_metric("zoom/outside", float(sum(c.problems.get("outside", 0) for c in counts)))
    over = [c.unanswered and max_turns is not None and c.calls >= max_turns for c in counts]
    log_metric("zoom/over_limit", float(sum(over)))
    log_metric("zoom/cut", float(sum(c.unanswered and not o for c, o in zip(counts, over, strict=True))))


def zoom_environment_factory(frame: str, budget, min_crop_side: int):
    """What TRL's `environment_factory` takes: a callable making one fresh environment per rollout."""
    from functools import partial

    return partial(ZoomEnvironment, frame, budget, min_crop_side)
