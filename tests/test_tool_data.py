"""Zoom data as the field publishes it: V* Bench and the plain V*-style form, DeepEyes-47k's verl rows, TRL's
and ms-swift's tool-calling conversations with the crop in the tool turn; sampled into the one record, and SFT
on the tool-use demonstrations (the loss on the calls and the answer, the crops fed to the model)."""

from __future__ import annotations

import json
from pathlib import Path

import anchor_data
import pytest
import yaml
from conftest import make_png, write_jsonl

from vlmexp.config.schema import DataSource
from vlmexp.data.record import read_sampled, reward_columns
from vlmexp.data.sampling import sample_sources
from vlmexp.errors import DataError

REPO = Path(__file__).resolve().parents[1]
ARGUMENTS = {"bbox_2d": [8.0, 8.0, 40.0, 40.0]}
CALL = ('<think>It is small.</think>\n<tool_call>\n{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": '
        '[8.0, 8.0, 40.0, 40.0]}}\n</tool_call>')


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("zoom-layouts")
    return {"vstar": anchor_data.vstar_bench(root), "vqa": anchor_data.vqa_with_box(root),
            "deepeyes": anchor_data.deepeyes_47k(root), "trl_tools": anchor_data.trl_tool_calls(root),
            "swift_agent": anchor_data.ms_swift_agent(root)}


def _sample(tmp_path: Path, path: Path, judged: bool = False):
    result = sample_sources([DataSource(json_path=str(path))], tmp_path / "s.jsonl", 0, judged)
    return result.sources[0], read_sampled(result.path)


def test_vstar_and_deepeyes_layouts_read_as_published(layouts, tmp_path):
    source, records = _sample(tmp_path / "vstar", layouts["vstar"])
    assert source.record_format == "vstar" and source.detected_by == ["text", "label"]
    first = records[0]
    assert (first.task, first.method, first.solution, first.id) == ("exact", "mcq", "A", "0")
    assert first.problem.startswith("What is the colour of the glove?\n(A) red") and first.extra == {
        "category": "direct_attributes"}
    assert first.image_refs == ["direct_attributes/sa_1000.jpg"] and first.box is None

    source, records = _sample(tmp_path / "vqa", layouts["vqa"])
    assert source.record_format == "vqa"
    assert [(r.solution, r.box, r.method) for r in records[:2]] == [
        ("red", [10.0, 20.0, 40.0, 50.0], "default"), ("blue", [11.0, 20.0, 41.0, 50.0], "default")]
    assert reward_columns(records[1])["bbox"] == [11.0, 20.0, 41.0, 50.0]

    with pytest.raises(DataError) as e:  # DeepEyes grades with a judge model: refused without one
        _sample(tmp_path / "deepeyes-no-judge", layouts["deepeyes"])
    assert "accu_reward_method 'llm' is scored by a judge model" in str(e.value)
    source, records = _sample(tmp_path / "deepeyes", layouts["deepeyes"], judged=True)
    assert source.record_format == "deepeyes" and source.embedded_images == 4
    first = records[0]
    assert first.system == anchor_data.DEEPEYES_SYSTEM and first.method == "llm" and first.solution == "red"
    assert first.problem == ("What is the colour of the umbrella 0?" + anchor_data.DEEPEYES_SUFFIX).strip()
    assert first.extra["data_source"] == "vstar" and first.extra["extra_info"]["index"] == 0
    assert Path(first.images[0]).suffix == ".jpg" and first.tool_turns == []


@pytest.mark.parametrize("name", ["trl_tools", "swift_agent"])
def test_tool_conversations_keep_the_calls_and_the_crops(layouts, tmp_path, name):
    """TRL's `tool_calls` and ms-swift's `tool_call` / `tool_response` turns become one layout: the call
    rendered once in the assistant's text, the tool turn with its image, the crop after the question's
    image."""
    source, records = _sample(tmp_path, layouts[name])
    assert source.record_format == "messages"
    first = records[0]
    assert first.problem == "What colour is the small square?" and first.target == "<answer>red</answer>"
    assert first.tool_turns == [{"role": "assistant", "content": CALL},
                                {"role": "tool", "content": "", "images": 1}]
    assert [size for size in first.image_sizes] == [[96, 96], [32, 32]]
    assert first.question_images == first.images[:1] and first.history == []
    if name == "swift_agent":  # the tools column reaches the rewards, as TRL passes every column
        assert json.loads(first.extra["tools"])[0]["function"]["name"] == "image_zoom_in_tool"


