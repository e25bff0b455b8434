"""Data from every anchor, unchanged: TRL's conversational VLM layouts, LLaMA-Factory's sharegpt (and its
dataset_info.json folders), ms-swift's messages; built in their published layouts (tests/anchor_data.py),
sampled by `vlmexp sample`, and trained one step by each stage they feed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import anchor_data
import pytest
import yaml
from conftest import make_png, write_jsonl

from vlmexp.config.schema import DataSource
from vlmexp.data.record import read_sampled
from vlmexp.data.sampling import sample_sources
from vlmexp.errors import DataError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def anchors(tmp_path_factory) -> dict[str, dict]:
    """Each anchor layout as a data YAML entry."""
    root = tmp_path_factory.mktemp("anchors")
    folder = anchor_data.llamafactory_folder(root)
    return {
        # a folder of shards
        "trl_messages": {"json_path": str(anchor_data.trl_language_modeling(root).parent)},
        "trl_prompt_completion": {"json_path": str(anchor_data.trl_prompt_completion(root))},
        "trl_preference": {"json_path": str(anchor_data.trl_preference(root))},
        "rlaif_v": {"json_path": str(anchor_data.rlaif_v(root))},
        "trl_prompt_only": {"json_path": str(anchor_data.trl_prompt_only(root)), "task": "math"},
        "llamafactory": {"json_path": str(folder), "dataset": "mllm_demo"},
        "llamafactory_preference": {"json_path": str(folder), "dataset": "rlhf_v_demo"},
        "llamafactory_alpaca": {"json_path": str(folder), "dataset": "alpaca_mm_demo"},
        "ms_swift": {"json_path": str(anchor_data.ms_swift(root))},
    }


def _sample(tmp_path, *entries: dict):
    return read_sampled(sample_sources([DataSource(**e) for e in entries], tmp_path / "s.jsonl", 0).path)


def test_sample_explain_names_each_format_and_why(anchors, tmp_path):
    data_yaml = tmp_path / "data.yaml"
    data_yaml.write_text(yaml.safe_dump({"datasets": list(anchors.values())}))
    r = subprocess.run([sys.executable, "-m", "vlmexp.cli", "sample", str(data_yaml), "--out",
                        str(tmp_path / "o.jsonl"), "--explain"],
                       capture_output=True, text=True, cwd=tmp_path, check=False)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    why = dict(line.split(": read as ", 1) for line in lines if ": read as " in line)
    folder = Path(anchors["llamafactory"]["json_path"])
    expected = {  # the source as the manifest names it -> how it was read
        anchors["trl_messages"]["json_path"]: "'messages' because its first record has messages",
        anchors["trl_prompt_completion"]["json_path"]: "'prompt_completion' because its first record "
                                                       "has prompt, completion",
        anchors["trl_preference"]["json_path"]: "'preference' because its first record has prompt, chosen, "
                                                "rejected",
        anchors["trl_prompt_only"]["json_path"]: "'prompt_only' because its first record has prompt",
        anchors["rlaif_v"]["json_path"]: "'pairs' because its first record has chosen, rejected",
        str(folder / "mllm_demo.json"): "'conversations' because its first record has conversations; "
                                        "LLaMA-Factory dataset 'mllm_demo'; columns renamed "
                                        "{'conversations': 'messages', 'images': 'images'}",
        str(folder / "rlhf_v_demo.json"): "'conversations' because its first record has conversations, "
                                          "chosen, rejected; LLaMA-Factory dataset 'rlhf_v_demo'",
        anchors["ms_swift"]["json_path"]: "'messages' because its first record has messages, "
                                          "rejected_response",
        str(folder / "alpaca_mm_demo.json"): "'alpaca' because its first record has instruction, output; "
                                             "LLaMA-Factory dataset 'alpaca_mm_demo'",
    }
    assert set(why) == set(expected), why
    for source, reason in expected.items():
        assert why[source].startswith(reason), (source, why[source])
    # RLAIF-V's `image_path` (its origin dataset's path) reaches the rewards under a name the report states
    renamed = ("rewards receive the source's field 'image_path' as 'source_image_path' (vlmexp's "
               "'image_path' is the first image's path)")
    assert f"{anchors['rlaif_v']['json_path']}: {renamed}" in lines
    assert why[anchors["rlaif_v"]["json_path"]].endswith(renamed)
    assert any(line.startswith("formats, tried in this order")
               and "prompt_only (prompt, solution or answer)" in line for line in lines)
    records = read_sampled(tmp_path / "o.jsonl")
    assert len(records) == 36
    assert [r.extra["source_image_path"] for r in records if r.record_format == "pairs"] == [
        f"OK-VQA/train/COCO_train2014_{i:012d}.jpg" for i in range(4)]
    from vlmexp.data.sampling import explain_manifest  # what the pipeline's sample step logs

    assert explain_manifest(tmp_path / "o.manifest.json") == [line for line in lines if ": read as " in line]


def test_trl_layouts_normalise_to_turns_targets_and_pairs(anchors, tmp_path):
    [lm, *_] = _sample(tmp_path / "lm", anchors["trl_messages"])
    assert (lm.record_format, lm.problem, lm.target, lm.solution) == ("messages", "And its shape?",
                                                                      "A square.", "A square.")
    assert lm.history == [{"role": "user", "content": "What colour is shape 0?"},
                          {"role": "assistant", "content": "It is red."}]
    assert len(lm.images) == 1 and lm.image_refs[0].startswith("images/")  # embedded, stored once
    [pc, *_] = _sample(tmp_path / "pc", anchors["trl_prompt_completion"])
    assert (pc.problem, pc.target, pc.history) == ("Name the colour of shape 0.", "red", [])
    [pref, *_] = _sample(tmp_path / "pref", anchors["trl_preference"])
    assert (pref.problem, pref.target, pref.rejected, pref.solution) == ("Which colour is shape 0?", "red",
                                                                         "blue", "red")
    [po, second, *_] = _sample(tmp_path / "po", anchors["trl_prompt_only"])
    assert (po.task, po.method, po.system, po.target, second.solution) == ("math", "math",
                                                                           "Think, then answer.", None, "2")


@pytest.mark.parametrize("name", ["trl_messages", "trl_prompt_completion", "trl_preference",
                                  "trl_prompt_only"])
def test_embedded_and_path_images_read_alike(anchors, tmp_path, name):
    """A TRL layout as parquet with embedded images and as JSONL with image paths gives the same records."""
    entry = anchors[name]
    parquet = next(Path(entry["json_path"]).glob("*.parquet")) if Path(entry["json_path"]).is_dir() \
        else Path(entry["json_path"])
    jsonl = anchor_data.as_jsonl_with_paths(parquet, tmp_path / "paths")
    embedded = _sample(tmp_path / "a", entry)
    paths = _sample(tmp_path / "b", {**entry, "json_path": str(jsonl)})
    assert all(r.image_refs[0].endswith(".png") and not r.image_refs[0].startswith("images/") for r in paths)
    keep = ("problem", "history", "system", "target", "rejected", "solution", "task", "method", "image_sizes",
            "record_format")
    assert [[getattr(r, k) for k in keep] for r in embedded] == [[getattr(r, k) for k in keep] for r in paths]


def test_trl_implicit_prompt_preference_reads_as_the_explicit_one(anchors, tmp_path):
    """TRL's implicit-prompt preference layout (the prompt's turns repeated at the start of chosen and
    rejected, as trl.extract_prompt splits them) gives the records of its explicit form; answers sharing no
    first turn are refused naming the fix."""
    explicit = anchor_data.as_jsonl_with_paths(Path(anchors["trl_preference"]["json_path"]),
                                               tmp_path / "paths")
    rows = [json.loads(line) for line in explicit.read_text().splitlines()]
    implicit = explicit.with_name("implicit.jsonl")  # beside the images its paths name
    implicit.write_text("".join(json.dumps({"images": r["images"], "chosen": r["prompt"] + r["chosen"],
                                            "rejected": r["prompt"] + r["rejected"]}) + "\n" for r in rows))
    keep = ("problem", "history", "system", "target", "rejected", "solution", "task", "image_sizes",
            "record_format")
    got = _sample(tmp_path / "i", {"json_path": str(implicit)})
    want = _sample(tmp_path / "e", {"json_path": str(explicit)})
    assert [[getattr(r, k) for k in keep] for r in got] == [[getattr(r, k) for k in keep] for r in want]
    assert got[0].record_format == "preference" and (got[0].target, got[0].rejected) == ("red", "blue")
    unshared = explicit.with_name("unshared.jsonl")
    unshared.write_text(json.dumps({"images": rows[0]["images"], "chosen": rows[0]["chosen"],
                                    "rejected": rows[0]["rejected"]}) + "\n")
    with pytest.raises(DataError, match="share no first turn.*give a `prompt` field"):
        _sample(tmp_path / "u", {"json_path": str(unshared)})


def test_llamafactory_and_ms_swift_layouts(anchors, tmp_path):
    [demo, *_] = _sample(tmp_path / "lf", anchors["llamafactory"])
    assert demo.problem == "What is it doing?" and demo.target == "Standing still." and len(demo.images) == 2
    assert demo.history[1] == {"role": "assistant", "content": "A red square."}
    assert demo.images[0] == str(Path(anchors["llamafactory"]["json_path"]).resolve() / "mllm_demo_data"
                                 / "red.png")
    [pref, *_] = _sample(tmp_path / "lfp", anchors["llamafactory_preference"])
    assert (pref.problem, pref.target, pref.rejected) == ("Which colour is it?", "red", "green")
    [alpaca, *_] = _sample(tmp_path / "alpaca", anchors["llamafactory_alpaca"])
    assert (alpaca.problem, alpaca.target, alpaca.record_format) == ("Name the colour.\nOne word.", "red",
                                                                     "alpaca")
    assert alpaca.history == [{"role": "user", "content": "Hello."},
                              {"role": "assistant", "content": "Hello! Show me an image."}]
    make_png(tmp_path / "a.png")  # LLaMA-Factory's alpaca preference form, named directly as a file
    ranked = write_jsonl(tmp_path / "ranked.jsonl", [{"instruction": "<image>Colour?", "input": "",
                                                      "chosen": "red", "rejected": "blue",
                                                      "images": ["a.png"]}])
    [pair] = _sample(tmp_path / "ranked", {"json_path": str(ranked)})
    assert (pair.record_format, pair.problem, pair.target, pair.rejected) == ("alpaca", "Colour?", "red",
                                                                              "blue")
    [swift, *_] = _sample(tmp_path / "swift", anchors["ms_swift"])
    assert (swift.system, swift.target, swift.rejected) == ("You are a helpful assistant.", "It is red.",
                                                            "It is blue.")


def test_a_record_fitting_no_format_names_the_formats_and_its_fields(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"img": "a.png", "query": "q", "reply": "r"}])
    with pytest.raises(DataError) as e:
        sample_sources([DataSource(json_path=str(path))], tmp_path / "o.jsonl", 0)
    text = str(e.value)
    assert f"{path}:1" in text and "fields: ['img', 'query', 'reply']" in text
    for tried in ("preference (prompt, chosen, rejected)", "messages (messages)",
                  "conversations (conversations)", "easyr1 (problem, answer, images)",
                  "rec (image, problem, solution)"):
        assert tried in text, tried


@pytest.mark.parametrize("turns, needle", [
    ([{"role": "assistant", "content": "hi"}, {"role": "user", "content": "<image>q"}],
     "turn 0 is 'assistant' where 'user' belongs"),
    ([{"role": "user", "content": "<image>q"}, {"role": "user", "content": "again"}],
     "turn 1 is 'user' where 'assistant' belongs"),
    ([{"role": "user", "content": "<image>q"}, {"role": "tool", "content": "x"}],
     "tool use must end in the assistant's answer"),
    ([{"role": "user", "content": [{"type": "video"}]}], "field 'messages' holds a {type: video} part"),
    ([{"role": "user", "content": "<image>What is it?"}], "no answer to grade"),
    ([{"role": "user", "content": "<image><image>q"}, {"role": "assistant", "content": "a"}],
     "messages has 2 <image> tags but the record lists 1 images"),
])
def test_turn_structures_a_stage_cannot_use_are_refused_naming_the_record(tmp_path, turns, needle):
    make_png(tmp_path / "a.png")
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "<image>ok"},
                                                            {"role": "assistant", "content": "fine"}],
                                               "images": ["a.png"]},
                                              {"messages": turns, "images": ["a.png"]}])
    with pytest.raises(DataError) as e:
        sample_sources([DataSource(json_path=str(path))], tmp_path / "o.jsonl", 0)
    assert f"{path}:2" in str(e.value) and needle in str(e.value), str(e.value)
    assert f"{path}:1" not in str(e.value)


def test_llamafactory_folder_errors_name_the_entry_and_the_fix(anchors, tmp_path):
    folder = anchors["llamafactory"]["json_path"]
    for entry, needle in (({"json_path": folder}, ("name one of its datasets with `dataset:`, one of "
                                                   "['alpaca_mm_demo', 'mllm_demo', "
                                                   "'mllm_video_demo', 'rlhf_v_demo']")),
                          ({"json_path": folder, "dataset": "mllm_video_demo"},
                           "[mllm_video_demo]: columns.videos = 'videos': not read by vlmexp"),
                          ({"json_path": str(tmp_path), "dataset": "x"}, "holds no dataset_info.json")):
        with pytest.raises(DataError, match=".") as e:
            sample_sources([DataSource(**entry)], tmp_path / "o.jsonl", 0)
        assert needle in str(e.value), str(e.value)


@pytest.mark.slow
def test_each_anchor_format_trains_a_step_of_each_stage_it_feeds(anchors, tmp_path, tiny_models):
    """SFT on multi-turn and single-turn conversations (loss on every assistant turn and nothing else), DPO on
    the four preference layouts (RLAIF-V's with its `image_path` column), GRPO on prompt-only,
    prompt-completion and multi-turn records: one step each, weights changed; then evaluation on the GRPO
    records."""
    from safetensors.torch import load_file

    from vlmexp.checks.loader import load_config
    from vlmexp.evaluate import evaluate
    from vlmexp.train.dpo import run_dpo
    from vlmexp.train.grpo import run_grpo
    from vlmexp.train.sft import run_sft

    sys.path.insert(0, str(Path(__file__).parent))
    base = tiny_models["qwen2_5_vl"]
    before = load_file(base / "model.safetensors")

    def train(stage: str, run, names: list[str], *overrides: str):
        data = tmp_path / f"{stage}.yaml"
        data.write_text(yaml.safe_dump({"datasets": [anchors[n] for n in names]}))
        cfg = load_config(REPO / "configs/demo.yaml", [
            f"run.output_dir={tmp_path / stage}", "tracking.backend=none", f"model.path={base}",
            "data.demo=null", f"data.data_yaml={data}", f"{stage}.args.max_steps=1",
            f"{stage}.args.per_device_train_batch_size=4", f"{stage}.args.learning_rate=1e-3",
            f"{stage}.args.warmup_steps=0", *overrides])
        final = run(cfg)
        after = load_file(final / "model.safetensors")
        assert any(not (before[k] == after[k]).all() for k in before), f"{stage} changed no parameter"
        return cfg, final

    cfg, final = train("sft", run_sft, ["trl_messages", "trl_prompt_completion", "llamafactory",
                                        "llamafactory_alpaca", "ms_swift"], "sft.args.max_length=512")
    _assert_loss_on_assistant_turns_only(cfg, final)
    train("dpo", run_dpo, ["trl_preference", "llamafactory_preference", "ms_swift", "rlaif_v"],
          "dpo.enabled=true", "dpo.pairs.from=data", "dpo.args.max_length=256")
    cfg, final = train("grpo", run_grpo, ["trl_prompt_only", "trl_prompt_completion", "llamafactory"],
                       "grpo.args.num_generations=4", "grpo.args.max_completion_length=8",
                       "grpo.args.gradient_accumulation_steps=1", "eval.max_new_tokens=8",
                       "grpo.rewards=[{name: 'rewards_for_tests:char_variety'}]")
    # evaluation generates on the same records (multi-turn prompts among them) and scores each task
    result = evaluate(cfg, str(final), Path(cfg.run.output_dir) / "data" / "train.jsonl", tmp_path / "eval")
    assert result.metrics["count"] == 12 and {"math_accuracy", "exact_accuracy"} <= set(result.metrics)


def _assert_loss_on_assistant_turns_only(cfg, final: Path) -> None:
    """The SFT rows of multi-turn data are `messages`, collated as TRL collates them with assistant_only_loss:
    the tokens that carry a label decode to the assistant turns, every one of them, and nothing else."""
    from trl.chat_template_utils import get_training_chat_template
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from vlmexp.families import get_family
    from vlmexp.processor import load_processor
    from vlmexp.train.data import build_dataset

    family = get_family("qwen2_5_vl")
    processor = load_processor(str(final), family, cfg.model.image_knobs)
    rows = build_dataset(Path(cfg.run.output_dir) / "data" / "train.jsonl", cfg.data, family,
                         family.image_budget(processor), "sft")
    assert rows.column_names == ["messages", "images"]
    collator = DataCollatorForVisionLanguageModeling(processor, assistant_only_loss=True,
                                                     chat_template=get_training_chat_template(processor))
    row = next(r for r in rows if len(r["messages"]) >= 4)  # a two-round conversation
    batch = collator([dict(row)])
    labelled = batch["input_ids"][0][batch["labels"][0] != -100]
    assistant = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
    assert len(assistant) == 2
    assert processor.tokenizer.decode(labelled) == "".join(f"{a}<|im_end|>\n" for a in assistant)


def test_multi_turn_sft_needs_a_chat_template_trl_can_mark(tiny_models):
    """TRL gives a VLM assistant-only loss through {% generation %} markers: the released Qwen2.5-VL template
    gets TRL's marked copy, another template is refused before any step, naming the fix."""
    from types import SimpleNamespace

    from vlmexp.errors import ConfigError
    from vlmexp.families import get_family
    from vlmexp.processor import load_processor
    from vlmexp.train.data import require_assistant_masks

    processor = load_processor(tiny_models["qwen2_5_vl"], get_family("qwen2_5_vl"))
    args = SimpleNamespace(assistant_only_loss=False)
    require_assistant_masks(args, processor)
    assert args.assistant_only_loss is True
    processor.chat_template = processor.tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}"
                                                                   "{% endfor %}")
    with pytest.raises(ConfigError) as e:
        require_assistant_masks(SimpleNamespace(assistant_only_loss=False), processor)
    assert "model: chat_template" in str(e.value) and "add the markers" in str(e.value)


