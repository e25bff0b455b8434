"""Coordinate frames: smart_resize agrees with transformers', round trips, and box parsing."""

from __future__ import annotations

import random

import pytest

from vlmexp.coords import from_frame, iou, parse_box, to_frame
from vlmexp.families.qwen import smart_resize
from vlmexp.processor import PixelBudget

REAL = PixelBudget(patch_size=14, merge_size=2, min_pixels=3136, max_pixels=12845056)
SMALL = PixelBudget(patch_size=14, merge_size=2, min_pixels=3136, max_pixels=200704)
QWEN3 = PixelBudget(patch_size=16, merge_size=2, min_pixels=4096, max_pixels=16777216)


def test_smart_resize_matches_transformers_on_random_sizes():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

    rng = random.Random(0)
    for _ in range(2000):
        h, w = rng.randint(4, 6000), rng.randint(4, 6000)
        if max(h, w) / min(h, w) > 200:
            continue
        budget = rng.choice([REAL, SMALL, QWEN3])
        ours = smart_resize(h, w, budget.factor, budget.min_pixels, budget.max_pixels)
        assert ours == hf_smart_resize(h, w, factor=budget.factor, min_pixels=budget.min_pixels,
                                       max_pixels=budget.max_pixels), (h, w, budget)


def test_pixels_frame_by_hand():
    # 1000 x 500 with the real budget: round(500/28)=18 -> 504, round(1000/28)=36 -> 1008
    assert smart_resize(500, 1000, 28, 3136, 12845056) == (504, 1008)
    assert to_frame([100, 50, 200, 100], 1000, 500, "pixels", REAL) == pytest.approx([100.8, 50.4, 201.6,
                                                                                      100.8])
    assert to_frame([100, 50, 200, 100], 1000, 500, "grid1000") == pytest.approx([100, 100, 200, 200])


@pytest.mark.parametrize("frame, budget", [("pixels", REAL), ("pixels", SMALL), ("grid1000", None)])
def test_round_trip(frame, budget):
    rng = random.Random(1)
    for _ in range(500):
        w, h = rng.randint(50, 4000), rng.randint(50, 4000)
        x1, y1 = rng.uniform(0, w / 2), rng.uniform(0, h / 2)
        box = [x1, y1, rng.uniform(x1 + 1, w), rng.uniform(y1 + 1, h)]
        assert from_frame(to_frame(box, w, h, frame, budget), w, h, frame, budget) == pytest.approx(box)


def test_pixels_frame_needs_budget():
    with pytest.raises(ValueError, match="pixel budget"):
        to_frame([0, 0, 1, 1], 10, 10, "pixels")


def test_budget_read_from_a_loaded_processor(tiny_models):
    from vlmexp.families import detect_family
    from vlmexp.processor import load_processor

    for family, patch in (("qwen2_5_vl", 14), ("qwen3_vl", 16)):
        fam = detect_family(tiny_models[family])
        proc = load_processor(tiny_models[family], fam, {"min_pixels": 3136, "max_pixels": 12845056})
        assert fam.image_budget(proc) == PixelBudget(patch, 2, 3136, 12845056)
        # The processor really resizes to what our smart_resize says.
        from PIL import Image

        out = proc.image_processor(images=[Image.new("RGB", (333, 217))], return_tensors="np")
        t, gh, gw = out["image_grid_thw"][0]
        assert (gh * patch, gw * patch) == smart_resize(217, 333, patch * 2, 3136, 12845056)


@pytest.mark.parametrize("value, expected", [
    ([1, 2, 3, 4], [1, 2, 3, 4]),
    ("[1, 2, 3, 4]", [1, 2, 3, 4]),
    ("<think>hm</think><answer>[10, 20.5, 30, 40]</answer>", [10, 20.5, 30, 40]),
    ('<answer>{"bbox_2d": [5, 6, 7, 8], "label": "cat"}</answer>', [5, 6, 7, 8]),
    ('<answer>[{"bbox_2d": [5, 6, 7, 8]}]</answer>', [5, 6, 7, 8]),
    ("the box is [1,2,3,4] I think", [1, 2, 3, 4]),
    ("<answer>no numbers</answer>", None),
    ("[1, 2, 3]", None),
    (None, None),
    ([True, 2, 3, 4], None),
])
def test_parse_box(value, expected):
    assert parse_box(value) == expected


def test_iou():
    assert iou([0, 0, 10, 10], [0, 0, 10, 10]) == 1.0
    assert iou([0, 0, 10, 10], [5, 0, 15, 10]) == pytest.approx(50 / 150)
    assert iou([0, 0, 1, 1], [2, 2, 3, 3]) == 0.0
    assert iou([0, 0, 0, 0], [0, 0, 0, 0]) == 0.0
