"""Model families vlmexp knows: how to recognise a checkpoint, which classes load it, and its box frame.

One row per family. Everything family-specific elsewhere (coordinate frame, chat template, processor
class) is looked up here, so adding Qwen3-VL-like families is one entry, not a hunt for `if`s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

BoxFrame = Literal["pixels", "grid1000"]


@dataclass(frozen=True)
class Family:
    name: str  # our name, also transformers' `model_type`
    model_class: str  # transformers class with the LM head
    processor_class: str  # the processor real checkpoints declare
    chat_template: str  # file name under trl/chat_templates (the official template, shipped by TRL)
    box_frame: BoxFrame  # "pixels": absolute pixels of the smart-resized image; "grid1000": 0-1000 grid
    default_patch_size: int


FAMILIES: dict[str, Family] = {
    "qwen2_vl": Family(
        "qwen2_vl", "Qwen2VLForConditionalGeneration", "Qwen2VLProcessor", "qwen2_5_vl.jinja", "grid1000", 14
    ),
    "qwen2_5_vl": Family(
        "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor", "qwen2_5_vl.jinja", "pixels", 14
    ),
    "qwen3_vl": Family(
        "qwen3_vl", "Qwen3VLForConditionalGeneration", "Qwen3VLProcessor", "qwen3_vl.jinja", "grid1000", 16
    ),
}

FamilyName = Literal[tuple(FAMILIES)]  # type: ignore[valid-type]  # the config's `model.family` values, from FAMILIES
TINY_PREFIX = "tiny:"


def get_family(name: str) -> Family:
    """The family called `name`, or a ValueError listing the known ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(
            f"unknown model family {name!r}: use one of {', '.join(sorted(FAMILIES))}"
        ) from None


def detect_family(model_path: str | Path) -> Family:
    """Read `model_type` from a local checkpoint's config.json and return its family."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"{config_file} not found: model.path must be a Hugging Face model folder with a config.json, "
            f"a hub id, or 'tiny:<family>'"
        )
    model_type = json.loads(config_file.read_text()).get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(
            f"{config_file}: model_type {model_type!r} is not a supported family; "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]
