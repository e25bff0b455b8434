"""GRPO's dynamic sampling, offline (`grpo.difficulty_filter`): drop the prompts whose rewards carry no
signal.

A GRPO group whose completions all score alike has zero advantage everywhere: it costs a generation and a
backward pass and teaches nothing (TRL logs its share as `frac_reward_zero_std`). DAPO's dynamic sampling and
EasyR1's `online_filtering` (hiyouga/EasyR1 verl/trainer/ray_trainer.py: keep a group when
`filter_low < mean(filter_key) < filter_high`, then generate more until the batch is full) drop such groups
during training; TRL 1.16 has no such hook (huggingface/trl#3708, open).

Why offline here: in TRL 1.16 one method, `GRPOTrainer._generate_and_score_completions`, generates, scores,
normalises advantages over groups that may span processes, and returns a batch of some twenty padded tensors
and lists (prompt and completion ids and masks, pixel values per image grid, old and reference
log-probabilities, ...) that `_prepare_inputs` then shuffles and splits. Dropping groups and refilling the
batch online means concatenating such batches across calls, re-padding each tensor and keeping every rank's
choices the same: re-implementing TRL internals that change between versions. The offline filter instead
samples before training, with the start model and the same reward objects
(`vlmexp.train.sampling.sample_and_score`, which DPO's pairs also sample through), keeps the prompts solved
sometimes but not always, and hands GRPO the kept records; TRL trains unchanged. What it cannot do is follow
the policy: a prompt that becomes too easy during training stays in (its groups then show as
frac_reward_zero_std, which TRL keeps logging). `grpo.online_filter` (vlmexp/train/online_filter.py) does the
online version, merging TRL's outputs across rounds by an explicit padding table that a test holds against
TRL's source.

Kept: a prompt whose `num_samples` scores are not all equal and whose mean lies strictly between `low` and
`high` (each bound optional). <grpo stage>/difficulty.json holds the counts and the kept rows (indices into
the sampled training records, which GRPO's dataset then selects); a resumed stage reuses it. The main process
samples; the other ranks wait for it (accelerate's main_process_first), then read the file.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from vlmexp.config.stages import DifficultyFilterConfig

log = logging.getLogger("vlmexp.train")
SUMMARY_FILE = "difficulty.json"


def verdict(scores: list[float], opts: DifficultyFilterConfig) -> str:
    """"kept", or why a prompt's group is dropped: "zero_std" (all scores equal), "low" or "high" (its
    mean)."""
    if max(scores) - min(scores) <= 1e-9 * max(1.0, abs(max(scores))):
        return "zero_std"
    mean = statistics.fmean(scores)
    if opts.low is not None and mean <= opts.low:
        return "low"
    if opts.high is not None and mean >= opts.high:
        return "high"
    return "kept"


def kept_rows(inputs, args) -> list[int]:
    """The rows of the sampled training records GRPO trains on with the filter on, from
    <stage_dir>/difficulty.json, which the main process samples and writes unless a resumed stage has it.
    `args`: the stage's GRPOConfig (its temperature and max_completion_length are the filter's defaults)."""
    from accelerate import PartialState

    path = inputs.stage_dir / SUMMARY_FILE
    state = PartialState()
    with state.main_process_first():
        if state.is_main_process and not path.is_file():
            summary = write_filtered(inputs, args, path)
            inputs.run.log_metrics({f"difficulty/{k}": v for k, v in summary.items()
                                    if isinstance(v, (int, float)) and not isinstance(v, bool)})
            inputs.run.log_artifact(path, "difficulty")
    return json.loads(path.read_text())["kept_rows"]


def write_filtered(inputs, args, path: Path) -> dict[str, Any]:
    """Sample, judge each prompt's group, write the counts and the kept rows; refuse when none is kept."""
    from vlmexp.data.record import read_sampled
    from vlmexp.files import atomic_write
    from vlmexp.processor import prefills_think
    from vlmexp.train.sampling import sample_and_score

    cfg, opts = inputs.cfg, inputs.cfg.grpo.difficulty_filter
    start = time.monotonic()
    records = read_sampled(inputs.train_path)
    rewards = [(r.name, r.kwargs, r.weight if opts.reward == "overall" else 1.0) for r in cfg.grpo.rewards
               if opts.reward in ("overall", r.name)]
    temperature = opts.temperature or args.temperature
    max_new_tokens = opts.max_new_tokens or args.max_completion_length
    _, groups, compiled = sample_and_score(cfg, inputs.model_path, inputs.family, inputs.budget, records,
                                           rewards, opts.num_samples, temperature, max_new_tokens,
                                           opts.batch_size, prefills_think(inputs.processor))
    inputs.run.log_metrics(compiled.metrics())
    verdicts = [verdict(scores, opts) for _, scores in groups]
    counts = {v: verdicts.count(v) for v in ("kept", "zero_std", "low", "high")}
    summary = {"prompts": len(records), "kept": counts["kept"], "dropped_zero_std": counts["zero_std"],
               "dropped_low": counts["low"], "dropped_high": counts["high"],
               "frac_reward_zero_std": counts["zero_std"] / max(1, len(records)),
               "mean_score": statistics.fmean(s for _, scores in groups for s in scores) if groups else 0.0,
               "num_samples": opts.num_samples, "temperature": temperature, "max_new_tokens": max_new_tokens,
               "reward": opts.reward, "low": opts.low, "high": opts.high,
               "seconds": round(time.monotonic() - start, 1)}
    if not counts["kept"]:
        from vlmexp.errors import ConfigError, Problem

        raise ConfigError(Problem("grpo.difficulty_filter", "", f"no training prompt kept: {summary}; every "
                                  f"group of {opts.num_samples} samples scored alike or its mean fell "
                                  "outside (low, high). Widen low/high, raise num_samples or temperature, "
                                  "train SFT first, or turn the filter off", opts.model_dump()))
    kept = [i for i, v in enumerate(verdicts) if v == "kept"]
    atomic_write(path, json.dumps({**summary, "kept_rows": kept}, indent=2) + "\n")
    log.info("difficulty filter: %s", summary)
    return summary
