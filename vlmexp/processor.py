"""Load a family's processor, with or without torchvision, and read its pixel budget.

Transformers' Qwen-VL processors also load a video processor, which needs torchvision. CPU machines
have no torchvision build, so where it is missing we load an images-only subclass of the family's
processor (image processor + tokenizer + chat template). It saves itself under the real class name,
so a folder written here loads with `AutoProcessor` wherever torchvision exists.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from vlmexp.families import Family


@dataclass(frozen=True)
class PixelBudget:
    """What smart_resize needs: read from the loaded processor, never hard-coded."""

    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def has_torchvision() -> bool:
    return importlib.util.find_spec("torchvision") is not None


@cache
def images_only_class(family: Family) -> type:
    """A subclass of the family's processor whose only sub-processors are image processor and tokenizer."""
    import transformers

    base = getattr(transformers, family.processor_class)

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        base.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        out = base.to_dict(self)
        out["processor_class"] = family.processor_class  # advertise the real class for AutoProcessor
        return out

    def save_pretrained(self, save_directory, **kwargs):
        result = base.save_pretrained(self, save_directory, **kwargs)
        self.tokenizer._set_processor_class(family.processor_class)
        self.tokenizer.save_pretrained(save_directory)  # tokenizer_config.json names the real class too
        return result

    return type(
        f"ImagesOnly{family.processor_class}",
        (base,),
        {"__init__": __init__, "to_dict": to_dict, "save_pretrained": save_pretrained},
    )


def load_processor(
    model_path: str | Path,
    family: Family,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    trust_remote_code: bool = False,
):
    """The processor saved with a checkpoint, with the pixel budget overridden when given."""
    if has_torchvision():
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
    else:
        processor = images_only_class(family).from_pretrained(str(model_path))
    set_pixel_budget(processor, min_pixels, max_pixels)
    return processor


def set_pixel_budget(processor, min_pixels: int | None, max_pixels: int | None) -> None:
    """Override the image processor's min/max pixels (the `size` dict transformers 5 reads)."""
    ip = processor.image_processor
    size = dict(ip.size)
    if min_pixels is not None:
        size["shortest_edge"] = int(min_pixels)
    if max_pixels is not None:
        size["longest_edge"] = int(max_pixels)
    if size["shortest_edge"] > size["longest_edge"]:
        raise ValueError(
            f"min_pixels {size['shortest_edge']} exceeds max_pixels {size['longest_edge']}: "
            f"lower model.min_pixels or raise model.max_pixels"
        )
    ip.size = type(ip.size)(**size) if not isinstance(ip.size, dict) else size
    for name, key in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        if hasattr(ip, name):
            setattr(ip, name, size[key])


def pixel_budget(processor) -> PixelBudget:
    """The processor's own patch size, merge size and pixel bounds."""
    ip = getattr(processor, "image_processor", processor)
    size = dict(ip.size)
    return PixelBudget(
        patch_size=int(ip.patch_size),
        merge_size=int(ip.merge_size),
        min_pixels=int(size["shortest_edge"]),
        max_pixels=int(size["longest_edge"]),
    )


def prefills_think(processor, tag: str = "think") -> bool:
    """Whether the chat template's generation prompt ends in <think> (Qwen3-VL "Thinking" templates do): then
    the model's completions start inside the think block, and the format reward must read them so (trl
    issue "think_format_reward always returns 0.0 for models whose chat template prefills <think>")."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "x"}]}]
    template_owner = processor if getattr(processor, "chat_template", None) else getattr(processor, "tokenizer", None)
    if template_owner is None or not getattr(template_owner, "chat_template", None):
        return False
    prompt = template_owner.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return prompt.rstrip().endswith(f"<{tag}>")
