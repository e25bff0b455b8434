"""What the pipeline reports after its stages: the evaluation run (metrics and per-sample tables of each
model, the comparison table) and each stage's curves as a PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vlmexp.tracking.tracker import Tracker


def log_evaluation_run(tracker: Tracker, parent_run_id: str, evaluations: list,
                       table: list[dict[str, Any]], dataset: str | Path | None = None,
                       headline: str | None = None, pictures: int = 0,
                       pictures_dir: str | Path | None = None) -> None:
    """One child run "eval" of `parent_run_id`: each model's metrics (`<name>/<metric>`) and per-sample table
    (`evaluations`: vlmexp.results.Evaluation), and the comparison `table` (also on the parent). Each
    evaluated model that a stage logged as a model gets its metrics too (`eval/<metric>` on the held-out
    `dataset` manifest's data, and the `headline` metric as its run's first chart) and is an input of the run.
    The first `pictures` records drawn with every model's boxes (vlmexp.pictures, written to `pictures_dir`)
    go to evaluation/pictures/, their grid also to the parent's evaluation/grid.png."""
    from vlmexp.pictures import write_evaluation_pictures

    run_id = tracker.start_stage(parent_run_id, "eval")
    models = {}
    for e in evaluations:
        metrics = {**{f"{e.name}/{k}": v for k, v in e.metrics.items()}, f"{e.name}/seconds": e.seconds}
        tracker.log_metrics(run_id, metrics)
        models[e.name] = rows = [json.loads(line) for line in Path(e.samples).read_text().splitlines()]
        tracker.log_table(run_id, [{"model": e.name, **row} for row in rows],
                          f"evaluation/{e.name}_samples.json")
    tracker.log_table(run_id, table, "evaluation/comparison.json")
    tracker.log_table(parent_run_id, table, "evaluation/comparison.json")
    if pictures and pictures_dir is not None and models:
        files = write_evaluation_pictures(models, pictures, pictures_dir,
                                          "held-out records: " + ", ".join(models))
        for path in files:
            tracker.log_artifact(run_id, path, "evaluation/pictures")
        if files:
            tracker.log_artifact(parent_run_id, files[-1], "evaluation")
    log_tool_evaluations(tracker, run_id, evaluations)
    tracker.log_evaluated_models(run_id, {e.model: e.metrics for e in evaluations}, dataset, headline)
    tracker.end(run_id)


def log_tool_evaluations(tracker: Tracker, run_id: str, evaluations: list) -> None:
    """Each model's evaluation with the tool (eval.tools; vlmexp.evaluate.evaluate_with_tools), where it ran:
    its per-sample table (final answer, zoom boxes, turns) as evaluation/<model>_samples_tool.json and its
    zoom pictures (the image with the zoom boxes in order, the crops beside it, the answer and its score)
    under evaluation/<model>_zoom/."""
    for e in evaluations:
        folder = Path(e.samples).parent
        if not (folder / "samples_tool.jsonl").is_file():
            continue
        rows = [json.loads(line) for line in (folder / "samples_tool.jsonl").read_text().splitlines()]
        tracker.log_table(run_id, [{"model": e.name, **row} for row in rows],
                          f"evaluation/{e.name}_samples_tool.json")
        for path in sorted((folder / "pictures_tool").glob("*.png")):
            tracker.log_artifact(run_id, path, f"evaluation/{e.name}_zoom")


def log_headline(tracker: Tracker, run, metric: str) -> dict[str, float]:
    """The parent run's first charts (`tracker.HEADLINE`): `metric` of the newest model, and the reward (GRPO)
    or reward margin (DPO) of the last such stage at its last step. `run`: vlmexp.results.PipelineResult."""
    from vlmexp.tracking.tracker import HEADLINE, HEADLINE_REWARD

    values = {f"{HEADLINE}/{metric}": run.metrics()[metric]} if metric in run.metrics() else {}
    rewarded = [s for s in run.trained if s.stage in HEADLINE_REWARD]
    if rewarded:
        key, name = HEADLINE_REWARD[rewarded[-1].stage]
        history = sorted(tracker.metric_history(rewarded[-1].run_id, key))
        if history:
            values[f"{HEADLINE}/{name}"] = history[-1][1]
    tracker.log_metrics(run.mlflow_run_id, values)
    return values


def curve_keys(tracker: Tracker, run_id: str, stage: str) -> list[str]:
    """The metrics a stage's curve plot shows: each reward's mean and the total for GRPO, loss, margins and
    accuracies for DPO, the loss for SFT."""
    keys = tracker.metric_keys(run_id)
    if stage == "grpo":
        return [k for k in keys if k == "reward" or (k.startswith("rewards/") and k.endswith("/mean"))]
    if stage == "dpo":
        return [k for k in keys if k in ("loss", "rewards/margins", "rewards/accuracies")]
    return [k for k in keys if k == "loss"]


def plot_curves(tracker: Tracker, run_id: str, keys: list[str], out_png: str | Path,
                title: str) -> Path | None:
    """A PNG of the metrics `keys` of `run_id` by step, or None when there is nothing to plot."""
    if not keys:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key in keys:
        points = sorted(tracker.metric_history(run_id, key))
        ax.plot([s for s, _ in points], [v for _, v in points], label=key, marker=".")
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
