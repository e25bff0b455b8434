"""Media vlmexp does not train: a record that carries video or audio is refused, never trained on its text
alone.

ms-swift (`videos`, `audios`, `<video>` / `<audio>` tags: docs Customization/Custom-dataset.md),
LLaMA-Factory (`videos`, `audios` columns and tags: data/README.md), EasyR1 (`videos`:
verl/utils/dataset.py) and TRL (`{"type": "video"}` parts; TRL 1.16's GRPO generates from a video prompt
but computes the loss without it, huggingface/trl#5373) all publish records with media vlmexp's families
are not given: such a record would otherwise lose its tags' meaning, its files would reach the rewards as a
column, and SFT and GRPO would train on the text without what it speaks of. A column whose value is empty
(None, "", []) carries nothing and passes.
"""

from __future__ import annotations

from typing import Any

MEDIA_COLUMNS = {"videos": "video", "video": "video", "audios": "audio", "audio": "audio"}
MEDIA_TAGS = {"<video>": "video", "<audio>": "audio"}
MEDIA_PARTS = {"video": "video", "video_url": "video", "audio": "audio", "audio_url": "audio",
               "input_audio": "audio"}
IMAGES_ONLY = "vlmexp trains on images (and text) only, so the record would be trained without its"


def media_problem(record: dict[str, Any]) -> tuple[str, str] | None:
    """(the field, why and the fix) where `record` carries video or audio, else None."""
    for name, kind in MEDIA_COLUMNS.items():
        if record.get(name) not in (None, "", []):
            return name, (f"field {name!r} carries {kind} ({_shown(record[name])}): {IMAGES_ONLY} {kind}; "
                          f"drop the column with `columns: {{{name}: null}}` in the source's data YAML entry "
                          f"(its rows are then read without it), or filter out the rows that carry {kind}")
    for name, value in record.items():
        found = _in_value(value)
        if found is not None:
            what, kind = found
            return name, (f"field {name!r} holds {what}: {IMAGES_ONLY} {kind}; filter out the rows that "
                          f"carry {kind} (e.g. datasets' `filter`, then `save_to_disk`, which vlmexp "
                          f"reads), or remove the {kind} from them")
    return None


def _in_value(value: Any, depth: int = 0) -> tuple[str, str] | None:
    """(what was found, its kind) in a text, a typed part or a nested list / object, else None."""
    if depth > 8:
        return None
    if isinstance(value, str):
        tag = next((t for t in MEDIA_TAGS if t in value), None)
        return (f"a {tag} tag", MEDIA_TAGS[tag]) if tag else None
    if isinstance(value, dict):
        kind = value.get("type")
        if isinstance(kind, str) and kind in MEDIA_PARTS:
            return f"a {{type: {kind}}} part", MEDIA_PARTS[kind]
        value = list(value.values())
    if isinstance(value, list):
        for item in value:
            if (found := _in_value(item, depth + 1)) is not None:
                return found
    return None


def _shown(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."