def test_validate_checks_a_llamafactory_dataset_name(anchors, tmp_path):
    from vlmexp.checks.loader import load_config
    from vlmexp.errors import ConfigError

    folder = anchors["llamafactory"]["json_path"]
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": "tiny:qwen2_5_vl"},
                                      "data": {"datasets": [{"json_path": folder, "dataset": "mllm_dmeo"}]}}))
    with pytest.raises(ConfigError) as e:
        load_config(config, check_paths=True)
    assert "data.datasets.0.dataset = 'mllm_dmeo'" in str(e.value) and "'mllm_demo'" in str(e.value)
    load_config(config, ["data.datasets=[{json_path: '" + folder + "', dataset: mllm_demo}]"],
                check_paths=True)


def test_video_records_are_refused_naming_the_row_field_and_the_way_on(tmp_path):
    """An ms-swift record with a video and an EasyR1 row with `videos`, as published: sampling refuses each,
    naming the source, the row, the field, that vlmexp trains images only and how to go on; dropping the
    column keeps going where the text holds no tag; `validate` refuses the EasyR1 source too."""
    from vlmexp.checks.loader import load_config
    from vlmexp.errors import ConfigError

    swift, easyr1 = anchor_data.ms_swift_video(tmp_path), anchor_data.easyr1_video(tmp_path)
    with pytest.raises(DataError) as e:
        sample_sources([DataSource(json_path=str(swift))], tmp_path / "s" / "s.jsonl", 0)
    text = str(e.value)
    assert f"{swift}:2" in text and "field 'videos' carries video (['clip.mp4'])" in text, text
    assert "vlmexp trains on images (and text) only" in text and "`columns: {videos: null}`" in text
    assert "filter out the rows" in text and f"{swift}:1" not in text
    with pytest.raises(DataError) as e:  # dropped: the <video> tag in the text still speaks of it
        sample_sources([DataSource(json_path=str(swift), columns={"videos": None})],
                       tmp_path / "d" / "s.jsonl", 0)
    assert f"{swift}:2" in str(e.value) and "field 'messages' holds a <video> tag" in str(e.value)
    kept = sample_sources([DataSource(json_path=str(swift), sampling_strategy="first:1",
                                      columns={"videos": None})], tmp_path / "k" / "s.jsonl", 0)
    assert kept.rows == 1

    with pytest.raises(DataError) as e:  # was "unknown record format"
        sample_sources([DataSource(json_path=str(easyr1))], tmp_path / "e" / "s.jsonl", 0)
    text = str(e.value)
    assert f"{easyr1}[0]" in text and "field 'videos' carries video" in text and "unknown" not in text
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": "tiny:qwen2_5_vl"},
                                      "data": {"datasets": [{"json_path": str(easyr1)}]}}))
    with pytest.raises(ConfigError) as e:
        load_config(config, check_paths=True)
    assert "data.datasets.0.json_path" in str(e.value) and "field 'videos' carries video" in str(e.value)


