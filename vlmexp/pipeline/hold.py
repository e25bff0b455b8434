"""One run per output folder: a run holds its folder for its life, and another run on it waits or is refused.

The holder is a file in the folder, HOLD_NAME, a JSON object: host, pid, run id, what holds it (a pipeline
flow run, `vlmexp train grpo` by hand, a stage deployment run), start time and a heartbeat that a thread of
the holder rewrites every HEARTBEAT_SECONDS. It is created whole or not at all (written to a temporary file,
then hard-linked to its name, which fails when the name exists: atomic on local file systems and on NFS), so
two runs started at the same moment cannot both hold it. Only its owner rewrites or removes it.

A holder is stale when its process is gone (same host) or its heartbeat is older than STALE_PERIODS
heartbeats (any host: a machine that died leaves no process to look for); a stale holder is taken over with a
warning. Otherwise the folder is busy: `run.on_busy: refuse` (default) refuses at once, naming the holder;
`wait` waits up to `run.busy_wait_seconds` for it to end.

What holds: the pipeline's flow (`vlmexp run`, a deployment run, the data-triggered retrain), a stage
deployment run started by hand, and `vlmexp train` started by hand. A stage the pipeline starts is inside the
pipeline's hold: it is told so with `--held-by RUN_ID` (or the `held_by` parameter of a stage deployment) and
checks that the folder is still held by that run.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from vlmexp.errors import Problem, VlmexpError

HOLD_NAME = ".vlmexp-hold.json"
HEARTBEAT_SECONDS = 5.0
STALE_PERIODS = 6  # a heartbeat older than 30 s: the holder is gone
POLL_SECONDS = 1.0  # how often a waiting run looks again
log = logging.getLogger("vlmexp.hold")


class FolderBusy(VlmexpError):
    title = "output folder in use"


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    run_id: str
    what: str  # "vlm-pipeline flow run", "vlmexp train grpo", ...
    started: float  # time.time()
    heartbeat: float

    def describe(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return (f"{self.what} {self.run_id} (process {self.pid} on {self.host}, started {started}, heartbeat "
                f"{max(0.0, now - self.heartbeat):.0f} s ago)")


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def read_holder(folder: str | Path) -> Holder | None:
    """The folder's holder, or None when nobody holds it (or its file is unreadable: `acquire` takes such a
    file over once it is older than a stale heartbeat)."""
    return read_holder_file(Path(folder) / HOLD_NAME)


def read_holder_file(path: Path) -> Holder | None:
    try:
        return Holder(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def stale_reason(holder: Holder, now: float | None = None) -> str | None:
    """Why `holder` no longer holds (its process gone, its heartbeat stopped), or None while it does."""
    now = time.time() if now is None else now
    if holder.host == socket.gethostname() and not _alive(holder.pid):
        return f"its process {holder.pid} is gone"
    if now - holder.heartbeat > STALE_PERIODS * HEARTBEAT_SECONDS:
        return f"its heartbeat stopped {now - holder.heartbeat:.0f} s ago"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    import psutil

    try:  # a zombie (exited, not yet reaped by its parent) holds nothing
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


class Hold:
    """A held folder: its heartbeat thread runs until `release`."""

    def __init__(self, folder: Path, holder: Holder, made_folder: bool = False):
        self.folder, self.holder, self.path = folder, holder, folder / HOLD_NAME
        self.made_folder = made_folder  # the folder did not exist: left empty, it goes with the hold
        self._stop = threading.Event()
        self._failed = False  # the last renewal failed (a full disk is said once, not every heartbeat)
        self._thread = threading.Thread(target=self._beat, name="vlmexp-hold-heartbeat", daemon=True)
        self._thread.start()

    @property
    def run_id(self) -> str:
        return self.holder.run_id

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            current = read_holder(self.folder)
            if current is None or current.run_id != self.run_id:
                log.error("%s is no longer held by %s (now: %s); another run took it over", self.folder,
                          self.run_id, current.describe() if current else "nobody")
                return
            try:
                _write(self.path, Holder(**{**asdict(self.holder), "heartbeat": time.time()}), replace=True)
                self._failed = False
            except OSError as e:  # a full disk: the holder looks stale after STALE_PERIODS, never silently
                self._renew_failed(e)

    def _renew_failed(self, e: OSError) -> None:
        """Say a failed renewal: a full disk as such (vlmexp.disk) once, not again while it stays full."""
        from vlmexp.disk import full_disk_message, is_disk_full

        if not is_disk_full(e, self.folder):
            log.warning("could not renew the hold on %s: %s", self.folder, e)
        elif not self._failed:
            log.error("%s", full_disk_message(e, self.folder, file=self.path))
        self._failed = True

    def release(self) -> None:
        """Stop the heartbeat and remove the holder file, if it is still this run's; and the folder, if the
        hold made it and the run wrote nothing there (a run refused on its config)."""
        self._stop.set()
        self._thread.join(timeout=HEARTBEAT_SECONDS)
        current = read_holder(self.folder)
        if current is not None and current.run_id == self.run_id:
            self.path.unlink(missing_ok=True)
            if self.made_folder and not any(self.folder.iterdir()):
                self.folder.rmdir()


def _write(path: Path, holder: Holder, replace: bool) -> None:
    """Write `holder` to a temporary file beside `path`, then link it to `path` (FileExistsError when a holder
    is there) or, to renew one's own, rename it over `path`."""
    fd, tmp = tempfile.mkstemp(prefix=f"{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(asdict(holder)) + "\n")
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def acquire(folder: str | Path, what: str, run_id: str | None = None, on_busy: str = "refuse",
            wait_seconds: float = 3600.0) -> Hold:
    """Hold `folder` for run `run_id` (a new id when None), or FolderBusy naming the holder: at once
    (`on_busy` refuse) or after `wait_seconds` (wait). A stale holder is taken over, with a warning."""
    folder = Path(folder).expanduser().resolve()
    made_folder = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    path, run_id = folder / HOLD_NAME, run_id or new_run_id()
    deadline = time.monotonic() + (wait_seconds if on_busy == "wait" else 0.0)
    while True:
        now = time.time()
        mine = Holder(socket.gethostname(), os.getpid(), run_id, what, now, now)
        try:
            _write(path, mine, replace=False)
            return Hold(folder, mine, made_folder)
        except FileExistsError:
            pass
        holder = read_holder(folder)
        if holder is not None and holder.run_id == run_id:
            raise FolderBusy(Problem(str(folder), "", f"already held by this run ({holder.describe()})"))
        if holder is None:
            holder = _unreadable(path)
        if holder is not None and (why := stale_reason(holder)) is not None:
            _take_over(path, holder, why)
            continue
        if time.monotonic() >= deadline:
            raise FolderBusy(Problem(str(folder), "run.output_dir", busy_message(holder, on_busy,
                                                                                 wait_seconds)))
        time.sleep(POLL_SECONDS)


def _unreadable(path: Path) -> Holder | None:
    """A holder file that does not parse (written by hand, cut by a crash), as a holder of unknown process
    whose heartbeat is the file's time; None when the file is gone."""
    try:
        changed = path.stat().st_mtime
    except FileNotFoundError:
        return None
    return Holder("unknown host", 0, "unknown", f"an unreadable {HOLD_NAME}", changed, changed)


def busy_message(holder: Holder | None, on_busy: str, wait_seconds: float) -> str:
    who = holder.describe() if holder else "a run that has just ended"
    if on_busy == "wait":
        return (f"still held by {who} after waiting {wait_seconds:g} s (run.busy_wait_seconds); raise "
                "run.busy_wait_seconds, or choose another run.output_dir")
    return (f"held by {who}: one run at a time writes an output folder. Wait for it to end, or set "
            "run.on_busy=wait to wait for it, or choose another run.output_dir; a holder that died is taken "
            f"over by itself (its process gone, or no heartbeat for {STALE_PERIODS * HEARTBEAT_SECONDS:g} s)")


def _take_over(path: Path, holder: Holder, why: str) -> None:
    """Move a stale holder's file aside (kept, as `<name>.stale-<run id>`). Should another run have taken it
    over in between, its new file is moved back (a link: never over a third one)."""
    aside = path.with_name(f"{path.name}.stale-{holder.run_id}")
    try:
        os.replace(path, aside)
    except FileNotFoundError:
        return  # another run moved it first
    moved = read_holder_file(aside)
    if moved is not None and moved.run_id != holder.run_id:  # not the stale one: put it back
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
        aside.unlink(missing_ok=True)
        return
    log.warning("%s was held by %s; %s: taking it over", path.parent, holder.describe(), why)


@contextmanager
def holding(folder: str | Path, what: str, run_id: str | None = None, on_busy: str = "refuse",
            wait_seconds: float = 3600.0) -> Iterator[Hold]:
    """`acquire` for the block's life; released when it ends, however it ends."""
    hold = acquire(folder, what, run_id, on_busy, wait_seconds)
    try:
        yield hold
    finally:
        hold.release()


def refuse_if_held(folder: str | Path) -> None:
    """FolderBusy naming the holder when a live run holds `folder` (a look, not a hold: `acquire` still
    decides), so a command can refuse before it starts anything."""
    folder = Path(folder).expanduser().resolve()
    holder = read_holder(folder)
    if holder is not None and stale_reason(holder) is None:
        raise FolderBusy(Problem(str(folder), "run.output_dir", busy_message(holder, "refuse", 0)))


def check_held_by(folder: str | Path, run_id: str) -> None:
    """A stage the pipeline started (`--held-by`): the folder must still be held by that run; FolderBusy
    naming the holder otherwise."""
    folder = Path(folder).expanduser().resolve()
    holder = read_holder(folder)
    if holder is None or holder.run_id != run_id:
        who = holder.describe() if holder else "nobody"
        raise FolderBusy(Problem(str(folder), "--held-by", f"this stage runs inside the hold of run "
                                 f"{run_id}, but the folder is held by {who}; start the stage through its "
                                 "pipeline run, or leave out --held-by to hold the folder itself", run_id))
