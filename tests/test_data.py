"""Record formats, the sampler's output and manifest, and every bad data input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import VARIED_SCENES, make_png, write_json, write_jsonl

from vlmexp.config.schema import DataSource
from vlmexp.data.demo import demo_folder_name
from vlmexp.data.record import read_sampled
from vlmexp.data.sampling import sample_sources
from vlmexp.data.sources import load_data_yaml
from vlmexp.errors import DataError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def imgs(tmp_path) -> Path:
    root = tmp_path / "imgs"
    make_png(root / "a.png", (64, 48))
    make_png(root / "b.png", (80, 60), "blue")
    return root


def _sample(tmp_path, sources, seed=0):
    return sample_sources(sources, tmp_path / "out" / "s.jsonl", seed)


def _read(path):
    return read_sampled(path)


def test_rec_format_variants(tmp_path, imgs):
    src = write_json(tmp_path / "rec.json", [
        {"image": "a.png", "problem": "the red thing", "solution": [1, 2, 30, 40]},
        {"image": "b.png", "problem": "the blue thing", "solution": "[5, 6, 70, 50]"},
        {"image": "a.png", "problem": "again", "solution": "<answer>[0, 0, 10, 10]</answer>", "extra": 1},
    ])
    res = _sample(tmp_path, [DataSource(json_path=str(src), image_root=str(imgs))])
    rows = _read(res.path)
    assert [r.task for r in rows] == ["rec"] * 3 and [r.method for r in rows] == ["iou"] * 3
    assert rows[0].images == [str(imgs / "a.png")] and rows[0].image_sizes == [[64, 48]]
    assert rows[0].image_refs == ["a.png"] and rows[0].id is None and rows[0].target is None
    # every spelling: a box
    assert [r.solution for r in rows] == [[1, 2, 30, 40], [5, 6, 70, 50], [0, 0, 10, 10]]
    assert rows[0].source == str(src) and rows[0].record_format == "rec" and rows[2].source_row == 2
    line = json.loads(res.path.read_text().splitlines()[2])
    # the source's other fields
    assert line["extra"] == {"extra": 1} and line["schema"] == 3 and rows[0].extra == {}


def test_conversations_format_multi_image(tmp_path, imgs):
    src = write_jsonl(tmp_path / "conv.jsonl", [
        {"id": 1, "image": ["a.png", "b.png"], "conversations": [
            {"from": "human", "value": "<image><image>Which is red? A or B"}, {"from": "gpt", "value": "A"}]},
        {"id": 2, "image": "b.png", "accu_reward_method": "math", "conversations": [
            {"from": "human", "value": "<image>2+2?"}, {"from": "gpt", "value": "4"}]},
    ])
    rows = _read(_sample(tmp_path, [DataSource(json_path=str(src), image_root=str(imgs))]).path)
    assert len(rows[0].images) == 2 and rows[0].task == "exact" and rows[0].problem == "Which is red? A or B"
    assert rows[0].solution == rows[0].target == "A" and rows[0].id == "1"
    assert rows[1].task == "math" and rows[1].method == "math"


def test_easyr1_format_parquet_and_relative_paths(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    make_png(tmp_path / "geo" / "images" / "1.png")
    table = pa.Table.from_pylist([{"problem": "<image>Find x.", "answer": "30",
                                   "images": ["images/1.png"]}] * 4)
    pq.write_table(table, tmp_path / "geo" / "train.parquet")
    res = _sample(tmp_path, [DataSource(json_path=str(tmp_path / "geo" / "train.parquet"),
                                        sampling_strategy="first:50%")])
    rows = _read(res.path)
    assert (len(rows) == 2 and rows[0].task == "math" and rows[0].problem == "Find x."
            and rows[0].target is None)
    assert rows[0].images == [str((tmp_path / "geo" / "images" / "1.png").resolve())]


def test_data_yaml_mixture_manifest_and_seed(tmp_path, imgs):
    write_json(tmp_path / "d" / "a.json",
               [{"image": "a.png", "problem": f"p{i}", "solution": [0, 0, 10, 10]} for i in range(40)])
    write_jsonl(tmp_path / "d" / "b.jsonl",
                [{"image": "b.png", "problem": f"q{i}", "solution": [0, 0, 10, 10]} for i in range(30)])
    data_yaml = tmp_path / "d" / "mix.yaml"
    data_yaml.write_text(yaml.safe_dump({"datasets": [
        {"json_path": "a.json", "sampling_strategy": "random:10", "image_root": str(imgs)},
        {"json_path": "b.jsonl", "sampling_strategy": "end:20%", "image_root": str(imgs)},
    ]}))
    sources = load_data_yaml(data_yaml)
    res = sample_sources(sources, tmp_path / "o1.jsonl", seed=3)
    assert res.rows == 16
    manifest = json.loads(res.manifest_path.read_text())
    assert res.manifest_path.name == "o1.manifest.json" and manifest["seed"] == 3
    assert [(s["rows_read"], s["rows_kept"]) for s in manifest["sources"]] == [(40, 10), (30, 6)]
    assert all(len(s["sha256"]) == 64 for s in manifest["sources"])
    again = sample_sources(sources, tmp_path / "o2.jsonl", seed=3)
    other = sample_sources(sources, tmp_path / "o3.jsonl", seed=4)

    def problems(r):
        return [x.problem for x in _read(r.path)]

    assert problems(res) == problems(again) and problems(res) != problems(other)
    assert problems(res)[-6:] == [f"q{i}" for i in range(24, 30)]


def _bad(tmp_path, rows, name="bad.jsonl", **src):
    path = write_jsonl(tmp_path / name, rows) if name.endswith(".jsonl") else tmp_path / name
    with pytest.raises(DataError) as e:
        _sample(tmp_path, [DataSource(json_path=str(path), **src)])
    assert not (tmp_path / "out" / "s.jsonl").exists(), "nothing may be written on error"
    return str(e.value)


def test_malformed_json_line_names_file_and_line(tmp_path):
    msg = _bad(tmp_path, [{"image": "a.png", "problem": "p", "solution": [0, 0, 1, 1]}, "{not json"])
    assert f"{tmp_path / 'bad.jsonl'}:2" in msg and "malformed JSON" in msg


def test_missing_and_empty_files(tmp_path):
    assert "file not found" in _bad(tmp_path, None, name="nope.json")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="empty"):
        _sample(tmp_path, [DataSource(json_path=str(tmp_path / "empty.jsonl"))])
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"unknown file format '.csv'"):
        _sample(tmp_path, [DataSource(json_path=str(tmp_path / "x.csv"))])


def test_unknown_record_format(tmp_path):
    msg = _bad(tmp_path, [{"img": "a.png", "question": "q"}])
    assert "unknown record format" in msg and "['img', 'question']" in msg


def test_missing_field(tmp_path, imgs):
    msg = _bad(tmp_path, [{"image": "a.png", "problem": "p", "solution": [0, 0, 5, 5]},
                          {"problem": "p", "solution": [0, 0, 5, 5]}], image_root=str(imgs))
    assert "bad.jsonl:2" in msg and "missing field 'image'" in msg


def test_count_above_rows_names_the_source(tmp_path, imgs):
    msg = _bad(tmp_path, [{"image": "a.png", "problem": "p", "solution": [0, 0, 5, 5]}],
               image_root=str(imgs), sampling_strategy="first:5")
    assert "bad.jsonl" in msg and "asks for 5 rows but the file has 1" in msg


def test_missing_truncated_and_non_image_files(tmp_path, imgs):
    good = (imgs / "a.png").read_bytes()
    (imgs / "trunc.png").write_bytes(good[: len(good) // 2])
    (imgs / "text.png").write_text("not an image")
    msg = _bad(tmp_path, [{"image": name, "problem": "p", "solution": [0, 0, 5, 5]}
                          for name in ("gone.png", "trunc.png", "text.png")], image_root=str(imgs))
    assert "image not found" in msg and "gone.png" in msg
    assert "trunc.png" in msg and "text.png" in msg and msg.count("unreadable image") == 2
    assert "bad.jsonl:1" in msg and "bad.jsonl:2" in msg and "bad.jsonl:3" in msg


def test_bad_images_shapes(tmp_path):
    make_png(tmp_path / "i" / "dot.png", (1, 1))
    make_png(tmp_path / "i" / "strip.png", (1000, 4))
    msg = _bad(tmp_path, [{"image": "dot.png", "problem": "p", "solution": [0, 0, 1, 1]},
                          {"image": "strip.png", "problem": "p", "solution": [0, 0, 1, 1]}],
               image_root=str(tmp_path / "i"))
    assert "1x1 pixels" in msg and "aspect ratio 250 exceeds 200" in msg


def test_bad_boxes(tmp_path, imgs):
    msg = _bad(tmp_path, [{"image": "a.png", "problem": "p", "solution": [30, 5, 10, 20]},
                          {"image": "a.png", "problem": "p", "solution": [0, 0, 65, 20]},
                          {"image": "a.png", "problem": "p", "solution": "no box here"}],
               image_root=str(imgs))
    assert "inverted or empty" in msg and "outside the 64x48 image" in msg and "holds no box" in msg


def test_image_tag_count_mismatch(tmp_path, imgs):
    msg = _bad(tmp_path, [{"image": ["a.png"], "conversations": [
        {"from": "human", "value": "<image><image>?"}, {"from": "gpt", "value": "A"}]}], image_root=str(imgs))
    assert "2 <image> tags but the record lists 1 images" in msg


def test_bad_data_yaml(tmp_path):
    p = tmp_path / "d.yaml"
    p.write_text("datasets:\n  - json_path: a.json\n    sampling_strategy: sometimes\n")
    with pytest.raises(DataError) as e:
        load_data_yaml(p)
    assert f"{p}:3" in str(e.value) and "unknown sampling strategy 'sometimes'" in str(e.value)
    p.write_text("sources: []\n")
    with pytest.raises(DataError, match="non-empty `datasets:` list"):
        load_data_yaml(p)


def test_sample_cli_prints_table_and_writes_manifest(tmp_path, demo_data):
    out = tmp_path / "s.jsonl"
    r = subprocess.run([sys.executable, "-m", "vlmexp.cli", "sample", str(demo_data / "train.yaml"), "--out",
                        str(out), "--seed", "5"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "train.json" in r.stdout and "total" in r.stdout and " 24" in r.stdout
    assert len(_read(out)) == 24 and json.loads((tmp_path / "s.manifest.json").read_text())["seed"] == 5
    bad = subprocess.run([sys.executable, "-m", "vlmexp.cli", "sample", str(tmp_path / "missing.yaml"),
                          "--out", str(tmp_path / "x.jsonl")], capture_output=True, text=True)
    assert bad.returncode == 2 and "missing.yaml" in bad.stderr and not (tmp_path / "x.jsonl").exists()


def test_demo_data_is_valid_rec_and_deterministic(tmp_path, demo_data):
    from vlmexp.data.demo import make_demo_data

    rows = json.loads((demo_data / "train.json").read_text())
    assert len(rows) == 24 and all(r["problem"].startswith("the ") for r in rows)
    again = make_demo_data(tmp_path / "again", train=24, val=8, seed=0, scenes=VARIED_SCENES)
    assert (again / "train.json").read_text() == (demo_data / "train.json").read_text()
    with pytest.raises(FileExistsError):
        make_demo_data(again, train=2, val=2)
    res = sample_sources(load_data_yaml(demo_data / "val.yaml"), tmp_path / "v.jsonl", 0)
    assert res.rows == 8


def test_demo_scenes_from_the_config_size_count_and_background(tmp_path):
    from PIL import Image

    from vlmexp.checks.loader import load_config
    from vlmexp.data.demo import COLORS
    from vlmexp.data.run_data import prepare_data
    from vlmexp.errors import ConfigError

    cfg = load_config(REPO / "configs/demo.yaml", [f"run.output_dir={tmp_path}", "data.demo.train=6",
                                                   "data.demo.val=2", "data.demo.width=[112,112]",
                                                   "data.demo.height=[96,96]", "data.demo.objects=[1,1]",
                                                   "data.demo.background=gradient"])
    rows = read_sampled(prepare_data(cfg).train)
    assert len(rows) == 6 and all(r.image_sizes == [[112, 96]] for r in rows)
    image = Image.open(rows[0].images[0]).convert("RGB")
    x1, y1, x2, y2 = map(int, rows[0].solution)
    # one shape; outside it the red shade rises with x and the green with y
    corners = [image.getpixel(p) for p in ((0, 0), (111, 0), (0, 95))]
    assert corners[1][0] > corners[0][0] + 90 and corners[2][1] > corners[0][1] + 90
    assert image.getpixel(((x1 + x2) // 2, (y1 + y2) // 2)) in COLORS.values()
    # a changed scene setting generates a new dataset instead of reusing the folder
    other = load_config(REPO / "configs/demo.yaml", [f"run.output_dir={tmp_path}", "data.demo.train=6",
                                                     "data.demo.val=2"])
    assert demo_folder_name(other.data.demo) != demo_folder_name(cfg.data.demo)
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs/demo.yaml", ["data.demo.width=[300,200]"])
    assert "data.demo" in str(err.value) and "[300, 200]" in str(err.value)


def test_demo_annotator_loosens_training_demonstrations_only(tmp_path):
    """SFT imitates the annotator's box; the exact box stays the solution the reward and evaluation score."""
    from PIL import Image

    from vlmexp.checks.loader import load_config
    from vlmexp.coords import iou
    from vlmexp.data.demo import Annotator, make_demo_data
    from vlmexp.data.run_data import prepare_data
    from vlmexp.families import get_family
    from vlmexp.processor import PixelBudget
    from vlmexp.prompts import target_text

    exact = make_demo_data(tmp_path / "exact", train=40, val=8, seed=3)
    loose = make_demo_data(tmp_path / "loose", train=40, val=8, seed=3,
                           annotator=Annotator(jitter=0.05, loose=0.25))
    plain, noisy = (json.loads((d / "train.json").read_text()) for d in (exact, loose))
    assert [r["solution"] for r in plain] == [r["solution"] for r in noisy]  # same images, same exact boxes
    assert (exact / "images/train_00007.png").read_bytes() == (loose / "images/train_00007.png").read_bytes()
    assert all("demonstration" not in r for r in plain)
    assert (loose / "val.json").read_text() == (exact / "val.json").read_text()  # held-out boxes stay exact
    for r in noisy:
        (x1, y1, x2, y2), (a1, b1, a2, b2) = r["demonstration"], r["solution"]
        assert x1 <= a1 and y1 <= b1 and x2 >= a2 and y2 >= b2  # 0.25 outward beats 0.05 of jitter
        width, height = Image.open(loose / r["image"]).size
        assert min(x1, y1) >= 0 and x2 <= width and y2 <= height
    mean = sum(iou(r["demonstration"], r["solution"]) for r in noisy) / len(noisy)
    assert 0.35 < mean < 0.6, mean

    cfg = load_config(REPO / "configs/demo.yaml", [f"run.output_dir={tmp_path / 'run'}", "data.demo.train=6",
                                                   "data.demo.val=2"])
    record = read_sampled(prepare_data(cfg).train)[0]
    budget = PixelBudget(patch_size=14, merge_size=2, min_pixels=3136, max_pixels=102400)
    # 112 x 112 stays 112 x 112: the frame is pixels
    text = target_text(record, get_family("qwen2_5_vl"), budget)
    shown = [int(v) for v in record.demonstration]
    assert record.demonstration != record.solution and text.endswith(f"<answer>{shown}</answer>")
    with pytest.raises(ValueError, match="annotator jitter and loose"):
        Annotator(jitter=1.5)
    from vlmexp.data.formats import parse_record

    with pytest.raises(ValueError, match="demonstration 'near the top' holds no box"):
        parse_record({**noisy[0], "demonstration": "near the top"}, "rec", None)


