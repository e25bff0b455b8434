"""Validation during training (`eval.every_steps`) and the best checkpoint it finds.

Every `eval.every_steps` optimizer steps, and at the last step, the stage process generates on the first
`eval.during_training_samples` held-out records and scores them with the end-of-stage evaluation's own code
(`vlmexp.generation.Generator`, as the `generation:` section says, and `score_records`, the reward objects
training uses), then logs `val/<metric>` at
that step through the Trainer's callbacks, as the Trainer logs its own metrics: into the stage's MLflow run
(`vlmexp.tracking.callbacks.TrainerLogs`) and trainer_state.json's log history. That is EasyR1's
`trainer.val_freq`
(hiyouga/EasyR1 verl/trainer/ray_trainer.py, `_validate`). With `eval.during_training_n` N > 1 each record
gets N samples at `eval.during_training_temperature`, logged as `val/<metric>/mean_at_N` (the metric of each
of the N sample sets, averaged) and `val/<metric>/best_at_N` (the metric of each record's best-scoring
sample): verl's mean@N and best@N (volcengine/verl verl/trainer/ppo/metric_utils.py,
`process_validation_metrics`; verl's best@N is a bootstrap estimate of the best of N draws, ours the best of
the N samples drawn). MLflow refuses '@'.

The best value of `export.metric` (in `export.direction`) is kept in the Trainer's own state, the fields
transformers keeps for `metric_for_best_model`: `state.best_metric` and `state.best_global_step`. A new best
asks for a checkpoint at its step (as `save_strategy: best` does); `Trainer._save_checkpoint` then records
that folder as `state.best_model_checkpoint`, which `rotate_checkpoints` never deletes under
`save_total_limit` (transformers trainer_utils.py). The state goes into every checkpoint's trainer_state.json,
so a stage resumed after a crash keeps the best so far. A tie keeps the earlier step.

Processes: the main process generates and scores while the others wait; the metrics then go to every rank
(accelerate's `broadcast_object_list`), so all ranks take the same decision to save. Refused when more than
one process trains with FSDP or DeepSpeed ZeRO-3, whose parameters are sharded over the ranks, so a generate
on the main process alone would wait forever for the others: by `vlmexp validate`, `run` and `train` before
anything starts (`vlmexp.checks.config_paths`, from the launch section and the DeepSpeed file), and in each
rank (`check_sharding`: before the model loads, and from the built trainer for an accelerate config's).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from vlmexp.config.schema import Config
from vlmexp.generation import CompileCount
from vlmexp.tracking.stage_run import NullStageRun, StageRun

log = logging.getLogger("vlmexp.train")
PREFIX = "val/"
SUMMARY_FILE = "validation.json"  # in the stage folder: the tracked metric's history and its best checkpoint

Scorer = Callable[[Sequence[str]], tuple[dict[str, float], list[dict[str, Any]]]]


def tracked_metric(cfg: Config) -> str:
    """The validation metric the best checkpoint is chosen by: export.metric, as validation logs it."""
    n = cfg.eval.during_training_n
    return f"{PREFIX}{cfg.export.metric}" + (f"/mean_at_{n}" if n > 1 else "")


def validation_metrics(groups: Sequence[Sequence[str]], score: Scorer) -> dict[str, float]:
    """`val/...` metrics of N completions per record (`groups[i]`: record i's), scored by `score`, which maps
    one completion per record to (metrics, rows) as `vlmexp.scoring.score_records` does. N = 1: val/<metric>;
    N > 1: val/<metric>/mean_at_N and val/<metric>/best_at_N. The record count is not repeated."""
    n = len(groups[0])
    if any(len(g) != n for g in groups):
        raise ValueError("every record needs the same number of completions, got "
                         f"{sorted({len(g) for g in groups})}")
    runs = [score([g[j] for g in groups]) for j in range(n)]
    if n == 1:
        return {f"{PREFIX}{k}": v for k, v in runs[0][0].items() if k != "count"}
    def score_of(j: int, i: int) -> float:  # a judge that could not read an answer leaves its score None
        value = runs[j][1][i]["score"]
        return float("-inf") if value is None else value

    best = [groups[i][max(range(n), key=lambda j: score_of(j, i))] for i in range(len(groups))]
    best_metrics = score(best)[0]
    out = {}
    for key in runs[0][0]:
        if key != "count":
            out[f"{PREFIX}{key}/mean_at_{n}"] = sum(m[key] for m, _ in runs) / n
            out[f"{PREFIX}{key}/best_at_{n}"] = best_metrics[key]
    return out


@dataclass
class HeldOut:
    """The held-out records validation generates on, their prompts and images, the model family that prompts
    and generates for them, and how they are scored."""

    records: list[Any]  # vlmexp.data.record.SampledRecord
    prompts: list[list[dict[str, Any]]]
    images: list[list[Any]]
    family: Any  # vlmexp.families.Family
    score: Scorer


def load_held_out(cfg: Config, val_path: Path, family, processor, budget) -> HeldOut:
    """The first eval.during_training_samples records of the sampled held-out file, scored as evaluation
    scores."""
    from vlmexp.data.record import read_sampled
    from vlmexp.processor import prefills_think
    from vlmexp.prompts import build_prompt, load_images
    from vlmexp.scoring import score_records

    records = read_sampled(val_path)[: cfg.eval.during_training_samples]
    thinking = prefills_think(processor)

    prompts = [build_prompt(r, cfg.data, family) for r in records]

    def score(completions: Sequence[str]):
        return score_records(records, completions, family.box_frame, budget, cfg.grpo.rewards, thinking,
                             cfg.eval.math_grader, prompts)

    return HeldOut(records, prompts,
                   [load_images(r.question_images) for r in records], family, score)


class Validation(TrainerCallback):
    """Validate every `eval.every_steps` steps and at the last; track the best `export.metric` in the
    Trainer's state (see the module docstring)."""

    def __init__(self, trainer, cfg: Config, held_out: HeldOut, stage: str = "model",
                 run: StageRun | None = None):
        self.trainer, self.cfg, self.held_out, self.stage = trainer, cfg, held_out, stage
        self.run = run or NullStageRun()
        self.metric, self.maximize = tracked_metric(cfg), cfg.export.direction == "maximize"
        self.compile_count = CompileCount()  # every validation's generation compilations, in one count
        self.first: list[str] = []  # each record's first completion at the last validation
        # GRPO with grpo.tools (eval.tools auto, on or both): validate with the tool too
        from vlmexp.scoring import tool_modes

        self.tools = stage == "grpo" and "on" in tool_modes(cfg)
        self.zoomed: list[tuple[dict[str, Any], list]] = []  # (scored row, zoom boxes) per record, last time

    def due(self, state) -> bool:
        return state.global_step % self.cfg.eval.every_steps == 0 or state.global_step == state.max_steps

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if not self.due(state):
            return control
        logs = self.validate(model, state.global_step) if state.is_world_process_zero else None
        if state.is_world_process_zero and self.run.enabled:
            # each picture as the image `validation/record_<i>` (the run page's image slider steps through)
            for i, picture in enumerate(self.pictures()):
                self.run.log_image(picture, key=f"validation/record_{i:02d}", step=state.global_step)
            for i, picture in enumerate(self.zoom_pictures()):  # with the tool: each record's zooms
                self.run.log_image(picture, key=f"validation/zoom_{i:02d}", step=state.global_step)
        logs = share(logs)
        value = logs.get(self.metric)
        if value is not None and self.better(value, state.best_metric):
            state.best_metric, state.best_global_step = value, state.global_step
            control.should_save = True  # the Trainer records the checkpoint as state.best_model_checkpoint
        state.log_history.append({**logs, "step": state.global_step})  # as Trainer.log does
        # the handler's on_log clears it: the Trainer's own log of this step stays
        should_log = control.should_log
        self.trainer.callback_handler.on_log(args, state, control, dict(logs))
        control.should_log = should_log
        return control

    def better(self, value: float, best: float | None) -> bool:
        return best is None or (value > best if self.maximize else value < best)

    def validate(self, model, step: int) -> dict[str, float]:
        """Generate on the held-out records and score; the model, its padding side and the random state are
        left as they were (a sampled validation draws from a generator of its own, seeded by run.seed and the
        step)."""
        import torch

        from vlmexp.generation import Generator

        ev, held = self.cfg.eval, self.held_out
        n, start = ev.during_training_n, time.perf_counter()
        tokenizer = getattr(self.trainer.processing_class, "tokenizer", self.trainer.processing_class)
        side, was_training = tokenizer.padding_side, model.training
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        model.eval()
        try:
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(self.cfg.run.seed + step)
                generator = Generator.for_config(self.cfg, model, self.trainer.processing_class, held.family,
                                                 self.compile_count)
                flat = generator([p for p in held.prompts for _ in range(n)],
                                 [im for im in held.images for _ in range(n)], ev.max_new_tokens,
                                 ev.during_training_temperature, ev.batch_size)
                tool_logs = self.validate_tools(generator) if self.tools else {}
        finally:
            tokenizer.padding_side = side
            model.train(was_training)
        self.first = flat[::n]
        logs = validation_metrics([flat[i * n:(i + 1) * n] for i in range(len(held.records))], held.score)
        logs.update(tool_logs)
        logs[f"{PREFIX}seconds"] = time.perf_counter() - start
        if generator.settings.compile:
            logs.update({f"{PREFIX}{k}": v for k, v in generator.count.metrics().items()})
        log.info("step %d: validation on %d held-out records x %d: %s (%.1f s)", step, len(held.records), n,
                 {k: round(v, 4) for k, v in logs.items()}, logs[f"{PREFIX}seconds"])
        return logs

    def validate_tools(self, generator) -> dict[str, float]:
        """val/tool_<metric>, val/tool_zooms_per_answer, val/tool_zoomed_share, val/tool_zoom_on_target: one
        conversation per held-out record with grpo.tools' tools (each record's own environment), scored as
        evaluation with the tool scores (`vlmexp.evaluate.evaluate_with_tools`); each record's row and zoom
        boxes kept for the pictures."""
        from vlmexp.rewards import completion_text
        from vlmexp.tools import environment_factory
        from vlmexp.tools.zoom import answer_zoom_metrics, zoom_counts

        held, ev, tools = self.held_out, self.cfg.eval, self.cfg.grpo.tools
        make = environment_factory(tools, held.family, held.family.image_budget(generator.processor))
        environments = [make() for _ in held.records]
        for environment, images in zip(environments, held.images, strict=True):
            environment.reset(images=images)
        conversations = generator.converse(held.prompts, held.images, environments, tools.max_turns,
                                           ev.max_new_tokens, ev.during_training_temperature, ev.batch_size)
        metrics, rows = held.score([completion_text(c) for c in conversations])
        counts = [zoom_counts(c) for c in conversations]
        metrics.update(answer_zoom_metrics(counts, [e.crops for e in environments],
                                           [r.targets for r in held.records]))
        self.zoomed = [(row, list(e.crops)) for row, e in zip(rows, environments, strict=True)]
        return {f"{PREFIX}tool_{k}": v for k, v in metrics.items() if k != "count"}

    def zoom_pictures(self) -> list:
        """The first eval.during_training_pictures held-out records as the last validation with the tool
        answered them: the image with the zoom boxes in order, the crops, the answer and its score."""
        from vlmexp.zoom_pictures import zoom_picture

        return [zoom_picture(row["image"], boxes, row.get("answer") or "", row.get("score"))
                for row, boxes in self.zoomed[: self.cfg.eval.during_training_pictures] if row["image"]]

    def pictures(self) -> list:
        """The first eval.during_training_pictures held-out records with the current model's box (its first
        completion at this validation), as vlmexp.pictures draws them."""
        from vlmexp.pictures import Answer, Shown, record_picture

        count = min(self.cfg.eval.during_training_pictures, len(self.first))
        if not count:
            return []
        rows = self.held_out.score(self.first)[1][:count]
        return [record_picture(Shown(r["image"], r["task"], r.get("truth", []), str(r["solution"]),
                                     [Answer(self.stage, r.get("boxes", []), r["answer"], r["score"])]))
                for r in rows]


def share(logs: dict[str, float] | None) -> dict[str, float]:
    """The main process's validation metrics on every rank (the others wait for them here)."""
    from accelerate import PartialState

    if PartialState().num_processes == 1:
        return logs or {}
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([logs])[0] or {}


def add_validation(trainer, inputs) -> Validation | None:
    """Attach validation during training to `trainer` when eval.every_steps is on; refuse, before any step,
    what it cannot run (sharded parameters over several processes) or an export.metric it does not produce."""
    cfg = inputs.cfg
    if not cfg.eval.every_steps:
        return None
    from vlmexp.errors import ConfigError, Problem

    check_sharding(cfg, inputs.stage, trainer)
    if inputs.val_path is None:
        raise ConfigError(Problem("eval.every_steps", "", "validation during training needs "
                                  "held-out records, and the sampled data has none; set "
                                  "data.val_datasets, data.val_data_yaml or data.val_fraction, "
                                  "or eval.every_steps: 0", cfg.eval.every_steps))
    held = load_held_out(cfg, inputs.val_path, inputs.family, inputs.processor, inputs.budget)
    produced = sorted(validation_metrics([[""] * cfg.eval.during_training_n for _ in held.records],
                                         held.score))
    metric = tracked_metric(cfg)
    if metric not in produced and cfg.export.checkpoint == "best":
        raise ConfigError(Problem("export.metric", "", "export.checkpoint: best is chosen by "
                                  f"{metric}, which validation on these held-out records does not "
                                  f"produce ({', '.join(produced)}); set export.metric to a "
                                  "metric of their task", cfg.export.metric))
    callback = Validation(trainer, cfg, held, inputs.stage, inputs.run)
    trainer.add_callback(callback)
    return callback


def check_sharding(cfg: Config, stage: str, trainer=None) -> None:
    """Refuse validation during training when several processes train with sharded parameters (DeepSpeed
    ZeRO-3, FSDP): a generate on one rank would hang. From the config before the model loads
    (launch.deepspeed's zero_optimization.stage, the stage's args.fsdp), and from the built `trainer` (an
    accelerate config's)."""
    from accelerate import PartialState

    from vlmexp.launch import is_zero3, sharded_validation_problem

    processes = PartialState().num_processes
    if not cfg.eval.every_steps or processes == 1:
        return
    if trainer is not None:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        zero3, fsdp = is_deepspeed_zero3_enabled(), trainer.is_fsdp_enabled
    else:
        ds = json.loads(Path(cfg.launch.deepspeed).read_text()) if cfg.launch.deepspeed else {}
        zero3, fsdp = is_zero3(ds), bool(getattr(cfg, stage).args.get("fsdp"))
    if problem := sharded_validation_problem(processes, zero3, fsdp):
        from vlmexp.errors import ConfigError, Problem

        raise ConfigError(Problem("eval.every_steps", "", problem, cfg.eval.every_steps))


def write_summary(state, cfg: Config, stage_dir: Path) -> dict[str, Any]:
    """<stage_dir>/validation.json: the tracked metric's history, the best step, value and checkpoint (from
    the Trainer's state, so a resumed stage's history from before the crash is in it)."""
    from vlmexp.files import atomic_write

    metric = tracked_metric(cfg)
    history = [[h["step"], h[metric]] for h in state.log_history if metric in h]
    summary = {"metric": metric, "direction": cfg.export.direction, "history": history,
               "best_step": state.best_global_step if history else None,
               "best_value": state.best_metric if history else None,
               "best_checkpoint": state.best_model_checkpoint if history else None,
               "last_step": state.global_step, "last_value": history[-1][1] if history else None}
    atomic_write(stage_dir / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
    return summary
