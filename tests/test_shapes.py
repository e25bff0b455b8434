"""Every model shape the benchmarks and shipped configs name builds, runs a forward pass with an image, and
generates.

The GPU benchmark once crashed in its first forward at Qwen2.5-VL-3B's depth (a two-entry `layer_types` left
from the tiny model's config) while its CPU test ran only the tiny shape. Here each published shape
(vlmexp.tiny.SHAPES, whose comments give the source of each number) is checked twice:
- at its exact sizes on the meta device (no memory): the config's per-layer lists match the depth and the
  parameter count is the published one;
- with weights, through `make_tiny_model` and a reload from disk, and through the GPU benchmark's own builder:
  real depth, head_dim, key/value heads, vocabulary, mrope_section, vision depth, heads and full-attention
  blocks; the width is scaled down to fit CI. Qwen2.5-VL's text attention needs hidden_size = num_heads x
  head_dim, so the width is scaled by using num_key_value_heads query heads (one query head per key/value
  head) at the real head_dim 128.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Parameter counts of the published checkpoints (Hub model cards: 3.75B and 8.29B; exact sums of their shapes)
PUBLISHED_PARAMETERS = {"qwen2.5-vl-3b": 3_754_622_976, "qwen2.5-vl-7b": 8_292_166_656}


def scaled(spec):
    """`spec` at CI width: real depth, head_dim, kv heads, vocabulary, mrope and vision depth/heads/blocks."""
    return type(spec)(**{**spec.model_dump(), "num_heads": spec.num_kv_heads,
                         "hidden_size": spec.num_kv_heads * spec.head_dim, "intermediate_size": 256,
                         "vision_hidden_size": 256, "vision_intermediate_size": 256})


def image_batch(processor, side: int = 112):
    from PIL import Image

    messages = [{"role": "user",
                 "content": [{"type": "image"}, {"type": "text", "text": "Find the circle."}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return processor(text=[text], images=[Image.new("RGB", (side, side), (200, 40, 40))], return_tensors="pt")


def forward_and_generate(model, processor) -> None:
    import torch

    inputs = image_batch(processor)
    with torch.no_grad():
        logits = model(**inputs).logits
        out = model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert logits.shape == (1, inputs["input_ids"].shape[1], model.config.text_config.vocab_size)
    assert torch.isfinite(logits.float()).all()
    assert out.shape[1] == inputs["input_ids"].shape[1] + 3


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_published_shape_builds_at_exact_size(name):
    import torch
    import transformers

    from vlmexp.families import get_family
    from vlmexp.tiny import SHAPES, TinySpec, build_tokenizer, model_config

    family = get_family("qwen2_5_vl")
    spec = SHAPES[name]
    config = model_config(family, spec, build_tokenizer(family, TinySpec()))
    text, vision = config.text_config, config.vision_config
    assert (text.layer_types == ["full_attention"] * spec.num_layers
            == ["full_attention"] * text.num_hidden_layers)
    assert (text.hidden_size // text.num_attention_heads == 128
            and sum(text.rope_parameters["mrope_section"]) == 64)
    assert vision.depth == 32 and vision.fullatt_block_indexes == [7, 15, 23, 31]
    with torch.device("meta"):
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMETERS[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_published_shape_saves_reloads_forwards_and_generates(tmp_path, name):
    import torch
    import transformers

    from vlmexp.families import get_family
    from vlmexp.processor import load_processor
    from vlmexp.tiny import SHAPES, make_tiny_model

    spec = scaled(SHAPES[name])
    folder = make_tiny_model(tmp_path / name, "qwen2_5_vl", spec, dtype="bfloat16")
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16)
    text = model.config.text_config
    assert (text.num_hidden_layers, len(text.layer_types)) == (spec.num_layers, spec.num_layers)
    assert text.vocab_size == SHAPES[name].model_vocab_size and text.num_key_value_heads == spec.num_kv_heads
    assert model.config.vision_config.depth == 32
    forward_and_generate(model, load_processor(folder, get_family("qwen2_5_vl")))


@pytest.mark.slow
def test_gpu_bench_builds_the_3b_shape_that_runs():
    """bench/gpu_grpo.py's own builder at the 3B depth (scaled width): the path that crashed on the H100."""
    import torch

    sys.path.insert(0, str(REPO / "bench"))
    from gpu_grpo import build

    from vlmexp.tiny import SHAPES

    model, processor = build(scaled(SHAPES["qwen2.5-vl-3b"]), torch.device("cpu"), torch.bfloat16)
    assert len(model.config.text_config.layer_types) == 36
    forward_and_generate(model, processor)
