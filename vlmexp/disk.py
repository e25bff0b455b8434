"""A full disk said as such: which folder, which file was being written, how much room is left and how much a
checkpoint needs.

A disk that fills while a stage saves surfaces as whatever the writer says: torch's `basic_ios::clear:
iostream error` or `file write failed`, safetensors' `No space left on device (os error 28)`, sqlite's
`database or disk is full` (an MLflow store on the same disk), an OSError with ENOSPC. `said_as_disk_full`
turns any of these, and any error raised while the folder's disk has less room left than a checkpoint needs,
into `DiskFull` naming the folder, the file, the free space and the fix (the command line shows it without a
traceback). `warn_if_short` says before training when the folder's disk has less room than one checkpoint
of the model needs (`checkpoint_bytes`).
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from vlmexp.errors import ReportedError

log = logging.getLogger("vlmexp.disk")
FULL_TEXTS = ("no space left on device", "os error 28", "database or disk is full", "disk quota exceeded")
WRITE_TEXTS = ("iostream error", "file write failed", "write failed")  # said by torch when the disk fills
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
DATABASE_SUFFIXES = (".db", ".db-journal", ".db-wal", ".db-shm")
# folders written all along, whatever failed: the stage's MLflow spool (vlmexp.tracking.spool.SPOOL_DIR)
WRITTEN_ALL_ALONG = ("mlflow_spool",)
ADAMW_BYTES = 8  # AdamW's two moments, float32, per trained parameter


class DiskFull(ReportedError, OSError):
    """The disk holding the run's folder is full: the message names the folder, the file, the room left."""


def free_bytes(folder: str | Path) -> int:
    """The room left on the file system holding `folder` (or its nearest existing parent)."""
    p = Path(folder).expanduser().resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def checkpoint_bytes(model_path: str, full: bool) -> int | None:
    """About what one checkpoint of a local model folder takes: its weights, plus AdamW's two float32 moments
    per parameter when every parameter trains (`full`); None when it cannot be told before the model loads
    (a Hub id, LoRA: the adapter's size depends on the modules it wraps)."""
    folder = Path(model_path)
    weights = sum(p.stat().st_size for pattern in ("*.safetensors", "*.bin") for p in folder.glob(pattern))
    if not full or not weights:
        return None
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
    parameters = weights / DTYPE_BYTES.get(str(dtype), 4)
    return int(weights + ADAMW_BYTES * parameters)


def warn_if_short(folder: str | Path, model_path: str, full: bool) -> None:
    """Warn, naming both figures, when `folder`'s disk has less room than one checkpoint of the model."""
    need = checkpoint_bytes(model_path, full)
    free = free_bytes(folder)
    if need is not None and free < need:
        log.warning("%s has %s free, and one checkpoint of %s needs about %s (its weights and AdamW's two "
                    "moments): the first save will fail. Free space there, or set run.output_dir to a "
                    "folder on a larger disk", folder, size(free), model_path, size(need))


def is_disk_full(error: BaseException, folder: str | Path, need: int | None = None) -> bool:
    """Whether `error` (or one it was raised from) is a full disk: ENOSPC or a writer's words for it, or a
    write failure while the folder's disk has less room than `need` (1 MiB when not known)."""
    text = ""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text += f" {seen}".lower()
        seen = seen.__cause__ or seen.__context__
    if any(t in text for t in FULL_TEXTS):
        return True
    return any(t in text for t in WRITE_TEXTS) and free_bytes(folder) < (need or 2**20)


def being_written(error: BaseException, folder: Path) -> str:
    """The file a full disk cut: the error's own; an sqlite store's database; else the newest file under
    `folder` (a store's database and the stage's MLflow spool left out: they are written all along, also
    after the save that failed)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.filename:
            return str(seen.filename)
        if "database or disk is full" in str(seen):
            return "the MLflow store's sqlite database"
        seen = seen.__cause__ or seen.__context__
    files = [p for p in folder.rglob("*") if p.is_file() and not p.name.endswith(DATABASE_SUFFIXES)
             and not set(p.relative_to(folder).parts) & set(WRITTEN_ALL_ALONG)]
    return str(max(files, key=lambda p: p.stat().st_mtime)) if files else f"a file under {folder}"


def full_disk_message(error: BaseException, folder: Path, need: int | None = None,
                      file: Path | None = None) -> str:
    """The full disk said as such: the folder, the file being written (`file`, else `being_written`), the
    room left, the fix. Of the error, the line that says the disk is full (SQLAlchemy's first line is a
    note on autoflush)."""
    lines = str(error).strip().splitlines() or [error.__class__.__name__]
    first = next((line for line in lines if any(t in line.lower() for t in FULL_TEXTS)), lines[0])[:300]
    needs = f"; one checkpoint of this model needs about {size(need)}" if need else ""
    return (f"the disk holding {folder} is full: writing {file or being_written(error, folder)} failed "
            f"({error.__class__.__name__}: {first}); {size(free_bytes(folder))} free there{needs}. "
            "Free space on that disk, or set run.output_dir to a folder on a larger one, then run "
            "the same command again: it resumes from the newest complete checkpoint")


# the loggers that meet a full disk before the stage's own error does: the hold's heartbeat, the MLflow
# spool, and MLflow's sqlite store, which logs SQLAlchemy's error with its traceback
# (mlflow/store/db/utils.py, make_managed_session)
NOISY_LOGGERS = ("vlmexp.hold", "vlmexp.tracking", "mlflow.store.db.utils",
                 "mlflow.store.tracking.sqlalchemy_store")


class SayFullDiskFirst(logging.Filter):
    """On NOISY_LOGGERS while a block runs (`said_as_disk_full`): the first log record that meets the full
    disk becomes the clear message (`full_disk_message`), so that it is the first thing a user reads; each
    logger's next such record follows once, as its first line without a traceback; the rest are dropped."""

    def __init__(self, folder: Path):
        super().__init__()
        self.folder, self.said, self.first = folder, set(), True

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        text = record.getMessage()
        if not (error is not None and is_disk_full(error, self.folder)
                or any(t in text.lower() for t in FULL_TEXTS)):
            return True
        if record.name in self.said:
            return False
        self.said.add(record.name)
        if self.first:
            self.first = False
            record.msg = text if text.startswith("the disk holding ") else full_disk_message(
                error or OSError(errno.ENOSPC, text.splitlines()[0][:300]), self.folder)
            record.levelno, record.levelname = logging.ERROR, "ERROR"
        else:
            record.msg = text.splitlines()[0][:200]
        record.args, record.exc_info, record.exc_text, record.stack_info = (), None, None, None
        return True


@contextmanager
def said_as_disk_full(folder: str | Path, checkpoint: Callable[[], int | None] = lambda: None
                      ) -> Iterator[None]:
    """Raise DiskFull (from the original error) for a full disk under the block: naming `folder`, the file
    being written, the room left, and what a checkpoint needs (`checkpoint()`, asked once the block failed:
    the model it estimates from may only exist by then) when known. While the block runs, what other parts
    log of the full disk comes after the clear message, briefly (SayFullDiskFirst)."""
    folder = Path(folder).expanduser().resolve()
    quiet = SayFullDiskFirst(folder)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    try:
        yield
    except DiskFull:
        raise
    except Exception as e:
        try:
            need = checkpoint()
        except Exception:  # noqa: BLE001 - an estimate only: the error says the rest without it
            need = None
        if not is_disk_full(e, folder, need):
            raise
        raise DiskFull(full_disk_message(e, folder, need)) from e
    finally:
        for name in NOISY_LOGGERS:
            logging.getLogger(name).removeFilter(quiet)
