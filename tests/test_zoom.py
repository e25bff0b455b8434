"""Thinking with images: multi-turn GRPO with the zoom tool (grpo.tools) on the tiny Qwen2.5-VL and Qwen3-VL,
through TRL's own tool loop. A scripted policy (tests/zoom_script.py) makes the random model write tool calls
and answers through HF generate; everything else (parsing, the tool, the tool turn, the loss) is the real
path."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import write_jsonl

from vlmexp.checks.loader import load_config

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))  # zoom_script

SIDE = 112
TARGET = (56, 28, 84, 56)  # the red square, original pixels


def scene(path: Path):
    """A white image with a red square at TARGET."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIDE, SIDE), "white")
    ImageDraw.Draw(image).rectangle((TARGET[0], TARGET[1], TARGET[2] - 1, TARGET[3] - 1), fill=(255, 0, 0))
    image.save(path)
    return image


def write_records(folder: Path, scripts: list[str], bbox: bool = False) -> Path:
    """One VLM-R1 conversations record per script name, each on the same scene, answer 'red' (with the
    target's box, V*-style, where `bbox`)."""
    folder.mkdir(parents=True, exist_ok=True)
    scene(folder / "scene.png")
    return write_jsonl(folder / "records.jsonl", [
        {"image": "scene.png", "accu_reward_method": "all_match", "conversations": [
            {"from": "human", "value": f"<image>What colour is the square? [script:{name}]"},
            {"from": "gpt", "value": "red"}], **({"bbox": list(TARGET)} if bbox else {})}
        for name in scripts])


def tool_cfg(out: Path, model: Path, records: Path, *overrides: str):
    data = (f"data.datasets=[{{json_path: {records}, task: exact}}]", f"data.val_datasets=[{{json_path: "
            f"{records}, task: exact}}]")
    return load_config(REPO / "configs/demo.yaml", [
        f"run.output_dir={out}", "tracking.backend=none", f"model.path={model}", "data.demo=null", *data,
        "sft.enabled=false", "grpo.tools.names=[zoom]", "grpo.tools.max_turns=2",
        "grpo.rewards=[{name: exact, kwargs: {default_match: exact}}, {name: tool}]",
        "grpo.args.max_completion_length=400", "grpo.args.logging_steps=1", "grpo.args.save_steps=100",
        "grpo.args.temperature=1.0", *overrides])


def frame_box(family, budget, box=TARGET) -> list[int]:
    from vlmexp.coords import to_frame

    return [round(v) for v in to_frame(box, SIDE, SIDE, family.box_frame, budget)]


def scripted(trainer_model, processor, family, budget):
    """The scripted policy on the model, and a record of the pixel rows the vision tower receives:
    [(grad enabled, pixel_values, grid_thw)]."""
    from zoom_script import ScriptedTurns, call

    box = frame_box(family, budget)
    script = ScriptedTurns(processor.tokenizer, {
        "zoom": ["<think>Too small to see.</think>\n" + call(box), "<answer>red</answer>"],
        "outside": [call([5000, 5000, 6000, 6000]), "<answer>red</answer>"],
        "malformed": ['<tool_call>\n{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [1, 2]}}\n'
                      '</tool_call>', "<tool_call>{oops</tool_call>"],
        "forever": [call(box)]})
    model = trainer_model.get_base_model() if hasattr(trainer_model, "get_base_model") else trainer_model
    model.register_forward_hook(script.hook, with_kwargs=True)
    seen = []

    def vision(module, args, kwargs):
        import torch

        pixels = args[0] if args else kwargs["hidden_states"]
        seen.append((torch.is_grad_enabled(), pixels.detach().clone()))

    model.model.visual.register_forward_pre_hook(vision, with_kwargs=True)
    return seen


