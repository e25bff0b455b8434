"""The run's markdown summary and the tags of its MLflow parent run, built from what the stages returned."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmexp.results import PipelineResult, StageResult

METRICS_FILE = "metrics.jsonl"  # each stage's log of the Trainer's metrics (vlmexp.train.progress writes it)


def stage_status(result: StageResult, flow_run_id: str) -> str:
    """"trained" when this flow run trained the stage, else where its cached result comes from."""
    if result.flow_run_id == flow_run_id:
        return "trained"
    return f"skipped: inputs unchanged since flow run {result.flow_run_id[:8]}"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def render_summary(run: PipelineResult, mlflow_link: str = "", store: str = "", grid: str = "") -> str:
    """The summary a person reads after a run (Prefect artifact, MLflow summary.md, `vlmexp run`'s output);
    `grid`: the evaluation's grid picture (vlmexp.pictures), relative to where the summary is read."""
    lines = [f"# {run.name}", "", f"config `{run.config}`, data manifest `{run.data.hash[:12]}`", "",
             "| stage | status | seconds | output |", "|---|---|---|---|"]
    for stage, result in run.stages.items():
        lines.append(f"| {stage} | disabled | | |" if result is None else
                     f"| {stage} | {stage_status(result, run.flow_run_id)} | {result.seconds:.1f} | "
                     f"`{result.final}` |")
    if run.evaluations:
        lines += ["", "## Evaluation", "", markdown_table(run.evaluation)]
        if grid:
            lines += ["", "The first held-out records, ground truth green, each model in its colour:", "",
                      f"![held-out records with each model's boxes]({grid})"]
    if run.export:
        lines += ["", f"Exported: `{run.export}`"]
    if p := run.promotion:
        verdict = "**promoted to `champion`**" if p.promoted else "kept, **not promoted**"
        lines.append(f"Registered `{p.name}` version {p.version}: {verdict} on {p.metric}: {p.reason}")
    text = "\n".join(lines) + "\n"
    if mlflow_link:
        text += f"\nMLflow: `{mlflow_link}` (browse: `vlmexp ui --store {store}`)\n"
    logs = [f"`{Path(r.final).parent / METRICS_FILE}`" for r in run.stages.values() if r is not None]
    if logs:
        text += f"\nEvery metric of each logging step: the stages' MLflow runs, and {', '.join(logs)}\n"
    return text


def summary_tags(run: PipelineResult) -> dict[str, str]:
    """Tags of the parent run: each trained stage's status (trained or skipped) and whether export
    promoted."""
    tags = {f"stage.{s.stage}": stage_status(s, run.flow_run_id).split(":")[0] for s in run.trained}
    if run.promotion is not None:
        tags["export.promoted"] = str(run.promotion.promoted).lower()
    return tags
