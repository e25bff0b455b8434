"""The zoom demo's data (vlmexp.data.zoom_demo): the colour cannot be read at the model's budget and can in
the zoom's crop; the demonstrations' calls are in the model's frame and their crops are the zoom tool's own;
the data is sampled into tool-use records and is the same for a seed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vlmexp.checks.loader import load_config
from vlmexp.data.record import read_sampled
from vlmexp.data.run_data import prepare_data

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def zoom_run(tmp_path_factory):
    """The demo config's data with its annotator's windows moved off the target (data.zoom_demo.
    annotator_offset) and close-ups of the crops that hold it, generated and sampled small: (config, train
    records, val records)."""
    out = tmp_path_factory.mktemp("zoom-demo")
    cfg = load_config(REPO / "configs/demo_zoom.yaml", [f"run.output_dir={out}", "data.zoom_demo.train=32",
                                                         "data.zoom_demo.val=8", "data.zoom_demo.closeup=1.0",
                                                         "data.zoom_demo.annotator_offset=0.75",
                                                         "tracking.backend=none"])
    prepared = prepare_data(cfg)
    return cfg, read_sampled(prepared.train), read_sampled(prepared.val)


def _interior(image, box, scale: float, frame: int) -> np.ndarray:
    """The mean colour inside the target's `frame` of `image` (`box` in original pixels, `scale` the
    image's)."""
    x1, y1, x2, y2 = (int(round(v * scale)) for v in box)
    inset = max(1, int(round((frame + 1) * scale)))
    return np.asarray(image, dtype=float)[y1 + inset:y2 - inset, x1 + inset:x2 - inset].reshape(-1, 3).mean(0)


def _demodulated(image, box, frame: int) -> np.ndarray:
    """The colour the target's checkerboard writes (its pixels where x + y is even, in the image's
    coordinates), read at full resolution inside its `frame`."""
    x1, y1, x2, y2 = (int(v) for v in box)
    pixels = np.asarray(image, dtype=float)
    inner = [pixels[y, x] for y in range(y1 + frame, y2 - frame) for x in range(x1 + frame, x2 - frame)
             if (x + y) % 2 == 0]
    return np.mean(inner, axis=0)


