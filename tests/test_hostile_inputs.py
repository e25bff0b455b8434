"""Hostile input, one case each: every one stops `vlmexp train` before any training step with exit 2 and an
error naming where (file:line or field), the value and the fix; nothing is left half-written.

The cases run the real command in-process (`vlmexp.cli.main`), the same path a pipeline stage takes.
"""

from __future__ import annotations

import json
import os
import sys
import time
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
    os.symlink("loop.png", img / "loop.png")  # a link to itself
    os.mkfifo(img / "pipe.png")  # a named pipe: reading it would block until someone writes
    return {"root": root, "img": img, "model": tiny_models["qwen2_5_vl"]}


def _config(world, tmp_path, data_body: str | None = None, extra: str = "") -> Path:
    data = data_body or (f"  datasets:\n    - {{json_path: {write_jsonl(tmp_path / 'ok.jsonl', [GOOD] * 4)}, "
                         f"image_root: {world['img']}}}\n")
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
    return (f"  datasets:\n    - {{json_path: {path}, image_root: {world['img']}, "
            f"sampling_strategy: '{strategy}'}}\n")


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
    "unknown reward": (["grpo.rewards=[{name: accuracy}]"], ["grpo.rewards", "unknown reward 'accuracy'",
                                                             "module:function"]),
    "module:function that does not import": (["grpo.rewards=[{name: 'nosuchmod:fn'}]"],
                                             ["nosuchmod:fn", "cannot import", "PYTHONPATH"]),
    "module:function naming nothing": (["grpo.rewards=[{name: 'json:nosuchfn'}]"],
                                       ["json:nosuchfn", "no callable"]),
    "TRL arg that does not exist": (["sft.args.learning_rat=1e-4"], ["sft.args.learning_rat",
                                                                     "did you mean 'learning_rate'"]),
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
                                                                       "docs/data-formats.md"]),
    "sampling count above the rows": (dict(rows=[GOOD], strategy="first:5"),
                                      ["sampling_strategy", "asks for 5 rows but the file has 1"]),
    "missing image": (dict(rows=_rows(image="nope.png")), ["d.jsonl:2", "image not found", "nope.png",
                                                           "image_root"]),
    "image path that is a symlink loop": (dict(rows=_rows(image="loop.png")), ["d.jsonl:2", "loop.png",
                                                                              "points back to itself"]),
    "image path that is a named pipe": (dict(rows=_rows(image="pipe.png")), ["d.jsonl:2", "pipe.png",
                                                                            "is a named pipe, not a file"]),
    "truncated image": (dict(rows=_rows(image="trunc.png")), ["d.jsonl:2", "unreadable image", "trunc.png"]),
    "non-image file": (dict(rows=_rows(image="text.png")), ["d.jsonl:2", "unreadable image", "text.png"]),
    "one-pixel image": (dict(rows=_rows(image="dot.png", solution=[0, 0, 1, 1])), ["d.jsonl:2", "1x1 pixels",
                                                                                  "remove the record"]),
    "aspect ratio over 200": (dict(rows=_rows(image="strip.png", solution=[0, 0, 9, 2])),
                              ["d.jsonl:2", "aspect ratio 250 exceeds 200", "crop or drop"]),
    "box outside the image": (dict(rows=_rows(solution=[10, 10, 80, 20])),
                              ["d.jsonl:2", "outside the 64x48 image"]),
    "inverted box": (dict(rows=_rows(solution=[30, 5, 10, 20])), ["d.jsonl:2", "inverted or empty",
                                                                  "x1 < x2"]),
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
    err = _fails(capsys, tmp_path, _config(world, tmp_path, _source(world, tmp_path, [GOOD],
                                                                    strategy="middle:3")))
    assert "sampling_strategy" in err and "middle:3" in err and "first:N" in err


def test_image_tokens_over_the_sequence_limit(world, tmp_path, capsys):
    # 1400x1400 at max_pixels 1003520 becomes 994x994 -> 1225 image tokens, over SFT's max_length of 512:
    # TRL would cut into the image placeholders ("Image features and image tokens do not match")
    rows = [GOOD, {**GOOD, "image": "huge.png", "solution": [10, 10, 500, 500]}]
    config = _config(world, tmp_path, _source(world, tmp_path, rows), extra="")
    err = _fails(capsys, tmp_path, config, "model.max_pixels=1003520", "sft.args.max_length=512",
                 data_ok=True)
    for needle in ("train.jsonl:2", "sft.args.max_length", "1225 for its image", "raise sft.args.max_length",
                   "lower model.max_pixels"):
        assert needle in err, (needle, err)


def test_safe_defaults(world, tmp_path, capsys):
    from vlmexp.checks.loader import load_config
    from vlmexp.cli import build_parser

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
    err = _fails(capsys, tmp_path, _config(world, tmp_path),
                 f"grpo.rewards=[{{name: '__import__(\"os\").system(\"touch {planted}\")'}}]")
    assert "unknown reward" in err and not planted.exists()


