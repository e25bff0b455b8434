"""A real Prefect server on a free loopback port, the `prefect` CLI against it, and workers (for the
deployment tests)."""

from __future__ import annotations

import contextlib
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
                    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                    "PREFECT_LOCAL_STORAGE_PATH": str(tmp_path / "results")}
        self.logs = tmp_path / "logs"
        self.logs.mkdir(exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self._start("server", ["server", "start", "--host", "127.0.0.1", "--port", str(port)])
        wait_http(f"http://127.0.0.1:{port}/api/health")

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

    def worker(self, pool: str, **env: str) -> subprocess.Popen:
        """A worker that asks for scheduled runs every second (Prefect's default: every 10 s, which a test
        whose pipeline sends seven stage runs to a pool would spend waiting)."""
        return self._start(f"worker-{pool}", ["worker", "start", "--pool", pool],
                           {**self.env, "PREFECT_WORKER_QUERY_SECONDS": "1", **env})

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
    """The pools prefect.yaml names (the Kubernetes one from the repository's base job template), then
    `prefect deploy --all`."""
    server.cli("work-pool", "create", "cpu", "--type", "process")
    server.cli("work-pool", "create", "gpu", "--type", "process")
    server.cli("work-pool", "create", "gpu-k8s", "--type", "kubernetes", "--base-job-template",
               str(REPO / "deploy" / "k8s-gpu-base-job-template.json"))
    server.cli("--no-prompt", "deploy", "--all")
