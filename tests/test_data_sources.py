"""Data as the field publishes it, built here in the exact layouts: geometry3k as parquet shards with embedded
images and as save_to_disk, a Hub id served from a Hugging Face cache filled by the real parquet builder,
a RefCOCO-style set with one `image` column, column mapping, and sampling that does not depend on where the
data lives."""

from __future__ import annotations

import io
import json
import shutil
import struct
import zlib
from pathlib import Path

import pytest
from conftest import SMALL_BATCHES, make_png, write_jsonl

from vlmexp.config.schema import DataSource
from vlmexp.data.sampling import sample_sources
from vlmexp.errors import DataError

REPO = Path(__file__).resolve().parents[1]
SIZES = [(64, 48), (80, 60), (96, 40), (48, 48)]


def png_bytes(size, color="red") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def geometry3k_rows(n: int, offset: int = 0) -> dict:
    """hiyouga/geometry3k's columns: images (list of Image), problem with <image>, answer, id, choices,
    ground_truth."""
    return {"images": [[{"bytes": png_bytes(SIZES[i % 4], ("red", "blue", "green")[i % 3]), "path": None}]
                       for i in range(offset, offset + n)],
            "problem": [f"<image>Find x. Angle {i} is given." for i in range(offset, offset + n)],
            "answer": [str(i + 2) for i in range(offset, offset + n)],
            "id": [str(i) for i in range(offset, offset + n)],
            "choices": [["1", "2", "3", "4"] for _ in range(n)],
            "ground_truth": ["B" for _ in range(n)]}


def geometry3k_dataset(n: int, offset: int = 0):
    from datasets import Dataset, Features, Image, List, Value

    features = Features({"images": List(Image()), "problem": Value("string"), "answer": Value("string"),
                         "id": Value("string"), "choices": List(Value("string")),
                         "ground_truth": Value("string")})
    return Dataset.from_dict(geometry3k_rows(n, offset), features=features)


@pytest.fixture(scope="module")
def geometry3k(tmp_path_factory) -> Path:
    """The Hub repository's layout: data/{train,validation,test}-00000-of-00001.parquet."""
    root = tmp_path_factory.mktemp("geometry3k")
    for split, n, offset in (("train", 12, 0), ("validation", 4, 100), ("test", 6, 200)):
        geometry3k_dataset(n, offset).to_parquet(root / "data" / f"{split}-00000-of-00001.parquet")
    return root


def _records(result):
    from vlmexp.data.record import read_sampled

    return read_sampled(result.path)


def test_geometry3k_parquet_shards_with_embedded_images(geometry3k, tmp_path):
    src = DataSource(json_path=str(geometry3k / "data" / "train-*.parquet"), sampling_strategy="random:5")
    result = sample_sources([src], tmp_path / "out" / "train.jsonl", seed=1)
    records = _records(result)
    assert len(records) == 5 and all(r.record_format == "easyr1" and r.task == "math" for r in records)
    text = result.path.read_text()
    assert "bytes" not in text and len(text) < 5000  # paths, not PNG byte strings
    for r in records:
        [path] = r.images
        stored = Path(path)
        assert stored.parent.parent == tmp_path / "out" / "images" and stored.suffix == ".png"
        import hashlib

        assert stored.name == hashlib.sha256(stored.read_bytes()).hexdigest() + ".png"  # content-addressed
        assert r.image_refs == [str(stored.relative_to(tmp_path / "out"))]
        assert not r.problem.startswith("<image>") and r.problem.startswith("Find")  # the tag is dropped
        assert tuple(r.image_sizes[0]) in SIZES
    manifest = json.loads(result.manifest_path.read_text())
    [source] = manifest["sources"]
    assert source["kind"] == "shards" and source["rows_read"] == 12 and source["embedded_images"] == 5
    assert len(source["sha256"]) == 64

    # re-sampling the same data writes nothing new, and the content hash is stable
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "out" / "images").rglob("*.png")}
    again = sample_sources([src], tmp_path / "out" / "train.jsonl", seed=1)
    assert again.images_written == [] and again.content_sha256 == result.content_sha256
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "out" / "images").rglob("*.png")} == before


