"""Hostile input, one case each: every one stops `vlmexp train` before any training step with exit 2 and an
error naming where (file:line or field), the value and the fix; nothing is left half-written.

The cases run the real command in-process (`vlmexp.cli.main`), the same path a pipeline stage takes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import make_png, write_jsonl
from vlmexp.cli import main

REPO = Path(__file__).resolve().parents[1]
GOOD = {"image": "a.png", "problem": "the red square", "solution": [2, 2, 20, 20]}


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_models):
    """Images (good and bad) and a base config pointing at a built tiny model."""
    root = tmp_path_factory.mktemp("hostile")
    img = root / "img"
    good = make_png(img / "a.png", (64, 48)).read_bytes()
    (img / "trunc.png").write_bytes(good[: len(good) // 2])
    (img / "text.png").write_text("not an image")
    make_png(img / "dot.png", (1, 1))
    make_png(img / "strip.png", (1000, 4))
    make_png(img / "huge.png", (1400, 1400))
    return {"root": root, "img": img, "model": tiny_models["qwen2_5_vl"]}


def _config(world, tmp_path, data_body: str | None = None, extra: str = "") -> Path:
    data = data_body or f"  datasets:\n    - {{json_path: {write_jsonl(tmp_path / 'ok.jsonl', [GOOD] * 4)}, " \
                        f"image_root: {world['img']}}}\n"
    path = tmp_path / "c.yaml"
    path.write_text(f"run:\n  output_dir: {tmp_path / 'out'}\nmodel:\n  path: {world['model']}\n"
                    f"tracking:\n  backend: none\nsft:\n  args: {{max_steps: 1}}\ndata:\n{data}{extra}")
    return path


def _source(world, tmp_path, rows=None, name="d.jsonl", strategy="all", raw: str | None = None) -> str:
    path = tmp_path / name
    if raw is not None:
        path.write_text(raw)
    elif rows is not None:
        write_jsonl(path, rows)
    return f"  datasets:\n    - {{json_path: {path}, image_root: {world['img']}, sampling_strategy: '{strategy}'}}\n"


def _fails(capsys, tmp_path, config: Path, *overrides: str, data_ok: bool = False) -> str:
    code = main(["train", "sft", "--config", str(config), *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    out = tmp_path / "out"
    assert not (out / "sft").exists(), "no training may start"
    if not data_ok:
        assert not list(out.glob("data/*.jsonl")), "no sampled data may be written from bad input"
    assert not list(out.rglob(".*.tmp*")) and not list(out.rglob(".*.jsonl.*")), "no temporary leftovers"
    return err


# --- config ---------------------------------------------------------------------------------------------

CONFIG_CASES = {
    "unknown key": (["sft.argz.max_steps=2"], ["sft.argz", "unknown key", "did you mean 'args'"]),
    "wrong type": (["eval.batch_size=many"], ["eval.batch_size", "'many'", "valid integer"]),
    "negative count": (["eval.max_new_tokens=-5"], ["eval.max_new_tokens", "-5", "greater than 0"]),
    "zero count": (["eval.batch_size=0"], ["eval.batch_size", "0", "greater than 0"]),
    "num_generations not dividing the batch": (
        ["grpo.args.num_generations=3", "grpo.args.per_device_train_batch_size=4"],
        ["grpo.args", "divisible by num_generations"]),
    "missing model path": (["model.path=./no/such/model"], ["model.path", "./no/such/model"]),
    "unknown reward": (["grpo.rewards=[{name: accuracy}]"], ["grpo.rewards", "unknown reward 'accuracy'", "module:function"]),
    "module:function that does not import": (["grpo.rewards=[{name: 'nosuchmod:fn'}]"],
                                             ["nosuchmod:fn", "cannot import", "PYTHONPATH"]),
    "module:function naming nothing": (["grpo.rewards=[{name: 'json:nosuchfn'}]"], ["json:nosuchfn", "no callable"]),
    "TRL arg that does not exist": (["sft.args.learning_rat=1e-4"], ["sft.args.learning_rat", "did you mean 'learning_rate'"]),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_config_case(world, tmp_path, capsys, case):
    overrides, needles = CONFIG_CASES[case]
    err = _fails(capsys, tmp_path, _config(world, tmp_path), *overrides)
    for needle in needles:
        assert needle in err, (needle, err)
    assert not (tmp_path / "out").exists()  # a config error writes nothing at all


def test_yaml_syntax_error_shows_the_line(world, tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(f"run:\n  output_dir: {tmp_path / 'out'}\nmodel:\n  path: [unclosed\n")
    err = _fails(capsys, tmp_path, config)
    assert f"{config}:4" in err or f"{config}:5" in err, err
    assert not (tmp_path / "out").exists()


# --- data -----------------------------------------------------------------------------------------------

def _rows(**change):
    return [GOOD, {**GOOD, **change}]


DATA_CASES = {
    "missing source file": (dict(name="gone.jsonl"), ["gone.jsonl", "file not found", "fix json_path"]),
    "empty file": (dict(raw=""), ["d.jsonl", "empty"]),
    "malformed JSON line": (dict(raw=json.dumps(GOOD) + "\n{not json\n"), ["d.jsonl:2", "malformed JSON"]),
    "missing field": (dict(rows=[GOOD, {"image": "a.png", "solution": [2, 2, 9, 9], "answer_key": 1}]),
                      ["d.jsonl:2", "missing field 'problem'"]),
    "unknown format": (dict(rows=[{"img": "a.png", "question": "q"}]), ["d.jsonl:1", "unknown record format",
                                                                       "Data formats"]),
    "sampling count above the rows": (dict(rows=[GOOD], strategy="first:5"), ["sampling_strategy",
                                                                              "asks for 5 rows but the file has 1"]),
    "missing image": (dict(rows=_rows(image="nope.png")), ["d.jsonl:2", "image not found", "nope.png", "image_root"]),
    "truncated image": (dict(rows=_rows(image="trunc.png")), ["d.jsonl:2", "unreadable image", "trunc.png"]),
    "non-image file": (dict(rows=_rows(image="text.png")), ["d.jsonl:2", "unreadable image", "text.png"]),
    "one-pixel image": (dict(rows=_rows(image="dot.png", solution=[0, 0, 1, 1])), ["d.jsonl:2", "1x1 pixels",
                                                                                  "remove the record"]),
    "aspect ratio over 200": (dict(rows=_rows(image="strip.png", solution=[0, 0, 9, 2])),
                              ["d.jsonl:2", "aspect ratio 250 exceeds 200", "crop or drop"]),
    "box outside the image": (dict(rows=_rows(solution=[10, 10, 80, 20])), ["d.jsonl:2", "outside the 64x48 image"]),
    "inverted box": (dict(rows=_rows(solution=[30, 5, 10, 20])), ["d.jsonl:2", "inverted or empty", "x1 < x2"]),
    "solution without a box": (dict(rows=_rows(solution="top left")), ["d.jsonl:2", "holds no box",
                                                                       "[x1, y1, x2, y2]"]),
}


@pytest.mark.parametrize("case", list(DATA_CASES))
def test_data_case(world, tmp_path, capsys, case):
    source, needles = DATA_CASES[case]
    err = _fails(capsys, tmp_path, _config(world, tmp_path, _source(world, tmp_path, **source)))
    for needle in needles:
        assert needle in err, (needle, err)


def test_unknown_sampling_strategy(world, tmp_path, capsys):
    err = _fails(capsys, tmp_path, _config(world, tmp_path, _source(world, tmp_path, [GOOD], strategy="middle:3")))
    assert "sampling_strategy" in err and "middle:3" in err and "first:N" in err


def test_image_tokens_over_the_sequence_limit(world, tmp_path, capsys):
    # 1400x1400 at max_pixels 1003520 becomes 994x994 -> 1225 image tokens, over SFT's max_length of 512:
    # TRL would cut into the image placeholders ("Image features and image tokens do not match")
    rows = [GOOD, {**GOOD, "image": "huge.png", "solution": [10, 10, 500, 500]}]
    config = _config(world, tmp_path, _source(world, tmp_path, rows), extra="")
    err = _fails(capsys, tmp_path, config, "model.max_pixels=1003520", "sft.args.max_length=512", data_ok=True)
    for needle in ("train.jsonl:2", "sft.args.max_length", "1225 for its image", "raise sft.args.max_length",
                   "lower model.max_pixels"):
        assert needle in err, (needle, err)


def test_safe_defaults(world, tmp_path, capsys):
    from vlmexp.cli import build_parser
    from vlmexp.config_loader import load_config

    cfg = load_config(_config(world, tmp_path))
    assert cfg.model.trust_remote_code is False
    assert build_parser().parse_args(["ui"]).host == "127.0.0.1"
    # YAML is read safely: a python tag is an error, never a call
    planted = tmp_path / "executed"
    config = tmp_path / "evil.yaml"
    config.write_text(f"run:\n  name: !!python/object/apply:os.system ['touch {planted}']\n")
    assert main(["validate", str(config)]) == 2
    assert not planted.exists() and "evil.yaml" in capsys.readouterr().err
    # a reward name is never evaluated: only registered names and importable module:function references
    err = _fails(capsys, tmp_path, _config(world, tmp_path), f"grpo.rewards=[{{name: '__import__(\"os\").system(\"touch {planted}\")'}}]")
    assert "unknown reward" in err and not planted.exists()
