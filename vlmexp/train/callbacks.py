"""Trainer callbacks the pipeline adds. Imported inside the stage entry points (transformers is heavy)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from transformers import TrainerCallback


class RewardFailureMetrics(TrainerCallback):
    """Add `rewards/<name>/unparsable/<reason>` (completions a reward could not parse) and
    `rewards/<name>/masked/<reason>` (scores that were NaN, inf or a custom reward's None) since the last log.

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
            for reason, count in getattr(reward, "masked", {}).items():
                added[f"rewards/{reward.__name__}/masked/{reason}"] = float(count)
            getattr(reward, "masked", {}).clear()
        logs.update(added)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(added)


class SkipLoggedSteps(TrainerCallback):
    """After a resume, the steps between the checkpoint and the crash run again; their logs are dropped
    before the reporting callbacks see them, so the run's MLflow metric history has no duplicated or
    backwards steps (the values first logged stay; trainer_state.json keeps the recomputed ones)."""

    def __init__(self, last_logged_step: int):
        self.last = last_logged_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and state.global_step <= self.last:
            logs.clear()


def last_logged_step(tracking_uri: str | None, run_id: str | None) -> int:
    """The highest step of any metric already in MLflow run `run_id` (0 when none or no run)."""
    if not tracking_uri or not run_id:
        return 0
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    keys = client.get_run(run_id).data.metrics
    return max((m.step for k in keys for m in client.get_metric_history(run_id, k)), default=0)


class StopAtStep(TrainerCallback):
    """Stop training after `step` optimizer steps, saving a checkpoint there (an interruption on purpose)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_save = True
            control.should_training_stop = True
        return control


class CompletionTable(TrainerCallback):
    """Every `every` steps, log a table of sample completions with each reward's score to the MLflow run
    the Trainer reports to (TRL sends none to MLflow). Sees the scores through the rewards' observer hook."""

    def __init__(self, rewards: Sequence[Any], every: int, rows: int):
        self.every, self.rows, self.names = every, rows, [r.__name__ for r in rewards]
        self.batch: dict[str, list] = {}
        for reward in rewards:
            reward.observer = self.observe

    def observe(self, name, prompts, completions, scores, columns) -> None:
        from vlmexp.rewards import completion_text

        if name == self.names[0]:  # TRL calls the rewards in order on one batch
            n = min(self.rows, len(completions))
            self.batch = {
                "image": list(columns.get("image_path", [""] * n))[:n],
                "prompt": [completion_text(p[-1]) if isinstance(p, list) else str(p) for p in (prompts or [""] * n)][:n],
                "completion": [completion_text(c) for c in completions[:n]],
                "solution": list(columns.get("solution", [""] * n))[:n],
            }
        self.batch[f"reward/{name}"] = list(scores[: len(self.batch.get("completion", []))])

    def on_step_end(self, args, state, control, **kwargs):
        if not self.every or state.global_step % self.every or not state.is_world_process_zero or not self.batch:
            return
        if "mlflow" not in (args.report_to or []):  # tracking none: mlflow may not even be installed
            return
        import mlflow

        if mlflow.active_run() is None:
            return
        import pandas as pd

        table = pd.DataFrame({"step": state.global_step, **self.batch})
        try:
            mlflow.log_table(table, artifact_file=f"completions/step_{state.global_step:06d}.json")
        except Exception as e:  # noqa: BLE001 - an unreachable store must not end a training run
            logging.getLogger("vlmexp.train").warning(
                "step %d: completion table not logged, MLflow store unreachable (%s); training goes on",
                state.global_step, str(e).splitlines()[0][:300])
