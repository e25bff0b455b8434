"""Record tables: one small interface over every kind of source a data YAML can name.

A table knows how many rows it has and what identifies its content, and hands out only the rows asked
for. Nothing is decoded before rows are selected: a JSONL file is indexed by line offsets in one pass
(numpy over 16 MiB blocks, memory ~24 bytes a line), parquet shards are read one row group at a time,
Arrow folders (save_to_disk, the Hugging Face cache) are memory-mapped. So peak memory does not grow with
the source, and `first:N` reads only the first row group of a parquet source.

`take(indices)` yields `(where, record)` in the order asked, `where` being `file:line` or `file[row]`;
a row that cannot be read yields `(where, "what is wrong; the fix")` instead of a record.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

BLOCK = 16 << 20  # bytes read at a time while indexing or hashing
BATCH = 256  # Arrow rows turned into Python objects at a time

Row = tuple[str, "dict[str, Any] | str"]


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def sha256_files(paths: list[Path]) -> str:
    """One file: its sha256. Several shards: the sha256 of their sha256s in reading order."""
    if len(paths) == 1:
        return sha256_file(paths[0])
    return hashlib.sha256("".join(sha256_file(p) for p in paths).encode()).hexdigest()


class JsonlTable:
    """A .jsonl file indexed by line offsets; blank lines are not rows."""

    def __init__(self, path: Path):
        import numpy as np

        self.path, self.name = path, str(path)
        h, newlines, size = hashlib.sha256(), [], 0
        with path.open("rb") as f:
            for block in iter(lambda: f.read(BLOCK), b""):
                h.update(block)
                newlines.append(np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == 10) + size)
                size += len(block)
        self.identity = {"sha256": h.hexdigest()}
        ends = np.concatenate(newlines + [np.array([size], dtype=np.int64)]) if newlines else np.array([size])
        starts = np.concatenate([[0], ends[:-1] + 1])
        lengths = ends - starts
        keep = lengths > 2  # a line of 1-2 bytes may be "\r" or " ": look at those few
        short = np.flatnonzero((lengths > 0) & ~keep)
        if len(short):
            with path.open("rb") as f:
                for i in short:
                    f.seek(int(starts[i]))
                    keep[i] = bool(f.read(int(lengths[i])).strip())
        self._rows = np.flatnonzero(keep)  # physical line index of each row
        self._starts, self._lengths = starts, lengths

    def __len__(self) -> int:
        return len(self._rows)

    def columns(self) -> list[str] | None:
        return None

    def take(self, indices: Iterable[int]) -> Iterator[Row]:
        with self.path.open("rb") as f:
            for i in indices:
                line = int(self._rows[i])
                f.seek(int(self._starts[line]))
                yield f"{self.path}:{line + 1}", _parse_line(f.read(int(self._lengths[line])))


def _parse_line(raw: bytes) -> dict[str, Any] | str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); save the file as UTF-8"
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        return f"malformed JSON ({e.msg} at column {e.colno}); fix or remove this line"
    except RecursionError:
        return "JSON nested too deeply; fix or remove this line"
    if not isinstance(record, dict):
        return f"each line must be a JSON object, got {type(record).__name__}"
    return record


class JsonListTable:
    """A .json file holding one list of records (read whole: the format cannot be read in parts)."""

    def __init__(self, path: Path):
        from vlmexp.errors import DataError, Problem

        self.path, self.name = path, str(path)
        raw = path.read_bytes()
        self.identity = {"sha256": hashlib.sha256(raw).hexdigest()}
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(Problem(f"{path}", "", f"not UTF-8 text (byte {raw[e.start]:#04x} at offset "
                                                   f"{e.start}); save the file as UTF-8")) from None
        except json.JSONDecodeError as e:
            raise DataError(Problem(f"{path}:{e.lineno}", "",
                                    f"malformed JSON ({e.msg}); fix the file")) from None
        except RecursionError:
            raise DataError(Problem(str(path), "", "JSON nested too deeply; fix the file")) from None
        if isinstance(data, dict):  # one record a file, beside its image (V* Bench's annotations)
            data = [paired_image(data, path)]
        if not isinstance(data, list):
            raise DataError(Problem(str(path), "", f"a .json source must hold a list of records or one "
                                                   f"record, got {type(data).__name__}; use .jsonl for one "
                                                   f"record a line"))
        self._data = data

    def __len__(self) -> int:
        return len(self._data)

    def columns(self) -> list[str] | None:
        return None

    def take(self, indices: Iterable[int]) -> Iterator[Row]:
        for i in indices:
            record = self._data[i]
            yield f"{self.path}[{i}]", record if isinstance(record, dict) else \
                f"each record must be a JSON object, got {type(record).__name__}"


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif")


def paired_image(record: dict[str, Any], path: Path) -> dict[str, Any]:
    """A one-record .json file's record with its image where it names none: the image file of the same name
    beside it (V* Bench: "the image and annotation files are paired according to the filename",
    penghao-wu/vstar README; vstar_bench_eval.py opens `sa_<n>.json` for `sa_<n>.jpg`)."""
    if "image" in record or "images" in record:
        return record
    found = [path.with_suffix(s) for s in IMAGE_SUFFIXES if path.with_suffix(s).is_file()]
    return {**record, "image": str(found[0].resolve())} if len(found) == 1 else record


class ParquetTable:
    """Parquet shards read one row group at a time; rows are numbered across the shards in order."""

    def __init__(self, files: list[Path], name: str):
        import numpy as np
        import pyarrow.parquet as pq

        self.files, self.name = files, name
        self._handles = [pq.ParquetFile(f) for f in files]
        # (file number, row group, first global row) for every row group, in order
        groups, first, self._file_starts = [], 0, []
        for n, handle in enumerate(self._handles):
            self._file_starts.append(first)
            for g in range(handle.metadata.num_row_groups):
                groups.append((n, g, first))
                first += handle.metadata.row_group(g).num_rows
        self._groups, self._size = groups, first
        self._group_starts = np.array([g[2] for g in groups] + [first], dtype=np.int64)
        self.identity = {"sha256": sha256_files(files)}

    def __len__(self) -> int:
        return self._size

    def columns(self) -> list[str] | None:
        return self._handles[0].schema_arrow.names if self._handles else []

    def take(self, indices: Iterable[int]) -> Iterator[Row]:
        import numpy as np

        idx = np.asarray(list(indices), dtype=np.int64)
        group_of = np.searchsorted(self._group_starts, idx, side="right") - 1
        # consecutive runs of indices in one row group: each run reads its row group once
        cuts = np.flatnonzero(np.diff(group_of)) + 1
        for run, g in zip(np.split(idx, cuts), group_of[np.concatenate([[0], cuts])] if len(idx) else []):
            n, rg, start = self._groups[int(g)]
            table = self._handles[n].read_row_group(rg)
            for b in range(0, len(run), BATCH):
                part = run[b:b + BATCH]
                for i, record in zip(part.tolist(), table.take(part - start).to_pylist()):
                    yield f"{self.files[n]}[{i - self._file_starts[n]}]", record


class DatasetTable:
    """A memory-mapped `datasets.Dataset` (a save_to_disk folder, a Hub dataset from the cache, .arrow)."""

    def __init__(self, dataset, name: str, identity: dict[str, Any]):
        self._ds = dataset.with_format("arrow")  # raw Arrow rows: images stay {bytes, path} structs
        self.name, self.identity = name, identity

    def __len__(self) -> int:
        return len(self._ds)

    def columns(self) -> list[str] | None:
        return list(self._ds.column_names)

    def take(self, indices: Iterable[int]) -> Iterator[Row]:
        idx = list(indices)
        for b in range(0, len(idx), BATCH):
            batch = idx[b:b + BATCH]
            for i, record in zip(batch, self._ds[batch].to_pylist()):
                yield f"{self.name}[{i}]", record
