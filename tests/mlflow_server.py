"""A real `mlflow server` for tests: on 127.0.0.1, a sqlite store and an artifact folder under `folder`, in a
session of its own so that a test can kill it as a crash would (SIGKILL to its process group) and start it
again on the same port and store."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(folder: Path, port: int) -> subprocess.Popen:
    """Start the server and wait until it answers /health (2 processes, ~0.5 GB, without job execution)."""
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port",
                               str(port), "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
                               "--workers", "1", "--default-artifact-root", str(folder / "artifacts")],
                              env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return server
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                kill_server(server)
                raise RuntimeError(f"mlflow server on port {port} did not start") from None
            time.sleep(0.3)


def kill_server(server: subprocess.Popen) -> None:
    """SIGKILL the server's whole process group (its workers too), as a lost machine ends it."""
    try:
        os.killpg(server.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.wait()
