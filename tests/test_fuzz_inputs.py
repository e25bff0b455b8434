"""Property-based (hypothesis): generated and mutated configs, data YAMLs, records and image bytes fed to
the loaders. The only outcomes allowed are a valid result or the project's error (VlmexpError: ConfigError
or DataError), never another exception; on error nothing is written.

Fixed budget, reproducible in CI: derandomized, no example database, a bounded number of examples each
(about 20-40 s in all on the 2-core CI machine). Record files are fuzzed as raw bytes (not UTF-8 too), as
.jsonl, .json and parquet with embedded images; the inputs that once escaped the readers stay pinned in
`test_reader_cases_that_once_escaped`.
"""

from __future__ import annotations

import io
import json
import math
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlmexp.checks.loader import load_config
from vlmexp.config.schema import Config, DataSource
from vlmexp.errors import VlmexpError

BUDGET = settings(max_examples=80, deadline=None, derandomize=True, database=None, print_blob=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# --- generators ---------------------------------------------------------------------------------------

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
                    st.sampled_from(["1e-6", "nan", "inf", "no", "tiny:qwen2_5_vl", "random:10%",
                                     "json:dumps", "nosuch:fn", "", "first:0"]))
values = st.recursive(scalars,
                      lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                  max_size=4), max_leaves=12)
BASE_CONFIG = {"run": {"name": "fuzz", "seed": 1}, "model": {"path": "tiny:qwen2_5_vl"},
               "tracking": {"backend": "none"}, "data": {"demo": {"train": 4, "val": 2}},
               "sft": {"args": {"max_steps": 1, "learning_rate": 1e-4}},
               "grpo": {"rewards": [{"name": "format", "weight": 0.5}, {"name": "iou"}],
                        "args": {"beta": 0.0}},
               "eval": {"batch_size": 2}}
KEYS = ["run", "model", "data", "sft", "grpo", "eval", "tracking", "launch", "pipeline", "name", "seed",
        "path", "args", "rewards", "weight", "kwargs", "demo", "datasets", "json_path", "sampling_strategy",
        "learning_rate", "batch_size", "output_dir", "peft", "r", "dropout", "temperature", "max_pixels"]


@st.composite
def mutated_tree(draw, base):
    """`base` with a few leaves replaced, keys removed or added, anywhere in the tree."""
    tree = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(0, 4))):
        node = tree
        while isinstance(node, (dict, list)) and node and draw(st.booleans()):
            key = draw(st.sampled_from(list(node) if isinstance(node, dict) else list(range(len(node)))))
            if not isinstance(node[key], (dict, list)):
                break
            node = node[key]
        if isinstance(node, dict):
            action = draw(st.sampled_from(["set", "delete", "add"]))
            if action == "delete" and node:
                del node[draw(st.sampled_from(list(node)))]
            elif action == "set" and node:
                node[draw(st.sampled_from(list(node)))] = draw(values)
            else:
                node[draw(st.sampled_from(KEYS))] = draw(values)
        elif isinstance(node, list) and node:
            node[draw(st.integers(0, len(node) - 1))] = draw(values)
    return tree


@st.composite
def mutated_bytes(draw, data: bytes):
    """`data` with bytes flipped, inserted, deleted or the tail cut off."""
    out = bytearray(data)
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        i = draw(st.integers(0, max(0, len(out) - 1)))
        if kind == "flip" and out:
            out[i] = draw(st.integers(0, 255))
        elif kind == "insert":
            out[i:i] = draw(st.sampled_from([b"\x00", b"\xff", b"&a ", b"*a", b"\n  ", b": ", b"[", b"- ",
                                             b"\xe9", b"!!python/name:os.system ", b"NaN", b"Infinity", b'"',
                                             b"{"]))
        elif kind == "delete" and out:
            del out[i]
        elif kind == "truncate":
            del out[i:]
    return bytes(out)


def yaml_documents(base):
    as_text = mutated_tree(base).map(lambda tree: yaml.safe_dump(tree, sort_keys=False).encode())
    return st.one_of(as_text, as_text.flatmap(mutated_bytes))


