"""vlmexp's automations and events on a real Prefect server: `vlmexp prefect-setup` creates the zombie-run
automation and the notifications (idempotently), `prefect deploy` the trigger that retrains on new data; a
failed pipeline run and a promotion emit their events, which the server's automations deliver to a webhook
block pointing at this test; the data sensor's event starts a scheduled-retrain run; and the zombie automation
crashes a run gone silent. One test: the zombie automation's shortest window (150 s after a heartbeat) runs
while the rest is exercised, instead of after it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from conftest import make_png, write_json
from prefect_server import create_pools_and_deploy, prefect_server

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


RECEIVED: list[dict] = []  # what the webhook block posted to this test


class Hook(BaseHTTPRequestHandler):
    def do_POST(self):
        RECEIVED.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def _wait(what, seconds: float = 90):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if found := what():
            return found
        time.sleep(1)
    return what()


@pytest.fixture(scope="module")
def server(tmp_path_factory, prefect_database):
    """A Prefect server with a webhook notification block `custom-webhook/hook` that posts to this test
    (RECEIVED); the test deploys prefect.yaml while the zombie automation's window runs."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.settings import PREFECT_API_URL, temporary_settings

    hook = HTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    home = tmp_path_factory.mktemp("prefect") / "prefect-home"
    shutil.copytree(prefect_database, home)
    with prefect_server(home.parent, home) as server, \
            temporary_settings({PREFECT_API_URL: server.url}):
        CustomWebhookNotificationBlock(name="test", url=f"http://127.0.0.1:{hook.server_port}/hook",
                                       json_data={"subject": "{{subject}}", "body": "{{body}}"}).save("hook")
        yield server
    hook.shutdown()


def _setup(server, *args: str) -> str:
    """`vlmexp prefect-setup ARGS` against the server; its output (exit 2 expected for an unknown block)."""
    r = subprocess.run([sys.executable, "-m", "vlmexp.cli", "prefect-setup", *args], capture_output=True,
                       text=True, cwd=REPO, env={**server.env, "PYTHONPATH": str(REPO)}, timeout=120,
                       check=False)
    assert r.returncode == (2 if "--notify" in args and "nope" in args[-1] else 0), r.stderr[-2000:]
    return r.stdout + r.stderr


def test_automations_notify_retrain_on_new_data_and_crash_a_run_gone_silent(server, tmp_path):
    """The set-up twice (no duplicates; an unknown block refused), the zombie automation's trigger at the
    default heartbeat (180 s: a 600 s window), then at the shortest heartbeat Prefect allows (30 s: a 150 s
    window) on flow runs whose process is gone (created through the API, their heartbeats sent from here).
    While that window runs: prefect.yaml is deployed (scheduled-retrain with its data trigger, the sensor); a
    failed pipeline run, a promotion and new data under the sensor emit their events, two notifications reach
    the webhook and the data trigger starts a scheduled-retrain run. Then a vlm-stage run whose last event was
    a heartbeat is marked Crashed with the automation's message and the lost-run notification goes out; one
    that completed and then sent a heartbeat (the known false positive, PrefectHQ/prefect#18653) stays
    Completed; a run of another flow that went silent is left alone."""
    _set_up_automations(server)
    runs, last = _runs_gone_silent()
    _deploy(server)
    _failure_promotion_and_new_data_are_delivered(tmp_path)
    _only_the_lost_run_is_crashed(runs, last)


