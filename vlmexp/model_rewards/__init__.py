"""Rewards computed by a model: a sequence-classification reward model (`reward_model`) and a generative judge
(`judge`, a local model folder or an OpenAI-compatible endpoint). Both are registered in `vlmexp.rewards.REGISTRY`,
so a config's `grpo.rewards` entry builds them through `vlmexp.rewards_loader.build_reward` like any other reward,
and GRPO, DPO's sample scoring, the difficulty filter, validation, evaluation and `vlmexp score` call them alike.

- `base`: what they share: one batched call per generation batch, the cost (seconds and calls) and the counted
  unparsable answers reported through TRL's `log_metric` / `log_extra` hooks.
- `reward_model`: TRL's reward-model scoring (prompt + completion through the model's own chat template, the
  first logit), loaded once per process on the process's device.
- `judge`: the judge's prompt template, its strict score parsing, a local judge model.
- `client`: the OpenAI-compatible `/v1/chat/completions` client (timeout, retries with backoff, a limit on
  requests in flight).
"""

# vlmexp.rewards defines Reward and, at its end, registers the classes of this package; importing it first lets a
# submodule of this package be imported on its own (its Reward base is then complete).
import vlmexp.rewards  # noqa: E402,F401
