"""Data sources: VLM-R1 data YAMLs and what their entries point to.

A source's `json_path` is one of (a local path always wins over a Hub id of the same spelling):
- a record file: .json (a list), .jsonl, .parquet or .arrow;
- a glob of shards (`data/train-*.parquet`) or a folder of shards (`data/`, `data@train` for one split);
- a folder written by `datasets.Dataset.save_to_disk` (a DatasetDict folder takes `@split`);
- a Hugging Face Hub dataset `org/name@split` (EasyR1's syntax; split default train; `subset` and
  `revision` fields), loaded with `datasets.load_dataset`: from the local cache when HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from vlmexp.config.schema import DataSource
from vlmexp.data.tables import (
    DatasetTable,
    JsonListTable,
    JsonlTable,
    ParquetTable,
    Row,
    sha256_file,
)
from vlmexp.errors import DataError, Problem

__all__ = ["RECORD_SUFFIXES", "Location", "check_source", "load_data_yaml", "locate", "open_table",
           "read_records", "resolve_relative", "sha256_file"]

RECORD_SUFFIXES = (".json", ".jsonl", ".parquet", ".arrow")
_GLOB = re.compile(r"[*?\[]")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_REVISION = re.compile(r"/([0-9a-f]{40})/")


@dataclass(frozen=True)
class Location:
    """Where a source's rows live. kind: file | shards | saved | hub."""

    kind: str
    path: str  # the file, the glob or folder, or the Hub id
    split: str | None = None


def _split_suffix(value: str) -> tuple[str, str | None]:
    base, sep, split = value.rpartition("@")
    return (base, split) if sep and base and split and "/" not in split else (value, None)


def locate(json_path: str) -> Location:
    """Classify a source string (no network, no reading)."""
    base, split = _split_suffix(json_path)
    for candidate, sp in ((json_path, None), (base, split)):
        p = Path(candidate).expanduser()
        if p.is_file():
            return Location("file", str(p), sp)
        if p.is_dir():
            kind = ("saved" if (p / "state.json").is_file() or (p / "dataset_dict.json").is_file()
                    else "shards")
            return Location(kind, str(p), sp)
    if _GLOB.search(base):
        return Location("shards", base, split)
    if _HUB_ID.fullmatch(base) and Path(base).suffix.lower() not in RECORD_SUFFIXES:
        return Location("hub", base, split or "train")
    return Location("file", json_path, None)  # a missing file: reported when opened


def resolve_relative(src: DataSource, base: Path) -> DataSource:
    """A copy of `src` whose relative local paths (json_path, image_root) are joined to `base`."""
    def join(value: str | None) -> str | None:
        if value is None or Path(value).expanduser().is_absolute():
            return None if value is None else str(Path(value).expanduser())
        return str((base / value).resolve())

    path, split = _split_suffix(src.json_path)
    if locate(src.json_path).kind == "hub" and not (base / path).exists():
        json_path = src.json_path  # a Hub id, not a path
    else:
        json_path = join(path) + (f"@{split}" if split else "")
    return src.model_copy(update={"json_path": json_path, "image_root": join(src.image_root)})


def open_table(src: DataSource):
    """The source's table (see vlmexp.data.tables), or DataError naming the source and the fix."""
    loc = locate(src.json_path)
    try:
        if loc.kind == "hub":
            return _open_hub(src, loc)
        if loc.kind == "saved":
            return _open_saved(src, loc)
        files = _shard_files(loc) if loc.kind == "shards" else [_check_file(Path(loc.path), src)]
        return _open_files(files, loc.path)
    except DataError:
        raise
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(Problem(src.json_path, "json_path", f"cannot be read ({e.__class__.__name__}: "
                                f"{str(e)[:200]}); replace the file or fix json_path")) from None


def _check_file(p: Path, src: DataSource) -> Path:
    if not p.is_file():
        raise DataError(Problem(str(p), "json_path", "file not found; fix json_path in the data YAML "
                                "(a file, a glob of shards, a folder, or a Hub id org/name@split)"))
    if p.suffix.lower() not in RECORD_SUFFIXES:
        raise DataError(Problem(str(p), "json_path", f"unknown file format {p.suffix.lower()!r}; use .json "
                                                     f"(a list), .jsonl, .parquet or .arrow"))
    if p.stat().st_size == 0:
        raise DataError(Problem(str(p), "", "file is empty; point json_path at a file with records"))
    return p


