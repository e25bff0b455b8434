"""Writing files and folders so that a reader sees them complete or not at all.

A file is written to a temporary sibling and renamed over its path (`atomic_write`); a folder is filled
under a temporary sibling and renamed into place (`new_folder`). A crash, a full disk or Ctrl-C leaves the
old file, or no folder, never half of one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


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


@contextmanager
def new_folder(path: str | Path, replace: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of `path` to fill; when the block ends cleanly it is renamed to `path`, when
    it raises it is removed. Without `replace`, `path` must be absent or empty (FileExistsError, checked
    before the block runs); with it, a folder already there is swapped out after the block and deleted, so a
    reader sees the old folder or the new one, never a mix."""
    out = Path(path)
    if not replace and out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty: choose a new folder or delete it first")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
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
