"""The Trainer callbacks through which a stage process logs to its run (`vlmexp.tracking.stage_run`): the
Trainer's params and logs (`TrainerLogs`, in place of transformers' MLflowCallback), each checkpoint and the
final model as logged models (`CheckpointModels`), the reward under the name that opens the
run page (`HeadlineMetrics`), GRPO's completion tables (`CompletionTable`), generation's compile count
(`CompileCountLog`), and the steps a resume must not log twice (`SkipLoggedSteps`). Imported inside the stage
entry points (transformers is heavy)."""

from __future__ import annotations

import logging
from pathlib import Path

from transformers import TrainerCallback

from vlmexp.tracking.stage_run import StageRun

log = logging.getLogger("vlmexp.train")
MAX_PARAM_CHARS = 6000  # MLflow's longest param value (mlflow.utils.validation.MAX_PARAM_VAL_LENGTH)


class TrainerLogs(TrainerCallback):
    """What transformers' MLflowCallback logs, through the stage's run (so never waiting for the store): when
    training begins the Trainer's arguments and the model's config as params (flattened; a value longer than
    MLflow takes is left out, with a warning), and each log's numbers at the step it is logged (names MLflow
    refuses sanitised, as that callback does). The Trainer reports to nothing itself (`report_to` none), so
    TRL's per-call profiling timings, which it sends to an active MLflow run only, are not logged."""

    def __init__(self, run: StageRun):
        self.run, self.dropped = run, set()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero:
            return
        from transformers.utils.generic import flatten_dict

        params = args.to_dict()
        if getattr(model, "config", None) is not None:
            params = {**model.config.to_dict(), **params}
        params = flatten_dict(params)
        if long := sorted(k for k, v in params.items() if len(str(v)) > MAX_PARAM_CHARS):
            log.warning("params longer than MLflow takes, not logged: %s", ", ".join(long))
        self.run.log_params({k: v for k, v in params.items() if k not in long})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        numbers = {}
        for key, value in logs.items():
            if hasattr(value, "numel") and value.numel() == 1:
                value = value.item()
            if isinstance(value, (int, float)):
                numbers[key] = value
            elif key not in self.dropped:
                self.dropped.add(key)
                log.warning("%s is a %s, not a number: not logged to MLflow", key, type(value).__name__)
        self.run.log_metrics(numbers, state.global_step)


class SkipLoggedSteps(TrainerCallback):
    """After a resume, the steps between the checkpoint and the crash run again; their logs are dropped
    before the reporting callbacks see them, so the run's MLflow metric history has no duplicated or
    backwards steps (the values first logged stay; trainer_state.json keeps the recomputed ones)."""

    def __init__(self, last_logged_step: int):
        self.last = last_logged_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and state.global_step <= self.last:
            logs.clear()


class CheckpointModels(TrainerCallback):
    """Every checkpoint the Trainer saves becomes an external logged model of the stage's run at its step,
    carrying the metrics the Trainer logged at that step (loss, reward, ...); `log_final` does the same for
    the final model. The weights stay where the Trainer wrote them: the model records their folder."""

    def __init__(self, run: StageRun):
        self.run = run
        # step -> metric keys the Trainer logged at it (the last few steps)
        self.keys: dict[int, set[str]] = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs:
            self.keys.setdefault(state.global_step, set()).update(logs)
            for old in sorted(self.keys)[:-4]:
                del self.keys[old]

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.run.log_model(Path(args.output_dir) / f"checkpoint-{state.global_step}", "checkpoint",
                               state.global_step, self.keys.get(state.global_step, ()))

    def log_final(self, folder: Path, step: int) -> None:
        self.run.log_model(folder, "final", step, self.keys.get(step, ()))


class HeadlineMetrics(TrainerCallback):
    """The stage's reward, also as `Summary/reward` (GRPO) or `Summary/reward_margin` (DPO): the first chart
    of the run page (vlmexp.tracking.tracker.HEADLINE). It runs before the logging callback and adds the key
    to what that logs; trainer_state.json keeps the Trainer's own keys only."""

    def __init__(self, stage: str):
        from vlmexp.tracking.tracker import HEADLINE, HEADLINE_REWARD

        key, name = HEADLINE_REWARD.get(stage, (None, None))
        self.key, self.name = key, f"{HEADLINE}/{name}"

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.key and logs and self.key in logs:
            logs[self.name] = logs[self.key]


