"""Qwen3.5, dense and MoE: detection, processor and image tokens, the box frame, tools in Qwen3.5's own call
format, LoRA's modules per layer kind, a checkpoint of another shape made with plain transformers, M-RoPE
positions of a left-padded batch as generation makes them, and (slow) every stage on the tiny models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlmexp.checks.loader import load_config
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
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3.5-2B's nothink template
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

    kinds = model.config.text_config.layer_types
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
