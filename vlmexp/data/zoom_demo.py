"""The embedded zoom dataset: questions whose answer needs a zoom ("thinking with images" on one CPU).

Each square image, larger than the model's pixel budget, holds one small framed square on a background whose
shade encodes x and y (as the grounding demo's, vlmexp.data.demo, so a tiny vision tower can see where things
are). The square's colour is written as a one-pixel checkerboard of the colour and its complement, in the
image's own phase (the colour where x + y is even): shrunk to
the budget, every colour averages to the same grey, so the colour cannot be read from the whole image, while
the crop of a zoom, shown at or above its own resolution, keeps the pattern. The black frame stays visible at
the budget, so the model can see where to zoom.

Training records are zoom-then-answer demonstrations in TRL's tool-calling layout: the question and the image,
the assistant's `image_zoom_in_tool` call with a loose annotator's box (each edge pushed out by `loose` of the
target's side, then moved by up to `jitter`; or a window of `window` x the side, the one of a coarse grid
nearest the target or the one centred on it, `centred`, then moved off it by up to `offset` of its side, so
that it may clip or miss the target), written in the family's box frame; the tool turn
with the crop, made by the zoom tool's own rule (vlmexp.tools.zoom.crop_box); the answer. A share `direct`
answers without the tool instead (no tools block: what evaluation without the tool asks). A share `closeup` of
the demonstrations also gives its crop as a record answered without the tool (reading with one picture as the
context; only of a crop that holds the whole target). Every record carries the answer (`solution`) and the
target's exact box (`bbox`, in its image's pixels). Held-out records are V*-style {image, question, answer,
bbox}. Deterministic for a seed and a frame.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from vlmexp.files import new_folder

# colours and their complements average to (127.5, 127.5, 127.5): no colour survives the shrink
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
QUESTION = "What colour is the small framed square?"
ZOOM_TOOL = "image_zoom_in_tool"


@dataclass(frozen=True)
class ZoomScenes:
    """The images: their side, the target's side range (frame included), the annotator's looseness."""

    side: int = 448
    target: tuple[int, int] = (24, 32)
    loose: float = 0.5
    jitter: float = 0.15
    window: float = 0.0
    centred: bool = False
    direct: float = 0.0  # the share of training records answered without the tool
    frame: int = 2  # the target's black frame, pixels
    closeup: float = 0.0  # the share of demonstrations that also give their crop as a close-up record
    offset: float = 0.0  # the window's centre moved off the target's by up to this share of its side


@dataclass(frozen=True)
class BoxFrame:
    """Where the demonstrations' calls write boxes: the family's frame and its pixel budget
    (vlmexp.coords.to_frame), and the zoom tool's smallest crop side."""

    frame: str
    budget: Any
    min_crop_side: int = 28


def _background(side: int):
    from vlmexp.data.demo import _gradient

    return _gradient(side, side)


def make_image(rng: random.Random, scenes: ZoomScenes, colour: str | None = None):
    """(image, colour name, the target's box in original pixels); the colour drawn unless given."""
    from PIL import Image

    image = _background(scenes.side)
    drawn = rng.choice(list(COLOURS))
    colour = colour or drawn
    side = rng.randint(*scenes.target)
    x1, y1 = rng.randint(2, scenes.side - side - 2), rng.randint(2, scenes.side - side - 2)
    rgb = COLOURS[colour]
    inner = side - 2 * scenes.frame
    patch = Image.new("RGB", (inner, inner))
    complement = tuple(255 - v for v in rgb)
    # the checkerboard's phase is the image's (colour where x + y is even): a crop that starts on an even
    # pixel, as the demonstrations' windows do, shows every colour in one phase, so a patch reads it one way
    left, top = x1 + scenes.frame, y1 + scenes.frame
    patch.putdata([rgb if (left + i + top + j) % 2 == 0 else complement for j in range(inner)
                   for i in range(inner)])
    framed = Image.new("RGB", (side, side), (0, 0, 0))
    framed.paste(patch, (scenes.frame, scenes.frame))
    image.paste(framed, (x1, y1))
    return image, colour, [x1, y1, x1 + side, y1 + side]