def _set_up_automations(server) -> None:
    """`vlmexp prefect-setup` refuses an unknown block, creates (its zombie trigger at the default
    heartbeat), then, run again with the heartbeat at 30 s, updates each automation by name (no duplicate)."""
    from prefect import get_client

    from flows.automations import FLOWS, NOTIFY_FAILED, NOTIFY_LOST, NOTIFY_PROMOTED, ZOMBIE

    assert "no such block" in _setup(server, "--notify", "custom-webhook/nope")
    assert f"created: {ZOMBIE}" in _setup(server, "--notify", "custom-webhook/hook")
    with get_client(sync_client=True) as client:
        automations = {a.name: a for a in client.read_automations()}
    assert {ZOMBIE, NOTIFY_FAILED, NOTIFY_LOST, NOTIFY_PROMOTED} <= set(automations)
    zombie = automations[ZOMBIE].trigger
    assert zombie.posture == "Proactive" and zombie.after == {"prefect.flow-run.heartbeat"}
    # 3 x 180 s + 60
    assert zombie.expect == {"prefect.flow-run.*"} and zombie.within == timedelta(seconds=600)
    assert zombie.match_related["prefect.resource.name"] == FLOWS
    assert automations[ZOMBIE].actions[0].force is False  # a finished run is never turned into Crashed

    # again: each one updated by name, no duplicate
    again = _setup(server, "--notify", "custom-webhook/hook", "--heartbeat-seconds", "30")
    assert all(f"updated: {name}" in again for name in (ZOMBIE, NOTIFY_FAILED, NOTIFY_LOST, NOTIFY_PROMOTED))
    with get_client(sync_client=True) as client:
        names = [a.name for a in client.read_automations()]
        (zombie,) = client.read_automations_by_name(ZOMBIE)
    assert sorted(names) == sorted(automations)  # the same automations, none added
    assert zombie.trigger.within == timedelta(seconds=150)  # 3 x 30 s + 60


def _runs_gone_silent() -> tuple[dict, float]:
    """Three running flow runs, each with one heartbeat, whose process is gone: `lost-node` and `finished`
    (vlm-stage; `finished` completes, then sends one more heartbeat, which arms the trigger once more) and
    `not-ours` (another flow). {name: (run, flow)} and the time of the last heartbeat."""
    from prefect import flow, get_client
    from prefect.events import emit_event
    from prefect.events.worker import EventsWorker
    from prefect.states import Completed, Running

    from flows.stage import vlm_stage

    @flow(name="not-vlmexp")
    def elsewhere():
        pass

    def heartbeat(run, of) -> float:
        emit_event("prefect.flow-run.heartbeat",
                   resource={"prefect.resource.id": f"prefect.flow-run.{run.id}",
                             "prefect.resource.name": run.name},
                   related=[{"prefect.resource.id": f"prefect.flow.{run.flow_id}",
                             "prefect.resource.role": "flow", "prefect.resource.name": of.name}])
        EventsWorker.drain_all()
        return time.monotonic()

    with get_client(sync_client=True) as client:
        runs = {name: (client.create_flow_run(of, name=name, state=Running()), of)
                for name, of in (("lost-node", vlm_stage), ("finished", vlm_stage), ("not-ours", elsewhere))}
        for run, of in runs.values():
            heartbeat(run, of)
        client.set_flow_run_state(runs["finished"][0].id, Completed())
    time.sleep(2)
    return runs, heartbeat(*runs["finished"])  # sent after Completed


def _deploy(server) -> None:
    """`prefect deploy --all` (and the pools it names): scheduled-retrain with its data trigger, which is an
    automation on the server, and the sensor."""
    from prefect import get_client

    create_pools_and_deploy(server)
    with get_client(sync_client=True) as client:
        assert client.read_automations_by_name("vlmexp: retrain when the demo data changes")


