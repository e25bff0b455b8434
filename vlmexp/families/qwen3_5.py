"""Qwen3.5 (dense `qwen3_5`, mixture-of-experts `qwen3_5_moe`): natively multimodal hybrid models.

What differs from Qwen3-VL (vlmexp/families/qwen.py, whose processor, pixel budget, 0-1000 box grid and GRPO
layout they share):
- Text layers mix Gated DeltaNet linear attention (`linear_attn.in_proj_qkv`, `in_proj_z`, `in_proj_a`,
  `in_proj_b`, `out_proj`, a causal conv1d) with full attention (`self_attn`), every 4th layer in the released
  checkpoints (`layer_types`); the MoE variant stores its experts fused (3-D `gate_up_proj` / `down_proj`
  parameters) behind a top-k router, plus a shared expert.
- The chat template is Qwen3.5's own (TRL 1.16 ships it: `trl/chat_templates/qwen3_5_nothink.jinja`, the one
  Qwen3.5-2B and smaller ship; 4B and larger ship the `think` variant); tools are called as
  `<tool_call><function=NAME><parameter=KEY>value</parameter></function></tool_call>` and read back with TRL's
  Qwen3.5 response template (`qwen3_5_template`, the new-style form of `qwen3_5_schema`, the pair
  `trl.chat_template_utils.add_response_schema` sets for these templates).
- Thinking on, always: the no-thinking template (`qwen3_5_nothink.jinja`) closes an empty think block in its
  generation prompt (`<think>\\n\\n</think>\\n\\n`) but renders an SFT target's `<think>...</think>` in that
  block, so TRL's SFT trained each answer after `<think>\\n` while generation prompted after the closed block,
  and a completion could never hold the think block the format reward asks for (`fit_chat_template` swaps in
  the think variant, byte for byte TRL's, so TRL still knows it).
- The forward with images needs `mm_token_type_ids` (the processor returns it; vlmexp passes it on).
- Boxes: the 0-1000 grid of the original image, as Qwen3-VL's: Qwen's grounding examples
  (QwenLM/Qwen3-VL `cookbooks/spatial_understanding.ipynb`) answer `bbox_2d` on a 0-1000 scale, and Qwen3.5
  keeps Qwen3-VL's processor and coordinates (agent.viscover.site/knowledge/qwen3-coordinate-system: "Qwen3-VL
  and 3.5 uses a relative coordinate system ... normalized to a 0-1000 range").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlmexp.families.base import moe_experts, tiny_text_config
from vlmexp.families.qwen import QwenVLFamily

# the released checkpoints' pattern: every 4th text layer full attention, the others linear attention
FULL_ATTENTION_INTERVAL = 4
# the released Qwen3.5 text config rotates a quarter of each head (partial_rotary_factor 0.25)
PARTIAL_ROTARY_FACTOR = 0.25


def hybrid_layer_types(num_layers: int, interval: int = FULL_ATTENTION_INTERVAL) -> list[str]:
    """`layer_types` of a Qwen3.5 decoder: full attention every `interval`-th layer, linear attention
    otherwise; a decoder shallower than `interval` ends on one full-attention layer, so every tiny model has
    both kinds."""
    interval = min(interval, num_layers)
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


@dataclass(frozen=True)
class Qwen35Family(QwenVLFamily):
    def use_tools(self, processor) -> None:
        """Qwen3.5's own template renders tools, calls and tool turns; TRL's Qwen3.5 response template reads
        the `<function=...>` calls back (set on the tokenizer, where `parse_response` reads it; TRL sets it
        itself only for templates it knows byte for byte)."""
        from trl.chat_template_utils import qwen3_5_template

        processor.tokenizer.response_template = qwen3_5_template

    def fit_chat_template(self, processor) -> None:
        """Qwen3.5's no-thinking templates (TRL's `qwen3_5_nothink*.jinja`, which Qwen3.5-2B and smaller ship)
        -> their thinking twins, which differ only in the generation prompt: it opens the think block, as
        the rendered SFT target does (`<think>\\nreasoning\\n</think>\\n\\nanswer`), so SFT's prompt is
        generation's and completions start inside the block (`vlmexp.processor.prefills_think`). Another
        template whose generation prompt closes the block is refused, naming the fix."""
        from importlib.resources import files

        templates = files("trl") / "chat_templates"
        for owner in (processor, processor.tokenizer):
            for variant in ("", "_training"):
                if owner.chat_template == (templates / f"qwen3_5_nothink{variant}.jinja").read_text():
                    owner.chat_template = (templates / f"qwen3_5_think{variant}.jinja").read_text()
        prompt = processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "x"}]}],
                                               tokenize=False, add_generation_prompt=True)
        if not prompt.endswith("<think>\n"):
            raise ValueError(
                f"{self.name}: the chat template's generation prompt ends {prompt[-24:]!r}, not inside an "
                "open think block ('<think>\\n'): Qwen3.5's template renders an SFT target's "
                "<think>...</think> there, so SFT would train on another prompt than generation's and no "
                "completion could hold the think block the format reward asks for; give the checkpoint "
                "Qwen3.5's thinking template (trl/chat_templates/qwen3_5_think.jinja) as its "
                "chat_template.jinja")

    def tiny_image_processor(self, spec):
        import transformers

        return transformers.Qwen2VLImageProcessorPil(patch_size=self.patch_size, merge_size=2,
                                                     temporal_patch_size=2, image_mean=[0.5] * 3,
                                                     image_std=[0.5] * 3)

    def tiny_config(self, spec, tokenizer):
        """Hybrid layers (`hybrid_layer_types`), linear attention of 2 key and 4 value heads of head_dim,
        and for MoE `moe_experts` and a shared expert."""
        text: dict[str, Any] = tiny_text_config(spec, tokenizer, eos="<|im_end|>", pad="<|endoftext|>")
        head_dim = spec.head_dim or spec.hidden_size // spec.num_heads
        half = int(head_dim * PARTIAL_ROTARY_FACTOR) // 2  # mrope_section sums to the rotated half
        mrope = list(spec.mrope_section or (half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8))
        if sum(mrope) != half or half < 3:
            raise ValueError(f"mrope_section {mrope} must sum to head_dim x {PARTIAL_ROTARY_FACTOR} / 2 = "
                             f"{half} (at least 3): raise hidden_size / num_heads")
        text.update(head_dim=head_dim, layer_types=hybrid_layer_types(spec.num_layers),
                    linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_conv_kernel_dim=4)
        text["rope_parameters"].update(mrope_section=mrope, mrope_interleaved=True,
                                       partial_rotary_factor=PARTIAL_ROTARY_FACTOR)
        if self.moe:
            text.update(moe_experts(spec), shared_expert_intermediate_size=spec.intermediate_size // 2)
        vision = dict(depth=spec.vision_depth, num_heads=spec.vision_heads, in_channels=3,
                      patch_size=self.patch_size, spatial_merge_size=2, temporal_patch_size=2,
                      hidden_size=spec.vision_hidden_size,
                      intermediate_size=spec.vision_intermediate_size or spec.vision_hidden_size * 2,
                      out_hidden_size=spec.hidden_size, num_position_embeddings=256)
        return self.wired_config(text, vision, tokenizer, spec)


_QWEN35 = dict(image_token="<|image_pad|>", vision_module="visual.", projector_module="merger",
               vision_tokens=("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
               chat_template_file="qwen3_5_nothink.jinja", patch_size=16, tools_template_file=None,
               tool_tokens=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
                            "</think>"))
QWEN35_FAMILIES = (
    Qwen35Family("qwen3_5", "Qwen3_5ForConditionalGeneration", "Qwen3VLProcessor", "grid1000", **_QWEN35),
    Qwen35Family("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", "Qwen3VLProcessor", "grid1000",
                 **_QWEN35, moe=True),
)
