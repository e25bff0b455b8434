"""What every stage entry point does the same way: config, seed, model, processor, data, checkpoints."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmexp.config import Config, StageConfig
from vlmexp.errors import ConfigError, Problem
from vlmexp.families import Family

log = logging.getLogger("vlmexp.train")

# Set by the pipeline for its stage processes: the data was sampled by its own task for this config.
SAMPLED_ENV = "VLMEXP_DATA_SAMPLED"


@dataclass
class StageInputs:
    cfg: Config
    stage: str  # "sft" | "grpo"
    stage_dir: Path
    model_path: str  # a model folder or hub id, or a LoRA adapter folder (see `adapter_base`)
    family: Family
    processor: Any
    budget: Any
    train_path: Path
    resume_from: str | None  # newest complete checkpoint of this stage when resuming, else None

    @property
    def stage_cfg(self) -> StageConfig:
        return getattr(self.cfg, self.stage)


def adapter_base(path: str) -> str | None:
    """The base model of a PEFT adapter folder (adapter_config.json), or None for a full model."""
    config = Path(path) / "adapter_config.json"
    return json.loads(config.read_text())["base_model_name_or_path"] if config.is_file() else None


def check_hardware(stage_cfg: StageConfig, stage: str) -> None:
    """Refuse what this machine cannot run, before anything is loaded."""
    import importlib.util

    import torch

    if stage_cfg.peft is None or stage_cfg.peft.method != "qlora":
        return
    if not torch.cuda.is_available():
        raise ConfigError(Problem(f"{stage}.peft.method", "", "QLoRA loads the base in 4 bits with bitsandbytes, "
                                  "which needs a CUDA GPU; on this machine use method: lora", "qlora"))
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(Problem(f"{stage}.peft.method", "", "QLoRA needs bitsandbytes: "
                                  "pip install 'vlmexp[gpu]'", "qlora"))


def prepare_stage(cfg: Config, stage: str, model_path: str | None = None) -> StageInputs:
    """Seed, resolve the model and its processor, and make sure the sampled data exists."""
    from filelock import FileLock
    from transformers import set_seed

    from vlmexp.data.prepare import prepare_data
    from vlmexp.families import detect_family
    from vlmexp.models import resolve_model
    from vlmexp.processor import load_processor, pixel_budget

    check_hardware(getattr(cfg, stage), stage)
    set_seed(cfg.run.seed)
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Every rank of a launch gets here: local rank 0 builds (tiny model, sampled data), the others wait for
    # it, since a non-zero rank's save_pretrained may skip the weights once torch.distributed is up. The
    # ready marker names this launch (host and launcher pid), so a marker left by an earlier launch never
    # lets a rank read data that rank 0 is about to resample.
    first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    launch = f"{socket.gethostname()}:{os.getppid() if 'LOCAL_RANK' in os.environ else os.getpid()}"
    train_path, ready = out / "data" / "train.jsonl", out / ".prepared"
    for _ in range(3600):
        with FileLock(out / ".prepare.lock"):
            if first or (ready.is_file() and ready.read_text() == launch and train_path.is_file()):
                if model_path is None:
                    model_path, family = resolve_model(cfg.model, out)
                else:
                    family = detect_family(adapter_base(model_path) or model_path)
                # The pipeline samples once in its own task before any stage (SAMPLED_ENV); a stage run by
                # hand samples here, so a changed data section or source never trains on stale records.
                if first and (os.environ.get(SAMPLED_ENV) != "1" or not train_path.is_file()):
                    train_path = prepare_data(cfg).train
                if first:
                    ready.write_text(launch)
                break
        time.sleep(1)
    else:
        raise TimeoutError(f"local rank 0 did not prepare {out} within an hour")
    if Path(model_path).is_dir():  # absolute, so adapters saved from it name a base that loads from anywhere
        model_path = str(Path(model_path).resolve())
    processor = load_processor(model_path, family, cfg.model.min_pixels, cfg.model.max_pixels,
                               trust_remote_code=cfg.model.trust_remote_code)
    stage_dir = out / stage
    resume_from = last_checkpoint(stage_dir) if getattr(cfg, stage).resume else None
    return StageInputs(cfg, stage, stage_dir, model_path, family, processor, pixel_budget(processor), train_path,
                       resume_from)


def load_pretrained(cfg: Config, model_path: str, family: Family, quantize_4bit: bool = False):
    """The family's model class from a folder or hub id, with the config's dtype and attention."""
    import torch
    import transformers

    dtype = "auto" if cfg.model.dtype == "auto" else getattr(torch, cfg.model.dtype)
    extra: dict[str, Any] = {}
    if quantize_4bit:
        extra["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16, llm_int8_skip_modules=["visual", "lm_head"])
    return getattr(transformers, family.model_class).from_pretrained(
        model_path, dtype=dtype, attn_implementation=cfg.model.attn_implementation,
        trust_remote_code=cfg.model.trust_remote_code, **extra,
    )


def merged_start(inputs: StageInputs, adapter: str) -> str:
    """Merge an adapter into its base once, under <stage_dir>/start-merged, and return that folder.

    A folder on disk (not an in-memory merge) so GRPO's reference model, loaded from the policy's
    `name_or_path`, is the merged model rather than the bare base.
    """
    from filelock import FileLock
    from peft import PeftModel

    target = inputs.stage_dir / "start-merged"
    inputs.stage_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(inputs.stage_dir / ".merge.lock"):  # one rank merges, the others wait and reuse
        if not (target / "config.json").is_file():
            base = load_pretrained(inputs.cfg, adapter_base(adapter), inputs.family)
            merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
            tmp = target.with_name(target.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            merged.save_pretrained(str(tmp), is_main_process=True)
            inputs.processor.save_pretrained(str(tmp))
            tmp.rename(target)
            log.info("merged adapter %s into %s", adapter, target)
    return str(target.resolve())


def load_model(inputs: StageInputs):
    """(model, peft_config for the trainer or None). Handles full, LoRA, QLoRA and starting from an adapter:
    `grpo.sft_adapter: merge` merges it first, `continue` keeps training it."""
    stage_cfg, path = inputs.stage_cfg, inputs.model_path
    base = adapter_base(path)
    if base is not None and getattr(stage_cfg, "sft_adapter", "merge") == "merge":
        path, base = merged_start(inputs, path), None
    qlora = stage_cfg.peft is not None and stage_cfg.peft.method == "qlora"
    weights = base or path
    ckpt = inputs.resume_from
    if ckpt and (Path(ckpt) / "config.json").is_file() and not (Path(ckpt) / "adapter_config.json").is_file():
        # Full-model resume: the Trainer restores optimizer, scheduler, RNG and step, but loads the weights
        # with a plain load_state_dict that skips transformers' key conversion, so a Qwen-VL checkpoint
        # (saved as model.layers.*, visual.*) would silently keep only lm_head (transformers#43701).
        # from_pretrained converts the keys; the Trainer's own load then only matches lm_head (same values)
        # and warns about the other keys: that warning is expected.
        log.info("loading the weights to resume from %s through from_pretrained (transformers#43701)", ckpt)
        weights = ckpt
    model = load_pretrained(inputs.cfg, weights, inputs.family, quantize_4bit=qlora)
    model.config._name_or_path = base or path  # GRPO builds its reference model from this: the start model
    if base is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, path, is_trainable=True)
        log.info("continuing to train the adapter in %s", path)
        return model, None
    frozen = freeze(model, vision=stage_cfg.freeze_vision, merger=stage_cfg.freeze_merger)
    if frozen:
        log.info("froze %d vision parameters", frozen)
    return model, lora_config(stage_cfg)


def freeze(model, vision: bool, merger: bool) -> int:
    """Stop gradients to the vision tower and/or the merger (projector); return the number of tensors frozen."""
    n = 0
    for name, param in model.named_parameters():
        if "visual." not in name:
            continue
        if (merger if "merger" in name else vision):
            param.requires_grad_(False)
            n += 1
    return n


def lora_config(stage_cfg: StageConfig):
    if stage_cfg.peft is None:
        return None
    from peft import LoraConfig

    p = stage_cfg.peft
    return LoraConfig(r=p.r, lora_alpha=p.alpha, lora_dropout=p.dropout, target_modules=p.target_modules,
                      modules_to_save=p.modules_to_save, task_type="CAUSAL_LM")


def trl_args(inputs: StageInputs, **stage_args: Any):
    """The stage's TRL config: the user's args plus what the pipeline owns (output, seed, tracking, DeepSpeed)."""
    from vlmexp.trl_args import build_trl_config

    cfg = inputs.cfg
    pipeline = dict(seed=cfg.run.seed, run_name=f"{cfg.run.name}-{inputs.stage}",
                    trust_remote_code=cfg.model.trust_remote_code,  # also governs GRPO's reference model
                    report_to=["mlflow"] if cfg.tracking.backend == "mlflow" else [], **stage_args)
    if cfg.launch.deepspeed:
        pipeline["deepspeed"] = cfg.launch.deepspeed
    return build_trl_config(inputs.stage, inputs.stage_cfg.args, str(inputs.stage_dir), **pipeline)


VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def vision_token_ids(processor) -> list[int]:
    """Ids of the vision placeholder tokens. A completion must never contain them: Qwen-VL's rope index
    counts them as image positions, and the policy's forward pass fails with a shape mismatch."""
    tok = processor.tokenizer
    ids = [tok.convert_tokens_to_ids(t) for t in VISION_TOKENS]
    return [i for i in ids if i is not None and i != tok.unk_token_id]


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
    """Train (resuming from the newest complete checkpoint) and save model (or adapter) + processor to final/."""
    log.info("%s on %d rows from %s (resume: %s)", inputs.stage, rows, inputs.model_path, inputs.resume_from)
    if inputs.resume_from and "mlflow" in (trainer.args.report_to or []):
        from vlmexp.train.callbacks import SkipLoggedSteps, last_logged_step

        last = last_logged_step(os.environ.get("MLFLOW_TRACKING_URI"), os.environ.get("MLFLOW_RUN_ID"))
        log.info("resuming: steps up to %d are already in MLflow run %s and are not logged again", last,
                 os.environ.get("MLFLOW_RUN_ID"))
        trainer.callback_handler.callbacks.insert(0, SkipLoggedSteps(last))
    store_errors: tuple[type[BaseException], ...] = ()  # with tracking none, mlflow is never imported
    if "mlflow" in (trainer.args.report_to or []):
        from mlflow.exceptions import MlflowException

        store_errors = (MlflowException,)
    try:
        trainer.train(resume_from_checkpoint=inputs.resume_from)
    except store_errors as e:
        # transformers' MLflowCallback ends the MLflow run in on_train_end, after the last checkpoint: a
        # store that went away mid-run must not cost the finished model (the pipeline closes the run)
        if trainer.state.global_step < trainer.state.max_steps:
            raise
        log.warning("training finished, but MLflow could not close the run (%s); saving the model",
                    str(e).splitlines()[0][:300])
    final = inputs.stage_dir / "final"
    trainer.save_model(str(final))
    if trainer.args.should_save:
        inputs.processor.save_pretrained(str(final))
        (inputs.stage_dir / "peak_memory.json").write_text(json.dumps(peak_memory()) + "\n")
    return final


def peak_memory() -> dict[str, float]:
    """This process's peak resident memory and, on CUDA, peak allocated GPU memory, in MiB."""
    import resource

    import torch

    out = {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if torch.cuda.is_available():
        out["peak_gpu_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def with_callbacks(trainer, first: Sequence[Any] = (), last: Sequence[Any] = ()):
    """Add callbacks; `first` ones run before the reporting callbacks, so metrics they add to the logs
    reach MLflow as well."""
    for cb in reversed(first):
        trainer.callback_handler.callbacks.insert(0, cb)
    for cb in last:
        trainer.add_callback(cb)
    return trainer
