"""The sampled record: what every source format is normalised to, once, by the sampler.

`vlmexp sample` (and the pipeline's data step) writes one `SampledRecord` a JSONL line; SFT, DPO, GRPO,
evaluation and `vlmexp eval --records` read them with `read_sampled` and never look at the source's layout
again (as EasyR1's `RLHFDataset` maps each source's prompt / answer / image keys once, hiyouga/EasyR1
verl/utils/dataset.py). `reward_columns` is the one place the reward functions' keyword columns are built
(GRPO's dataset, DPO's sample scoring, the difficulty filter, validation, evaluation): vlmexp's own columns
and, as TRL passes every dataset column, the source record's other fields (`extra`). `content_sha256` is the
one digest of sampled data (the manifest's, the stage cache keys', MLflow's dataset inputs').

A file written in another layout (an older vlmexp kept the source's raw fields) is refused by
`read_sampled`, naming the file and the fix; the pipeline samples such data again by itself, since
SCHEMA_VERSION is part of what its sampled data is keyed on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 3  # 2: without `extra` (the source's other fields were dropped); 1: the source's raw fields
# plus record_format, task, image_paths, image_sizes (no marker)
LOCATION_FIELDS = ("source", "images")  # machine-specific absolute paths: left out of content_sha256
RESAMPLE = ("sampled with an older vlmexp or written by hand: run `vlmexp sample` again (a pipeline run "
            "samples again by itself)")


@dataclass(frozen=True)
class SampledRecord:
    """One normalised training or evaluation record (one JSONL line of a sampled file)."""

    task: str  # rec | math | exact | detection: which reward scores the answer
    method: str | None  # VLM-R1's accu_reward_method: how the answer is scored within the task
    problem: str  # the final user turn's text, `<image>` tags removed (the prompt template fills {problem})
    solution: Any  # rec: the box [x1, y1, x2, y2] in original pixels; otherwise the answer as a string
    images: list[str]  # absolute paths of the images (embedded ones as stored beside the sampled file)
    image_sizes: list[list[int]]  # [width, height] of each image, read from its header
    image_refs: list[str]  # the images as the source names them (relative paths as written; embedded:
    # stored name)
    source: str  # the source's file, folder or Hub id
    source_id: str  # what identifies the source's content (sha256 of its files, or its dataset fingerprint)
    source_row: int  # the row within the source
    record_format: str  # the format the source was read as (provenance only: nothing branches on it)
    id: str | None = None  # the source record's own id, where it has one
    system: str | None = None  # the record's own system message (data.system_prompt otherwise)
    history: list[dict[str, str]] = field(default_factory=list)  # earlier turns,
    # {role: user|assistant, content}
    target: str | None = None  # the answer text SFT imitates as written (a chosen answer, the last
    # assistant turn)
    demonstration: list[float] | None = None  # rec: the box SFT imitates instead of the solution
    # (an annotator's)
    rejected: str | None = None  # the dispreferred answer of a preference record (the chosen one is `target`)
    extra: dict[str, Any] = field(default_factory=dict)  # the source record's other fields, as JSON:
    # reward columns
    # the assistant's calls and the tools' turns between the question and `target` when the answer took tool
    # calls: {role: assistant, content: text with its calls as <tool_call>...</tool_call>} and {role: tool,
    # content: text, images: n}; the tool turns' images follow the question's in `images`, in order
    tool_turns: list[dict[str, Any]] = field(default_factory=list)
    box: list[float] | None = None  # the target's box, xyxy in original pixels (V*-style records), or None
    # every target's box (xyxy) where the question has several (V*'s relative-position questions); `box` is
    # None then
    boxes: list[list[float]] | None = None
    schema: int = SCHEMA_VERSION

    @property
    def question_images(self) -> list[str]:
        """The images of the question (a prompt's), without those the tool turns brought."""
        return self.images[:len(self.images) - sum(t.get("images", 0) for t in self.tool_turns)]

    @property
    def targets(self) -> list[list[float]] | None:
        """Every target's box (xyxy), or None where the record carries none."""
        return self.boxes if self.boxes is not None else None if self.box is None else [self.box]

    @property
    def where(self) -> str:
        """How errors name the record: its source and row."""
        return f"{self.source} row {self.source_row}"

    def as_dict(self) -> dict[str, Any]:
        """The fields by name, values shared (not copied as dataclasses.asdict copies them): for writing."""
        return {name: getattr(self, name) for name in FIELD_NAMES}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), ensure_ascii=False)


FIELD_NAMES = tuple(f.name for f in fields(SampledRecord))
REQUIRED = tuple(f.name for f in fields(SampledRecord)
                 if f.default is MISSING and f.default_factory is MISSING)


def from_dict(data: dict[str, Any], where: str) -> SampledRecord:
    """The record a sampled JSONL line holds, or ValueError naming `where` and the fix (resample)."""
    if data.get("schema") != SCHEMA_VERSION:
        layout = f"schema {data['schema']!r}" if "schema" in data else "the layout without a schema field"
        raise ValueError(f"{where}: written in {layout}, not sampled-record schema {SCHEMA_VERSION}; "
                         f"{RESAMPLE}")
    unknown, missing = sorted(set(data) - set(FIELD_NAMES)), [k for k in REQUIRED if k not in data]
    if unknown or missing:
        raise ValueError(f"{where}: not a sampled record (unknown fields {unknown}, missing {missing}); "
                         f"{RESAMPLE}")
    if not isinstance(data.get("extra", {}), dict):
        raise ValueError(f"{where}: `extra` must be an object of the source's fields; {RESAMPLE}")
    if (found := clash(data.get("extra", {}))) is not None:
        raise ValueError(f"{where}: {found[1]}")
    return SampledRecord(**data)