def _written(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*")}


# --- configs ------------------------------------------------------------------------------------------

@settings(BUDGET, max_examples=40)  # each example builds TRL's config classes (~0.2 s)
@given(document=yaml_documents(BASE_CONFIG), overrides=st.lists(st.builds(
    lambda k, v: f"{k}={v}", st.sampled_from(["run.seed", "eval.batch_size", "grpo.args.beta", "sft.args.lr",
                                              "x.y", "grpo.rewards.0.weight", "data.demo.train"]),
    st.sampled_from(["1", "-1", ".nan", "nan", "[1, 2", "&a [*a]", "{a: 1, a: 2}", "yes", "1e9", "x" * 300])),
    max_size=2))
def test_config_loader_gives_a_config_or_the_projects_error(document, overrides):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path = folder / "c.yaml"
        path.write_bytes(document)
        before = _written(folder)
        try:
            cfg = load_config(path, overrides, check_paths=True)
        except VlmexpError as e:
            assert e.problems and all(len(str(p)) < 2500 for p in e.problems)
        else:
            assert isinstance(cfg, Config)
            for weight in (r.weight for r in cfg.grpo.rewards):
                assert math.isfinite(weight)
        assert _written(folder) == before, "loading a config writes nothing"


# --- data YAMLs ---------------------------------------------------------------------------------------

BASE_DATA_YAML = {"datasets": [{"json_path": "a.jsonl", "sampling_strategy": "random:50%",
                                "image_root": "img", "task": "rec"},
                               {"json_path": "b.json", "sampling_strategy": "first:2"}]}


@BUDGET
@given(document=yaml_documents(BASE_DATA_YAML))
def test_data_yaml_loader_gives_sources_or_the_projects_error(document):
    from vlmexp.data.sources import load_data_yaml

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "d.yaml"
        path.write_bytes(document)
        try:
            sources = load_data_yaml(path)
        except VlmexpError as e:
            assert e.problems
        else:
            assert sources and all(isinstance(s, DataSource) for s in sources)


# --- records and images, through sample_sources -----------------------------------------------------------

def _png(size=(32, 24)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, "blue").save(buf, "PNG")
    return buf.getvalue()


GOOD_RECORD = {"image": "a.png", "problem": "the blue square", "solution": [2, 2, 20, 20]}
records = st.lists(mutated_tree(GOOD_RECORD), min_size=1, max_size=4)


def _record_bytes(rows, suffix: str) -> bytes:
    if suffix == ".json":
        return json.dumps(rows).encode()
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _sample(folder: Path, record_file: bytes, suffix: str, image: bytes, strategy: str = "all"):
    from vlmexp.data.sampling import sample_sources

    (folder / f"r{suffix}").write_bytes(record_file)
    (folder / "a.png").write_bytes(image)
    out = folder / "out" / "s.jsonl"
    src = DataSource(json_path=str(folder / f"r{suffix}"), image_root=str(folder), sampling_strategy=strategy)
    try:
        result = sample_sources([src], out, seed=3)
    except VlmexpError as e:
        assert e.problems and all(len(str(p)) < 2500 for p in e.problems)
        assert (not (folder / "out").exists()
                or not any((folder / "out").iterdir())), "nothing written on error"
        return None
    assert out.is_file() and result.rows == len(out.read_text().splitlines())
    for line in out.read_text().splitlines():
        row = json.loads(line)
        if row["task"] == "rec":
            assert all(math.isfinite(float(v))
                       for v in (row["solution"] if isinstance(row["solution"], list) else []))
    return result


@BUDGET
@given(rows=records, suffix=st.sampled_from([".jsonl", ".json"]),
       strategy=st.sampled_from(["all", "first:1", "random:50%", "end:9"]))
def test_sampling_generated_records(rows, suffix, strategy):
    with tempfile.TemporaryDirectory() as tmp:
        _sample(Path(tmp), _record_bytes(rows, suffix), suffix, _png(), strategy)


@BUDGET
@given(data=st.data())
def test_sampling_mutated_record_bytes(data):
    suffix = data.draw(st.sampled_from([".jsonl", ".json"]))
    raw = data.draw(mutated_bytes(_record_bytes([GOOD_RECORD, GOOD_RECORD], suffix)))
    with tempfile.TemporaryDirectory() as tmp:
        _sample(Path(tmp), raw, suffix, _png())


def _png_claiming(width: int, height: int) -> bytes:
    """A valid small PNG whose header says width x height (CRC fixed up): what a lying header looks like."""
    import struct
    import zlib

    data = bytearray(_png())
    ihdr = data[12:29]  # b"IHDR" + 13 bytes
    ihdr[4:12] = struct.pack(">II", width, height)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)) & 0xFFFFFFFF)
    return bytes(data)


@BUDGET
@given(image=st.one_of(st.just(_png()).flatmap(mutated_bytes), st.binary(max_size=64),
                       # headers that lie about the size, up to past PIL's decompression-bomb limit
                       st.builds(lambda w, h: _png_claiming(w, h), st.integers(0, 200000),
                                 st.integers(0, 200000))))
def test_sampling_mutated_image_bytes(image):
    with tempfile.TemporaryDirectory() as tmp:
        _sample(Path(tmp), _record_bytes([GOOD_RECORD], ".jsonl"), ".jsonl", image)


@BUDGET
@given(image=st.one_of(st.just(_png()).flatmap(mutated_bytes), st.binary(max_size=64),
                       st.builds(lambda w, h: _png_claiming(w, h), st.integers(0, 200000),
                                 st.integers(0, 200000))))
def test_sampling_mutated_embedded_images(image):
    """A parquet record whose image is embedded as a {bytes, path} struct, as datasets stores an Image."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist([{**GOOD_RECORD, "image": {"bytes": image, "path": None}}]), buf)
    with tempfile.TemporaryDirectory() as tmp:
        _sample(Path(tmp), buf.getvalue(), ".parquet", _png())


@pytest.mark.parametrize("record_file, image", [
    pytest.param(b'{"image": "a.png", "problem": "caf\xe9", "solution": [2, 2, 20, 20]}\n', None,
                 id="record file not UTF-8"),
    pytest.param(None, _png_claiming(100000, 100000), id="PNG header claiming 100000x100000"),
])
def test_reader_cases_that_once_escaped(record_file, image):
    with tempfile.TemporaryDirectory() as tmp:
        _sample(Path(tmp), record_file or _record_bytes([GOOD_RECORD], ".jsonl"), ".jsonl", image or _png())