def test_colour_hidden_at_the_budget_and_shown_by_the_zoom(zoom_run, tiny_models):
    from PIL import Image

    from vlmexp.coords import from_frame
    from vlmexp.data.zoom_demo import COLOURS, box_frame_of, holds, window_box
    from vlmexp.families import get_family
    from vlmexp.processor import load_processor
    from vlmexp.tools.zoom import crop_box

    cfg, train, val = zoom_run
    family = get_family("qwen2_5_vl")
    processor = load_processor(tiny_models["qwen2_5_vl"], family, cfg.model.image_knobs)
    budget = family.image_budget(processor)
    frame = box_frame_of(cfg)
    assert frame.budget == budget and frame.frame == "pixels"  # the calls are in the processor's own frame
    processed = processor.image_processor(images=[Image.open(train[0].images[0])], return_tensors="pt")
    assert processed["image_grid_thw"].tolist() == [[1, 8, 8]]  # 224 px shrunk to 112: 16 vision tokens
    colours, direct, closeups, held = set(), 0, [], set()
    reach = cfg.data.zoom_demo.annotator_offset * 112 + 1  # pixels a window moves off the centred one
    for record in train:
        assert record.record_format == "messages" and record.solution in COLOURS and record.box is not None
        image = Image.open(record.images[0]).convert("RGB")
        if record.images[0].endswith("_crop.png"):  # a close-up (data.zoom_demo.closeup): the crop, answered
            assert not record.tool_turns and len(record.images) == 1 and image.size == (112, 112)
            assert record.target == (f"<think>The square is large enough to see.</think><answer>"
                                     f"{record.solution}</answer>")
            assert 0 <= record.box[0] < record.box[2] <= 112 and 0 <= record.box[1] < record.box[3] <= 112
            shown = _demodulated(image, record.box, cfg.data.zoom_demo.frame)  # read where the crop shows it
            assert np.abs(shown - np.array(COLOURS[record.solution])).max() < 1
            closeups.append(record)
            continue
        seen = image.resize((112, 112), Image.BICUBIC)  # as the processor shrinks it
        grey = _interior(seen, record.box, 112 / image.width, cfg.data.zoom_demo.frame)
        assert np.ptp(grey) < 8, (record.solution, grey)  # every colour the same grey at the budget
        if not record.tool_turns:  # answered without the tool (data.zoom_demo.direct)
            assert len(record.images) == 1 and record.target == (
                f"<think>The square is too small to see.</think><answer>{record.solution}</answer>")
            direct += 1
            continue
        crop = Image.open(record.images[1]).convert("RGB")
        written = record.tool_turns[0]["content"].split("<tool_call>\n")[1]
        call = json.loads(written.split("\n</tool_call>")[0])
        assert call["name"] == "image_zoom_in_tool"
        assert record.tool_turns[1] == {"role": "tool", "content": "", "images": 1}
        cropped = crop_box(call["arguments"]["bbox_2d"], image.width, image.height, "pixels", budget,
                           28)
        assert np.array_equal(np.asarray(crop), np.asarray(image.crop(tuple(cropped))))  # the tool's crop
        window = from_frame(call["arguments"]["bbox_2d"], image.width, image.height, "pixels", budget)
        assert [round(v) for v in window] == cropped  # a half-image window: the crop itself
        assert cropped[2] - cropped[0] == cropped[3] - cropped[1] == 112
        assert all(v % 2 == 0 for v in cropped)  # on even pixels: the checkerboard's phase
        centred = window_box(record.box, 224, 0.5, centred=True)  # the window centred on the target, moved
        for axis in (0, 1):  # off it by up to the annotator's offset, or to an edge
            moved = abs(cropped[axis] - centred[axis])
            assert moved <= reach or cropped[axis] in (0, 112), (centred, cropped)
        if holds(cropped, record.box):
            held.add(record.images[1])
        shown = _demodulated(image, record.box, cfg.data.zoom_demo.frame)
        assert np.abs(shown - np.array(COLOURS[record.solution])).max() < 1  # the zoom shows the colour
        assert record.target.endswith(f"<answer>{record.solution}</answer>")
        colours.add(record.solution)
    assert colours == set(COLOURS) and 0 < direct < len(train)
    # each close-up is a demonstration's crop, with its answer
    demonstrations = {r.images[1]: r for r in train if r.tool_turns}
    assert closeups and all(demonstrations[r.images[0]].solution == r.solution for r in closeups)
    assert {r.images[0] for r in closeups} == held != set(demonstrations)  # only crops that hold the target
    assert [r.record_format for r in val] == ["vqa"] * 8 and all(r.tool_turns == [] for r in val)
    # the colours take turns: one answer for all scores a quarter
    assert sorted(r.solution for r in val) == sorted([*COLOURS] * 2)
    assert all(len(r.images) == 1 and r.box is not None for r in val)


def test_same_seed_same_data_another_frame_another_folder(zoom_run, tmp_path):
    from vlmexp.data.zoom_demo import box_frame_of, make_zoom_demo_data, scenes_of, zoom_folder_name

    cfg, _, _ = zoom_run
    demo, frame = cfg.data.zoom_demo.model_copy(update={"train": 6, "val": 2}), box_frame_of(cfg)
    a = make_zoom_demo_data(tmp_path / "a", frame, 6, 2, 0, scenes_of(demo))
    b = make_zoom_demo_data(tmp_path / "b", frame, 6, 2, 0, scenes_of(demo))
    assert (a / "train.jsonl").read_bytes() == (b / "train.jsonl").read_bytes()
    crop = "images/train_00003_crop.png"
    assert (a / crop).read_bytes() == (b / crop).read_bytes()
    grid = cfg.model_copy(update={"model": cfg.model.model_copy(update={"max_pixels": 50176,
                                                                         "min_pixels": 50176})})
    assert zoom_folder_name(demo, box_frame_of(grid)) != zoom_folder_name(demo, frame)
    no_family = cfg.model_copy(update={"model": cfg.model.model_copy(update={"family": None})})
    with pytest.raises(ValueError, match="name model.family"):
        box_frame_of(no_family)
    with pytest.raises(ValueError, match=r"frame 9 leaves no colour inside the smallest target "
                       r"\(18 pixels\): give target a low side above 20"):
        load_config(REPO / "configs/demo_zoom.yaml", [f"run.output_dir={tmp_path}", "data.zoom_demo.frame=9",
                                                      "data.zoom_demo.target=[18, 24]"])


