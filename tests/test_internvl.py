"""InternVL as the second family: the tiny model's processor round trip, tiles and image tokens as the
processor makes them, the image budget each family reads (the other refused), box frames both ways, the
vision/projector split that freezing and LoRA rely on, and (slow) one step of SFT, DPO and GRPO, evaluation
and export."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SMALL_BATCHES, make_png, write_jsonl

from vlmexp.checks.loader import load_config
from vlmexp.errors import ConfigError
from vlmexp.families import get_family

REPO = Path(__file__).resolve().parents[1]
INTERNVL = get_family("internvl")
SIZES = [[112, 112], [64, 64], [333, 217], [250, 64], [64, 250], [90, 700], [1000, 90], [2048, 1536],
         [29, 57]]


def test_processor_round_trip_keeps_its_class_tiles_and_tokens(tiny_models, tmp_path):
    from vlmexp.processor import load_processor

    proc = load_processor(tiny_models["internvl"], INTERNVL, {"min_patches": 2, "max_patches": 4})
    proc.save_pretrained(tmp_path / "p")
    saved = json.loads((tmp_path / "p" / "processor_config.json").read_text())
    assert saved["processor_class"] == "InternVLProcessor" and saved["image_seq_length"] == 16
    assert (saved["image_processor"]["min_patches"], saved["image_processor"]["max_patches"]) == (2, 4)
    tokenizer_config = json.loads((tmp_path / "p" / "tokenizer_config.json").read_text())
    assert tokenizer_config["processor_class"] == "InternVLProcessor"
    assert tokenizer_config["context_image_token"] == "<IMG_CONTEXT>"  # the attribute InternVLProcessor reads

    again = load_processor(tmp_path / "p", INTERNVL)
    assert INTERNVL.image_budget(again) == INTERNVL.image_budget(proc)
    assert again.image_token_id == again.tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>")
    assert type(again.image_processor).__name__ == "GotOcr2ImageProcessorPil"  # no torchvision needed


@pytest.mark.parametrize("patches", [(1, 1), (1, 6), (1, 12), (3, 8)])
def test_tiles_and_image_tokens_are_what_the_processor_makes(tiny_models, patches):
    """The family's arithmetic (sequence-length check, GRPO guard) against the processor, sizes odd, tall,
    wide."""
    from PIL import Image

    from vlmexp.processor import load_processor

    proc = load_processor(tiny_models["internvl"], INTERNVL,
                          dict(zip(("min_patches", "max_patches"), patches)))
    budget = INTERNVL.image_budget(proc)
    text = proc.apply_chat_template([{"role": "user",
                                      "content": [{"type": "image"}, {"type": "text", "text": "x"}]}],
                                    tokenize=False, add_generation_prompt=True)
    for width, height in SIZES:
        out = proc(text=[text], images=[Image.new("RGB", (width, height))], return_tensors="pt")
        rows = out["pixel_values"].shape[0]
        assert (rows == budget.tiles(width, height)
                == INTERNVL.layout_rows(INTERNVL.image_layout([[width, height]], budget)))
        tokens = int((out["input_ids"] == proc.image_token_id).sum())
        assert tokens == INTERNVL.image_tokens(width, height, budget) == rows * 16
        # what GRPOTrainer asks the image processor alone for (trl 1.16 `num_patches`, crop_to_patches=True)
        assert proc.image_processor(images=[Image.new("RGB", (width, height))], crop_to_patches=True,
                                    return_tensors="pt")["num_patches"].tolist() == [rows]


def test_released_tile_budget_matches_the_released_image_processor():
    from transformers import GotOcr2ImageProcessorPil

    released = GotOcr2ImageProcessorPil(size={"height": 448, "width": 448}, crop_to_patches=True,
                                        max_patches=12)
    budget = INTERNVL.released_budget({})
    assert ((budget.tile_size, budget.min_patches, budget.max_patches, budget.tokens_per_tile)
            == (448, 1, 12, 256))
    for width, height in SIZES:
        assert budget.tiles(width, height) == released.get_number_of_image_patches(height, width, {})


@pytest.mark.parametrize("model, needle", [
    ("{path: tiny:internvl, max_pixels: 100000}",
     ("model.max_pixels do(es) not apply to internvl: its image budget is model.min_patches / "
      "model.max_patches")),
    ("{path: tiny:qwen2_5_vl, max_patches: 6}",
     ("model.max_patches do(es) not apply to qwen2_5_vl: its image budget is model.min_pixels / "
      "model.max_pixels")),
    ("{path: OpenGVLab/InternVL3-2B-hf, family: internvl, min_pixels: 3136}",
     "model.min_pixels do(es) not apply"),
    ("{path: tiny:internvl, min_patches: 8, max_patches: 6}",
     "min_patches (8) exceeds max_patches (6): swap them"),
])
def test_each_family_reads_its_own_image_budget_and_refuses_the_other(tmp_path, model, needle):
    path = tmp_path / "c.yaml"
    path.write_text(f"model: {model}\ndata:\n  demo: {{train: 4, val: 2}}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert needle in "\n".join(str(p) for p in e.value.problems)


def test_a_folders_family_refuses_the_other_budget_at_validation_and_when_its_processor_loads(tiny_models,
                                                                                              tmp_path):
    from vlmexp.processor import load_processor

    path = tmp_path / "c.yaml"
    path.write_text(f"model: {{path: {tiny_models['internvl']}, max_pixels: 102400}}\ndata:\n"
                    "  demo: {train: 4, val: 2}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, check_paths=True)
    assert "model.max_pixels do(es) not apply to internvl" in "\n".join(str(p) for p in e.value.problems)
    assert load_config(path, ["model.max_pixels=null", "model.max_patches=4"],
                       check_paths=True).model.max_patches == 4

    with pytest.raises(ValueError,
                       match=r"model.max_pixels do\(es\) not apply to internvl.*remove model.max_pixels"):
        load_processor(tiny_models["internvl"], INTERNVL, {"min_pixels": None, "max_pixels": 102400})


def test_internvls_remote_code_checkpoints_are_refused_with_the_hf_ones_named(tmp_path):
    from vlmexp.families import detect_family

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "internvl_chat", "auto_map": {}}))
    with pytest.raises(ValueError,
                       match=r"model_type 'internvl_chat' is not supported: .*remote code; use .*-hf "
                             r"repositories \(e.g. OpenGVLab/InternVL3-2B-hf\)"):
        detect_family(tmp_path)


def test_demo_config_drops_the_bases_pixel_budget_for_tiles():
    cfg = load_config(REPO / "configs/demo_internvl.yaml")
    assert (cfg.model.family, cfg.model.min_pixels, cfg.model.max_pixels, cfg.model.max_patches) == (
        "internvl", None, None, 6)


def test_box_frame_both_ways_on_the_records(demo_data):
    """InternVL answers on [0, 1000) of the original image: SFT targets, rewards and evaluation map through
    it."""
    from PIL import Image

    from vlmexp.coords import from_frame, parse_box, to_frame
    from vlmexp.data.record import SampledRecord
    from vlmexp.prompts import target_text

    rng = random.Random(0)
    for record in json.loads((demo_data / "train.json").read_text())[:8]:
        (width, height), box = Image.open(demo_data / record["image"]).size, record["solution"]
        scaled = to_frame(box, width, height, INTERNVL.box_frame)
        assert scaled == pytest.approx([box[0] * 1000 / width, box[1] * 1000 / height, box[2] * 1000 / width,
                                        box[3] * 1000 / height])
        assert from_frame(scaled, width, height, INTERNVL.box_frame) == pytest.approx(box)
        sampled = SampledRecord(task="rec", method=None, problem=record["problem"], solution=box,
                                images=[str(demo_data / record["image"])], image_sizes=[[width, height]],
                                image_refs=[record["image"]], source=str(demo_data), source_id="",
                                source_row=0, record_format="rec")
        target = parse_box(target_text(sampled, INTERNVL, None))
        assert target == [round(v) for v in scaled]
        # no budget is needed: the frame ignores the tiling
        jitter = [v + rng.uniform(-0.5, 0.5) for v in box]
        assert (from_frame(to_frame(jitter, width, height, "grid1000"), width, height, "grid1000")
                == pytest.approx(jitter))


def test_score_reads_internvl_completions_in_its_frame_and_refuses_qwens_budget(tmp_path):
    # a 200 x 100 image, ground truth [20, 10, 60, 50] in pixels: [100, 100, 300, 500] on InternVL's grid
    make_png(tmp_path / "a.png", size=(200, 100))
    rec = {"image": "a.png", "problem": "p", "solution": [20, 10, 60, 50], "task": "rec"}
    preds = write_jsonl(tmp_path / "p.jsonl",
                        [{**rec, "completion": "<think>x</think><answer>[100, 100, 300, 500]</answer>"},
                         {**rec, "completion": "<think>x</think><answer>[20, 10, 60, 50]</answer>"}])
    run = [sys.executable, "-m", "vlmexp.cli", "score", str(preds), "--family", "internvl"]
    ok = subprocess.run([*run, "--max-patches", "6", "--per-sample", str(tmp_path / "s.jsonl")],
                        capture_output=True, text=True, cwd=REPO)
    assert ok.returncode == 0, ok.stderr[-2000:]
    scores = [json.loads(line)["score"] for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert scores[0] == pytest.approx(1.0) and scores[1] < 0.2  # pixels read as the grid miss
    bad = subprocess.run([*run, "--max-pixels", "250000"], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and "--max-pixels" in bad.stderr and "does not apply to internvl" in bad.stderr
    assert "use --min-patches / --max-patches" in bad.stderr


def test_freezing_and_lora_find_internvls_vision_tower_projector_and_language_model(tiny_models):
    from peft import LoraConfig, get_peft_model
    from transformers import InternVLForConditionalGeneration

    from vlmexp.config.stages import LM_LORA_TARGETS
    from vlmexp.modeling import freeze

    model = InternVLForConditionalGeneration.from_pretrained(tiny_models["internvl"])
    names = [n for n, _ in model.named_parameters()]
    assert (freeze(model, INTERNVL, vision=True, merger=False)
            == sum("model.vision_tower." in n for n in names))
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {n for n in names if n.startswith("model.vision_tower.")}
    assert (freeze(model, INTERNVL, vision=False, merger=True)
            == sum("multi_modal_projector" in n for n in names) > 0)

    lora = get_peft_model(InternVLForConditionalGeneration.from_pretrained(tiny_models["internvl"]),
                          LoraConfig(r=2, target_modules=LM_LORA_TARGETS))
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in lora.named_parameters() if ".lora_A" in n}
    # the vision tower's q/k/v_proj left alone
    assert wrapped and all(".language_model." in n for n in wrapped)
    assert (any(n.endswith("self_attn.q_proj") for n in wrapped)
            and any(n.endswith("mlp.down_proj") for n in wrapped))


def test_multi_turn_sft_is_refused_for_internvls_template_with_the_fix(tiny_models):
    """TRL 1.16 marks assistant turns only in templates it knows (Qwen2.5-VL's, Qwen3-VL's): InternVL's -hf
    template has no {% generation %} markers, so multi-turn SFT is refused before any step, naming what to
    do."""
    from types import SimpleNamespace

    from vlmexp.processor import load_processor
    from vlmexp.train.data import require_assistant_masks

    args = SimpleNamespace(assistant_only_loss=False)
    with pytest.raises(ConfigError,
                       match=r"model: chat_template: multi-turn records .* add the markers to its chat "
                             r"template, or sample single-turn records"):
        require_assistant_masks(args, load_processor(tiny_models["internvl"], INTERNVL))
    assert args.assistant_only_loss is False


def _cfg(tmp_path, *overrides):
    return load_config(REPO / "configs/demo_internvl.yaml",
                       [f"run.output_dir={tmp_path}", "tracking.backend=none",
                        "data.demo.train=16", "data.demo.val=4", *SMALL_BATCHES,
                        *overrides])


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def _changed(before: dict, after: dict) -> set[str]:
    return {k for k in before if not (before[k] == after[k]).all()}


@pytest.mark.slow
def test_sft_dpo_grpo_each_train_then_evaluation_and_export_load_in_plain_transformers(tmp_path):
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from vlmexp.evaluate import evaluate
    from vlmexp.export import export_model
    from vlmexp.processor import load_processor
    from vlmexp.train.dpo import run_dpo
    from vlmexp.train.grpo import run_grpo
    from vlmexp.train.sft import run_sft

    sys.path.insert(0, str(Path(__file__).parent))  # rewards_for_tests
    cfg = _cfg(tmp_path, "sft.args.max_steps=2", "sft.args.save_steps=2", "dpo.enabled=true",
               "dpo.pairs.from=samples", "dpo.pairs.num_samples=3", "dpo.pairs.max_new_tokens=8",
               "dpo.args.max_steps=1", "dpo.args.save_steps=1", "dpo.args.per_device_train_batch_size=4",
               "dpo.pairs.min_margin=0.05", "grpo.args.max_steps=1", "grpo.args.save_steps=1",
               "grpo.args.warmup_steps=0", "grpo.args.max_completion_length=8", "grpo.args.temperature=1.5",
               "grpo.rewards=[{name: format}, {name: iou}, {name: 'rewards_for_tests:char_variety'}]",
               # validation during training: every step
               "eval.every_steps=1", "eval.during_training_samples=2")
    sft = run_sft(cfg)
    validated = json.loads((tmp_path / "sft" / "validation.json").read_text())
    assert validated["metric"] == "val/rec_mean_iou" and [s for s, _ in validated["history"]] == [1, 2]
    assert all(0 <= v <= 1 for _, v in validated["history"])
    [base] = (tmp_path / "models").glob("tiny-internvl-*")
    changed = _changed(_weights(base), _weights(sft))  # saved in the -hf checkpoints' key layout
    assert {k.split(".")[0] for k in changed} == {"language_model", "vision_tower", "multi_modal_projector"}
    dpo = run_dpo(cfg, str(sft))
    assert any(k.startswith("language_model.model.layers.") for k in _changed(_weights(sft), _weights(dpo)))
    grpo = run_grpo(cfg, str(dpo))
    assert any(k.startswith("language_model.model.layers.") for k in _changed(_weights(dpo), _weights(grpo)))
    assert [s for s, _ in json.loads((tmp_path / "grpo" / "validation.json").read_text())["history"]] == [1]

    result = evaluate(cfg, str(grpo), tmp_path / "data" / "val.jsonl", tmp_path / "eval")
    assert result.metrics["count"] == 4 and "rec_mean_iou" in result.metrics
    out = export_model(cfg, str(grpo), tmp_path / "export", {"note": "test"})
    assert (out / "preprocessor_config.json").is_file()  # AutoProcessor's video processor falls back to it
    model = AutoModelForImageTextToText.from_pretrained(out)  # plain transformers
    assert type(model).__name__ == "InternVLForConditionalGeneration"
    processor = load_processor(out, INTERNVL)  # AutoProcessor where torchvision is installed
    messages = [{"role": "user",
                 "content": [{"type": "image"}, {"type": "text", "text": "Find the red circle."}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[Image.new("RGB", (250, 90), "red")], return_tensors="pt")
    assert inputs["pixel_values"].shape[0] == 4  # 3 tiles and the thumbnail
    generated = model.generate(**inputs, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert generated.shape[1] == inputs["input_ids"].shape[1] + 5


def test_the_demo_figures_claimed_for_internvl_are_the_recorded_cells():
    """docs/demos.md and bench/RESULTS.md quote bench/results/demo_matrix_internvl: base < SFT < GRPO in every
    cell, two seeds at least, GRPO ahead by 3 paired standard errors or more."""
    cells = [json.loads(p.read_text())
             for p in sorted((REPO / "bench/results/demo_matrix_internvl").glob("*.json"))]
    assert (len({c["seed"] for c in cells}) >= 2
            and all(c["config"] == "configs/demo_internvl.yaml" for c in cells))
    demos, results = (REPO / "docs/demos.md").read_text(), (REPO / "bench/RESULTS.md").read_text()
    for cell in cells:
        iou = {k: v["rec_mean_iou"] for k, v in cell["metrics"].items()}
        gain = cell["gains_over_sft"]["grpo"]
        assert iou["base"] < iou["sft"] < iou["grpo"] and gain["gain"] >= 3 * gain["se"], cell["seed"]
        row = (f"| {cell['seed']} | {cell['arithmetic']} | {iou['base']:.3f} | {iou['sft']:.3f} | "
               f"{iou['grpo']:.3f} | {gain['gain']:+.3f} ({gain['se']:.3f}) |")
        assert row in results, row
        if cell["arithmetic"] == "avx512":  # docs/demos.md quotes the machine's own arithmetic
            claim = f"base 0 / SFT {iou['sft']:.3f} / GRPO {iou['grpo']:.3f} (seed {cell['seed']})"
            assert claim in " ".join(demos.split()), claim
