"""The vlm-pipeline flow: validate -> sample data -> SFT -> DPO -> GRPO -> evaluate -> export.

Stages switch off in the config (`sft.enabled`, ...). Training, evaluation and export are cached by what
they depend on, so a re-run with the same config and data skips them (`force=True` recomputes), and a
retried training task resumes from its last checkpoint. Run it with `vlmexp run CONFIG [k=v ...]`, or
from a deployment: `prefect deployment run 'vlm-pipeline/manual' --param config=configs/demo.yaml`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from tasks.stages import (
    evaluate_model,
    export_model,
    log_evaluation,
    register_model,
    sample_data,
    start_tracking,
    summarise,
    train_stage,
    validate_config,
)


def _cached(task, output: str, force: bool, retries: int, delay: float, **params: Any) -> dict[str, Any]:
    """Run `task` with the config's retries; a cached result whose files were deleted is recomputed."""
    runner = task.with_options(retries=retries, retry_delay_seconds=delay, refresh_cache=force or None)
    result = runner(**params)
    path = result[output] if isinstance(result, dict) else result
    if not Path(path).exists():
        result = task.with_options(retries=retries, retry_delay_seconds=delay, refresh_cache=True)(**params)
    return result


@flow(name="vlm-pipeline", log_prints=True)
def vlm_pipeline(config: str, overrides: list[str] | None = None, force: bool = False) -> dict[str, Any]:
    from vlmexp.errors import quiet_bad_input_tracebacks
    from vlmexp.pipeline import check_pipeline_parameters, load_resolved, stage_key
    from vlmexp.tracking import git_commit

    quiet_bad_input_tracebacks("prefect.task_runs", "prefect.flow_runs")  # bad input: the problems, no traceback
    check_pipeline_parameters(config, overrides)
    pending = validate_config(config, overrides or [])
    cfg = load_resolved(pending)
    retry = {"force": force, "retries": cfg.pipeline.retries, "delay": cfg.pipeline.retry_delay_seconds}

    data = sample_data.with_options(retries=cfg.pipeline.retries)(pending)
    resolved = data["resolved"]  # config.resolved.yaml: written once the data sampled cleanly
    parent = start_tracking(resolved, data["hash"], str(flow_run.id or ""))
    summary = [f"# {cfg.run.name}", "", f"config `{config}`, data manifest `{data['hash'][:12]}`", "",
               "| stage | status | seconds | output |", "|---|---|---|---|"]

    model, upstream, candidates = data["base_model"], "", [("base", data["base_model"], "")]
    stage_runs: dict[str, str] = {}
    tags: dict[str, str] = {}
    for stage in ("sft", "dpo", "grpo"):
        if not getattr(cfg, stage).enabled:
            summary.append(f"| {stage} | disabled | | |")
            continue
        key = stage_key(cfg, stage, data["hash"], upstream)
        trained = _cached(train_stage, "final", stage=stage, resolved=resolved, key=key,
                          model=None if stage == "sft" or model == data["base_model"] else model,
                          parent_run_id=parent, **retry)
        status = ("trained" if trained["flow_run_id"] == str(flow_run.id) else
                  f"skipped: inputs unchanged since flow run {trained['flow_run_id'][:8]}")
        summary.append(f"| {stage} | {status} | {trained['seconds']:.1f} | `{trained['final']}` |")
        tags[f"stage.{stage}"] = status.split(":")[0]
        stage_runs[stage] = trained["run_id"]
        model, upstream = trained["final"], trained["key"]
        candidates.append((stage, model, upstream))

    table, metrics = [], {}
    if cfg.eval.enabled and data["val"]:
        results = [_cached(evaluate_model, "samples", name=name, resolved=resolved,
                           key=stage_key(cfg, "eval", data["hash"], f"{name}:{ukey}:{path}"),
                           model=path, records=data["val"], parent_run_id=parent, **retry)
                   for name, path, ukey in candidates]
        table = log_evaluation(resolved, results, parent)
        metrics = {r["name"]: r["metrics"] for r in results}
        summary += ["", "## Evaluation", "", _markdown_table(table)]

    exported, promotion = None, None
    if cfg.export.enabled and len(candidates) > 1:
        export_key = stage_key(cfg, "export", data["hash"], upstream)
        exported = _cached(export_model, "manifest", resolved=resolved, key=export_key, model=model,
                           parent_run_id=parent, **retry,
                           provenance={"stage_key": upstream, "data_manifest_sha256": data["hash"],
                                       "git_commit": git_commit(), "mlflow_parent_run_id": parent,
                                       "mlflow_stage_run_ids": stage_runs, "evaluation": table})
        summary += ["", f"Exported: `{exported}`"]
        if cfg.tracking.backend != "none":
            value = metrics.get(candidates[-1][0], {}).get(cfg.export.metric)
            promotion = register_model(resolved, export_key, exported, parent, value)
            verdict = "**promoted to `champion`**" if promotion["promoted"] else "kept, **not promoted**"
            summary.append(f"Registered `{promotion['name']}` version {promotion['version']}: {verdict} on "
                           f"{promotion['metric']}: {promotion['reason']}")
            tags["export.promoted"] = str(promotion["promoted"]).lower()
    text = summarise(resolved, parent, summary, tags)
    return {"resolved": resolved, "model": model, "evaluation": table, "export": exported, "promotion": promotion,
            "mlflow_run_id": parent, "summary": text}


def _markdown_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)
