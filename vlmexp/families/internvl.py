"""InternVL (InternVL2.5 / InternVL3 `-hf` checkpoints, transformers' native
InternVLForConditionalGeneration).

Images are cut into square tiles (448 x 448 in the released checkpoints): the grid of at least min_patches and
at most max_patches tiles whose aspect ratio is closest to the image's, plus a thumbnail of the whole image
when there is more than one tile (transformers' GotOcr2 image processor, `crop_to_patches`; VLM-R1 calls
max_patches `max_anyres_num`). Each tile becomes `image_seq_length` (256) `<IMG_CONTEXT>` tokens between
`<img>` and `</img>`. So the image budget is model.min_patches / model.max_patches, not Qwen's pixel bounds.

Boxes: InternVL is trained on boxes normalised to [0, 1000) of the original image (VLM-R1 feeds it REC files
converted so, `rec_jsons_internvl`, and its InternVL IoU reward compares in that frame), the same frame as
Qwen2-VL's: "grid1000" (vlmexp/coords.py), so ground truth kept in original pixels is mapped by the frame
alone, whatever the tiling.

Without torchvision: GotOcr2ImageProcessorPil (numpy/PIL) is what AutoImageProcessor picks, and an
images-only InternVLProcessor (no video processor) saves itself as InternVLProcessor.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar

from vlmexp.families.base import Family, tiny_text_config
from vlmexp.families.qwen import QWEN_SPECIAL_TOKENS, saved_as

# The released -hf checkpoints' image processor and processor (preprocessor_config.json,
# processor_config.json)
RELEASED_TILE, RELEASED_PATCHES, RELEASED_TOKENS_PER_TILE = 448, (1, 12), 256
PATCH_SIZE = 14  # the vision tower's patch side; a tile of side s gives (s / 14)^2 / 4 tokens
# (pixel shuffle 0.5)

# transformers' conversion script (src/transformers/models/internvl/convert_internvl_weights_to_hf.py) writes
# this template into the -hf checkpoints: an image part is `<IMG_CONTEXT>` and a newline, which the processor
# expands to <img> + image_seq_length x tiles x <IMG_CONTEXT> + </img>; no default system message.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif part['type'] == 'video' %}{{ '<video>\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TileBudget:
    """What decides an image's tiles and tokens: read from the loaded processor."""

    tile_size: int  # side of a square tile, in pixels
    min_patches: int
    max_patches: int
    tokens_per_tile: int  # the processor's image_seq_length

    def tiles(self, width: int, height: int) -> int:
        """Tiles the processor cuts an image of `width` x `height` into (the thumbnail included)."""
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

        if self.max_patches <= 1:
            return 1
        columns, rows = get_optimal_tiled_canvas((height, width), (self.tile_size, self.tile_size),
                                                 self.min_patches, self.max_patches)
        return columns * rows + (columns * rows > 1)


