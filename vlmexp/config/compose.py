"""Configs that compose: a config's top-level `extends:` names the files it builds on.

`extends: base.yaml`, or a list `[a.yaml, b.yaml]`; each path is relative to the file that names it. The
bases are read first (each may extend others), merged in the order listed, and the file's own keys are
merged on top: mappings merge key by key, at any depth; anything else (a list, a value, null) replaces
what a base had there. Dotted overrides apply after all of this. A file that extends itself, directly or
through others, is refused with the chain.

Every value keeps the file and line where it was written (`Origins`), so a problem in a value that came
from a base names the base's line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from vlmexp.config.yaml_reader import Loc, YamlProblems, read_yaml_mapping
from vlmexp.errors import ConfigError, Problem, short

EXTENDS = "extends"
EXPECTED = "a config's sections (run, model, data, ...) or a data YAML's `datasets:` list"

# location in the merged mapping -> "file:line" where its key or list item was written
Origins = dict[Loc, str]


def read_composed(path: str | Path) -> tuple[dict[str, Any], Origins]:
    """The config at `path` with its `extends:` chain merged in, and where each value was written.
    Raises ConfigError naming the file and line of the problem and the fix."""
    return _read(Path(path), ())


def _read(path: Path, chain: tuple[Path, ...]) -> tuple[dict[str, Any], Origins]:
    try:
        raw, lines = read_yaml_mapping(path, EXPECTED)
    except YamlProblems as e:
        raise ConfigError(e.problems, title=f"invalid config {chain[0] if chain else path}") from None
    origins = {loc: f"{path}:{line}" for loc, line in lines.items()}
    if EXTENDS not in raw:
        return raw, origins
    here = origins[(EXTENDS,)]
    bases = _base_paths(raw.pop(EXTENDS), path, here, chain)
    origins = {loc: where for loc, where in origins.items() if loc[:1] != (EXTENDS,)}
    merged: dict[str, Any] = {}
    merged_origins: Origins = {}
    for base in bases:
        base_raw, base_origins = _read(base, (*chain, path))
        merged, merged_origins = merge(merged, merged_origins, base_raw, base_origins)
    return merge(merged, merged_origins, raw, origins)


def _base_paths(value: Any, path: Path, here: str, chain: tuple[Path, ...]) -> list[Path]:
    """The files `extends` names, relative to `path`'s folder; refused: a wrong type, a missing file, a
    cycle."""
    def refuse(message: str) -> ConfigError:
        return ConfigError([Problem(here, EXTENDS, message, value)],
                           title=f"invalid config {chain[0] if chain else path}")

    names = value if isinstance(value, list) else [value]
    if not names or not all(isinstance(name, str) and name.strip() for name in names):
        raise refuse("write the path of a config file to build on, or a list of them (relative to this "
                     "file's folder), e.g. extends: demo.yaml")
    out = []
    for name in names:
        base = Path(os.path.normpath(path.parent / Path(name).expanduser()))
        if not base.is_file():
            raise refuse(f"{base} is not a file; paths in extends are relative to the folder of the file "
                         f"that names them ({path.parent}): fix the path")
        seen = [p.resolve() for p in (*chain, path)]
        if base.resolve() in seen:
            cycle = " -> ".join(str(p) for p in (*chain, path, base)[seen.index(base.resolve()):])
            raise refuse(f"extends makes a cycle: {short(cycle, 600, text=True)}; "
                         "remove one of these extends")
        out.append(base)
    return out


def origin_of(origins: Origins, loc: Loc) -> str | None:
    """Where the value at `loc` (or its nearest written parent) was written. A section whose values came from
    several files (a problem found in the section as a whole) names the first line of each of the others."""
    for n in range(len(loc), -1, -1):
        if loc[:n] in origins:
            own = origins[loc[:n]]
            break
    else:
        return None
    files = {own.rpartition(":")[0]: own}
    for sub, where in origins.items():
        if len(sub) > n and sub[:n] == loc[:n]:
            files.setdefault(where.rpartition(":")[0], where)
    others = list(files.values())[1:]
    return f"{own} (with values from {', '.join(others)})" if n == len(loc) and others else own


def merge(base: dict[str, Any], base_origins: Origins, top: dict[str, Any],
          top_origins: Origins) -> tuple[dict[str, Any], Origins]:
    """`top` merged onto `base` (mappings key by key, anything else replaced) and where each merged value was
    written: a location `top` wrote comes from `top`, any other from `base`."""
    merged = _merged(base, top)
    origins: Origins = {}
    _walk(merged, (), lambda loc: origins.__setitem__(loc, top_origins.get(loc) or base_origins.get(loc, "")))
    return merged, {loc: where for loc, where in origins.items() if where}


def _merged(base: Any, top: Any) -> Any:
    if isinstance(base, dict) and isinstance(top, dict):
        return {**base,
                **{key: _merged(base[key], value) if key in base else value for key, value in top.items()}}
    return top


def _walk(value: Any, loc: Loc, visit) -> None:
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        visit((*loc, key))
        _walk(item, (*loc, key), visit)
