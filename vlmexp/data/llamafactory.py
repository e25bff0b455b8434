"""A LLaMA-Factory dataset folder as a source: its dataset_info.json names the file, format, columns and tags.

LLaMA-Factory (hiyouga/LLaMA-Factory, data/README.md) describes each dataset of a folder in dataset_info.json:
`file_name` (or `hf_hub_url`, with `subset` and `split`), `formatting` (alpaca | sharegpt), `ranking` (a
preference dataset), `columns` (messages, images, system, chosen, rejected, ...) and, for sharegpt, `tags`
(role_tag, content_tag, user_tag, assistant_tag, system_tag). A source names the folder as its json_path and
the dataset with `dataset:`; the entry becomes an ordinary source: its file, its columns mapped to vlmexp's
fields (sharegpt's messages column to `conversations`; alpaca's prompt, query, response and history columns to
`instruction`, `input`, `output`, `history`), its tags to the turn reader's, images relative to the folder
(LLaMA-Factory's media_dir default). What vlmexp does not read (videos, audios, tools, KTO tags,
`num_samples`, other hubs) is refused, naming the entry and the key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vlmexp.config.schema import DataSource
from vlmexp.data.turns import Tags
from vlmexp.errors import DataError, Problem

INFO_NAME = "dataset_info.json"
SHARED = {"images": "images", "system": "system", "chosen": "chosen", "rejected": "rejected"}
COLUMNS = {  # per formatting: LLaMA-Factory's column key -> vlmexp's field
    "sharegpt": {"messages": "conversations", **SHARED},
    "alpaca": {"prompt": "instruction", "query": "input", "response": "output", "history": "history",
               **SHARED},
}
UNREAD_COLUMNS = ("videos", "audios", "tools", "kto_tag")
TAG_DEFAULTS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                "system_tag": "system"}
UNREAD_KEYS = ("script_url", "ms_hub_url", "om_hub_url", "cloud_file_name", "folder", "num_samples")


def info_path(src: DataSource) -> Path | None:
    """The dataset_info.json of a source naming a LLaMA-Factory folder, or None. A `save_to_disk` folder holds
    a dataset_info.json of its own (the `datasets` library's), beside its state.json or dataset_dict.json."""
    from vlmexp.data.sources import locate

    p = Path(src.json_path).expanduser() / INFO_NAME
    return p if p.is_file() and locate(src.json_path).kind != "saved" else None


def resolve(src: DataSource) -> tuple[DataSource, Tags | None]:
    """The source to read and the turn reader's tags: `src` itself when it names no LLaMA-Factory folder, else
    the file (or Hub dataset) its dataset_info.json entry `src.dataset` describes. DataError names the fix."""
    info = info_path(src)
    if info is None:
        if src.dataset is not None:
            raise DataError(Problem(src.json_path, "dataset",
                                    "`dataset` picks a dataset of a LLaMA-Factory folder, but "
                                    f"{src.json_path} holds no {INFO_NAME}; name the folder, or drop "
                                    "`dataset`"))
        return src, None
    entry = _entry(src, info)
    where = f"{info} [{src.dataset}]"
    problems = [Problem(where, key, "not read by vlmexp; remove it from the entry (use the source's "
                        "sampling_strategy for a subset)", entry[key]) for key in UNREAD_KEYS if key in entry]
    formatting = entry.get("formatting", "alpaca")
    if formatting not in COLUMNS:
        raise DataError(Problem(where, "formatting", "LLaMA-Factory's formattings are alpaca and sharegpt",
                                formatting), title="LLaMA-Factory dataset not readable")
    # LLaMA-Factory's default columns (conversations; instruction, input, output) are vlmexp's field names:
    # only the columns an entry names are renamed
    columns = entry.get("columns") or {}
    problems += [Problem(where, f"columns.{key}",
                         "not read by vlmexp (images and text only); drop the column from the "
                         "entry", value) for key, value in columns.items() if key in UNREAD_COLUMNS]
    problems += [Problem(where, f"columns.{key}",
                         f"not a column of LLaMA-Factory's {formatting} formatting; use "
                         f"{', '.join(COLUMNS[formatting])}", value) for key, value in columns.items()
                 if key not in COLUMNS[formatting] and key not in UNREAD_COLUMNS]
    if entry.get("ranking") and not {"chosen", "rejected"} <= set(columns):
        problems.append(Problem(where, "columns", "a ranking dataset names its chosen and rejected columns",
                                entry.get("columns")))
    if src.columns:
        problems.append(Problem(src.json_path, "columns",
                                f"a LLaMA-Factory folder's columns come from {INFO_NAME}; drop the source's "
                                "`columns`", src.columns))
    if problems:
        raise DataError(problems, title="LLaMA-Factory dataset not readable")
    mapped = {COLUMNS[formatting][key]: value for key, value in columns.items()}
    folder = info.parent.resolve()
    update: dict[str, Any] = {"columns": mapped, "image_root": src.image_root or str(folder)}
    if "hf_hub_url" in entry:
        update.update(json_path=f"{entry['hf_hub_url']}@{entry.get('split', 'train')}",
                      subset=entry.get("subset"))
    else:
        update["json_path"] = str(folder / entry["file_name"])
    return src.model_copy(update=update), _tags(entry.get("tags") or {})


def _entry(src: DataSource, info: Path) -> dict[str, Any]:
    try:
        entries = json.loads(info.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(Problem(str(info), "",
                                f"cannot be read ({e.__class__.__name__}: {str(e)[:200]}); "
                                "fix the file")) from None
    names = sorted(entries) if isinstance(entries, dict) else []
    if src.dataset is None or src.dataset not in names:
        raise DataError(Problem(src.json_path, "dataset", f"a LLaMA-Factory folder: name one of its datasets "
                                f"with `dataset:`, one of {names}", src.dataset))
    entry = entries[src.dataset]
    if not isinstance(entry, dict) or not ("file_name" in entry or "hf_hub_url" in entry):
        raise DataError(Problem(f"{info} [{src.dataset}]", "file_name",
                                "the entry needs file_name (a file or folder beside dataset_info.json) or "
                                "hf_hub_url", entry))
    return entry


def _tags(tags: dict[str, Any]) -> Tags:
    t = {**TAG_DEFAULTS, **tags}
    roles = {t["user_tag"]: "user", t["assistant_tag"]: "assistant", t["system_tag"]: "system"}
    return Tags(role_tag=t["role_tag"], content_tag=t["content_tag"], roles=roles)
