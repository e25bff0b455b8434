"""The source's own columns reach the rewards, as TRL passes every dataset column to reward functions:
VLM-R1's REC JSON with its `normal_caption`, EasyR1's Hub parquet (geometry3k's `id`, `choices`,
`ground_truth`) and TRL's messages with a column of the user's own, each built in its published layout; seen
by a `module:function` reward in a real GRPO step, in `vlmexp eval`, in DPO's sample scoring and in
evaluation's scoring. A source column named as one of vlmexp's own is refused at sampling, naming both and the
fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anchor_data
import pytest
import yaml
from conftest import make_png, write_json
from test_data_sources import geometry3k_dataset

from vlmexp.config.schema import DataSource
from vlmexp.data.record import columns_of, content_sha256, read_sampled
from vlmexp.data.sampling import sample_sources
from vlmexp.errors import DataError

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
REWARD = "rewards_for_tests:columns_seen"
# what each source holds besides what vlmexp reads, by (record format, source row)
CAPTIONS = ["the red square on the left", "the blue square at the top"]


def expected(fmt: str, row: int) -> dict:
    if fmt == "rec":
        return {"normal_caption": CAPTIONS[row]}
    if fmt == "easyr1":
        return {"id": str(row), "choices": ["1", "2", "3", "4"], "ground_truth": "B"}
    return {"difficulty": row + 1, "tags": ["colour", f"shape {row}"]}


def vlmr1_rec(folder: Path, n: int = 2, **more) -> Path:
    """VLM-R1's rec_jsons_processed/refcoco_*.json: a JSON list of {image, problem, solution, normal_caption},
    images by COCO file name under image_root."""
    rows = []
    for i in range(n):
        make_png(folder / "train2014" / f"COCO_train2014_{i:012d}.png", (64, 48), ("red", "blue")[i % 2])
        rows.append({"image": f"COCO_train2014_{i:012d}.png", "problem": CAPTIONS[i],
                     "solution": [4, 6, 30 + i, 40], "normal_caption": CAPTIONS[i],
                     **{k: v[i] for k, v in more.items()}})
    return write_json(folder / "refcoco_train.json", rows)


def trl_messages_with_own_column(folder: Path, n: int = 2) -> Path:
    """HuggingFaceH4/llava-instruct-mix-vsft's layout (anchor_data) plus columns of the user's own."""
    from datasets import Dataset

    shard = anchor_data.trl_language_modeling(folder / "plain", n)
    ds = Dataset.from_parquet(str(shard), cache_dir=str(folder / "cache"))
    ds = ds.add_column("difficulty", [expected("messages", i)["difficulty"] for i in range(n)])
    ds = ds.add_column("tags", [expected("messages", i)["tags"] for i in range(n)])
    path = folder / "mine" / "data" / "train-00000-of-00001.parquet"
    path.parent.mkdir(parents=True)
    ds.to_parquet(path)
    return path.parent


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[dict]:
    """The three sources as data YAML entries."""
    root = tmp_path_factory.mktemp("columns")
    rec = vlmr1_rec(root / "vlmr1")
    geometry3k_dataset(2).to_parquet(root / "geometry3k" / "data" / "train-00000-of-00001.parquet")
    return [{"json_path": str(rec), "image_root": str(root / "vlmr1" / "train2014")},
            {"json_path": str(root / "geometry3k" / "data" / "train-*.parquet")},
            {"json_path": str(trl_messages_with_own_column(root / "trl"))}]


def _sample(tmp_path, entries) -> list:
    return read_sampled(sample_sources([DataSource(**e) for e in entries], tmp_path / "s.jsonl", 0).path)


def test_sampled_records_keep_the_source_columns_and_the_digest_covers_them(sources, tmp_path):
    from vlmexp.data.sampling import format_report

    result = sample_sources([DataSource(**e) for e in sources], tmp_path / "a" / "s.jsonl", 0)
    explained = format_report(result, explain=True)  # `vlmexp sample --explain`, and the manifest, name them
    assert "its own columns ['normal_caption'] reach the rewards" in explained
    assert "its own columns ['id', 'choices', 'ground_truth'] reach the rewards" in explained
    assert "its own columns ['difficulty', 'tags'] reach the rewards" in explained
    records = read_sampled(result.path)
    assert [r.record_format for r in records] == ["rec", "rec", "easyr1", "easyr1", "messages", "messages"]
    for r in records:
        own = {**({"id": r.id} if r.id is not None else {}), **r.extra}
        assert own == expected(r.record_format, r.source_row), r
    columns = columns_of(records)  # a column a source lacks is None for its records, as in one TRL dataset
    assert columns["normal_caption"] == CAPTIONS + [None] * 4
    assert columns["difficulty"] == [None] * 4 + [1, 2]
    assert (columns["choices"][2] == ["1", "2", "3", "4"]
            and columns["id"] == [None, None, "0", "1", None, None])
    assert columns["solution"][0] == "[4.0, 6.0, 30.0, 40.0]"  # vlmexp's own columns are there as before
    # the digest covers the source's columns: another caption is other data
    changed = json.loads(Path(sources[0]["json_path"]).read_text())
    changed[0]["normal_caption"] = "another caption"
    other = write_json(tmp_path / "b" / "refcoco_train.json", changed)
    again = _sample(tmp_path / "b", [{**sources[0], "json_path": str(other)}])
    assert content_sha256(again) != content_sha256(records[:2])
    assert content_sha256(_sample(tmp_path / "c", sources[:1])) == content_sha256(records[:2])


def test_a_file_sampled_without_the_source_columns_is_refused(sources, tmp_path):
    """The layout before the source's columns were kept (schema 2) would hand rewards none of them:
    refused."""
    path = sample_sources([DataSource(**sources[0])], tmp_path / "s.jsonl", 0).path
    old = [{k: v for k, v in json.loads(line).items() if k != "extra"} | {"schema": 2}
           for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    with pytest.raises(DataError, match="schema 2, not sampled-record schema 3.*run `vlmexp sample` again"):
        read_sampled(path)


@pytest.fixture
def columns_file(tmp_path, monkeypatch) -> Path:
    sys.path.insert(0, str(TESTS))
    path = tmp_path / "seen.jsonl"
    monkeypatch.setenv("VLMEXP_TEST_COLUMNS_FILE", str(path))
    return path


def _seen(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _assert_each_saw_its_own(seen: list[dict], records) -> None:
    """Every row the reward received holds its record's source columns, and vlmexp's own columns beside
    them."""
    by_key = {(r.task, r.source_row): r for r in records}
    for row in seen:
        record = by_key[(row["task"], row["source_row"])]
        for name, value in expected(record.record_format, record.source_row).items():
            assert row[name] == value, (name, row)
        assert row["image_path"] == record.images[0] and row["accu_reward_method"] == record.method


def test_dpo_sample_scoring_and_evaluation_pass_the_source_columns(sources, tmp_path, columns_file):
    """DPO's sample scoring (and the difficulty filter, which scores through it) and evaluation's scoring (and
    validation's, the same function) give a `module:function` reward the source's columns."""
    from vlmexp.config.stages import RewardSpec
    from vlmexp.rewards_loader import build_reward
    from vlmexp.scoring import score_group, score_records

    records = _sample(tmp_path, sources)
    reward = build_reward(REWARD, {}, "pixels", None)
    for record in records:
        assert score_group([reward], [1.0], [], ["a", "b"], record) == [1.0, 1.0]
    _assert_each_saw_its_own(_seen(columns_file), records)
    assert len(_seen(columns_file)) == 12
    columns_file.unlink()
    metrics, rows = score_records(records, ["<answer>2</answer>"] * 6, "pixels", None,
                                  [RewardSpec(name=REWARD)])
    assert (metrics["reward_rewards_for_tests.columns_seen"] == 1.0
            and [r["reward_rewards_for_tests.columns_seen"] for r in rows] == [1.0] * 6)
    _assert_each_saw_its_own(_seen(columns_file), records)


def test_a_source_column_named_as_one_of_vlmexps_reaches_the_rewards_renamed(tmp_path):
    """A published layout is never refused for a column named as one of vlmexp's: rewards receive it as
    `source_<name>` beside vlmexp's own, and the manifest states it."""
    from vlmexp.data.record import reward_columns
    from vlmexp.data.sampling import explain_manifest

    rec = vlmr1_rec(tmp_path / "vlmr1", image_path=["crops/0.png", "crops/1.png"])
    entry = {"json_path": str(rec), "image_root": str(tmp_path / "vlmr1" / "train2014")}
    result = sample_sources([DataSource(**entry)], tmp_path / "a" / "s.jsonl", 0)
    records = read_sampled(result.path)
    assert records[1].extra == {"normal_caption": CAPTIONS[1], "source_image_path": "crops/1.png"}
    columns = reward_columns(records[1])
    assert columns["source_image_path"] == "crops/1.png" and columns["image_path"] == records[1].images[0]
    assert result.sources[0].renamed_columns == {"image_path": "source_image_path"}
    [line] = explain_manifest(result.manifest_path)
    assert "rewards receive the source's field 'image_path' as 'source_image_path'" in line
    # a field vlmexp reads in other formats but this one does not (EasyR1 grades `answer`) alike
    ds = geometry3k_dataset(2).add_column("solution", ["x = 2", "x = 3"])
    ds.to_parquet(tmp_path / "g" / "train.parquet")
    [first, _] = _sample(tmp_path / "c", [{"json_path": str(tmp_path / "g" / "train.parquet")}])
    assert first.extra["source_solution"] == "x = 2" and first.solution != "x = 2"
    # a source holding both names is refused, naming the field and the fix
    ds.add_column("source_solution", ["a", "b"]).to_parquet(tmp_path / "h" / "train.parquet")
    with pytest.raises(DataError, match="reaches the rewards as 'source_solution', a field the source has "
                                        "as well; give one of them another name with `columns:"):
        sample_sources([DataSource(json_path=str(tmp_path / "h" / "train.parquet"))],
                       tmp_path / "d" / "s.jsonl", 0)
    # a name of the user's own in `columns` must not be vlmexp's column, nor a misspelt field
    from vlmexp.data.sources import check_source

    [(_, _, own)] = check_source(DataSource(json_path="x.json", columns={"image_path": "crop"}))
    assert "'image_path' in columns is vlmexp's reward column" in own
    [(_, _, typo)] = check_source(DataSource(json_path="x.json", columns={"soluton": "answer"}))
    assert "did you mean 'solution'?" in typo


def test_a_column_json_cannot_hold_is_refused_and_an_image_column_left_out(tmp_path):
    import datetime

    from datasets import Features, Image, Value

    ds = geometry3k_dataset(2)
    ds.add_column("created", [datetime.datetime(2024, 1, i + 1) for i in range(2)]).cast_column(
        "created", Value("timestamp[s]")).to_parquet(tmp_path / "t" / "train.parquet")
    with pytest.raises(DataError) as e:
        sample_sources([DataSource(json_path=str(tmp_path / "t" / "train.parquet"))],
                       tmp_path / "a" / "s.jsonl", 0)
    assert "train.parquet" in str(e.value) and "created: field 'created' holds datetime" in str(e.value)
    assert "convert it to strings, numbers, lists or objects in the source" in str(e.value)
    features = Features({**ds.features, "mask": Image()})
    masked = ds.add_column("mask", [{"bytes": anchor_data.png("red"), "path": None}] * 2).cast(features)
    masked.to_parquet(tmp_path / "m" / "train.parquet")
    records = _sample(tmp_path / "b", [{"json_path": str(tmp_path / "m" / "train.parquet")}])
    # the image column left out
    assert records[0].extra == {"choices": ["1", "2", "3", "4"], "ground_truth": "B"}


@pytest.mark.slow
def test_grpo_and_vlmexp_eval_rewards_receive_the_source_columns(sources, tmp_path, tiny_models,
                                                                 columns_file):
    """A real GRPO step on the three sources at once (every prompt in the step), then `vlmexp eval` on them:
    the `module:function` reward receives each record's own columns, and its score (1.0 where it did) is
    logged."""
    from vlmexp.checks.loader import load_config
    from vlmexp.train.grpo import run_grpo

    data = tmp_path / "data.yaml"
    data.write_text(yaml.safe_dump({"datasets": sources}))
    overrides = [f"run.output_dir={tmp_path / 'run'}", "tracking.backend=none",
                 f"model.path={tiny_models['qwen2_5_vl']}", "data.demo=null", f"data.data_yaml={data}",
                 "grpo.args.max_steps=1", "grpo.args.logging_steps=1",
                 "grpo.args.per_device_train_batch_size=12", "grpo.args.num_generations=2",
                 "grpo.args.gradient_accumulation_steps=1", "grpo.args.max_completion_length=4",
                 "eval.max_new_tokens=4", f"grpo.rewards=[{{name: '{REWARD}'}}]"]
    final = run_grpo(load_config(REPO / "configs/demo.yaml", overrides))
    records = read_sampled(tmp_path / "run" / "data" / "train.jsonl")
    seen = _seen(columns_file)
    assert (len(seen) == 12
            and {(r["task"], r["source_row"]) for r in seen} == {(r.task, r.source_row) for r in records})
    _assert_each_saw_its_own(seen, records)
    [ckpt] = (tmp_path / "run" / "grpo").glob("checkpoint-*")
    [logged] = [h for h in json.loads((ckpt / "trainer_state.json").read_text())["log_history"]
                if "reward" in h]
    assert logged[f"rewards/{REWARD}/mean"] == 1.0

    columns_file.unlink()
    config = tmp_path / "config.yaml"
    config.write_text((REPO / "configs/demo.yaml").read_text())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "vlmexp.cli", "eval", str(final), "--config", str(config),
                        "--records", str(tmp_path / "run" / "data" / "train.jsonl"), "--out",
                        str(tmp_path / "eval"), *overrides[1:]], capture_output=True, text=True, cwd=REPO,
                       env=env, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = json.loads(r.stdout[r.stdout.index("{"):])
    assert metrics["count"] == 6 and metrics["reward_rewards_for_tests.columns_seen"] == 1.0
    seen = _seen(columns_file)
    assert len(seen) == 6
    _assert_each_saw_its_own(seen, records)


