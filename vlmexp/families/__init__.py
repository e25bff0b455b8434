"""Model families vlmexp knows, one module each: how to recognise a checkpoint, which classes load it, its
prompts, image budget, box frame and embedded model (the interface: `vlmexp.families.base.Family`).

Everything family-specific elsewhere is looked up through the family object, so a new family is one module
here plus its entry in FAMILIES (docs/families.md says what it must provide).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from vlmexp.families.base import BUDGET_KNOBS, BoxFrame, Family
from vlmexp.families.internvl import INTERNVL
from vlmexp.families.qwen import QWEN_FAMILIES
from vlmexp.families.qwen3_5 import QWEN35_FAMILIES

__all__ = ["BUDGET_KNOBS", "FAMILIES", "TINY_PREFIX", "BoxFrame", "Family", "FamilyName", "detect_family",
           "get_family"]

FAMILIES: dict[str, Family] = {f.name: f for f in (*QWEN_FAMILIES, *QWEN35_FAMILIES, INTERNVL)}

# the config's `model.family` values, from FAMILIES
FamilyName = Literal[tuple(FAMILIES)]  # type: ignore[valid-type]
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
    hints = [f.refused_model_types[model_type] for f in FAMILIES.values()
             if model_type in f.refused_model_types]
    if hints:
        raise ValueError(f"{config_file}: model_type {model_type!r} is not supported: {hints[0]}")
    if model_type not in FAMILIES:
        raise ValueError(
            f"{config_file}: model_type {model_type!r} is not a supported family; "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]