@pytest.mark.parametrize(("messages", "needle"), [
    ([{"role": "user", "content": "<image>q"}, {"role": "tool", "content": "<image>"},
      {"role": "assistant", "content": "a"}], "turn 1 is a tool's answer that follows no tool call"),
    ([{"role": "user", "content": "<image>q"}, {"role": "tool_call", "content": "zoom please"},
      {"role": "tool_response", "content": "<image>"}, {"role": "assistant", "content": "a"}],
     "messages[1].content is not a tool call's JSON"),
    ([{"role": "user", "content": "<image>q"},
      {"role": "tool_call",
       "content": '{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [1, 1, 9, 9]}}'},
      {"role": "tool_response", "content": "<image>"}], "tool use must end in the assistant's answer"),
    ([{"role": "user", "content": "<image>q"}, {"role": "robot", "content": "a"}], "has role 'robot'"),
])
def test_malformed_tool_use_is_refused_naming_the_turn(tmp_path, messages, needle):
    make_png(tmp_path / "a.png", (64, 64))
    make_png(tmp_path / "b.png", (16, 16))
    path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": messages, "images": ["a.png", "b.png"][
        :sum(m["content"].count("<image>") for m in messages)]}])
    with pytest.raises(DataError) as e:
        _sample(tmp_path, path)
    assert needle in str(e.value) and "bad.jsonl:1" in str(e.value), str(e.value)


def test_vstar_annotations_read_as_published_with_their_xywh_boxes(layouts, tmp_path):
    """V*'s per-image `sa_<n>.json` beside `sa_<n>.jpg`: boxes [x, y, w, h] (one target or two), options[0]
    right, read as the lettered question test_questions.jsonl asks; the targets reach zoom_on_target."""
    from vlmexp.tools.zoom import ZoomCounts, answer_zoom_metrics

    root = layouts["vstar"].parent
    source, records = _sample(tmp_path / "glob", root / "*" / "sa_*.json")
    assert source.record_format == "vstar_annotation" and len(records) == 4
    direct, relative = records[0], records[2]  # direct_attributes/ sorts first
    assert direct.problem == ("What is the colour of the glove?\n(A) red\n(B) blue\n(C) green\n(D) yellow\n"
                              "Answer with the option's letter from the given choices directly.")
    assert (direct.solution, direct.method, direct.task) == ("A", "mcq", "exact")
    assert direct.images == [str(root / "direct_attributes" / "sa_1000.jpg")]
    assert direct.box == [4.0, 6.0, 34.0, 36.0] and direct.boxes is None  # [4, 6, 30, 30] as x, y, w, h
    assert direct.extra == {"target_object": ["glove"]}
    assert relative.box is None
    assert relative.boxes == [[10.0, 60.0, 30.0, 90.0], [110.0, 50.0, 150.0, 90.0]]
    assert reward_columns(relative)["bbox"] == relative.boxes
    assert reward_columns(direct)["bbox"] == direct.box
    # the glove held, no zoom; a crop over both targets (held), one over the cup only (not held)
    crops = [[[0, 0, 34, 36]], [], [[0, 40, 160, 120]], [[0, 50, 60, 100]]]
    metrics = answer_zoom_metrics([ZoomCounts(zooms=len(c)) for c in crops], crops,
                                  [r.targets for r in records])
    assert metrics["zoom_on_target"] == 2 / 4
    _, one_folder = _sample(tmp_path / "folder", root / "relative_position")  # a category's folder
    assert [r.boxes for r in one_folder] == [relative.boxes] * 2


