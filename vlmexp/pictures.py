"""Pictures of what a model sees and says: a record's image with the ground truth and each model's boxes drawn
on it, in original pixels, for MLflow (evaluation, GRPO's completion tables, validation during training).

Boxes come from the rewards' own reading of an answer (`boxes_of`: `IoUReward.box`,
`DetectionReward.objects`), which maps the family's frame (Qwen2-VL's and InternVL's 0-1000 grid, Qwen2.5-VL's
resized pixels) to original pixels; nothing here reads an answer a second way. Every picture is a PNG of at
most MAX_SIDE pixels a side (PNG: the colours on a box's edges stay exact). Each model has a fixed colour
(COLOURS); the ground truth is green. Math and other text answers are shown as text beside the image, with
their verdict.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

MAX_SIDE = 512  # no picture is larger on either side
RGB = tuple[int, int, int]
TRUTH = "truth"
# fixed colours (name, RGB) of the ground truth and of each stage's model; other names take OTHER_COLOURS in
# turn
COLOURS: dict[str, tuple[str, RGB]] = {TRUTH: ("green", (0, 170, 0)), "base": ("grey", (128, 128, 128)),
                                       "sft": ("blue", (0, 90, 255)), "dpo": ("orange", (255, 140, 0)),
                                       "grpo": ("magenta", (230, 0, 230))}
OTHER_COLOURS: tuple[tuple[str, RGB], ...] = (("red", (230, 30, 30)), ("cyan", (0, 190, 210)),
                                              ("brown", (140, 80, 20)), ("black", (0, 0, 0)))
LINE = 3  # box edge width in picture pixels, drawn inward from the box's coordinates
PANEL = 192  # width of the text panel beside a record's image
FONT_SIZE = 12
BOXED_TASKS = ("rec", "detection")


def colours(names: Sequence[str]) -> dict[str, tuple[str, RGB]]:
    """(colour name, RGB) of each model name: a stage's own colour, else the next of OTHER_COLOURS."""
    others = iter(OTHER_COLOURS * (1 + len(names) // len(OTHER_COLOURS)))
    return {name: COLOURS.get(name) or next(others) for name in names}


def _rounded(box: Sequence[float]) -> list[float]:
    return [round(float(v), 2) for v in box]


def boxes_of(scorers: Mapping[str, Any], text: str, columns: Mapping[str, list], i: int) -> dict[str, list]:
    """{"truth": [...], "boxes": [...]} of sample `i`, each a {"box": [x1, y1, x2, y2], "label": str} in
    original pixels: the ground truth and the completion `text`'s boxes as the iou and detection rewards of
    `scorers` (vlmexp.scoring.build_scorers) read them. An unreadable answer has no boxes; other tasks give
    {}."""
    from vlmexp.coords import parse_box
    from vlmexp.detection import gold_objects
    from vlmexp.rewards import Unparsable

    task, solution, sizes = columns["task"][i], columns["solution"][i], columns["image_sizes"][i]
    if task == "rec":
        box = scorers["iou"].fn.box(text, sizes)
        found = [] if isinstance(box, Unparsable) else [(box, "")]
        truth = [(parse_box(solution), "")]
    elif task == "detection":
        method = columns["accu_reward_method"][i]
        read = scorers["detection"].fn.objects(text, solution, method, sizes)
        found, truth = (([], gold_objects(solution, method)) if isinstance(read, Unparsable)
                        else (read[0], read[2]))
    else:
        return {}
    return {"truth": [{"box": _rounded(b), "label": label} for b, label in truth],
            "boxes": [{"box": _rounded(b), "label": label} for b, label in found]}


@dataclass
class Answer:
    """One model's answer on a record, as drawn: its boxes in original pixels, its answer text and its
    score."""

    model: str
    boxes: list[dict[str, Any]] = field(default_factory=list)
    answer: str | None = None
    score: float | None = None


@dataclass
class Shown:
    """One record as drawn: its image, task, ground truth and the answers of one or more models."""

    image: str  # path of the record's first image ("" when it has none)
    task: str
    truth: list[dict[str, Any]]
    solution: str
    answers: list[Answer]


def shown_records(models: Mapping[str, Sequence[Mapping[str, Any]]], count: int) -> list[Shown]:
    """The first `count` records of per-sample evaluation rows ({model: rows}, rows as
    `vlmexp.scoring.score_records` writes them, every model's in the same record order)."""
    names = list(models)
    first = models[names[0]] if names else []
    out = []
    for i, row in enumerate(first[:count]):
        answers = [Answer(name, list(models[name][i].get("boxes", [])), models[name][i].get("answer"),
                          models[name][i].get("score")) for name in names]
        out.append(Shown(row.get("image", ""), row["task"], list(row.get("truth", [])),
                         str(row.get("solution", "")), answers))
    return out


def font(size: int = FONT_SIZE) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def open_image(path: str, side: int) -> tuple[Image.Image, float]:
    """(the image scaled so its longer side is `side`, the scale from original pixels); a grey square when the
    record has no image."""
    if not path:
        return Image.new("RGB", (side, side), (200, 200, 200)), 1.0
    with Image.open(path) as im:
        im = im.convert("RGB")
    scale = side / max(im.size)
    size = (max(1, round(im.width * scale)), max(1, round(im.height * scale)))
    return im.resize(size, Image.Resampling.BILINEAR), scale


def draw_boxes(canvas: Image.Image, scale: float, boxes: Sequence[Mapping[str, Any]], colour: RGB,
               labels: bool) -> None:
    """Each box (original pixels) scaled by `scale`, its edges LINE pixels wide inside the box, its label
    written inside its top-left corner when `labels`."""
    draw = ImageDraw.Draw(canvas)
    for item in boxes:
        x1, y1, x2, y2 = (round(v * scale) for v in item["box"])
        x1, y1 = max(x1, -LINE), max(y1, -LINE)
        x2, y2 = min(x2, canvas.width + LINE), min(y2, canvas.height + LINE)
        if x2 - x1 < 1 or y2 - y1 < 1:
            continue
        draw.rectangle([x1, y1, x2 - 1, y2 - 1], outline=colour, width=LINE)
        if labels and item.get("label"):
            draw.text((x1 + LINE + 1, y1 + LINE), str(item["label"])[:24], fill=colour, font=font(10))


def boxed_image(shown: Shown, side: int, palette: Mapping[str, tuple[str, RGB]]) -> Image.Image:
    """The record's image at `side` pixels (its longer side) with the ground truth, then each answer's
    boxes."""
    canvas, scale = open_image(shown.image, side)
    labels = shown.task == "detection"
    draw_boxes(canvas, scale, shown.truth, COLOURS[TRUTH][1], labels)
    for answer in shown.answers:
        draw_boxes(canvas, scale, answer.boxes, palette[answer.model][1], labels)
    return canvas


def verdict(task: str, answer: Answer) -> str:
    """How an answer's score reads: IoU for a box, the detection reward, right / wrong (or partial credit)."""
    if answer.score is None:
        return "not scored"
    if task == "rec":
        return f"IoU {answer.score:.2f}" + ("" if answer.boxes else " (no box)")
    if task == "detection":
        return f"score {answer.score:.2f}, {len(answer.boxes)} box(es)"
    return {1.0: "right", 0.0: "wrong"}.get(float(answer.score), f"score {answer.score:.2f}")


def wrap(text: str, width: int, face) -> list[str]:
    """`text` in lines no wider than `width` pixels."""
    lines, line = [], ""
    for word in " ".join(str(text).split()).split(" "):
        trial = f"{line} {word}".strip()
        if line and face.getlength(trial) > width:
            lines.append(line)
            line = word
        else:
            line = trial
        while face.getlength(line) > width and len(line) > 1:  # a word too long for a line
            cut = max(1, int(len(line) * width / face.getlength(line)))
            lines.append(line[:cut])
            line = line[cut:]
    return [*lines, line] if line else lines


def panel_lines(shown: Shown, palette: Mapping[str, tuple[str, RGB]]) -> list[tuple[str, RGB]]:
    """The legend and answers beside a record's image: (text, colour) per line before wrapping."""
    black = (0, 0, 0)
    lines = [(f"ground truth ({COLOURS[TRUTH][0]})", COLOURS[TRUTH][1])]
    if shown.task not in BOXED_TASKS:
        lines.append((f"solution: {shown.solution}", black))
    for answer in shown.answers:
        name, rgb = palette[answer.model]
        lines.append((f"{answer.model} ({name}): {verdict(shown.task, answer)}", rgb))
        if shown.task not in BOXED_TASKS:
            lines.append((f"  answer: {answer.answer if answer.answer is not None else '(none)'}", black))
    return lines


def record_picture(shown: Shown, palette: Mapping[str, tuple[str, RGB]] | None = None,
                   side: int = MAX_SIDE - PANEL) -> Image.Image:
    """One record: its image (longer side `side`) with every box, and beside it the legend, each model's
    verdict (IoU per model) and, for text tasks, the solution and each answer."""
    palette = palette or colours([a.model for a in shown.answers])
    image = boxed_image(shown, min(side, MAX_SIDE - PANEL), palette)
    face = font()
    rows = [(piece, rgb) for text, rgb in panel_lines(shown, palette)
            for piece in wrap(text, PANEL - 12, face)]
    height = min(MAX_SIDE, max(image.height, 8 + 16 * len(rows)))
    canvas = Image.new("RGB", (image.width + PANEL, height), (255, 255, 255))
    canvas.paste(image, (0, 0))
    draw = ImageDraw.Draw(canvas)
    for n, (text, rgb) in enumerate(rows):
        y = 6 + 16 * n
        if y + 14 > height:
            draw.text((image.width + 6, height - 16), "...", fill=(0, 0, 0), font=face)
            break
        draw.text((image.width + 6, y), text, fill=rgb, font=face)
    return canvas


def grid_picture(shown: Sequence[Shown], title: str = "") -> Image.Image:
    """Every record's image with its boxes, in a square-ish grid under a legend line (model: colour, mean
    score), the whole at most MAX_SIDE pixels a side."""
    names = [a.model for a in shown[0].answers] if shown else []
    palette = colours(names)
    cols = max(1, math.ceil(math.sqrt(len(shown))))
    rows = max(1, math.ceil(len(shown) / cols))
    legend, gap = 34, 2
    tile = max(16, min((MAX_SIDE - gap * (cols - 1)) // cols, (MAX_SIDE - legend - gap * (rows - 1)) // rows))
    canvas = Image.new("RGB", (cols * tile + gap * (cols - 1), legend + rows * tile + gap * (rows - 1)),
                       (255,) * 3)
    draw, face = ImageDraw.Draw(canvas), font(11)
    draw.text((4, 2), title, fill=(0, 0, 0), font=face)
    x = 4
    for name, (colour, rgb) in [(f"{COLOURS[TRUTH][0]}: truth", COLOURS[TRUTH]),
                                *((mean_label(shown, n), palette[n]) for n in names)]:
        draw.text((x, 18), name, fill=rgb, font=face)
        x += int(face.getlength(name)) + 10
    for k, item in enumerate(shown):
        image = boxed_image(item, tile, palette)
        canvas.paste(image, ((k % cols) * (tile + gap), legend + (k // cols) * (tile + gap)))
    return canvas


def mean_label(shown: Sequence[Shown], model: str) -> str:
    """'<model> <colour> <mean score>' for the grid's legend."""
    scores = [a.score for s in shown for a in s.answers if a.model == model and a.score is not None]
    mean = f" {sum(scores) / len(scores):.2f}" if scores else ""
    return f"{COLOURS.get(model, ('', None))[0] or model}: {model}{mean}"


def completion_picture(image: str, truth: Sequence[Mapping[str, Any]], boxes: Sequence[Mapping[str, Any]],
                       reward: float | None, advantage: float | None, model: str = "grpo",
                       side: int = 256, task: str = "rec") -> Image.Image:
    """A GRPO completion for its table: the image (longer side `side`) with the ground truth and the
    completion's boxes, and its reward and advantage written under it."""
    shown = Shown(image, task, list(truth), "", [Answer(model, list(boxes))])
    top = boxed_image(shown, side, colours([model]))
    canvas = Image.new("RGB", (top.width, top.height + 18), (255, 255, 255))
    canvas.paste(top, (0, 0))
    words = [f"reward {reward:.3f}" if reward is not None else "reward -",
             f"advantage {advantage:+.3f}" if advantage is not None else "advantage -"]
    ImageDraw.Draw(canvas).text((4, top.height + 3), ", ".join(words), fill=(0, 0, 0), font=font(11))
    return canvas


def save_png(image: Image.Image, path: str | Path) -> Path:
    """`image` as a PNG at `path` (its folder made), written whole or not at all."""
    import io

    from vlmexp.files import atomic_write

    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=True)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, buffer.getvalue())


def write_evaluation_pictures(models: Mapping[str, Sequence[Mapping[str, Any]]], count: int,
                              folder: str | Path, title: str = "") -> list[Path]:
    """record_000.png ... (one per record, the first `count` of the per-sample rows {model: rows}) and
    grid.png (all of them) in `folder`; [] when `count` is 0 or there are no rows. Returns the files, the grid
    last."""
    shown = shown_records(models, count)
    if not shown:
        return []
    palette = colours(list(models))
    folder = Path(folder)
    files = [save_png(record_picture(s, palette), folder / f"record_{i:03d}.png")
             for i, s in enumerate(shown)]
    return [*files, save_png(grid_picture(shown, title), folder / GRID)]


GRID = "grid.png"
