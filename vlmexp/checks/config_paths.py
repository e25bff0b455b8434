"""Path checks of a config behind `vlmexp validate` (skipped with --no-check-paths): the files and folders its
fields name (data sources, data YAMLs, image roots, the model, the output folder, model rewards' folders,
launch files) exist and are what they should be, all before any work starts; `data_paths`: what an output
folder must never be or hold. The generic predicates they use are `vlmexp.paths`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmexp.config.schema import TRAINING_STAGES, Config, DataSource
from vlmexp.errors import DataError
from vlmexp.paths import check_model_path, check_output_dir, foreign_stage_dir, is_hub_id, read_json_file

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
        elif found.kind != "hub" and (media := _first_record_media(src)) is not None:
            out.append(((*loc, i, "json_path"), src.json_path, f"{media}{where}"))
    return out


def _first_record_media(src: DataSource) -> str | None:
    """Why the source's first record is refused for carrying video or audio (vlmexp.data.media), or None;
    sampling checks every row it keeps. A source that cannot be read is left to the other checks."""
    from vlmexp.data.media import media_problem
    from vlmexp.data.sampling import rename_columns
    from vlmexp.data.sources import open_table

    try:
        table = open_table(src)
        where, record = next(iter(table.take([0]))) if len(table) else ("", None)
    except (DataError, OSError, ValueError):
        return None
    found = media_problem(rename_columns(record, src.columns)) if isinstance(record, dict) else None
    return None if found is None else f"{where}: {found[1]}"


def _llamafactory(src: DataSource) -> list:
    """The problems of a source naming a LLaMA-Factory folder's dataset (vlmexp.data.llamafactory), if any."""
    from vlmexp.data.llamafactory import resolve

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


def check_config_paths(cfg: Config, check_cluster: bool = True) -> list[Found]:
    """Every local path the config names that does not exist (or is not what it should be); with
    `check_cluster`, the Ray cluster that `launch.launcher: ray` names."""
    out: list[Found] = []
    if msg := check_model_path(cfg.model.path):
        out.append((("model", "path"), cfg.model.path, msg))
    elif cfg.model.family is None and not is_hub_id(cfg.model.path):
        out += _check_budget_knobs(cfg)
    if msg := check_output_dir(cfg.run.output_dir):
        out.append((("run", "output_dir"), cfg.run.output_dir, msg))
    else:
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
    ds: Any = {}
    if launch.deepspeed and Path(launch.deepspeed).is_file():
        ds, msg = read_json_file(launch.deepspeed)
        if msg:
            out.append((("launch", "deepspeed"), launch.deepspeed, msg))
    out += _check_sharded_validation(cfg, ds)
    from vlmexp.launch import is_launched_process

    # a worker's cluster was checked by its driver
    if launch.launcher == "ray" and check_cluster and not is_launched_process():
        from vlmexp.ray_cluster import check_ray_launch

        out += check_ray_launch(cfg)
    return out


def _check_sharded_validation(cfg: Config, deepspeed: Any) -> list[Found]:
    """Validation during training over several processes whose parameters are sharded (ZeRO-3 in
    launch.deepspeed, FSDP in a stage's args): refused here, before the launcher starts any process, as each
    rank would refuse it after its start-up."""
    from vlmexp.launch import is_zero3, process_count, sharded_validation_problem

    if not cfg.eval.every_steps:
        return []
    zero3 = is_zero3(deepspeed)
    fsdp = any(getattr(cfg, s).enabled and getattr(cfg, s).args.get("fsdp") for s in TRAINING_STAGES)
    problem = sharded_validation_problem(process_count(cfg.launch), zero3, fsdp)
    return [(("eval", "every_steps"), cfg.eval.every_steps, problem)] if problem else []


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
        return [(("grpo", "tools", "names"), cfg.grpo.tools.names, family.tools_problem())]
    return []


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