def test_sampled_file_of_the_old_layout_is_refused_naming_file_and_fix(tmp_path, imgs):
    """A file sampled before records had a schema (the source's raw fields plus record_format and image_paths)
    is refused by the one reader every stage uses, naming the file and the fix; `vlmexp eval --records`
    too."""
    from vlmexp.evaluate import check_sampled_records

    old = write_jsonl(tmp_path / "train.jsonl", [{
        "image": "a.png", "problem": "p", "solution": [1, 2, 30, 40], "record_format": "rec", "task": "rec",
        "image_paths": [str(imgs / "a.png")], "image_sizes": [[64, 48]], "source": "x.json",
        "source_row": 0}])
    for read in (read_sampled, check_sampled_records):
        with pytest.raises(DataError) as e:
            read(old)
        assert f"{old}:1" in str(e.value) and "run `vlmexp sample` again" in str(e.value)
    src = write_json(tmp_path / "rec.json", [{"image": "a.png", "problem": "p", "solution": [1, 2, 30, 40]}])
    good = _sample(tmp_path, [DataSource(json_path=str(src), image_root=str(imgs))]).path
    line = json.loads(good.read_text())
    write_jsonl(tmp_path / "edited.jsonl", [{**line, "solution_text": "x"}])
    with pytest.raises(DataError, match=r"unknown fields \['solution_text'\]"):
        read_sampled(tmp_path / "edited.jsonl")