def test_a_folder_of_shards_takes_a_split_and_parquet_file_and_arrow_read_alike(geometry3k, tmp_path):
    by_split = sample_sources([DataSource(json_path=f"{geometry3k}@test")], tmp_path / "a" / "t.jsonl", 0)
    assert by_split.rows == 6 and {r.id for r in _records(by_split)} == {str(i) for i in range(200, 206)}
    one_file = DataSource(json_path=str(geometry3k / "data" / "test-00000-of-00001.parquet"))
    assert sample_sources([one_file], tmp_path / "b" / "t.jsonl", 0).content_sha256 == by_split.content_sha256
    arrow = tmp_path / "test.arrow"
    ds = geometry3k_dataset(6, 200)
    ds.save_to_disk(tmp_path / "tmp_saved")
    shutil.copy(next((tmp_path / "tmp_saved").glob("*.arrow")), arrow)
    from_arrow = sample_sources([DataSource(json_path=str(arrow))], tmp_path / "c" / "t.jsonl", 0)
    assert [r.id for r in _records(from_arrow)] == [r.id for r in _records(by_split)]


def test_save_to_disk_folders_dataset_and_dataset_dict(tmp_path):
    from datasets import DatasetDict

    geometry3k_dataset(8).save_to_disk(tmp_path / "saved")
    DatasetDict({"train": geometry3k_dataset(8),
                 "test": geometry3k_dataset(3, 50)}).save_to_disk(tmp_path / "dict")
    result = sample_sources([DataSource(json_path=str(tmp_path / "saved"), sampling_strategy="first:3"),
                             DataSource(json_path=f"{tmp_path / 'dict'}@test")],
                            tmp_path / "out" / "t.jsonl", 0)
    assert [r.id for r in _records(result)] == ["0", "1", "2", "50", "51", "52"]
    manifest = json.loads(result.manifest_path.read_text())
    assert all(s["kind"] == "saved" and s["fingerprint"] for s in manifest["sources"])
    with pytest.raises(DataError, match=r"name a split, one of \['test', 'train'\]"):
        sample_sources([DataSource(json_path=str(tmp_path / "dict"))], tmp_path / "bad" / "t.jsonl", 0)
    assert not (tmp_path / "bad").exists()


@pytest.fixture()
def hf_cache(tmp_path, monkeypatch, geometry3k) -> Path:
    """A Hugging Face datasets cache holding hiyouga/geometry3k as an online `load_dataset` leaves it: the
    real Parquet builder prepares the Hub's files under the commit hash, in the repository's cache folder."""
    import datasets
    from datasets.packaged_modules.parquet.parquet import Parquet

    cache = tmp_path / "hf" / "datasets"
    commit = "c0ffee" + "0" * 34
    files = {s: [str(geometry3k / "data" / f"{s}-00000-of-00001.parquet")]
             for s in ("train", "validation", "test")}
    builder = Parquet(cache_dir=str(cache), dataset_name="geometry3k", hash=commit, data_files=files)
    builder.download_and_prepare()
    # where a load of the repository puts it: the namespaced folder, config "default" (a Hub load declares
    # the repository's data files as the config's own, so its id carries no data_files hash)
    [config_dir] = (cache / "geometry3k").iterdir()
    config_dir.rename(cache / "geometry3k" / "default")
    (cache / "geometry3k").rename(cache / "hiyouga___geometry3k")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_hub_id_with_split_loads_from_the_local_cache_offline(hf_cache, tmp_path):
    train = DataSource(json_path="hiyouga/geometry3k@train", sampling_strategy="first:4")
    local = write_jsonl(tmp_path / "local.jsonl", [{"problem": "2+2?", "answer": "4",
                                                    "images": [str(make_png(tmp_path / "im.png"))]}])
    result = sample_sources([train, DataSource(json_path=str(local))], tmp_path / "out" / "train.jsonl",
                            seed=3)
    records = _records(result)
    assert [r.id for r in records[:4]] == ["0", "1", "2", "3"] and records[4].solution == "4"
    hub = json.loads(result.manifest_path.read_text())["sources"][0]
    assert hub["kind"] == "hub" and hub["revision"] == "c0ffee" + "0" * 34 and hub["fingerprint"]
    assert hub["json_path"] == "hiyouga/geometry3k@train" and hub["rows_read"] == 12

    missing = DataSource(json_path="nobody/nothing@train")
    with pytest.raises(DataError) as e:
        sample_sources([missing], tmp_path / "none" / "train.jsonl", seed=3)
    message = str(e.value)
    assert "'nobody/nothing'" in message and str(hf_cache) in message and "network access" in message
    assert not (tmp_path / "none").exists()


