"""Checkpoints: the newest complete one to resume from, training (resuming) and saving final/, peak memory."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from vlmexp.tracking import close_stage_run

if TYPE_CHECKING:
    from vlmexp.train.stage import StageInputs

log = logging.getLogger("vlmexp.train")


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
    run = inputs.run
    if inputs.resume_from and run is not None:
        from vlmexp.train.callbacks import SkipLoggedSteps, last_logged_step

        last = last_logged_step(run.uri, run.run_id)
        log.info("resuming: steps up to %d are already in MLflow run %s and are not logged again", last, run.run_id)
        trainer.callback_handler.callbacks.insert(0, SkipLoggedSteps(last))
    try:
        trainer.train(resume_from_checkpoint=inputs.resume_from)
    except BaseException:
        close_stage_run(run, finished=False)
        raise
    close_stage_run(run, finished=True)
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
