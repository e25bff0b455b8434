"""The embedded model's sizes (`model.tiny`): the config section that `vlmexp.tiny.TinySpec` extends with the
shapes of published checkpoints. Part of the config tree's ground floor (vlmexp.config.schema holds the
root)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt, model_validator

from vlmexp.config.base import Section


class TinyModelConfig(Section):
    """Sizes of the embedded model (`model.path: tiny:<family>`). The defaults give ~0.8M parameters, which
    train on a laptop CPU in seconds. `vlmexp.tiny.TinySpec` extends these with the shapes of published
    checkpoints."""

    hidden_size: PositiveInt = Field(128, description="Text model width (also the vision merger's output).")
    intermediate_size: PositiveInt = Field(256, description="Text model MLP width.")
    num_layers: PositiveInt = Field(2, description="Text decoder layers.")
    num_heads: PositiveInt = Field(4, description="Text attention heads; hidden_size / num_heads must be a "
                                                  "multiple of 8.")
    num_kv_heads: PositiveInt = Field(2, description="Text key/value heads (grouped-query attention); "
                                                     "divides num_heads.")
    vision_hidden_size: PositiveInt = Field(64, description="Vision tower width.")
    vision_depth: PositiveInt = Field(2, description="Vision tower blocks.")
    vision_heads: PositiveInt = Field(4, description="Vision tower attention heads.")
    vocab_size: PositiveInt = Field(1024, description="BPE vocabulary trained "
                                    "locally, before the special tokens.")
    seed: int = Field(0, description="Seed of the tokenizer corpus and the random weights.")
    corpus_tools: list[Literal["zoom"]] = Field(
        [], description="Tools whose block (the chat template's tools section, as grpo.tools shows them) the "
        "BPE merges also learn: with [zoom] the zoom tool's block is ~230 tokens instead of ~550, so each "
        "sample of a config that offers the tool is that much shorter. []: the pipeline's prompts and "
        "answers only.")
    tools_block_token: bool = Field(
        False, description="With corpus_tools: the tools' section of the system turn (as grpo.tools shows "
        "them) becomes one added token of the tokenizer, so a sample that offers the tools is ~250 tokens "
        "shorter (a real checkpoint's tokenizer renders the zoom tool's ~300). false: BPE tokens only.")

    @model_validator(mode="after")
    def _heads(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 8:
            raise ValueError("hidden_size / num_heads must be a multiple of 8 (mrope needs it)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.tools_block_token and not self.corpus_tools:
            raise ValueError("tools_block_token makes corpus_tools' block one token: set corpus_tools: "
                             "[zoom] or tools_block_token: false")
        return self
