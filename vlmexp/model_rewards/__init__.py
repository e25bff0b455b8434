"""Rewards computed by a model: a sequence-classification reward model (`reward_model`) and a generative judge
(`judge`, a local model folder or an OpenAI-compatible endpoint). `MODEL_REGISTRY` names them beside the
rule-based rewards' `vlmexp.rewards.REGISTRY` (`vlmexp.rewards_loader.REWARDS` holds both), so a config's
`grpo.rewards` entry builds them through `vlmexp.rewards_loader.build_reward` like any other reward, and GRPO,
DPO's sample scoring, the difficulty filter, validation, evaluation and `vlmexp score` call them alike.

- `base`: what they share: one batched call per generation batch, the cost (seconds and calls) and the counted
  unparsable answers reported through TRL's `log_metric` / `log_extra` hooks.
- `reward_model`: TRL's reward-model scoring (prompt + completion through the model's own chat template, the
  first logit), loaded once per process on the process's device.
- `judge`: the judge's prompt template, its strict score parsing, a local judge model.
- `client`: the OpenAI-compatible `/v1/chat/completions` client (timeout, retries with backoff, a limit on
  requests in flight).
"""

from vlmexp.model_rewards.judge import JudgeReward
from vlmexp.model_rewards.reward_model import RewardModelReward

MODEL_REGISTRY = {cls.name: cls for cls in (JudgeReward, RewardModelReward)}  # beside vlmexp.rewards.REGISTRY
