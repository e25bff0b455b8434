"""Sample a mixture of sources into one JSONL file plus a manifest, validating every kept record.

Rows are selected first (vlmexp.data.strategies), then only the kept rows are read, checked and normalised
into SampledRecords (vlmexp.data.normalise): fields, images (exist, readable, sane size; embedded ones
written once under `images/` beside the output file), boxes (finite, x1 < x2, y1 < y2, inside the image). All
problems are reported at once; on any problem nothing is written (images written by this call are removed
again). Output is written to a temporary file and renamed, so a file is complete or absent.

The random pick of a source is seeded by the run seed and the source's content (sha256 of its files, or its
dataset fingerprint), never its path, and the manifest's `content_sha256` leaves absolute paths out: the
same data sampled in another folder or on another machine gives the same rows and the same hash.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vlmexp.config.schema import DataSource
from vlmexp.data import llamafactory
from vlmexp.data.formats import JUDGED_METHOD, NO_JUDGE, detect_format, no_format
from vlmexp.data.images import ImageStore
from vlmexp.data.media import media_problem
from vlmexp.data.normalise import Origin, normalise
from vlmexp.data.record import SCHEMA_VERSION, SampledRecord, content_sha256, reward_name, source_column_names
from vlmexp.data.sources import locate, open_table, sha256_file
from vlmexp.data.strategies import parse_strategy, select_rows
from vlmexp.errors import DataError, Problem
from vlmexp.files import atomic_write

MAX_PROBLEMS = 50
IMAGES_DIR = "images"  # beside the sampled JSONL


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
    detected_by: list[str] = field(default_factory=list)  # the fields that decided record_format
    dataset: str | None = None  # the dataset of a LLaMA-Factory folder (its dataset_info.json entry)
    # the source's fields the rewards receive besides vlmexp's
    own_columns: list[str] = field(default_factory=list)
    # the source's fields named as one of vlmexp's reward columns: field -> the name the rewards receive it by
    renamed_columns: dict[str, str] = field(default_factory=dict)


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


def rename_columns(record: dict[str, Any], columns: dict[str, str | None] | None) -> dict[str, Any]:
    """`record` with the source's `columns` applied: `field: column` renames, `column: null` drops."""
    if not columns:
        return record
    dropped = {name for name, column in columns.items() if column is None}
    out = {k: v for k, v in record.items() if k not in columns.values() and k not in dropped}
    out.update({target: record[column] for target, column in columns.items() if column is not None})
    return out


def _missing_columns(src: DataSource, have: list[str] | None) -> Problem | None:
    # a dropped column (`column: null`) may be absent from a row: rows of a JSON source differ in their keys
    missing = [c for c in (src.columns or {}).values()
               if c is not None and have is not None and c not in have]
    if not missing:
        return None
    return Problem(src.json_path, "columns", f"mapped column(s) {missing} not in the source, which has "
                                             f"{have}; fix the source's `columns` mapping")


def sample_source(src: DataSource, seed: int, store: ImageStore, judged: bool = False
                  ) -> tuple[list[SampledRecord], SourceReport, list[Problem]]:
    """The kept records of one source, normalised (vlmexp.data.normalise), and its problems; `judged`: a judge
    reward is configured, so records of VLM-R1's `llm` method are kept (else refused, naming the fix)."""
    named, (src, tags) = src, llamafactory.resolve(src)
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
    out, tasks, problems, found, embedded, renamed = [], set(), [], None, 0, {}
    for i, (where, raw) in zip(keep, table.take(keep)):
        if isinstance(raw, str):
            problems.append(Problem(where, "", raw))
            continue
        if (missing := _missing_columns(src, list(raw))) is not None:
            problems.append(Problem(where, "columns", missing.message))
            continue
        record = rename_columns(raw, src.columns)
        if (media := media_problem(record)) is not None:
            problems.append(Problem(where, *media))
            continue
        found = found or detect_format(record)
        if found is None:
            raise DataError(Problem(where, "", no_format(record)))
        kept = normalise(record, found[0], src.task, where, image_root, store,
                         Origin(table.name, identity, i), tags, src.box_form)
        if isinstance(kept, Problem):
            problems.append(kept)
            continue
        if kept[0].method == JUDGED_METHOD and not judged:
            problems.append(Problem(where, "accu_reward_method", NO_JUDGE, JUDGED_METHOD))
            continue
        tasks.add(kept[0].task)
        embedded += kept[1]
        renamed.update({n: reward_name(n) for n in record
                        if reward_name(n) != n and reward_name(n) in kept[0].extra})
        out.append(kept[0])
    report = SourceReport(table.name, table.identity.get("sha256"), src.sampling_strategy,
                          found[0] if found else "", ",".join(sorted(tasks)) or (src.task or ""), image_root,
                          len(table), len(out), kind, table.identity.get("fingerprint"),
                          table.identity.get("revision"), src.columns, embedded, found[1] if found else [],
                          named.dataset, source_column_names(out), renamed)
    return out, report, problems


