"""Running a stage's launch command as a subprocess: its output streamed (progress bars thinned), its exit
read as a failure or a stop, and a stop reaching every process it started."""

from __future__ import annotations

import collections
import contextlib
import io
import os
import re
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path


class StageFailed(RuntimeError):
    """A stage's process exited non-zero; the message has the exit code and its last output lines."""


class StageInterrupted(StageFailed):
    """A stage's process was stopped by SIGINT or SIGTERM (Ctrl-C, a cancel): a stop, not a failure to retry."""


INTERRUPT_CODES = (130, 143, -2, -15)  # exit codes of a process ended by SIGINT / SIGTERM (shell and Popen forms)


def stop_process_tree(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Stop `proc` gently (SIGTERM), then every process it started, wherever they went: the descendants are
    listed before the launcher is signalled, so workers that torchrun starts in their own sessions, and that
    outlive it, are found too. SIGKILL for what is still alive after `grace` seconds, or at once when a second
    Ctrl-C or SIGTERM cuts the grace short."""
    import psutil

    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
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


def _signal_all(procs: list, how: str) -> None:
    """`terminate` or `kill` each psutil process still running (psutil refuses a pid reused since)."""
    import psutil

    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.is_running():
                getattr(p, how)()


def stage_env() -> dict[str, str]:
    """The environment of a stage subprocess: this process's, with unbuffered output (streamed to the log).
    Nothing else: what the stage needs is in its command line (config, model, MLflow run id)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


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


def run_streaming(cmd: list[str], env: Mapping[str, str], on_line: Callable[[str], None], tail: int = 40,
                  cwd: str | Path | None = None, progress_every: float = 30.0) -> None:
    """Run `cmd`, passing its output lines (stdout and stderr merged) to `on_line`, progress bar redraws at a
    readable rate (`ProgressLines`); raise StageFailed with the exit code and the last `tail` lines shown
    when it fails."""
    last: collections.deque[str] = collections.deque(maxlen=tail)

    def show(line: str) -> None:
        last.append(line)
        on_line(line)

    progress = ProgressLines(show, progress_every)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(env), cwd=cwd)
    try:
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
    except BaseException:  # Ctrl-C, SIGTERM (raised as KeyboardInterrupt by the command line), a cancel
        stop_process_tree(proc)
        raise
    if rc in INTERRUPT_CODES:
        stop_process_tree(proc)  # the launcher is gone; its workers may not be
        raise StageInterrupted(f"{' '.join(cmd[:3])} ... was stopped by a signal (exit code {rc}); last lines:\n"
                               + "\n".join(last))
    if rc != 0:
        raise StageFailed(f"{' '.join(cmd[:3])} ... exited with code {rc}; last lines:\n" + "\n".join(last))
