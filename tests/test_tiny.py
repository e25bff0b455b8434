"""The embedded model: each family saves, reloads through the project loader, runs with an image,
generates."""

from __future__ import annotations

import json

import pytest

from vlmexp.families import FAMILIES, detect_family
from vlmexp.processor import load_processor

IMAGE_PART = {"qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
              "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
              "qwen3_vl": "<|vision_start|><|image_pad|><|vision_end|>",
              "qwen3_vl_moe": "<|vision_start|><|image_pad|><|vision_end|>",
              "qwen3_5": "<|vision_start|><|image_pad|><|vision_end|>",
              "qwen3_5_moe": "<|vision_start|><|image_pad|><|vision_end|>",
              # expanded by the processor to <img> + tiles x 256 x <IMG_CONTEXT> + </img>
              "internvl": "<IMG_CONTEXT>\n"}
# the assistant's turn as the generation prompt opens it: Qwen3.5's no-think template (what its small
# checkpoints ship) is loaded as its think twin (Family.fit_chat_template), which opens the thinking block
GENERATION_PROMPT = {"qwen3_5": "<|im_start|>assistant\n<think>\n",
                     "qwen3_5_moe": "<|im_start|>assistant\n<think>\n"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tiny_model_round_trip(tiny_models, family):
    import torch
    import transformers
    from PIL import Image

    path = tiny_models[family]
    fam = detect_family(path)
    assert fam.name == family
    declared = json.loads((path / "processor_config.json").read_text())["processor_class"]
    assert declared == fam.processor_class  # AutoProcessor loads it where torchvision exists
    assert json.loads((path / "tokenizer_config.json").read_text())["processor_class"] == fam.processor_class

    proc = load_processor(path, fam)
    model = getattr(transformers, fam.model_class).from_pretrained(path)
    assert 0.3e6 < sum(p.numel() for p in model.parameters()) < 3e6
    tok = proc.tokenizer
    assert [tok.decode([t]) for t in tok("x=2024")["input_ids"][-4:]] == ["2", "0", "2", "4"]
    for special in ("<|im_start|>", "<|im_end|>", fam.image_token, *fam.vision_tokens):
        assert len(tok(special)["input_ids"]) == 1
    assert model.config.image_token_id == tok.convert_tokens_to_ids(fam.image_token)

    msgs = [{"role": "user", "content": [{"type": "image"},
                                         {"type": "text", "text": "Locate the red square."}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    # the official templates' image part
    assert IMAGE_PART[fam.name] + "Locate the red square.<|im_end|>" in text
    assert text.endswith(GENERATION_PROMPT.get(family, "<|im_start|>assistant\n"))
    inputs = proc(text=[text], images=[Image.new("RGB", (120, 90), "red")], return_tensors="pt")
    budget = fam.image_budget(proc)
    assert (inputs["input_ids"] == model.config.image_token_id).sum() == fam.image_tokens(120, 90, budget)
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape[:2] == inputs["input_ids"].shape and torch.isfinite(logits).all()
    out = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]


def test_tiny_model_is_deterministic_and_refuses_overwrite(tmp_path, tiny_models):
    from safetensors.torch import load_file

    from vlmexp.tiny import make_tiny_model

    again = make_tiny_model(tmp_path / "again", "qwen2_5_vl")
    a = load_file(tiny_models["qwen2_5_vl"] / "model.safetensors")
    b = load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    with pytest.raises(FileExistsError, match="not empty"):
        make_tiny_model(again, "qwen2_5_vl")
    with pytest.raises(ValueError, match="unknown model family"):
        make_tiny_model(tmp_path / "x", "llava")
    assert not (tmp_path / "x").exists()


def test_tiny_path_in_config_builds_once(tmp_path):
    from vlmexp.config.schema import ModelConfig
    from vlmexp.modeling import resolve_model

    cfg = ModelConfig(path="tiny:qwen2_vl")
    path, fam = resolve_model(cfg, tmp_path)
    assert fam.name == "qwen2_vl" and (tmp_path / "models").exists()
    stamp = (tmp_path / "models").stat().st_mtime_ns
    assert resolve_model(cfg, tmp_path)[0] == path
    assert (len(list((tmp_path / "models").iterdir())) == 1
            and (tmp_path / "models").stat().st_mtime_ns == stamp)


def test_a_tokenizer_that_learns_the_zoom_tools_block_renders_it_in_under_half_the_tokens():
    from vlmexp.families import get_family
    from vlmexp.tiny import TinySpec, _tools_block, build_tokenizer

    for name in ("qwen2_5_vl", "qwen3_vl"):
        family = get_family(name)
        plain = build_tokenizer(family, TinySpec())
        learned = build_tokenizer(family, TinySpec(corpus_tools=["zoom"]))
        block = _tools_block(family, build_tokenizer(family, TinySpec()), ["zoom"])
        assert '"name": "image_zoom_in_tool"' in block and "<tools>" in block
        assert len(learned(block)["input_ids"]) < 0.5 * len(plain(block)["input_ids"]), name
        # the rest is the same tokenizer: template, special tokens, every digit its own token
        assert learned.chat_template == plain.chat_template
        assert learned.all_special_tokens == plain.all_special_tokens
        assert [learned.decode([t]) for t in learned("x=2024")["input_ids"][-4:]] == ["2", "0", "2", "4"]
        assert learned.decode(learned(block)["input_ids"]) == block


def test_the_tools_block_as_one_token_shortens_only_the_tools_section():
    from vlmexp.config.tiny_model import TinyModelConfig
    from vlmexp.families import get_family
    from vlmexp.tiny import TinySpec, _tools_block, build_tokenizer

    for name in ("qwen2_5_vl", "qwen3_vl"):
        family = get_family(name)
        merged = build_tokenizer(family, TinySpec(corpus_tools=["zoom"]))
        token = build_tokenizer(family, TinySpec(corpus_tools=["zoom"], tools_block_token=True))
        block = _tools_block(family, build_tokenizer(family, TinySpec()), ["zoom"])
        ids = token(block)["input_ids"]
        assert len(ids) < 20 < 200 < len(merged(block)["input_ids"]), name
        assert token.decode(ids) == block  # the same text, as the model reads it and as logs show it
        added = [i for i in ids if '"image_zoom_in_tool"' in token.decode([i])]
        assert len(added) == 1 and added[0] not in token.all_special_ids, name  # never skipped on decode
        # everything but the tools reads as before: a prompt without them, and an answer
        plain = "<|im_start|>user\nWhat colour is it?<|im_end|>\n<|im_start|>assistant\nred<|im_end|>"
        assert token(plain)["input_ids"] == merged(plain)["input_ids"], name
        assert token.chat_template == merged.chat_template
    with pytest.raises(ValueError, match="set corpus_tools: \\[zoom\\] or tools_block_token: false"):
        TinyModelConfig(tools_block_token=True)
