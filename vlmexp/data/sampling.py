"""Sample a mixture of sources into one JSONL file plus a manifest, validating every kept record.

Rows are selected first (vlmexp.data.strategies), then only the kept rows are read and checked: fields,
images (exist, readable, sane size; embedded ones written once under `images/` beside the output file),
boxes (finite, x1 < x2, y1 < y2, inside the image). All problems are reported at once; on any problem
nothing is written (images written by this call are removed again). Output is written to a temporary file
and renamed, so a file is complete or absent.

The random pick of a source is seeded by the run seed and the source's content (sha256 of its files, or its
dataset fingerprint), never its path, and the manifest's `content_sha256` leaves absolute paths out: the
same data sampled in another folder or on another machine gives the same rows and the same hash.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vlmexp.config import DataSource
from vlmexp.data.formats import FORMATS, detect_format, parse_record
from vlmexp.data.images import ImageStore, describe
from vlmexp.data.sources import locate, open_table, sha256_file
from vlmexp.data.strategies import parse_strategy, select_rows
from vlmexp.errors import DataError, Problem
from vlmexp.files import atomic_write

MAX_PROBLEMS = 50
IMAGES_DIR = "images"  # beside the sampled JSONL
LOCATION_FIELDS = ("source", "image_paths")  # machine-specific: left out of content_sha256


@dataclass
class SourceReport:
    json_path: str
    sha256: str | None  # of the file (or of the shards' hashes); None for a Hub or save_to_disk dataset
    sampling_strategy: str
    record_format: str
    task: str
    image_root: str | None
    rows_read: int
    rows_kept: int
    kind: str = "file"  # file | shards | saved | hub
    fingerprint: str | None = None  # datasets' fingerprint (save_to_disk, Hub)
    revision: str | None = None  # Hub commit
    columns: dict[str, str] | None = None
    embedded_images: int = 0


@dataclass
class SampleResult:
    path: Path
    manifest_path: Path
    sources: list[SourceReport]
    seed: int
    records_sha256: str
    rows: int
    content_sha256: str = ""
    images_written: list[Path] = field(default_factory=list)


def _default_image_root(src: DataSource, kind: str) -> str | None:
    """Where relative image paths resolve: image_root, else the source's folder (a Hub dataset has none)."""
    if src.image_root or kind == "hub":
        return src.image_root
    p = Path(locate(src.json_path).path).expanduser()
    return str((p if p.is_dir() else p.parent).resolve())


def _check_box(box: list[float], size: tuple[int, int]) -> str | None:
    x1, y1, x2, y2 = box
    w, h = size
    if not all(math.isfinite(v) for v in box):
        return f"box {box} has a non-finite coordinate; write four finite numbers [x1, y1, x2, y2]"
    if x2 <= x1 or y2 <= y1:
        return f"box {box} is inverted or empty (needs x1 < x2 and y1 < y2); fix the solution"
    if x1 < 0 or y1 < 0 or x2 > w or y2 > h:
        return f"box {box} lies outside the {w}x{h} image; boxes are in original pixels"
    return None


def _rename(record: dict[str, Any], columns: dict[str, str] | None) -> dict[str, Any]:
    if not columns:
        return record
    out = {k: v for k, v in record.items() if k not in columns.values()}
    out.update({target: record[column] for target, column in columns.items()})
    return out


def _missing_columns(src: DataSource, have: list[str] | None) -> Problem | None:
    missing = [c for c in (src.columns or {}).values() if have is not None and c not in have]
    if not missing:
        return None
    return Problem(src.json_path, "columns", f"mapped column(s) {missing} not in the source, which has "
                                             f"{have}; fix the source's `columns` mapping")


def sample_source(src: DataSource, seed: int, store: ImageStore) -> tuple[list[dict], SourceReport, list[Problem]]:
    """Kept records of one source (with `source`, `task`, `image_paths`, ... added) and its problems."""
    table = open_table(src)
    kind = locate(src.json_path).kind
    if len(table) == 0:
        raise DataError(Problem(table.name, "", "holds no records"))
    if (missing := _missing_columns(src, table.columns())) is not None:
        raise DataError(missing)
    identity = "|".join(f"{k}={v}" for k, v in sorted(table.identity.items()))
    try:
        keep = select_rows(parse_strategy(src.sampling_strategy), len(table), seed, salt=identity)
    except ValueError as e:
        raise DataError(Problem(src.json_path, "sampling_strategy", str(e), src.sampling_strategy)) from None
    image_root = _default_image_root(src, kind)
    out, tasks, problems, fmt, embedded = [], set(), [], None, 0
    for i, (where, raw) in zip(keep, table.take(keep)):
        if isinstance(raw, str):
            problems.append(Problem(where, "", raw))
            continue
        if (missing := _missing_columns(src, list(raw))) is not None:
            problems.append(Problem(where, "columns", missing.message))
            continue
        record = _rename(raw, src.columns)
        fmt = fmt or detect_format(record)
        if fmt is None:
            raise DataError(Problem(where, "", f"unknown record format (fields: {sorted(record)}); expected one of "
                                               f"{', '.join(FORMATS)}: see docs/data-formats.md, or map the "
                                               f"source's columns with `columns:`"))
        kept = _check_record(record, fmt, src, where, image_root, store)
        if isinstance(kept, Problem):
            problems.append(kept)
            continue
        tasks.add(kept["task"])
        embedded += kept.pop("_embedded")
        out.append({**kept, "source": table.name, "source_id": identity, "source_row": i})
    report = SourceReport(table.name, table.identity.get("sha256"), src.sampling_strategy, fmt or "",
                          ",".join(sorted(tasks)) or (src.task or ""), image_root, len(table), len(out), kind,
                          table.identity.get("fingerprint"), table.identity.get("revision"), src.columns, embedded)
    return out, report, problems