def test_video_parts_and_audio_are_refused_too(tmp_path):
    make_png(tmp_path / "a.png", (56, 56))
    rows = [{"prompt": [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What?"}]}],
             "solution": "red"},
            {"messages": [{"role": "user", "content": "<audio>What is said?"},
                          {"role": "assistant", "content": "hello"}], "audios": ["a.wav"]}]
    for i, row in enumerate(rows):
        with pytest.raises(DataError) as e:
            path = write_jsonl(tmp_path / f"{i}.jsonl", [row])
            sample_sources([DataSource(json_path=str(path))], tmp_path / str(i) / "s.jsonl", 0)
        assert ("field 'prompt' holds a {type: video} part" if i == 0
                else "field 'audios' carries audio") in str(e.value)


def test_a_relative_out_writes_absolute_image_paths(anchors, tmp_path, monkeypatch):
    """docs/data-formats.md: the sampled records hold absolute paths, embedded images (stored beside the
    sampled file) and images named by path alike, whatever folder `--out` is given relative to."""
    monkeypatch.chdir(tmp_path)
    sources = [DataSource(json_path=anchors[name]["json_path"]) for name in ("rlaif_v", "ms_swift")]
    result = sample_sources(sources, Path("rel") / "s.jsonl", 0)
    records = read_sampled(tmp_path / "rel" / "s.jsonl")
    assert result.path == tmp_path / "rel" / "s.jsonl"
    assert all(Path(p).is_absolute() and Path(p).is_file() for r in records for p in r.images)
    assert any(str(tmp_path / "rel" / "images") in p for r in records for p in r.images)
