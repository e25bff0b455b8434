"""Fault injection for tests/test_faults.py, loaded by Python at start-up when this folder is on PYTHONPATH.

VLMEXP_FAULT selects one fault in the training process (nothing happens without it):
  kill_at_step:N    SIGKILL right after step N was logged (a preempted node)
  kill_in_save:N    SIGKILL while checkpoint-N is being written: weights and optimizer are on disk,
                    trainer_state.json is not (a node lost mid-save)
(A full disk is not planted: tests/test_faults.py fills a real tmpfs.)
"""

import os

FAULT = os.environ.get("VLMEXP_FAULT", "")

if FAULT:
    import signal

    kind, _, step = FAULT.partition(":")
    step = int(step)

    def kill() -> None:
        """SIGKILL once the metrics logged so far have reached the store: MLflow logs asynchronously,
        and a node lost a while after a step has that step's metrics in MLflow."""
        import mlflow

        mlflow.flush_async_logging()
        os.kill(os.getpid(), signal.SIGKILL)

    from transformers import trainer as _trainer
    from transformers import trainer_callback as _callback

    if kind == "kill_at_step":
        original_log = _trainer.Trainer.log

        def log(self, logs, *args, **kwargs):
            original_log(self, logs, *args, **kwargs)
            if self.state.global_step == step and "loss" in logs:
                kill()

        _trainer.Trainer.log = log
    else:
        original_save = _callback.TrainerState.save_to_json

        def save_to_json(self, json_path):
            if f"checkpoint-{step}" in str(json_path) and kind == "kill_in_save":
                kill()
            return original_save(self, json_path)

        _callback.TrainerState.save_to_json = save_to_json