class CompletionTable(TrainerCallback):
    """Every `every` steps, log a table of the latest generation batch's completions to the stage's run (TRL
    sends its own table only to wandb and trackio). It reads what GRPOTrainer collected: prompts, completions,
    each reward's score, the advantages, and the columns logged through `log_extra` (the record's image,
    solution, task and sizes, each reward's unparsable reason). The `image` column is the picture itself
    (MLflow's table view shows it): the record's image with the ground truth and the completion's boxes as
    `scorers` read them (vlmexp.scoring.build_scorers, vlmexp.pictures), its weighted reward and its
    advantage; the file's path is `image_path`."""

    def __init__(self, trainer, run: StageRun, every: int, rows: int, scorers=None, zooms=None):
        self.trainer, self.run, self.every, self.rows, self.scorers = trainer, run, every, rows, scorers
        # with grpo.tools: (completion, width, height) -> its zoom boxes (vlmexp.tools.zoom.replayed_zooms);
        # a completion that zoomed is drawn with its zooms and crops (vlmexp.zoom_pictures)
        self.zooms = zooms

    def table(self, step: int) -> dict[str, list]:
        from vlmexp.rewards import completion_text

        logs, n = self.trainer._logs, min(self.rows, len(self.trainer._logs["completion"]))
        extra = {k: list(v)[:n] for k, v in logs["extra"].items()}
        paths = extra.pop("image", [""] * n)
        completions = [completion_text(c) for c in list(logs["completion"])[:n]]
        rewards = {f"reward/{name}": list(v)[:n] for name, v in logs["rewards"].items()}
        total = self.weighted(rewards, n)
        table = {"step": [step] * n, "image_path": paths,
                 "prompt": [completion_text(p[-1]) if isinstance(p, list) else str(p)
                            for p in list(logs["prompt"])[:n]],
                 "completion": completions, "solution": extra.pop("solution", [""] * n), "reward": total,
                 **rewards, "advantage": list(logs["advantages"])[:n], **extra}
        table["image"] = self.pictures(table, paths, completions, total)
        if self.zooms is not None:
            self.zoom_pictures(table, list(logs["completion"])[:n])
        return table

    def zoom_pictures(self, table: dict[str, list], raw: list) -> None:
        """With tools: the `zooms` column (each completion's zoom boxes, original pixels) and, for a
        completion that zoomed, its `image`: the record's image with the boxes in order and the crops beside
        it, the final answer and its weighted reward under them."""
        from vlmexp.answers import extract_answer
        from vlmexp.zoom_pictures import zoom_picture

        sizes = table.get("image_sizes") or [None] * len(raw)
        table["zooms"] = [self.zooms(c, *s[0]) if s and table["image_path"][i] else []
                          for i, (c, s) in enumerate(zip(raw, sizes, strict=True))]
        for i, boxes in enumerate(table["zooms"]):
            if boxes:
                answer = extract_answer(table["completion"][i]) or ""
                table["image"][i] = zoom_picture(table["image_path"][i], boxes, answer, table["reward"][i])

    def weighted(self, rewards: dict[str, list], n: int) -> list[float]:
        """Each completion's reward as GRPO sums it: weights times scores, a masked (NaN) score left out."""
        weights = [float(w) for w in self.trainer.reward_weights]
        return [sum(w * v[i] for w, v in zip(weights, rewards.values(), strict=False) if v[i] == v[i])
                for i in range(n)]

    def pictures(self, table: dict[str, list], paths: list, completions: list[str],
                 total: list[float]) -> list:
        """The `image` column: each completion drawn (vlmexp.pictures.completion_picture)."""
        from vlmexp.pictures import boxes_of, completion_picture

        out = []
        for i, text in enumerate(completions):
            columns = {"task": table.get("task"), "solution": table["solution"],
                       "image_sizes": table.get("image_sizes"), "accu_reward_method": table.get("method")}
            drawn = (boxes_of(self.scorers, text, columns, i)
                     if self.scorers is not None and columns["task"] and columns["image_sizes"] else {})
            out.append(completion_picture(paths[i] or "", drawn.get("truth", []), drawn.get("boxes", []),
                                          total[i], table["advantage"][i],
                                          task=columns["task"][i] if columns["task"] else "rec"))
        return out

    def on_step_end(self, args, state, control, **kwargs):
        if not self.every or state.global_step % self.every or not state.is_world_process_zero:
            return
        if not self.run.enabled or not self.trainer._logs["completion"]:
            return
        self.run.log_table(self.table(state.global_step),
                           artifact_file=f"completions/step_{state.global_step:06d}.json")


class CompileCountLog(TrainerCallback):
    """GRPO's generation compilations (`vlmexp.generation.CompileCount`): with compiled generation, added to
    every log (so MLflow and trainer_state.json carry generation/compilations per logging step); at the end,
    whether compiled or not, logged to the stage's run."""

    def __init__(self, count, compiled: bool, run: StageRun):
        self.count, self.compiled, self.run = count, compiled, run

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and self.compiled:
            logs.update(self.count.metrics())

    def on_train_end(self, args, state, control, **kwargs):
        self.run.log_metrics(self.count.metrics(), step=state.global_step)