def zoom_call(rng: random.Random, box: list[int], scenes: ZoomScenes, frame: BoxFrame) -> list[int]:
    """The annotator's zoom box for the target's `box`, in the family's frame (integers, as models write):
    the window nearest the target (`scenes.window`), or the loose box around it."""
    from vlmexp.coords import to_frame

    if scenes.window:
        zoom = window_box(box, scenes.side, scenes.window, scenes.centred)
        if scenes.offset:
            zoom = offset_window(rng, zoom, scenes.side, scenes.offset)
    else:
        side = box[2] - box[0]
        out = [scenes.loose + rng.uniform(-scenes.jitter, scenes.jitter) for _ in range(4)]
        zoom = [max(0.0, box[0] - out[0] * side), max(0.0, box[1] - out[1] * side),
                min(float(scenes.side), box[2] + out[2] * side),
                min(float(scenes.side), box[3] + out[3] * side)]
    shown = to_frame(zoom, scenes.side, scenes.side, frame.frame, frame.budget)
    return [int(round(v)) for v in shown]


def window_box(box: list[int], side: int, share: float, centred: bool = False) -> list[float]:
    """The square window of `share` x `side` for `box`: centred on it (`centred`: moved inside the image, its
    corners on even pixels, the checkerboard's phase), or, of the windows whose corners lie on a grid half a
    window apart (the last one flush with the image's edge), the one whose centre is nearest the centre of
    `box`."""
    width = round(share * side)
    step = max(1, width // 2)
    starts = sorted({*range(0, side - width + 1, step), side - width})

    def nearest(centre: float) -> int:
        if centred:
            return min(max(0, 2 * round((centre - width / 2) / 2)), (side - width) // 2 * 2)
        return min(starts, key=lambda s: abs(s + width / 2 - centre))

    x, y = nearest((box[0] + box[2]) / 2), nearest((box[1] + box[3]) / 2)
    return [float(x), float(y), float(x + width), float(y + width)]


def offset_window(rng: random.Random, window: list[float], side: int, offset: float) -> list[float]:
    """`window` moved along each axis by a uniform draw in [-offset, +offset] x its side (even pixels, the
    checkerboard's phase), then back inside the image: a careless annotator's zoom, which may clip or miss the
    target."""
    width = window[2] - window[0]
    moved = []
    for start in (window[0], window[1]):
        shift = 2 * round(rng.uniform(-offset, offset) * width / 2)
        moved.append(float(min(max(0, int(start) + shift), (side - int(width)) // 2 * 2)))
    return [moved[0], moved[1], moved[0] + width, moved[1] + width]


def holds(crop: list[int], box: list[int]) -> bool:
    """Whether the crop holds the whole target box."""
    return crop[0] <= box[0] and crop[1] <= box[1] and crop[2] >= box[2] and crop[3] >= box[3]


def crop_window(image, call: list[int], frame: BoxFrame) -> list[int]:
    """The box, in original pixels, of the crop the zoom tool returns for `call` (its own rule:
    vlmexp.tools.zoom.crop_box)."""
    from vlmexp.tools.zoom import crop_box

    return list(crop_box(call, *image.size, frame.frame, frame.budget, frame.min_crop_side))


def direct_answer(name: str, colour: str, box: list[int]) -> dict[str, Any]:
    """A training record answered without the tool (TRL's conversational layout): the colour, which the
    image at the budget cannot show."""
    return {"messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": f"<think>The square is too small to see.</think><answer>{colour}"
                                         "</answer>"}],
        "images": [name], "solution": colour, "bbox": box}


def closeup_answer(crop_name: str, colour: str, box: list[int], crop: list[int]) -> dict[str, Any]:
    """A training record whose image is a demonstration's crop (what the zoom tool returned), answered
    without the tool: reading the colour where the question and one picture are all the context. `bbox` is
    the target's box in the crop's pixels."""
    inside = [max(0, box[0] - crop[0]), max(0, box[1] - crop[1]), min(crop[2], box[2]) - crop[0],
              min(crop[3], box[3]) - crop[1]]
    return {"messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": f"<think>The square is large enough to see.</think><answer>{colour}"
                                         "</answer>"}],
        "images": [crop_name], "solution": colour, "bbox": inside}


def demonstration(name: str, crop_name: str, colour: str, call: list[int], box: list[int]) -> dict[str, Any]:
    """A training record: TRL's tool-calling conversation, the answer and the target's box."""
    return {"messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": "<think>The square is too small to see.</think>",
         "tool_calls": [{"type": "function",
                         "function": {"name": ZOOM_TOOL, "arguments": {"bbox_2d": call}}}]},
        {"role": "tool", "content": [{"type": "image"}]},
        {"role": "assistant", "content": f"<think>The zoom shows it.</think><answer>{colour}</answer>"}],
        "images": [name, crop_name], "solution": colour, "bbox": box}


