"""Running a stage's launch command as a subprocess: its output streamed (progress bars thinned), its exit
read as a failure or a stop, and a stop reaching every process it started.

The stage runs in a session of its own, tied to this process (Linux sends it SIGTERM when this process ends,
however it ends). So a terminal's Ctrl-C, which signals the whole foreground process group, reaches only this
process, and a signal to the group and a signal to this process alone stop a stage the same way: this process
passes the signal on to the stage's launcher once (torchrun passes it on to its workers) and knows the stage
was stopped, whatever exit code the launcher reports (torchrun exits 1), so the stage is never taken for a
failure and retried. A second signal kills every process of the stage at once."""

from __future__ import annotations

import collections
import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path


class StageFailed(RuntimeError):
    """A stage's process exited non-zero; the message has the exit code and its last output lines."""


class StageInterrupted(StageFailed):
    """A stage's process was stopped by a signal (Ctrl-C, SIGTERM, SIGHUP, a cancel): a stop, not a failure to
    retry."""


INTERRUPT_CODES = (129, 130, 143, -1, -2, -15)  # exit codes of a process ended by SIGHUP / SIGINT / SIGTERM
# (shell and Popen forms)
STOP_SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}
# torchrun's last line when a signal stopped it (it exits 1): torch.distributed.elastic's SignalException
_LAUNCHER_SIGNALLED = re.compile(r"SignalException: Process \d+ got signal: "
                                 r"(1|2|3|15|SIG(HUP|INT|QUIT|TERM))\b")
STOP_GRACE = 15.0  # seconds a stopped stage has to end before every process of it is killed

_stops: list[int] = []  # the stop signals this process received, first first


def note_stop(signum: int) -> None:
    """Record that this process received stop signal `signum`: from now on it is stopping."""
    _stops.append(int(signum))


def stop_signal() -> int | None:
    """The first stop signal this process received, or None: a stage that ends now was stopped, not failed."""
    return _stops[0] if _stops else None


def stop_outside_a_stage(signum: int, frame) -> None:
    """The command's handler for a stop signal where no stage runs: the first raises KeyboardInterrupt (the
    pipeline closes its runs and exits 128 + the signal). A second one, typically a double Ctrl-C that came
    while the stage was being stopped, lets that closing finish (a second or so: the Prefect flow run
    Cancelled, the MLflow runs KILLED) instead of breaking into it and leaving the run Crashed; a third raises
    anyway."""
    note_stop(signum)
    if len(_stops) == 2:
        os.write(2, b"stopping: recording the stop in Prefect and MLflow; a further signal leaves without\n")
        return
    raise KeyboardInterrupt(f"signal {signum}")


def stopped_by(signum: int | None) -> str:
    """How a stop is named to the user: Ctrl-C for SIGINT, else the signal's name."""
    return STOP_SIGNALS.get(signum or signal.SIGINT, f"signal {signum}")


# the stage's command, after asking Linux for SIGTERM when the process that starts it (pid argv[1]) ends
# (PR_SET_PDEATHSIG, kept across exec): a stage in a session of its own must not outlive a killed pipeline
_TIED_TO_PARENT = """
import ctypes, os, signal, sys
prctl = getattr(ctypes.CDLL(None), "prctl", None)
if prctl is not None:
    prctl(1, int(signal.SIGTERM))
if os.getppid() != int(sys.argv[1]):
    sys.exit("the process that started this one is gone")
os.execvp(sys.argv[2], sys.argv[2:])
"""


def tied_to_this_process(cmd: list[str]) -> list[str]:
    """`cmd`, run so that it gets SIGTERM when this process ends (Linux; elsewhere `cmd` runs as it is)."""
    return [sys.executable, "-c", _TIED_TO_PARENT, str(os.getpid()), *cmd]


def stop_process_tree(proc: subprocess.Popen, grace: float = 10.0, known: list | tuple = ()) -> None:
    """Stop `proc` gently (SIGTERM), then every process it started, wherever they went: the descendants are
    listed before the launcher is signalled, so workers that torchrun starts in their own sessions, and that
    outlive it, are found too (with `known`, the psutil processes listed earlier, while the launcher lived).
    SIGKILL for what is still alive after `grace` seconds, or at once when a second Ctrl-C or SIGTERM cuts the
    grace short."""
    import psutil

    tree = [*known, *_descendants(proc)]
    try:
        if proc.poll() is None:
            proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
        _signal_all(tree, "terminate")
        psutil.wait_procs(tree, timeout=grace)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _signal_all(tree, "kill")
        psutil.wait_procs(tree, timeout=grace)


def _descendants(proc: subprocess.Popen) -> list:
    """The psutil processes `proc` started, and theirs (none once it is gone)."""
    import psutil

    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _signal_all(procs: list, how: str) -> None:
    """`terminate` or `kill` each psutil process still running (psutil refuses a pid reused since)."""
    import psutil

    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.is_running():
                getattr(p, how)()


# glibc's malloc gives a freed block above its mmap threshold (128 KiB at first, rising to at most 32 MiB)
# back to the kernel at once, and trims the heap's free top above 128 KiB: a training step that allocates and
# frees the same large tensors every step (logits and their gradients) has the kernel fault in and zero every
# page of them again, step after step. With both thresholds at 1 GiB freed memory stays with the process for
# the next step, as PyTorch's CPU launcher keeps it with jemalloc (torch.backends.xeon.run_cpu, MALLOC_CONF's
# decay times): on the 2-core machine an SFT of 150 steps at batch 32 faulted 1.5 M pages instead of 8.6 M,
# and spent 3.1 s of system time instead of 14.3 s (user time unchanged, 71 s), its peak memory 1.21 GB
# instead of 1.02 GB (bench/RESULTS.md). glibc reads them only at a process's start; a value the user set is
# kept; other C libraries ignore them.
HELD_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def stage_env() -> dict[str, str]:
    """The environment of a stage subprocess: this process's, with unbuffered output (streamed to the log)
    and freed memory held for the next step (HELD_MEMORY, where the user did not set it). Nothing else: what
    the stage needs is in its command line (config, model, MLflow run id)."""
    return {**HELD_MEMORY, **os.environ, "PYTHONUNBUFFERED": "1"}


