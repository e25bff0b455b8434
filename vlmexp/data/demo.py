"""The embedded grounding dataset: images of coloured shapes and referring expressions, VLM-R1 REC format.

Each image holds 2-3 shapes with distinct (size, colour, shape) descriptions, so "the small blue
circle" names exactly one of them; its box is the shape's tight bounding box in original pixels.
Image sizes vary (so the Qwen2.5-VL frame differs from original pixels). Deterministic for a seed.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import yaml

from vlmexp.config.generated_data import DemoDataConfig, check_scene_range
from vlmexp.files import new_folder

# the defaults live there
_DEFAULTS = {name: field.default for name, field in DemoDataConfig.model_fields.items()}

COLORS = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220),
    "yellow": (230, 200, 30), "purple": (140, 60, 180),
}  # fmt: skip
SHAPES = ("circle", "square", "triangle")
SIZES = {"small": (0.18, 0.26), "large": (0.38, 0.50)}  # side as a share of the image's short side


def _place(rng: random.Random, w: int, h: int, side: int, boxes: list[list[int]]) -> list[int] | None:
    for _ in range(50):
        x1, y1 = rng.randint(2, w - side - 2), rng.randint(2, h - side - 2)
        box = [x1, y1, x1 + side, y1 + side]
        if all(box[2] + 3 < b[0] or b[2] + 3 < box[0] or box[3] + 3 < b[1] or b[3] + 3 < box[1]
               for b in boxes):
            return box
    return None


@dataclass(frozen=True)
class Scenes:
    """What the generated images look like: size ranges in pixels and the number of shapes (inclusive)."""

    width: tuple[int, int] = _DEFAULTS["width"]
    height: tuple[int, int] = _DEFAULTS["height"]
    objects: tuple[int, int] = _DEFAULTS["objects"]
    background: str = _DEFAULTS["background"]  # or "gradient": the shade encodes the pixel's x (red)
    # and y (green)

    def __post_init__(self) -> None:
        for name in ("width", "height", "objects"):
            check_scene_range(name, getattr(self, name))


def _gradient(w: int, h: int):
    """A background whose red rises left to right and green top to bottom: where a patch lies is in its
    colour."""
    from PIL import Image

    ramp = Image.linear_gradient("L")  # 256 x 256, 0 at the top to 255 at the bottom
    green = ramp.resize((w, h)).point(lambda v: 90 + v * 110 // 255)
    red = ramp.transpose(Image.Transpose.TRANSPOSE).resize((w, h)).point(lambda v: 90 + v * 110 // 255)
    blue = Image.new("L", (w, h), 150)
    return Image.merge("RGB", (red, green, blue))


def make_image(rng: random.Random, scenes: Scenes = Scenes()):
    """One image and its objects as (description, box) pairs."""
    from PIL import Image, ImageDraw

    w, h = rng.randint(*scenes.width), rng.randint(*scenes.height)
    shade = rng.randint(225, 250)  # drawn for every background, so a seed gives the same shapes either way
    image = _gradient(w, h) if scenes.background == "gradient" else Image.new("RGB", (w, h), (shade,) * 3)
    draw = ImageDraw.Draw(image)
    objects: list[tuple[str, list[int]]] = []
    seen: set[tuple[str, str, str]] = set()
    for _ in range(rng.randint(*scenes.objects)):
        size, color, shape = rng.choice(list(SIZES)), rng.choice(list(COLORS)), rng.choice(SHAPES)
        if (size, color, shape) in seen:
            continue
        lo, hi = SIZES[size]
        side = int(min(w, h) * rng.uniform(lo, hi))
        box = _place(rng, w, h, side, [b for _, b in objects])
        if box is None:
            continue
        seen.add((size, color, shape))
        x1, y1, x2, y2 = box
        fill = COLORS[color]
        if shape == "circle":
            draw.ellipse([x1, y1, x2 - 1, y2 - 1], fill=fill)
        elif shape == "square":
            draw.rectangle([x1, y1, x2 - 1, y2 - 1], fill=fill)
        else:
            draw.polygon([((x1 + x2) / 2, y1), (x2 - 1, y2 - 1), (x1, y2 - 1)], fill=fill)
        objects.append((f"the {size} {color} {shape}", box))
    return image, objects


@dataclass(frozen=True)
class Annotator:
    """How the demonstrations of the training split deviate from the exact boxes, as a share of the box's
    side.

    Each edge moves outward by `loose` and then by a uniform draw in [-jitter, +jitter]: a quick human
    annotator's box. SFT imitates these boxes; the reward and evaluation score against the exact `solution`.
    """

    jitter: float = 0.0
    loose: float = 0.0

    def __post_init__(self) -> None:
        if not (0 <= self.jitter <= 1 and 0 <= self.loose <= 1):
            raise ValueError(f"annotator jitter and loose are shares of a box's side in [0, 1], got "
                             f"jitter {self.jitter}, loose {self.loose}")

    def draw(self, rng: random.Random, box: list[int], w: int, h: int) -> list[int]:
        """The annotator's box for the exact `box` in a `w` x `h` image (pixels, inside the image)."""
        side = max(box[2] - box[0], box[3] - box[1])
        out = [self.loose + rng.uniform(-self.jitter, self.jitter) for _ in range(4)]  # outward, per edge
        x1 = min(max(round(box[0] - out[0] * side), 0), w - 2)
        y1 = min(max(round(box[1] - out[1] * side), 0), h - 2)
        x2 = min(max(round(box[2] + out[2] * side), x1 + 1), w)
        y2 = min(max(round(box[3] + out[3] * side), y1 + 1), h)
        return [x1, y1, x2, y2]


