"""Qwen3.5, dense and MoE: detection, processor and image tokens, the box frame, tools in Qwen3.5's own call
format, LoRA's modules per layer kind, a checkpoint of another shape made with plain transformers, M-RoPE
positions of a left-padded batch as generation makes them, and (slow) every stage on the tiny models (more in
tests/test_qwen3_5_runs.py: the MoE killed and resumed, under torchrun, through DPO, export and registration;
Ray in tests/test_ray.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import SMALL_BATCHES

from vlmexp.checks.loader import load_config
from vlmexp.families import FAMILIES as FAMILY_TABLE
from vlmexp.families import detect_family, get_family

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ["qwen3_5", "qwen3_5_moe"]
SIZES = [[112, 112], [64, 64], [333, 217], [250, 64], [64, 250], [29, 57]]


@pytest.mark.parametrize("name", FAMILIES)
def test_detection_processor_image_tokens_and_frame(tiny_models, tmp_path, name):
    from PIL import Image

    from vlmexp.processor import load_processor

    family = detect_family(tiny_models[name])
    assert family is get_family(name) and family.box_frame == "grid1000"
    proc = load_processor(tiny_models[name], family, {"min_pixels": 4096, "max_pixels": 102400})
    proc.save_pretrained(tmp_path / "p")
    assert json.loads((tmp_path / "p" / "processor_config.json").read_text())["processor_class"] == \
        "Qwen3VLProcessor"
    budget = family.image_budget(proc)
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                       "text": "x"}]}],
                                    tokenize=False, add_generation_prompt=True)
    # Qwen3.5-2B's no-think template, loaded as its think twin: the prompt opens the block SFT's targets fill
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    image_id = proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for width, height in SIZES:
        out = proc(text=[text], images=[Image.new("RGB", (width, height))], return_tensors="pt")
        tokens = int((out["input_ids"] == image_id).sum())
        assert tokens == family.image_tokens(width, height, budget)
        assert out["image_grid_thw"].tolist() == family.image_layout([[width, height]], budget).tolist()
        # the forward refuses images without it: 1 exactly where the image tokens are
        assert out["mm_token_type_ids"].bool().equal(out["input_ids"] == image_id)
    # a hub id names its family
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{path: Qwen/Qwen3.5-4B, family: {name}}}\ndata:\n  demo: {{train: 4, val: 2}}\n")
    assert load_config(cfg).model.family == name


@pytest.mark.parametrize("name", sorted(FAMILY_TABLE))
def test_sft_trains_after_the_generation_prompt_on_what_the_rewards_parse(tiny_models, tmp_path, name):
    """SFT's rows of the demo recipe, collated as TRL's SFTTrainer collates them: the tokens without a label
    are exactly the prompt generation renders (images expanded), and the labelled tokens decode, as
    generation decodes a completion, to a text evaluation's rewards score in full (format 1, the target's own
    box). Qwen3.5's no-think template broke both: SFT trained after `<think>\n`, generation prompted after
    `<think>\n\n</think>\n\n`, and no completion there could hold the think block the format asks for."""
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from vlmexp.data.record import read_sampled
    from vlmexp.data.run_data import prepare_data
    from vlmexp.generation import with_image_parts
    from vlmexp.processor import load_processor, prefills_think
    from vlmexp.scoring import score_records
    from vlmexp.train.data import build_dataset

    family = get_family(name)
    cfg = load_config(REPO / "configs/demo.yaml", [
        f"run.output_dir={tmp_path}", f"model.path={tiny_models[name]}", "tracking.backend=none",
        "data.demo.train=3", "data.demo.val=1", "data.demo.annotator_loose=0", "data.demo.annotator_jitter=0",
        "model.min_pixels=null", "model.max_pixels=null"])  # exact boxes: SFT targets the solution
    processor = load_processor(tiny_models[name], family)
    budget = family.image_budget(processor)
    train = prepare_data(cfg).train
    rows = build_dataset(train, cfg.data, family, budget, "sft")
    collator = DataCollatorForVisionLanguageModeling(processor, completion_only_loss=True)
    completions = []
    for row in rows:
        batch = collator([dict(row)])
        ids, labels = batch["input_ids"][0], batch["labels"][0]
        prompt = processor.apply_chat_template(with_image_parts(row["prompt"], len(row["images"])),
                                               tokenize=False, add_generation_prompt=True)
        expected = processor(text=[prompt], images=row["images"], return_tensors="pt")["input_ids"][0]
        assert ids[labels == -100].tolist() == expected.tolist(), processor.tokenizer.decode(ids)
        completions.append(processor.tokenizer.decode(ids[labels != -100], skip_special_tokens=True))
    metrics, _ = score_records(read_sampled(train), completions, family.box_frame, budget, cfg.grpo.rewards,
                               prefills_think(processor))
    assert metrics["format_rate"] == 1.0 and metrics["rec_mean_iou"] > 0.9, (metrics, completions)


def test_a_qwen35_template_that_closes_the_think_block_is_refused_naming_the_fix(tiny_models):
    """TRL's no-think templates become their think twins (the training variant too); another template whose
    generation prompt closes the think block cannot be fitted and is refused, naming the template to use."""
    from importlib.resources import files

    from vlmexp.processor import load_processor

    family = get_family("qwen3_5")
    processor = load_processor(tiny_models["qwen3_5"], family)
    templates = files("trl") / "chat_templates"
    processor.chat_template = (templates / "qwen3_5_nothink_training.jinja").read_text()
    family.fit_chat_template(processor)
    assert processor.chat_template == (templates / "qwen3_5_think_training.jinja").read_text()
    processor.chat_template = "\n" + (templates / "qwen3_5_nothink.jinja").read_text()  # not TRL's bytes
    with pytest.raises(ValueError, match=r"qwen3_5: .*<think>\\n\\n</think>\\n\\n'.*qwen3_5_think\.jinja"):
        family.fit_chat_template(processor)


def test_tool_calls_render_and_parse_in_qwen35s_own_format(tiny_models):
    from trl.chat_template_utils import parse_response

    from vlmexp.processor import load_processor

    family = get_family("qwen3_5")
    proc = load_processor(tiny_models["qwen3_5"], family)
    family.use_tools(proc)
    call = {"type": "function", "function": {"name": "image_zoom_in_tool",
                                             "arguments": {"bbox_2d": [100, 200, 300, 400]}}}
    prompt = [{"role": "user", "content": "Where?"}]
    full = proc.tokenizer.apply_chat_template(
        [*prompt, {"role": "assistant", "content": "", "tool_calls": [call]}], tokenize=False)
    assert "<tool_call>\n<function=image_zoom_in_tool>\n<parameter=bbox_2d>\n[100, 200, 300, 400]\n" in full
    head = proc.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert full.startswith(head)  # what generation.Generator.converse parses: the completion after its prompt
    tokens = proc.tokenizer.encode
    message = parse_response(proc.tokenizer, tokens(full[len(head):]), prefix=tokens(head))
    [parsed] = message["tool_calls"]
    assert parsed["function"]["name"] == "image_zoom_in_tool"
    assert parsed["function"]["arguments"]["bbox_2d"] in ([100, 200, 300, 400], "[100, 200, 300, 400]")


def _lora_counts(model, **lora) -> dict[str, set[str]]:
    """Adapted module names (relative to their layer) by layer kind, and what else was adapted."""
    from peft import LoraConfig, get_peft_model

    from vlmexp.config.stages import LM_LORA_TARGETS

    text = model.config.text_config  # Qwen3-VL-MoE's has no layer_types: full attention throughout
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=LM_LORA_TARGETS, **lora))
    found: dict[str, set[str]] = {"vision": set(), **{k: set() for k in kinds}}
    for name, _ in peft_model.named_parameters():
        if "lora_A" not in name:
            continue
        if ".visual." in name:
            found["vision"].add(name)
            continue
        layer = int(name.split(".layers.")[1].split(".")[0])
        found.setdefault(f"{kinds[layer]}:{layer}", set()).add(
            name.split(".layers.")[1].split(".", 1)[1].split(".lora_A")[0])
    return found


LINEAR = {f"linear_attn.{p}" for p in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")}
ATTENTION = {f"self_attn.{p}_proj" for p in "qkvo"}
MLP = {f"mlp.{p}_proj" for p in ("gate", "up", "down")}
SHARED = {f"mlp.shared_expert.{p}_proj" for p in ("gate", "up", "down")}


@pytest.mark.parametrize("name", FAMILIES)
def test_lora_adapts_linear_attention_attention_and_mlp_never_the_vision_tower(tiny_models, name):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_models[name])
    found = _lora_counts(model)
    mlp = SHARED if name == "qwen3_5_moe" else MLP
    assert found.pop("vision") == set()
    assert found["linear_attention:0"] == LINEAR | mlp and len(found["linear_attention:0"]) == 8
    assert found["full_attention:1"] == ATTENTION | mlp and len(found["full_attention:1"]) == 7
    if name == "qwen3_5_moe":  # the fused experts: PEFT's target_parameters (peft.target_parameters)
        model = AutoModelForImageTextToText.from_pretrained(tiny_models[name])
        found = _lora_counts(model, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
        assert {"mlp.experts"} <= found["linear_attention:0"] and {"mlp.experts"} <= found["full_attention:1"]


def test_lora_on_the_fused_experts_is_refused_with_dropout_naming_the_fix(tmp_path):
    from vlmexp.errors import ConfigError

    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {path: tiny:qwen3_5_moe}\ndata:\n  demo: {train: 4, val: 2}\n"
                   "grpo:\n  peft: {target_parameters: [mlp.experts.gate_up_proj]}\n")
    with pytest.raises(ConfigError, match=r"LoRA on parameters has no dropout .*set dropout: 0"):
        load_config(cfg)
    peft = load_config(cfg, ["grpo.peft.dropout=0"]).grpo.peft
    assert peft.target_parameters == ["mlp.experts.gate_up_proj"]


def test_the_kernel_fallback_is_said_once_with_its_cost_not_once_per_kernel(tiny_models, caplog):
    import logging

    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from vlmexp.modeling import missing_linear_attention_kernels, say_reference_kernels

    assert missing_linear_attention_kernels(AutoConfig.from_pretrained(tiny_models["qwen3_5"])) == (
        "flash-linear-attention", "causal-conv1d")  # CUDA only: never on this CPU machine
    assert missing_linear_attention_kernels(AutoConfig.from_pretrained(tiny_models["qwen2_5_vl"])) == ()
    caplog.set_level(logging.WARNING)
    transformers_log = logging.getLogger("transformers")  # which does not propagate to the root logger
    transformers_log.addHandler(caplog.handler)
    say_reference_kernels.cache_clear()  # an earlier test in this process may have said it already
    for _ in range(2):
        say_reference_kernels(("flash-linear-attention", "causal-conv1d"))
    model = AutoModelForImageTextToText.from_pretrained(tiny_models["qwen3_5"])
    model(input_ids=torch.tensor([[5, 6, 7, 8]]))
    transformers_log.removeHandler(caplog.handler)
    said = [r.getMessage() for r in caplog.records]
    assert sum("PyTorch reference kernels" in m and "s a forward and backward" in m for m in said) == 1
    assert not any("is falling back to its reference PyTorch implementation" in m for m in said)


def _plain_checkpoint(tiny: Path, out: Path) -> Path:
    """Qwen3.5 of 6 layers, full attention every 3rd, made with transformers alone (not vlmexp's builder),
    with the tiny model's tokenizer and processor."""
    import shutil

    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration

    config = AutoConfig.from_pretrained(tiny)
    text = config.text_config.to_dict()
    text.update(num_hidden_layers=6, layer_types=None, full_attention_interval=3)
    config = type(config)(text_config=text, vision_config=config.vision_config.to_dict(),
                          **{k: getattr(config, k) for k in ("image_token_id", "video_token_id",
                                                             "vision_start_token_id", "vision_end_token_id")})
    Qwen3_5ForConditionalGeneration(config).save_pretrained(out)
    for f in tiny.iterdir():
        if not (out / f.name).exists() and f.suffix in (".json", ".jinja") and f.name != "vlmexp_tiny.json":
            shutil.copy(f, out / f.name)
    return out


def test_a_checkpoint_of_another_shape_made_with_plain_transformers(tiny_models, tmp_path):
    from transformers import AutoModelForImageTextToText

    out = _plain_checkpoint(tiny_models["qwen3_5"], tmp_path / "six")
    assert detect_family(out).name == "qwen3_5"
    model = AutoModelForImageTextToText.from_pretrained(out)
    assert model.config.text_config.layer_types == ["linear_attention", "linear_attention",
                                                    "full_attention"] * 2
    found = _lora_counts(model)
    assert [len(found[f"linear_attention:{i}"]) for i in (0, 1, 3, 4)] == [8] * 4
    assert [len(found[f"full_attention:{i}"]) for i in (2, 5)] == [7] * 2


@pytest.mark.slow
def test_a_checkpoint_of_another_shape_trains_a_step_in_every_layer(tiny_models, tmp_path):
    """The 6-layer checkpoint made with plain transformers, as model.path with no family named: the stage
    detects it from config.json and one SFT step moves the linear-attention layers' and the full-attention
    layers' weights, all six."""
    from vlmexp.train.sft import run_sft

    six = _plain_checkpoint(tiny_models["qwen3_5"], tmp_path / "six")
    cfg = load_config(REPO / "configs/demo.yaml", [
        f"run.output_dir={tmp_path / 'out'}", f"model.path={six}", "model.min_pixels=4096",
        "model.max_pixels=102400", "tracking.backend=none", "data.demo.train=4", "data.demo.val=2",
        "sft.args.max_steps=1", "sft.args.save_steps=1", "sft.args.warmup_steps=0",
        "sft.args.per_device_train_batch_size=4", "grpo.enabled=false", "eval.enabled=false"])
    final = run_sft(cfg)
    changed = _changed(_weights(six), _weights(final))
    kinds = ["linear_attn.in_proj_qkv", "linear_attn.in_proj_qkv", "self_attn.q_proj"] * 2
    for layer, kind in enumerate(kinds):
        assert f"model.language_model.layers.{layer}.{kind}.weight" in changed, (layer, sorted(changed))


def test_left_padded_prompts_get_generations_positions_in_the_loss_forward(tiny_models):
    """Prompts of different lengths (images of different sizes, two images in one) left-padded in one batch:
    M-RoPE positions of every real token equal each prompt's alone; the completion's, computed on prompt +
    completion with `mm_token_type_ids` extended on the right (as TRL 1.16 does), continue where
    generation's do (the prompt's largest position + 1, + 1 a token)."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from vlmexp.processor import load_processor

    family = get_family("qwen3_5")
    proc = load_processor(tiny_models["qwen3_5"], family)
    model = AutoModelForImageTextToText.from_pretrained(tiny_models["qwen3_5"])
    prompts = [([(112, 112)], "a"), ([(64, 200), (96, 64)], "find the red circle in these two pictures")]
    texts, images = [], []
    for sizes, words in prompts:
        content = [{"type": "image"}] * len(sizes) + [{"type": "text", "text": words}]
        texts.append(proc.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                              add_generation_prompt=True))
        images.append([Image.new("RGB", s, "gray") for s in sizes])
    batch = proc(text=texts, images=images, return_tensors="pt", padding=True, padding_side="left")
    assert batch["attention_mask"][0, 0] == 0  # the first prompt is the shorter one: padded
    completion = torch.randint(20, 200, (2, 5))
    ids = torch.cat([batch["input_ids"], completion], 1)
    mask = torch.cat([batch["attention_mask"], torch.ones_like(completion)], 1)
    types = torch.cat([batch["mm_token_type_ids"], torch.zeros_like(completion)], 1)
    rope = model.model.get_rope_index
    together, _ = rope(ids, mm_token_type_ids=types, image_grid_thw=batch["image_grid_thw"],
                       attention_mask=mask)
    grids = torch.split(batch["image_grid_thw"], [1, 2])
    for b in range(2):
        real = batch["attention_mask"][b].bool()
        alone, _ = rope(batch["input_ids"][b:b + 1, real],
                        mm_token_type_ids=batch["mm_token_type_ids"][b:b + 1, real], image_grid_thw=grids[b])
        prompt_len = int(real.sum())
        got = together[:, b, -(prompt_len + 5):]
        assert torch.equal(got[:, :prompt_len], alone[:, 0])
        start = alone.max() + 1  # generation: each new token one position past the last
        assert torch.equal(got[:, prompt_len:], (start + torch.arange(5)).expand(3, 5))


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def _changed(before: dict, after: dict) -> set[str]:
    return {k for k in before if not (before[k] == after[k]).all()}


def _record_forwards(model) -> list[dict]:
    """What each forward of `model` with images receives: grad on, the keys, the pixel rows."""
    import torch

    seen = []

    def hook(module, args, kwargs):
        if kwargs.get("pixel_values") is not None:
            seen.append({"grad": torch.is_grad_enabled(), "keys": set(kwargs),
                         "rows": kwargs["pixel_values"].shape[0], "pixels": kwargs["pixel_values"].detach(),
                         "types": kwargs.get("mm_token_type_ids"), "grid": kwargs.get("image_grid_thw")})

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


@pytest.mark.slow
def test_sft_dpo_grpo_with_validation_then_evaluation_and_export_on_tiny_qwen35(tiny_models, tmp_path):
    """Images of mixed sizes; every stage trains the language model's linear- and full-attention layers, and
    every forward with images (generation and loss) carries mm_token_type_ids."""
    from transformers import AutoModelForImageTextToText

    from vlmexp.evaluate import evaluate
    from vlmexp.export import export_model
    from vlmexp.train.dpo import run_dpo
    from vlmexp.train.grpo import build_grpo_trainer
    from vlmexp.train.sft import run_sft
    from vlmexp.train.stage import train_and_save

    sys.path.insert(0, str(Path(__file__).parent))  # rewards_for_tests
    cfg = load_config(REPO / "configs/demo_qwen3_5.yaml", [
        f"run.output_dir={tmp_path}", f"model.path={tiny_models['qwen3_5']}", "tracking.backend=none",
        "data.demo.train=16", "data.demo.val=4", "data.demo.width=[64,120]", "data.demo.height=[64,120]",
        *SMALL_BATCHES,
        "sft.args.max_steps=2", "sft.args.save_steps=2", "dpo.enabled=true", "dpo.pairs.from=samples",
        "dpo.pairs.num_samples=3", "dpo.pairs.max_new_tokens=8", "dpo.args.max_steps=1",
        "dpo.args.save_steps=1", "dpo.args.per_device_train_batch_size=4", "dpo.pairs.min_margin=0.05",
        "grpo.args.max_steps=1",
        "grpo.args.save_steps=1", "grpo.args.warmup_steps=0", "grpo.args.max_completion_length=8",
        "grpo.args.temperature=1.5", "eval.every_steps=1", "eval.during_training_samples=2",
        "grpo.rewards=[{name: format}, {name: iou}, {name: 'rewards_for_tests:char_variety'}]"])
    sft = run_sft(cfg)
    validated = json.loads((tmp_path / "sft" / "validation.json").read_text())
    assert [s for s, _ in validated["history"]] == [1, 2]
    base = tiny_models["qwen3_5"]
    changed = _changed(_weights(base), _weights(sft))
    assert any(".linear_attn.in_proj_qkv" in k for k in changed)
    assert any(".self_attn.q_proj" in k for k in changed)
    dpo = run_dpo(cfg, str(sft))
    assert any(".linear_attn." in k for k in _changed(_weights(sft), _weights(dpo)))

    trainer, inputs, rows = build_grpo_trainer(cfg, str(dpo))
    seen = _record_forwards(trainer.model)
    grpo = train_and_save(trainer, inputs, rows)
    assert any(".linear_attn." in k for k in _changed(_weights(dpo), _weights(grpo)))
    # the loss forward (generation's forwards run without hooks; without mm_token_type_ids they would raise)
    loss = [s for s in seen if s["grad"]]
    assert loss and all(s["types"] is not None and s["types"].sum() > 0 for s in loss)
    assert all(s["rows"] == int(s["grid"].prod(-1).sum()) for s in loss)  # every image's pixel rows

    result = evaluate(cfg, str(grpo), tmp_path / "data" / "val.jsonl", tmp_path / "eval")
    assert result.metrics["count"] == 4 and "rec_mean_iou" in result.metrics
    out = export_model(cfg, str(grpo), tmp_path / "export", {"note": "test"})
    model = AutoModelForImageTextToText.from_pretrained(out)
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"


def _multi_image_records(folder: Path) -> Path:
    """Records of one or two images of different sizes each, answered with a colour."""
    from conftest import make_png

    for i, (size, colour) in enumerate(zip([(64, 64), (120, 80), (72, 150), (96, 96)],
                                           ("red", "green", "blue", "gray"), strict=True)):
        make_png(folder / f"{i}.png", size, colour)
    rows = []
    for i in range(8):
        images = [f"{i % 4}.png"] + ([f"{(i + 1) % 4}.png"] if i % 2 else [])
        rows.append({"image": images, "accu_reward_method": "all_match", "conversations": [
            {"from": "human", "value": "<image>" * len(images) + "What colour is the first picture?"},
            {"from": "gpt", "value": "red"}]})
    from conftest import write_jsonl

    return write_jsonl(folder / "train.jsonl", rows)


@pytest.mark.slow
def test_moe_grpo_several_images_per_prompt_gspo_lora_on_experts_and_its_routing_in_mlflow(tiny_models,
                                                                                             tmp_path):
    """Qwen3.5-MoE, LoRA on the fused experts (target_parameters), sequence-level importance ratio (GSPO), two
    images of different sizes in some prompts. The policy is pushed to write <|video_pad|> / <|image_pad|>
    (ms-swift#9287: such a token in a completion sends get_rope_index looking for a grid that is not there):
    generation suppresses them, and the step trains. The router's aux loss and the experts' evenness are in
    MLflow."""
    import torch
    from mlflow.tracking import MlflowClient

    from vlmexp.train.grpo import build_grpo_trainer
    from vlmexp.train.stage import train_and_save

    sys.path.insert(0, str(Path(__file__).parent))  # rewards_for_tests
    records = _multi_image_records(tmp_path / "data")
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config(REPO / "configs/demo_qwen3_5.yaml", [
        f"run.output_dir={tmp_path / 'out'}", f"model.path={tiny_models['qwen3_5_moe']}", "data.demo=null",
        f"data.datasets=[{{json_path: {records}, task: exact}}]",
        f"data.val_datasets=[{{json_path: {records}, task: exact}}]", "sft.enabled=false",
        "tracking.backend=mlflow", f"tracking.tracking_uri={store}", "tracking.system_metrics=false",
        "grpo.peft={r: 4, dropout: 0, target_parameters: [mlp.experts.gate_up_proj, mlp.experts.down_proj]}",
        "grpo.args.importance_sampling_level=sequence", "grpo.args.warmup_steps=0",
        "grpo.args.max_steps=1", "grpo.args.save_steps=1",
        "grpo.args.logging_steps=1", "grpo.args.per_device_train_batch_size=8", "grpo.args.num_generations=2",
        "grpo.args.gradient_accumulation_steps=1", "grpo.args.max_completion_length=6",
        "grpo.args.temperature=1.5",
        "grpo.rewards=[{name: exact, kwargs: {default_match: exact}},"
        " {name: 'rewards_for_tests:char_variety'}]"])
    trainer, inputs, rows = build_grpo_trainer(cfg)
    vision = [inputs.processor.tokenizer.convert_tokens_to_ids(t) for t in ("<|video_pad|>", "<|image_pad|>")]

    def push(module, args, kwargs, output):  # generation only (a cache): the loss forward is left alone
        if kwargs.get("past_key_values") is not None:
            output.logits[:, -1, vision] += 1e4
        return output

    trainer.model.get_base_model().register_forward_hook(push, with_kwargs=True)
    seen = _record_forwards(trainer.model.get_base_model())
    experts = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
               if p.requires_grad and "experts" in n}
    assert experts  # LoRA on the fused experts
    train_and_save(trainer, inputs, rows)

    assert any(not torch.equal(p, experts[n]) for n, p in trainer.model.named_parameters() if n in experts)
    [loss] = [s for s in seen if s["grad"]]
    assert loss["grid"].shape[0] == 12  # 8 prompts, 4 of them with two images, each completion its own copy
    assert loss["rows"] == int(loss["grid"].prod(-1).sum()) and loss["types"].sum() > 0
    client = MlflowClient(store)
    [run] = client.search_runs([client.get_experiment_by_name("demo_qwen3_5").experiment_id])
    metrics = run.data.metrics
    assert metrics["aux_loss"] > 0 and 0 <= metrics["moe/expert_load_cv"] <= 3 ** 0.5
    assert 0.25 <= metrics["moe/expert_load_max_share"] <= 1


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_zoom_in_qwen35s_call_format_the_loss_sees_the_crop_and_evaluation_with_and_without_it(
        tiny_models, tmp_path, name):
    """A scripted policy calls the zoom in Qwen3.5's <function=...> format: TRL's loop parses it with the
    Qwen3.5 parser, the crop reaches the loss forward; evaluation answers with the tool (one zoom each, right)
    and without it (one turn). Dense and MoE."""
    from test_zoom import SIDE, frame_box, holds_rows, scene, tool_cfg, write_records
    from zoom_script import ScriptedTurns, call

    from vlmexp.data.record import read_sampled
    from vlmexp.data.run_data import prepare_data
    from vlmexp.evaluate import evaluate_with_tools
    from vlmexp.generation import Generator
    from vlmexp.modeling import load_for_inference
    from vlmexp.prompts import build_prompt, load_images
    from vlmexp.tools.zoom import crop_box
    from vlmexp.train.grpo import build_grpo_trainer
    from vlmexp.train.stage import train_and_save

    model_dir = tiny_models[name]
    records = write_records(tmp_path / "data", ["zoom", "zoom"], bbox=True)
    cfg = tool_cfg(tmp_path / "out", model_dir, records, "grpo.args.max_steps=1",
                   "grpo.args.per_device_train_batch_size=4", "grpo.args.num_generations=2",
                   "grpo.args.gradient_accumulation_steps=1", "grpo.args.max_completion_length=160",
                   "model.min_pixels=4096", "eval.max_new_tokens=160")
    header = "<|im_start|>assistant\n<think>\n"  # the generation prompt (the think template's)

    def script(model, processor, family, budget):
        box = frame_box(family, budget)
        # each turn starts inside the think block the generation prompt opened, and closes it first
        closed = "</think>\n\n"
        turns = ScriptedTurns(processor.tokenizer,
                              {"zoom": [closed + call(box, family.name), closed + "<answer>red</answer>"]},
                              header)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.register_forward_hook(turns.hook, with_kwargs=True)

    trainer, inputs, rows = build_grpo_trainer(cfg)
    script(trainer.model, inputs.processor, inputs.family, inputs.budget)
    seen = _record_forwards(trainer.model)
    train_and_save(trainer, inputs, rows)
    [logs] = [h for h in trainer.state.log_history if "zoom/zooms_per_completion" in h]  # the step's
    assert logs["zoom/zooms_per_completion"] == 1 and logs["rewards/tool/mean"] == 1
    image = scene(tmp_path / "check.png")
    crop = image.crop(tuple(crop_box(frame_box(inputs.family, inputs.budget), SIDE, SIDE,
                                     inputs.family.box_frame, inputs.budget, 28)))
    crop_rows = inputs.processor.image_processor(images=[crop], return_tensors="pt")["pixel_values"]
    [loss] = [s for s in seen if s["grad"]]
    assert loss["grid"].shape[0] == 4 + 4  # each completion's image and its crop
    assert loss["types"].sum() > 0 and loss["rows"] == int(loss["grid"].prod(-1).sum())
    assert holds_rows(loss["pixels"], crop_rows)  # the crop's pixel rows, as the processor makes them

    recs = read_sampled(prepare_data(cfg).val)
    model, processor, family = load_for_inference(cfg, str(model_dir))
    script(model, processor, family, family.image_budget(processor))
    generator = Generator.for_config(cfg, model, processor, family)
    prompts = [build_prompt(r, cfg.data, family) for r in recs]
    plain = generator(prompts, [load_images(r.images) for r in recs], 160, 0.0, 8)
    assert all("<function=image_zoom_in_tool>" in text for text in plain)  # without the tool: one turn
    prompted: list[str] = []  # each turn's prompt, through the real generate
    generate_ids = generator.generate_ids
    generator.generate_ids = lambda texts, *rest: prompted.extend(texts) or generate_ids(texts, *rest)
    metrics = evaluate_with_tools(cfg, recs, prompts, generator, tmp_path / "eval")
    assert metrics["tool_exact_accuracy"] == 1 and metrics["tool_zooms_per_answer"] == 1, (metrics, prompted)
