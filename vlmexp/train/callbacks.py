"""Trainer callbacks the pipeline adds. Imported inside the stage entry points (transformers is heavy)."""

from __future__ import annotations

import logging

from transformers import TrainerCallback


class SkipLoggedSteps(TrainerCallback):
    """After a resume, the steps between the checkpoint and the crash run again; their logs are dropped
    before the reporting callbacks see them, so the run's MLflow metric history has no duplicated or
    backwards steps (the values first logged stay; trainer_state.json keeps the recomputed ones)."""

    def __init__(self, last_logged_step: int):
        self.last = last_logged_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and state.global_step <= self.last:
            logs.clear()


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
    """Every `every` steps, log a table of the latest generation batch's completions to the MLflow run the
    Trainer reports to (TRL sends its own table only to wandb and trackio). It reads what GRPOTrainer
    collected: prompts, completions, each reward's score, the advantages, and the columns logged through
    `log_extra` (the record's image, solution, task and sizes, each reward's unparsable reason). The `image`
    column is the picture itself (MLflow's table view shows it): the record's image with the ground truth and
    the completion's boxes as `scorers` read them (vlmexp.evaluate.build_scorers, vlmexp.pictures), its
    weighted reward and its advantage; the file's path is `image_path`."""

    def __init__(self, trainer, every: int, rows: int, scorers=None, zooms=None):
        self.trainer, self.every, self.rows, self.scorers = trainer, every, rows, scorers
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
        if "mlflow" not in (args.report_to or []) or not self.trainer._logs["completion"]:
            return  # tracking none: mlflow may not even be installed
        import mlflow

        if mlflow.active_run() is None:
            return
        import pandas as pd

        try:
            mlflow.log_table(pd.DataFrame(self.table(state.global_step)),
                             artifact_file=f"completions/step_{state.global_step:06d}.json")
        except Exception as e:  # noqa: BLE001 - an unreachable store must not end a training run
            logging.getLogger("vlmexp.train").warning(
                "step %d: completion table not logged, MLflow store unreachable (%s); training goes on",
                state.global_step, str(e).splitlines()[0][:300])


class CompileCountLog(TrainerCallback):
    """GRPO's generation compilations (`vlmexp.generation.CompileCount`): with compiled generation, added to
    every log (so MLflow and trainer_state.json carry generation/compilations per logging step); at the end,
    whether compiled or not, logged to the stage's MLflow run when there is one."""

    def __init__(self, count, compiled: bool, run=None):
        self.count, self.compiled, self.run = count, compiled, run

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and self.compiled:
            logs.update(self.count.metrics())

    def on_train_end(self, args, state, control, **kwargs):
        from vlmexp.generation import log_compile_count

        log_compile_count(self.count, self.run, state.global_step)