_PERCENT = re.compile(r"(\d{1,3})%\|")  # tqdm's "45%|████▌     | 9/20 [...]"


class ProgressLines:
    """Passes output lines to `on_line`, but a progress bar's redraws (text ending in \\r) only at a readable
    rate: when the bar reaches another tenth (a new bar starts at its first), or `every` seconds after the
    last one shown; and its last state (its final draw, or the last redraw when the output ends)."""

    def __init__(self, on_line: Callable[[str], None], every: float = 30.0):
        self.on_line, self.every = on_line, every
        self.shown_at, self.tenth, self.pending = -float("inf"), None, None

    def line(self, text: str) -> None:
        if _PERCENT.search(text):  # a bar's final draw (ended by a newline): its last state, shown
            self.tenth, self.pending = None, None
        self.on_line(text)

    def redraw(self, text: str) -> None:
        match = _PERCENT.search(text)
        tenth = int(match.group(1)) // 10 if match else None
        if tenth != self.tenth or time.monotonic() - self.shown_at >= self.every:
            self.tenth, self.shown_at, self.pending = tenth, time.monotonic(), None
            self.on_line(text)
        else:
            self.pending = text

    def flush(self) -> None:
        if self.pending is not None:
            self.on_line(self.pending)
            self.pending = None


@contextlib.contextmanager
def _passing_stops_to(proc: subprocess.Popen, known: list) -> Iterator[None]:
    """While `proc` runs: the first stop signal this process receives is recorded and passed on to `proc` (the
    stage's launcher), with every process of the stage killed if it has not ended `STOP_GRACE` seconds later;
    a second one kills them at once. `known` collects the stage's processes seen while the launcher lived.
    Handlers go only to the main thread; a SIGHUP ignored when the command started (nohup) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def kill_all() -> None:
        known.extend(_descendants(proc))
        proc.kill()  # nothing once it is reaped
        _signal_all(known, "kill")

    def stop(signum, frame) -> None:
        # before the launcher goes: its workers may be in sessions of their own
        known.extend(_descendants(proc))
        first = stop_signal() is None
        note_stop(signum)
        if not first:
            kill_all()
            return
        proc.send_signal(signum)
        timers.append(threading.Timer(STOP_GRACE, kill_all))  # also workers that outlive their launcher
        timers[-1].daemon = True
        timers[-1].start()

    timers: list[threading.Timer] = []
    taken = [s for s in STOP_SIGNALS if s != signal.SIGHUP or signal.getsignal(s) is not signal.SIG_IGN]
    previous = {s: signal.signal(s, stop) for s in taken}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for timer in timers:
            timer.cancel()


def run_streaming(cmd: list[str], env: Mapping[str, str], on_line: Callable[[str], None], tail: int = 40,
                  cwd: str | Path | None = None, progress_every: float = 30.0) -> None:
    """Run `cmd` in a session of its own tied to this process, passing its output lines (stdout and stderr
    merged) to `on_line`, progress bar redraws at a readable rate (`ProgressLines`); raise StageFailed with
    the exit code and the last `tail` lines shown when it fails, StageInterrupted when a signal stopped it
    (this process's, passed on, or one sent to the stage itself). Nothing starts once this process is
    stopping."""
    if stop_signal() is not None:
        raise StageInterrupted(f"{' '.join(cmd[:3])} ... not started: stopping ({stopped_by(stop_signal())})")
    last: collections.deque[str] = collections.deque(maxlen=tail)

    def show(line: str) -> None:
        last.append(line)
        on_line(line)

    progress = ProgressLines(show, progress_every)
    known: list = []
    proc = subprocess.Popen(tied_to_this_process(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(env), cwd=cwd, start_new_session=True)
    try:
        with _passing_stops_to(proc, known):
            assert proc.stdout is not None
            # newline="": lines come with their ending, so a redraw (ended by the \r that starts the next one)
            # is told apart from a line
            for raw in io.TextIOWrapper(proc.stdout, encoding="utf-8", errors="replace", newline=""):
                line = raw.rstrip("\r\n")
                if not line.strip():
                    continue
                (progress.redraw if raw.endswith("\r") else progress.line)(line)
            progress.flush()
            rc = proc.wait()
    except BaseException:  # an error, or a stop raised where the handlers above could not go (another thread)
        stop_process_tree(proc, known=known)
        raise
    signalled = (stop_signal() is not None or rc in INTERRUPT_CODES
                 or any(map(_LAUNCHER_SIGNALLED.search, last)))
    if signalled:
        stop_process_tree(proc, known=known)  # the launcher is gone; its workers may not be
        here = f"{stopped_by(stop_signal())} here, passed on; " if stop_signal() is not None else ""
        raise StageInterrupted(f"{' '.join(cmd[:3])} ... was stopped by a signal ({here}exit code {rc}); "
                               "last lines:\n" + "\n".join(last))
    if rc != 0:
        raise StageFailed(f"{' '.join(cmd[:3])} ... exited with code {rc}; last lines:\n" + "\n".join(last))
