"""Where a config's model lives: a local folder, a hub id, or a tiny model built on first use."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from vlmexp.config import ModelConfig
from vlmexp.families import TINY_PREFIX, Family, detect_family, get_family

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_hub_id(path: str) -> bool:
    """'org/name' that is not a local path (no ./, ../, /, ~ prefix and not on disk)."""
    return bool(_HUB_ID.fullmatch(path)) and not Path(path).exists() and not path.startswith((".", "~"))


def check_model_path(path: str) -> str | None:
    """None when `path` is a tiny spec, a hub id, or a local model folder; otherwise the problem and fix."""
    if path.startswith(TINY_PREFIX) or is_hub_id(path):
        return None
    from vlmexp.paths import check_checkpoint

    p = Path(path).expanduser()
    if not p.exists():
        return "no such folder, and not a hub id (org/name); fix model.path or use tiny:qwen2_5_vl"
    if not (p / "config.json").is_file():
        return f"{p} has no config.json: point model.path at a Hugging Face model folder"
    return check_checkpoint(p)


def tiny_spec(cfg: ModelConfig):
    from vlmexp.tiny import TinySpec

    return TinySpec(**cfg.tiny.model_dump()) if cfg.tiny else TinySpec()


def resolve_model(cfg: ModelConfig, output_dir: str | Path) -> tuple[str, Family]:
    """(path to load, family). A tiny model is built once under <output_dir>/models/ and reused."""
    if cfg.is_tiny:
        from vlmexp.tiny import make_tiny_model

        family = get_family(cfg.path[len(TINY_PREFIX):])
        spec = tiny_spec(cfg)
        key = hashlib.sha256(json.dumps(spec.model_dump(), sort_keys=True).encode()).hexdigest()[:8]
        folder = Path(output_dir) / "models" / f"tiny-{family.name}-{key}"
        if not (folder / "config.json").is_file():
            make_tiny_model(folder, family.name, spec)
        return str(folder), family
    if is_hub_id(cfg.path):
        if cfg.family is None:
            raise ValueError(f"model.path {cfg.path!r} is a hub id: set model.family (one of qwen2_vl, "
                             f"qwen2_5_vl, qwen3_vl) or download it and give the local folder")
        return cfg.path, get_family(cfg.family)
    family = detect_family(cfg.path)
    if cfg.family and cfg.family != family.name:
        raise ValueError(f"model.family {cfg.family!r} contradicts {cfg.path}/config.json "
                         f"(model_type {family.name!r}): remove model.family")
    return cfg.path, family