def test_box_lists_of_an_unnamed_form_are_refused_and_box_form_names_it(tmp_path):
    make_png(tmp_path / "a.png", (64, 48))
    rows = [{"image": "a.png", "question": "q", "answer": "red", "bbox": [[4, 6, 30, 30]]}]
    path = write_jsonl(tmp_path / "vqa.jsonl", rows)
    with pytest.raises(DataError) as e:
        _sample(tmp_path / "unnamed", path)
    text = str(e.value)
    assert "vqa.jsonl:1" in text and "bbox [[4, 6, 30, 30]] lists 1 box(es)" in text
    assert "`box_form: xywh`" in text and "`box_form: xyxy`" in text
    for form, box in (("xywh", [4.0, 6.0, 34.0, 36.0]), ("xyxy", [4.0, 6.0, 30.0, 30.0])):
        result = sample_sources([DataSource(json_path=str(path), box_form=form)],
                                tmp_path / form / "s.jsonl", 0)
        assert read_sampled(result.path)[0].box == box
    rec = write_jsonl(tmp_path / "rec.jsonl",
                      [{"image": "a.png", "problem": "the dot", "solution": [4, 6, 30, 30]}])
    result = sample_sources([DataSource(json_path=str(rec), box_form="xywh")], tmp_path / "r" / "s.jsonl", 0)
    assert read_sampled(result.path)[0].solution == [4.0, 6.0, 34.0, 36.0]
    write_jsonl(tmp_path / "vqa.jsonl", [{**rows[0], "bbox": [[4, 6, 0, 30]]}])
    with pytest.raises(DataError) as e:
        sample_sources([DataSource(json_path=str(path), box_form="xywh")], tmp_path / "w" / "s.jsonl", 0)
    assert "bbox [4.0, 6.0, 0.0, 30.0] is [x, y, w, h] (box_form xywh) with a width or height of 0" in \
        str(e.value)


def test_bad_target_box_and_unknown_deepeyes_style_are_refused(tmp_path):
    make_png(tmp_path / "a.png", (64, 48))
    path = write_jsonl(tmp_path / "vqa.jsonl", [
        {"image": "a.png", "question": "q", "answer": "red", "bbox": [10, 10, 80, 20]},
        {"image": "a.png", "question": "q", "answer": "red", "bbox": "somewhere"}])
    with pytest.raises(DataError) as e:
        _sample(tmp_path, path)
    text = str(e.value)
    assert "vqa.jsonl:1" in text
    assert "the target's box [10.0, 10.0, 80.0, 20.0] lies outside the 64x48" in text
    assert "vqa.jsonl:2" in text and "bbox 'somewhere' holds no box" in text
    row = {"prompt": [{"role": "user", "content": "<image>q"}], "images": ["a.png"],
           "reward_model": {"ground_truth": "red", "style": "human"}}
    with pytest.raises(DataError) as e:
        _sample(tmp_path / "d", write_jsonl(tmp_path / "deepeyes.jsonl", [row]))
    assert "reward_model.style 'human' is not one of model, rule" in str(e.value)


