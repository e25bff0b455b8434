"""The generated datasets' sections (`data.demo`, `data.zoom_demo`): the scenes, the annotators whose
demonstrations SFT imitates, the zoom demo's targets. Part of the config tree's ground floor
(vlmexp.config.schema holds the root); vlmexp.data.demo and vlmexp.data.zoom_demo read their defaults here."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt, ValidationInfo, field_validator, model_validator

from vlmexp.config.base import Section


def check_scene_range(name: str, value: tuple[int, int]) -> None:
    """Raise ValueError unless a generated images' range (width, height: pixels; objects: shapes) can work;
    the schema's data.demo and vlmexp.data.demo.Scenes both ask here."""
    lo, hi = value
    if not 0 < lo <= hi:
        raise ValueError(f"scenes.{name} must be [low, high] with 0 < low <= high, got [{lo}, {hi}]")
    if name in ("width", "height") and lo < 64:
        raise ValueError(f"scene images must be at least 64 pixels a side, got {name} {list(value)}")


class DemoDataConfig(Section):
    """Generate the embedded grounding dataset under <output_dir>/demo_data on first use. The defaults are the
    demo's recipe (configs/demo.yaml) and `vlmexp make-demo-data`'s (vlmexp.data.demo.Scenes reads them
    here)."""

    train: PositiveInt = Field(1024, description="Training records to generate.")
    val: PositiveInt = Field(256, description="Held-out records to generate.")
    seed: int = Field(0, description="Seed of the generated images and captions (not run.seed: the data "
                                     "stays the same across training seeds).")
    width: tuple[PositiveInt, PositiveInt] = Field((112, 112), description="Image width range [low, high].")
    height: tuple[PositiveInt, PositiveInt] = Field((112, 112), description="Image height range [low, high].")
    objects: tuple[PositiveInt, PositiveInt] = Field((1, 1), description="Shapes per image [low, high].")
    background: Literal["plain", "gradient"] = Field(
        "gradient", description="gradient: the shade encodes x (red) and y (green), so a tiny vision tower, "
        "which has no absolute position embedding, can see where a shape is.")
    annotator_jitter: float = Field(
        0.05, ge=0, le=1, description="Training demonstrations (the boxes SFT imitates) move each edge "
        "by a uniform draw in [-j, +j] x the box's side; the reward and evaluation score against the "
        "exact box. 0: exact.")
    annotator_loose: float = Field(
        0.25, ge=0, le=1, description="Training demonstrations push each edge outward by this share of the "
        "box's side (a loose annotator). 0: tight.")

    @field_validator("width", "height", "objects")
    @classmethod
    def _scenes(cls, value: tuple[int, int], info: ValidationInfo) -> tuple[int, int]:
        check_scene_range(str(info.field_name), value)
        return value


class ZoomDemoConfig(Section):
    """Generate the embedded zoom dataset (vlmexp.data.zoom_demo) under <output_dir> on first use: images
    larger than the model's pixel budget, each with one small framed square whose colour is a one-pixel
    checkerboard of the colour and its complement, so that at the budget every colour blurs to the same grey
    and only a zoom shows it. Training records are zoom-then-answer conversations from a loose annotator, the
    call written in model.family's box frame with model.min_pixels / max_pixels; held-out records are V*-style
    (image, question, answer, the target's box)."""

    train: PositiveInt = Field(512, description="Training records (zoom-then-answer demonstrations).")
    val: PositiveInt = Field(128, description="Held-out records.")
    seed: int = Field(0, description="Seed of the generated images and demonstrations.")
    side: PositiveInt = Field(448, ge=56, description="Image side in pixels (square images).")
    target: tuple[PositiveInt, PositiveInt] = Field(
        (24, 32), description="The framed square's side range [low, high] in pixels, its black frame "
        "included.")
    frame: PositiveInt = Field(2, description="The target's black frame, pixels: what shows where it is at "
                               "the budget (its colour does not).")
    annotator_loose: float = Field(
        0.5, ge=0, le=2, description="The demonstrations' zoom box pushes each edge outward by this share of "
        "the target's side (a loose annotator); the target's exact box travels with each record as `bbox`.")
    annotator_jitter: float = Field(
        0.15, ge=0, le=1, description="... and moves each edge by a uniform draw in [-j, +j] x the side.")
    annotator_window: float = Field(
        0, ge=0, lt=1, description="0: the loose box above. Otherwise the annotator zooms into a square "
        "window "
        "of this share of the image side instead, the one of a grid of windows (half a window apart) whose "
        "centre is nearest the target's: a coarse zoom, as a person looking for a detail first halves the "
        "picture. A window shown at or above its own resolution keeps the target's pattern.")
    annotator_centred: bool = Field(
        False, description="With annotator_window: the window centred on the target instead (moved inside "
        "the image, its corners on even pixels so that the crop keeps the checkerboard's phase), so the "
        "call's numbers follow the target's place as a grounding box does; false: the grid's window nearest "
        "it.")
    annotator_offset: float = Field(
        0, ge=0, le=1, description="With annotator_window: each demonstration's window is moved along "
        "each axis by a uniform draw in [-o, +o] x its side (even pixels, kept inside the image), so that it "
        "often clips or misses the target, as a careless annotator's zoom: SFT then learns to call the tool "
        "near the target but not yet where it holds it, which GRPO, paid for a right answer after a zoom, "
        "must learn. The answer stays the right colour. 0: the window as annotator_centred says.")
    direct: float = Field(
        0, ge=0, lt=1, description="The share of training records that answer without the tool: the question "
        "and the image, no tools block, the answer (what evaluation without the tool asks; at the budget the "
        "colour can only be guessed). The rest are zoom-then-answer demonstrations.")
    closeup: float = Field(
        0, ge=0, le=1, description="The share of demonstrations that also give a close-up record: their crop "
        "(what the zoom tool returned) as the only image, the question, the answer, no tools block. Reading "
        "is then learned where the question and one picture are the whole context, not only after the tools "
        "block, the scene and the call. 0: none.")

    @field_validator("target")
    @classmethod
    def _target(cls, value: tuple[int, int]) -> tuple[int, int]:
        if not 8 <= value[0] <= value[1]:
            raise ValueError(f"target {list(value)} needs 8 <= low <= high (pixels, frame included)")
        return value

    @model_validator(mode="after")
    def _frame(self) -> ZoomDemoConfig:
        if self.annotator_offset and not self.annotator_window:
            raise ValueError(f"annotator_offset {self.annotator_offset} moves the annotator's window: set "
                             "annotator_window (e.g. 0.5) too, or annotator_offset: 0")
        if self.target[0] <= 2 * self.frame + 2:
            raise ValueError(f"frame {self.frame} leaves no colour inside the smallest target "
                             f"({self.target[0]} pixels): give target a low side above {2 * self.frame + 2} "
                             "or a thinner frame")
        return self
