"""What every stage entry point does the same way: config, seed, model, processor, data, checkpoints."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmexp.config import Config
from vlmexp.families import Family

log = logging.getLogger("vlmexp.train")


@dataclass
class StageInputs:
    cfg: Config
    stage_dir: Path
    model_path: str
    family: Family
    processor: Any
    budget: Any
    train_path: Path


def prepare_stage(cfg: Config, stage: str, model_path: str | None = None) -> StageInputs:
    """Seed, resolve the model and its processor, and make sure the sampled data exists."""
    from transformers import set_seed

    from vlmexp.data.prepare import prepare_data
    from vlmexp.families import detect_family
    from vlmexp.models import resolve_model
    from vlmexp.processor import load_processor, pixel_budget

    set_seed(cfg.run.seed)
    out = Path(cfg.run.output_dir)
    if model_path is None:
        model_path, family = resolve_model(cfg.model, out)
    else:
        family = detect_family(model_path)
    processor = load_processor(model_path, family, cfg.model.min_pixels, cfg.model.max_pixels,
                               trust_remote_code=cfg.model.trust_remote_code)
    train_path = out / "data" / "train.jsonl"
    if not train_path.is_file():
        train_path = prepare_data(cfg).train
    return StageInputs(cfg, out / stage, model_path, family, processor, pixel_budget(processor), train_path)


def load_model(cfg: Config, model_path: str, family: Family):
    """The family's model class from a folder or hub id, with the config's dtype and attention."""
    import torch
    import transformers

    dtype = "auto" if cfg.model.dtype == "auto" else getattr(torch, cfg.model.dtype)
    return getattr(transformers, family.model_class).from_pretrained(
        model_path, dtype=dtype, attn_implementation=cfg.model.attn_implementation,
        trust_remote_code=cfg.model.trust_remote_code,
    )


def last_checkpoint(stage_dir: Path) -> str | None:
    """Newest complete `checkpoint-N` folder (one with trainer_state.json, written last), or None."""
    if not stage_dir.is_dir():
        return None
    done = [p for p in stage_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()
            and (p / "trainer_state.json").is_file()]
    return str(max(done, key=lambda p: int(p.name.split("-")[-1]))) if done else None


def train_and_save(trainer, inputs: StageInputs, stage: str, rows: int) -> Path:
    """Train (resuming from the newest complete checkpoint) and save model + processor under final/."""
    resume = last_checkpoint(inputs.stage_dir)
    log.info("%s on %d rows from %s (resume: %s)", stage, rows, inputs.model_path, resume)
    trainer.train(resume_from_checkpoint=resume)
    final = inputs.stage_dir / "final"
    trainer.save_model(str(final))
    inputs.processor.save_pretrained(str(final))
    return final


def report_to(cfg: Config) -> list[str]:
    return ["mlflow"] if cfg.tracking.backend == "mlflow" else []