def test_reward_columns_and_content_digest_are_one_function(tmp_path, imgs):
    """GRPO's dataset, DPO's sample scoring and evaluation all take `reward_columns`; the manifest's digest
    leaves absolute paths out, so the same data sampled in two folders has one digest."""
    from vlmexp.data.record import columns_of, content_sha256, reward_columns

    src = write_json(tmp_path / "rec.json", [{"image": "a.png", "problem": "p",
                                              "solution": "[1, 2, 30, 40]"}])
    res = _sample(tmp_path, [DataSource(json_path=str(src), image_root=str(imgs))])
    [record] = _read(res.path)
    assert reward_columns(record) == {"solution": "[1.0, 2.0, 30.0, 40.0]", "task": "rec",
                                      "accu_reward_method": "iou", "image_sizes": [[64, 48]], "source_row": 0,
                                      "image_path": str(imgs / "a.png"), "bbox": None}
    assert columns_of([record, record])["solution"] == ["[1.0, 2.0, 30.0, 40.0]"] * 2
    manifest = json.loads(res.manifest_path.read_text())
    assert manifest["content_sha256"] == content_sha256([record]) == res.content_sha256
    moved = tmp_path / "moved"
    (imgs).rename(moved)
    again = sample_sources([DataSource(json_path=str(src), image_root=str(moved))],
                           tmp_path / "b" / "s.jsonl", 0)
    assert again.content_sha256 == res.content_sha256 and _read(again.path)[0].images != record.images