def holds_rows(pixels, rows) -> bool:
    """Whether `rows` ([n, d]) sit as one block in `pixels` ([N, d])."""
    import torch

    n = rows.size(0)
    return any(torch.equal(pixels[i:i + n], rows) for i in range(pixels.size(0) - n + 1))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_grpo_zooms_through_trls_tool_loop_and_the_loss_sees_the_crop(tmp_path, tiny_models, family):
    """One GRPO step of 4 prompts x 2 completions: a zoom then the answer, a box outside the image, malformed
    calls, calls past max_turns. The crop (not the full image) is what the second turn and the loss forward
    see; every problem is counted in its own metric and the run goes on."""
    from PIL import Image

    from vlmexp.tools.zoom import crop_box
    from vlmexp.train.grpo import build_grpo_trainer
    from vlmexp.train.stage import train_and_save

    records = write_records(tmp_path / "data", ["zoom", "outside", "malformed", "forever"])
    cfg = tool_cfg(tmp_path / "out", tiny_models[family], records, "grpo.args.max_steps=1",
                   "grpo.args.per_device_train_batch_size=8", "grpo.args.num_generations=2",
                   "grpo.args.gradient_accumulation_steps=1")
    trainer, inputs, rows = build_grpo_trainer(cfg)
    seen = scripted(trainer.model, inputs.processor, inputs.family, inputs.budget)
    train_and_save(trainer, inputs, rows)

    logs = {k: v for h in trainer.state.log_history for k, v in h.items()}
    # zoom: 1 zoom each; forever: 2 zooms each (max_turns 2), then a call not run; outside: refused;
    # malformed: a call with two numbers (refused) then one the parser cannot read
    assert logs["zoom/zooms_per_completion"] == pytest.approx((2 * 1 + 2 * 2) / 8)
    assert logs["zoom/zoomed_share"] == pytest.approx(4 / 8)
    assert (logs["zoom/outside"], logs["zoom/malformed"], logs["zoom/over_limit"], logs["zoom/cut"]) == (
        2, 4, 2, 0)
    # right and zoomed: the two "zoom" completions; "outside" answered right without a zoom
    assert logs["rewards/tool/mean"] == pytest.approx(2 / 8)
    assert logs["rewards/exact/mean"] == pytest.approx(4 / 8)
    assert logs["tools/call_frequency"] == pytest.approx((2 + 2 + 2 + 4) / 8)  # the unreadable call: none
    # the crop's pixel rows, as the processor makes them from the crop of the original image
    image = Image.open(records.parent / "scene.png").convert("RGB")
    crop = image.crop(tuple(crop_box(frame_box(inputs.family, inputs.budget), SIDE, SIDE,
                                     inputs.family.box_frame, inputs.budget, 28)))
    crop_rows = inputs.processor.image_processor(images=[crop], return_tensors="pt")["pixel_values"]
    full_rows = inputs.processor.image_processor(images=[image], return_tensors="pt")["pixel_values"]
    assert crop_rows.shape != full_rows.shape
    generation = [p for grad, p in seen if not grad]
    loss = [p for grad, p in seen if grad]
    assert not holds_rows(generation[0], crop_rows)  # the first turn: the record's image alone
    assert any(holds_rows(p, crop_rows) for p in generation[1:])  # the turn after the call sees the crop
    assert len(loss) == 1 and holds_rows(loss[0], crop_rows) and holds_rows(loss[0], full_rows)
    # 4 prompts x 2: 8 full images, + 2 crops (zoom) + 2 x 2 (forever)
    assert loss[0].size(0) == 8 * full_rows.size(0) + 6 * crop_rows.size(0)


@pytest.mark.slow
def test_a_share_of_the_prompts_comes_without_the_tools(tmp_path, tiny_models):
    """grpo.tools.without 0.5: half the prompts (the same ones at every build) are rendered without the tools
    block, the others with it, in one GRPO step; the tool rewards and the zoom metrics count the prompts that
    offered the tool alone (every one of those zoomed and answered right: their means are 1, where the
    tool-less half would halve them)."""
    from vlmexp.tools import WITH_TOOLS, WITHOUT_TOOLS
    from vlmexp.train.grpo import build_grpo_trainer
    from vlmexp.train.stage import train_and_save

    records = write_records(tmp_path / "data", ["zoom"] * 4)
    cfg = tool_cfg(tmp_path / "out", tiny_models["qwen2_5_vl"], records, "grpo.args.max_steps=1",
                   "grpo.args.per_device_train_batch_size=8", "grpo.args.num_generations=2",
                   "grpo.args.gradient_accumulation_steps=1", "grpo.tools.without=0.5",
                   "grpo.rewards=[{name: exact, kwargs: {default_match: exact}}, {name: tool}, "
                   "{name: zoom_target}]", "grpo.online_filter.enabled=false")
    trainer, inputs, rows = build_grpo_trainer(cfg)
    routed = list(trainer.train_dataset["environment"])
    assert sorted(routed) == sorted([WITH_TOOLS] * 2 + [WITHOUT_TOOLS] * 2), routed
    assert list(build_grpo_trainer(cfg)[0].train_dataset["environment"]) == routed  # the same rows again
    scripted(trainer.model, inputs.processor, inputs.family, inputs.budget)
    shown, tokenize = [], trainer._tokenize_prompts

    def recorded(prompts):
        out = tokenize(prompts)
        texts = [inputs.processor.tokenizer.decode(ids) for ids in out[0]]
        shown.extend(zip(list(trainer._batch_environments), texts, strict=True))
        return out

    trainer._tokenize_prompts = recorded
    train_and_save(trainer, inputs, rows)
    assert sorted(e for e, _ in shown) == sorted([WITH_TOOLS] * 4 + [WITHOUT_TOOLS] * 4), shown
    assert all(("<tools>" in text) == (e == WITH_TOOLS) for e, text in shown), shown
    logs = {k: v for h in trainer.state.log_history for k, v in h.items()}
    assert logs["rewards/tool/mean"] == pytest.approx(1.0)
    assert logs["zoom/zoomed_share"] == pytest.approx(1.0)
    assert logs["zoom/zooms_per_completion"] == pytest.approx(1.0)


