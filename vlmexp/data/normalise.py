"""One source record -> one SampledRecord: its format read, its images checked, its boxes checked.

The sampler calls `normalise` for every kept row, and `vlmexp score` for every line of a predictions file
given by a user, so both read a record the same way. Images are resolved through an ImageStore (checked
once each; embedded ones written beside the sampled file, or only checked when the store has no folder).
Boxes, a rec record's and each of a detection record's, must be finite, not inverted, inside the image.
The record's fields its format does not read are kept as the SampledRecord's `extra` (`source_extra`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmexp.data.formats import Example, detect_format, parse_record, read_fields
from vlmexp.data.images import ImageStore, describe
from vlmexp.data.record import SampledRecord, reward_name
from vlmexp.data.turns import Tags
from vlmexp.errors import Problem


@dataclass(frozen=True)
class Origin:
    """Where a record comes from: the source's name, what identifies its content, the row."""

    source: str
    source_id: str
    row: int


def check_box(box: list[float], size: tuple[int, int] | list[int]) -> str | None:
    """What is wrong with a box in original pixels of an image of `size` (w, h), or None."""
    x1, y1, x2, y2 = box
    w, h = size
    if not all(math.isfinite(v) for v in box):
        return f"box {box} has a non-finite coordinate; write four finite numbers [x1, y1, x2, y2]"
    if x2 <= x1 or y2 <= y1:
        return f"box {box} is inverted or empty (needs x1 < x2 and y1 < y2); fix the solution"
    if x1 < 0 or y1 < 0 or x2 > w or y2 > h:
        return f"box {box} lies outside the {w}x{h} image; boxes are in original pixels"
    return None


def read_example(record: dict[str, Any], fmt: str, task: str | None, tags: Tags | None = None,
                 box_form: str | None = None) -> Example:
    """The record's Example in the source's format, or ValueError naming the field and the fix."""
    ex = parse_record(record, fmt, task, tags, box_form)  # names a missing field and what the format needs
    if (detect_format(record) or ("",))[0] != fmt:
        raise ValueError(f"record is not in the source's format {fmt!r} (detected from its first record); "
                         f"give every record of a source the same format")
    if ex.task == "rec" and len(ex.images) != 1:  # a detection record's count is checked with its solution
        raise ValueError(f"a grounding record needs exactly one image, got {len(ex.images)}")
    return ex


def normalise(record: dict[str, Any], fmt: str, task: str | None, where: str, image_root: str | None,
              store: ImageStore, origin: Origin,
              tags: Tags | None = None, box_form: str | None = None) -> tuple[SampledRecord, int] | Problem:
    """(the SampledRecord, how many of its images were embedded) or the record's first problem; `tags`: how a
    LLaMA-Factory source names message keys and roles; `box_form`: the source's (vlmexp.data.boxes)."""
    try:
        ex = read_example(record, fmt, task, tags, box_form)
    except ValueError as e:
        return Problem(where, "", str(e))
    extra = source_extra(record, fmt)
    if isinstance(extra, Problem):
        return Problem(where, extra.field, extra.message)
    resolved = [store.resolve(ref, image_root) for ref in ex.images]
    if bad := [r for r in resolved if isinstance(r, str)]:
        return Problem(where, "image", bad[0])
    paths, sizes = [r[0] for r in resolved], [list(r[1]) for r in resolved]
    if (msg := _box_problem(ex, sizes)) is not None:
        return Problem(where, "solution", msg)
    for box in ex.boxes or []:
        if (msg := check_box(box, sizes[0])) is not None:
            return Problem(where, "bbox", f"the target's {msg}")
    embedded = [not isinstance(ref, str) and not (isinstance(ref, dict) and ref.get("bytes") is None)
                for ref in ex.images]
    # machine-independent names: embedded images by their stored name (relative to the store's parent, the
    # sampled file's folder), others as the record writes them
    refs = [str(Path(p).relative_to(store.folder.parent)) if e and store.folder is not None
            else p if e else (r.get("path") if isinstance(r, dict) else r)
            for p, e, r in zip(paths, embedded, ex.images)]
    return SampledRecord(task=ex.task, method=ex.method, problem=ex.problem, solution=ex.solution,
                         images=paths, image_sizes=sizes, image_refs=refs, source=origin.source,
                         source_id=origin.source_id, source_row=origin.row, record_format=fmt, id=ex.id,
                         system=ex.system, history=ex.history, target=ex.target,
                         demonstration=ex.demonstration, rejected=ex.rejected, extra=extra,
                         tool_turns=ex.tool_turns,
                         box=ex.boxes[0] if ex.boxes and len(ex.boxes) == 1 else None,
                         boxes=ex.boxes if ex.boxes and len(ex.boxes) > 1 else None), sum(embedded)


def _binary(value: Any) -> bool:
    """An embedded image or raw bytes (a PIL image, a `{bytes, path}` struct, bytes), or a list of them."""
    if isinstance(value, list):
        return bool(value) and all(_binary(v) for v in value)
    return isinstance(value, (bytes, bytearray)) or type(value).__module__.startswith("PIL.") or (
        isinstance(value, dict) and isinstance(value.get("bytes"), (bytes, bytearray)))


def source_extra(record: dict[str, Any], fmt: str) -> dict[str, Any] | Problem:
    """The record's fields its format does not read (`read_fields`), which rewards receive as keyword columns
    as TRL passes every column: JSON values as written; embedded images and bytes left out (a sampled record
    holds images as paths); a field named as one of vlmexp's own columns under `reward_name`. A field of
    another type is a Problem, and so is a renamed field whose new name the source uses as well."""
    extra = {}
    for name in sorted(set(record) - read_fields(record, fmt)):
        value = record[name]
        if _binary(value):
            continue
        try:
            json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError) as e:
            return Problem("", name, f"field {name!r} holds {type(value).__name__} {describe(value)}, which "
                           f"a sampled record cannot store as JSON ({e}), so rewards could not receive it as "
                           "a column; convert it to strings, numbers, lists or objects in the source (e.g. "
                           "datasets' `map` then `save_to_disk`, which vlmexp reads)")
        if (new := reward_name(name)) != name and new in record:
            return Problem("", name, f"the source's field {name!r} has the name of vlmexp's reward column "
                           f"{name!r}, so it reaches the rewards as {new!r}, a field the source has as well; "
                           f"give one of them another name with `columns: {{<new name>: {name}}}` in its "
                           "data YAML entry")
        extra[new] = value
    return extra


def _box_problem(ex: Example, sizes: list[list[int]]) -> str | None:
    """A rec record's box, or any of a detection record's boxes, that is not inside its image."""
    if ex.task == "rec":
        return check_box(ex.solution, sizes[0])
    if ex.task == "detection":
        from vlmexp.detection import gold_objects

        for box, label in gold_objects(ex.solution, ex.method or ""):
            if (msg := check_box(box, sizes[0])) is not None:
                return f"{msg} (object {label!r})"
    return None