def sample_sources(sources: list[DataSource], out_path: str | Path, seed: int,
                   judged: bool = False) -> SampleResult:
    """Sample every source, validate, and write OUT.jsonl, OUT.manifest.json and images/ atomically; `judged`:
    a judge reward will score records of the `llm` method (`sample_source`). A relative `out_path` is taken
    from the working folder, and the records hold absolute image paths all the same."""
    out = Path(out_path).expanduser().absolute()
    store = ImageStore(out.parent / IMAGES_DIR)
    try:
        return _sample_into(sources, out, seed, store, judged)
    except BaseException:
        store.discard()
        raise


def _sample_into(sources: list[DataSource], out: Path, seed: int, store: ImageStore,
                 judged: bool) -> SampleResult:
    records, reports, problems = [], [], []
    for src in sources:
        try:
            recs, report, probs = sample_source(src, seed, store, judged)
        except DataError as e:
            problems += e.problems
            continue
        records += recs
        reports.append(report)
        problems += probs
    if problems:
        raise DataError(problems[:MAX_PROBLEMS]
                        + ([Problem("", "", f"... {len(problems) - MAX_PROBLEMS} more")]
                           if len(problems) > MAX_PROBLEMS else []))
    manifest_path = out.with_name(out.name.removesuffix(".jsonl") + ".manifest.json")
    atomic_write(out, "".join(r.to_json() + "\n" for r in records))
    digest, content = sha256_file(out), content_sha256(records)
    manifest: dict[str, Any] = {"schema": SCHEMA_VERSION, "seed": seed, "rows": len(records),
                                "records_sha256": digest, "content_sha256": content,
                                "sources": [asdict(r) for r in reports]}
    atomic_write(manifest_path, json.dumps(manifest, indent=2) + "\n")
    return SampleResult(out, manifest_path, reports, seed, digest, len(records), content, list(store.written))


def format_report(result: SampleResult, explain: bool = False) -> str:
    """The per-source count table `vlmexp sample` prints; `explain` adds why each source was read as its
    format (the fields that decided it) and the columns it was renamed with."""
    rows = [("source", "format", "task", "strategy", "read", "kept")]
    rows += [(s.json_path if s.kind == "hub" else Path(s.json_path).name, s.record_format, s.task,
              s.sampling_strategy, str(s.rows_read), str(s.rows_kept)) for s in result.sources]
    rows.append(("total", "", "", "", str(sum(s.rows_read for s in result.sources)), str(result.rows)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
    table += "".join(f"\n{s.json_path}: {renamed_text(s)}" for s in result.sources if s.renamed_columns)
    if not explain:
        return table
    from vlmexp.data.formats import formats_tried

    return "\n".join([table, "",
                      f"formats, tried in this order on each source's first record: {formats_tried()}",
                      *(explain_source(s) for s in result.sources)])


def explain_manifest(manifest_path: str | Path) -> list[str]:
    """`explain_source` for each source a sampled file's manifest records (the pipeline logs them)."""
    manifest = json.loads(Path(manifest_path).read_text())
    return [explain_source(SourceReport(**source)) for source in manifest["sources"]]


def explain_source(s: SourceReport) -> str:
    """Why a source was read as its format: the fields that decided it, the columns and dataset that named
    them."""
    line = (f"{s.json_path}: read as {s.record_format!r} because its first record has "
            f"{', '.join(s.detected_by)}")
    if s.dataset:
        line += f"; LLaMA-Factory dataset {s.dataset!r}"
    if s.columns:
        line += f"; columns renamed {s.columns} (field: source column)"
    if s.own_columns:
        line += f"; its own columns {s.own_columns} reach the rewards as keyword arguments"
    if s.renamed_columns:
        line += f"; {renamed_text(s)}"
    return line


def renamed_text(s: SourceReport) -> str:
    """What the report says of a source's fields named as vlmexp's reward columns: the names rewards get."""
    from vlmexp.data.record import OWN_COLUMNS

    each = ", ".join(f"{old!r} as {new!r} (vlmexp's {old!r} is {OWN_COLUMNS[old]})" for old, new in
                     s.renamed_columns.items())
    return f"rewards receive the source's field {each}"
