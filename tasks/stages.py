"""Thin Prefect tasks over library calls. They pass paths, keys and run ids, never models, and return the
typed records of `vlmexp.results`.

Training, evaluation and export are cached by a key of what they depend on (`vlmexp.pipeline.keys.stage_key`:
the resolved config's relevant sections, the sampled data's content digest, the upstream stage's key), so
re-running the flow with the same config and data skips them; `force` recomputes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from vlmexp.results import Evaluation, PipelineResult, Promotion, SampledData, StageResult

# how often the pipeline's task asks the server whether a stage's deployment run has ended (Prefect's
# run_deployment asks every 5 s: 2.5 s on average after each stage's end, a run of stages on a GPU pool
# waiting a few seconds per stage for nothing); one read of a flow run a second costs the server little
STAGE_POLL_SECONDS = 1.0


def _key(prefix: str):
    def cache_key(context, parameters: dict[str, Any]) -> str:
        # "v2": the tasks return typed results (vlmexp.results), not dicts; results persisted
        # in the dict shape are under the old "vlmexp-<prefix>-" keys and are never read back
        return f"vlmexp-v2-{prefix}-{parameters['key']}"

    return cache_key


@task(name="validate-config", cache_policy=NO_CACHE)
def validate_config(config: str, overrides: list[str], run_id: str = "") -> str:
    """Check the config (all problems at once) and write the resolved copy (pending until the data is
    sampled; the run's own, `run_id`)."""
    from vlmexp.pipeline.keys import resolve_config

    _, pending = resolve_config(config, overrides, run_id)
    get_run_logger().info("config %s ok; resolved to %s", config, pending)
    return str(pending)


def retry_unless_bad_input(task, task_run, state) -> bool:
    """Retry a failed task unless it failed on bad input (a VlmexpError): the same input fails the same way,
    while a Hub outage or a full disk may pass on the next try. An interrupted stage (Ctrl-C, SIGTERM, a
    cancel) is a stop, never retried."""
    from vlmexp.errors import VlmexpError
    from vlmexp.pipeline.processes import StageInterrupted, stop_signal

    if stop_signal() is not None:  # this process is stopping: whatever the stage's exit said, never again
        return False
    try:
        state.result()
    except (VlmexpError, StageInterrupted, KeyboardInterrupt):
        return False
    except BaseException:
        return True
    return True


@task(name="sample-data", cache_policy=NO_CACHE, retry_condition_fn=retry_unless_bad_input)
def sample_data(pending: str) -> SampledData:
    """Sample the data sources afresh (seeded): train/val JSONL files and their content digest. Only then is
    the pending resolved config committed as config.resolved.yaml (bad data leaves the folder as it was)."""
    from vlmexp.data.run_data import prepare_data
    from vlmexp.data.sampling import explain_manifest
    from vlmexp.modeling import resolve_model
    from vlmexp.pipeline.keys import commit_resolved, load_resolved
    from vlmexp.prompts import check_sft_targets

    cfg = load_resolved(pending)
    model_path, _ = resolve_model(cfg.model, cfg.run.output_dir)  # builds a tiny model once
    data = prepare_data(cfg)  # raises on bad data before writing anything; a retry reads `pending` again
    if cfg.sft.enabled:
        check_sft_targets(data.train, cfg.sft.target_template)  # before any stage starts
    resolved = commit_resolved(pending)
    log = get_run_logger()
    log.info("data: %s (content %s)", data.train, data.content_sha256[:12])
    for path in [p for p in (data.train, data.val) if p is not None]:
        for line in explain_manifest(path.with_name(path.stem + ".manifest.json")):
            log.info("%s data: %s", path.stem, line)  # which format each source was read as, and why
    return SampledData(resolved=str(resolved), train=str(data.train), val=str(data.val) if data.val else None,
                       hash=data.content_sha256, base_model=model_path)


@task(name="start-tracking", cache_policy=NO_CACHE)
def start_tracking(resolved: str, data_hash: str, flow_run_id: str) -> str:
    """The pipeline's parent MLflow run: flattened config as params, provenance tags, config + manifest."""
    from vlmexp.data.run_data import sampled_manifests
    from vlmexp.pipeline.keys import load_resolved
    from vlmexp.provenance import flatten, redact, redacted_yaml, run_tags
    from vlmexp.tracking.tracker import make_tracker

    cfg = load_resolved(resolved)
    tracker = make_tracker(cfg)
    parent = tracker.start_pipeline(
        f"{cfg.run.name}-pipeline", flatten(redact(cfg.model_dump(mode="json")), "config."),
        run_tags({"prefect.flow_run_id": flow_run_id, "data.content_sha256": data_hash}))
    tracker.log_text(parent, redacted_yaml(resolved), Path(resolved).name)  # secrets in the config stay out
    for manifest in sorted(Path(cfg.run.output_dir, "data").glob("*.manifest.json")):
        tracker.log_artifact(parent, manifest, "data")
    tracker.log_datasets(parent, sampled_manifests(cfg))
    return parent


def _on_deployment(stage: str, resolved: str, folder: Path, key: str, parameters: dict[str, Any], kind: type):
    """When `pipeline.stage_deployments` names a deployment for `stage`: run the `vlm-stage` flow there as a
    subflow of this task, wait, and return its result (a run that did not complete raises its error, so
    this task's retry starts it again). Otherwise None: the caller runs the stage in this process."""
    from vlmexp.pipeline.keys import load_resolved
    from vlmexp.pipeline.steps import remote_result

    name = load_resolved(resolved).pipeline.stage_deployments.get(stage)
    if not name:
        return None
    from prefect.deployments import run_deployment

    get_run_logger().info("%s runs as deployment %s", stage, name)
    run = run_deployment(name, parameters={"stage": stage, "resolved": resolved, "key": key, **parameters},
                         as_subflow=True, poll_interval=STAGE_POLL_SECONDS)
    get_run_logger().info("%s: flow run %s (%s) ended %s", stage, run.name, run.id, run.state.name)
    return remote_result(name, str(run.id), run.state.type.value, run.state.message, folder, key, kind)


@task(name="train-stage", cache_key_fn=_key("train"), persist_result=True,
      retry_condition_fn=retry_unless_bad_input)
def train_stage(stage: str, resolved: str, key: str, model: str | None, parent_run_id: str,
                force: bool = False, held_by: str | None = None) -> StageResult:
    """Run one training stage through the configured launcher as a subprocess, streaming its output, here or
    on the stage's deployment (`pipeline.stage_deployments`). A retry (same key) resumes from the newest
    checkpoint; the subprocess logs TRL's step metrics into this stage's MLflow child run. `held_by`: the
    pipeline run holding the output folder, inside whose hold the stage runs."""
    from vlmexp.pipeline.keys import load_resolved
    from vlmexp.pipeline.steps import run_training_stage

    folder = Path(load_resolved(resolved).run.output_dir) / stage
    result = _on_deployment(stage, resolved, folder, key, {"model": model, "parent_run_id": parent_run_id,
                                                            "force": force, "held_by": held_by}, StageResult)
    if result is None:
        result = run_training_stage(stage, resolved, key, model, parent_run_id, get_run_logger().info, force,
                                    held_by)
    return result.model_copy(update={"flow_run_id": str(flow_run.id)})


@task(name="evaluate", cache_key_fn=_key("eval"), persist_result=True,
      retry_condition_fn=retry_unless_bad_input)
def evaluate_model(name: str, resolved: str, key: str, model: str, records: str,
                   parent_run_id: str) -> Evaluation:
    """Generate on the held-out records with `model` and score with the training rewards (here, or on the
    `eval` deployment)."""
    from vlmexp.pipeline.keys import load_resolved
    from vlmexp.pipeline.steps import run_evaluation

    folder = Path(load_resolved(resolved).run.output_dir) / "eval" / name
    result = _on_deployment("eval", resolved, folder, key, {"name": name, "model": model, "records": records},
                            Evaluation)
    if result is None:
        result = run_evaluation(name, resolved, key, model, records)
    get_run_logger().info("%s: %s", name, result.metrics)
    return result


@task(name="log-evaluation", cache_policy=NO_CACHE)
def log_evaluation(resolved: str, evaluations: list[Evaluation], parent_run_id: str) -> list[dict[str, Any]]:
    """One MLflow child run for evaluation: metrics per model, the comparison table, per-sample tables;
    the comparison as a Prefect table artifact too."""
    from prefect.artifacts import create_table_artifact

    from vlmexp.data.run_data import sampled_manifests
    from vlmexp.pipeline.keys import load_resolved
    from vlmexp.pipeline.report import log_evaluation_run
    from vlmexp.results import comparison_table
    from vlmexp.tracking.tracker import make_tracker

    cfg = load_resolved(resolved)
    table = comparison_table(evaluations)
    log_evaluation_run(make_tracker(cfg), parent_run_id, evaluations, table,
                       sampled_manifests(cfg).get("evaluation"), cfg.export.metric, cfg.eval.pictures,
                       Path(cfg.run.output_dir) / "eval" / "pictures")
    create_table_artifact(table, key=f"{_artifact_key(cfg.run.name)}-evaluation",
                          description="Evaluation on the held-out records, one row per model")
    return table


def _artifact_key(name: str) -> str:
    """A Prefect artifact key from run.name (lowercase letters, digits and dashes)."""
    return name.lower().replace("_", "-").replace(".", "-")


@task(name="export", cache_key_fn=_key("export"), persist_result=True,
      retry_condition_fn=retry_unless_bad_input)
def export_model(resolved: str, key: str, model: str, parent_run_id: str, provenance: dict[str, Any]) -> str:
    """Merge (if LoRA), save a self-contained folder with manifest.json, and log it to the parent run."""
    from vlmexp.export import export_model as export
    from vlmexp.pipeline.keys import load_resolved
    from vlmexp.tracking.tracker import make_tracker

    cfg = load_resolved(resolved)
    out = export(cfg, model, Path(cfg.run.output_dir) / "export", provenance, resolved_config=resolved)
    make_tracker(cfg).log_artifact(parent_run_id, out / "manifest.json", "export")
    return str(out)


@task(name="register-model", cache_key_fn=_key("register"), persist_result=True)
def register_model(resolved: str, key: str, folder: str, parent_run_id: str,
                   metrics: dict[str, float]) -> Promotion:
    """Register the exported folder (a logged model of the parent run, with the evaluation `metrics` of the
    model it holds) in the MLflow Model Registry; move `champion` only to a better model."""
    import json

    from vlmexp.data.run_data import sampled_manifests
    from vlmexp.export import register_and_promote
    from vlmexp.pipeline.keys import load_resolved
    from vlmexp.tracking.registration import plan_registration
    from vlmexp.tracking.tracker import make_tracker

    cfg = load_resolved(resolved)
    name = cfg.export.registered_name or cfg.run.name
    # by copy or by reference, as the export's manifest says (an export written before it said: planned now)
    plan = json.loads((Path(folder) / "manifest.json").read_text()).get("registration")
    promotion = register_and_promote(make_tracker(cfg), parent_run_id, folder, name, cfg.export.metric,
                                     metrics.get(cfg.export.metric), cfg.export.direction,
                                     registration=plan or plan_registration(cfg.export, folder),
                                     metrics=metrics, dataset=sampled_manifests(cfg).get("evaluation"))
    verdict = "promoted to champion" if promotion.promoted else "kept, not promoted"
    get_run_logger().info("%s version %s %s: %s", name, promotion.version, verdict, promotion.reason)
    if promotion.promoted:  # the event the "new champion" automation notifies on (flows/automations.py)
        from tasks.events import emit_promoted

        emit_promoted(promotion, str(flow_run.id or ""))
    return promotion


@task(name="summarise", cache_policy=NO_CACHE)
def summarise(run: PipelineResult, status: str = "FINISHED") -> PipelineResult:
    """The run's markdown summary as a Prefect artifact and an MLflow artifact; tags and closes the parent
    run."""
    from prefect.artifacts import create_markdown_artifact

    from vlmexp.pipeline.keys import load_resolved
    from vlmexp.pipeline.report import log_headline
    from vlmexp.summary import render_summary, summary_tags
    from vlmexp.tracking.tracker import make_tracker

    cfg = load_resolved(run.data.resolved)
    tracker = make_tracker(cfg)
    # beside it
    grid = "evaluation/grid.png" if tracker.enabled and cfg.eval.pictures and run.evaluations else ""
    text = render_summary(run, tracker.run_link(run.mlflow_run_id), tracker.uri, grid)
    create_markdown_artifact(text, key=f"{_artifact_key(cfg.run.name)}-summary",
                             description="vlm-pipeline summary")
    tracker.log_text(run.mlflow_run_id, text, "summary.md")
    tracker.set_tags(run.mlflow_run_id, summary_tags(run))
    log_headline(tracker, run, cfg.export.metric)
    tracker.end(run.mlflow_run_id, status)
    return run.model_copy(update={"summary": text})
