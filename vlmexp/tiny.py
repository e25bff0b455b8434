"""Build the embedded model: a tiny random-weight model of any supported family, offline.

The folder written here is a normal Hugging Face checkpoint (config.json, safetensors, tokenizer,
chat template, image processor), so every code path that loads a real checkpoint loads this one.
The tokenizer is a byte-level BPE trained locally on a small corpus of the prompts and answers the
pipeline uses, with Qwen's pre-tokenizer (every digit its own token) and the family's special tokens; the
family module (vlmexp/families/) gives the model config, the image processor and the processor.
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

from pydantic import ConfigDict

from vlmexp.config.tiny_model import TinyModelConfig
from vlmexp.families import Family, get_family
from vlmexp.files import new_folder

_WORDS = (
    "the a an of in on at to is are what where which find locate output box bounding coordinates "
    "object image picture region answer think first then final reasoning process question please "
    "small medium large big tiny red green blue yellow purple orange black white gray cyan circle "
    "square triangle rectangle shape left right top bottom center corner above below next between "
    "angle triangle area length radius degrees value solve equals therefore because so step given "
    "describe this with for and or not each one two three four five six seven eight nine ten"
).split()


class TinySpec(TinyModelConfig):
    """The config's tiny sizes (`model.tiny`, `TinyModelConfig`) plus what it leaves to follow from them,
    which a published checkpoint's shape sets (SHAPES). Frozen: SHAPES are constants."""

    model_config = ConfigDict(frozen=True)

    head_dim: int | None = None  # text attention; Qwen2(.5)-VL requires hidden_size = num_heads x head_dim
    model_vocab_size: int | None = None  # embedding rows; default: the tokenizer's length rounded up to 64
    vision_intermediate_size: int | None = None  # default: 2 x vision_hidden_size
    # qwen2_5_vl windowed attention; default: the last block
    vision_fullatt_blocks: tuple[int, ...] | None = None
    mrope_section: tuple[int, int, int] | None = None  # default: split of head_dim / 2 (it must sum to that)
    # internvl: a tile's side; default 112 (16 tokens a tile; released checkpoints: 448)
    tile_size: int | None = None
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False


# Published shapes of real checkpoints (random weights: cost and shape bugs do not depend on the values).
# Qwen/Qwen2.5-VL-3B-Instruct config.json on the Hub: text hidden_size 2048, intermediate_size 11008,
# num_hidden_layers 36, num_attention_heads 16 (head_dim 128), num_key_value_heads 2, vocab_size 151936,
# max_position_embeddings 128000, rope_theta 1e6, mrope_section [16, 24, 24], tie_word_embeddings true;
# vision depth 32, hidden_size 1280, intermediate_size 3420, num_heads 16, fullatt_block_indexes
# [7, 15, 23, 31], window_size 112, patch_size 14 (out_hidden_size = the text hidden_size).
# Qwen/Qwen2.5-VL-7B-Instruct config.json: text hidden_size 3584, intermediate_size 18944, num_hidden_layers
# 28, num_attention_heads 28 (head_dim 128), num_key_value_heads 4, vocab_size 152064, rope_theta 1e6,
# mrope_section [16, 24, 24], tie_word_embeddings false; vision as the 3B's (out_hidden_size 3584).
_QWEN25_VISION = dict(vision_hidden_size=1280, vision_intermediate_size=3420, vision_depth=32,
                      vision_heads=16, vision_fullatt_blocks=(7, 15, 23, 31))
SHAPES: dict[str, TinySpec] = {
    "qwen2.5-vl-3b": TinySpec(hidden_size=2048, intermediate_size=11008, num_layers=36, num_heads=16,
                              num_kv_heads=2, head_dim=128, model_vocab_size=151936,
                              mrope_section=(16, 24, 24), rope_theta=1e6, max_position_embeddings=128000,
                              tie_word_embeddings=True, **_QWEN25_VISION),
    "qwen2.5-vl-7b": TinySpec(hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                              num_kv_heads=4, head_dim=128, model_vocab_size=152064,
                              mrope_section=(16, 24, 24), rope_theta=1e6, max_position_embeddings=128000,
                              tie_word_embeddings=False, **_QWEN25_VISION),
}


