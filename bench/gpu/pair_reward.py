"""The reward the harness's DPO cases pair samples with: at random weights every completion scores 0 on format
and IoU, so no pair has a best and a worst; this one varies with the text, so two samples make a pair.
Named in the config as `pair_reward:char_variety` (bench/gpu/stage.py runs with this folder on sys.path)."""

from vlmexp.rewards import completion_text


def char_variety(prompts, completions, **kwargs):
    """Distinct characters in the completion, scaled to about [0, 1]."""
    return [len(set(completion_text(c))) / 20 for c in completions]