def test_a_column_whose_types_differ_across_sources_is_refused_before_grpo(tmp_path):
    """GRPO's dataset is Arrow, as TRL's: one source's `difficulty: 1` and another's `difficulty: "hard"`
    cannot be one column; refused naming it, before any model loads."""
    from vlmexp.checks.loader import load_config
    from vlmexp.families import get_family
    from vlmexp.train.data import build_dataset

    entries = [{"json_path": str(vlmr1_rec(tmp_path / name, difficulty=values)),
                "image_root": str(tmp_path / name / "train2014")}
               for name, values in (("a", [1, 2]), ("b", ["hard"] * 2))]
    path = sample_sources([DataSource(**e) for e in entries], tmp_path / "s.jsonl", 0).path
    cfg = load_config(REPO / "configs/demo.yaml", [f"run.output_dir={tmp_path}"])
    with pytest.raises(DataError,
                       match="difficulty: the source column 'difficulty' holds values of different types "
                             r"across records \(int, str"):
        build_dataset(path, cfg.data, get_family("qwen2_5_vl"), None, "grpo")
    rows = build_dataset(sample_sources([DataSource(**entries[0])], tmp_path / "one.jsonl", 0).path, cfg.data,
                         get_family("qwen2_5_vl"), None, "grpo")
    assert rows["difficulty"] == [1, 2] and rows["normal_caption"] == CAPTIONS


def test_vlmexp_score_reads_a_predictions_line_with_the_source_columns(sources, tmp_path):
    """`vlmexp score`: each line a data record with the model's output as `completion`; the record's own
    columns travel with it to the rewards, the output does not."""
    from vlmexp.evaluate import read_predictions

    rows = json.loads(Path(sources[0]["json_path"]).read_text())
    preds = tmp_path / "predictions.jsonl"
    preds.write_text("".join(json.dumps({**r, "completion": "<answer>[4, 6, 30, 40]</answer>"}) + "\n"
                             for r in rows))
    records, completions = read_predictions(preds, sources[0]["image_root"])
    assert [r.extra for r in records] == [{"normal_caption": c} for c in CAPTIONS]
    assert completions == ["<answer>[4, 6, 30, 40]</answer>"] * 2
