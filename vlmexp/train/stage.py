"""A training stage's life, what every stage entry point does the same way: seed, model and processor, sampled
data, the MLflow run it logs into, the TRL arguments, the model to train, then training (resuming from the
newest complete checkpoint), saving final/ and closing the run.

A stage process is told its state explicitly: the config (its tracking store, its data section) and, when
the pipeline started it, `--mlflow-run-id` (the stage's child run). Nothing reaches it through environment
variables, so `vlmexp train STAGE --config C` run by hand behaves like a stage the pipeline starts: it
samples only when the sampled files are not those the config asks for, and logs to the configured store
(into a run of its own).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmexp.config.schema import Config
from vlmexp.config.stages import StageConfig
from vlmexp.families import Family
from vlmexp.files import made_by_vlmexp, mark_folder
from vlmexp.paths import KEY_FILE
from vlmexp.tracking.stage_run import NullStageRun, StageRun, open_stage_run

log = logging.getLogger("vlmexp.train")


@dataclass
class StageInputs:
    cfg: Config
    stage: str  # "sft" | "dpo" | "grpo"
    stage_dir: Path
    model_path: str  # a model folder or hub id, or a LoRA adapter folder (see `modeling.adapter_base`)
    family: Family
    processor: Any
    budget: Any
    train_path: Path
    resume_from: str | None  # newest complete checkpoint of this stage when resuming, else None
    run: StageRun = field(default_factory=NullStageRun)  # logs nothing: tracking off, or not rank 0
    val_path: Path | None = None  # the sampled held-out records (validation during training), None when none

    @property
    def stage_cfg(self) -> StageConfig:
        return getattr(self.cfg, self.stage)


def prepare_stage(cfg: Config, stage: str, model_path: str | None = None,
                  mlflow_run_id: str | None = None) -> StageInputs:
    """Seed, resolve the model and its processor, make sure the sampled data exists, open the MLflow run."""
    from accelerate import PartialState
    from transformers import set_seed

    from vlmexp.config.trl_args import runs_on_cpu
    from vlmexp.data.run_data import prepare_data
    from vlmexp.disk import warn_if_short
    from vlmexp.families import detect_family
    from vlmexp.model_rewards.probe import check_model_rewards
    from vlmexp.modeling import adapter_base, check_hardware, resolve_model
    from vlmexp.processor import load_processor
    from vlmexp.train.validation import check_sharding
    from vlmexp.train.verbosity import quiet_model_saves

    # accelerate's state as the trainer will make it (transformers builds it with cpu=use_cpu), before any
    # rank asks it: on a machine without CUDA a bare PartialState() is one process in every rank, so each rank
    # would take itself for the main one (open the MLflow run, build the tiny model beside the others)
    state = PartialState(cpu=runs_on_cpu(getattr(cfg, stage).args))
    quiet_model_saves()  # a tiny model's build below, unless verbose (the checkpoints': show_progress)
    check_hardware(getattr(cfg, stage), stage)
    check_model_rewards(cfg, stage)  # a judge endpoint that is down, before any model loads
    check_sharding(cfg, stage)  # validation during training with sharded parameters over several processes
    set_seed(cfg.run.seed)
    Path(cfg.run.output_dir).mkdir(parents=True, exist_ok=True)
    # Every rank of a launch gets here. The main process builds first (tiny model, sampled data): a non-zero
    # rank's save_pretrained may skip the weights once torch.distributed is up. Then each node's local main
    # process (whose output folder may be its own disk) before that node's other ranks, which find both
    # current and only read them. Each context waits on a barrier of all ranks, so no rank reads data that
    # another is still writing; a single process just runs the body.
    with state.main_process_first(), state.local_main_process_first():
        if model_path is None:
            model_path, family = resolve_model(cfg.model, cfg.run.output_dir)
        else:
            family = detect_family(adapter_base(model_path) or model_path)
        # sampled again only when the files are not what this config asks for (data section, seed, sources)
        data = prepare_data(cfg, reuse=True)
    if Path(model_path).is_dir():  # absolute, so adapters saved from it name a base that loads from anywhere
        model_path = str(Path(model_path).resolve())
    processor = load_processor(model_path, family, cfg.model.image_knobs,
                               trust_remote_code=cfg.model.trust_remote_code)
    stage_dir = Path(cfg.run.output_dir) / stage
    warn_if_short(cfg.run.output_dir, model_path, getattr(cfg, stage).peft is None)
    resume_from = last_checkpoint(stage_dir) if getattr(cfg, stage).resume else None
    run = open_stage_run(cfg, stage, mlflow_run_id) if state.is_main_process else NullStageRun()
    return StageInputs(cfg, stage, stage_dir, model_path, family, processor, family.image_budget(processor),
                       data.train, resume_from, run, data.val)


def trl_args(inputs: StageInputs, **stage_args: Any):
    """The stage's TRL config: the user's args plus what the pipeline owns (output, seed, tracking,
    DeepSpeed)."""
    import warnings

    from vlmexp.config.trl_args import build_trl_config

    # TRL 1.16 switches activation checkpointing off and on (around each GRPO generation, DPO's reference
    # pass) through the model methods transformers 5 renamed
    # (trl.models.utils.disable_gradient_checkpointing): three FutureWarnings each time, from TRL's code, not
    # ours; exactly those are silenced
    warnings.filterwarnings("ignore", message=r"`(is_gradient_checkpointing|"
                                              r"gradient_checkpointing_(enable|disable))` "
                                              "is deprecated", category=FutureWarning)

    cfg = inputs.cfg
    pipeline = dict(seed=cfg.run.seed, run_name=f"{cfg.run.name}-{inputs.stage}",
                    trust_remote_code=cfg.model.trust_remote_code,  # also governs GRPO's reference model
                    # the stage's run logs what the Trainer reports (vlmexp.tracking.callbacks.TrainerLogs)
                    report_to=[], **stage_args)
    if cfg.launch.deepspeed:
        pipeline["deepspeed"] = cfg.launch.deepspeed
        no_shared_memory_op_on_cpu()
    return build_trl_config(inputs.stage, inputs.stage_cfg.args, str(inputs.stage_dir), **pipeline)


def no_shared_memory_op_on_cpu() -> None:
    """On a CPU-only machine, keep DeepSpeed from compiling its shared-memory all-reduce op.

    DeepSpeed's communication backend JIT-builds `deepspeed_shm_comm` whenever it starts on its CPU
    accelerator: one to two minutes of g++ in every new environment, before the first step. Only DeepSpeed's
    `inference_all_reduce` (tensor-parallel layers) calls the op, and without it that call all-reduces
    through torch.distributed, the same sum; ZeRO's training all-reduces through torch.distributed either
    way. Marked not compatible here (DeepSpeed's own table, which `build_shm_op` reads), it is not built.
    Any other accelerator (a GPU's) is left as it is."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    log.info("DeepSpeed on CPU: its shared-memory all-reduce op (tensor-parallel inference only) "
             "is not built")


def load_model(inputs: StageInputs):
    """(model, peft_config for the trainer or None): the stage's start model as its config says to train
    it."""
    from vlmexp.modeling import load_for_training

    return load_for_training(inputs.cfg, inputs.stage_cfg, inputs.model_path, inputs.family, inputs.processor,
                             inputs.stage_dir, inputs.resume_from)


def last_checkpoint(stage_dir: Path) -> str | None:
    """Newest complete `checkpoint-N` folder, or None.

    The Trainer writes trainer_state.json last; a checkpoint whose state file is missing or does not
    parse was cut off while saving and is skipped (with a warning), falling back to the one before.
    """
    if not stage_dir.is_dir():
        return None
    candidates = sorted((p for p in stage_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
                        key=lambda p: int(p.name.split("-")[-1]), reverse=True)
    for ckpt in candidates:
        try:
            state = json.loads((ckpt / "trainer_state.json").read_text())
            if state.get("global_step") == int(ckpt.name.split("-")[-1]):
                return str(ckpt)
        except (OSError, ValueError):
            pass
        log.warning("skipping incomplete checkpoint %s (no readable trainer_state.json)", ckpt)
    return None


def train_and_save(trainer, inputs: StageInputs, rows: int) -> Path:
    """Train (resuming from the newest complete checkpoint) and save model (or adapter) + processor to
    final/."""
    log.info("%s on %d rows from %s (resume: %s)", inputs.stage, rows, inputs.model_path, inputs.resume_from)
    run = inputs.run
    if (trainer.args.should_save and not (inputs.stage_dir / KEY_FILE).is_file()
            and not made_by_vlmexp(inputs.stage_dir)):
        # `vlmexp train` by hand (the pipeline's stages carry its key): marked as made here, so a re-run after
        # a crash may resume in it; the config check refused a folder of the user's before any work
        inputs.stage_dir.mkdir(parents=True, exist_ok=True)
        mark_folder(inputs.stage_dir, f"{inputs.stage} stage")
    from vlmexp.train.validation import add_validation, write_summary

    # eval.every_steps; refuses what it cannot run before any step
    validation = add_validation(trainer, inputs)
    from vlmexp.tracking.callbacks import CheckpointModels, HeadlineMetrics, SkipLoggedSteps, TrainerLogs
    from vlmexp.train.progress import show_progress

    show_progress(trainer, inputs.stage, inputs.stage_dir)  # one line a logging step; the dicts to a file

    if inputs.resume_from and run.enabled:
        last = run.last_logged_step()
        log.info("resuming: steps up to %d are already in MLflow run %s and are not logged again", last,
                 run.run_id)
        trainer.callback_handler.callbacks.insert(0, SkipLoggedSteps(last))
    # each checkpoint and final/ as a logged model of the run; the reward's headline chart
    models = CheckpointModels(run)
    if run.enabled:
        trainer.add_callback(TrainerLogs(run))
        trainer.add_callback(models)
        trainer.callback_handler.callbacks.insert(0, HeadlineMetrics(inputs.stage))  # before TrainerLogs
    if inputs.cfg.tracking.backend != "none":  # on every rank: each step's counts are summed over the ranks
        from vlmexp.tracking.experts import ExpertUsage, routers

        if routers(trainer.model):  # a mixture of experts: how evenly its experts are used
            trainer.add_callback(ExpertUsage(trainer.model, run))
    try:
        if finished_at(trainer, inputs.resume_from):
            restore_finished(trainer, inputs.resume_from)
        else:
            trainer.train(resume_from_checkpoint=inputs.resume_from)
        final = inputs.stage_dir / "final"
        trainer.save_model(str(final))
        if trainer.args.should_save:
            inputs.processor.save_pretrained(str(final))
            if validation is not None:
                write_summary(trainer.state, inputs.cfg, inputs.stage_dir)
            (inputs.stage_dir / "peak_memory.json").write_text(json.dumps(peak_memory()) + "\n")
        models.log_final(final, trainer.state.global_step)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (the command line raises it): stopped, not failed
        run.close("KILLED")
        raise
    except BaseException:
        run.close("FAILED")
        raise
    run.close("FINISHED")  # waits a bounded time for the records the store has not taken yet
    return final


def finished_at(trainer, checkpoint: str | None) -> bool:
    """Whether `checkpoint` is at the stage's last step already (a task retried after its stage ended: its
    store did not take the records in time). Transformers' Trainer checks max_steps only after each step, so
    resuming there would train one step the run never asked for, and log it as step max_steps + 1."""
    if checkpoint is None or trainer.args.max_steps <= 0:
        return False
    state = json.loads((Path(checkpoint) / "trainer_state.json").read_text())
    return state["global_step"] >= trainer.args.max_steps


def restore_finished(trainer, checkpoint: str) -> None:
    """The trainer as the stage left it at `checkpoint` (its weights and state), without another step."""
    from transformers.trainer_callback import TrainerState

    log.info("%s is at max_steps (%d): training is over; the final model is saved from it", checkpoint,
             trainer.args.max_steps)
    trainer._load_from_checkpoint(checkpoint)  # what `train` loads first (weights, or a PEFT adapter)
    trainer.state = TrainerState.load_from_json(str(Path(checkpoint) / "trainer_state.json"))


def peak_memory() -> dict[str, float]:
    """This process's peak resident memory and, on CUDA, peak allocated GPU memory, in MiB."""
    import resource

    import torch

    out = {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if torch.cuda.is_available():
        out["peak_gpu_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out