def _shard_files(loc: Location) -> list[Path]:
    p = Path(loc.path).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in RECORD_SUFFIXES
                       and not f.name.startswith("."))
        if loc.split:
            files = [f for f in files if any(re.match(rf"{re.escape(loc.split)}([-_.]|$)", part)
                                             for part in f.relative_to(p).parts)]
    else:
        files = sorted(Path(f) for f in glob_paths(loc.path))
    if not files:
        what = f"split {loc.split!r} in " if loc.split else ""
        raise DataError(Problem(loc.path, "json_path", f"no record files (.json, .jsonl, .parquet, .arrow) "
                                                       f"for {what}this glob or folder; fix the pattern"))
    suffixes = {f.suffix.lower() for f in files}
    if len(suffixes) > 1:
        raise DataError(Problem(loc.path, "json_path", f"shards of different formats {sorted(suffixes)}; "
                                                       f"name one format per source "
                                                       f"(e.g. a glob ending in .parquet)"))
    return files


def glob_paths(pattern: str) -> list[str]:
    """The paths a glob pattern (`**` recursive, `~` expanded) matches."""
    import glob

    return glob.glob(str(Path(pattern).expanduser()), recursive=True)


def _open_files(files: list[Path], name: str):
    suffix = files[0].suffix.lower()
    for f in files:
        if f.stat().st_size == 0:
            raise DataError(Problem(str(f), "", "file is empty; point json_path at a file with records"))
    if suffix == ".parquet":
        return ParquetTable(files, name)
    tables = [_open_one(f) for f in files]
    return tables[0] if len(tables) == 1 else ConcatTable(tables, name)


def _open_one(f: Path):
    suffix = f.suffix.lower()
    if suffix == ".jsonl":
        return JsonlTable(f)
    if suffix == ".json":
        return JsonListTable(f)
    from datasets import Dataset

    return DatasetTable(Dataset.from_file(str(f)), str(f), {"sha256": sha256_file(f)})


def _open_saved(src: DataSource, loc: Location):
    from datasets import DatasetDict, load_from_disk

    ds = load_from_disk(loc.path)
    if isinstance(ds, DatasetDict):
        if loc.split not in ds:
            raise DataError(Problem(src.json_path, "json_path",
                                    f"a save_to_disk DatasetDict folder: name a split, "
                                    f"one of {sorted(ds)}, as {loc.path}@{next(iter(ds), 'train')}"))
        ds = ds[loc.split]
    return DatasetTable(ds, loc.path, {"fingerprint": ds._fingerprint})


def _open_hub(src: DataSource, loc: Location):
    import datasets

    try:
        ds = datasets.load_dataset(loc.path, name=src.subset, split=loc.split, revision=src.revision)
    except Exception as e:  # noqa: BLE001 - the Hub client raises many types; each is reported with its message
        cache = datasets.config.HF_DATASETS_CACHE
        raise DataError(Problem(src.json_path, "json_path", (
            f"Hub dataset {loc.path!r} (subset {src.subset}, split {loc.split!r}, revision {src.revision}) "
            f"could not be loaded from the Hub or the local cache {cache} ({e.__class__.__name__}: "
            f"{str(e)[:200]}); check the id and split, or load it once with network access (HF_HUB_OFFLINE "
            f"unset) to fill the cache, or point json_path at local parquet files"))) from None
    files = ds.cache_files or []
    found = _REVISION.search(files[0]["filename"]) if files else None
    identity = {"fingerprint": ds._fingerprint,
                "revision": src.revision or (found.group(1) if found else None)}
    return DatasetTable(ds, f"{loc.path}@{loc.split}", identity)


class ConcatTable:
    """Several tables of one format read as one, rows numbered across them in order."""

    def __init__(self, tables: list, name: str):
        import hashlib

        self.tables, self.name = tables, name
        self._starts = [0]
        for t in tables:
            self._starts.append(self._starts[-1] + len(t))
        ids = "".join(str(sorted(t.identity.items())) for t in tables)
        self.identity = {"sha256": hashlib.sha256(ids.encode()).hexdigest()}

    def __len__(self) -> int:
        return self._starts[-1]

    def columns(self) -> list[str] | None:
        return self.tables[0].columns()

    def take(self, indices):
        import bisect

        for i in indices:
            n = bisect.bisect_right(self._starts, i) - 1
            yield from self.tables[n].take([i - self._starts[n]])


