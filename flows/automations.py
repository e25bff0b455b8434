"""The Prefect automations vlmexp ships, created (or updated, by name) on the server at PREFECT_API_URL by
`vlmexp prefect-setup [--notify BLOCK]`; the deployment trigger that retrains on new data is in prefect.yaml.

- "vlmexp: crash zombie flow runs": Prefect's zombie-flow automation (docs.prefect.io/v3/advanced/
  detect-zombie-flows): a self-hosted server marks a run whose worker died Crashed only through it, and a
  Crashed stage run is what makes the pipeline's task retry and resume. Tuned against its known false
  positives: `within` is three missed heartbeats plus a minute (PrefectHQ/prefect#16459: a window of barely
  three heartbeats crashed healthy runs whose heartbeats arrived late; Prefect Cloud's managed version waits 9
  minutes at the default 180 s); `expect` is every flow-run event (`prefect.flow-run.*`, as the docs now say,
  so a state with a custom name disarms it too); the state change is not forced, so a heartbeat sent after the
  run completed (#18653, #19598, #20887, #21932) cannot turn a Completed run into Crashed: Prefect refuses to
  crash a run in a terminal state; and it watches only vlmexp's flows (vlm-pipeline, vlm-stage), leaving the
  server's other flows as they were.
- With `--notify TYPE/NAME` (a notification block on the server, e.g. `slack-webhook/ops`): a notification
  when a pipeline run fails or crashes (`vlmexp.pipeline.failed` / `.crashed`, tasks/events.py), when the
  zombie automation marked a run Crashed (its process is gone: nothing else is left to report it), and when a
  new model takes the champion alias (`vlmexp.model.promoted`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from tasks.events import MODEL_PROMOTED, PIPELINE_CRASHED, PIPELINE_FAILED

ZOMBIE, NOTIFY_FAILED = "vlmexp: crash zombie flow runs", "vlmexp: notify on failed or crashed pipeline runs"
NOTIFY_LOST, NOTIFY_PROMOTED = ("vlmexp: notify on flow runs lost with their worker",
                                "vlmexp: notify on a new champion")
ZOMBIE_MESSAGE = "Flow run marked as crashed due to missing heartbeats (vlmexp: crash zombie flow runs)."
FLOWS = ["vlm-pipeline", "vlm-stage"]  # the flows whose runs the zombie automation watches


def zombie_automation(heartbeat_seconds: int):
    """Crash a run of vlmexp's flows that sent no event for three heartbeats and a minute after a
    heartbeat."""
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    trigger = EventTrigger(
        after={"prefect.flow-run.heartbeat"}, expect={"prefect.flow-run.*"},
        match={"prefect.resource.id": "prefect.flow-run.*"},
        match_related={"prefect.resource.role": "flow", "prefect.resource.name": FLOWS},
        for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1,
        within=timedelta(seconds=3 * heartbeat_seconds + 60))
    return AutomationCore(name=ZOMBIE, trigger=trigger, description=__doc__.split("\n\n")[1][:1000],
                          actions=[ChangeFlowRunState(state=StateType.CRASHED, message=ZOMBIE_MESSAGE,
                                                      force=False)])


def notify_automations(block_id) -> list:
    """The three notifications, sent through the notification block `block_id`."""
    from prefect.events.actions import SendNotification
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    def notify(name: str, subject: str, body: str, **trigger: Any):
        return AutomationCore(name=name,
                              trigger=EventTrigger(posture=Posture.Reactive, threshold=1, **trigger),
                              actions=[SendNotification(block_document_id=block_id, subject=subject,
                                                        body=body)])

    return [
        notify(NOTIFY_FAILED,
               "vlmexp: pipeline {{ event.resource['prefect.resource.name'] }} {{ event.payload.state }}",
               "{{ event.event }}: config {{ event.payload.config }} {{ event.payload.overrides }}, flow run "
               "{{ event.payload.flow_run_name }}:\n{{ event.payload.message }}",
               expect={PIPELINE_FAILED, PIPELINE_CRASHED},
               match={"prefect.resource.id": "vlmexp.pipeline.*"}),
        notify(NOTIFY_LOST, "vlmexp: flow run {{ event.resource['prefect.resource.name'] }} lost",
               "Flow run {{ event.resource['prefect.resource.name'] }} sent no heartbeat and was marked "
               "Crashed: its worker or node is gone. A stage run is retried by its pipeline; a pipeline run "
               "needs starting again.",
               expect={"prefect.flow-run.Crashed"},
               match={"prefect.resource.id": "prefect.flow-run.*", "prefect.state-message": ZOMBIE_MESSAGE},
               match_related={"prefect.resource.role": "flow", "prefect.resource.name": FLOWS}),
        notify(NOTIFY_PROMOTED,
               "vlmexp: {{ event.payload.name }} version {{ event.payload.version }} is the champion",
               "{{ event.payload.name }} version {{ event.payload.version }} took the champion alias on "
               "{{ event.payload.metric }} = {{ event.payload.value }}: {{ event.payload.reason }}",
               expect={MODEL_PROMOTED}, match={"prefect.resource.id": "vlmexp.model.*"}),
    ]


def set_up(notify: str | None = None, heartbeat_seconds: int | None = None) -> dict[str, str]:
    """Create or update (by name) vlmexp's automations on the server; {name: "created" | "updated"}."""
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, get_current_settings

    if not PREFECT_API_URL.value():
        raise ValueError("PREFECT_API_URL is not set: automations belong on the server your workers use, "
                         "e.g. export PREFECT_API_URL=http://127.0.0.1:4200/api (a temporary server forgets "
                         "them)")
    seconds = heartbeat_seconds or get_current_settings().flows.heartbeat_frequency or 180
    if seconds < 30:
        raise ValueError(f"--heartbeat-seconds {seconds}: Prefect sends flow-run heartbeats at most every "
                         "30 s (PREFECT_FLOWS_HEARTBEAT_FREQUENCY >= 30); give the workers' value")
    done = {}
    with get_client(sync_client=True) as client:
        automations = [zombie_automation(seconds)] + (notify_automations(notification_block(client, notify))
                                                      if notify else [])
        for automation in automations:
            found = client.read_automations_by_name(automation.name)
            if found:
                client.update_automation(found[0].id, automation)
            else:
                client.create_automation(automation)
            done[automation.name] = "updated" if found else "created"
    return done


def notification_block(client, name: str):
    """The id of notification block `name` (`block-type-slug/block-name`), refused with the fix if absent."""
    from prefect.exceptions import ObjectNotFound

    slug, _, block = name.partition("/")
    if not slug or not block:
        raise ValueError(f"--notify {name!r}: name the block as TYPE/NAME, e.g. slack-webhook/ops")
    try:
        document = client.read_block_document_by_name(name=block, block_type_slug=slug)
    except ObjectNotFound:
        raise ValueError(f"--notify {name!r}: no such block on the server; create it first (UI: Blocks, or "
                         f"in Python, e.g. SlackWebhook(url=...).save({block!r}))") from None
    if "notify" not in (document.block_schema.capabilities if document.block_schema else []):
        raise ValueError(f"--notify {name!r}: a {slug} block cannot send notifications; use a notification "
                         "block (slack-webhook, custom-webhook, ms-teams-webhook, ...)")
    return document.id
