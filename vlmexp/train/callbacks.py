"""Trainer callbacks the pipeline adds. Imported inside the stage entry points (transformers is heavy)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import TrainerCallback


class RewardFailureMetrics(TrainerCallback):
    """Add `rewards/<name>/unparsable/<reason>`: completions a reward could not parse since the last log.

    Runs before the reporting callbacks (see `with_callbacks`) and writes into the log entry itself, so
    the counts reach MLflow and trainer_state.json alike.
    """

    def __init__(self, rewards: Sequence[Any]):
        self.rewards = rewards

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or not any(k.startswith("rewards/") for k in logs):
            return
        added = {}
        for reward in self.rewards:
            failures = reward.failures
            for reason, count in failures.items():
                added[f"rewards/{reward.__name__}/unparsable/{reason}"] = float(count)
            failures.clear()
        logs.update(added)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(added)


class StopAtStep(TrainerCallback):
    """Stop training after `step` optimizer steps, saving a checkpoint there (an interruption on purpose)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_save = True
            control.should_training_stop = True
        return control