def read_sampled(path: str | Path) -> list[SampledRecord]:
    """The records of a sampled JSONL file (`vlmexp sample`'s output), or DataError naming the file, the line
    and the fix when it is in another layout."""
    from vlmexp.errors import DataError, Problem
    from vlmexp.files import read_jsonl

    path = Path(path)
    try:
        rows = read_jsonl(path)
    except (OSError, ValueError) as e:
        raise DataError(Problem(str(path), "", f"cannot be read as sampled records ({e.__class__.__name__}: "
                                               f"{str(e)[:200]}); {RESAMPLE}"),
                        title="invalid sampled data") from None
    out = []
    for n, row in enumerate(rows, start=1):
        try:
            if not isinstance(row, dict):
                raise TypeError(f"{path}:{n}: each line must be a JSON object; {RESAMPLE}")
            out.append(from_dict(row, f"{path}:{n}"))
        except (ValueError, TypeError) as e:
            raise DataError(Problem(str(path), "", str(e)), title="invalid sampled data") from None
    return out


# The keyword arguments a reward receives besides a record's `extra`: vlmexp's columns (`reward_columns`),
# GRPO's dataset columns TRL reads itself, and what TRL's GRPOTrainer adds (trl/trainer/grpo_trainer.py,
# `_calculate_rewards`). A source field of one of these names reaches the rewards as `source_<name>`
# (`reward_name`; the sample report and manifest state it), so a published layout is never refused for it.
REWARD_COLUMNS = ("solution", "task", "accu_reward_method", "image_sizes", "source_row", "image_path",
                  "bbox")
OWN_COLUMNS = {
    "solution": "the answer rewards grade", "task": "the task that scores the answer",
    "accu_reward_method": "how the answer is scored", "image_sizes": "the question's images' [width, height]",
    "source_row": "the record's row in its source", "image_path": "the first image's path",
    "bbox": "the target's box [x1, y1, x2, y2] in original pixels (a list of them where the question has "
            "several targets), or None",
    "prompt": "GRPO's prompt column", "image": "GRPO's image column", "images": "GRPO's images column",
    "prompts": "TRL's prompts argument", "completions": "TRL's completions argument",
    "completion": "TRL's completion column", "completion_ids": "TRL's completion_ids argument",
    "trainer_state": "TRL's trainer_state argument", "log_metric": "TRL's log_metric hook",
    "log_extra": "TRL's log_extra hook", "environments": "TRL's environments argument",
    "environment": "the environment TRL gives a GRPO row (grpo.tools.without)",
}


RENAMED_PREFIX = "source_"


def reward_name(name: str) -> str:
    """The name a source field reaches the rewards under: its own, or `source_<name>` where vlmexp or TRL
    passes a keyword of that name (RLAIF-V's `image_path` beside vlmexp's first-image path)."""
    return RENAMED_PREFIX + name if name in OWN_COLUMNS else name


def clash(extra: dict[str, Any]) -> tuple[str, str] | None:
    """(the field, why) where a sampled record's `extra` holds a field vlmexp or TRL passes a keyword of that
    name for (a file written by hand or by an older vlmexp: the sampler renames such fields, `reward_name`);
    None when every field can reach the rewards."""
    for name in extra:
        if name in OWN_COLUMNS:
            return name, (f"the source's field {name!r} has the name of vlmexp's reward column {name!r} "
                          f"({OWN_COLUMNS[name]}), so rewards could not receive both; give the source's "
                          f"column another name with `columns: {{<new name>: {name}}}` in its data YAML "
                          f"entry (rewards receive it under the new name), or drop it from the source")
    return None


def source_columns(record: SampledRecord) -> dict[str, Any]:
    """The source's own fields a reward receives: its `id` (as a string) where it has one, and its `extra`."""
    return {**({"id": record.id} if record.id is not None else {}), **record.extra}


def reward_columns(record: SampledRecord, names: Sequence[str] = ()) -> dict[str, Any]:
    """The keyword columns reward functions receive for `record`, as TRL passes every dataset column (GRPO's
    dataset columns; DPO's sample scoring, the difficulty filter, validation and evaluation pass the same):
    the source's own fields (`source_columns`; `names` it lacks as None, for rows of several sources), then
    vlmexp's: the solution as a string (a box as JSON), task, method, sizes, row, first image, the target's
    box (boxes, where several)."""
    return {**{name: None for name in names}, **source_columns(record),
            "solution": json.dumps(record.solution) if record.task == "rec" else str(record.solution),
            "task": record.task, "accu_reward_method": record.method,
            "image_sizes": record.image_sizes[:len(record.question_images)],
            "source_row": record.source_row, "image_path": record.images[0] if record.images else "",
            "bbox": record.boxes if record.boxes is not None else record.box}


def source_column_names(records: Iterable[SampledRecord]) -> list[str]:
    """The names of every record's `source_columns`, in the order first seen."""
    return list(dict.fromkeys(name for r in records for name in source_columns(r)))


def columns_of(records: Sequence[SampledRecord]) -> dict[str, list[Any]]:
    """`reward_columns` of several records, as the column lists reward functions take (a field some records
    lack is None for them)."""
    names = source_column_names(records)
    rows = [reward_columns(r, names) for r in records]
    return {key: [row[key] for row in rows] for key in (*names, *REWARD_COLUMNS)}


def content_sha256(records: Iterable[SampledRecord]) -> str:
    """What identifies sampled records wherever they live: every field but the machine-specific paths."""
    h = hashlib.sha256()
    for r in records:
        h.update(json.dumps({k: v for k, v in r.as_dict().items() if k not in LOCATION_FIELDS},
                            sort_keys=True, ensure_ascii=False).encode())
    return h.hexdigest()
