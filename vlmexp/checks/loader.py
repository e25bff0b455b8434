"""Load a config: YAML file (with its `extends:` chain) + dotted overrides -> validated `Config`, or a
ConfigError listing every problem.

Each problem names where it comes from (file:line of the file that wrote the value, a base file's included,
or the override that set it), the field's dotted path, the bad value, and the fix. YAML is parsed with the
safe loader only. Three phases: compose (`vlmexp.config.compose`), the schema (`vlmexp.config.schema`, pure),
and the check phase (`vlmexp.checks.rules` and `vlmexp.checks.config_paths`, whose checks with side effects
run only when asked).
"""

from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from vlmexp.checks.rules import check_names, check_reward_imports, check_sections, check_trl_config
from vlmexp.config.compose import EXTENDS, origin_of, read_composed
from vlmexp.config.schema import Config
from vlmexp.config.yaml_reader import Loc, YamlProblems, parse_yaml
from vlmexp.errors import ConfigError, Problem, change_the_value, short


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = (), check_paths: bool = False,
                check_trl: bool = True, import_rewards: bool = False, check_cluster: bool = True) -> Config:
    """Read (merging `extends:`), override and validate a config. Raises ConfigError with all problems found.

    Reward names, sampling strategies and `columns` fields are always checked (nothing runs). The switches:
    `check_trl` builds TRL's config classes from the args (off for a config validated already: a run's
    resolved copy); `import_rewards` imports each module:function reward's module in a child process, so the
    module's top-level code runs (`vlmexp validate`, `run` and `train` turn it on); `check_paths` probes the
    files and folders the config names, and with `check_cluster` the Ray cluster of `launch.launcher: ray`
    (off where the Ray driver that checks it on its own connection comes next)."""
    raw, origins = read_composed(path)
    problems: list[Problem] = []
    override_locs: dict[Loc, str] = {}
    for item in overrides:
        try:
            loc = apply_override(raw, item)
            override_locs[loc] = item
        except ValueError as e:
            problems.append(Problem(f"override {short(item)}", "", str(e)))

    def where(loc: Loc) -> str:
        for set_loc, item in override_locs.items():  # the override set this field, or something inside it
            n = min(len(loc), len(set_loc))
            if n and loc[:n] == set_loc[:n]:
                return f"override {short(item)}"
        return origin_of(origins, loc) or str(path)

    non_finite = dict(_non_finite(raw, ()))  # anywhere, kwargs and TRL args included
    problems += [Problem(where(loc), _dotted(loc),
                         "not a finite number (NaN or infinity); write a finite number", value)
                 for loc, value in non_finite.items()]
    cfg = None
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as e:
        problems += [_problem_from_pydantic(err, where) for err in e.errors()
                     if not (err["type"] == "finite_number" and _clean(err["loc"]) in non_finite)]
    found = check_names(raw)
    if cfg is not None:
        found += check_sections(cfg)
        found += ((check_trl_config(cfg) if check_trl else [])
                  + (check_reward_imports(cfg) if import_rewards else []))
    if cfg is not None and check_paths:
        from vlmexp.checks.config_paths import check_config_paths

        found += check_config_paths(cfg, check_cluster)
    problems += [Problem(where(loc), _dotted(loc), message, value) for loc, value, message in found
                 if loc not in non_finite]
    if problems:
        raise ConfigError(problems, title=f"invalid config {path}")
    return cfg


def parse_override(item: str) -> tuple[list[str], Any]:
    """'a.b.c=value' -> (['a', 'b', 'c'], value parsed as YAML)."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
        raise ValueError("overrides look like section.key=value, e.g. grpo.args.learning_rate=1e-6")
    try:
        parsed = parse_yaml(value, "the value")[0] if value.strip() else ""
    except YamlProblems as e:
        raise ValueError(f"value {short(value)}: {e.problems[0].message} (or quote the value)") from None
    return key.strip().split("."), parsed


def apply_override(raw: dict[str, Any], item: str) -> Loc:
    """Set one dotted override in the raw mapping; return the location it set."""
    parts, value = parse_override(item)
    if parts[0] == EXTENDS:
        raise ValueError(f"{EXTENDS} is read from the config file only (it merges files before any "
                         "override); write it in the YAML file")
    node: Any = raw
    loc: list[str | int] = []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ValueError(f"{'.'.join(map(str, loc))} is a list of {len(node)}; "
                                 f"use an index below {len(node)}")
            key: str | int = int(part)
        elif isinstance(node, dict):
            key = part
            if not last and node.get(key) is None:
                node[key] = {}
        else:
            raise ValueError(f"{'.'.join(map(str, loc))} is a value, not a section: "
                             f"cannot set {part!r} in it")
        loc.append(key)
        if last:
            node[key] = value
        else:
            node = node[key]
    return tuple(loc)


def _non_finite(value: Any, loc: Loc):
    """(location, value) of every NaN or infinite float inside a parsed YAML value."""
    if isinstance(value, float) and not math.isfinite(value):
        yield loc, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _non_finite(item, (*loc, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _non_finite(item, (*loc, i))


def _clean(loc: tuple) -> Loc:
    """A pydantic error location without its validator steps ('function-after[...]')."""
    return tuple(x for x in loc if not (isinstance(x, str) and x.startswith("function-")))


def _dotted(loc: Loc) -> str:
    return ".".join(str(x) for x in loc)


def _problem_from_pydantic(err: dict[str, Any], where) -> Problem:
    loc = _clean(err["loc"])
    kind = err["type"]
    msg = err["msg"].removeprefix("Value error, ")
    value = err.get("input")
    if kind == "extra_forbidden":
        known = _fields_at(loc[:-1]) + ([EXTENDS] if len(loc) == 1 else [])  # the loader's own top-level key
        hint = difflib.get_close_matches(str(loc[-1]), known, n=1)
        fix = f"did you mean {hint[0]!r}?" if hint else f"known keys: {', '.join(known)}"
        return Problem(where(loc), _dotted(loc), f"unknown key; remove it or fix its spelling ({fix})")
    if kind == "missing":
        return Problem(where(loc[:-1]) if loc[:-1] else where(loc), _dotted(loc), "required; add this field")
    if kind == "finite_number":
        msg = f"{msg}, not NaN or infinity; write a finite number"
    if kind.endswith("_type") or kind.endswith("_parsing") or kind in ("literal_error", "enum"):
        msg = f"{msg}; {change_the_value(str(loc[-1]), value)}"
    return Problem(where(loc), _dotted(loc), msg, value)


def _fields_at(loc: Loc) -> list[str]:
    """Field names of the config section at `loc` (for 'did you mean' hints)."""
    model: Any = Config
    for part in loc:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = _model_in(field.annotation)
    return list(getattr(model, "model_fields", {}))


def _model_in(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def dump_config(cfg: Config, path: str | Path) -> Path:
    """Write the resolved config as YAML (what a stage subprocess reads)."""
    from vlmexp.files import atomic_write

    return atomic_write(path, yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
