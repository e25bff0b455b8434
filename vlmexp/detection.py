"""Open-vocabulary detection answers: several labelled boxes per answer matched to several targets.

An answer (and a record's solution) lists boxes as VLM-R1's detection data writes them: a JSON list of
`{"bbox_2d": [x1, y1, x2, y2], "label": "..."}` in a ```json fenced block, inside <answer></answer>, or
"None" when there is nothing to find. Solutions are in original pixels; the model's boxes are read in the
family's frame and mapped to original pixels before matching (as the rec reward does).

Scoring follows om-ai-lab/VLM-R1, src/open-r1-multimodal/src/open_r1/grpo_jsonl.py, method by method:
- od_ap / od_ap50 (`od_reward`): the last <answer>; "None" for both scores 1; else `map_reward` on it.
- map (`map_reward` on the whole completion): the last ```json block; both lists empty 1, one empty 0, else
  COCO AP of the single image (`calculate_map`: every box scored 1.0, categories from the target labels,
  boxes with other labels dropped): AP@[.5:.95] for od_ap and map, AP@.5 for od_ap50.
- odLength (`odLength_reward`): od_ap's value times min(1, targets / predicted boxes).
- weighted_sum (`detection_score` after `clean_text`, labels lower-cased): greedy one-to-one matching at IoU
  0.5 (VLM-R1's pixel-inclusive `iou`), (0.7 * mean IoU of label-correct matches over targets + 0.3 *
  (1 - (miss rate + false alarm rate) / 2)); "none" for both scores 1.
`coco_ap` is COCOeval's bbox AP (area "all", 100 detections, 101 recall points) in plain Python; over many
images at once it is evaluation's detection_ap / detection_ap50.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

from vlmexp.answers import after_think, clean_text

DETECTION_METHODS = ("od_ap", "od_ap50", "map", "odLength", "weighted_sum")
Box = list[float]
Found = list[tuple[Box, str]]  # (box in original pixels, label) per object
AP_THRESHOLDS = tuple(0.5 + 0.05 * i for i in range(10))  # COCO's .50:.05:.95
_FENCE = re.compile(r"```json(.*?)```", re.DOTALL)
SOLUTION_HINT = ('write <answer>```json [{"bbox_2d": [x1, y1, x2, y2], "label": "..."}]```</answer> in '
                 'original pixels, or <answer>None</answer> when there is nothing to find')


class Unreadable(ValueError):
    """A model's answer that holds no readable list of boxes; `reason` is the counted reason."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def read_objects(items: Any, lower: bool = False, strict: bool = False) -> Found:
    """(box, label) of each item with a four-number bbox_2d and a string label. Others are dropped (VLM-R1
    skips what pycocotools cannot read), or with `strict` (a ground truth) refused with ValueError."""
    if not isinstance(items, list):
        if strict:
            raise ValueError(f"the boxes must be a JSON list, got {type(items).__name__}; {SOLUTION_HINT}")
        return []
    out: Found = []
    for item in items:
        box = item.get("bbox_2d") if isinstance(item, dict) else None
        label = item.get("label") if isinstance(item, dict) else None
        ok = (isinstance(box, list) and len(box) == 4 and isinstance(label, str)
              and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                      for v in box))
        if ok and strict and not (box[0] < box[2] and box[1] < box[3]):
            raise ValueError(f"box {box} of {label!r} is inverted or empty (needs x1 < x2 and y1 < y2)")
        if ok:
            out.append(([float(v) for v in box], label.lower() if lower else label))
        elif strict:
            raise ValueError(f"item {str(item)[:80]} is not {{\"bbox_2d\": [x1, y1, x2, y2], \"label\": "
                             f"\"...\"}}; {SOLUTION_HINT}")
    return out


def gold_objects(solution: str, method: str) -> Found:
    """The target boxes of a detection record's solution ([] for "None"), or ValueError with the fix.

    The first <answer> content when there is one, else the solution; then its last ```json block, else the
    text itself as JSON (VLM-R1 needs the fence; a bare list is read too)."""
    text = clean_text(solution) if method == "weighted_sum" else solution
    found = re.search(r"<answer>(.*?)</answer>", text, re.DOTALL)
    text = (found.group(1) if found else text).strip()
    if text.lower() == "none":
        return []
    blocks = _FENCE.findall(text)
    try:
        items = json.loads(blocks[-1] if blocks else text)
    except ValueError:
        raise ValueError(f"solution {text[:80]!r} holds no JSON list of boxes; {SOLUTION_HINT}") from None
    return read_objects(items, lower=method == "weighted_sum", strict=True)


def predicted_objects(text: str, method: str) -> tuple[Found, int]:
    """(readable boxes in the model's frame, how many items the answer listed) as `method` reads a completion;
    a "None" answer lists none. Raises Unreadable with the reason."""
    if method == "weighted_sum":
        text, lower, first = clean_text(text), True, True
    elif method == "map":
        text, lower, first = after_think(text), False, False
    else:
        answers = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
        if not answers:
            raise Unreadable("no_answer")
        text, lower, first = answers[-1].strip(), False, False
    if text.strip().lower() == "none":
        return [], 0
    blocks = _FENCE.findall(text)
    if not blocks:
        raise Unreadable("no_json_block")
    try:
        items = json.loads(blocks[0] if first else blocks[-1])
    except ValueError:
        raise Unreadable("bad_json") from None
    if not isinstance(items, list):
        raise Unreadable("not_a_list")
    return read_objects(items, lower=lower), len(items)


