"""Evaluation: generate on held-out records and score with the same reward objects that train.

`score_records` is the one scoring path: `vlmexp eval` (generate, then score) and offline scoring of
completions produced elsewhere both end there, so they cannot disagree.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlmexp.config.schema import Config
from vlmexp.errors import short

if TYPE_CHECKING:
    from vlmexp.data.record import SampledRecord

log = logging.getLogger("vlmexp.eval")


# the rewards the metrics come from: format_rate, rec_*, *_accuracy, detection_*
SCORERS = ("format", "iou", "math", "exact", "detection")


def build_scorers(rewards: Sequence[Any], frame: str, budget: Any, prefilled_think: bool = False,
                  math_grader: str | None = None) -> dict[str, Any]:
    """The rewards evaluation scores with, built by `build_reward` like the training rewards: each of SCORERS
    with the kwargs of the configured reward of that name (`grpo.rewards`), else its defaults; `math_grader`
    (eval.math_grader) replaces the math reward's grader."""
    from vlmexp.rewards_loader import build_reward

    kwargs = {r.name: dict(r.kwargs) for r in rewards}
    if math_grader is not None:
        kwargs.setdefault("math", {})["grader"] = math_grader
    return {name: build_reward(name, kwargs.get(name, {}), frame, budget, prefilled_think)
            for name in SCORERS}


def score_records(records: Sequence[SampledRecord], completions: Sequence[str], frame: str, budget: Any,
                  rewards: Sequence[Any] = (), prefilled_think: bool = False, math_grader: str | None = None,
                  prompts: Sequence[Any] | None = None) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """(metrics, per-sample rows) for sampled records and their completions, scored by
    `build_scorers(rewards)` with the columns GRPO gives them (`reward_columns`: the source's own fields too).
    Metrics exist only for the tasks present; unparsable answers score 0; a box task's row holds the ground
    truth's and the answer's boxes in original pixels (`truth`, `boxes`: vlmexp.pictures.boxes_of). Detection
    records also give detection_ap / detection_ap50: COCO AP over all of them at once. The model rewards among
    `rewards` (judge, reward_model) score every record too (`model_reward_metrics`), given `prompts` (the
    prompts the completions answer; default: each record's problem as the user turn); a record of VLM-R1's
    `llm` method takes the judge's score as its own. Each other configured reward (a `module:function` one,
    say) gives `reward_<name>`."""
    from vlmexp.data.record import columns_of
    from vlmexp.pictures import boxes_of
    from vlmexp.rewards import extract_answer

    texts = list(completions)
    if len(texts) != len(records):
        raise ValueError(f"{len(records)} records but {len(texts)} completions")
    columns = columns_of(records)
    scorers = build_scorers(rewards, frame, budget, prefilled_think, math_grader)
    scored = {name: fn(completions=texts, **columns) for name, fn in scorers.items()}
    model_metrics, model_scores = model_reward_metrics(rewards, frame, budget, records, texts, columns,
                                                       prompts)
    rows, per_task = [], {"rec": [], "math": [], "exact": [], "detection": []}
    for i, (record, text) in enumerate(zip(records, texts, strict=True)):
        score = scored[{"rec": "iou"}.get(record.task, record.task)][i]
        if record.method == "llm":  # VLM-R1's judged records
            score = model_scores["judge"][i]
        if score is not None:  # an llm record the judge could not read is counted in judge_unparsable
            per_task[record.task].append(score)
        rows.append({"image": (record.images or [""])[0], "task": record.task, "problem": record.problem,
                     "solution": columns["solution"][i], "completion": text, "answer": extract_answer(text),
                     "format": scored["format"][i], "score": score, **boxes_of(scorers, text, columns, i)})
    metrics: dict[str, float] = {"count": float(len(rows))}
    if rows:
        metrics["format_rate"] = sum(scored["format"]) / len(rows)
    if per_task["rec"]:
        ious = per_task["rec"]
        metrics.update(rec_mean_iou=sum(ious) / len(ious), rec_acc50=sum(v >= 0.5 for v in ious) / len(ious),
                       rec_acc75=sum(v >= 0.75 for v in ious) / len(ious))
    for task in ("math", "exact"):
        if per_task[task]:
            metrics[f"{task}_accuracy"] = sum(per_task[task]) / len(per_task[task])
    if per_task["detection"]:
        metrics["detection_reward"] = sum(per_task["detection"]) / len(per_task["detection"])
        metrics.update(detection_metrics(scorers["detection"].fn, texts, columns))
    metrics.update(other_rewards(rewards, texts, columns, rows, frame, budget, prefilled_think, prompts))
    return {**metrics, **model_metrics}, rows


