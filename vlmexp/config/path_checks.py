"""Path checks behind `vlmexp validate` (skipped with --no-check-paths) and the commands' own arguments:
what must exist does, what will be read can be read, and what will be written can be written, all
before any work starts."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

from vlmexp.config.schema import Config, DataSource
from vlmexp.errors import DataError, short
from vlmexp.families import TINY_PREFIX

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
Found = tuple[tuple[str | int, ...], Any, str]  # (location in the config, value, message)


def _check_sources(sources: list[DataSource], loc: tuple, origin: str | None = None) -> list[Found]:
    out: list[Found] = []
    from vlmexp.data.sources import glob_paths, locate

    for i, src in enumerate(sources):
        where = f" (from {origin})" if origin else ""
        found = locate(src.json_path)
        if found.kind == "file" and not Path(found.path).is_file():
            out.append(((*loc, i, "json_path"), src.json_path,
                        (f"file not found{where}; fix json_path (a file, a glob or folder of shards, or a "
                         "Hub id org/name@split)")))
        elif found.kind == "shards" and not Path(found.path).is_dir() and not glob_paths(found.path):
            out.append(((*loc, i, "json_path"), src.json_path,
                        f"no file matches this glob{where}; fix json_path"))
        if src.image_root and not Path(src.image_root).is_dir():
            out.append(((*loc, i, "image_root"), src.image_root, f"folder not found{where}; fix image_root"))
        if src.dataset is not None and found.kind != "hub":
            out += [((*loc, i, "dataset"), src.dataset, f"{p.message}{where}") for p in _llamafactory(src)]
    return out


def _llamafactory(src: DataSource) -> list:
    """The problems of a source naming a LLaMA-Factory folder's dataset (vlmexp.data.llamafactory), if any."""
    from vlmexp.data.llamafactory import resolve
    from vlmexp.errors import DataError

    try:
        resolve(src)
    except DataError as e:
        return e.problems
    return []


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
    elif cfg.model.family is None and not is_hub_id(cfg.model.path):
        out += _check_budget_knobs(cfg)
    if msg := check_output_dir(cfg.run.output_dir):
        out.append((("run", "output_dir"), cfg.run.output_dir, msg))
    else:
        from vlmexp.config.schema import TRAINING_STAGES

        for stage in TRAINING_STAGES:
            if getattr(cfg, stage).enabled and (msg := foreign_stage_dir(Path(cfg.run.output_dir) / stage)):
                out.append((("run", "output_dir"), cfg.run.output_dir, msg))
    d = cfg.data
    out += _check_sources(d.datasets or [], ("data", "datasets"))
    out += _check_sources(d.val_datasets or [], ("data", "val_datasets"))
    out += _check_yaml(d.data_yaml, ("data", "data_yaml"))
    out += _check_yaml(d.val_data_yaml, ("data", "val_data_yaml"))
    out += _check_reward_models(cfg)
    launch = cfg.launch
    for key in ("deepspeed", "accelerate_config", "hostfile"):
        value = getattr(launch, key)
        if value and not Path(value).is_file():
            out.append((("launch", key), value, "file not found; fix the path"))
    if launch.deepspeed and Path(launch.deepspeed).is_file():
        _, msg = read_json_file(launch.deepspeed)
        if msg:
            out.append((("launch", "deepspeed"), launch.deepspeed, msg))
    return out


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


def data_paths(cfg: Config, *models: str) -> dict[str, str]:
    """The local files and folders a config reads (data sources, data YAMLs, image roots) and `models`, by
    what they are: what an output folder must never be or hold."""
    from vlmexp.data.sources import load_data_yaml, locate

    found: dict[str, str] = {f"the model {m}": m for m in models if m and Path(m).exists()}
    d = cfg.data
    sources = list(d.datasets or []) + list(d.val_datasets or [])
    for yaml_path in (d.data_yaml, d.val_data_yaml):
        if yaml_path and Path(yaml_path).is_file():
            found[f"the data YAML {yaml_path}"] = yaml_path
            try:
                sources += load_data_yaml(yaml_path)
            except DataError:
                pass  # reported by check_config_paths; nothing of it can be protected
    for src in sources:
        where = locate(src.json_path)
        if where.kind != "hub":
            found[f"the data source {src.json_path}"] = str(Path(where.path).parent if where.kind == "shards"
                                                            and not Path(where.path).is_dir()
                                                            else where.path)
        if src.image_root:
            found[f"the image root {src.image_root}"] = src.image_root
    return found


def check_replaceable_folder(path: str | Path, protected: dict[str, str | Path] | None = None) -> str | None:
    """None when vlmexp may replace the folder `path` as a whole; else why not and the fix. Refused: a folder
    holding anything vlmexp did not make (no marker; an empty one is fine), and a folder that is, or holds,
    the working folder, the home folder, this checkout of vlmexp, or any `protected` path (name -> path: data
    sources, image roots). Symlinks are followed: a link to a user's folder is that folder."""
    from vlmexp.files import foreign_content

    p = Path(path).expanduser()
    target = p.resolve()
    guarded = {"the working folder": Path.cwd(), "your home folder": Path.home(),
               "the vlmexp checkout": Path(__file__).resolve().parents[1], **(protected or {})}
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


def _check_budget_knobs(cfg: Config) -> list[Found]:
    """A local checkpoint's family, read from its config.json, refuses the other family's image-budget fields
    (the schema checks them itself when the family is named or tiny)."""
    from vlmexp.families import detect_family

    if (Path(cfg.model.path).expanduser() / "adapter_config.json").is_file():
        return []  # an adapter's base is checked when its processor loads (vlmexp.processor.load_processor)
    try:
        family = detect_family(Path(cfg.model.path).expanduser())
        family.check_budget_knobs(cfg.model.image_knobs)
    except ValueError as e:
        return [(("model",), cfg.model.path, str(e))]
    if cfg.grpo.tools.names and family.tools_refusal and cfg.model.family is None:
        from vlmexp.config.checks import tools_refusal

        return [(("grpo", "tools", "names"), cfg.grpo.tools.names, tools_refusal(family))]
    return []


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


def _check_reward_models(cfg: Config) -> list[Found]:
    """The model folders of grpo.rewards: a reward model's `path`, a local judge's `model` (without an
    endpoint)."""
    out: list[Found] = []
    for i, spec in enumerate(cfg.grpo.rewards):
        key = {"reward_model": "path", "judge": "model"}.get(spec.name)
        folder = (spec.kwargs.get(key) if key and not (spec.name == "judge" and spec.kwargs.get("endpoint"))
                  else None)
        # a judge runs from disk
        hub = spec.name == "reward_model" and isinstance(folder, str) and is_hub_id(folder)
        if isinstance(folder, str) and folder and not hub and not (Path(folder) / "config.json").is_file():
            out.append((("grpo", "rewards", i, "kwargs", key), folder, (
                "no model folder with a config.json here; fix the path"
                f"{', or set kwargs.endpoint to ask a served judge' if spec.name == 'judge' else ''}")))
    return out


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
