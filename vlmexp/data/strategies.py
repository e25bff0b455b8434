"""Sampling strategies of VLM-R1 data YAMLs: all, first:N, end:N, random:N, with N a count or 'P%'.

Percentages round up, as VLM-R1 does (`math.ceil(P * rows / 100)`). Random sampling is seeded per
source by the run seed and what identifies the source's content (its sha256 or dataset fingerprint, the
`salt`), never its path: adding a source never changes the rows drawn from another, and moving the data
or the checkout changes no row.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

KINDS = ("all", "first", "end", "random")
_FORM = "all, first:N, end:N, random:N, where N is a positive count or a percentage like 10%"


@dataclass(frozen=True)
class Strategy:
    kind: str  # one of KINDS
    count: int | None = None  # absolute number of rows
    percent: float | None = None  # share of the rows, in (0, 100]

    def size(self, rows: int) -> int:
        """How many rows this strategy keeps out of `rows` (without checking bounds)."""
        if self.kind == "all":
            return rows
        if self.percent is not None:
            return math.ceil(self.percent * rows / 100)
        return int(self.count or 0)


def parse_strategy(text: str) -> Strategy:
    """Parse a sampling_strategy string, or raise ValueError saying the accepted forms."""
    value = str(text).strip()
    if value == "all":
        return Strategy("all")
    m = re.fullmatch(r"(\w+):\s*(.+)", value)
    if not m or m.group(1) not in KINDS[1:]:
        raise ValueError(f"unknown sampling strategy {text!r}; use {_FORM}")
    kind, number = m.group(1), m.group(2).strip()
    if number.endswith("%"):
        try:
            pct = float(number[:-1])
        except ValueError:
            raise ValueError(f"malformed percentage in {text!r}; use {_FORM}") from None
        if not 0 < pct <= 100:
            raise ValueError(f"percentage in {text!r} must be in (0, 100]; use e.g. {kind}:10%")
        return Strategy(kind, percent=pct)
    if not re.fullmatch(r"[+-]?\d+", number):
        raise ValueError(f"malformed count in {text!r}; use {_FORM}")
    count = int(number)
    if count <= 0:
        raise ValueError(f"count in {text!r} must be positive; use e.g. {kind}:100 or {kind}:10%")
    return Strategy(kind, count=count)


def select_rows(strategy: Strategy, rows: int, seed: int, salt: str) -> list[int]:
    """Indices of the kept rows, in file order. Raises ValueError when N exceeds the rows."""
    k = strategy.size(rows)
    if k > rows:
        raise ValueError(f"asks for {k} rows but the file has {rows}; lower N or use 'all'")
    if k <= 0:
        raise ValueError(f"keeps no rows of {rows}; raise the percentage or use 'all'")
    if strategy.kind in ("all", "first"):
        return list(range(k))
    if strategy.kind == "end":
        return list(range(rows - k, rows))
    rng = random.Random(f"{seed}:{salt}")
    return sorted(rng.sample(range(rows), k))