def _failure_promotion_and_new_data_are_delivered(tmp_path: Path) -> None:
    """A failed pipeline run, a promotion and the sensor's new data: their three events on the server, the
    failure's and the promotion's notifications at the webhook, and a scheduled-retrain run started."""
    from prefect import get_client
    from prefect.events.filters import EventFilter, EventNameFilter
    from prefect.events.worker import EventsWorker

    from tasks.events import emit_promoted
    from vlmexp.results import Promotion

    _fail_a_pipeline_run(tmp_path)
    emit_promoted(Promotion("vlmexp-demo", "3", "rec_mean_iou", 0.41, "2", 0.35, True, "0.4100 > 0.3500"), "")
    retrains = _new_data_starts_a_retrain(tmp_path)
    EventsWorker.drain_all()
    names = ["vlmexp.pipeline.failed", "vlmexp.model.promoted", "vlmexp.data.changed"]

    def read_events():
        with get_client(sync_client=True) as client:  # the server takes at most 50 a page
            found = {e.event: e for e in client.read_events(EventFilter(event=EventNameFilter(name=names)),
                                                            limit=50).events}
        return found if len(found) == len(names) else None

    events = _wait(read_events)
    assert events and set(events) == set(names), events
    assert events["vlmexp.pipeline.failed"].resource.id == "vlmexp.pipeline.demo"
    assert events["vlmexp.model.promoted"].payload["version"] == "3"
    assert events["vlmexp.data.changed"].resource.id == "vlmexp.data.demo"

    def received():  # the lost-run notification may arrive among them
        bodies = " | ".join(r["subject"] + ": " + r["body"] for r in RECEIVED)
        return bodies if "is the champion" in bodies and "pipeline demo" in bodies else None

    bodies = _wait(received)
    assert bodies and "vlmexp-demo version 3 is the champion" in bodies, RECEIVED
    assert "pipeline demo Failed" in bodies and "sft.args.learning_rate" in bodies, bodies
    assert retrains, "no scheduled-retrain run was started by the data trigger"


def _only_the_lost_run_is_crashed(runs: dict, last: float) -> None:
    """Within the 150 s window and a margin of `last` (the last heartbeat's time): `lost-node` Crashed by the
    automation and its notification sent; past `finished`'s window too, `finished` still Completed and
    `not-ours` still Running."""
    from prefect import get_client

    from flows.automations import ZOMBIE_MESSAGE

    with get_client(sync_client=True) as client:

        def state(name: str):
            return client.read_flow_run(runs[name][0].id).state

        crashed = _wait(lambda: state("lost-node").is_crashed(), last + 240 - time.monotonic())
        assert crashed and state("lost-node").message == ZOMBIE_MESSAGE, state("lost-node")
        time.sleep(max(0.0, last + 150 + 30 - time.monotonic()))  # past the finished run's window too
        assert state("finished").is_completed(), state("finished")
        assert state("not-ours").is_running(), state("not-ours")
    lost = _wait(lambda: [r for r in RECEIVED if "lost-node lost" in r["subject"]])
    assert lost and "marked Crashed" in lost[0]["body"], RECEIVED


def _fail_a_pipeline_run(tmp_path: Path) -> None:
    """A pipeline run whose config is refused fails at its first task: its on_failure hook emits the event."""
    from flows.pipeline import vlm_pipeline

    state = vlm_pipeline(config=str(REPO / "configs/demo.yaml"), return_state=True,
                         overrides=[f"run.output_dir={tmp_path / 'failed'}", "sft.args.learning_rate=oops"])
    assert state.is_failed()


def _new_data_starts_a_retrain(tmp_path: Path) -> list:
    """The sensor's first look records the sources; after the data file is rewritten, its second look
    emits vlmexp.data.changed and the deployment trigger starts scheduled-retrain (a run created by the
    automation)."""
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName, FlowRunFilter

    from flows.data_sensor import vlm_data_sensor

    image = make_png(tmp_path / "data" / "a.png")
    data = write_json(tmp_path / "data" / "rec.json", [{"image": str(image), "problem": "the red box",
                                                       "solution": [1, 1, 9, 9]}])
    overrides = ["data.demo=null", f"data.datasets=[{{json_path: {data}}}]", "eval.enabled=false",
                 f"run.output_dir={tmp_path / 'sensed'}"]
    config = str(REPO / "configs/demo.yaml")
    assert vlm_data_sensor(config, overrides) is False  # the first look
    assert vlm_data_sensor(config, overrides) is False  # nothing changed
    write_json(data, [{"image": str(image), "problem": "the red box", "solution": [1, 1, 9, 9]}] * 2)
    assert vlm_data_sensor(config, overrides) is True

    def started():
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(), deployment_filter=DeploymentFilter(
                name=DeploymentFilterName(any_=["scheduled-retrain"])))
        return [r for r in runs if r.created_by and r.created_by.type == "AUTOMATION"]

    return _wait(started)
