"""DPO stage entry point: seed, pairs, processor, model, trainer, train (resuming), save. Reads top to bottom.

Pairs come from the data (`dpo.pairs.from: data`, records with a chosen and a rejected answer) or from
the start model's own samples (`from: samples`): `num_samples` completions per training prompt, scored with
`grpo.rewards` (the same reward objects GRPO trains on and evaluation scores with, so DPO prefers what the
pipeline measures), best vs worst kept when their rewards differ by at least `min_margin`. The sampled pairs
are written once to <stage_dir>/pairs.jsonl (a resumed stage reuses them) with a summary in pairs.json.

Reference model: with `dpo.peft` TRL disables the adapter to get it (no copy); in full fine-tuning TRL loads
one frozen copy from the start model's folder (`model.config._name_or_path`, set by
`modeling.load_for_training`), since TRL 1.16 refuses `precompute_ref_log_probs` for image data.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlmexp.config.schema import Config
from vlmexp.train.stage import StageInputs, load_model, prepare_stage, train_and_save, trl_args

log = logging.getLogger("vlmexp.train")
PAIRS_FILE, SUMMARY_FILE = "pairs.jsonl", "pairs.json"


def run_dpo(cfg: Config, model_path: str | None = None, callbacks: Sequence[Any] = (),
            mlflow_run_id: str | None = None) -> Path:
    """Train with trl.DPOTrainer from the base model or `model_path` (the SFT stage's model or adapter)."""
    from trl import DPOTrainer

    inputs = prepare_stage(cfg, "dpo", model_path, mlflow_run_id)
    args = trl_args(inputs)
    pairs = load_pairs(inputs)
    train_dataset = build_pair_dataset(pairs)
    model, peft_config = load_model(inputs)
    trainer = DPOTrainer(model=model, ref_model=None, args=args, train_dataset=train_dataset,
                         processing_class=inputs.processor, peft_config=peft_config,
                         callbacks=list(callbacks))
    return train_and_save(trainer, inputs, len(train_dataset))


def load_pairs(inputs: StageInputs) -> list[dict[str, Any]]:
    """Pair rows {prompt, image_paths, chosen, rejected, ...} from the data or from the model's samples."""
    from vlmexp.files import read_jsonl

    if inputs.cfg.dpo.pairs.from_ == "samples":
        path = inputs.stage_dir / PAIRS_FILE
        if not path.is_file():  # a resumed stage trains on the pairs it started with
            sample_pairs(inputs, path)
        pairs = read_jsonl(path)
    else:
        pairs = pairs_from_data(inputs)
    if not pairs:
        from vlmexp.errors import ConfigError, Problem

        raise ConfigError(Problem("dpo.pairs", "min_margin", "no prompt gave a pair whose rewards differ by "
                                  "min_margin; lower dpo.pairs.min_margin, raise num_samples or temperature, "
                                  "or train SFT first", inputs.cfg.dpo.pairs.min_margin))
    return pairs


def pairs_from_data(inputs: StageInputs) -> list[dict[str, Any]]:
    """The sampled records as pairs; every one must carry a rejected answer (checked before any model
    loads)."""
    from vlmexp.data.record import read_sampled
    from vlmexp.errors import DataError, Problem
    from vlmexp.prompts import build_prompt

    out, problems = [], []
    for record in read_sampled(inputs.train_path):
        if record.rejected is None or record.target is None:
            problems.append(Problem(record.where, "chosen", "dpo.pairs.from: data needs records with chosen "
                                    f"and rejected answers, this one ({record.record_format!r}) has no "
                                    "rejected answer; use pair data or dpo.pairs.from: samples",
                                    record.problem))
            continue
        out.append({"prompt": build_prompt(record, inputs.cfg.data, inputs.family),
                    "image_paths": record.question_images, "chosen": record.target,
                    "rejected": record.rejected})
    if problems:
        raise DataError(problems[:20], title=f"{len(problems)} records without a preference pair")
    return out


def sample_pairs(inputs: StageInputs, path: Path) -> dict[str, int]:
    """Sample, score and pair; write the pairs (with scores) to `path` and a summary beside it."""
    from vlmexp.data.record import read_sampled
    from vlmexp.files import atomic_write
    from vlmexp.train.sampling import sample_and_score

    cfg, opts = inputs.cfg, inputs.cfg.dpo.pairs
    records = read_sampled(inputs.train_path)
    k = opts.num_samples
    prompts, groups, compiled = sample_and_score(
        cfg, inputs.model_path, inputs.family, inputs.budget, records,
        [(r.name, r.kwargs, r.weight) for r in cfg.grpo.rewards], k,
        opts.temperature, opts.max_new_tokens, opts.batch_size)
    inputs.run.log_metrics(compiled.metrics())
    pairs = []
    for i, record in enumerate(records):
        texts, scores = groups[i]
        pair = best_vs_worst(texts, scores, opts.min_margin)
        if pair is not None:
            pairs.append({"prompt": prompts[i], "image_paths": record.question_images, **pair,
                          "source": record.source, "source_row": record.source_row})
    summary = {"prompts": len(records), "pairs": len(pairs),
               "prompts_without_pair": len(records) - len(pairs), "num_samples": k,
               "min_margin": opts.min_margin}
    atomic_write(path, "".join(json.dumps(p) + "\n" for p in pairs))
    atomic_write(path.with_name(SUMMARY_FILE), json.dumps(summary, indent=2) + "\n")
    log.info("dpo pairs from samples: %s", summary)
    return summary


def best_vs_worst(texts: list[str], scores: list[float], min_margin: float) -> dict[str, Any] | None:
    """{chosen, rejected, chosen_score, rejected_score} for the best and worst completion, or None when their
    scores differ by less than `min_margin` (or the two texts are the same)."""
    best = max(range(len(texts)), key=lambda j: scores[j])
    worst = min(range(len(texts)), key=lambda j: scores[j])
    if scores[best] - scores[worst] < min_margin or texts[best] == texts[worst]:
        return None
    return {"chosen": texts[best], "rejected": texts[worst], "chosen_score": scores[best],
            "rejected_score": scores[worst]}


def build_pair_dataset(pairs: list[dict[str, Any]]):
    """TRL's conversational preference rows: prompt (text-only messages; TRL adds the image parts), chosen,
    rejected (assistant messages) and `images` (PIL)."""
    from datasets import Dataset

    from vlmexp.prompts import load_images

    return Dataset.from_list([{"prompt": p["prompt"], "images": load_images(p["image_paths"]),
                               "chosen": [{"role": "assistant", "content": p["chosen"]}],
                               "rejected": [{"role": "assistant", "content": p["rejected"]}]} for p in pairs])