@dataclass(frozen=True)
class InternVLFamily(Family):
    budget_knobs: ClassVar[tuple[str, ...]] = ("min_patches", "max_patches")
    budget_summary: ClassVar[str] = "square tiles, at most max_patches per image plus a thumbnail"
    refused_model_types: ClassVar[dict[str, str]] = {
        "internvl_chat": "InternVL's original checkpoints (VLM-R1 trains those) run remote code; use their "
                         "transformers-native conversion, the -hf repositories "
                         "(e.g. OpenGVLab/InternVL3-2B-hf), model_type internvl"}
    special_tokens: ClassVar[tuple[str, ...]] = (
        *QWEN_SPECIAL_TOKENS, "<img>", "</img>", "<IMG_CONTEXT>", "<quad>", "</quad>", "<ref>", "</ref>",
        "<box>", "</box>")  # fmt: skip  # the InternVL3 -hf tokenizer: Qwen2.5-VL's plus these nine
    extra_tokens: ClassVar[tuple[str, ...]] = ("<tool_call>", "</tool_call>")
    tools_refusal: ClassVar[str] = (
        "TRL 1.16's GRPOTrainer gives an image a tool returns to the model through the image processor alone "
        "and builds the image-token positions from the Qwen-VL placeholder; InternVL's tool-turn image would "
        "need its <IMG_CONTEXT> tokens expanded per tile, which TRL does not do yet "
        "(huggingface/trl#6906, open)")
    named_tokens: ClassVar[dict[str, str]] = {"start_image_token": "<img>", "end_image_token": "</img>",
                                              "context_image_token": "<IMG_CONTEXT>",
                                              "video_token": "<video>"}

    def chat_template(self) -> str:
        return CHAT_TEMPLATE

    def images_only_processor(self) -> type:
        return _images_only_processor()

    def set_image_budget(self, processor, knobs: dict[str, int]) -> None:
        ip = processor.image_processor
        low, high = knobs.get("min_patches", ip.min_patches), knobs.get("max_patches", ip.max_patches)
        if low > high:
            raise ValueError(f"min_patches {low} exceeds max_patches {high}: lower model.min_patches "
                             f"or raise model.max_patches")
        ip.min_patches, ip.max_patches = int(low), int(high)
        # tile as the processor does by default (InternVLProcessor's images_kwargs), also where TRL calls the
        # image processor alone (GRPOTrainer counts tiles per image so)
        ip.crop_to_patches = True

    def image_budget(self, processor) -> TileBudget:
        ip = processor.image_processor
        size = dict(ip.size)
        if size["height"] != size["width"]:
            raise ValueError(f"the image processor's tiles are {size['height']} x {size['width']}; "
                             "InternVL's are square: fix size in preprocessor_config.json")
        return TileBudget(int(size["height"]), int(ip.min_patches), int(ip.max_patches),
                          int(processor.image_seq_length))

    def released_budget(self, knobs: dict[str, int]) -> TileBudget:
        return TileBudget(RELEASED_TILE, knobs.get("min_patches", RELEASED_PATCHES[0]),
                          knobs.get("max_patches", RELEASED_PATCHES[1]), RELEASED_TOKENS_PER_TILE)

    def image_tokens(self, width: int, height: int, budget: TileBudget) -> int:
        """`<IMG_CONTEXT>` tokens: image_seq_length per tile."""
        return budget.tiles(width, height) * budget.tokens_per_tile

    layout_name: ClassVar[str] = "tiles"

    def image_layout(self, image_sizes, budget: TileBudget):
        """[1] the sample's tiles, all its images together: GRPOTrainer carries tiles per sample
        (`num_tiles`), or, when every image of the generation batch is one tile, one `pixel_values` row per
        image."""
        import torch

        return torch.tensor([sum(budget.tiles(w, h) for w, h in image_sizes or [])], dtype=torch.long)

    def batch_layouts(self, batch: dict[str, Any], num_images: list[int]):
        import torch

        if batch.get("pixel_values") is None:
            return None
        tiles = batch.get("num_tiles") or num_images  # absent: one row per image (TRL's flat layout)
        return [torch.tensor([t], dtype=torch.long) for t in tiles]

    def layout_rows(self, layout) -> int:
        return int(layout.sum())

    def layout_tokens(self, layout, budget: TileBudget) -> int:
        return self.layout_rows(layout) * budget.tokens_per_tile

    def tiny_image_processor(self, spec):
        import transformers

        side = spec.tile_size or 112
        return transformers.GotOcr2ImageProcessorPil(
            size={"height": side, "width": side}, crop_to_patches=True, min_patches=RELEASED_PATCHES[0],
            max_patches=RELEASED_PATCHES[1], image_mean=[0.485, 0.456, 0.406],
            image_std=[0.229, 0.224, 0.225])

    def tiny_processor(self, image_processor, tokenizer, spec):
        side = image_processor.size["height"]
        return self.images_only_processor()(image_processor=image_processor, tokenizer=tokenizer,
                                            chat_template=tokenizer.chat_template,
                                            image_seq_length=(side // PATCH_SIZE) ** 2 // 4)

    def tiny_config(self, spec, tokenizer):
        """A Qwen2 decoder behind InternViT (absolute position embeddings, pixel shuffle 0.5, a 2-layer MLP
        projector). `spec.tile_size` (default 112: 16 tokens a tile, as the demo's 112 x 112 images give the
        tiny Qwen2.5-VL) must be a multiple of 28 for the pixel shuffle."""
        import transformers


        side = spec.tile_size or 112
        if side % (2 * PATCH_SIZE):
            raise ValueError(f"tile_size {side} must be a multiple of {2 * PATCH_SIZE} "
                             "(patch 14, pixel shuffle 0.5)")
        vision = dict(hidden_size=spec.vision_hidden_size, num_hidden_layers=spec.vision_depth,
                      num_attention_heads=spec.vision_heads,
                      intermediate_size=spec.vision_intermediate_size or 2 * spec.vision_hidden_size,
                      image_size=side, patch_size=PATCH_SIZE)
        text = {"model_type": "qwen2",
                **tiny_text_config(spec, tokenizer, eos="<|im_end|>", pad="<|endoftext|>")}
        return transformers.InternVLConfig(
            text_config=text, vision_config=vision,
            image_token_id=tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>"),
            image_seq_length=(side // PATCH_SIZE) ** 2 // 4, downsample_ratio=0.5,
            tie_word_embeddings=spec.tie_word_embeddings)


@cache
def _images_only_processor() -> type:
    """InternVLProcessor without its video processor (InternVLVideoProcessor needs torchvision); `__init__`'s
    signature is what ProcessorMixin saves and loads, image_seq_length included."""
    from transformers import InternVLProcessor

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, image_seq_length: int = 256,
                 **kwargs):
        InternVLProcessor.__init__(self, image_processor, tokenizer, None, image_seq_length=image_seq_length,
                                   chat_template=chat_template, **kwargs)

    return type("ImagesOnlyInternVLProcessor", (InternVLProcessor,),
                {"__init__": __init__, **saved_as("InternVLProcessor", InternVLProcessor)})


INTERNVL = InternVLFamily("internvl", "InternVLForConditionalGeneration", "InternVLProcessor", "grid1000",
                          image_token="<IMG_CONTEXT>", vision_tokens=("<img>", "</img>", "<IMG_CONTEXT>"),
                          vision_module="vision_tower.", projector_module="multi_modal_projector.")