def test_the_offset_annotator_clips_or_misses_the_target_and_zero_offset_holds_it(zoom_run, tmp_path):
    """data.zoom_demo.annotator_offset: the half-image window moved off the target by up to that share of its
    side holds the whole target only sometimes and misses its colour sometimes, on even pixels inside the
    image; without it every window holds the target. It needs a window to move."""
    import random

    from vlmexp.data.zoom_demo import box_frame_of, crop_window, holds, make_image, scenes_of, zoom_call

    cfg, _, _ = zoom_run
    frame, border = box_frame_of(cfg), cfg.data.zoom_demo.frame

    def shares(offset: float) -> tuple[float, float]:
        scenes = scenes_of(cfg.data.zoom_demo.model_copy(update={"annotator_offset": offset}))
        rng, noise, held, missed = random.Random(0), random.Random(1), 0, 0
        for _ in range(200):
            image, _, box = make_image(rng, scenes)
            crop = crop_window(image, zoom_call(noise, box, scenes, frame), frame)
            assert crop[2] - crop[0] == crop[3] - crop[1] == 112 and all(v % 2 == 0 for v in crop)
            assert 0 <= crop[0] and 0 <= crop[1] and crop[2] <= 224 and crop[3] <= 224
            held += holds(crop, box)
            inner = [box[0] + border, box[1] + border, box[2] - border, box[3] - border]
            missed += (min(crop[2], inner[2]) <= max(crop[0], inner[0])
                       or min(crop[3], inner[3]) <= max(crop[1], inner[1]))
        return held / 200, missed / 200

    assert cfg.data.zoom_demo.annotator_offset == 0.75
    held, missed = shares(0.75)
    assert 0.2 <= held <= 0.5 and 0.1 <= missed <= 0.3, (held, missed)
    assert shares(0.0) == (1.0, 0.0)
    with pytest.raises(ValueError, match=r"annotator_offset 0.5 moves the annotator's window: set "
                       r"annotator_window \(e.g. 0.5\) too, or annotator_offset: 0"):
        load_config(REPO / "configs/demo_zoom.yaml", [f"run.output_dir={tmp_path}",
                                                      "data.zoom_demo.annotator_window=0",
                                                      "data.zoom_demo.annotator_offset=0.5"])


