"""A training stage and an evaluation as the pipeline runs them: the same function in-process or in a
stage deployment's flow run, each leaving its result (a small JSON) in its folder."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from vlmexp.paths import KEY_FILE
from vlmexp.pipeline.keys import claim_stage_dir, load_resolved
from vlmexp.pipeline.processes import StageFailed, StageInterrupted, run_streaming, stage_env
from vlmexp.results import Evaluation, Result, StageResult

R = TypeVar("R", bound=Result)


RESULT_NAME = "stage_result.json"


def run_training_stage(stage: str, resolved: str, key: str, model: str | None, parent_run_id: str,
                       on_line: Callable[[str], None], force: bool = False,
                       held_by: str | None = None) -> StageResult:
    """One training stage, wherever it runs (the flow's train task, or the `vlm-stage` flow on another pool).

    The stage folder belongs to `key`: a retry (same key) resumes from the newest checkpoint and reuses the
    stage's MLflow child run; new inputs archive the old folder first. The launched subprocess logs TRL's
    step metrics into that child run. The result is also written to <stage folder>/stage_result.json,
    which is how a flow on another machine reads it (the output folder is shared). `held_by`: the run that
    holds the output folder (vlmexp.pipeline.hold), passed to the stage process as `--held-by`.
    """
    from vlmexp.data.run_data import sampled_manifests
    from vlmexp.launch import stage_command
    from vlmexp.pipeline.report import curve_keys, plot_curves
    from vlmexp.tracking.spool import send_spooled
    from vlmexp.tracking.tracker import make_tracker

    cfg = load_resolved(resolved)
    stage_dir = Path(cfg.run.output_dir) / stage
    resuming = not force and stage_dir.is_dir() and (stage_dir / KEY_FILE).is_file()
    claim_stage_dir(stage_dir, key, fresh=force)
    tracker = make_tracker(cfg)
    run_file = stage_dir / "mlflow_run_id"
    run_id = run_file.read_text().strip() if resuming and run_file.is_file() else ""
    if not run_id:
        run_id = tracker.start_stage(parent_run_id, stage, {"stage_key": key})
        run_file.write_text(run_id + "\n")
        tracker.log_datasets(run_id, {k: v for k, v in sampled_manifests(cfg).items() if k == "training"})
    command = stage_command(cfg.launch, stage, resolved, model, run_id=f"{cfg.run.name}-{stage}",
                            mlflow_run_id=run_id or None, checked=True, held_by=held_by)
    on_line("running " + " ".join(command))
    start = time.monotonic()
    try:
        run_streaming(command, stage_env(), on_line)
    except BaseException as e:  # stopped (Ctrl-C, SIGTERM, a cancel): KILLED, as MLflow names a stopped run
        stopped = (isinstance(e, (StageInterrupted, KeyboardInterrupt))
                   or type(e).__name__ == "TerminationSignal")
        try:
            _tag_ray_run(tracker, run_id, cfg, stage)
            tracker.end(run_id, "KILLED" if stopped else "FAILED")
        except Exception as closing:  # noqa: BLE001 - a store on the disk that filled: the stage's error stays
            on_line(f"could not close MLflow run {run_id} as {'KILLED' if stopped else 'FAILED'} "
                    f"({closing.__class__.__name__}: {str(closing)[:300]})")
        raise
    _tag_ray_run(tracker, run_id, cfg, stage)
    seconds = time.monotonic() - start
    if tracker.enabled:  # what the stage's store did not take before the stage ended (the curves read it)
        send_spooled(stage_dir)
    png = plot_curves(tracker, run_id, curve_keys(tracker, run_id, stage), stage_dir / "curves.png",
                      f"{cfg.run.name} {stage}: {'rewards' if stage == 'grpo' else 'loss'} by step")
    if png:
        tracker.log_artifact(run_id, png, "plots")
    # DPO's sampled pairs and their counts
    for pairs in (stage_dir / "pairs.jsonl", stage_dir / "pairs.json"):
        if pairs.is_file():
            tracker.log_artifact(run_id, pairs, "pairs")
    memory, counts = stage_dir / "peak_memory.json", stage_dir / "pairs.json"
    tracker.log_metrics(run_id, {"stage_seconds": seconds,
                                 **(json.loads(memory.read_text()) if memory.is_file() else {}),
                                 **({f"pairs/{k}": v for k, v in json.loads(counts.read_text()).items()}
                                    if counts.is_file() else {})})
    tracker.end(run_id, "FINISHED")
    summary = stage_dir / "validation.json"  # validation during training: the best checkpoint and its step
    result = StageResult(stage=stage, final=str(stage_dir / "final"), key=key, run_id=run_id, seconds=seconds,
                         validation=json.loads(summary.read_text()) if summary.is_file() else None)
    return write_result(stage_dir, result)


def _tag_ray_run(tracker, run_id: str, cfg, stage: str) -> None:
    """launch.launcher ray: the cluster, Ray's ids, the node count and each worker's node and resources as
    the stage run's tags."""
    if cfg.launch.launcher == "ray":
        from vlmexp.ray_cluster import ray_dir, run_tags

        tracker.set_tags(run_id, run_tags(ray_dir(cfg, stage)))


def write_result(folder: Path, result: R) -> R:
    """Record a stage's result next to its outputs as stage_result.json (through a temporary file and a
    rename)."""
    from vlmexp.files import atomic_write

    atomic_write(folder / RESULT_NAME, result.model_dump_json(indent=1) + "\n")
    return result


def remote_result(deployment: str, flow_run: str, state: str, message: str | None, folder: Path,
                  key: str, kind: type[R]) -> R:
    """The result of a stage that ran as deployment `deployment` (flow run `flow_run`, final state `state`).

    A run that did not complete raises StageFailed with its state message (the stage's error), so the
    calling task fails and its retry starts the deployment again, which resumes from the checkpoint. A
    completed run's result is read from `folder`/stage_result.json, which must carry `key`, as a `kind`.
    """
    if state != "COMPLETED":
        raise StageFailed(f"stage deployment {deployment} (flow run {flow_run}) ended {state}: "
                          f"{(message or 'no message').strip()[-3000:]}")
    path = folder / RESULT_NAME
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise StageFailed(f"stage deployment {deployment} (flow run {flow_run}) completed but {path} is not "
                          f"readable here ({e}); the output folder must be shared between the flow's and the "
                          "stage's machines (the same path on both)") from e
    if result.get("key") != key:
        raise StageFailed(f"{path} belongs to stage key {str(result.get('key'))[:12]}, not {key[:12]}: "
                          "another run wrote the folder; retrying")
    return kind.model_validate(result)


def run_evaluation(name: str, resolved: str, key: str, model: str, records: str) -> Evaluation:
    """Generate on the held-out `records` with `model` and score with the training rewards, into
    <output_dir>/eval/<name>/ (with stage_result.json, as `run_training_stage`)."""
    from vlmexp.evaluate import evaluate

    cfg = load_resolved(resolved)
    start = time.monotonic()
    folder = Path(cfg.run.output_dir) / "eval" / name
    result = evaluate(cfg, model, records, folder)
    return write_result(folder, Evaluation(name=name, model=model, metrics=result.metrics,
                                           samples=str(result.samples_path), key=key,
                                           seconds=time.monotonic() - start))