def detection_reward(method: str, predicted: Found, listed: int, gold: Found) -> float:
    """The reward of `method` for the predicted boxes (original pixels; `listed` counts every item the answer
    listed, readable or not) against the targets. No targets: 1 for an empty answer, else 0; targets and an
    empty answer: 0."""
    if not gold or not listed:
        return float(not gold and not listed)
    if method == "weighted_sum":
        return weighted_score(predicted, gold, unreadable=listed - len(predicted))
    value = coco_ap([(predicted, gold)], AP_THRESHOLDS[:1] if method == "od_ap50" else AP_THRESHOLDS)
    if method == "odLength":
        value *= 1.0 if len(gold) >= listed else len(gold) / listed
    return value


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """COCO's bbox IoU (continuous coordinates)."""
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    inter = w * h if w > 0 and h > 0 else 0.0
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def coco_ap(images: Sequence[tuple[Found, Found]], thresholds: Sequence[float] = AP_THRESHOLDS) -> float:
    """COCOeval bbox AP over (predicted, target) pairs of images, every prediction scored 1.0 (so in the order
    given): mean over the target labels and `thresholds` of the 101-point interpolated precision. Predictions
    with a label no target has are left out; 0.0 when no prediction is left (VLM-R1's `calculate_map`)."""
    labels = list(dict.fromkeys(label for _, gold in images for _, label in gold))
    if not any(label in labels for predicted, _ in images for _, label in predicted):
        return 0.0
    values = [_ap_one(images, label, t) for label in labels for t in thresholds]
    return sum(values) / len(values)


def _ap_one(images: Sequence[tuple[Found, Found]], label: str, threshold: float) -> float:
    hits: list[bool] = []
    targets = 0
    for predicted, gold in images:
        boxes = [b for b, lab in gold if lab == label]
        targets += len(boxes)
        taken: set[int] = set()
        for box, _ in [p for p in predicted if p[1] == label and _area(p[0]) >= 0][:100]:
            best, match = min(threshold, 1 - 1e-10), -1  # COCOeval.evaluateImg: the best untaken target
            for j, target in enumerate(boxes):
                if j in taken or box_iou(box, target) < best:
                    continue
                best, match = box_iou(box, target), j
            if match >= 0:
                taken.add(match)
            hits.append(match >= 0)
    tp = fp = 0
    recall, precision = [], []
    for hit in hits:
        tp, fp = tp + hit, fp + (not hit)
        recall.append(tp / targets)
        precision.append(tp / (tp + fp))
    for i in range(len(precision) - 1, 0, -1):  # precision made non-increasing, as COCOeval.accumulate does
        precision[i - 1] = max(precision[i - 1], precision[i])
    total = 0.0
    for r in (i / 100 for i in range(101)):  # np.searchsorted(recall, r, side="left")
        k = next((i for i, value in enumerate(recall) if value >= r), None)
        if k is None:
            break
        total += precision[k]
    return total / 101


def _area(box: Box) -> float:
    return (box[2] - box[0]) * (box[3] - box[1])  # COCO ignores an unmatched box of negative area


def vlmr1_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """VLM-R1's `iou` (grpo_jsonl.py): pixel-inclusive intersection, so boxes overlapping by one pixel or less
    score 0."""
    x1, y1 = max(a[0], b[0]), max(a[1], b[1])
    x2, y2 = min(a[2] - 1, b[2] - 1), min(a[3] - 1, b[3] - 1)
    inter = (x2 - x1 + 1) * (y2 - y1 + 1) if x1 < x2 and y1 < y2 else 0
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return float(inter) / union if union else 0.0


def weighted_score(predicted: Found, gold: Found, unreadable: int = 0, iou_threshold: float = 0.5,
                   alpha: float = 0.7, beta: float = 0.0, gamma: float = 0.3) -> float:
    """VLM-R1's `detection_score`: greedy matching by highest IoU above the threshold; position (mean IoU of
    label-correct matches over the targets), label and completeness (1 - (miss + false alarm rate) / 2).
    `unreadable` items of the answer (no box or label) stay unmatched, as VLM-R1's IoU 0 leaves them."""
    if not gold:
        return 0.0 if predicted or unreadable else 1.0
    if not predicted:
        return 0.0
    ious = [[vlmr1_iou(p, g) for g, _ in gold] for p, _ in predicted]
    free_p, free_g = list(range(len(predicted))), list(range(len(gold)))
    matches: list[tuple[float, bool]] = []
    while free_p and free_g:
        best, bp, bg = -1.0, -1, -1
        for i in free_p:
            for j in free_g:
                if ious[i][j] > best:
                    best, bp, bg = ious[i][j], i, j
        if best < iou_threshold:
            break
        correct = predicted[bp][1] == gold[bg][1]
        matches.append((best if correct else 0.0, correct))
        free_p.remove(bp)
        free_g.remove(bg)
    position = sum(m[0] for m in matches) / len(gold)
    label = sum(m[1] for m in matches) / len(gold)
    completeness = 1.0 - (len(free_g) / len(gold)
                          + (len(free_p) + unreadable) / (len(predicted) + unreadable)) / 2
    return (alpha * position + beta * label + gamma * completeness) / (alpha + beta + gamma)
