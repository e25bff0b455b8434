"""What a model family provides: everything a stage, evaluation, scoring or the embedded model needs to know
about a family, behind one interface. A family module (`qwen.py`, `internvl.py`) subclasses `Family`; nothing
else in vlmexp branches on a family's name.

Light on purpose: the config schema imports this table, so torch and transformers are imported only inside
the methods that need them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

BoxFrame = Literal["pixels", "grid1000"]
# The image-budget fields of `model` (vlmexp.config.schema.ModelConfig); each family reads some of them
BUDGET_KNOBS = ("min_pixels", "max_pixels", "min_patches", "max_patches")


@dataclass(frozen=True)
class Family:
    name: str  # our name, also transformers' `model_type` in a checkpoint's config.json
    model_class: str  # transformers class with the LM head
    processor_class: str  # the processor real checkpoints declare
    box_frame: BoxFrame  # "pixels": absolute pixels of the resized image; "grid1000": 0-1000 of the original
    image_token: str  # the placeholder the processor repeats once per image feature
    # image/video markers a completion must never contain (suppressed in generate)
    vision_tokens: tuple[str, ...]
    # the vision tower's parameter names contain this (freeze_vision; QLoRA leaves it unquantised)
    vision_module: str
    # ... the projector's, between vision tower and language model (freeze_merger); checked first
    projector_module: str
    # the model.* image-budget fields this family reads (BUDGET_KNOBS); the others are refused for it
    budget_knobs: ClassVar[tuple[str, ...]] = ()
    # other `model_type`s of this family's models that vlmexp does not load, and what to use instead
    refused_model_types: ClassVar[dict[str, str]] = {}

    # ---- prompts -------------------------------------------------------------------------------------------
    def chat_template(self) -> str:
        """The family's original chat template (the embedded model ships it)."""
        raise NotImplementedError

    def fit_chat_template(self, processor) -> None:
        """Make the loaded processor's generation prompt the prompt SFT's rendered targets follow (TRL's SFT
        takes as prompt the common prefix of the generation prompt and the rendered prompt + target); nothing
        to do for a template that renders an assistant turn as written. ValueError with the fix for a template
        it cannot fit."""

    # ---- tools in GRPO's rollouts (grpo.tools; vlmexp.tools) ----------------------------------------------
    # why this family's models cannot call tools in GRPO's rollouts ("" where they can): `vlmexp validate`
    # refuses grpo.tools for it with this reason
    tools_refusal: ClassVar[str] = ""

    def tools_problem(self) -> str:
        """Why grpo.tools cannot run on this family, with the fix ("" where it can)."""
        if not self.tools_refusal:
            return ""
        return (f"{self.name} cannot call tools in GRPO's rollouts: {self.tools_refusal}; use a Qwen-VL "
                "model (qwen2_5_vl, qwen3_vl) for tool use, or grpo.tools.names: []")

    def use_tools(self, processor) -> None:
        """Give the loaded processor what TRL's GRPOTrainer needs to run tools: a chat template that renders
        the tools, the assistant's calls and tool turns holding images, and a response parser
        (`response_template`) that reads the calls back out of a completion."""
        raise NotImplementedError

    # ---- processor and image budget ------------------------------------------------------------------------
    def images_only_processor(self) -> type:
        """The family's processor class without a video processor (which needs torchvision), saving itself
        under `processor_class` so AutoProcessor loads the folder where torchvision exists."""
        raise NotImplementedError

    def set_image_budget(self, processor, knobs: dict[str, int]) -> None:
        """Apply the config's budget overrides (`knobs`: only this family's `budget_knobs`, each given) to
        the loaded processor."""
        raise NotImplementedError

    def image_budget(self, processor) -> Any:
        """What maps an image size to its tokens (and the 'pixels' frame): read from the loaded processor."""
        raise NotImplementedError

    def released_budget(self, knobs: dict[str, int]) -> Any:
        """The budget of the released checkpoints, with `knobs` overriding it: for scoring completions made
        elsewhere, where no processor is loaded."""
        raise NotImplementedError

    def image_tokens(self, width: int, height: int, budget) -> int:
        """How many `image_token` placeholders an image of `width` x `height` becomes (the start/end markers
        around them not counted)."""
        raise NotImplementedError

    # ---- what GRPO's batches carry per sample (the pairing guard, vlmexp/train/grpo_pairing.py) -----------
    layout_name: ClassVar[str] = ""  # what a layout is called in the guard's messages ("grid", "tiles")

    def image_layout(self, image_sizes, budget):
        """The tensor that describes a sample's images in a training batch, as the processor makes it for
        images of `image_sizes` ([[w, h], ...]); equal layouts mean the same pixel rows and image tokens."""
        raise NotImplementedError

    def batch_layouts(self, batch: dict[str, Any], num_images: list[int]):
        """Each sample's layout in a batch reaching the loss (`image_layout`'s form), or None when it has
        none."""
        raise NotImplementedError

    def layout_rows(self, layout) -> int:
        """Rows of `pixel_values` that a layout takes."""
        raise NotImplementedError

    def layout_tokens(self, layout, budget) -> int:
        """`image_token` placeholders a layout puts in the prompt."""
        raise NotImplementedError

    def layout_image_tokens(self, layout, budget) -> list[int]:
        """The placeholders of each image of a layout, in order: asked only of the families whose batches
        carry image-token types (`mm_token_type_ids`), whose model finds each image as one run of them."""
        raise NotImplementedError

    # ---- the embedded model (vlmexp.tiny) ------------------------------------------------------------------
    special_tokens: ClassVar[tuple[str, ...]] = ()  # added as special tokens to the tiny tokenizer, in order
    extra_tokens: ClassVar[tuple[str, ...]] = ()  # added as plain tokens, as the real tokenizers do
    # tokenizer attributes the processor reads (start_image_token, ...)
    named_tokens: ClassVar[dict[str, str]] = {}

    def tiny_config(self, spec, tokenizer):
        """A transformers config of the family at `spec`'s sizes (vlmexp.tiny.TinySpec), wired to the
        tokenizer."""
        raise NotImplementedError

    def tiny_image_processor(self, spec):
        """The image processor the embedded model ships (no torchvision needed)."""
        raise NotImplementedError

    def tiny_processor(self, image_processor, tokenizer, spec):
        """The embedded model's processor, as `images_only_processor` builds it."""
        return self.images_only_processor()(image_processor=image_processor, tokenizer=tokenizer,
                                            chat_template=tokenizer.chat_template)

    # ---- shared behaviour ----------------------------------------------------------------------------------
    def check_budget_knobs(self, knobs: dict[str, int | None]) -> dict[str, int]:
        """The knobs that are set, all of them this family's; ValueError naming the field and the fix
        otherwise."""
        given = {k: v for k, v in knobs.items() if v is not None}
        if wrong := [k for k in given if k not in self.budget_knobs]:
            raise ValueError(
                f"model.{', model.'.join(wrong)} do(es) not apply to {self.name}: its image budget is "
                f"{' / '.join('model.' + k for k in self.budget_knobs)} ({self.budget_summary}); remove "
                f"{', '.join('model.' + k for k in wrong)} (write null to drop a value a base config sets)")
        return given

    budget_summary: ClassVar[str] = ""  # one phrase saying how the family sizes images

    def vision_part(self, parameter_name: str) -> Literal["vision", "projector"] | None:
        """Which part of the vision side a parameter belongs to (None: the language model or its head)."""
        if self.projector_module in parameter_name:
            return "projector"
        return "vision" if self.vision_module in parameter_name else None


