"""Load a family's processor, with or without torchvision, with the config's image budget applied.

Transformers' VLM processors also load a video processor, which needs torchvision. CPU machines have no
torchvision build, so where it is missing we load the family's images-only subclass of its processor
(image processor + tokenizer + chat template; `Family.images_only_processor`). It saves itself under the
real class name, so a folder written here loads with `AutoProcessor` wherever torchvision exists.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from vlmexp.families import Family
from vlmexp.families.qwen import PixelBudget

__all__ = ["PixelBudget", "has_torchvision", "load_processor", "prefills_think"]


def has_torchvision() -> bool:
    return importlib.util.find_spec("torchvision") is not None


def load_processor(model_path: str | Path, family: Family, knobs: dict[str, int | None] | None = None,
                   trust_remote_code: bool = False):
    """The processor saved with a checkpoint, with the image budget `knobs` (model.min_pixels, max_patches,
    ...: `ModelConfig.image_knobs`) applied and its chat template fitted to SFT's targets
    (`Family.fit_chat_template`); a knob the family does not read is refused (ValueError with the fix)."""
    given = family.check_budget_knobs(knobs or {})
    if has_torchvision():
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
    else:
        processor = family.images_only_processor().from_pretrained(str(model_path))
    family.set_image_budget(processor, given)
    family.fit_chat_template(processor)
    _no_saved_truncation(processor)
    return processor


def _no_saved_truncation(processor) -> None:
    """Drop a truncation the checkpoint's tokenizer.json carries. TRL's SFT collator truncates to
    sft.args.max_length through the fast tokenizer, which saves that state with the checkpoint; a later stage
    loading it would cut every longer text, silently: GRPO's prompt with the tools block (longer than SFT's
    max_length) lost its image tokens from the left. vlmexp checks lengths itself (train/data.py) and each
    stage asks for truncation where it wants it."""
    tokenizer = getattr(processor, "tokenizer", processor)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.truncation is not None:
        backend.no_truncation()
        for key in ("max_length", "truncation_strategy", "stride"):  # the defaults it gave every call
            tokenizer.init_kwargs.pop(key, None)


def prefills_think(processor, tag: str = "think") -> bool:
    """Whether the chat template's generation prompt ends in <think> (Qwen3-VL "Thinking" templates do): then
    the model's completions start inside the think block, and the format reward must read them so (trl
    issue "think_format_reward always returns 0.0 for models whose chat template prefills <think>")."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "x"}]}]
    template_owner = (processor if getattr(processor, "chat_template", None)
                      else getattr(processor, "tokenizer", None))
    if template_owner is None or not getattr(template_owner, "chat_template", None):
        return False
    prompt = template_owner.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return prompt.rstrip().endswith(f"<{tag}>")
