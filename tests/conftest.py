"""Shared fixtures: tiny models and demo data are built once per test session (offline, seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlmexp.data.demo import Scenes

REPO = Path(__file__).resolve().parents[1]
# configs/demo.yaml batches 32 SFT records and 8 GRPO prompts (64 completions) per step for its demo run;
# tests that train a few steps from it take one prompt (and 8 records) per step
SMALL_BATCHES = ["sft.args.per_device_train_batch_size=8", "grpo.args.per_device_train_batch_size=8",
                 "grpo.args.gradient_accumulation_steps=1"]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """A built tiny model folder per family, created lazily."""
    from vlmexp.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    cache: dict[str, Path] = {}

    class Models(dict):
        def __missing__(self, family: str) -> Path:
            cache[family] = make_tiny_model(root / family, family)
            self[family] = cache[family]
            return cache[family]

    return Models()


# 2-3 shapes on plain images of many sizes (not the demo recipe's): what the frame and caption tests need
VARIED_SCENES = Scenes(width=(160, 320), height=(120, 280), objects=(2, 3), background="plain")


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    from vlmexp.data.demo import make_demo_data

    return make_demo_data(tmp_path_factory.mktemp("demo") / "data", train=24, val=8, seed=0, scenes=VARIED_SCENES)


def write_json(path: Path, obj) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))
    return path


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def make_png(path: Path, size=(64, 48), color="red") -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    return path
