"""The Prefect events the pipeline emits, for automations to act on (`flows/automations.py`, and the
`scheduled-retrain` deployment's trigger in prefect.yaml):

- `vlmexp.pipeline.failed`, `vlmexp.pipeline.crashed`, about `vlmexp.pipeline.<run.name>`: the vlm-pipeline
  flow's on_failure / on_crashed hook;
- `vlmexp.model.promoted`, about `vlmexp.model.<registered name>`: the register-model task, when a version
  takes the champion alias;
- `vlmexp.data.changed`, about `vlmexp.data.<run.name>`: the vlm-data-sensor flow, when the config's data
  sources changed.

Each names the flow run it comes from as a related resource (`prefect.flow-run.<id>`), so the UI links them.
The library never imports prefect: flows/ and tasks/ call these.
"""

from __future__ import annotations

from typing import Any

PIPELINE_FAILED, PIPELINE_CRASHED = "vlmexp.pipeline.failed", "vlmexp.pipeline.crashed"
MODEL_PROMOTED, DATA_CHANGED = "vlmexp.model.promoted", "vlmexp.data.changed"


def emit(event: str, kind: str, name: str, payload: dict[str, Any], flow_run_id: str | None = None):
    """Emit `event` about resource `vlmexp.<kind>.<name>` with `payload`; returns the Event (None where the
    client emits no events)."""
    from prefect.events import emit_event

    related = ([{"prefect.resource.id": f"prefect.flow-run.{flow_run_id}",
                 "prefect.resource.role": "flow-run"}] if flow_run_id else [])
    return emit_event(event, resource={"prefect.resource.id": f"vlmexp.{kind}.{name}",
                                       "prefect.resource.name": name},
                      related=related, payload=payload)


def emit_pipeline_ended(flow_run, state) -> None:
    """`vlmexp.pipeline.failed` or `.crashed` for a pipeline run that ended so (a cancel emits nothing: it was
    asked for), with the config, the state's message and the flow run's name."""
    kind = state.type.value.lower()
    if kind not in ("failed", "crashed"):
        return
    parameters = flow_run.parameters or {}
    config = parameters.get("config", "")
    emit(PIPELINE_FAILED if kind == "failed" else PIPELINE_CRASHED, "pipeline", _run_name(config, parameters),
         {"config": config, "overrides": parameters.get("overrides") or [], "state": state.name,
          "message": (state.message or "")[-2000:], "flow_run_name": flow_run.name}, str(flow_run.id))


def emit_promoted(promotion, flow_run_id: str) -> None:
    """`vlmexp.model.promoted` for a version that took the champion alias (vlmexp.results.Promotion)."""
    emit(MODEL_PROMOTED, "model", promotion.name, promotion.as_dict(), flow_run_id)


def _run_name(config: str, parameters: dict[str, Any]) -> str:
    """run.name of the config the pipeline ran (the file's stem when the config does not load)."""
    from pathlib import Path

    from vlmexp.checks.loader import load_config
    from vlmexp.errors import VlmexpError

    try:
        return load_config(config, parameters.get("overrides") or [], check_paths=False).run.name
    except (VlmexpError, OSError):
        # the run failed on its config: the event still goes out, named by the file
        return Path(config).stem or "unknown"