def test_a_share_without_the_tools_is_refused_where_no_tool_is_offered():
    from vlmexp.errors import ConfigError

    with pytest.raises(ConfigError, match=r"without \(0.25\) is the share of prompts given without the "
                       r"tools, and names offers none; set names: \[zoom\]"):
        load_config(REPO / "configs/demo.yaml", ["grpo.tools.without=0.25"])


def test_masking_truncated_completions_is_refused_with_tools():
    """TRL's mask_truncated_completions zeroes the attention over a cut completion's crops (the fault the
    online filter's fill had: tests/test_online_filter.py); with tools it is refused before anything starts,
    naming the fix, and allowed without them."""
    from vlmexp.errors import ConfigError

    with pytest.raises(ConfigError, match=r"grpo.args.mask_truncated_completions: true hides the tools' "
                       r"images .* remove it, or raise grpo.args.max_completion_length"):
        load_config(REPO / "configs/demo_zoom.yaml", ["grpo.args.mask_truncated_completions=true"])
    load_config(REPO / "configs/demo.yaml", ["grpo.args.mask_truncated_completions=true"])


@pytest.mark.slow
def test_a_step_whose_calls_return_no_image_trains_on(tmp_path, tiny_models):
    """A GRPO step in which every tool call is refused (boxes outside the image, malformed calls), so no turn
    returns a crop: TRL's tool loop then reads the prompts' image fields, which vlmexp gives it as tensors
    (TRL 1.16 merges them as lists there and failed: "'list' object has no attribute 'prod'")."""
    from vlmexp.train.grpo import build_grpo_trainer
    from vlmexp.train.stage import train_and_save

    records = write_records(tmp_path / "data", ["outside", "malformed"])
    cfg = tool_cfg(tmp_path / "out", tiny_models["qwen2_5_vl"], records, "grpo.args.max_steps=1",
                   "grpo.args.per_device_train_batch_size=4", "grpo.args.num_generations=2",
                   "grpo.args.gradient_accumulation_steps=1")
    trainer, inputs, rows = build_grpo_trainer(cfg)
    scripted(trainer.model, inputs.processor, inputs.family, inputs.budget)
    train_and_save(trainer, inputs, rows)
    logs = {k: v for h in trainer.state.log_history for k, v in h.items()}
    assert trainer.state.global_step == 1
    assert (logs["zoom/outside"], logs["zoom/malformed"], logs["zoom/zoomed_share"]) == (2, 4, 0)