def read_records(path: str | Path) -> list[Row]:
    """Every record of a local file as (where, record); DataError listing every unreadable row."""
    if not Path(path).is_file():
        raise DataError(Problem(str(path), "", "file not found; check the path"))
    table = open_table(DataSource(json_path=str(path)))
    rows = list(table.take(range(len(table))))
    problems = [Problem(where, "", rec) for where, rec in rows if isinstance(rec, str)]
    if problems:
        raise DataError(problems)
    if not rows:
        raise DataError(Problem(str(path), "", "holds no records"))
    return rows  # type: ignore[return-value]


def check_source(src: DataSource) -> list[tuple[str, Any, str]]:
    """(field, value, problem) for each field of a source that names something the data package defines: its
    sampling strategy and the record fields its `columns` map to. Reads nothing."""
    from vlmexp.data.strategies import parse_strategy

    out: list[tuple[str, Any, str]] = []
    try:
        parse_strategy(src.sampling_strategy)
    except ValueError as e:
        out.append(("sampling_strategy", src.sampling_strategy, str(e)))
    for name, column in (src.columns or {}).items():
        if column is not None and (msg := own_name_problem(name)) is not None:
            out.append(("columns", src.columns, msg))
    return out


def own_name_problem(name: str) -> str | None:
    """Why `columns` may not map a source column to `name`, or None: a field vlmexp reads (FIELDS) is fine,
    and so is a name of the user's own (the column then reaches the rewards under it), unless it is one of
    vlmexp's reward columns or so close to a field that it is likely that field misspelt."""
    import difflib

    from vlmexp.data.formats import FIELDS
    from vlmexp.data.record import OWN_COLUMNS

    if name in FIELDS:
        return None
    fix = (f"map the source's columns to these fields: {', '.join(FIELDS)}, or to a name of your own for a "
           "reward column")
    if name in OWN_COLUMNS:
        return f"{name!r} in columns is vlmexp's reward column ({OWN_COLUMNS[name]}); {fix}"
    if near := difflib.get_close_matches(name, FIELDS, n=1, cutoff=0.85):
        return f"{name!r} in columns is not a field vlmexp reads; did you mean {near[0]!r}? ({fix})"
    return None


def load_data_yaml(path: str | Path) -> list[DataSource]:
    """The `datasets:` entries of a VLM-R1 data YAML; relative paths resolve against the YAML's folder."""
    from vlmexp.config.yaml_reader import YamlProblems, read_yaml_mapping

    p = Path(path)
    try:
        raw, lines = read_yaml_mapping(p, "a `datasets:` list of {json_path, sampling_strategy, ...}")
    except YamlProblems as e:
        raise DataError(e.problems, title=f"invalid data YAML {p}") from None
    entries = raw.get("datasets") if isinstance(raw, dict) else None
    if not isinstance(entries, list) or not entries:
        raise DataError(Problem(str(p), "datasets", "needs a non-empty `datasets:` list of "
                                "{json_path, sampling_strategy, image_root, task, columns}"),
                        title="invalid data YAML")
    sources, problems = [], []
    for i, entry in enumerate(entries):
        try:
            src = DataSource.model_validate(entry)
        except ValidationError as e:
            problems += [_yaml_problem(p, lines, ("datasets", i, *err["loc"]), err) for err in e.errors()]
            continue
        found = check_source(src)
        problems += [_yaml_problem(p, lines, ("datasets", i, field), {"msg": message, "input": value})
                     for field, value, message in found]
        if not found:
            sources.append(resolve_relative(src, p.parent))
    if problems:
        raise DataError(problems, title=f"invalid data YAML {p}")
    return sources


def _yaml_problem(p: Path, lines: dict, loc: tuple, err: dict[str, Any]) -> Problem:
    line = next((lines[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in lines), None)
    return Problem(f"{p}:{line}" if line else str(p), ".".join(map(str, loc)),
                   err["msg"].removeprefix("Value error, "), err.get("input"))
