"""Stopping a pipeline run: its stage flow runs on other work pools are cancelled with it, and its MLflow runs
are marked KILLED. Prefect cancels a parent flow run without its subflows on other workers (PrefectHQ/prefect
#17593, #22594), so the pipeline cancels them itself: from its `on_cancellation` / `on_crashed` /
`on_failure` hooks (a cancel from the UI or the API, a crash, a failure) and when a Ctrl-C or SIGTERM
reaches `vlmexp run`."""

from __future__ import annotations

import logging

log = logging.getLogger("vlmexp.pipeline")


def cancel_child_runs(flow_run_id: str) -> list[str]:
    """Ask every unfinished flow run started under `flow_run_id` (the stage deployments' runs) to cancel:
    their workers then stop the stage's processes. Returns the ids asked."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.states import Cancelling

    asked = []
    with get_client(sync_client=True) as client:
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])))
        for child in children:
            if child.state is not None and child.state.is_final():
                continue
            client.set_flow_run_state(child.id, Cancelling(message=f"its pipeline run {flow_run_id} stopped"),
                                      force=True)
            asked.append(str(child.id))
    if asked:
        log.info("asked the stage runs %s to cancel", ", ".join(asked))
    return asked


def on_stopped(flow, flow_run, state) -> None:
    """The pipeline flow's on_cancellation / on_crashed / on_failure hook: a pipeline run that ends without
    finishing leaves no stage run of its own running, and a failed or crashed one emits its Prefect event
    (`tasks/events.py`) for the automations that notify."""
    from tasks.events import emit_pipeline_ended

    cancel_child_runs(str(flow_run.id))
    emit_pipeline_ended(flow_run, state)


def mark_killed(resolved: str | None, run_ids: list[str]) -> None:
    """End the pipeline's MLflow runs (parent, and any stage run still open) as KILLED: the run was stopped,
    it did not fail."""
    if not resolved:
        return
    from vlmexp.pipeline.keys import load_resolved
    from vlmexp.tracking.tracker import make_tracker

    tracker = make_tracker(load_resolved(resolved))
    for run_id in run_ids:
        if run_id:
            tracker.end(run_id, "KILLED")
