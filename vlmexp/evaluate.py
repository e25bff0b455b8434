"""Evaluation: generate on held-out records (`vlmexp eval`) and score with the same reward objects that train;
offline scoring of completions produced elsewhere (`vlmexp score`, `read_predictions`).

Both end in `vlmexp.scoring.score_records`, the one scoring path (validation during training scores there
too), so they cannot disagree.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vlmexp.config.schema import Config
from vlmexp.errors import short
from vlmexp.scoring import score_records

if TYPE_CHECKING:
    from vlmexp.data.record import SampledRecord

log = logging.getLogger("vlmexp.eval")


def read_predictions(path: str | Path,
                     image_root: str | Path | None = None) -> tuple[list[SampledRecord], list[str]]:
    """(records, completions) of a predictions JSONL: each line a data record in any format the sampler
    reads (or a line of a sampled file), with the model's output as `completion`, normalised as the sampler
    normalises (vlmexp.data.normalise): its images are read and checked (relative paths join `image_root`,
    default the file's folder). `completion` is the output, never the record's: a prompt-completion record
    gives its reference answer as `solution`. All problems at once."""
    from vlmexp.data.formats import detect_format, no_format
    from vlmexp.data.images import ImageStore
    from vlmexp.data.normalise import Origin, normalise
    from vlmexp.data.record import from_dict
    from vlmexp.data.sources import read_records
    from vlmexp.errors import DataError, Problem

    root = str(Path(image_root or Path(path).parent).resolve())
    store, problems, records, completions = ImageStore(None), [], [], []
    for row, (where, line) in enumerate(read_records(path)):
        completion = line.get("completion")
        if not isinstance(completion, str):
            problems.append(Problem(where, "completion", "each line needs the model's output as a string "
                                    "`completion`", completion))
            continue
        record = {k: v for k, v in line.items() if k != "completion"}  # the data record the output answers
        try:
            if "schema" in record:  # a line of a sampled file (`vlmexp sample`) with a completion added
                done = from_dict(record, where), 0
            elif (found := detect_format(record)) is None:
                raise ValueError(no_format(record))
            else:
                done = normalise(record, found[0], None, where, root, store, Origin(str(path), "", row))
        except (ValueError, TypeError) as e:
            done = Problem(where, "", str(e))
        if isinstance(done, Problem):
            problems.append(done)
            continue
        records.append(done[0])
        completions.append(completion)
    if problems:
        raise DataError(problems, title=f"invalid predictions file {path}")
    return records, completions


def check_sampled_records(path: str | Path) -> None:
    """Refuse a records file for `vlmexp eval --records` that `vlmexp sample` did not write (or that was
    changed since, or whose images are gone). Raises DataError naming the file, the record and the fix."""
    from vlmexp.data.record import read_sampled
    from vlmexp.errors import DataError, Problem

    problems = [Problem(f"{path}:{n}", "images", f"{short(r.images)} are not all existing files; "
                        "sample the data again") for n, r in enumerate(read_sampled(path), start=1)
                if not all(Path(x).is_file() for x in r.images)]
    if problems:
        raise DataError(problems[:50], title=f"invalid records file {path}")


def score_predictions(path: str | Path, family_name: str, knobs: dict[str, int | None] | None = None,
                      image_root: str | Path | None = None, prefilled_think: bool = False,
                      math_grader: str | None = None, cfg: Config | None = None):
    """`vlmexp score`: (metrics, rows) for completions produced by any system, through `score_records`; the
    family's image budget is its released checkpoints' with `knobs` (min/max pixels or patches) applied;
    `prefilled_think`: the completions begin inside a think block the template opened. With `cfg`, its
    grpo.rewards score (a judge and a reward model among them) and their prompts are built as training builds
    them (`build_prompt` with cfg.data)."""
    from vlmexp.families import get_family
    from vlmexp.prompts import build_prompt

    family = get_family(family_name)
    budget = family.released_budget(family.check_budget_knobs(knobs or {}))
    records, completions = read_predictions(path, image_root)
    rewards = cfg.grpo.rewards if cfg is not None else ()
    prompts = [build_prompt(r, cfg.data, family) for r in records] if cfg is not None else None
    return score_records(records, completions, family.box_frame, budget, rewards, prefilled_think,
                         math_grader, prompts)


@dataclass
class EvalResult:
    metrics: dict[str, float]
    metrics_path: Path
    samples_path: Path


def evaluate(cfg: Config, model_path: str, records_path: str | Path, out_dir: str | Path) -> EvalResult:
    """Generate on `records_path` (sampled JSONL) with `model_path`; write metrics.json, samples.jsonl and the
    first eval.pictures records drawn with their boxes (pictures/, vlmexp.pictures; the model named after
    `out_dir`)."""
    from transformers import set_seed

    from vlmexp.data.record import read_sampled
    from vlmexp.files import atomic_write
    from vlmexp.generation import Generator
    from vlmexp.modeling import load_for_inference
    from vlmexp.pictures import write_evaluation_pictures
    from vlmexp.processor import prefills_think
    from vlmexp.prompts import build_prompt, load_images

    set_seed(cfg.run.seed)
    records = read_sampled(records_path)
    if cfg.eval.max_samples:
        records = records[: cfg.eval.max_samples]
    model, processor, family = load_for_inference(cfg, model_path)
    prompts = [build_prompt(r, cfg.data, family) for r in records]
    generator = Generator.for_config(cfg, model, processor, family)
    completions = generator(prompts, [load_images(r.images) for r in records], cfg.eval.max_new_tokens,
                            cfg.eval.temperature, cfg.eval.batch_size)
    metrics, rows = score_records(records, completions, family.box_frame, family.image_budget(processor),
                                  cfg.grpo.rewards, prefills_think(processor), cfg.eval.math_grader, prompts)
    for row, prompt in zip(rows, prompts, strict=True):
        row["prompt"] = prompt[-1]["content"]
    if generator.settings.compile:  # logged with the evaluation's metrics (eval run: <model>/generation/...)
        metrics.update(generator.count.metrics())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "samples.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    atomic_write(out / "metrics.json", json.dumps({"model": model_path, **metrics}, indent=2) + "\n")
    write_evaluation_pictures({out.name: rows}, cfg.eval.pictures, out / "pictures",
                              f"{out.name}: {model_path}")
    log.info("evaluated %s on %d records: %s", model_path, len(rows), metrics)
    return EvalResult(metrics, out / "metrics.json", out / "samples.jsonl")
