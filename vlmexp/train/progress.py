"""What a training stage shows on its terminal: one progress line per logging step (the stage, step/total,
the time left, the stage's one or two key figures) instead of the Trainer's dict of every metric, which goes
to the stage's `metrics.jsonl` (and to MLflow, vlmexp.tracking.callbacks.TrainerLogs). A log level of INFO or
lower for transformers (`--verbose`, `TRANSFORMERS_VERBOSITY=info`, or the stage's `args.log_level`) brings
the dicts back, and transformers' bar over a model's save ("Writing model shards": at each checkpoint, the
final save, a tiny model's build, the export), which is off otherwise (vlmexp.train.verbosity)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from transformers import TrainerCallback

from vlmexp.summary import METRICS_FILE
from vlmexp.train.verbosity import quiet_model_saves, verbose

# the figures a progress line shows, by stage; GRPO adds its rewards' means (rewards/<name>/mean) but the
# format reward's
KEY_FIGURES = {"sft": ("loss", "mean_token_accuracy"), "dpo": ("loss", "rewards/margins"),
               "grpo": ("reward",)}
SHOWN_REWARDS = 2


def key_figures(stage: str, logs: dict) -> list[tuple[str, float]]:
    """The figures of `logs` a progress line shows for `stage`, by their short names."""
    names = KEY_FIGURES.get(stage, ("loss",))
    figures = [(k.rpartition("/")[2], logs[k]) for k in names if isinstance(logs.get(k), (int, float))]
    if stage == "grpo":
        means = [(k.split("/")[1], v) for k, v in logs.items()
                 if k.startswith("rewards/") and k.endswith("/mean") and "format" not in k
                 and isinstance(v, (int, float))]
        figures += means[:SHOWN_REWARDS]
    return figures


def duration(seconds: float) -> str:
    """`1h02m`, `3m05s`, `42s`."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def progress_line(stage: str, step: int, total: int, left: float | None,
                  figures: list[tuple[str, float]]) -> str:
    """`grpo  step 40/150  2m13s left  reward 0.412  iou 0.301`."""
    parts = [f"{stage}  step {step}/{total}", f"{duration(left)} left" if left is not None else "",
             *(f"{name} {value:.4g}" for name, value in figures)]
    return "  ".join(p for p in parts if p)


class ProgressLine(TrainerCallback):
    """One line per logging step on the main process's stdout, and every log (the Trainer's full dict, with
    its step) appended to `<stage folder>/metrics.jsonl`; at the end, the stage's steps and time and where its
    metrics are."""

    def __init__(self, stage: str, folder: Path, show_line: bool = True):
        self.stage, self.file, self.show_line = stage, Path(folder) / METRICS_FILE, show_line
        self.started, self.first_step = time.monotonic(), 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.started, self.first_step = time.monotonic(), state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not state.is_world_process_zero:
            return
        self.file.parent.mkdir(parents=True, exist_ok=True)
        with self.file.open("a") as f:
            f.write(json.dumps({"step": state.global_step, **logs}, default=str) + "\n")
        if not self.show_line:
            return
        done = state.global_step - self.first_step
        elapsed = time.monotonic() - self.started
        if "train_runtime" in logs:  # the Trainer's closing log
            print(f"{self.stage}  done: {state.global_step} steps in {duration(elapsed)}; every metric in "
                  f"{self.file} and the stage's MLflow run", flush=True)
            return
        figures = key_figures(self.stage, logs)
        if not figures:  # a validation's or another callback's log: in the file, not a step of training
            return
        left = elapsed / done * (state.max_steps - state.global_step) if done > 0 else None
        print(progress_line(self.stage, state.global_step, state.max_steps, left, figures), flush=True)


def show_progress(trainer, stage: str, folder: Path) -> None:
    """Give `trainer` the progress line; unless `verbose()`, in place of transformers' progress bar and its
    dicts (ProgressCallback, PrinterCallback), and without the save's bar at each checkpoint."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    loud = verbose()
    if not loud:
        trainer.remove_callback(ProgressCallback)
        trainer.remove_callback(PrinterCallback)
    quiet_model_saves()
    trainer.add_callback(ProgressLine(stage, folder, show_line=not loud))
