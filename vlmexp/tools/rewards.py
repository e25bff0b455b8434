"""The rewards GRPO scores a tool run with (DeepEyes' recipe): `tool`, a right answer after a zoom, and
`zoom_target`, how well the zooms held the record's target. Built like the rule-based rewards of
`vlmexp.rewards` (their base, their signature, their hooks), registered beside them in TOOL_REWARDS (the
loader's REWARDS joins both). A prompt GRPO gives without the tools (grpo.tools.without) is theirs to leave
unscored: None, and not counted in the `zoom/*` metrics."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from vlmexp.rewards import REGISTRY, DetectionReward, IoUReward, Reward, Score, column
from vlmexp.tools import WITHOUT_TOOLS


def _offered(kwargs: dict[str, Any], n: int) -> list[bool]:
    """Whether each completion's prompt offered the tools: all but the rows GRPO gives without them
    (grpo.tools.without: their `environment` column)."""
    return [e != WITHOUT_TOOLS for e in column(kwargs, "environment", n)]


@dataclass
class ToolReward(Reward):
    """DeepEyes' tool reward: 1 when the completion zoomed (a crop came back) and its final answer is right
    (`accuracy`, a registered reward, scores it at least `threshold`), else 0; None where `accuracy` does not
    apply to the record's task. It also reports what the completions did with the tool, through TRL's
    `log_metric` (vlmexp.tools.zoom.report_zoom_metrics): zooms per completion, the share that zoomed, and
    per generation batch the malformed calls, boxes outside the image and calls past max_turns. None (and
    not counted) for a prompt given without the tools (grpo.tools.without)."""

    name: ClassVar[str] = "tool"
    accuracy: str = "exact"
    threshold: float = 1.0
    max_turns: int | None = None  # grpo.tools.max_turns (set by the loader): tells over-limit calls apart
    frame: str = "pixels"
    budget: Any = None

    def __post_init__(self) -> None:
        if self.accuracy not in REGISTRY or self.accuracy == "format":
            raise TypeError(f"accuracy {self.accuracy!r} is not a reward that scores answers: use one of "
                            f"{', '.join(n for n in REGISTRY if n != 'format')}")
        cls = REGISTRY[self.accuracy]
        boxes = issubclass(cls, (IoUReward, DetectionReward))
        self._accuracy = cls(frame=self.frame, budget=self.budget) if boxes else cls()

    def __call__(self, prompts: Sequence[Any] | None = None, completions: Sequence[Any] = (),
                 log_metric: Callable[[str, float], None] | None = None,
                 log_extra: Callable[[str, list], None] | None = None, **kwargs: Any) -> list[Score]:
        from vlmexp.tools.zoom import report_zoom_metrics, zoom_counts

        counts = [zoom_counts(c) for c in completions]
        right = self._accuracy(prompts, completions, **kwargs)
        offered = _offered(kwargs, len(completions))
        shown = [c for c, o in zip(counts, offered, strict=True) if o]
        report_zoom_metrics(log_metric, shown, self.max_turns)
        if log_extra is not None:
            log_extra("zooms", [c.zooms for c in counts])
        return [None if r is None or not o else float(c.zooms > 0 and r >= self.threshold)
                for r, c, o in zip(right, counts, offered, strict=True)]


@dataclass
class ZoomTargetReward(Reward):
    """How well a completion's zooms held the record's target(s) (`bbox`, original pixels): for each target,
    the largest share of its area inside one crop, averaged over the targets; with `whole`, 1 when every
    target lies whole inside a crop (evaluation's tool_zoom_on_target) else 0. A completion without a zoom
    scores 0; a record without a box, or a prompt given without the tools (grpo.tools.without), None. The
    crops are found again from the calls as the tool made them (vlmexp.tools.zoom.replayed_zooms;
    `min_crop_side` is grpo.tools.min_crop_side, set by the loader). With `max_crop_side` (original pixels),
    a crop with a longer side holds nothing: the processor shrinks it into the image budget, where the detail
    the zoom was for is lost, and a policy paid for holding the target learns to widen its windows until they
    hold it and show nothing (bench/RESULTS.md). Paid beside the answer's reward, it rewards where the zoom
    looked, not only what was answered."""

    name: ClassVar[str] = "zoom_target"
    whole: bool = False
    min_crop_side: int = 28
    max_crop_side: int | None = None
    frame: str = "pixels"
    budget: Any = None

    def __post_init__(self) -> None:
        side = self.max_crop_side
        if side is not None and (isinstance(side, bool) or not isinstance(side, int)
                                 or side < self.min_crop_side):
            raise TypeError(f"max_crop_side {side!r} must be a whole number of pixels at least "
                            f"grpo.tools.min_crop_side ({self.min_crop_side}), or null for no limit")

    def __call__(self, prompts: Sequence[Any] | None = None, completions: Sequence[Any] = (),
                 log_metric: Callable[[str, float], None] | None = None,
                 log_extra: Callable[[str, list], None] | None = None, **kwargs: Any) -> list[Score]:
        n = len(completions)
        boxes, sizes = column(kwargs, "bbox", n), column(kwargs, "image_sizes", n)
        return [self.held(c, b, s) if o else None
                for c, b, s, o in zip(completions, boxes, sizes, _offered(kwargs, n), strict=True)]

    def held(self, completion: Any, bbox: Any, image_sizes: Any) -> Score:
        from vlmexp.tools.zoom import held_targets, replayed_zooms

        if not bbox:
            return None
        if not image_sizes:
            raise ValueError(f"record has a bbox ({bbox!r}) but no image size; sample it again with "
                             "`vlmexp sample`")
        targets = [bbox] if isinstance(bbox[0], (int, float)) else list(bbox)
        width, height = image_sizes[0]
        crops = replayed_zooms(completion, width, height, self.frame, self.budget, self.min_crop_side)
        if self.max_crop_side is not None:
            crops = [c for c in crops if max(c[2] - c[0], c[3] - c[1]) <= self.max_crop_side]
        if self.whole:
            return float(bool(crops) and held_targets(crops, targets))
        return sum(max((inside(c, t) for c in crops), default=0.0) for t in targets) / len(targets)


def inside(crop: Sequence[float], box: Sequence[float]) -> float:
    """The share of `box`'s area inside `crop` (0 for a degenerate box)."""
    area = (box[2] - box[0]) * (box[3] - box[1])
    ix = max(0.0, min(crop[2], box[2]) - max(crop[0], box[0]))
    iy = max(0.0, min(crop[3], box[3]) - max(crop[1], box[1]))
    return ix * iy / area if area > 0 else 0.0


TOOL_REWARDS: dict[str, type[Reward]] = {cls.name: cls for cls in (ToolReward, ZoomTargetReward)}
