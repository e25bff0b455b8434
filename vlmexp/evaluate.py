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

from vlmexp.config import Config
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
    return {name: build_reward(name, kwargs.get(name, {}), frame, budget, prefilled_think) for name in SCORERS}


def score_records(records: Sequence[SampledRecord], completions: Sequence[str], frame: str, budget: Any,
                  rewards: Sequence[Any] = (), prefilled_think: bool = False,
                  math_grader: str | None = None) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """(metrics, per-sample rows) for sampled records and their completions, scored by `build_scorers(rewards)`
    with the columns GRPO gives them (`reward_columns`); a box task's row holds the ground truth's and the answer's
    boxes in original pixels (`truth`, `boxes`: vlmexp.pictures.boxes_of). Metrics exist only for the tasks present; unparsable
    answers score 0. Detection records also give detection_ap / detection_ap50: COCO AP over all of them at once."""
    from vlmexp.data.record import columns_of
    from vlmexp.pictures import boxes_of
    from vlmexp.rewards import extract_answer

    texts = list(completions)
    if len(texts) != len(records):
        raise ValueError(f"{len(records)} records but {len(texts)} completions")
    columns = columns_of(records)
    scorers = build_scorers(rewards, frame, budget, prefilled_think, math_grader)
    scored = {name: fn(completions=texts, **columns) for name, fn in scorers.items()}
    rows, per_task = [], {"rec": [], "math": [], "exact": [], "detection": []}
    for i, (record, text) in enumerate(zip(records, texts, strict=True)):
        score = scored[{"rec": "iou"}.get(record.task, record.task)][i]
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
    return metrics, rows


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
            images.append(([], gold_objects(solution, method)) if isinstance(read, Unparsable) else (read[0], read[2]))
    return {"detection_ap": coco_ap(images, AP_THRESHOLDS), "detection_ap50": coco_ap(images, AP_THRESHOLDS[:1])}


def read_predictions(path: str | Path, image_root: str | Path | None = None) -> tuple[list[SampledRecord], list[str]]:
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

    problems = [Problem(f"{path}:{n}", "images", f"{short(r.images)} are not all existing files; sample the data "
                        "again") for n, r in enumerate(read_sampled(path), start=1)
                if not all(Path(x).is_file() for x in r.images)]
    if problems:
        raise DataError(problems[:50], title=f"invalid records file {path}")


def score_predictions(path: str | Path, family_name: str, knobs: dict[str, int | None] | None = None,
                      image_root: str | Path | None = None, prefilled_think: bool = False,
                      math_grader: str | None = None):
    """`vlmexp score`: (metrics, rows) for completions produced by any system, through `score_records`; the
    family's image budget is its released checkpoints' with `knobs` (min/max pixels or patches) applied;
    `prefilled_think`: the completions begin inside a think block the template opened."""
    from vlmexp.families import get_family

    family = get_family(family_name)
    budget = family.released_budget(family.check_budget_knobs(knobs or {}))
    records, completions = read_predictions(path, image_root)
    return score_records(records, completions, family.box_frame, budget, (), prefilled_think, math_grader)


@dataclass
class EvalResult:
    metrics: dict[str, float]
    metrics_path: Path
    samples_path: Path


def generate(model, processor, family, prompts: list[list[dict]], images: list[list], max_new_tokens: int,
             temperature: float, batch_size: int) -> list[str]:
    """Completions for chat prompts with their images, batched with left padding; the family's vision tokens
    are never generated."""
    import torch

    from vlmexp.modeling import vision_token_ids

    tokenizer = processor.tokenizer
    tokenizer.padding_side = "left"
    out: list[str] = []
    for start in range(0, len(prompts), batch_size):
        batch_prompts, batch_images = prompts[start:start + batch_size], images[start:start + batch_size]
        texts = []
        for messages, imgs in zip(batch_prompts, batch_images, strict=True):
            texts.append(processor.apply_chat_template(with_image_parts(messages, len(imgs)), tokenize=False,
                                                       add_generation_prompt=True))
        inputs = processor(text=texts, images=[im for imgs in batch_images for im in imgs] or None,
                           padding=True, return_tensors="pt").to(model.device)
        sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        with torch.inference_mode():
            generated = model.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                       suppress_tokens=vision_token_ids(processor, family), **sampling)
        new_tokens = generated[:, inputs["input_ids"].shape[1]:]
        out += tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    return out


def with_image_parts(messages: list[dict], images: int) -> list[dict]:
    """`messages` with one image part per image at the start of the first user turn, where TRL's
    `prepare_multimodal_messages` puts them in training (trl/data_utils.py)."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "user")
    user = messages[first]
    content = [{"type": "image"} for _ in range(images)] + [{"type": "text", "text": user["content"]}]
    return [*messages[:first], {**user, "content": content}, *messages[first + 1:]]


def evaluate(cfg: Config, model_path: str, records_path: str | Path, out_dir: str | Path) -> EvalResult:
    """Generate on `records_path` (sampled JSONL) with `model_path`; write metrics.json, samples.jsonl and the
    first eval.pictures records drawn with their boxes (pictures/, vlmexp.pictures; the model named after
    `out_dir`)."""
    from transformers import set_seed

    from vlmexp.data.record import read_sampled
    from vlmexp.files import atomic_write
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
    completions = generate(model, processor, family, prompts, [load_images(r.images) for r in records],
                           cfg.eval.max_new_tokens, cfg.eval.temperature, cfg.eval.batch_size)
    metrics, rows = score_records(records, completions, family.box_frame, family.image_budget(processor),
                                  cfg.grpo.rewards, prefills_think(processor), cfg.eval.math_grader)
    for row, prompt in zip(rows, prompts, strict=True):
        row["prompt"] = prompt[-1]["content"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "samples.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    atomic_write(out / "metrics.json", json.dumps({"model": model_path, **metrics}, indent=2) + "\n")
    write_evaluation_pictures({out.name: rows}, cfg.eval.pictures, out / "pictures", f"{out.name}: {model_path}")
    log.info("evaluated %s on %d records: %s", model_path, len(rows), metrics)
    return EvalResult(metrics, out / "metrics.json", out / "samples.jsonl")
