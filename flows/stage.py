"""The vlm-stage flow: ONE stage of vlm-pipeline, run as its own deployment on the work pool where the
GPUs are (`pipeline.stage_deployments`). The pipeline's task starts it with `run_deployment` and waits.

It runs exactly what the pipeline's task runs in-process (`vlmexp.pipeline.steps.run_training_stage` or
`run_evaluation`): the same stage folder, MLflow child run, stage_key.json and resume from the newest
checkpoint. It takes paths, keys and run ids only; the output folder and the MLflow store must be the
same on the flow's machine and on this one. Its result (`vlmexp.results.StageResult` or `Evaluation`) is
written to <stage folder>/stage_result.json.
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.exceptions import TerminationSignal
from prefect.runtime import flow_run

from vlmexp.results import Evaluation, StageResult


@flow(name="vlm-stage", log_prints=True)
def vlm_stage(stage: str, resolved: str, key: str, model: str | None = None, parent_run_id: str = "",
              force: bool = False, name: str | None = None, records: str | None = None,
              held_by: str | None = None) -> StageResult | Evaluation:
    """Train `stage` (sft, dpo, grpo) from `model`, or evaluate `model` as candidate `name` on `records`
    (stage eval), for the resolved config at `resolved`. `held_by`: the pipeline run holding the output
    folder, which started this one; without it (a stage deployment run started by hand) this run holds the
    folder itself, or waits or is refused as `run.on_busy` says."""
    from vlmexp.pipeline.steps import run_evaluation

    if stage == "eval":
        if not (name and model and records):
            raise ValueError(f"stage eval needs name, model and records; got {name=}, {model=}, {records=}")
        return run_evaluation(name, resolved, key, model, records)
    if held_by:
        return _train(stage, resolved, key, model, parent_run_id, force, held_by)
    from vlmexp.pipeline.hold import holding
    from vlmexp.pipeline.keys import load_resolved

    cfg = load_resolved(resolved)
    with holding(cfg.run.output_dir, "vlm-stage flow run", str(flow_run.id or "") or None, cfg.run.on_busy,
                 cfg.run.busy_wait_seconds) as hold:
        return _train(stage, resolved, key, model, parent_run_id, force, hold.run_id)


def _train(stage: str, resolved: str, key: str, model: str | None, parent_run_id: str, force: bool,
           held_by: str) -> StageResult:
    import signal

    from vlmexp.pipeline.processes import StageInterrupted, stop_signal
    from vlmexp.pipeline.steps import run_training_stage

    try:
        return run_training_stage(stage, resolved, key, model, parent_run_id, get_run_logger().info, force,
                                  held_by)
    except StageInterrupted as e:
        # the worker's cancel, passed on to the stage's processes: to Prefect
        if stop_signal() == signal.SIGTERM:
            raise TerminationSignal(signal.SIGTERM) from e  # as its own SIGTERM handler raises it (a cancel)
        raise
