"""A partial-credit reward for training tests: a random tiny model scores 0 on IoU, so groups would
have zero variance and zero gradient; this one varies with the completion, so GRPO has signal."""

from vlmexp.rewards import completion_text


def char_variety(prompts, completions, **kwargs):
    """Distinct characters in the completion, scaled to about [0, 1]."""
    return [len(set(completion_text(c))) / 20 for c in completions]
