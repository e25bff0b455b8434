"""Pictures of a zoom run (grpo.tools, "thinking with images"): the record's image with every zoom box drawn
in order (numbered, in original pixels) and the crops beside it, and under them the final answer and its
score. For GRPO's completion tables, validation during training and evaluation with the tool; the boxes come
from the environment that cropped them, or replayed from a completion's calls (`replayed_zooms`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from vlmexp.pictures import LINE, MAX_SIDE, font, open_image, save_png, wrap

ZOOM_COLOURS = ((230, 30, 30), (0, 90, 255), (255, 140, 0), (230, 0, 230), (0, 190, 210), (140, 80, 20))


def zoom_picture(image: str, zooms: Sequence[Sequence[int]], answer: str, score: float | None,
                 side: int = 256) -> Image.Image:
    """`image` (a path) at `side` pixels with the zoom boxes (original pixels) numbered in order, the crops
    beside it, each scaled to a cell of at most `side` pixels (the picture at most MAX_SIDE wide: cells
    shrink to fit), the final answer and its score written under them."""
    canvas, scale = open_image(image, side)
    with Image.open(image) as im:
        original = im.convert("RGB")
    draw = ImageDraw.Draw(canvas)
    crops = []
    for n, box in enumerate(zooms):
        colour = ZOOM_COLOURS[n % len(ZOOM_COLOURS)]
        x1, y1, x2, y2 = (round(v * scale) for v in box)
        draw.rectangle([x1, y1, max(x1, x2 - 1), max(y1, y2 - 1)], outline=colour, width=LINE)
        draw.text((x1 + LINE + 1, y1 + LINE), str(n + 1), fill=colour, font=font(11))
        crops.append((colour, original.crop(tuple(box))))
    width = canvas.width
    cell = min(side, (MAX_SIDE - width) // max(1, len(crops))) if crops else 0
    shown = "-" if score is None else f"{score:.2f}"
    text = f"answer: {answer!r}  score: {shown}  zooms: {len(zooms)}"
    lines = wrap(text, width + cell * len(crops) - 8, font(11))
    out = Image.new("RGB", (width + cell * len(crops), canvas.height + 4 + 14 * len(lines)), (255, 255, 255))
    out.paste(canvas, (0, 0))
    draw = ImageDraw.Draw(out)
    for n, (colour, crop) in enumerate(crops):
        fit = (cell - 2 * LINE) / max(crop.size)  # up or down to the cell
        crop = crop.resize((max(1, round(crop.width * fit)), max(1, round(crop.height * fit))),
                           Image.Resampling.NEAREST)
        x = width + n * cell + LINE
        out.paste(crop, (x, LINE))
        draw.rectangle([x - LINE, 0, x + crop.width + LINE - 1, crop.height + 2 * LINE - 1], outline=colour,
                       width=LINE)
        draw.text((x + 2, crop.height + 2 * LINE), str(n + 1), fill=colour, font=font(11))
    for i, line in enumerate(lines):
        draw.text((4, canvas.height + 2 + 14 * i), line, fill=(0, 0, 0), font=font(11))
    return out


def write_zoom_pictures(rows: Sequence[dict[str, Any]], count: int, folder: str | Path) -> list[Path]:
    """record_000.png ...: the first `count` rows of an evaluation with the tool (each with `image`, `zooms`,
    `answer`, `score`) drawn by `zoom_picture`."""
    return [save_png(zoom_picture(row["image"], row["zooms"], row.get("answer") or "", row.get("score")),
                     Path(folder) / f"record_{i:03d}.png")
            for i, row in enumerate(rows[:count]) if row.get("image")]