def _corpus(seed: int, n_lines: int = 4000) -> list[str]:
    """Text resembling the pipeline's prompts and answers, for training the BPE merges."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14)))
        box = [rng.randint(0, 999) for _ in range(4)]
        lines.append(f"{words.capitalize()}.")
        lines.append(f"<think>{words}</think><answer>{json.dumps(box)}</answer>")
        lines.append(json.dumps({"bbox_2d": box, "label": rng.choice(_WORDS)}))
        lines.append(f"The answer is \\boxed{{{rng.randint(0, 360)}}}. {words}?\n")
    return lines


def build_tokenizer(family: Family, spec: TinySpec):
    """A Qwen2Tokenizer with locally trained merges, the family's special tokens and chat template. With
    `spec.corpus_tools`, the merges also learn those tools' block as the family's tool template renders it
    (trained once without it, to render it); with `spec.tools_block_token` as well, the tools' section of that
    block is one added token."""
    corpus = _corpus(spec.seed)
    if not spec.corpus_tools:
        return _tokenizer(family, spec, corpus)
    throwaway = _tokenizer(family, spec, corpus)
    block = _tools_block(family, throwaway, spec.corpus_tools)
    tokenizer = _tokenizer(family, spec, corpus + [block] * _TOOLS_BLOCK_LINES)
    if spec.tools_block_token:
        from transformers import AddedToken

        section = _tools_section(family, throwaway, block)
        tokenizer.add_tokens([AddedToken(section, special=False, normalized=False)])
    return tokenizer


_TOOLS_BLOCK_LINES = 400  # the block's share of the corpus: ~230 tokens left of its ~550 at vocab_size 1024


def _tools_block(family: Family, tokenizer, names) -> str:
    """The system turn `family`'s tool template renders for the tools `names`: what GRPO's rollouts and SFT's
    tool demonstrations open with (`tokenizer` is changed: a throwaway)."""
    from types import SimpleNamespace

    from vlmexp.config.stages import ToolsConfig
    from vlmexp.tools import offered_tools

    family.use_tools(SimpleNamespace(tokenizer=tokenizer))
    tools = offered_tools(ToolsConfig(names=list(names)), family, family.released_budget({}))
    return tokenizer.apply_chat_template([{"role": "user", "content": ""}], tools=tools, tokenize=False)


def _tools_section(family: Family, tokenizer, with_tools: str) -> str:
    """What the tools add to the system turn of `family`'s tool template: its block with them (`with_tools`,
    as `_tools_block` rendered it with `tokenizer`, which now holds that template), less its turn without
    them."""
    without = tokenizer.apply_chat_template([{"role": "user", "content": ""}], tokenize=False)
    head = len(os.path.commonprefix([with_tools, without]))
    tail = len(os.path.commonprefix([with_tools[head:][::-1], without[head:][::-1]]))
    section = with_tools[head:len(with_tools) - tail]
    if without != with_tools[:head] + with_tools[len(with_tools) - tail:] or not section:
        raise ValueError(f"{family.name}'s tool template does not add the tools as one section of the "
                         "system turn: set model.tiny.tools_block_token: false")
    special = "|".join(re.escape(t) for t in tokenizer.all_special_tokens)
    return max(re.split(special, section), key=len)  # its text between turn markers (Qwen3-VL's opens one)


def _tokenizer(family: Family, spec: TinySpec, corpus: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import AddedToken, Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),  # \p{N}: digits alone
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer=trainer)
    state = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if not isinstance(m, str) else tuple(m.split(" ")) for m in state["merges"]]

    tokenizer = Qwen2Tokenizer(
        vocab=state["vocab"],
        merges=merges,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        errors="replace",
        model_max_length=32768,
        **family.named_tokens,  # e.g. InternVL's start_image_token: attributes its processor reads
    )
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, special=True) for t in family.special_tokens]}
    )
    tokenizer.add_tokens([AddedToken(t, special=False) for t in family.extra_tokens])
    tokenizer.chat_template = family.chat_template()
    return tokenizer


def model_config(family: Family, spec: TinySpec, tokenizer):
    """A transformers config of the family at `spec`'s sizes: the one place vlmexp and bench/ build one."""
    return family.tiny_config(spec, tokenizer)


def make_tiny_model(out_dir: str | Path, family: str = "qwen2_5_vl", spec: TinySpec | None = None,
                    dtype: str | None = None, device: str | None = None) -> Path:
    """Write a random-weight model of `family` to `out_dir` and return it.

    `dtype` (e.g. "bfloat16") and `device` (e.g. "cuda") build a large shape (SHAPES) fast and in half the
    disk; the defaults (float32 on CPU) give the embedded model. Written to a temporary sibling folder and
    renamed into place, so `out_dir` is either complete or absent, never half-written.
    """
    import torch
    import transformers
    from transformers import GenerationConfig

    fam = get_family(family)
    spec = spec or TinySpec()
    with new_folder(out_dir) as tmp:  # checks first that out_dir is absent or empty
        tokenizer = build_tokenizer(fam, spec)
        config = model_config(fam, spec, tokenizer)
        torch.manual_seed(spec.seed)
        model_class = getattr(transformers, fam.model_class)
        if dtype is None and device is None:
            model = model_class(config)
        else:
            with torch.device(device or "cpu"):
                model = model_class._from_config(config, dtype=getattr(torch, dtype or "float32"))
        model.generation_config = GenerationConfig(
            eos_token_id=[config.text_config.eos_token_id, config.text_config.pad_token_id],
            pad_token_id=config.text_config.pad_token_id,
            do_sample=False,
        )
        image_processor = fam.tiny_image_processor(spec)
        processor = fam.tiny_processor(image_processor, tokenizer, spec)
        # whatever rank builds it (under a launcher) writes it
        model.save_pretrained(tmp, is_main_process=True)
        processor.save_pretrained(tmp)  # with preprocessor_config.json, as real checkpoints ship
        (tmp / "vlmexp_tiny.json").write_text(json.dumps({"family": fam.name, **spec.model_dump()}, indent=2))
    return Path(out_dir)


def make_tiny_reward_model(out_dir: str | Path, spec: TinySpec | None = None) -> Path:
    """Write a random-weight text reward model (Qwen2ForSequenceClassification, one label) with the tiny
    model's tokenizer and chat template to `out_dir`: what the `reward_model` reward loads, offline."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    fam, spec = get_family("qwen2_5_vl"), spec or TinySpec()
    with new_folder(out_dir) as tmp:
        tokenizer = build_tokenizer(fam, spec)
        text = fam.tiny_config(spec, tokenizer).text_config
        config = Qwen2Config(vocab_size=text.vocab_size, hidden_size=spec.hidden_size,
                             num_hidden_layers=spec.num_layers, intermediate_size=spec.intermediate_size,
                             num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                             num_labels=1, pad_token_id=text.pad_token_id, eos_token_id=text.eos_token_id)
        torch.manual_seed(spec.seed)
        Qwen2ForSequenceClassification(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return Path(out_dir)