def test_detection_boxes_are_checked_inside_the_image(tmp_path, imgs):
    def detection(boxes):
        objects = ", ".join(f'{{"bbox_2d": {b}, "label": "cat"}}' for b in boxes)
        return {"image": "a.png", "accu_reward_method": "od_ap", "conversations": [
            {"from": "human", "value": "<image>Find the cats."},
            {"from": "gpt", "value": f"<answer>```json [{objects}]```</answer>"}]}

    msg = _bad(tmp_path, [detection([[1, 2, 30, 40]]), detection([[1, 2, 30, 40], [10, 10, 70, 20]]),
                          detection([[5, 5, 2, 9]])], image_root=str(imgs))
    assert "bad.jsonl:2: solution: box [10.0, 10.0, 70.0, 20.0] lies outside the 64x48 image" in msg
    assert "(object 'cat')" in msg and "bad.jsonl:3" in msg and "inverted or empty" in msg
    assert "bad.jsonl:1" not in msg


def test_a_stage_process_samples_again_when_the_sampled_layout_changed(tmp_path, monkeypatch):
    """A stage process reuses the run's sampled files only when they were sampled for the same request, and
    the sampled-record schema is part of the request: files of an older layout are sampled again, not read."""
    from vlmexp.checks.loader import load_config
    from vlmexp.data import run_data

    cfg = load_config(REPO / "configs/demo.yaml", [f"run.output_dir={tmp_path}", "data.demo.train=4",
                                                   "data.demo.val=2"])
    first = run_data.prepare_data(cfg)
    stamp = first.train.stat().st_mtime_ns
    assert run_data.prepare_data(cfg, reuse=True).train.stat().st_mtime_ns == stamp  # same request: reused
    monkeypatch.setattr(run_data, "SCHEMA_VERSION", run_data.SCHEMA_VERSION + 1)
    again = run_data.prepare_data(cfg, reuse=True)
    assert again.train.stat().st_mtime_ns != stamp and again.content_sha256 == first.content_sha256


def test_prompts_carry_the_history_and_images_open_the_first_user_turn():
    from vlmexp.config.schema import DataConfig
    from vlmexp.data.record import SampledRecord
    from vlmexp.families import get_family
    from vlmexp.generation import with_image_parts
    from vlmexp.prompts import build_prompt

    record = SampledRecord(task="exact", method="default", problem="And now?", solution="b", images=["x.png"],
                           image_sizes=[[8, 8]], image_refs=["x.png"], source="s", source_id="", source_row=0,
                           record_format="messages", system="Be brief.",
                           history=[{"role": "user", "content": "First?"},
                                    {"role": "assistant", "content": "a"}])
    data = DataConfig(datasets=[DataSource(json_path="s")], system_prompt="ignored: the record has its own",
                      prompt_templates={"exact": "Q: {problem}"})
    prompt = build_prompt(record, data, get_family("qwen2_5_vl"))
    assert prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "First?"},
                      {"role": "assistant", "content": "a"}, {"role": "user", "content": "Q: And now?"}]
    shown = with_image_parts(prompt, 1)
    assert (shown[1]["content"] == [{"type": "image"}, {"type": "text", "text": "First?"}]
            and shown[3] == prompt[3])
