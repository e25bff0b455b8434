"""The Qwen-VL families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): pixel budget, processor, chat template, embedded
model.

Images are resized by smart_resize to multiples of patch_size x merge_size with an area between min_pixels
and max_pixels (model.min_pixels / model.max_pixels); each merge_size x merge_size block of patches becomes
one `<|image_pad|>` token between `<|vision_start|>` and `<|vision_end|>`. Qwen2.5-VL answers boxes in
absolute pixels of the resized image, Qwen2-VL and Qwen3-VL on a 0-1000 grid (vlmexp/coords.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar

from vlmexp.families.base import Family, moe_experts, tiny_text_config

# The pixel bounds the released Qwen2(.5)-VL checkpoints ship (preprocessor_config.json; class defaults
# differ): min_pixels 4x28x28, max_pixels 16384x28x28. Used only where no processor can be read
# (`vlmexp score`); everything else reads the loaded processor.
RELEASED_PIXELS = (3136, 12845056)

# Qwen-VL's special tokens, in the order the real tokenizers number them.
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip


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


MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) the Qwen-VL image processor resizes an image to: multiples of `factor`, area in
    bounds. transformers' algorithm, restated so that scoring does not import torch; a test checks the two
    agree."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, "
                         f"got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class QwenVLFamily(Family):
    # under trl/chat_templates (the official template, shipped by TRL)
    chat_template_file: str = "qwen2_5_vl.jinja"
    patch_size: int = 14
    tool_tokens: tuple[str, ...] = ("<tool_call>", "</tool_call>")

    # a mixture of experts (qwen3_vl_moe, qwen3_5_moe): fused 3-D experts behind a top-k router
    moe: bool = False

    budget_knobs: ClassVar[tuple[str, ...]] = ("min_pixels", "max_pixels")
    budget_summary: ClassVar[str] = "smart_resize to an area between min and max pixels"
    special_tokens: ClassVar[tuple[str, ...]] = QWEN_SPECIAL_TOKENS

    @property
    def extra_tokens(self) -> tuple[str, ...]:  # type: ignore[override]
        return self.tool_tokens

    def chat_template(self) -> str:
        from importlib.resources import files

        return (files("trl") / "chat_templates" / self.chat_template_file).read_text()

    def images_only_processor(self) -> type:
        return _images_only_class(self.processor_class)

    # beside this module: Qwen2(.5)-VL's template with tools (their released one renders none); None: the
    # checkpoint's own template renders them (Qwen3-VL's)
    tools_template_file: str | None = "qwen2_5_vl_tools.jinja"

    def use_tools(self, processor) -> None:
        """Qwen2(.5)-VL: our template with tools in place of the checkpoint's; every Qwen-VL: TRL's parser of
        Qwen's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` calls (the form Qwen2.5 and Qwen3
        write, and DeepEyes trains Qwen2.5-VL on), set on the tokenizer, where `parse_response` reads it. TRL
        sets that parser itself only for templates it knows byte for byte."""
        from importlib.resources import files

        from trl.chat_template_utils import qwen3_template

        tokenizer = processor.tokenizer
        if self.tools_template_file is not None:
            template = (files("vlmexp.families") / self.tools_template_file).read_text()
            processor.chat_template = tokenizer.chat_template = template
        tokenizer.response_template = qwen3_template

    def set_image_budget(self, processor, knobs: dict[str, int]) -> None:
        """Override the image processor's min/max pixels (the `size` dict transformers 5 reads)."""
        ip = processor.image_processor
        size = dict(ip.size)
        if "min_pixels" in knobs:
            size["shortest_edge"] = int(knobs["min_pixels"])
        if "max_pixels" in knobs:
            size["longest_edge"] = int(knobs["max_pixels"])
        if size["shortest_edge"] > size["longest_edge"]:
            raise ValueError(f"min_pixels {size['shortest_edge']} exceeds max_pixels {size['longest_edge']}: "
                             f"lower model.min_pixels or raise model.max_pixels")
        ip.size = type(ip.size)(**size) if not isinstance(ip.size, dict) else size
        for name, key in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if hasattr(ip, name):
                setattr(ip, name, size[key])

    def image_budget(self, processor) -> PixelBudget:
        """The processor's own patch size, merge size and pixel bounds."""
        ip = getattr(processor, "image_processor", processor)
        size = dict(ip.size)
        return PixelBudget(patch_size=int(ip.patch_size), merge_size=int(ip.merge_size),
                           min_pixels=int(size["shortest_edge"]), max_pixels=int(size["longest_edge"]))

    def released_budget(self, knobs: dict[str, int]) -> PixelBudget:
        return PixelBudget(self.patch_size, 2, knobs.get("min_pixels", RELEASED_PIXELS[0]),
                           knobs.get("max_pixels", RELEASED_PIXELS[1]))

    def image_tokens(self, width: int, height: int, budget: PixelBudget) -> int:
        """`<|image_pad|>` tokens: one per merge_size x merge_size patches of the smart-resized image."""
        h, w = smart_resize(height, width, budget.factor, budget.min_pixels, budget.max_pixels)
        return (h // budget.patch_size) * (w // budget.patch_size) // budget.merge_size**2

    layout_name: ClassVar[str] = "grid"

    def image_layout(self, image_sizes, budget: PixelBudget):
        """[n_images, 3] (t, h, w) patch grids (the processor's `image_grid_thw`)."""
        import torch

        rows = []
        for width, height in image_sizes or []:
            h, w = smart_resize(height, width, budget.factor, budget.min_pixels, budget.max_pixels)
            rows.append([1, h // budget.patch_size, w // budget.patch_size])
        return torch.tensor(rows, dtype=torch.long).reshape(-1, 3)

    def batch_layouts(self, batch: dict[str, Any], num_images: list[int]):
        import torch

        grids = batch.get("image_grid_thw")
        if grids is None:
            return None
        return list(torch.split(grids.cpu(), num_images)) if sum(num_images) == len(grids) else [grids.cpu()]

    def layout_rows(self, layout) -> int:
        return int(layout.prod(-1).sum())

    def layout_tokens(self, layout, budget: PixelBudget) -> int:
        return self.layout_rows(layout) // budget.merge_size**2

    def layout_image_tokens(self, layout, budget: PixelBudget) -> list[int]:
        return [int(grid.prod()) // budget.merge_size**2 for grid in layout]

    def tiny_image_processor(self, spec):
        import transformers

        return transformers.Qwen2VLImageProcessorPil(
            patch_size=self.patch_size, merge_size=2, temporal_patch_size=2,
            **({"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if self.name.startswith("qwen3_vl") else {}))

    def tiny_config(self, spec, tokenizer):
        """Every depth-dependent list (text `layer_types`, vision full-attention blocks) is derived here from
        the depth, never left from another depth (a stale list crashed the first forward at the 3B depth)."""

        text = tiny_text_config(spec, tokenizer, eos="<|im_end|>", pad="<|endoftext|>")
        head_dim = spec.head_dim or spec.hidden_size // spec.num_heads
        if not self.name.startswith("qwen3_vl") and head_dim * spec.num_heads != spec.hidden_size:
            raise ValueError(f"{self.name} needs hidden_size = num_heads x head_dim; got {spec.hidden_size} "
                             f"!= {spec.num_heads} x {head_dim}: change hidden_size or num_heads")
        half = head_dim // 2  # mrope_section (t, h, w) must sum to head_dim / 2
        mrope = list(spec.mrope_section or (half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8))
        if sum(mrope) != half:
            raise ValueError(f"mrope_section {mrope} must sum to head_dim / 2 = {half}")
        text["rope_parameters"]["mrope_section"] = mrope
        vision: dict[str, Any] = dict(depth=spec.vision_depth, num_heads=spec.vision_heads, in_channels=3,
                                      patch_size=self.patch_size, spatial_merge_size=2, temporal_patch_size=2)
        if self.name == "qwen2_vl":
            vision.update(embed_dim=spec.vision_hidden_size, hidden_size=spec.hidden_size, mlp_ratio=2)
        elif self.name == "qwen2_5_vl":
            vision.update(hidden_size=spec.vision_hidden_size,
                          intermediate_size=spec.vision_intermediate_size or spec.vision_hidden_size * 2,
                          out_hidden_size=spec.hidden_size, window_size=112,
                          fullatt_block_indexes=list(spec.vision_fullatt_blocks or [spec.vision_depth - 1]))
        else:  # qwen3_vl(_moe): explicit head_dim, interleaved mrope, deepstack features
            text.update(head_dim=head_dim)
            if self.moe:  # every layer sparse: 4 experts, 2 a token (Qwen3-VL-30B-A3B: 128, 8)
                text.update(moe_experts(spec), decoder_sparse_step=1, mlp_only_layers=[])
            text["rope_parameters"]["mrope_interleaved"] = True
            vision.update(hidden_size=spec.vision_hidden_size,
                          intermediate_size=spec.vision_intermediate_size or spec.vision_hidden_size * 2,
                          out_hidden_size=spec.hidden_size, num_position_embeddings=256,
                          deepstack_visual_indexes=[spec.vision_depth - 1])
        return self.wired_config(text, vision, tokenizer, spec)

    def wired_config(self, text: dict, vision: dict, tokenizer, spec):
        """The family's config of `text` and `vision`, its vision token ids the tokenizer's (the defaults are
        the released vocabulary's, past a tiny one's end)."""
        import transformers

        ids = {t: tokenizer.convert_tokens_to_ids(t)
               for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
        config_class = getattr(transformers, self.model_class.replace("ForConditionalGeneration", "Config"))
        return config_class(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                            video_token_id=ids["<|video_pad|>"],
                            vision_start_token_id=ids["<|vision_start|>"],
                            vision_end_token_id=ids["<|vision_end|>"],
                            tie_word_embeddings=spec.tie_word_embeddings)


@cache
def _images_only_class(processor_class: str) -> type:
    """A subclass of a Qwen-VL processor whose only sub-processors are image processor and tokenizer.

    Transformers' Qwen-VL processors also load a video processor, which needs torchvision; ProcessorMixin
    reads the sub-processors from `__init__`'s signature, so this one takes (image_processor, tokenizer,
    chat_template).
    """
    import transformers

    base = getattr(transformers, processor_class)

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        base.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return type(f"ImagesOnly{processor_class}", (base,),
                {"__init__": __init__, **saved_as(processor_class, base)})


def saved_as(processor_class: str, base: type) -> dict[str, Any]:
    """`to_dict` and `save_pretrained` for an images-only subclass of `base`: the folder it writes names
    `processor_class` (processor_config.json and tokenizer_config.json), so AutoProcessor loads it, and holds
    the image processor's own preprocessor_config.json too, as released checkpoints do (where torchvision
    exists, AutoProcessor also builds the video processor, from that file when the folder has no video
    config)."""

    def to_dict(self) -> dict[str, Any]:
        out = base.to_dict(self)
        out["processor_class"] = processor_class  # advertise the real class for AutoProcessor
        return out

    def save_pretrained(self, save_directory, **kwargs):
        result = base.save_pretrained(self, save_directory, **kwargs)
        self.tokenizer._set_processor_class(processor_class)
        self.tokenizer.save_pretrained(save_directory)  # tokenizer_config.json names the real class too
        self.image_processor.save_pretrained(save_directory)
        return result

    return {"to_dict": to_dict, "save_pretrained": save_pretrained}


_VISION = dict(image_token="<|image_pad|>", vision_module="visual.", projector_module="merger",
               vision_tokens=("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"))
_QWEN3_VL = dict(chat_template_file="qwen3_vl.jinja", patch_size=16, tools_template_file=None,
                 tool_tokens=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
                              "</think>"))
QWEN_FAMILIES = (
    QwenVLFamily("qwen2_vl", "Qwen2VLForConditionalGeneration", "Qwen2VLProcessor", "grid1000", **_VISION),
    QwenVLFamily("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor", "pixels",
                 **_VISION),
    QwenVLFamily("qwen3_vl", "Qwen3VLForConditionalGeneration", "Qwen3VLProcessor", "grid1000", **_VISION,
                 **_QWEN3_VL),
    QwenVLFamily("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", "Qwen3VLProcessor", "grid1000",
                 **_VISION, **_QWEN3_VL, moe=True),
)
