"""vlmexp's automations and events on a real Prefect server: `vlmexp prefect-setup` creates the zombie-run
automation and the notifications (idempotently), `prefect deploy` the trigger that retrains on new data; a
failed pipeline run and a promotion emit their events, which the server's automations deliver to a webhook
block pointing at this test; the data sensor's event starts a scheduled-retrain run."""

from __future__ import annotations

import json
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


def test_automations_notify_and_new_data_starts_a_retrain(tmp_path):
    from prefect import get_client
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.events.filters import EventFilter, EventNameFilter
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.automations import FLOWS, NOTIFY_FAILED, NOTIFY_LOST, NOTIFY_PROMOTED, ZOMBIE

    hook = HTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    with prefect_server(tmp_path) as server, temporary_settings({PREFECT_API_URL: server.url}):
        create_pools_and_deploy(server)  # prefect.yaml: scheduled-retrain with its data trigger, the sensor
        CustomWebhookNotificationBlock(name="test", url=f"http://127.0.0.1:{hook.server_port}/hook",
                                       json_data={"subject": "{{subject}}", "body": "{{body}}"}).save("hook")

        def setup(*args: str) -> str:
            r = subprocess.run([sys.executable, "-m", "vlmexp.cli", "prefect-setup", *args], capture_output=True,
                               text=True, cwd=REPO, env={**server.env, "PYTHONPATH": str(REPO)}, timeout=120,
                               check=False)
            assert r.returncode == (2 if "--notify" in args and "nope" in args[-1] else 0), r.stderr[-2000:]
            return r.stdout + r.stderr

        assert "no such block" in setup("--notify", "custom-webhook/nope")
        assert f"created: {ZOMBIE}" in setup("--notify", "custom-webhook/hook")
        assert f"updated: {NOTIFY_PROMOTED}" in setup("--notify", "custom-webhook/hook")  # again: no duplicate
        with get_client(sync_client=True) as client:
            automations = {a.name: a for a in client.read_automations()}
            assert [a.name for a in client.read_automations()].count(ZOMBIE) == 1
        assert {ZOMBIE, NOTIFY_FAILED, NOTIFY_LOST, NOTIFY_PROMOTED,
                "vlmexp: retrain when the demo data changes"} <= set(automations)
        zombie = automations[ZOMBIE].trigger
        assert zombie.posture == "Proactive" and zombie.after == {"prefect.flow-run.heartbeat"}
        assert zombie.expect == {"prefect.flow-run.*"} and zombie.within == timedelta(seconds=600)  # 3 x 180 s + 60
        assert zombie.match_related["prefect.resource.name"] == FLOWS
        assert automations[ZOMBIE].actions[0].force is False  # a finished run is never turned into Crashed

        _fail_a_pipeline_run(tmp_path)
        from tasks.events import emit_promoted
        from vlmexp.export import Promotion

        emit_promoted(Promotion("vlmexp-demo", "3", "rec_mean_iou", 0.41, "2", 0.35, True, "0.4100 > 0.3500"), "")
        retrains = _new_data_starts_a_retrain(tmp_path)
        from prefect.events.worker import EventsWorker

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
        bodies = _wait(lambda: " | ".join(r["subject"] + ": " + r["body"] for r in RECEIVED)
                       if len(RECEIVED) >= 2 else None)
        assert bodies and "vlmexp-demo version 3 is the champion" in bodies, bodies
        assert "pipeline demo Failed" in bodies and "sft.args.learning_rate" in bodies, bodies
        assert retrains, "no scheduled-retrain run was started by the data trigger"
    hook.shutdown()


def _fail_a_pipeline_run(tmp_path: Path) -> None:
    """A pipeline run whose config is refused fails at its first task: its on_failure hook emits the event."""
    from flows.pipeline import vlm_pipeline

    state = vlm_pipeline(config=str(REPO / "configs/demo.yaml"), return_state=True,
                         overrides=[f"run.output_dir={tmp_path / 'failed'}", "sft.args.learning_rate=oops"])
    assert state.is_failed()


def _new_data_starts_a_retrain(tmp_path: Path) -> list:
    """The sensor's first look records the sources; after the data file is rewritten, its second look emits
    vlmexp.data.changed and the deployment trigger starts scheduled-retrain (a run created by the automation)."""
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