def test_refcoco_style_image_column_and_column_mapping(tmp_path):
    from datasets import Dataset, Features, Image, List, Value

    rows = {"image": [{"bytes": png_bytes(s), "path": f"COCO_{i}.jpg"} for i, s in enumerate(SIZES)],
            "problem": ["the red thing"] * 4, "solution": [[2.0, 3.0, 20.0, 30.0]] * 4}
    features = Features({"image": Image(), "problem": Value("string"), "solution": List(Value("float32"))})
    Dataset.from_dict(rows, features=features).to_parquet(tmp_path / "refcoco.parquet")
    result = sample_sources([DataSource(json_path=str(tmp_path / "refcoco.parquet"))],
                            tmp_path / "a" / "t.jsonl", 0)
    records = _records(result)
    assert [r.task for r in records] == ["rec"] * 4 and records[0].solution == [2, 3, 20, 30]
    assert all(r.image_refs[0].startswith("images/") for r in records)

    renamed = {"question": [f"q{i}" for i in range(4)], "solution": [str(i) for i in range(4)],
               "picture": rows["image"]}
    Dataset.from_dict(renamed, features=Features({"question": Value("string"), "solution": Value("string"),
                                                 "picture": Image()})).to_parquet(tmp_path / "qa.parquet")
    mapped = DataSource(json_path=str(tmp_path / "qa.parquet"), task="exact",
                        columns={"problem": "question", "answer": "solution", "images": "picture"})
    records = _records(sample_sources([mapped], tmp_path / "b" / "t.jsonl", 0))
    assert [(r.problem, r.solution, r.record_format) for r in records][1] == ("q1", "1", "easyr1")

    wrong = DataSource(json_path=str(tmp_path / "qa.parquet"),
                       columns={"problem": "prompt", "images": "picture"})
    with pytest.raises(DataError) as e:
        sample_sources([wrong], tmp_path / "c" / "t.jsonl", 0)
    assert "['prompt']" in str(e.value) and "'question'" in str(e.value) and "columns" in str(e.value)


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels, with no pixel data behind it (a lying header)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))


