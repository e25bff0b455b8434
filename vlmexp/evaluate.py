"""Evaluation: generate on held-out records (`vlmexp eval`) and score with the same reward objects that train;
offline scoring of completions produced elsewhere (`vlmexp score`, `read_predictions`).

Both end in `vlmexp.scoring.score_records`, the one scoring path (validation during training scores there
too), so they cannot disagree.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vlmexp.config.schema import Config
from vlmexp.errors import short
from vlmexp.scoring import score_records, tool_modes, without_tool_reward

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
    out = Path(out_dir)
    metrics, rows = {}, []
    if tool_modes(cfg) != ("on",):
        images = [load_images(r.question_images) for r in records]
        completions = generator(prompts, images, cfg.eval.max_new_tokens, cfg.eval.temperature,
                                cfg.eval.batch_size)
        metrics, rows = score_records(records, completions, family.box_frame, family.image_budget(processor),
                                      without_tool_reward(cfg.grpo.rewards), prefills_think(processor),
                                      cfg.eval.math_grader, prompts)
        for row, prompt in zip(rows, prompts, strict=True):
            row["prompt"] = prompt[-1]["content"]
    if "on" in tool_modes(cfg):
        metrics.update(evaluate_with_tools(cfg, records, prompts, generator, out))
    if generator.settings.compile:  # logged with the evaluation's metrics (eval run: <model>/generation/...)
        metrics.update(generator.count.metrics())
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "samples.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    atomic_write(out / "metrics.json", json.dumps({"model": model_path, **metrics}, indent=2) + "\n")
    write_evaluation_pictures({out.name: rows}, cfg.eval.pictures, out / "pictures",
                              f"{out.name}: {model_path}")
    log.info("evaluated %s on %d records: %s", model_path, len(rows), metrics)
    return EvalResult(metrics, out / "metrics.json", out / "samples.jsonl")


def evaluate_with_tools(cfg: Config, records: Sequence[SampledRecord], prompts: list, generator,
                        out: Path) -> dict[str, float]:
    """`tool_<metric>` for the records answered with grpo.tools' tools (each record's own zoom environment, at
    most grpo.tools.max_turns calls): the same scorers on each conversation's final answer, plus
    tool_zooms_per_answer, tool_zoomed_share, tool_zoom_on_target (records with the target's box) and
    per-problem counts of the calls (tool_zoom_malformed, ...).
    Writes samples_tool.jsonl (each record's final answer, its zoom boxes in original pixels, its
    conversation's turns) and the first eval.pictures records drawn with their zooms (pictures_tool/)."""
    from vlmexp.data.record import columns_of
    from vlmexp.files import atomic_write
    from vlmexp.processor import prefills_think
    from vlmexp.prompts import load_images
    from vlmexp.rewards import completion_text
    from vlmexp.rewards_loader import build_reward
    from vlmexp.tools import environment_factory
    from vlmexp.tools.zoom import answer_zoom_metrics, zoom_counts
    from vlmexp.zoom_pictures import write_zoom_pictures

    family, processor = generator.family, generator.processor
    budget = family.image_budget(processor)
    family.use_tools(processor)
    make = environment_factory(cfg.grpo.tools, family, budget)
    images = [load_images(r.question_images) for r in records]
    environments = [make() for _ in records]
    for environment, shown in zip(environments, images, strict=True):
        environment.reset(images=shown)
    conversations = generator.converse(prompts, images, environments, cfg.grpo.tools.max_turns,
                                       cfg.eval.max_new_tokens, cfg.eval.temperature, cfg.eval.batch_size)
    metrics, rows = score_records(records, [completion_text(c) for c in conversations], family.box_frame,
                                  budget, without_tool_reward(cfg.grpo.rewards), prefills_think(processor),
                                  cfg.eval.math_grader, prompts)
    configured = next((dict(r.kwargs) for r in cfg.grpo.rewards if r.name == "tool"), {})
    tool_reward = build_reward("tool", configured, family.box_frame, budget)  # on the conversations
    scores = tool_reward(completions=conversations, **columns_of(records))
    metrics["reward_tool"] = sum(s or 0.0 for s in scores) / max(1, len(scores))
    counts = [zoom_counts(c) for c in conversations]
    metrics.update(answer_zoom_metrics(counts, [e.crops for e in environments],
                                       [r.targets for r in records]))
    metrics.update(zoom_malformed=float(sum(c.malformed for c in counts)),
                   zoom_outside=float(sum(c.problems.get("outside", 0) for c in counts)),
                   zoom_unanswered=float(sum(c.unanswered for c in counts)))
    for row, prompt, environment, conversation in zip(rows, prompts, environments, conversations,
                                                      strict=True):
        row.update(prompt=prompt[-1]["content"], zooms=list(environment.crops), turns=[
            {"role": m["role"], "text": completion_text([m]), "tool_calls": m.get("tool_calls")}
            for m in conversation])
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "samples_tool.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    write_zoom_pictures(rows, cfg.eval.pictures, out / "pictures_tool")
    return {f"tool_{k}": v for k, v in metrics.items()}
