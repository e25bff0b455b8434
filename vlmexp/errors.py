"""Errors raised for bad input: each problem names where (file:line or field), the value, and the fix."""

from __future__ import annotations

import logging
import reprlib
from dataclasses import dataclass
from typing import Any

_MISSING = object()
VALUE_LIMIT = 200  # characters of a bad value shown in a problem
MESSAGE_LIMIT = 1000  # characters of a problem's place or message (a value quoted inside an exception's text)


@dataclass(frozen=True)
class Problem:
    where: str  # "configs/demo.yaml:12", "override 'a.b=1'", "data/train.jsonl:7"
    field: str  # dotted path of the field, or "" when the whole place is wrong
    message: str  # what is wrong and how to fix it
    value: Any = _MISSING

    def __str__(self) -> str:
        head = ": ".join(short(part, MESSAGE_LIMIT, text=True) for part in (self.where, self.field) if part)
        value = "" if self.value is _MISSING else f" = {short(self.value)}"
        return f"{head}{value}: {short(self.message, MESSAGE_LIMIT, text=True)}"


class _BoundedRepr(reprlib.Repr):
    """repr() that stops early: a few levels, a few items, bytes as their length. The time it takes does
    not grow with the value (a billion-laughs list, a 1 GB string)."""

    def __init__(self, limit: int):
        super().__init__()  # keyword arguments only from Python 3.12
        self.maxlevel = 4
        self.maxtuple = self.maxlist = self.maxarray = self.maxdict = self.maxset = self.maxfrozenset = 8
        self.maxdeque = 8
        self.maxstring = self.maxlong = self.maxother = limit

    def repr_bytes(self, value: bytes, level: int) -> str:
        return f"<{len(value)} bytes>"

    repr_bytearray = repr_memoryview = repr_bytes


def short(value: Any, limit: int = VALUE_LIMIT, text: bool = False) -> str:
    """The one place a value is cut for a message: at most `limit` characters, bytes shown as `<N bytes>`.
    `text=True` shows a string as it is (a message, a path); otherwise values are shown as repr()."""
    if text and isinstance(value, str):
        shown = value
    elif isinstance(value, (bytes, bytearray, memoryview)):
        return f"<{len(value)} bytes>"
    else:
        shown = _BoundedRepr(limit).repr(value)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def change_the_value(key: str, value: Any) -> str:
    """The fix for a value of the wrong type. YAML 1.1 reads unquoted no/yes/off/on as booleans, so a
    boolean where a word was expected gets the quoting fix."""
    if isinstance(value, bool):
        word = "yes" if value else "no"
        return f"YAML read an unquoted word (no, yes, off, on) as {value}; quote it, e.g. {key}: \"{word}\""
    return "change the value"


class VlmexpError(ValueError):
    """Bad input, reported as a list of problems, all at once."""

    title = "invalid input"

    def __init__(self, problems: list[Problem] | Problem, title: str | None = None):
        self.problems = [problems] if isinstance(problems, Problem) else list(problems)
        if title:
            self.title = title
        super().__init__(self.render())

    def render(self, limit: int = 50) -> str:
        lines = [f"{self.title} ({len(self.problems)} problem{'s' * (len(self.problems) != 1)}):"]
        lines += [f"  - {p}" for p in self.problems[:limit]]
        if len(self.problems) > limit:
            lines.append(f"  ... and {len(self.problems) - limit} more")
        return "\n".join(lines)


class ReportedError(RuntimeError):
    """A failure whose message says everything: what failed (a judge endpoint gone mid-run, a full disk),
    where, and the fix. The command line shows the message without a traceback, and exits 1."""


class ConfigError(VlmexpError):
    title = "invalid config"


class DataError(VlmexpError):
    title = "invalid data"


class _NoTracebackForBadInput(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], VlmexpError):
            record.exc_info, record.exc_text = None, None  # the message already holds every problem
        return True


def quiet_bad_input_tracebacks(*logger_names: str) -> None:
    """Log a VlmexpError (bad input) that an orchestrator reports, e.g. Prefect's "Task run failed with
    exception", without its traceback: the error lists every problem with the fix, and a traceback would
    read as a crash. Any other exception keeps its traceback. Idempotent."""
    for name in logger_names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTracebackForBadInput) for f in logger.filters):
            logger.addFilter(_NoTracebackForBadInput())