def test_every_image_check_applies_to_embedded_images_and_values_stay_short(tmp_path):
    good = png_bytes((32, 32))
    bad = {"truncated": good[: len(good) // 2], "tiny": png_bytes((2, 2)), "aspect": png_bytes((1000, 4)),
           "bomb": _png_claiming(100000, 100000), "noise": b"\x00not an image" * 20000}
    rows = [{"problem": f"p {k}", "answer": "1", "images": [{"bytes": v, "path": None}]}
            for k, v in bad.items()]
    raw = [{"problem": "p", "answer": "1", "images": [b"\x89PNG" * 100000]}]  # raw bytes, broken
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    pq.write_table(pa.Table.from_pylist(raw), tmp_path / "raw.parquet")
    out = tmp_path / "out" / "t.jsonl"
    with pytest.raises(DataError) as e:
        sample_sources([DataSource(json_path=str(tmp_path / "bad.parquet")),
                        DataSource(json_path=str(tmp_path / "raw.parquet"))], out, 0)
    problems = {p.where: p.message for p in e.value.problems}
    assert len(problems) == 6
    assert "unreadable" in problems[f"{tmp_path / 'bad.parquet'}[0]"]
    assert "below 4x4" in problems[f"{tmp_path / 'bad.parquet'}[1]"]
    assert "aspect ratio" in problems[f"{tmp_path / 'bad.parquet'}[2]"]
    assert "decompression bomb" in problems[f"{tmp_path / 'bad.parquet'}[3]"]
    assert "<400000 bytes>" in problems[f"{tmp_path / 'raw.parquet'}[0]"]
    assert max(len(str(p)) for p in e.value.problems) < 400  # no byte strings in messages
    assert not out.parent.exists() or not any(out.parent.rglob("*.*"))  # nothing written, no image left

    # a bytes value in a field that must hold images is described, never printed
    write_jsonl(tmp_path / "b.jsonl", [{"problem": "p", "answer": "1", "images": [123]}])
    with pytest.raises(DataError, match="got int 123"):
        sample_sources([DataSource(json_path=str(tmp_path / "b.jsonl"))], out, 0)


def test_a_lying_png_file_and_non_utf8_lines_are_problems_naming_the_record(tmp_path):
    (tmp_path / "bomb.png").write_bytes(_png_claiming(100000, 100000))
    make_png(tmp_path / "ok.png")
    lines = [json.dumps({"image": "bomb.png", "problem": "x", "solution": [1, 1, 5, 5]}).encode(),
             b'{"image": "ok.png", "problem": "caf\xe9", "solution": [1, 1, 5, 5]}',
             json.dumps({"image": "ok.png", "problem": "x", "solution": [1, 1, 5, 5]}).encode()]
    (tmp_path / "d.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DataError) as e:
        sample_sources([DataSource(json_path=str(tmp_path / "d.jsonl"))], tmp_path / "out" / "t.jsonl", 0)
    where = {p.where: p.message for p in e.value.problems}
    assert "decompression bomb" in where[f"{tmp_path / 'd.jsonl'}:1"]
    assert "not UTF-8" in where[f"{tmp_path / 'd.jsonl'}:2"] and len(where) == 2


def test_the_rows_a_seed_picks_do_not_depend_on_where_the_data_lives(tmp_path, monkeypatch):
    """The same config and data in two folders (a moved checkout): same rows, same data hash, same stage
    key."""
    from vlmexp.checks.loader import load_config
    from vlmexp.data.run_data import prepare_data
    from vlmexp.pipeline.keys import stage_key

    rows = [{"image": "im.png", "problem": f"thing {i}", "solution": [1, 1, 5, 5]} for i in range(50)]
    picks, hashes, keys = [], [], []
    for folder in ("one", "two/deeper"):
        write_jsonl(tmp_path / folder / "data" / "d.jsonl", rows)
        make_png(tmp_path / folder / "data" / "im.png")
        (tmp_path / folder / "data.yaml").write_text(
            "datasets:\n  - {json_path: data/d.jsonl, sampling_strategy: 'random:5'}\n")
        monkeypatch.chdir(tmp_path / folder)
        cfg = load_config(REPO / "configs/demo.yaml", ["run.output_dir=run", "run.seed=1", "data.demo=null",
                                                       "data.data_yaml=data.yaml", "data.val_fraction=0.2"])
        prepared = prepare_data(cfg)
        lines = prepared.train.read_text().splitlines() + prepared.val.read_text().splitlines()
        picks.append(sorted(json.loads(line)["source_row"] for line in lines))
        hashes.append(prepared.content_sha256)
        keys.append(stage_key(cfg, "sft", prepared.content_sha256))
    assert keys[0] == keys[1]  # moving the checkout and its data retrains nothing
    assert picks[0] == picks[1] and len(picks[0]) == 5
    assert hashes[0] == hashes[1]  # the stage cache keys see the same data hash
    # another source beside it changes none of its rows
    write_jsonl(tmp_path / "one" / "data" / "other.jsonl", rows[:10])
    d = str(tmp_path / "one" / "data" / "d.jsonl")
    both = sample_sources([DataSource(json_path=str(tmp_path / "one" / "data" / "other.jsonl"),
                                      sampling_strategy="random:3"),
                           DataSource(json_path=d, sampling_strategy="random:5")],
                          tmp_path / "mix" / "t.jsonl", seed=1)
    assert sorted(r.source_row for r in _records(both)[3:]) == sorted(
        r.source_row for r in _records(sample_sources([DataSource(json_path=d, sampling_strategy="random:5")],
                                                         tmp_path / "alone" / "t.jsonl", seed=1)))


def test_easyr1_format_reward_style():
    from vlmexp.rewards_loader import build_reward

    boxed = build_reward("format", {"style": "boxed"}, "pixels", None)
    tags = build_reward("format", {}, "pixels", None)
    easyr1 = "<think>The angles sum to 180.</think> So x is \\boxed{42}."
    assert boxed(completions=[easyr1, "<think>a</think><answer>42</answer>"]) == [1.0, 0.0]
    assert tags(completions=[easyr1, "<think>a</think><answer>42</answer>"]) == [0.0, 1.0]
    with pytest.raises(ValueError, match="style 'latex'"):
        build_reward("format", {"style": "latex"}, "pixels", None)


@pytest.mark.slow
def test_one_grpo_step_from_parquet_with_embedded_images(geometry3k, tmp_path):
    """The embedded model trains a GRPO step on geometry3k-layout data (images of four sizes, one per
    prompt)."""
    from vlmexp.checks.loader import load_config
    from vlmexp.train.grpo import run_grpo

    data = tmp_path / "data.yaml"
    data.write_text(f"datasets:\n  - {{json_path: '{geometry3k}/data/train-*.parquet', "
                    "sampling_strategy: 'first:4'}\n")
    cfg = load_config(REPO / "configs/demo.yaml", [
        f"run.output_dir={tmp_path / 'run'}", "tracking.backend=none", "data.demo=null",
        f"data.data_yaml={data}", "sft.enabled=false", *SMALL_BATCHES, "grpo.args.max_steps=1",
        "grpo.args.save_steps=1", "grpo.args.gradient_accumulation_steps=1",
        "grpo.args.per_device_train_batch_size=4", "grpo.args.num_generations=4",
        "grpo.args.max_completion_length=8", "grpo.args.logging_steps=1",
        "grpo.rewards=[{name: format, kwargs: {style: boxed}}, {name: math}]"])
    final = run_grpo(cfg)
    assert (final / "model.safetensors").is_file()
    state = json.loads(next((tmp_path / "run" / "grpo").glob("checkpoint-*/trainer_state.json")).read_text())
    assert state["global_step"] == 1 and any("rewards/math/mean" in h for h in state["log_history"])


def test_validate_accepts_every_source_kind_and_names_a_glob_that_matches_nothing(geometry3k, tmp_path):
    from vlmexp.checks.loader import load_config
    from vlmexp.errors import ConfigError

    body = ("model:\n  path: Qwen/Qwen2.5-VL-3B-Instruct\ndata:\n  datasets:\n"
            "    - {json_path: hiyouga/geometry3k@train}\n"
            f"    - {{json_path: '{geometry3k}/data/train-*.parquet'}}\n"
            f"    - {{json_path: '{geometry3k}@test'}}\n")
    (tmp_path / "ok.yaml").write_text(body)
    load_config(tmp_path / "ok.yaml", check_paths=True)
    (tmp_path / "bad.yaml").write_text(body + f"    - {{json_path: '{geometry3k}/data/tran-*.parquet'}}\n")
    with pytest.raises(ConfigError, match=r"data\.datasets\.3\.json_path.*no file matches this glob"):
        load_config(tmp_path / "bad.yaml", check_paths=True)


@pytest.mark.slow
def test_data_sampling_benchmark_runs_at_a_small_size(tmp_path):
    """bench/data_sampling.py (the figures in bench/RESULTS.md) at 300 records: every case samples, in its own
    process."""
    import subprocess
    import sys

    out = tmp_path / "r.json"
    subprocess.run([sys.executable, str(REPO / "bench" / "data_sampling.py"), "--records", "300",
                    "--embedded", "20", "--work", str(tmp_path / "w"), "--cases", "0,2,4", "--out", str(out)],
                   check=True, cwd=tmp_path)
    cases = json.loads(out.read_text())["cases"]
    assert [c["rows"] for c in cases.values()] == [3, 3, 20]  # random:1% rounds up
    assert all(c["peak_rss_mib"] > 0 and c["wall_s"] > 0 for c in cases.values())