def scenes_of(demo: DemoDataConfig) -> Scenes:
    return Scenes(tuple(demo.width), tuple(demo.height), tuple(demo.objects), demo.background)


def annotator_of(demo: DemoDataConfig) -> Annotator:
    return Annotator(demo.annotator_jitter, demo.annotator_loose)


def demo_folder_name(demo: DemoDataConfig) -> str:
    """Where under run.output_dir `demo`'s dataset is generated; any setting that changes it changes the
    name."""
    import hashlib

    scenes, annotator = scenes_of(demo), annotator_of(demo)
    made = scenes if annotator == Annotator() else (scenes, annotator)
    digest = hashlib.sha256(repr(made).encode()).hexdigest()[:8]
    return f"demo_data-{demo.train}-{demo.val}-{demo.seed}-{digest}"


def make_demo_data(out_dir: str | Path, train: int = _DEFAULTS["train"], val: int = _DEFAULTS["val"],
                   seed: int = _DEFAULTS["seed"],
                   scenes: Scenes = Scenes(), annotator: Annotator = Annotator()) -> Path:
    """Write images/, train.json, val.json, train.yaml and val.yaml under `out_dir`; return it.

    With a noisy `annotator`, each training record also carries `demonstration`: the box SFT trains on.
    Written to a temporary sibling and renamed, so `out_dir` is complete or absent.
    """
    if train <= 0 or val <= 0:
        raise ValueError(f"train ({train}) and val ({val}) must be positive counts")
    out = Path(out_dir)
    with new_folder(out) as tmp:
        (tmp / "images").mkdir()
        rng = random.Random(seed)
        # its own stream: the images do not change with the annotator
        noise = random.Random(f"annotator-{seed}")
        for split, count in (("train", train), ("val", val)):
            records = []
            for i in range(count):
                image, objects = make_image(rng, scenes)
                name = f"images/{split}_{i:05d}.png"
                image.save(tmp / name)
                caption, box = rng.choice(objects)
                record = {"image": name, "problem": caption, "solution": box, "normal_caption": caption}
                if split == "train" and annotator != Annotator():
                    record["demonstration"] = annotator.draw(noise, box, *image.size)
                records.append(record)
            (tmp / f"{split}.json").write_text(json.dumps(records, indent=1) + "\n")
            data_yaml = {"datasets": [{"json_path": f"{split}.json", "sampling_strategy": "all",
                                       "image_root": ".", "task": "rec"}]}
            (tmp / f"{split}.yaml").write_text(
                f"# Generated by `vlmexp make-demo-data` (seed {seed}). Sample it with:\n"
                f"#   vlmexp sample {split}.yaml --out {split}.sampled.jsonl\n"
                + yaml.safe_dump(data_yaml, sort_keys=False)
            )
    return out