@pytest.mark.slow
def test_the_zoom_demo_config_runs_sft_grpo_with_the_tool_and_both_evaluations(zoom_run, tiny_models):
    """The demo's recipe at a few records: SFT on the tool-use demonstrations (their prompts open with the
    tools block GRPO's prompts show), GRPO from it with the zoom tool, evaluation with and without the tool;
    each training stage changes the weights."""
    from safetensors.torch import load_file

    from vlmexp.evaluate import evaluate
    from vlmexp.train.grpo import run_grpo
    from vlmexp.train.sft import build_sft_trainer
    from vlmexp.train.stage import train_and_save

    cfg, _, _ = zoom_run
    cfg = load_config(REPO / "configs/demo_zoom.yaml", [
        f"run.output_dir={cfg.run.output_dir}", "data.zoom_demo.train=24", "data.zoom_demo.val=8",
        "tracking.backend=none", f"model.path={tiny_models['qwen2_5_vl']}", "model.family=qwen2_5_vl",
        "model.tiny=null", "sft.args.max_steps=2",
        "sft.args.per_device_train_batch_size=4", "grpo.args.max_steps=1",
        "grpo.args.per_device_train_batch_size=8", "grpo.args.num_generations=4",
        "grpo.args.max_completion_length=96", "grpo.args.warmup_steps=0", "eval.max_new_tokens=64",
        "eval.max_samples=4",
        # a reward with spread (the untrained model's answers all score 0 on accuracy: no gradient)
        "grpo.rewards=[{name: 'rewards_for_tests:char_variety'}, {name: exact, weight: 1.0}]"])
    base = load_file(tiny_models["qwen2_5_vl"] / "model.safetensors")
    trainer, inputs, rows = build_sft_trainer(cfg)
    batch = trainer.data_collator([trainer.train_dataset[0]])
    system = inputs.processor.tokenizer.decode(batch["input_ids"][0]).split("<|im_start|>user")[0]
    assert "<tools>" in system and '"name": "image_zoom_in_tool"' in system, system  # as GRPO's prompts
    sft = train_and_save(trainer, inputs, rows)
    grpo = run_grpo(cfg, str(sft))
    after_sft, after_grpo = (load_file(p / "model.safetensors") for p in (sft, grpo))
    assert any(not (base[k] == after_sft[k]).all() for k in base), "SFT changed no parameter"
    assert any(not (after_sft[k] == after_grpo[k]).all() for k in base), "GRPO changed no parameter"
    result = evaluate(cfg, str(grpo), Path(cfg.run.output_dir) / "data" / "val.jsonl",
                      Path(cfg.run.output_dir) / "eval")
    assert result.metrics["count"] == 4
    assert {"exact_accuracy", "tool_exact_accuracy", "tool_zooms_per_answer"} <= set(result.metrics)


def test_direct_answers_are_rendered_without_the_tools_block_beside_the_demonstrations(tmp_path):
    """data.zoom_demo.direct: records answered without the tool. In a batch with zoom demonstrations, each
    demonstration opens with the tools block and each direct answer has none (as evaluation without the tool
    prompts); every row is what the template renders for it alone, and the images stay with their rows."""
    import torch

    from vlmexp.train.sft import build_sft_trainer

    cfg = load_config(REPO / "configs/demo_zoom.yaml", [
        f"run.output_dir={tmp_path}", "data.zoom_demo.train=12", "data.zoom_demo.val=2",
        "data.zoom_demo.direct=0.5", "tracking.backend=none"])
    trainer, inputs, _ = build_sft_trainer(cfg)
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    tools = [r for r in rows if any(m["role"] == "tool" for m in r["messages"])]
    direct = [r for r in rows if r not in tools]
    assert tools and direct
    tokenizer = inputs.processor.tokenizer
    alone = [trainer.data_collator([r]) for r in (direct[0], tools[0])]
    batch = trainer.data_collator([direct[0], tools[0]])  # rendered demonstrations first
    texts = [tokenizer.decode(ids, skip_special_tokens=False) for ids in batch["input_ids"]]
    assert "<tools>" in texts[0] and "<tool_response>" in texts[0], texts[0]
    assert "<tools>" not in texts[1] and "<tool_call>" not in texts[1], texts[1]
    shown = int((batch["input_ids"][0] != tokenizer.pad_token_id).sum())  # the tools block as one token
    assert shown < 250, f"a demonstration is {shown} tokens: model.tiny.tools_block_token did not shorten it"
    for row, single in zip(batch["input_ids"], (alone[1], alone[0]), strict=True):
        kept = row[row != tokenizer.pad_token_id]
        assert torch.equal(kept, single["input_ids"][0][single["input_ids"][0] != tokenizer.pad_token_id])
    assert torch.equal(batch["pixel_values"], torch.cat([alone[1]["pixel_values"], alone[0]["pixel_values"]]))
    assert batch["image_grid_thw"].shape[0] == 3  # the demonstration's image and crop, the direct answer's
    labels = batch["labels"][1][batch["labels"][1] != -100]
    assert tokenizer.decode(labels).startswith("<think>The square is too small to see.</think><answer>")
