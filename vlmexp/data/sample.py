"""Sample a mixture of sources into one JSONL file plus a manifest, validating every kept record.

Every kept record is checked before anything is written: fields, image files (exist, readable, sane
size), boxes (x1 < x2, y1 < y2, inside the image). All problems are reported at once; on any problem
nothing is written. Output is written to a temporary file and renamed, so a file is complete or absent.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vlmexp.config import DataSource
from vlmexp.coords import MAX_ASPECT_RATIO
from vlmexp.data.formats import FORMATS, detect_format, parse_record
from vlmexp.data.sampling import parse_strategy, select_rows
from vlmexp.data.sources import read_records, sha256_file
from vlmexp.errors import DataError, Problem

MIN_IMAGE_SIDE = 4  # smaller images cannot be grounded (and are usually broken files)
MAX_PROBLEMS = 50


@dataclass
class SourceReport:
    json_path: str
    sha256: str
    sampling_strategy: str
    record_format: str
    task: str
    image_root: str | None
    rows_read: int
    rows_kept: int


@dataclass
class SampleResult:
    path: Path
    manifest_path: Path
    sources: list[SourceReport]
    seed: int
    records_sha256: str
    rows: int


class ImageChecker:
    """Opens each distinct image once (header and integrity, no full decode) and remembers its size."""

    def __init__(self) -> None:
        self.sizes: dict[str, tuple[int, int] | str] = {}

    def check(self, path: str) -> tuple[int, int] | str:
        if path not in self.sizes:
            self.sizes[path] = self._check(path)
        return self.sizes[path]

    @staticmethod
    def _check(path: str) -> tuple[int, int] | str:
        from PIL import Image, UnidentifiedImageError

        p = Path(path)
        if not p.is_file():
            return f"image not found: {path}; fix the path or the source's image_root"
        try:
            with Image.open(p) as im:
                size, fmt = im.size, im.format
                im.verify()  # PNG: every chunk's CRC up to IEND, so truncation is caught
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
            return f"unreadable image {path} ({e.__class__.__name__}: {e}); replace or remove the file"
        if fmt == "JPEG":
            with p.open("rb") as f:
                f.seek(max(0, p.stat().st_size - 64))
                if b"\xff\xd9" not in f.read():
                    return f"truncated JPEG {path} (no end-of-image marker); re-export the file"
        w, h = size
        if min(w, h) < MIN_IMAGE_SIDE:
            return f"image {path} is {w}x{h} pixels, below {MIN_IMAGE_SIDE}x{MIN_IMAGE_SIDE}; remove the record"
        if max(w, h) / min(w, h) > MAX_ASPECT_RATIO:
            return (f"image {path} is {w}x{h}: aspect ratio {max(w, h) / min(w, h):.0f} exceeds "
                    f"{MAX_ASPECT_RATIO}, which Qwen-VL processors refuse; crop or drop it")
        return w, h


def resolve_image(ref: str, src: DataSource) -> str:
    """Absolute path of an image reference: relative ones join image_root (default: the file's folder)."""
    p = Path(ref).expanduser()
    if p.is_absolute():
        return str(p)
    root = Path(src.image_root) if src.image_root else Path(src.json_path).parent
    return str((root / p).resolve())


def _check_box(box: list[float], size: tuple[int, int]) -> str | None:
    x1, y1, x2, y2 = box
    w, h = size
    if x2 <= x1 or y2 <= y1:
        return f"box {box} is inverted or empty (needs x1 < x2 and y1 < y2); fix the solution"
    if x1 < 0 or y1 < 0 or x2 > w or y2 > h:
        return f"box {box} lies outside the {w}x{h} image; boxes are in original pixels"
    return None


def sample_source(src: DataSource, seed: int, checker: ImageChecker) -> tuple[list[dict], SourceReport, list[Problem]]:
    """Kept records of one source (with `source`, `task`, `image_paths`, ... added) and its problems."""
    rows = read_records(src.json_path)
    problems: list[Problem] = []
    first_where, first = rows[0]
    fmt = detect_format(first)
    if fmt is None:
        raise DataError(Problem(first_where, "", f"unknown record format (fields: {sorted(first)}); expected one "
                                                 f"of {', '.join(FORMATS)}: see README 'Data formats'"))
    strategy = parse_strategy(src.sampling_strategy)
    try:
        keep = select_rows(strategy, len(rows), seed, salt=src.json_path)
    except ValueError as e:
        raise DataError(Problem(src.json_path, "sampling_strategy", str(e), src.sampling_strategy)) from None
    out, tasks = [], set()
    for i in keep:
        where, record = rows[i]
        try:
            ex = parse_record(record, fmt, src.task)  # names a missing field and what the format needs
            if detect_format(record) != fmt:
                raise ValueError(f"record is not in the source's format {fmt!r} (detected from its first record); "
                                 f"give every record of a file the same format")
            if ex.task == "rec" and len(ex.images) != 1:
                raise ValueError(f"a grounding record needs exactly one image, got {len(ex.images)}")
        except ValueError as e:
            problems.append(Problem(where, "", str(e)))
            continue
        paths = [resolve_image(ref, src) for ref in ex.images]
        sizes = [checker.check(p) for p in paths]
        bad = [s for s in sizes if isinstance(s, str)]
        if bad:
            problems += [Problem(where, "image", msg) for msg in bad]
            continue
        if ex.task == "rec" and (msg := _check_box(ex.solution, sizes[0])):
            problems.append(Problem(where, "solution", msg))
            continue
        tasks.add(ex.task)
        out.append({**record, "source": src.json_path, "source_row": i, "record_format": fmt, "task": ex.task,
                    "image_paths": paths, "image_sizes": [list(s) for s in sizes]})
    report = SourceReport(src.json_path, sha256_file(src.json_path), src.sampling_strategy, fmt,
                          ",".join(sorted(tasks)) or (src.task or ""), src.image_root, len(rows), len(out))
    return out, report, problems


def sample_sources(sources: list[DataSource], out_path: str | Path, seed: int) -> SampleResult:
    """Sample every source, validate, and write OUT.jsonl and OUT.manifest.json atomically."""
    checker = ImageChecker()
    records, reports, problems = [], [], []
    for src in sources:
        try:
            recs, report, probs = sample_source(src, seed, checker)
        except DataError as e:
            problems += e.problems
            continue
        records += recs
        reports.append(report)
        problems += probs
    if problems:
        raise DataError(problems[:MAX_PROBLEMS] + ([Problem("", "", f"... {len(problems) - MAX_PROBLEMS} more")]
                                                   if len(problems) > MAX_PROBLEMS else []))
    out = Path(out_path)
    manifest_path = out.with_name(out.name.removesuffix(".jsonl") + ".manifest.json")
    atomic_write(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    digest = sha256_file(out)
    manifest: dict[str, Any] = {"seed": seed, "rows": len(records), "records_sha256": digest,
                                "sources": [asdict(r) for r in reports]}
    atomic_write(manifest_path, json.dumps(manifest, indent=2) + "\n")
    return SampleResult(out, manifest_path, reports, seed, digest, len(records))


def atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def format_report(result: SampleResult) -> str:
    """The per-source count table `vlmexp sample` prints."""
    rows = [("source", "format", "task", "strategy", "read", "kept")]
    rows += [(Path(s.json_path).name, s.record_format, s.task, s.sampling_strategy, str(s.rows_read),
              str(s.rows_kept)) for s in result.sources]
    rows.append(("total", "", "", "", str(sum(s.rows_read for s in result.sources)), str(result.rows)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
