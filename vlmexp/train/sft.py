"""SFT stage entry point: seed, data, processor, model, trainer, train (resuming), save. Reads top to bottom."""

from __future__ import annotations

from pathlib import Path

from vlmexp.config import Config
from vlmexp.train.common import load_model, prepare_stage, report_to, train_and_save


def run_sft(cfg: Config) -> Path:
    """Train with trl.SFTTrainer; return the folder holding the final model and processor."""
    from trl import SFTTrainer

    from vlmexp.train.data import build_dataset
    from vlmexp.trl_args import build_trl_config

    inputs = prepare_stage(cfg, "sft")
    train_dataset = build_dataset(inputs.train_path, cfg.data, inputs.family, inputs.budget, "sft")
    model = load_model(cfg, inputs.model_path, inputs.family)
    args = build_trl_config("sft", cfg.sft.args, str(inputs.stage_dir), seed=cfg.run.seed,
                            report_to=report_to(cfg), run_name=f"{cfg.run.name}-sft")
    trainer = SFTTrainer(model=model, args=args, train_dataset=train_dataset, processing_class=inputs.processor)
    return train_and_save(trainer, inputs, "SFT", len(train_dataset))