def model_reward_metrics(rewards: Sequence[Any], frame: str, budget: Any, records: Sequence[SampledRecord],
                         texts: list[str], columns: dict[str, list], prompts: Sequence[Any] | None):
    """({name}_score (the mean over the records it could score), {name}_unparsable, {name}_seconds,
    {name}_calls for each model reward among `rewards`; {name: its score or None per record}). A record's
    `llm` method with no judge configured is refused, naming the fix."""
    from vlmexp.data.formats import JUDGED_METHOD, NO_JUDGE
    from vlmexp.model_rewards import MODEL_REGISTRY
    from vlmexp.rewards_loader import build_reward

    models = [r for r in rewards if r.name in MODEL_REGISTRY]
    if any(r.method == JUDGED_METHOD for r in records) and "judge" not in [r.name for r in models]:
        from vlmexp.errors import ConfigError, Problem

        raise ConfigError(Problem("grpo.rewards", "",
                                  f"{NO_JUDGE}; `vlmexp score`: pass --config with that judge"))
    if prompts is None:
        prompts = [[{"role": "user", "content": r.problem}] for r in records]
    metrics: dict[str, float] = {}
    scores: dict[str, list] = {}
    for spec in models:
        logged: dict[str, float] = {}
        fn = build_reward(spec.name, spec.kwargs, frame, budget)
        scores[spec.name] = fn(prompts=list(prompts), completions=texts, **columns,
                               log_metric=lambda k, v, logged=logged: logged.__setitem__(
                                   k, logged.get(k, 0.0) + v))
        found = [v for v in scores[spec.name] if v is not None]
        prefix = f"rewards/{spec.name}/"
        metrics.update({f"{spec.name}_unparsable": sum(v for k, v in logged.items()
                                                       if k.startswith(f"{prefix}unparsable/")),
                        f"{spec.name}_seconds": logged[f"{prefix}seconds"],
                        f"{spec.name}_calls": logged[f"{prefix}calls"]})
        if found:
            metrics[f"{spec.name}_score"] = sum(found) / len(found)
    return metrics, scores


def other_rewards(rewards: Sequence[Any], texts: Sequence[str], columns: dict[str, list],
                  rows: list[dict[str, Any]], frame: str, budget: Any, prefilled_think: bool,
                  prompts: Sequence[Any] | None = None) -> dict[str, float]:
    """`reward_<name>` (its mean over the records it scores; NaN when it masks them all) for each configured
    reward not among SCORERS nor a model reward (`model_reward_metrics` scores those), called as GRPO calls
    it: the prompts (None where not given), completions as assistant messages, every column; each row gets the
    reward's score under the same key. A name's `:` becomes `.` (MLflow's metric names have no `:`)."""
    from vlmexp.model_rewards import MODEL_REGISTRY
    from vlmexp.rewards_loader import build_reward

    out = {}
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    for r in rewards:
        if r.name in SCORERS or r.name in MODEL_REGISTRY:
            continue
        key = "reward_" + r.name.replace(":", ".")
        scores = build_reward(r.name, dict(r.kwargs), frame, budget, prefilled_think)(
            prompts=list(prompts) if prompts is not None else [None] * len(texts), completions=completions,
            **columns)
        for row, score in zip(rows, scores, strict=True):
            row[key] = score
        kept = [s for s in scores if s is not None]
        out[key] = sum(kept) / len(kept) if kept else float("nan")
    return out


def detection_metrics(reward: Any, texts: Sequence[str], columns: dict[str, list]) -> dict[str, float]:
    """detection_ap (AP@[.5:.95]) and detection_ap50: COCO AP over every detection record at once, each answer
    read as its method reads it (an unreadable answer predicts nothing)."""
    from vlmexp.detection import AP_THRESHOLDS, coco_ap, gold_objects
    from vlmexp.rewards import Unparsable

    images = []
    for i, text in enumerate(texts):
        if columns["task"][i] == "detection":
            solution, method = columns["solution"][i], columns["accu_reward_method"][i]
            read = reward.objects(text, solution, method, columns["image_sizes"][i])
            images.append(([], gold_objects(solution, method)) if isinstance(read, Unparsable)
                          else (read[0], read[2]))
    return {"detection_ap": coco_ap(images, AP_THRESHOLDS),
            "detection_ap50": coco_ap(images, AP_THRESHOLDS[:1])}


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
                                      cfg.grpo.rewards, prefills_think(processor), cfg.eval.math_grader,
                                      prompts)
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


def tool_modes(cfg: Config) -> tuple[str, ...]:
    """How evaluation runs (eval.tools): ("off",) without the tools, ("on",) with them, or both."""
    mode = cfg.eval.tools if cfg.eval.tools != "auto" else ("both" if cfg.grpo.tools.names else "off")
    return {"off": ("off",), "on": ("on",), "both": ("off", "on")}[mode]


def evaluate_with_tools(cfg: Config, records: Sequence[SampledRecord], prompts: list, generator,
                        out: Path) -> dict[str, float]:
    """`tool_<metric>` for the records answered with grpo.tools' tools (each record's own zoom environment, at
    most grpo.tools.max_turns calls): the same scorers on each conversation's final answer, plus
    tool_zooms_per_answer, tool_zoomed_share and per-problem counts of the calls (tool_zoom_malformed, ...).
    Writes samples_tool.jsonl (each record's final answer, its zoom boxes in original pixels, its
    conversation's turns) and the first eval.pictures records drawn with their zooms (pictures_tool/)."""
    from vlmexp.files import atomic_write
    from vlmexp.processor import prefills_think
    from vlmexp.prompts import load_images
    from vlmexp.rewards import completion_text
    from vlmexp.tools import environment_factory
    from vlmexp.tools.zoom import zoom_counts
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
                                  budget, cfg.grpo.rewards, prefills_think(processor), cfg.eval.math_grader,
                                  prompts)
    counts = [zoom_counts(c) for c in conversations]
    n = max(1, len(counts))
    metrics.update(zooms_per_answer=sum(c.zooms for c in counts) / n,
                   zoomed_share=sum(c.zooms > 0 for c in counts) / n,
                   zoom_malformed=float(sum(c.malformed for c in counts)),
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
