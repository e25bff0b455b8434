"""What a stage process adds to its MLflow run beyond transformers' MLflowCallback: each checkpoint and the
final model as a logged model of the run (`vlmexp.tracking.logged_models`; a checkpoint rotated away is
removed from the Models tab), and the reward under the name
that opens the run page (`HeadlineMetrics`). Only the process that holds the run (global rank 0) adds these
callbacks; an unreachable store costs the models' entries, never the training."""

from __future__ import annotations

import logging
from pathlib import Path

from transformers import TrainerCallback

from vlmexp.tracking.stage_run import StageRun

log = logging.getLogger("vlmexp.train")


class CheckpointModels(TrainerCallback):
    """Every checkpoint the Trainer saves becomes an external logged model of the stage's run at its step,
    carrying the metrics the Trainer logged at that step (loss, reward, ...); `log_final` does the same for
    the final model. The weights stay where the Trainer wrote them: the model records their folder."""

    def __init__(self, run: StageRun):
        self.run = run
        # step -> metric keys the Trainer logged at it (the last few steps)
        self.keys: dict[int, set[str]] = {}
        self._client = self._experiment = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs:
            self.keys.setdefault(state.global_step, set()).update(logs)
            for old in sorted(self.keys)[:-4]:
                del self.keys[old]

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.log_model(Path(args.output_dir) / f"checkpoint-{state.global_step}", "checkpoint",
                           state.global_step)

    def log_final(self, folder: Path, step: int) -> None:
        self.log_model(folder, "final", step)

    def log_model(self, folder: Path, model_type: str, step: int) -> None:
        import mlflow
        from mlflow.tracking import MlflowClient

        from vlmexp.tracking.logged_models import forget_rotated_checkpoints, log_folder_model

        try:
            mlflow.flush_async_logging()  # this step's metrics, queued by MLflowCallback, are in the store
            if self._client is None:
                self._client = MlflowClient(self.run.uri)
                self._experiment = self._client.get_run(self.run.run_id).info.experiment_id
            log_folder_model(self._client, self._experiment, self.run.run_id, folder, model_type, step,
                             self.keys.get(step, ()))
            if model_type == "checkpoint":  # the Trainer rotates old checkpoints away before on_save
                gone = forget_rotated_checkpoints(self._client, self._experiment, self.run.run_id)
                if gone:
                    log.info("step %d: removed the MLflow models of rotated-away %s", step, ", ".join(gone))
        except Exception as e:  # noqa: BLE001 - an unreachable store must not end a training run
            log.warning("step %d: %s not logged as an MLflow model, store unreachable (%s); training goes on",
                        step, folder, str(e).splitlines()[0][:300])


class HeadlineMetrics(TrainerCallback):
    """The stage's reward, also as `Summary/reward` (GRPO) or `Summary/reward_margin` (DPO): the first chart
    of the run page (vlmexp.tracking.tracker.HEADLINE). It runs before MLflowCallback and adds the key to what
    that logs; trainer_state.json keeps the Trainer's own keys only."""

    def __init__(self, stage: str):
        from vlmexp.tracking.tracker import HEADLINE, HEADLINE_REWARD

        key, name = HEADLINE_REWARD.get(stage, (None, None))
        self.key, self.name = key, f"{HEADLINE}/{name}"

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.key and logs and self.key in logs:
            logs[self.name] = logs[self.key]
