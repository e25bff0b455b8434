"""Prefect's temporary server for `vlmexp run` without a PREFECT_API_URL, started in a session of its own.

Prefect starts its temporary server in the caller's process group, so a terminal's Ctrl-C, which reaches the
whole foreground group, ends the server at once: the pipeline can then no longer record its flow run as
Cancelled, and Prefect's events and log clients retry the dead server at exit for many seconds while the
command ignores further signals. Started here, in a session of its own, the server outlives the Ctrl-C long
enough for the pipeline to record the stop, send its last events and logs, and then stop the server itself.
The command line is Prefect's own (`prefect.server.api.server.SubprocessASGIServer`). Out of the process
group, a kill of the group would no longer reach the server: on Linux it asks the kernel for SIGTERM when
`vlmexp run` goes, however it goes (SIGKILL, the OOM killer).

The server's first start on a machine creates Prefect's database by running every one of Prefect's migrations:
half a minute on an idle 2-core machine, more than Prefect's 20 s start-up timeout. A start that creates the
database waits at least FIRST_START_TIMEOUT_S, and says why it takes long. Later starts took 19-26 s on the
same idle machine where Python caches no bytecode (PYTHONDONTWRITEBYTECODE, as CI machines set it), 12 s
where it does: unless PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS is set, a start waits START_TIMEOUT_S,
not 20 s.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

FIRST_START_TIMEOUT_S = 180.0
START_TIMEOUT_S = 90.0


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(port: int) -> subprocess.Popen:
    import prefect
    from prefect.settings import get_current_settings

    from vlmexp.pipeline.processes import tied_to_this_process

    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
           "PREFECT__SERVER_FINAL": "1",
           **get_current_settings().to_environment_variables(exclude_unset=True)}
    # uvicorn gets SIGTERM when `vlmexp run` ends, however it ends (PR_SET_PDEATHSIG), as a stage does
    return subprocess.Popen(
        tied_to_this_process([sys.executable, "-m", "uvicorn", "--app-dir",
                              str(prefect.__module_path__.parent), "--factory",
                              "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port",
                              str(port), "--log-level", "error", "--lifespan", "on"]),
        env=env, start_new_session=True)


def new_database() -> Path | None:
    """The SQLite file the server is about to create (Prefect's database on this machine does not exist
    yet), or None: it exists, or the database is not a SQLite file (a PostgreSQL server, in memory)."""
    from prefect.settings import get_current_settings

    url = get_current_settings().server.database.connection_url.get_secret_value()
    scheme, _, path = url.partition(":///")
    if not scheme.startswith("sqlite") or not path or path.startswith(":memory:"):
        return None
    path = Path(path.split("?")[0])
    return None if path.is_file() and path.stat().st_size > 0 else path


def start_timeout(creates_database: bool) -> float:
    """Seconds to wait for the server to answer: PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS where it is
    set, START_TIMEOUT_S otherwise; at least FIRST_START_TIMEOUT_S for a start that creates the database."""
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS as STARTUP_TIMEOUT
    from prefect.settings import get_current_settings

    given = get_current_settings().to_environment_variables(exclude_unset=True)
    timeout = (float(STARTUP_TIMEOUT.value()) if "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" in given
               else START_TIMEOUT_S)
    return max(timeout, FIRST_START_TIMEOUT_S) if creates_database else timeout


def _wait_healthy(server: subprocess.Popen, url: str, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    with httpx.Client() as client:
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise RuntimeError(f"Prefect's temporary server exited with code {server.returncode} "
                                   "on start")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/health").status_code == 200:
                    return
            time.sleep(0.1)
    raise RuntimeError(f"Prefect's temporary server at {url} did not answer within {timeout:.0f} s (a busy "
                       f"or slow machine); raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, or start "
                       f"a server with `prefect server start` and set PREFECT_API_URL")


def _stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=5)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def drain_prefect_clients(timeout: float = 10.0) -> None:
    """Send the flow's last logs and events (Prefect's log and events workers) while the server is up."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogHandler, APILogWorker

    APILogHandler().flush()
    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=timeout, at_exit=False)


@contextlib.contextmanager
def temporary_server() -> Iterator[None]:
    """Prefect's API for the duration: the configured one (PREFECT_API_URL), or else a temporary server in a
    session of its own, stopped (after the last logs and events are sent) when the block ends."""
    from prefect.logging import get_logger
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if PREFECT_API_URL.value():
        yield
        return

    log = get_logger()  # Prefect's own lines, as its temporary server logs them (bench/pipeline_overhead.py)
    port = _free_port()
    address = f"http://127.0.0.1:{port}"
    created = new_database()
    timeout = start_timeout(created is not None)
    if created:
        # Prefect makes PREFECT_HOME, not the folders above it: a PREFECT_HOME under a new folder (a CI
        # cache, a fresh volume) failed its start with "unable to open database file"
        created.parent.mkdir(parents=True, exist_ok=True)
        log.info("Creating Prefect's database %s: its first start runs Prefect's migrations (about half a "
                 "minute, once per machine)", created)
    log.info("Starting temporary server on %s", address)
    server = _start(port)
    try:
        _wait_healthy(server, f"{address}/api", timeout)
        with temporary_settings({PREFECT_API_URL: f"{address}/api"}):
            try:
                yield
            finally:
                drain_prefect_clients()
    finally:
        log.info("Stopping temporary server on %s", address)
        _stop(server)
