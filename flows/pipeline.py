"""The vlm-pipeline flow: validate -> sample data -> SFT -> DPO -> GRPO -> evaluate -> export.

Stages switch off in the config (`sft.enabled`, ...). Training, evaluation and export are cached by what
they depend on, so a re-run with the same config and data skips them (`force=True` recomputes), and a
retried training task resumes from its last checkpoint. Run it with `vlmexp run CONFIG [k=v ...]`, or
from a deployment: `prefect deployment run 'vlm-pipeline/manual' --param config=configs/demo.yaml`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.exceptions import TerminationSignal
from prefect.runtime import flow_run
from prefect.states import Cancelled

from flows.stopping import cancel_child_runs, mark_killed, on_stopped
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
from vlmexp.config.schema import TRAINING_STAGES
from vlmexp.results import PipelineResult  # typed results: light, no torch


def _cached(task, force: bool, retries: int, delay: float, **params: Any):
    """Run `task` with the config's retries; a cached result whose output was deleted is recomputed."""
    result = task.with_options(retries=retries, retry_delay_seconds=delay,
                               refresh_cache=force or None)(**params)
    if not Path(getattr(result, "output", result)).exists():
        result = task.with_options(retries=retries, retry_delay_seconds=delay, refresh_cache=True)(**params)
    return result


@flow(name="vlm-pipeline", log_prints=True, on_cancellation=[on_stopped], on_crashed=[on_stopped],
      on_failure=[on_stopped])
def vlm_pipeline(config: str, overrides: list[str] | None = None, force: bool = False) -> PipelineResult:
    """The pipeline. It holds the output folder for its life (vlmexp.pipeline.hold): another run on it waits
    or is refused, as `run.on_busy` says. A Ctrl-C or SIGTERM stops it: the stage's processes are stopped
    (never retried), its stage runs on other pools are cancelled, its MLflow runs end KILLED and the flow run
    ends Cancelled."""
    from vlmexp.errors import quiet_bad_input_tracebacks
    from vlmexp.pipeline.keys import check_pipeline_parameters

    # bad input: the problems, no traceback
    quiet_bad_input_tracebacks("prefect.task_runs", "prefect.flow_runs")
    check_pipeline_parameters(config, overrides)
    with _holding(config, overrides) as held_by:
        return _stoppable(config, overrides, force, held_by)


@contextmanager
def _holding(config: str, overrides: list[str] | None) -> Iterator[str | None]:
    """Hold the config's output folder as this flow run, yielding the holder's run id; a config that does not
    load holds nothing (its validate step reports every problem)."""
    from vlmexp.pipeline.hold import holding
    from vlmexp.pipeline.keys import pending_path, run_folder

    found = run_folder(config, overrides)
    if found is None:
        yield None
        return
    folder, cfg = found
    with holding(folder, "vlm-pipeline flow run", str(flow_run.id or "") or None, cfg.run.on_busy,
                 cfg.run.busy_wait_seconds) as hold:
        try:
            yield hold.run_id
        finally:  # a run that ended before its data was sampled leaves no pending config of its own
            pending_path(folder, hold.run_id).unlink(missing_ok=True)


def _stoppable(config: str, overrides: list[str] | None, force: bool, held_by: str | None):
    from vlmexp.pipeline.processes import StageInterrupted, note_stop, stop_signal, stopped_by

    started: dict[str, Any] = {}  # what a stop must close: the resolved config and the MLflow runs
    try:
        return _pipeline(config, overrides, force, started, held_by)
    except (KeyboardInterrupt, TerminationSignal, StageInterrupted) as stop:
        # Prefect's SIGTERM handler raised it
        if isinstance(stop, TerminationSignal) and stop_signal() is None:
            note_stop(stop.signal)
        by = stopped_by(stop_signal())  # this process's signal; none: a stage stopped from outside, or Ctrl-C
        cancel_child_runs(str(flow_run.id or ""))
        mark_killed(started.get("resolved"), [started.get("parent", "")])  # a stage's run: pipeline/steps.py
        return Cancelled(message=f"stopped by {by}; run the same command again to resume")


def _pipeline(config: str, overrides: list[str] | None, force: bool, started: dict[str, Any],
              held_by: str | None) -> PipelineResult:
    from vlmexp.pipeline.keys import load_resolved, stage_key

    pending = validate_config(config, overrides or [], held_by or "")
    cfg = load_resolved(pending)
    retry = {"force": force, "retries": cfg.pipeline.retries, "delay": cfg.pipeline.retry_delay_seconds}
    data = sample_data.with_options(retries=cfg.pipeline.retries)(pending)  # commits config.resolved.yaml
    this_run = str(flow_run.id or "")
    run = PipelineResult(name=cfg.run.name, config=config, data=data, flow_run_id=this_run,
                         mlflow_run_id=start_tracking(data.resolved, data.hash, this_run))
    started.update(resolved=data.resolved, parent=run.mlflow_run_id)
    tracked = {"resolved": data.resolved, "parent_run_id": run.mlflow_run_id, **retry}

    for stage in TRAINING_STAGES:
        run.stages[stage] = _cached(train_stage, stage=stage,
                                    key=stage_key(cfg, stage, data.hash, run.upstream_key),
                                    model=run.start_model(stage), held_by=held_by,
                                    **tracked) if getattr(cfg, stage).enabled else None

    if cfg.eval.enabled and data.val:
        run.evaluations = [_cached(evaluate_model, name=name, model=path, records=data.val, **tracked,
                                   key=stage_key(cfg, "eval", data.hash, f"{name}:{upstream}:{path}"))
                           for name, path, upstream in run.candidates(cfg.export.checkpoint)]
        run.evaluation = log_evaluation(data.resolved, run.evaluations, run.mlflow_run_id)

    if cfg.export.enabled and run.trained:
        export_key = stage_key(cfg, "export", data.hash, run.upstream_key)
        chosen = cfg.export.checkpoint  # last: the final model; best: the best validation's checkpoint
        run.export = _cached(export_model, key=export_key, model=run.exported(chosen)[0],
                             provenance=run.provenance(chosen), **tracked)
        if cfg.tracking.backend != "none":
            run.promotion = register_model(data.resolved, export_key, run.export, run.mlflow_run_id,
                                           run.metrics(chosen))
    return summarise(run)
