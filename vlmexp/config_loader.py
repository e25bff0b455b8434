"""Load a config: YAML file + dotted overrides -> validated `Config`, or a ConfigError listing every problem.

Each problem names where it comes from (file:line, or the override that set it), the field's dotted
path, the bad value, and the fix. YAML is parsed with the safe loader only.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from vlmexp.config import Config
from vlmexp.errors import ConfigError, Problem, change_the_value

Loc = tuple[str | int, ...]


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = (), check_paths: bool = False,
                check_trl: bool = True) -> Config:
    """Read, override and validate a config. Raises ConfigError with all problems found."""
    raw, lines = read_yaml_with_lines(path)
    problems: list[Problem] = []
    override_locs: dict[Loc, str] = {}
    for item in overrides:
        try:
            loc = apply_override(raw, item)
            override_locs[loc] = item
        except ValueError as e:
            problems.append(Problem(f"override {item!r}", "", str(e)))

    def where(loc: Loc) -> str:
        for set_loc, item in override_locs.items():  # the override set this field, or something inside it
            n = min(len(loc), len(set_loc))
            if n and loc[:n] == set_loc[:n]:
                return f"override {item!r}"
        for n in range(len(loc), -1, -1):
            if loc[:n] in lines:
                return f"{path}:{lines[loc[:n]]}"
        return str(path)

    cfg = None
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as e:
        problems += [_problem_from_pydantic(err, where) for err in e.errors()]
    if cfg is not None and check_trl:
        from vlmexp.trl_args import check_trl_args

        for stage in ("sft", "dpo", "grpo"):
            for key, value, message in check_trl_args(stage, getattr(cfg, stage).args):
                loc: Loc = (stage, "args", key) if key else (stage, "args")
                problems.append(Problem(where(loc), _dotted(loc), message, value))
    if cfg is not None and check_paths:
        from vlmexp.paths import check_config_paths

        problems += [Problem(where(loc), _dotted(loc), msg, value) for loc, value, msg in check_config_paths(cfg)]
    if problems:
        raise ConfigError(problems, title=f"invalid config {path}")
    return cfg


def read_yaml_with_lines(path: str | Path) -> tuple[dict[str, Any], dict[Loc, int]]:
    """Parse a YAML mapping safely; also return the 1-based line of every key and list item."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(Problem(str(p), "", "file not found: check the path (relative paths start at "
                                              "the current directory)"), title="invalid config")
    text = p.read_text(encoding="utf-8")
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        reason = getattr(e, "problem", None) or str(e)
        raise ConfigError(Problem(f"{p}{line}", "", f"YAML syntax error: {reason}; fix the YAML at that line"),
                          title=f"invalid config {p}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(Problem(str(p), "", f"top level must be a mapping of sections, got "
                                              f"{type(raw).__name__}"), title=f"invalid config {p}")
    lines: dict[Loc, int] = {}
    _collect_lines(node, (), lines)
    return raw, lines


def _collect_lines(node, loc: Loc, out: dict[Loc, int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            sub = loc + (key_node.value,)
            out[sub] = key_node.start_mark.line + 1
            _collect_lines(value_node, sub, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out[loc + (i,)] = item.start_mark.line + 1
            _collect_lines(item, loc + (i,), out)


def parse_override(item: str) -> tuple[list[str], Any]:
    """'a.b.c=value' -> (['a', 'b', 'c'], value parsed as YAML)."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
        raise ValueError("overrides look like section.key=value, e.g. grpo.args.learning_rate=1e-6")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError as e:
        raise ValueError(f"value {value!r} is not valid YAML ({e.__class__.__name__}); quote it") from None
    return key.strip().split("."), parsed


def apply_override(raw: dict[str, Any], item: str) -> Loc:
    """Set one dotted override in the raw mapping; return the location it set."""
    parts, value = parse_override(item)
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
            raise ValueError(f"{'.'.join(map(str, loc))} is a value, not a section: cannot set {part!r} in it")
        loc.append(key)
        if last:
            node[key] = value
        else:
            node = node[key]
    return tuple(loc)


def _dotted(loc: Loc) -> str:
    return ".".join(str(x) for x in loc)


def _problem_from_pydantic(err: dict[str, Any], where) -> Problem:
    loc: Loc = tuple(x for x in err["loc"] if not (isinstance(x, str) and x.startswith("function-")))
    kind = err["type"]
    msg = err["msg"].removeprefix("Value error, ")
    value = err.get("input")
    if kind == "extra_forbidden":
        known = _fields_at(loc[:-1])
        hint = difflib.get_close_matches(str(loc[-1]), known, n=1)
        fix = f"did you mean {hint[0]!r}?" if hint else f"known keys: {', '.join(known)}"
        return Problem(where(loc), _dotted(loc), f"unknown key; remove it or fix its spelling ({fix})")
    if kind == "missing":
        return Problem(where(loc[:-1]) if loc[:-1] else where(loc), _dotted(loc), "required; add this field")
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
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    tmp.replace(p)
    return p
