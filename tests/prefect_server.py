"""A real Prefect server on a free loopback port, the `prefect` CLI against it, and workers (for the
deployment tests)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# The server's loop services that no test here exercises (late runs, paused runs' timeouts, cancelled
# parents' children, concurrency leases, workers' and pools' status): off, so a server that lives through a
# long test does not keep querying its database for them on a shared CPU. The scheduler, the triggers and
# actions, and the event and task-run recorders stay on.
UNUSED_SERVICES = ("LATE_RUNS", "PAUSE_EXPIRATIONS", "CANCELLATION_CLEANUP", "REPOSSESSOR", "FOREMAN")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, seconds: float = 60) -> None:
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


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # the worker stops on SIGINT, not promptly on SIGTERM
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Server:
    """A running server: `env` points the CLI and clients at it; `cli` runs `prefect ...` in the repository;
    `worker` starts a worker on a pool (stopped with the server)."""

    def __init__(self, tmp_path: Path, home: Path):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}/api"
        self.env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": self.url,
                    "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_SERVER_UI_ENABLED": "false",
                    "PREFECT_LOCAL_STORAGE_PATH": str(tmp_path / "results"),
                    **{f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false" for name in UNUSED_SERVICES}}
        self.logs = tmp_path / "logs"
        self.logs.mkdir(exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self._start("server", ["server", "start", "--host", "127.0.0.1", "--port", str(port)])
        # half a minute on an idle 2-core machine; more than a minute with three test processes and their
        # training processes on it
        wait_http(f"http://127.0.0.1:{port}/api/health", 240)

    def _start(self, log: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        proc = subprocess.Popen([str(BIN / "prefect"), *args], env=env or self.env, cwd=REPO,
                                stdout=open(self.logs / f"{log}.log", "w"), stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def cli(self, *args: str, timeout: float = 300) -> str:
        r = subprocess.run([str(BIN / "prefect"), *args], env=self.env, cwd=REPO, capture_output=True,
                           text=True, timeout=timeout)
        assert r.returncode == 0, f"prefect {' '.join(args)}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return r.stdout

    def worker(self, pool: str, *args: str, query_seconds: float = 1) -> subprocess.Popen:
        """A worker on `pool` (with `prefect worker start` options `args`) that asks for scheduled runs
        every `query_seconds` (Prefect's default: every 10 s, which a test whose pipeline sends seven stage
        runs to a pool would spend waiting; each ask costs the worker and the server CPU time)."""
        return self._start(f"worker-{pool}", ["worker", "start", "--pool", pool, *args],
                           {**self.env, "PREFECT_WORKER_QUERY_SECONDS": str(query_seconds)})

    def run_pipeline(self, params: dict, log: Path, deployment: str = "manual") -> subprocess.Popen:
        """`prefect deployment run vlm-pipeline/<deployment> --watch` with `params` (its output in `log`),
        once the server has created the pipeline's run."""
        name = f"vlm-pipeline/{deployment}"
        watch = subprocess.Popen([str(BIN / "prefect"), "deployment", "run", name,
                                  "--params", json.dumps(params), "--watch", "--watch-timeout", "1500"],
                                 env=self.env, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        wait_for_pipeline_run(self.url, watch, deployment=deployment)
        return watch

    def close(self) -> None:
        for proc in reversed(self.procs):
            stop(proc)
        assert all(p.poll() is not None for p in self.procs)


@contextlib.contextmanager
def prefect_server(tmp_path: Path, home: Path) -> Iterator[Server]:
    """A server in `tmp_path` on the database in `home` (PREFECT_HOME: conftest's `prefect_home`, a copy of a
    created database)."""
    server = Server(tmp_path, home)
    try:
        yield server
    finally:
        server.close()


def create_pools_and_deploy(server: Server) -> None:
    """The pools prefect.yaml names, then `prefect --no-prompt deploy --all`. The pools are what `prefect
    work-pool create NAME --type process` and `... gpu-k8s --type kubernetes --base-job-template
    deploy/k8s-gpu-base-job-template.json` create (the process worker's default job template; the
    repository's Kubernetes template, which the server validates), sent through the API from this process
    instead of three CLI processes that each import Prefect."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.workers.process import ProcessWorker

    k8s = json.loads((REPO / "deploy" / "k8s-gpu-base-job-template.json").read_text())
    pools = [WorkPoolCreate(name=name, type="process",
                            base_job_template=ProcessWorker.get_default_base_job_template())
             for name in ("cpu", "gpu")]
    with temporary_settings({PREFECT_API_URL: server.url}), get_client(sync_client=True) as client:
        for pool in [*pools, WorkPoolCreate(name="gpu-k8s", type="kubernetes", base_job_template=k8s)]:
            client.create_work_pool(pool)
    server.cli("--no-prompt", "deploy", "--all")


def wait_for_pipeline_run(url: str, watch: subprocess.Popen, seconds: float = 300,
                          deployment: str = "manual") -> None:
    """Until `prefect deployment run` has created the pipeline's run (a `--run-once` worker started before
    that would find nothing to submit)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deadline = time.monotonic() + seconds
    with temporary_settings({PREFECT_API_URL: url}), get_client(sync_client=True) as client:
        while not client.read_flow_runs(deployment_filter=DeploymentFilter(
                name=DeploymentFilterName(any_=[deployment]))):
            assert watch.poll() is None and time.monotonic() < deadline, "the pipeline's run was not created"
            time.sleep(0.5)
