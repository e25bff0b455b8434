"""A Trainer callback for tests: an interruption on purpose at a chosen step."""

from transformers import TrainerCallback


class StopAtStep(TrainerCallback):
    """Stop training after `step` optimizer steps, saving a checkpoint there."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_save = True
            control.should_training_stop = True
        return control