def make_zoom_demo_data(out_dir: str | Path, frame: BoxFrame, train: int = 512, val: int = 128, seed: int = 0,
                        scenes: ZoomScenes = ZoomScenes()) -> Path:
    """Write images/, train.jsonl, val.jsonl, train.yaml and val.yaml under `out_dir` (complete or absent)."""
    if train <= 0 or val <= 0:
        raise ValueError(f"train ({train}) and val ({val}) must be positive counts")
    if scenes.target[1] + 4 > scenes.side:
        raise ValueError(f"target side {scenes.target[1]} does not fit a {scenes.side}-pixel image")
    if scenes.target[0] <= 2 * scenes.frame + 2:
        raise ValueError(f"target side {scenes.target[0]} leaves no colour inside a {scenes.frame}-pixel "
                         "frame: give a larger target or a thinner frame")
    out = Path(out_dir)
    with new_folder(out) as tmp:
        (tmp / "images").mkdir()
        rng, noise = random.Random(seed), random.Random(f"zoom-annotator-{seed}")
        direct = random.Random(f"zoom-direct-{seed}")  # its own draws: the images stay those of `seed`
        closeup = random.Random(f"zoom-closeup-{seed}")
        for split, count in (("train", train), ("val", val)):
            rows = []
            for i in range(count):
                # held-out colours take turns: any one answer given to every record scores a quarter
                image, colour, box = make_image(rng, scenes, list(COLOURS)[i % len(COLOURS)]
                                                if split == "val" else None)
                name = f"images/{split}_{i:05d}.png"
                image.save(tmp / name)
                if split == "val":
                    rows.append({"image": name, "question": QUESTION, "answer": colour, "bbox": box})
                    continue
                if scenes.direct and direct.random() < scenes.direct:
                    rows.append(direct_answer(name, colour, box))
                    continue
                call = zoom_call(noise, box, scenes, frame)
                crop_name = f"images/{split}_{i:05d}_crop.png"
                crop = crop_window(image, call, frame)
                image.crop(tuple(crop)).save(tmp / crop_name)
                rows.append(demonstration(name, crop_name, colour, call, box))
                # a close-up teaches reading: only of a crop that holds the whole target
                if scenes.closeup and closeup.random() < scenes.closeup and holds(crop, box):
                    rows.append(closeup_answer(crop_name, colour, box, crop))
            (tmp / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            data_yaml = {"datasets": [{"json_path": f"{split}.jsonl", "sampling_strategy": "all",
                                       "image_root": "."}]}
            (tmp / f"{split}.yaml").write_text(
                f"# Generated by vlmexp.data.zoom_demo (seed {seed}, boxes in the {frame.frame} frame). "
                f"Sample it with:\n#   vlmexp sample {split}.yaml --out {split}.sampled.jsonl\n"
                + yaml.safe_dump(data_yaml, sort_keys=False))
    return out


def zoom_folder_name(demo, frame: BoxFrame) -> str:
    """Where under run.output_dir the zoom dataset is generated; any setting that changes it changes the
    name."""
    import hashlib

    made = (demo.model_dump(mode="json"), frame.frame, repr(frame.budget), frame.min_crop_side)
    digest = hashlib.sha256(json.dumps(made, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"zoom_demo_data-{demo.train}-{demo.val}-{demo.seed}-{digest}"


def box_frame_of(cfg) -> BoxFrame:
    """The frame the config's model reads boxes in, with the budget its processor uses: model.min_pixels /
    max_pixels over the family's patch and merge sizes (`released_budget`, what the embedded model's
    processor is built with)."""
    from vlmexp.families import get_family

    if cfg.model.family is None:
        raise ValueError("data.zoom_demo writes its zoom calls in the model's box frame: name model.family "
                         "(or use a tiny:<family> model)")
    family = get_family(cfg.model.family)
    knobs = {k: v for k, v in cfg.model.image_knobs.items() if v is not None}
    return BoxFrame(family.box_frame, family.released_budget(knobs), cfg.grpo.tools.min_crop_side)


def scenes_of(demo) -> ZoomScenes:
    return ZoomScenes(side=demo.side, target=tuple(demo.target), loose=demo.annotator_loose,
                      jitter=demo.annotator_jitter, window=demo.annotator_window,
                      centred=demo.annotator_centred, direct=demo.direct, frame=demo.frame,
                      closeup=demo.closeup, offset=demo.annotator_offset)
