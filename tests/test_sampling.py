"""Sampling strategies, seeds, and the errors for bad strategies."""

from __future__ import annotations

import pytest

from vlmexp.data.strategies import Strategy, parse_strategy, select_rows


@pytest.mark.parametrize("text, expected", [
    ("all", Strategy("all")),
    ("first:5", Strategy("first", count=5)),
    ("end:3", Strategy("end", count=3)),
    ("random:7", Strategy("random", count=7)),
    ("random:10%", Strategy("random", percent=10.0)),
    ("first:12.5%", Strategy("first", percent=12.5)),
])
def test_parse(text, expected):
    assert parse_strategy(text) == expected


@pytest.mark.parametrize("text, needle", [
    ("middle:3", "unknown sampling strategy"),
    ("first", "unknown sampling strategy"),
    ("first:0", "must be positive"),
    ("first:-2", "must be positive"),
    ("first:abc", "malformed count"),
    ("random:x%", "malformed percentage"),
    ("random:0%", "(0, 100]"),
    ("random:150%", "(0, 100]"),
])
def test_parse_errors(text, needle):
    with pytest.raises(ValueError, match="use"):
        parse_strategy(text)
    with pytest.raises(ValueError) as e:
        parse_strategy(text)
    assert needle in str(e.value)


def test_first_end_all():
    assert select_rows(parse_strategy("first:3"), 10, 0, "s") == [0, 1, 2]
    assert select_rows(parse_strategy("end:3"), 10, 0, "s") == [7, 8, 9]
    assert select_rows(parse_strategy("all"), 4, 0, "s") == [0, 1, 2, 3]


def test_percent_rounds_up_like_vlm_r1():
    assert len(select_rows(parse_strategy("first:10%"), 25, 0, "s")) == 3  # ceil(2.5)
    assert select_rows(parse_strategy("end:50%"), 5, 0, "s") == [2, 3, 4]


def test_random_is_seeded():
    s = parse_strategy("random:20")
    a = select_rows(s, 1000, seed=1, salt="x.jsonl")
    assert a == select_rows(s, 1000, seed=1, salt="x.jsonl")
    assert a != select_rows(s, 1000, seed=2, salt="x.jsonl")
    assert a != select_rows(s, 1000, seed=1, salt="y.jsonl")  # sources draw independently
    assert len(set(a)) == 20 and a == sorted(a)


def test_count_above_rows():
    with pytest.raises(ValueError, match="asks for 11 rows but the file has 10"):
        select_rows(parse_strategy("random:11"), 10, 0, "s")