def _check_record(record: dict[str, Any], fmt: str, src: DataSource, where: str, image_root: str | None,
                  store: ImageStore) -> dict[str, Any] | Problem:
    """The record ready to write (images as paths, sizes added), or its first problem."""
    try:
        ex = parse_record(record, fmt, src.task)  # names a missing field and what the format needs
        if detect_format(record) != fmt:
            raise ValueError(f"record is not in the source's format {fmt!r} (detected from its first record); "
                             f"give every record of a source the same format")
        if ex.task == "rec" and len(ex.images) != 1:
            raise ValueError(f"a grounding record needs exactly one image, got {len(ex.images)}")
    except ValueError as e:
        return Problem(where, "", str(e))
    resolved = [store.resolve(ref, image_root) for ref in ex.images]
    if bad := [r for r in resolved if isinstance(r, str)]:
        return Problem(where, "image", bad[0])
    paths, sizes = [r[0] for r in resolved], [r[1] for r in resolved]
    if ex.task == "rec" and (msg := _check_box(ex.solution, sizes[0])):
        return Problem(where, "solution", msg)
    embedded = [not isinstance(ref, str) and not (isinstance(ref, dict) and ref.get("bytes") is None)
                for ref in ex.images]
    # the JSONL holds paths: embedded images by their stored name (relative to the file), others as written
    refs = [str(Path(p).relative_to(store.folder.parent)) if e else (r.get("path") if isinstance(r, dict) else r)
            for p, e, r in zip(paths, embedded, ex.images)]
    key = next((k for k in (("images", "image") if fmt == "easyr1" else ("image", "images")) if k in record), None)
    if key is not None:
        record = {**record, key: refs if isinstance(record[key], list) else refs[0]}
    return {**_jsonable(record), "record_format": fmt, "task": ex.task, "image_paths": paths,
            "image_sizes": [list(s) for s in sizes], "_embedded": sum(embedded)}


def _jsonable(record: dict[str, Any]) -> dict[str, Any]:
    """The record with values JSON cannot hold (bytes, dates, ...) written as short descriptions."""
    def fix(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [fix(x) for x in v]
        if v is None or isinstance(v, (str, int, float, bool)):
            return v
        return describe(v)

    return {k: fix(v) for k, v in record.items()}


def sample_sources(sources: list[DataSource], out_path: str | Path, seed: int) -> SampleResult:
    """Sample every source, validate, and write OUT.jsonl, OUT.manifest.json and images/ atomically."""
    out = Path(out_path)
    store = ImageStore(out.parent / IMAGES_DIR)
    try:
        return _sample_into(sources, out, seed, store)
    except BaseException:
        store.discard()
        raise


def _sample_into(sources: list[DataSource], out: Path, seed: int, store: ImageStore) -> SampleResult:
    records, reports, problems = [], [], []
    for src in sources:
        try:
            recs, report, probs = sample_source(src, seed, store)
        except DataError as e:
            problems += e.problems
            continue
        records += recs
        reports.append(report)
        problems += probs
    if problems:
        raise DataError(problems[:MAX_PROBLEMS] + ([Problem("", "", f"... {len(problems) - MAX_PROBLEMS} more")]
                                                   if len(problems) > MAX_PROBLEMS else []))
    manifest_path = out.with_name(out.name.removesuffix(".jsonl") + ".manifest.json")
    atomic_write(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    digest, content = sha256_file(out), content_sha256(records)
    manifest: dict[str, Any] = {"seed": seed, "rows": len(records), "records_sha256": digest,
                                "content_sha256": content, "sources": [asdict(r) for r in reports]}
    atomic_write(manifest_path, json.dumps(manifest, indent=2) + "\n")
    return SampleResult(out, manifest_path, reports, seed, digest, len(records), content, list(store.written))


def content_sha256(records: list[dict[str, Any]]) -> str:
    """What identifies sampled records wherever they live: every field but the machine-specific paths."""
    h = hashlib.sha256()
    for r in records:
        h.update(json.dumps({k: v for k, v in r.items() if k not in LOCATION_FIELDS}, sort_keys=True,
                            ensure_ascii=False).encode())
    return h.hexdigest()


def format_report(result: SampleResult) -> str:
    """The per-source count table `vlmexp sample` prints."""
    rows = [("source", "format", "task", "strategy", "read", "kept")]
    rows += [(s.json_path if s.kind == "hub" else Path(s.json_path).name, s.record_format, s.task,
              s.sampling_strategy, str(s.rows_read), str(s.rows_kept)) for s in result.sources]
    rows.append(("total", "", "", "", str(sum(s.rows_read for s in result.sources)), str(result.rows)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
