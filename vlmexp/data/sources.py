"""Data sources: VLM-R1 data YAMLs and the record files they point to (.json list, .jsonl, .parquet)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from vlmexp.config import DataSource
from vlmexp.errors import DataError, Problem

RECORD_SUFFIXES = (".json", ".jsonl", ".parquet")


def load_data_yaml(path: str | Path) -> list[DataSource]:
    """The `datasets:` entries of a VLM-R1 data YAML; relative paths resolve against the YAML's folder."""
    from vlmexp.config_loader import read_yaml_with_lines
    from vlmexp.errors import ConfigError

    p = Path(path)
    try:
        raw, lines = read_yaml_with_lines(p)
    except ConfigError as e:
        raise DataError(e.problems, title=f"invalid data YAML {p}") from None
    entries = raw.get("datasets")
    if not isinstance(entries, list) or not entries:
        raise DataError(Problem(str(p), "datasets", "needs a non-empty `datasets:` list of "
                                "{json_path, sampling_strategy, image_root, task}"), title="invalid data YAML")
    sources, problems = [], []
    for i, entry in enumerate(entries):
        try:
            src = DataSource.model_validate(entry)
        except ValidationError as e:
            for err in e.errors():
                loc = ("datasets", i, *err["loc"])
                line = next((lines[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in lines), None)
                where = f"{p}:{line}" if line else str(p)
                problems.append(Problem(where, ".".join(map(str, loc)), err["msg"].removeprefix("Value error, "),
                                        err.get("input")))
            continue
        sources.append(resolve_relative(src, p.parent))
    if problems:
        raise DataError(problems, title=f"invalid data YAML {p}")
    return sources


def resolve_relative(src: DataSource, base: Path) -> DataSource:
    """A copy of `src` whose relative json_path and image_root are joined to `base`."""
    def join(value: str | None) -> str | None:
        if value is None or Path(value).expanduser().is_absolute():
            return None if value is None else str(Path(value).expanduser())
        return str((base / value).resolve())

    return src.model_copy(update={"json_path": join(src.json_path), "image_root": join(src.image_root)})


def read_records(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """All records of a source file as (location, record); location is 'file:line' or 'file[row]'."""
    p = Path(path)
    if not p.is_file():
        raise DataError(Problem(str(p), "json_path", "file not found; fix json_path in the data YAML"))
    suffix = p.suffix.lower()
    if suffix not in RECORD_SUFFIXES:
        raise DataError(Problem(str(p), "json_path", f"unknown file format {suffix!r}; use .json (a list), "
                                                     f".jsonl or .parquet"))
    if p.stat().st_size == 0:
        raise DataError(Problem(str(p), "", "file is empty; point json_path at a file with records"))
    if suffix == ".jsonl":
        return _read_jsonl(p)
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(p).to_pylist()
        return [(f"{p}[{i}]", row) for i, row in enumerate(rows)]
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(Problem(f"{p}:{e.lineno}", "", f"malformed JSON ({e.msg}); fix the file")) from None
    if not isinstance(data, list):
        raise DataError(Problem(str(p), "", f"a .json source must hold a list of records, got "
                                            f"{type(data).__name__}; use .jsonl for one record a line"))
    if not data:
        raise DataError(Problem(str(p), "", "holds no records"))
    return [(f"{p}[{i}]", row) for i, row in enumerate(data)]


def _read_jsonl(p: Path) -> list[tuple[str, dict[str, Any]]]:
    out, problems = [], []
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                problems.append(Problem(f"{p}:{n}", "", f"malformed JSON ({e.msg} at column {e.colno}); "
                                                        f"fix or remove this line"))
                continue
            if not isinstance(rec, dict):
                problems.append(Problem(f"{p}:{n}", "", f"each line must be a JSON object, got "
                                                        f"{type(rec).__name__}"))
                continue
            out.append((f"{p}:{n}", rec))
    if problems:
        raise DataError(problems)
    if not out:
        raise DataError(Problem(str(p), "", "holds no records (only blank lines)"))
    return out


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
