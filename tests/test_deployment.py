"""A real Prefect server, process work pool, `prefect deploy`, worker and `prefect deployment run --watch`."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SMALL_BATCHES

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, seconds: float = 60) -> None:
    import urllib.request

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {seconds} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # the worker stops on SIGINT, not promptly on SIGTERM
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_deployments_run_from_a_worker_and_the_schedule_creates_runs(tmp_path):
    port = _free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_LOCAL_STORAGE_PATH": str(tmp_path / "results")}
    logs = tmp_path / "logs"
    logs.mkdir()
    procs = []
    try:
        server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                  env=env, stdout=open(logs / "server.log", "w"), stderr=subprocess.STDOUT)
        procs.append(server)
        _wait_http(f"http://127.0.0.1:{port}/api/health")

        def prefect(*args, timeout=300):
            r = subprocess.run([str(BIN / "prefect"), *args], env=env, cwd=REPO, capture_output=True, text=True,
                               timeout=timeout)
            assert r.returncode == 0, f"prefect {' '.join(args)}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
            return r.stdout

        prefect("work-pool", "create", "vlmexp", "--type", "process")
        prefect("--no-prompt", "deploy", "--all")
        worker = subprocess.Popen([str(BIN / "prefect"), "worker", "start", "--pool", "vlmexp"], env=env, cwd=REPO,
                                  stdout=open(logs / "worker.log", "w"), stderr=subprocess.STDOUT)
        procs.append(worker)

        out = tmp_path / "run"
        params = {"config": "configs/demo.yaml", "overrides": [
            f"run.output_dir={out}", "data.demo.train=16", "data.demo.val=4", "sft.args.max_steps=2",
            "grpo.args.max_steps=1", "grpo.args.per_device_train_batch_size=4", "grpo.args.num_generations=4", "grpo.args.max_completion_length=8",
            "eval.max_new_tokens=8", *SMALL_BATCHES]}
        text = prefect("deployment", "run", "vlm-pipeline/manual", "--params", json.dumps(params), "--watch",
                       "--watch-timeout", "400", timeout=450)
        assert "Completed" in text, text[-2000:]
        assert (out / "export" / "model.safetensors").is_file()
        assert (out / "grpo" / "final").is_dir()

        import asyncio

        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName, FlowRunFilter
        from prefect.settings import PREFECT_API_URL, temporary_settings

        async def scheduled_runs():
            async with get_client() as client:
                for _ in range(60):  # the scheduler service fills the schedule shortly after deploy
                    runs = await client.read_flow_runs(
                        flow_run_filter=FlowRunFilter(), deployment_filter=DeploymentFilter(
                            name=DeploymentFilterName(any_=["scheduled-retrain"])))
                    if runs:
                        return runs
                    await asyncio.sleep(1)
                return []

        with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}):
            runs = asyncio.run(scheduled_runs())
        assert runs and all(r.state.name == "Scheduled" for r in runs)
        assert all(r.expected_start_time.weekday() == 0 for r in runs)  # "0 3 * * 1": Mondays
    finally:
        for proc in reversed(procs):
            _stop(proc)
    assert all(p.poll() is not None for p in procs)