@pytest.mark.slow
def test_a_resumed_zoom_run_goes_on_with_the_tool_and_its_tables_show_the_zooms(tmp_path, tiny_models,
                                                                                mlflow_store):
    """Step 1 saves a checkpoint and stops; a second run resumes there and zooms again at step 2. Each step's
    completion table in MLflow (read back through MlflowClient) draws a zooming completion with its box on
    the image and the crop beside it; validation during training runs with the tool and logs its pictures."""
    from mlflow.tracking import MlflowClient
    from PIL import Image

    from vlmexp.train.grpo import build_grpo_trainer
    from vlmexp.train.stage import train_and_save
    from vlmexp.zoom_pictures import ZOOM_COLOURS

    out = mlflow_store(tmp_path / "out")
    records = write_records(tmp_path / "data", ["zoom", "forever"])
    steps = []
    for step in (1, 2):
        cfg = tool_cfg(out, tiny_models["qwen2_5_vl"], records, f"grpo.args.max_steps={step}",
                       "grpo.args.save_steps=1", "grpo.args.per_device_train_batch_size=4",
                       "grpo.args.num_generations=2", "tracking.backend=mlflow",
                       "tracking.completions_every=1", "tracking.completions_per_table=4",
                       "eval.every_steps=1", "eval.during_training_samples=2", "eval.max_new_tokens=120",
                       "eval.during_training_pictures=1")
        trainer, inputs, rows = build_grpo_trainer(cfg)
        scripted(trainer.model, inputs.processor, inputs.family, inputs.budget)
        train_and_save(trainer, inputs, rows)
        steps.append((inputs.resume_from, trainer.state.global_step))
        zoomed = [h["zoom/zoomed_share"] for h in trainer.state.log_history if "zoom/zoomed_share" in h]
        assert zoomed[-1] == 1.0  # both prompts zoom: the tool is there after the resume too
    assert steps[0] == (None, 1) and steps[1][0].endswith("checkpoint-1") and steps[1][1] == 2

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    # `vlmexp train` by hand: a run of its own each time (the pipeline passes its run to the resumed stage)
    runs = client.search_runs([client.get_experiment_by_name("demo").experiment_id], order_by=["start_time"])
    assert [[m.step for m in client.get_metric_history(r.info.run_id, "zoom/zooms_per_completion")]
            for r in runs] == [[1], [2]]
    run = runs[1]
    # validation during training, with the tool: scored on the final answers, drawn with the zooms
    # (the held-out records: zoom, then right; forever, no answer)
    assert run.data.metrics["val/tool_exact_accuracy"] == 0.5 and run.data.metrics["val/exact_accuracy"] == 0
    assert run.data.metrics["val/tool_zoomed_share"] == 1.0
    assert [a.path for a in client.list_artifacts(run.info.run_id, "images")
            if a.path.startswith("images/validation~zoom_00+step+2+")]
    table = json.loads(Path(client.download_artifacts(run.info.run_id, "completions/step_000002.json",
                                                      str(tmp_path / "dl"))).read_text())
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    zoomed = [r for r in rows if r["zooms"]]
    assert zoomed and all(r["zooms"][0] == [56, 28, 84, 56] for r in zoomed)
    picture = Image.open(client.download_artifacts(run.info.run_id, zoomed[0]["image"]["filepath"],
                                                   str(tmp_path / "dl"))).convert("RGB")
    scale = 256 / SIDE
    assert picture.width > 256  # the crops beside the image
    assert picture.getpixel((round(56 * scale) + 1, round(42 * scale))) == ZOOM_COLOURS[0]  # box 1's edge
    # the first crop, beside the image: the red square fills it
    assert picture.getpixel((256 + 40, 40))[0] > 200 and picture.getpixel((256 + 40, 40))[1] < 60


