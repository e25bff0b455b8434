"""Scoring: completions -> rewards and metrics, one code path for every part that scores. Evaluation
(`vlmexp eval`, `vlmexp score`), validation during training, GRPO's completion table (`build_scorers`), DPO's
pairs and the difficulty filter (`score_group`, through `vlmexp.train.sampling`) all score here, with the
reward objects GRPO trains with (`vlmexp.rewards_loader.build_reward`), so they cannot disagree.

- `score_records`: (metrics, per-sample rows) for records and their completions: format_rate, rec_*,
  *_accuracy, detection_* (with COCO AP, `detection_metrics`), the model rewards' scores and costs
  (`model_reward_metrics`) and every other configured reward (`other_rewards`).
- `score_group`: the weighted reward sum of each of a prompt's completions, as GRPO sums its rewards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vlmexp.config.schema import Config
    from vlmexp.data.record import SampledRecord

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


def score_group(rewards, weights: list[float], prompt, texts: list[str],
                record: SampledRecord) -> list[float]:
    """Weighted reward sum per completion, fed the same keyword columns GRPO gives its rewards
    (`reward_columns`). A masked (None) score counts as 0 for that reward."""
    from vlmexp.data.record import reward_columns

    n = len(texts)
    columns = {key: [value] * n for key, value in reward_columns(record).items()}
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    totals = [0.0] * n
    for reward, weight in zip(rewards, weights, strict=True):
        for j, score in enumerate(reward(prompts=[prompt] * n, completions=completions, **columns)):
            totals[j] += weight * (score or 0.0)
    return totals


def without_tool_reward(rewards: Sequence[Any]) -> list[Any]:
    """The configured rewards evaluation scores answers with: the tool reward reads a conversation's zooms,
    which a single answer has none of (evaluation with the tool scores it on the conversations,
    `reward_tool`); nor does zoom_target read a single answer's zooms."""
    return [r for r in rewards if r.name not in ("tool", "zoom_target")]


def tool_modes(cfg: Config) -> tuple[str, ...]:
    """How evaluation runs (eval.tools): ("off",) without the tools, ("on",) with them, or both."""
    mode = cfg.eval.tools if cfg.eval.tools != "auto" else ("both" if cfg.grpo.tools.names else "off")
    return {"off": ("off",), "on": ("on",), "both": ("off", "on")}[mode]
