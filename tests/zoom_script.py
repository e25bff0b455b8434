"""A scripted policy for multi-turn tests: a forward hook that makes a tiny random model write chosen turns
(tool calls, answers) through the real generate path (HF generate inside TRL's GRPOTrainer, or evaluation's
Generator), so a test can drive the zoom tool without a trained model.

Generation only: the hook adds a large bias to the chosen next token's logit on forward calls that carry a
key/value cache (generate); the loss forward (no cache) sees the model's own logits. Which turns a prompt
gets is chosen by a tag in its user text (`[script:<name>]`); the turn it is at is the number of tool
responses in the conversation so far.
"""

from __future__ import annotations

import json

CALL = '<tool_call>\n{{"name": "image_zoom_in_tool", "arguments": {{"bbox_2d": {box}}}}}\n</tool_call>'


# Qwen3.5's own call format (its chat template's tools block asks for it; TRL's Qwen3.5 parser reads it)
QWEN3_5_CALL = ("<tool_call>\n<function=image_zoom_in_tool>\n<parameter=bbox_2d>\n{box}\n</parameter>\n"
                "</function>\n</tool_call>")


def call(box, family: str = "") -> str:
    """A zoom call in `family`'s format (Qwen's JSON call unless Qwen3.5)."""
    form = QWEN3_5_CALL if family.startswith("qwen3_5") else CALL
    return form.format(box=json.dumps(list(box)))


class ScriptedTurns:
    """`scripts[name]` lists the turns a prompt tagged `[script:name]` writes, one per assistant turn; past
    the list its last turn repeats. `hook` goes on the model with
    `register_forward_hook(..., with_kwargs=True)`."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]], header: str = "<|im_start|>assistant\n"):
        """`header`: what the chat template's generation prompt opens a turn with (Qwen3.5's opens the think
        block)."""
        self.tokenizer, self.scripts = tokenizer, scripts
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.header = tokenizer.encode(header)
        self.rows = None  # the token ids of each row of the batch being generated

    def _turn_ids(self, ids: list[int]) -> list[int]:
        text = self.tokenizer.decode(ids)
        name = text.split("[script:", 1)[1].split("]", 1)[0]
        turns = self.scripts[name]
        turn = turns[min(text.count("<tool_response>"), len(turns) - 1)]
        return self.tokenizer.encode(turn) + [self.eos]

    def _written(self, ids: list[int]) -> int:
        """Tokens of the current assistant turn written so far (after the last assistant header)."""
        h = len(self.header)
        for start in range(len(ids) - h, -1, -1):
            if ids[start:start + h] == self.header:
                return len(ids) - start - h
        raise AssertionError("no assistant turn open")

    def hook(self, module, args, kwargs, output):
        import torch

        cache = kwargs.get("past_key_values")
        if cache is None:
            return output  # the loss forward: the model's own logits
        ids = kwargs["input_ids"]
        fresh = cache.get_seq_length() == ids.size(1)  # the prefill (the cache holds just these tokens)
        self.rows = (ids.tolist() if fresh or self.rows is None
                     else [r + n for r, n in zip(self.rows, ids.tolist(), strict=True)])
        logits = output.logits
        for b, row in enumerate(self.rows):
            pad = getattr(self.tokenizer, "pad_token_id", None)
            row = [t for t in row if t != pad]
            want = self._turn_ids(row)
            n = self._written(row)
            token = want[n] if n < len(want) else self.eos
            bias = torch.zeros_like(logits[b, -1])
            bias[token] = 1e4
            logits[b, -1] = logits[b, -1] + bias
        return output