@pytest.mark.slow
def test_evaluation_with_the_tool_scores_the_final_answers_and_draws_the_zooms(tmp_path, tiny_models,
                                                                               mlflow_store):
    """Evaluation with the tool (Generator.converse, the records' own environments): the final answers are
    scored, zooms per answer and the share that zoomed counted, each record's zoom boxes written and drawn,
    each turn's prompt holds the turns before it as written,
    and the pipeline's evaluation run carries the tables and pictures (read back through MlflowClient);
    without the tool the same model answers in one turn."""
    from PIL import Image

    from vlmexp.data.record import read_sampled
    from vlmexp.data.run_data import prepare_data
    from vlmexp.evaluate import evaluate_with_tools
    from vlmexp.generation import Generator
    from vlmexp.modeling import load_for_inference
    from vlmexp.prompts import build_prompt, load_images
    from vlmexp.scoring import tool_modes
    from vlmexp.zoom_pictures import ZOOM_COLOURS

    records_file = write_records(tmp_path / "data", ["zoom", "outside", "forever"], bbox=True)
    cfg = tool_cfg(tmp_path / "out", tiny_models["qwen2_5_vl"], records_file, "eval.max_new_tokens=120",
                   "eval.pictures=3")
    assert tool_modes(cfg) == ("off", "on")  # eval.tools: auto, with grpo.tools on
    records = read_sampled(prepare_data(cfg).val)
    model, processor, family = load_for_inference(cfg, str(tiny_models["qwen2_5_vl"]))
    scripted(model, processor, family, family.image_budget(processor))
    generator = Generator.for_config(cfg, model, processor, family)
    prompts = [build_prompt(r, cfg.data, family) for r in records]
    plain = generator(prompts, [load_images(r.images) for r in records], 120, 0.0, 8)
    assert all("<tool_call>" in text for text in plain)  # without the tool: the call is the answer

    prompted: list[str] = []  # each turn's prompt, through the real generate
    generate_ids = generator.generate_ids
    generator.generate_ids = lambda texts, *rest: prompted.extend(texts) or generate_ids(texts, *rest)
    metrics = evaluate_with_tools(cfg, records, prompts, generator, tmp_path / "eval")
    # the next turn sees the turn as the model wrote it (its <think> included), then the tool's turn
    assert any("<|im_start|>assistant\n<think>Too small to see.</think>\n<tool_call>" in t
               and t.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
               for t in prompted), prompted

    # zoom: one zoom, right; outside: refused, then right; forever: two zooms, then a call not run
    assert metrics["tool_exact_accuracy"] == pytest.approx(2 / 3)
    assert metrics["tool_zooms_per_answer"] == pytest.approx(3 / 3)
    assert metrics["tool_zoomed_share"] == pytest.approx(2 / 3)
    assert metrics["tool_zoom_on_target"] == pytest.approx(2 / 3)  # both that zoomed cropped the whole TARGET
    assert (metrics["tool_zoom_outside"], metrics["tool_zoom_unanswered"]) == (1, 1)
    assert metrics["tool_reward_tool"] == pytest.approx(1 / 3)  # zoomed and right: the "zoom" record
    rows = {r["problem"].split("[script:")[1][:-1]: r
            for r in map(json.loads, (tmp_path / "eval" / "samples_tool.jsonl").read_text().splitlines())}
    assert rows["zoom"]["zooms"] == [list(TARGET)] and rows["zoom"]["answer"] == "red"
    assert rows["forever"]["zooms"] == [list(TARGET)] * 2 and rows["outside"]["zooms"] == []
    picture = Image.open(tmp_path / "eval" / "pictures_tool" / "record_000.png").convert("RGB")
    scale = 256 / SIDE
    assert picture.width > 256
    assert picture.getpixel((round(56 * scale) + 1, round(42 * scale))) == ZOOM_COLOURS[0]

    # `vlmexp eval` / the pipeline's evaluation step (here the random model, no script): both modes' metrics
    from vlmexp.evaluate import evaluate

    short = tool_cfg(tmp_path / "out", tiny_models["qwen2_5_vl"], records_file, "eval.max_new_tokens=16")
    result = evaluate(short, str(tiny_models["qwen2_5_vl"]), prepare_data(cfg).val, tmp_path / "eval_random")
    assert {"exact_accuracy", "tool_exact_accuracy", "tool_zooms_per_answer", "tool_zoomed_share",
            "tool_reward_tool"} <= set(result.metrics)
    assert len((tmp_path / "eval_random" / "samples_tool.jsonl").read_text().splitlines()) == 3

    # the pipeline's evaluation run: the tool's samples table and the zoom pictures
    from mlflow.tracking import MlflowClient

    from vlmexp.pipeline.report import log_evaluation_run
    from vlmexp.results import Evaluation
    from vlmexp.tracking.tracker import make_tracker

    write_jsonl(tmp_path / "eval" / "samples.jsonl", [])
    evaluation = Evaluation(name="grpo", model="m", metrics=metrics, samples=str(tmp_path / "eval" /
                            "samples.jsonl"), key="k", seconds=1.0)
    tracker = make_tracker(tool_cfg(mlflow_store(tmp_path / "run"), tiny_models["qwen2_5_vl"], records_file,
                                    "tracking.backend=mlflow"))
    parent = tracker.start_pipeline("zoom-pipeline", {}, {})
    log_evaluation_run(tracker, parent, [evaluation], [], None, None, 0, None)
    client = MlflowClient(tracker.uri)
    [run] = [r for r in client.search_runs([tracker.experiment_id]) if r.info.run_name == "eval"]
    assert run.data.metrics["grpo/tool_zoomed_share"] == pytest.approx(2 / 3)
    logged = Image.open(client.download_artifacts(run.info.run_id, "evaluation/grpo_zoom/record_000.png",
                                                  str(tmp_path / "dl"))).convert("RGB")
    assert logged.tobytes() == picture.tobytes()
    table = json.loads(Path(client.download_artifacts(run.info.run_id, "evaluation/grpo_samples_tool.json",
                                                      str(tmp_path / "dl"))).read_text())
    assert "zooms" in table["columns"] and len(table["data"]) == 3
