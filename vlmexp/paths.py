"""Existence checks behind `vlmexp validate` (skipped with --no-check-paths)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vlmexp.config import Config, DataSource
from vlmexp.errors import DataError
from vlmexp.models import check_model_path

Found = tuple[tuple[str | int, ...], Any, str]  # (location in the config, value, message)


def _check_sources(sources: list[DataSource], loc: tuple, origin: str | None = None) -> list[Found]:
    out: list[Found] = []
    from vlmexp.data.sources import locate

    for i, src in enumerate(sources):
        where = f" (from {origin})" if origin else ""
        found = locate(src.json_path)
        if found.kind == "file" and not Path(found.path).is_file():
            out.append(((*loc, i, "json_path"), src.json_path, f"file not found{where}; fix json_path (a file, "
                                                               f"a glob or folder of shards, or a Hub id org/name@split)"))
        elif found.kind == "shards" and not Path(found.path).is_dir() and not _glob(found.path):
            out.append(((*loc, i, "json_path"), src.json_path, f"no file matches this glob{where}; fix json_path"))
        if src.image_root and not Path(src.image_root).is_dir():
            out.append(((*loc, i, "image_root"), src.image_root, f"folder not found{where}; fix image_root"))
    return out


def _glob(pattern: str) -> list[str]:
    import glob

    return glob.glob(str(Path(pattern).expanduser()), recursive=True)


def _check_yaml(path: str | None, loc: tuple) -> list[Found]:
    from vlmexp.data.sources import load_data_yaml

    if path is None:
        return []
    if not Path(path).is_file():
        return [(loc, path, "data YAML not found; fix the path")]
    try:
        sources = load_data_yaml(path)
    except DataError as e:
        return [(loc, path, str(p)) for p in e.problems]
    return _check_sources(sources, loc + ("datasets",), origin=path)


def check_config_paths(cfg: Config) -> list[Found]:
    """Every local path the config names that does not exist (or is not what it should be)."""
    out: list[Found] = []
    if msg := check_model_path(cfg.model.path):
        out.append((("model", "path"), cfg.model.path, msg))
    d = cfg.data
    out += _check_sources(d.datasets or [], ("data", "datasets"))
    out += _check_sources(d.val_datasets or [], ("data", "val_datasets"))
    out += _check_yaml(d.data_yaml, ("data", "data_yaml"))
    out += _check_yaml(d.val_data_yaml, ("data", "val_data_yaml"))
    launch = cfg.launch
    for key in ("deepspeed", "accelerate_config", "hostfile"):
        value = getattr(launch, key)
        if value and not Path(value).is_file():
            out.append((("launch", key), value, "file not found; fix the path"))
    if launch.deepspeed and Path(launch.deepspeed).is_file():
        try:
            json.loads(Path(launch.deepspeed).read_text())
        except json.JSONDecodeError as e:
            out.append((("launch", "deepspeed"), launch.deepspeed, f"not valid JSON (line {e.lineno}: {e.msg})"))
    return out
