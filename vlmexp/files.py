"""Writing files and folders so that a reader sees them complete or not at all.

A file is written to a temporary sibling and renamed over its path (`atomic_write`); a folder is filled
under a temporary sibling and renamed into place (`new_folder`). A crash, a full disk or Ctrl-C leaves the
old file, or no folder, never half of one.

Every folder `new_folder` makes carries a marker file (MARKER: what it is and which command made it), and
a folder is replaced only when it carries one: vlmexp never deletes a folder it did not make.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def atomic_write(path: str | Path, content: str | bytes) -> Path:
    """Write `content` (text as UTF-8) to a temporary file beside `path`, then rename: complete or absent."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content.encode("utf-8") if isinstance(content, str) else content)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSONL file vlmexp wrote (sampled data, samples, pairs), blank lines skipped."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


MARKER = ".vlmexp-made.json"


def made_by_vlmexp(folder: str | Path) -> bool:
    """Whether `folder` carries the marker of a folder vlmexp made (following a symlink to its target)."""
    return (Path(folder) / MARKER).is_file()


def mark_folder(folder: str | Path, what: str) -> None:
    """Mark `folder` as one vlmexp made: what it is and the command that made it (never its arguments)."""
    from vlmexp.provenance import command_name

    marker = {"made_by": "vlmexp", "what": what, "command": command_name()}
    (Path(folder) / MARKER).write_text(json.dumps(marker) + "\n")


def foreign_content(folder: str | Path) -> str | None:
    """Why vlmexp may not replace or clear `folder`, or None: it is absent, empty, or made by vlmexp."""
    p = Path(folder)
    if not p.exists() or (p.is_dir() and not any(p.iterdir())) or made_by_vlmexp(p):
        return None
    what = "a file" if not p.is_dir() else "files vlmexp did not make (it has no " + MARKER + ")"
    return (f"{p} holds {what}; vlmexp replaces only folders it made: choose a new or empty folder, or move "
            "that one away yourself")


@contextmanager
def new_folder(path: str | Path, replace: bool = False, what: str = "") -> Iterator[Path]:
    """Yield a temporary sibling of `path` to fill; when the block ends cleanly it is marked as vlmexp's
    (`what`, the command) and renamed to `path`, when it raises it is removed. Without `replace`, `path` must
    be absent or empty (FileExistsError, checked before the block runs); with it, a folder vlmexp made may be
    there, and is swapped out after the block and deleted, so a reader sees the old folder or the new one,
    never a mix. A folder vlmexp did not make is never replaced (FileExistsError, before the block runs)."""
    out = Path(path).expanduser().resolve()  # `a/..`, `~` and links name the folder they lead to
    if not replace and out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty: choose a new folder or delete it first")
    refused = foreign_content(out)
    if refused:
        raise FileExistsError(refused)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        mark_folder(tmp, what or out.name)
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent)) / out.name
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old.parent, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