@pytest.mark.slow
def test_sft_on_tool_use_trains_the_calls_and_answer_and_feeds_the_crops(layouts, tmp_path, tiny_models):
    """A real SFT step on TRL's and ms-swift's tool conversations: weights change, every forward sees the
    crops (two images a record), the labelled tokens are the assistant's calls and answers and nothing of the
    tool turns, and the crop's pixels change the loss."""
    import torch
    from safetensors.torch import load_file
    from transformers import TrainerCallback
    from trl.chat_template_utils import get_training_chat_template
    from trl.data_utils import prepare_multimodal_messages
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from vlmexp.checks.loader import load_config
    from vlmexp.families import get_family
    from vlmexp.processor import load_processor
    from vlmexp.train.data import build_dataset
    from vlmexp.train.sft import run_sft

    base = tiny_models["qwen2_5_vl"]
    data = tmp_path / "data.yaml"
    data.write_text(yaml.safe_dump({"datasets": [{"json_path": str(layouts["trl_tools"])},
                                                 {"json_path": str(layouts["swift_agent"])}]}))
    cfg = load_config(REPO / "configs/demo.yaml", [
        f"run.output_dir={tmp_path / 'sft'}", "tracking.backend=none", f"model.path={base}", "data.demo=null",
        f"data.data_yaml={data}", "sft.args.max_steps=1", "sft.args.per_device_train_batch_size=4",
        "sft.args.learning_rate=1e-3", "sft.args.warmup_steps=0", "sft.args.max_length=512"])

    class SeenImages(TrainerCallback):
        """The images each forward's vision tower receives (rows of image_grid_thw)."""

        seen: list[int] = []

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            visual = next(m for name, m in model.named_modules() if name.endswith("visual"))
            visual.register_forward_hook(lambda m, a, kw, out: self.seen.append(len(kw["grid_thw"])),
                                         with_kwargs=True)

    final = run_sft(cfg, callbacks=[SeenImages()])
    before, after = load_file(base / "model.safetensors"), load_file(final / "model.safetensors")
    assert any(not (before[k] == after[k]).all() for k in before), "SFT changed no parameter"
    assert SeenImages.seen == [8], SeenImages.seen  # 4 records x (the image + the crop)

    family = get_family("qwen2_5_vl")
    processor = load_processor(str(final), family, cfg.model.image_knobs)
    rows = build_dataset(Path(cfg.run.output_dir) / "data" / "train.jsonl", cfg.data, family,
                         family.image_budget(processor), "sft")
    assert rows.column_names == ["messages", "images"] and len(rows[0]["images"]) == 1
    collator = DataCollatorForVisionLanguageModeling(processor, assistant_only_loss=True,
                                                     chat_template=get_training_chat_template(processor))
    row = dict(rows[0])
    batch = collator([dict(row)])
    labelled = processor.tokenizer.decode(batch["input_ids"][0][batch["labels"][0] != -100])
    assert labelled == f"{CALL}<|im_end|>\n<answer>red</answer><|im_end|>\n"
    assert len(batch["image_grid_thw"]) == 2
    # rendered as GRPO's rollouts render the same turns (the family's template with tools, TRL's tool_calls)
    structured = [*row["messages"][:1], {"role": "assistant", "content": "<think>It is small.</think>",
                                         "tool_calls": [{"type": "function", "function": {
                                             "name": "image_zoom_in_tool", "arguments": ARGUMENTS}}]},
                  *row["messages"][2:]]
    text, grpo_text = (processor.apply_chat_template(prepare_multimodal_messages(m, row["images"]),
                                                     tokenize=False) for m in (row["messages"], structured))
    assert text == grpo_text and "<|im_start|>user\n<tool_response>\n<|vision_start|><|image_pad|>" in text

    from vlmexp.modeling import load_for_inference

    model = load_for_inference(cfg, str(final))[0]
    crop = next(p for p in row["messages"][2]["content"] if p["type"] == "image")["image"]
    other = make_png(tmp_path / "other_crop.png", (32, 32), "white")
    with torch.no_grad():
        loss = model(**batch).loss
        crop_part = next(p for p in row["messages"][2]["content"] if p["type"] == "image")
        crop_part["image"] = str(other)
        swapped = model(**collator([row])).loss
    assert Path(crop).is_file() and torch.isfinite(loss) and loss != swapped


def test_a_truncation_saved_with_a_checkpoint_is_not_applied_by_later_stages(tiny_models, tmp_path):
    """TRL's SFT collator truncates through the fast tokenizer, which saves that state with the checkpoint;
    loaded again, it cut GRPO's prompt (the tools block made it longer than sft.args.max_length) and its image
    tokens. The processor vlmexp loads tokenizes in full."""
    import shutil

    from vlmexp.families import get_family
    from vlmexp.processor import load_processor

    folder = tmp_path / "saved"
    shutil.copytree(tiny_models["qwen2_5_vl"], folder)
    family = get_family("qwen2_5_vl")
    processor = load_processor(folder, family)
    processor.tokenizer("x " * 100, truncation=True, max_length=16)  # as the SFT collator calls it
    processor.save_pretrained(folder)
    assert json.loads((folder / "tokenizer.json").read_text())["truncation"]["max_length"] == 16
    again = load_processor(folder, family)
    assert len(again.tokenizer("x " * 100)["input_ids"]) > 16
    assert len(again(text=["x " * 100])["input_ids"][0]) > 16