# --- files that are not what a config or data YAML should be ---------------------------------

def _laughs(levels: int = 7) -> str:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


YAML_FILE_CASES = {
    "duplicate key": (b"run:\n  seed: 1\n  seed: 2\n", [":3", "run.seed", "defined twice", "lines 2 and 3",
                                                        "remove one"]),
    "billion laughs": (_laughs().encode(), ["aliases (*name) expand the document by",
                                            "over the limit of 100000"]),
    "recursive alias": (b"run: &r\n  name: [*r]\n", ["alias refers to the anchor that contains it"]),
    "not UTF-8": (b"run:\n  name: caf\xe9\n", [":2", "not UTF-8 text: byte 0xe9 at byte 16",
                                               "save the file as UTF-8"]),
    "UTF-16": ("run:\n  seed: 1\n".encode("utf-16"), ["UTF-16 text", "save it as UTF-8"]),
    "binary file": (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", ["binary file", "NUL byte at byte 8"]),
    "huge file": (b"# " + b"x" * (1 << 20) + b"\n", ["over the 1048576 bytes", "records go in .jsonl files"]),
    "empty file": (b"", ["the file is empty", "write a config's sections"]),
    "top level a list": (b"- run\n- model\n", [":1", "top level must be a mapping", "got a list"]),
    "nesting too deep": (b"run: " + b"[" * 100 + b"]" * 100 + b"\n", ["nested more than 64 levels deep",
                                                                      "flatten"]),
    "value YAML cannot build": (b"run:\n  seed: 2024-13-45\n", ["a value cannot be read", "quote it"]),
}


@pytest.mark.parametrize("case", list(YAML_FILE_CASES))
def test_config_file_case(tmp_path, capsys, case):
    body, needles = YAML_FILE_CASES[case]
    config = tmp_path / "c.yaml"
    config.write_bytes(body)
    start = time.monotonic()
    assert main(["validate", str(config)]) == 2
    err = capsys.readouterr().err
    assert time.monotonic() - start < 20, "refused quickly"
    for needle in [str(config), *needles]:
        assert needle in err, (needle, err)
    assert "Traceback" not in err and len(max(err.splitlines(), key=len)) < 1500


@pytest.mark.parametrize("case", ["duplicate key", "billion laughs", "not UTF-8", "binary file"])
def test_data_yaml_file_case(world, tmp_path, capsys, case):
    body, needles = YAML_FILE_CASES[case]
    data_yaml = tmp_path / "d.yaml"
    data_yaml.write_bytes(body.replace(b"run:", b"datasets:") if case == "duplicate key" else body)
    err = _fails(capsys, tmp_path, _config(world, tmp_path, f"  data_yaml: {data_yaml}\n"))
    for needle in [str(data_yaml), *needles[1:]]:
        assert needle.replace("run.", "datasets.") in err, (needle, err)


def test_config_that_is_a_folder(tmp_path, capsys):
    assert main(["validate", str(tmp_path)]) == 2
    assert "is a folder, not a file" in capsys.readouterr().err


# --- non-finite numbers ---------------------------------------------------------------------------------

NON_FINITE_CASES = {
    "NaN learning rate": (["grpo.args.learning_rate=.nan"], "grpo.args.learning_rate = nan"),
    "nan as a TRL string": (["grpo.args.beta=nan"], "grpo.args.beta = 'nan'"),
    "infinite reward weight": (["grpo.rewards=[{name: iou, weight: .inf}]"], "grpo.rewards.0.weight = inf"),
    "NaN in reward kwargs": (["grpo.rewards=[{name: iou_threshold, kwargs: {threshold: .nan}}]"],
                             "grpo.rewards.0.kwargs.threshold = nan"),
    "infinite temperature": (["eval.temperature=-.inf"], "eval.temperature = -inf"),
}


@pytest.mark.parametrize("case", list(NON_FINITE_CASES))
def test_non_finite_number_case(world, tmp_path, capsys, case):
    overrides, needle = NON_FINITE_CASES[case]
    err = _fails(capsys, tmp_path, _config(world, tmp_path), *overrides)
    assert needle in err and "finite number" in err, err


@pytest.mark.parametrize("solution", ["[NaN, 2, 20, 20]", [2, 2, "Infinity", 20], "[2, 2, 1e999, 20]"])
def test_non_finite_box(world, tmp_path, capsys, solution):
    rows = [GOOD, {**GOOD, "solution": solution}]
    if isinstance(solution, list):  # JSON's Infinity, written as the bare word
        raw = (json.dumps(GOOD) + "\n"
               + json.dumps({**GOOD, "solution": [2, 2, 0, 20]}).replace("0, 20]", "Infinity, 20]") + "\n")
        source = _source(world, tmp_path, raw=raw)
    else:
        source = _source(world, tmp_path, rows)
    err = _fails(capsys, tmp_path, _config(world, tmp_path, source))
    assert "d.jsonl:2" in err and "not a finite number" in err and "four finite numbers" in err, err


# --- module:function rewards whose import misbehaves ------------------------------------------------------

REWARD_MODULES = {
    "raises": ("raise RuntimeError('no GPU here')\n", ["raised RuntimeError: no GPU here", "fix the module"]),
    "exits": ("import sys\nsys.exit(0)\n", ["called sys.exit(0)", "remove that call"]),
    "ends the process": ("import os\nos._exit(0)\n", ["ended the Python process (exit status 0)"]),
    "hangs": ("import time\nwhile True:\n    time.sleep(0.1)\n", ["did not finish in 2 s",
                                                                  "VLMEXP_REWARD_IMPORT_TIMEOUT"]),
}


@pytest.mark.parametrize("case", list(REWARD_MODULES))
def test_reward_module_import_case(world, tmp_path, capsys, monkeypatch, case):
    body, needles = REWARD_MODULES[case]
    name = f"hostile_reward_{case.replace(' ', '_')}"
    (tmp_path / f"{name}.py").write_text(body + "def score(prompts, completions, **kw):\n"
                                                "    return [1.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("VLMEXP_REWARD_IMPORT_TIMEOUT", "2")
    err = _fails(capsys, tmp_path, _config(world, tmp_path), f"grpo.rewards=[{{name: '{name}:score'}}]")
    assert f"{name}:score" in err and "grpo.rewards.0.name" in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    assert name not in sys.modules, "validation imports in a child process"


# --- entry points' own arguments and output paths ---------------------------------------------------------

def _unwritable(tmp_path: Path) -> Path:
    """A folder this process cannot write in: a read-only folder, or for root (who may write anywhere on
    a normal mount) a folder under /proc."""
    if os.geteuid() == 0:
        return Path("/proc/vlmexp-not-writable")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    return ro / "inside"


def test_output_dir_that_is_a_file(world, tmp_path, capsys):
    (tmp_path / "taken").write_text("a file")
    err = _fails(capsys, tmp_path, _config(world, tmp_path), f"run.output_dir={tmp_path / 'taken'}")
    assert "run.output_dir" in err and "is a file, not a folder" in err


def test_output_dir_that_cannot_be_written(world, tmp_path, capsys):
    place = _unwritable(tmp_path)
    err = _fails(capsys, tmp_path, _config(world, tmp_path), f"run.output_dir={place}")
    assert "run.output_dir" in err and "cannot be" in err and "choose a writable place" in err


@pytest.mark.parametrize("where", ["missing folder under a file", "unwritable", "a folder"])
def test_sample_out_that_cannot_be_written(world, tmp_path, capsys, where):
    data_yaml = tmp_path / "d.yaml"
    data_yaml.write_text(_source(world, tmp_path, [GOOD]))
    data_yaml.write_text("datasets:\n" + _source(world, tmp_path, [GOOD]).split("\n", 1)[1])
    (tmp_path / "file").write_text("x")
    out = {"missing folder under a file": tmp_path / "file" / "new" / "s.jsonl",
           "unwritable": _unwritable(tmp_path) / "s.jsonl", "a folder": tmp_path}[where]
    assert main(["sample", str(data_yaml), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and str(out) in err and "Traceback" not in err, err


def test_checkpoint_arguments(world, tmp_path, capsys):
    config = _config(world, tmp_path)
    bad = tmp_path / "ckpt"
    bad.mkdir()
    (bad / "config.json").write_bytes(b"\xff{}")
    for argv in (["eval", str(tmp_path / "none"), "--config", str(config)],
                 ["export", str(bad), "--config", str(config)],
                 ["train", "grpo", "--config", str(config), "--model", str(tmp_path / "none")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert ("no such folder" in err or "not UTF-8" in err) and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "out" / "data").exists(), "refused before sampling anything"


def test_long_values_are_cut(world, tmp_path, capsys):
    err = _fails(capsys, tmp_path, _config(world, tmp_path), f"eval.batch_size={'x' * 5000}")
    line = next(line for line in err.splitlines() if "eval.batch_size =" in line)
    # the value at most ~200 characters, in the override too
    assert "..." in line and line.count("x") < 450, line


@pytest.mark.slow
def test_pipeline_stopped_by_bad_input_logs_no_traceback(world, tmp_path, prefect_home):
    """`vlmexp run`: the flow's tasks fail on bad data; Prefect's log shows the problems, not a traceback."""
    import subprocess

    source = _source(world, tmp_path,
                     raw=json.dumps(GOOD) + "\n" + json.dumps(GOOD).replace("[2, 2", "[NaN, 2") + "\n")
    config = _config(world, tmp_path, source)
    r = subprocess.run([sys.executable, "-m", "vlmexp.cli", "run", str(config), "pipeline.retries=0"],
                       capture_output=True, text=True, cwd=tmp_path, check=False)
    output = r.stdout + r.stderr
    assert r.returncode == 2, output
    assert "d.jsonl:2" in output and "not a finite number" in output and "Traceback" not in output, output
