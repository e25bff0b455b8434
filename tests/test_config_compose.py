"""Configs that compose with `extends:`: merge rules, relative paths, cycles, and errors at the line that
wrote the value (in the base file or the file extending it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlmexp.checks.loader import load_config
from vlmexp.errors import ConfigError

BASE = """\
run:
  name: base
  seed: 1
model:
  path: tiny:qwen2_5_vl
  min_pixels: 3136
data:
  demo: {train: 4, val: 2, width: [112, 112]}
grpo:
  rewards:
    - {name: format, weight: 0.25}
    - {name: iou}
"""


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _problems(path: Path, overrides=()) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(path, list(overrides))
    return [str(p) for p in e.value.problems]


def test_deep_merge_lists_replaced_then_overrides(tmp_path):
    _write(tmp_path / "base.yaml", BASE)
    child = _write(tmp_path / "child.yaml",
                   "extends: base.yaml\nrun:\n  name: child\ndata:\n  demo: {train: 8}\n"
                   "grpo:\n  rewards: [{name: iou}]\n")
    cfg = load_config(child, ["run.seed=5"])
    assert (cfg.run.name, cfg.run.seed, cfg.model.min_pixels) == ("child", 5, 3136)  # child, override, base
    # merged mapping
    assert (cfg.data.demo.train, cfg.data.demo.val, cfg.data.demo.width) == (8, 2, (112, 112))
    assert [(r.name, r.weight) for r in cfg.grpo.rewards] == [("iou", 1.0)]  # a list is replaced whole
    assert load_config(tmp_path / "base.yaml").run.name == "base"  # a base loads alone as well


def test_null_drops_a_base_section(tmp_path):
    _write(tmp_path / "base.yaml", BASE)
    child = _write(tmp_path / "child.yaml",
                   "extends: base.yaml\ndata:\n  demo: null\n  datasets: [{json_path: a.jsonl}]\n")
    cfg = load_config(child)
    assert cfg.data.demo is None and cfg.data.datasets[0].json_path == "a.jsonl"


def test_a_list_of_bases_merges_in_order_with_paths_relative_to_each_file(tmp_path):
    _write(tmp_path / "recipes" / "common.yaml", BASE)
    _write(tmp_path / "recipes" / "fast.yaml", "extends: common.yaml\nrun:\n  seed: 2\n  name: fast\n")
    _write(tmp_path / "recipes" / "named.yaml", "run:\n  name: named\n")
    child = _write(tmp_path / "runs" / "child.yaml",
                   "extends: [../recipes/fast.yaml, ../recipes/named.yaml]\n")
    cfg = load_config(child)
    # later base wins; fast's own base
    assert (cfg.run.name, cfg.run.seed, cfg.data.demo.train) == ("named", 2, 4)


def test_errors_name_the_line_of_the_file_that_wrote_the_value(tmp_path):
    base = _write(tmp_path / "base.yaml",
                  BASE.replace("  seed: 1", "  seed: one").replace("name: iou", "name: iuo"))
    child = _write(tmp_path / "child.yaml", "# a child\nextends: base.yaml\neval:\n  batch_size: 0\n"
                                            "data:\n  demo: {train: -1}\n")
    joined = "\n".join(_problems(child, ["model.min_pixels=x"]))
    assert f"{base}:3: run.seed = 'one'" in joined  # the value came from the base: the base's line
    assert f"{base}:12: grpo.rewards.1.name = 'iuo': unknown reward 'iuo'" in joined  # the check phase too
    assert f"{child}:4: eval.batch_size = 0" in joined and f"{child}:6: data.demo.train = -1" in joined
    assert "override 'model.min_pixels=x': model.min_pixels = 'x'" in joined
    base.write_text(BASE.replace("width: [112, 112]", "width: [300, 200]"))
    child.write_text("extends: base.yaml\nmodel:\n  max_pixels: 100\n")
    joined = "\n".join(_problems(child))
    assert f"{base}:8: data.demo.width = [300, 200]: scenes.width must be [low, high]" in joined
    # a check of a section as a whole, on values from both files: both named
    assert (f"{child}:2 (with values from {base}:5): model = " in joined
            and "exceeds max_pixels (100)" in joined)


def test_cycles_are_refused_naming_the_chain(tmp_path):
    a = _write(tmp_path / "a.yaml", "extends: sub/b.yaml\n" + BASE)
    b = _write(tmp_path / "sub" / "b.yaml", "run:\n  seed: 3\nextends: ../a.yaml\n")
    [msg] = _problems(a)
    assert msg.startswith(f"{b}:3: extends = '../a.yaml': extends makes a cycle: {a} -> {b} -> {a};"), msg
    assert "remove one of these extends" in msg
    me = _write(tmp_path / "me.yaml", "extends: me.yaml\n")
    assert f"extends makes a cycle: {me} -> {me}" in _problems(me)[0]


def test_bad_extends_values(tmp_path):
    missing = _write(tmp_path / "sub" / "c.yaml", "run: {seed: 1}\nextends: base.yaml\n")
    [msg] = _problems(missing)
    assert msg == (f"{missing}:2: extends = 'base.yaml': {tmp_path / 'sub' / 'base.yaml'} is not a file; "
                   "paths in extends are relative to the folder of the file that names them "
                   f"({tmp_path / 'sub'}): fix the path")
    for value in ("[]", "3", "[base.yaml, {x: 1}]"):
        [msg] = _problems(_write(tmp_path / "d.yaml", f"extends: {value}\n"))
        assert (f"{tmp_path / 'd.yaml'}:1: extends" in msg
                and "write the path of a config file to build on" in msg)
    _write(tmp_path / "base.yaml", BASE)
    broken = _write(tmp_path / "broken.yaml", "run: [unclosed\n")
    [msg] = _problems(_write(tmp_path / "e.yaml", "extends: [base.yaml, broken.yaml]\n"))
    assert msg.startswith(f"{broken}:") and "YAML syntax error" in msg
    ok = _write(tmp_path / "f.yaml", "extends: base.yaml\n")
    [msg] = _problems(ok, ["extends=other.yaml"])
    assert "override 'extends=other.yaml'" in msg and "write it in the YAML file" in msg
    [msg] = _problems(_write(tmp_path / "g.yaml", "extend: base.yaml\n" + BASE))
    assert "did you mean 'extends'?" in msg
