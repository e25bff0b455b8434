"""Path predicates every part of vlmexp asks before work starts: is this a Hub id, a model or adapter
folder (`check_model_path`, `check_checkpoint`), a folder or file that can be written (`check_output_dir`,
`check_output_file`), a folder vlmexp may replace (`check_replaceable_folder`) or reuse as a stage folder
(`foreign_stage_dir`), a readable JSON settings file (`read_json_file`). Each answers None, or what is wrong
and the fix. They know nothing of the config: `vlmexp.checks.config_paths` applies them to its fields."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

from vlmexp.errors import short
from vlmexp.families import TINY_PREFIX

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def read_json_file(path: str | Path, limit: int = 64 << 20) -> tuple[Any, str | None]:
    """(parsed JSON, None), or (None, what is wrong with the file and the fix): unreadable, over `limit`
    bytes, not UTF-8, not JSON (with the line)."""
    p = Path(path)
    try:
        if p.stat().st_size > limit:
            return None, f"{p} has {p.stat().st_size} bytes, over the {limit} a JSON settings file may have"
        data = p.read_bytes()
    except OSError as e:
        return None, f"{p} cannot be read ({e.strerror or e}); check the path and permissions"
    try:
        return json.loads(data.decode("utf-8-sig")), None
    except UnicodeDecodeError as e:
        return None, f"{p} is not UTF-8 text (byte {e.start}); save it as UTF-8"
    except json.JSONDecodeError as e:
        return None, f"{p} is not valid JSON (line {e.lineno}: {e.msg}); fix the file"
    except (ValueError, RecursionError) as e:
        return None, f"{p} cannot be read as JSON ({e.__class__.__name__}); fix the file"


def check_output_dir(path: str | Path) -> str | None:
    """None when `path` is a folder that can be written, or one that can be created; else why not.

    Writing is tried (a temporary file, removed at once) rather than predicted from permission bits,
    which say nothing for root, ACLs or read-only mounts."""
    p = Path(path).expanduser().absolute()
    if p.exists() and not p.is_dir():
        return f"{p} is a file, not a folder; choose another path or move the file away"
    existing = next((a for a in (p, *p.parents) if a.exists()), Path("/"))
    if not existing.is_dir():
        return f"{existing} is a file, so the folder {p} cannot be created there; choose another path"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        doing = "written" if existing == p else f"created ({existing} cannot be written)"
        return f"the folder {p} cannot be {doing}: {e.strerror or e}; choose a writable place"
    return None


def check_replaceable_folder(path: str | Path, protected: dict[str, str | Path] | None = None) -> str | None:
    """None when vlmexp may replace the folder `path` as a whole; else why not and the fix. Refused: a folder
    holding anything vlmexp did not make (no marker; an empty one is fine), and a folder that is, or holds,
    the working folder, the home folder, this checkout of vlmexp, or any `protected` path (name -> path: data
    sources, image roots). Symlinks are followed: a link to a user's folder is that folder."""
    from vlmexp.files import foreign_content

    p = Path(path).expanduser()
    target = p.resolve()
    guarded = {"the working folder": Path.cwd(), "your home folder": Path.home(),
               "the vlmexp checkout": Path(__file__).resolve().parent, **(protected or {})}
    for name, value in guarded.items():
        q = Path(value).expanduser().resolve()
        if q == target or target in q.parents:
            return (f"{p} is or holds {name} ({q}), and vlmexp replaces its output folder as a whole; choose "
                    f"a folder of its own, e.g. {p / 'export'}")
    return foreign_content(target)


KEY_FILE = "stage_key.json"  # in each stage folder: the inputs it belongs to (vlmexp.pipeline.keys)


def foreign_stage_dir(stage_dir: Path) -> str | None:
    """Why `stage_dir` is not vlmexp's to archive and reuse (it holds files, but neither the pipeline's stage
    key nor the marker `vlmexp train` leaves), or None."""
    from vlmexp.files import MARKER, foreign_content

    if (stage_dir / KEY_FILE).is_file() or foreign_content(stage_dir) is None:
        return None
    return (f"{stage_dir} holds files that no vlmexp stage wrote (no {KEY_FILE} or {MARKER}); vlmexp moves "
            "or reuses only its own stage folders: set run.output_dir to a folder of the run's own, or move "
            "that folder away")


def check_output_file(path: str | Path) -> str | None:
    """None when a file can be written at `path` (created or replaced); else why not."""
    p = Path(path).expanduser().absolute()
    if p.is_dir():
        return f"{p} is a folder; give a file path"
    return check_output_dir(p.parent)


def check_checkpoint(path: str | Path) -> str | None:
    """None when `path` is a model folder (config.json of a known family) or a LoRA adapter folder
    (adapter_config.json naming a usable base); else what is wrong and the fix."""
    from vlmexp.families import FAMILIES

    p = Path(path).expanduser()
    if not p.is_dir():
        return (f"{p}: no such folder; give a model folder or a LoRA adapter folder "
                "(e.g. outputs/demo/grpo/final)")
    if (p / "adapter_config.json").is_file():
        adapter, msg = read_json_file(p / "adapter_config.json")
        base = adapter.get("base_model_name_or_path") if isinstance(adapter, dict) else None
        if msg or not isinstance(base, str):
            return msg or f"{p}/adapter_config.json names no base_model_name_or_path; re-save the adapter"
        return check_model_path(base)
    if not (p / "config.json").is_file():
        return f"{p} has no config.json or adapter_config.json; point at a saved model or adapter folder"
    config, msg = read_json_file(p / "config.json")
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if msg or model_type not in FAMILIES:
        return msg or (f"{p}/config.json: model_type {short(model_type)} is not a supported family; "
                       f"supported: {', '.join(sorted(FAMILIES))}")
    return None


def is_hub_id(path: str) -> bool:
    """'org/name' that is not a local path (no ./, ../, /, ~ prefix and not on disk)."""
    return bool(_HUB_ID.fullmatch(path)) and not Path(path).exists() and not path.startswith((".", "~"))


def check_model_path(path: str) -> str | None:
    """None when `path` is a tiny spec, a hub id, or a local model folder; otherwise the problem and fix."""
    if path.startswith(TINY_PREFIX) or is_hub_id(path):
        return None
    p = Path(path).expanduser()
    if not p.exists():
        return "no such folder, and not a hub id (org/name); fix model.path or use tiny:qwen2_5_vl"
    if not (p / "config.json").is_file():
        return f"{p} has no config.json: point model.path at a Hugging Face model folder"
    return check_checkpoint(p)
