"""Errors raised for bad input: each problem names where (file:line or field), the value, and the fix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_MISSING = object()


@dataclass(frozen=True)
class Problem:
    where: str  # "configs/demo.yaml:12", "override 'a.b=1'", "data/train.jsonl:7"
    field: str  # dotted path of the field, or "" when the whole place is wrong
    message: str  # what is wrong and how to fix it
    value: Any = _MISSING

    def __str__(self) -> str:
        head = ": ".join(part for part in (self.where, self.field) if part)
        value = "" if self.value is _MISSING else f" = {_short(self.value)}"
        return f"{head}{value}: {self.message}"


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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


class ConfigError(VlmexpError):
    title = "invalid config"


class DataError(VlmexpError):
    title = "invalid data"