def tiny_text_config(spec, tokenizer, eos: str, pad: str) -> dict:
    """The embedded model's text config at `spec`'s sizes (vlmexp.tiny.TinySpec): a Qwen2-style decoder, as
    every family here has, wired to the tokenizer's `eos` and `pad` tokens. `layer_types` has one entry per
    layer: transformers 5 reads it, and a list left from another depth fails the first forward with IndexError
    in the attention layer."""
    vocab = spec.model_vocab_size or -(-len(tokenizer) // 64) * 64  # rounded up to 64, as real checkpoints do
    if vocab < len(tokenizer):
        raise ValueError(f"model_vocab_size {vocab} is below the tokenizer's "
                         f"{len(tokenizer)} tokens: raise it")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (eos, pad)}
    return dict(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        layer_types=["full_attention"] * spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        bos_token_id=ids[pad],
        eos_token_id=ids[eos],
        pad_token_id=ids[pad],
        tie_word_embeddings=spec.tie_word_embeddings,
    )


def moe_experts(spec) -> dict:
    """A tiny mixture-of-experts text config's experts: 4 of half the MLP's width, each token taking 2, with
    the router's auxiliary loss coefficient (TRL adds that loss in SFT and GRPO and logs it as `aux_loss`)."""
    return dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=spec.intermediate_size // 2,
                router_aux_loss_coef=0.001,
                # off in the config, as released: on, generate's decode steps fail in the aux loss (a
                # one-token step against the whole attention mask, transformers 5.23); TRL asks for the router
                # logits in its loss forwards itself
                output_router_logits=False)
