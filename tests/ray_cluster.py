"""A real 2-node Ray cluster on this machine for the Ray tests: two `ray start` processes (a head and a worker
node, one CPU and a custom resource each: node_a, node_b), its dashboard (Ray's state API) on 127.0.0.1.

`ray stop` would end every Ray process on the machine, anyone's: the cluster ends its own processes by PID,
those that appeared while each node started (Ray's daemons rename themselves, so their command lines do not
show the temp folder). A node can be killed (its processes) and started again, as a lost node and its
replacement."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

BIN = Path(sys.executable).parent
# Ray Client's server forks a server per client; grpcio's fork handlers crash it on this machine ("Check
# failed: next_worker->state == KICKED") unless fork support is off and gRPC polls with poll(2)
GRPC_ENV = {"GRPC_ENABLE_FORK_SUPPORT": "0", "GRPC_POLL_STRATEGY": "poll"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayTestCluster:
    """`cpus`: the CPUs each of node a and b declares. Ray starts at most that many of a node's worker
    processes at once (the raylet's maximum_startup_concurrency is min(CPUs declared, cores)), so with one
    CPU a node starts its worker processes one after the other. `grpc_env`: the nodes run with GRPC_ENV
    (Ray Client's server needs it here). `env`: more environment for the nodes (e.g. RAY_AUTH_MODE)."""

    def __init__(self, cpus: int = 1, grpc_env: bool = True, env: dict[str, str] | None = None):
        self.cpus, self.grpc_env, self.env = cpus, grpc_env, env or {}
        # Ray's socket paths must stay under 107 bytes: a short folder of its own under /tmp
        self.temp = Path(tempfile.mkdtemp(prefix="vr", dir="/tmp"))
        self.port, self.client_port, self.dashboard_port = free_port(), free_port(), free_port()
        self.pids: dict[str, set[int]] = {}

    @property
    def gcs(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def client(self) -> str:
        return f"ray://127.0.0.1:{self.client_port}"

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def _start(self, name: str, args: list[str], wrapper: tuple[str, ...] = (), cpus: int = 1) -> None:
        before = set(psutil.pids())
        # RAY_AUTH_MODE: Ray turns token authentication on for a `ray start --head` when ~/.ray/auth_token
        # exists (a local `ray.init()` writes it) and leaves it off for `ray start --address`, so node b would
        # be refused on a machine where Ray ran before; a mode the user set stays
        env = {"RAY_AUTH_MODE": "disabled", **os.environ, **(GRPC_ENV if self.grpc_env else {}),
               "RAY_USAGE_STATS_ENABLED": "0", **self.env}
        # the ports Ray would otherwise take at fixed defaults (the dashboard agent's 52365), which another
        # cluster on the machine may hold
        ports = [f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}"]
        r = subprocess.run([*wrapper, str(BIN / "ray"), "start", *args, *ports, "--node-ip-address=127.0.0.1",
                            f"--num-cpus={cpus}", "--disable-usage-stats"], env=env, capture_output=True,
                           text=True, timeout=120)
        time.sleep(2)  # the node's daemons (dashboard agent, runtime env agent) start after `ray start`
        self.pids[name] = {p.pid for p in self._ours(set(psutil.pids()) - before)}
        if r.returncode != 0:  # what it started before failing ends with it
            self.kill_node(name)
            raise RuntimeError(f"ray start {' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")

    def _ours(self, pids: set[int]) -> list[psutil.Process]:
        """Of the processes `pids`, those of this cluster: naming its temp folders (each node's daemons) or
        its GCS port (the Ray Client server), or a renamed Ray daemon (ray::...) whose parent is one of them;
        not what others started meanwhile (another cluster from the same venv included)."""
        procs = {}
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                procs[pid] = psutil.Process(pid)
        def named(p: psutil.Process) -> bool:
            with contextlib.suppress(psutil.Error):
                line = " ".join(p.cmdline())
                return str(self.temp) in line or f":{self.port} " in line + " "
            return False
        ours = {pid for pid, p in procs.items() if named(p)}
        for pid, p in procs.items():
            with contextlib.suppress(psutil.Error):
                if p.name().startswith("ray::") and p.ppid() in ours:
                    ours.add(pid)
        return [procs[pid] for pid in ours]

    def start_head(self) -> None:
        self._start("a", ["--head", f"--port={self.port}", f"--ray-client-server-port={self.client_port}",
                          f"--temp-dir={self.temp}", "--resources={\"node_a\": 1}",
                          "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                          f"--dashboard-port={self.dashboard_port}"], cpus=self.cpus)

    def start_node_b(self) -> None:
        # a temp folder of its own: each node's log monitor streams the logs in its folder to the drivers (in
        # one shared folder, both would send every worker line twice)
        self._start("b", [f"--address={self.gcs}", "--resources={\"node_b\": 1}", f"--temp-dir={self.temp}b"],
                    cpus=self.cpus)

    def start_blind_node(self, hidden: Path) -> None:
        """Node c: no CPU (no worker is placed there), in a mount namespace of its own where an empty tmpfs
        covers `hidden`, so it does not see what the other nodes see in that folder (a node without the
        shared mount). Needs root (mount)."""
        cover = f'mount -t tmpfs none "{hidden}" && exec "$0" "$@"'
        self._start("c", [f"--address={self.gcs}", "--resources={\"node_c\": 1}", f"--temp-dir={self.temp}c"],
                    ("unshare", "--mount", "--propagation", "private", "sh", "-c", cover), cpus=0)

    def kill_node(self, name: str) -> None:
        """End every process node `name` started (SIGKILL: a node lost, not shut down)."""
        procs = []
        for pid in self.pids.pop(name, set()):
            with contextlib.suppress(psutil.NoSuchProcess):
                procs.append(psutil.Process(pid))
                procs.extend(procs[-1].children(recursive=True))
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(procs, timeout=30)

    def processes(self, *names: str) -> list[psutil.Process]:
        """Ray processes on this machine whose name or command line contains one of `names`."""
        found = []
        for p in psutil.process_iter(["name", "cmdline"]):
            text = " ".join([p.info["name"] or "", *(p.info["cmdline"] or [])])
            if any(n in text for n in names):
                found.append(p)
        return found

    def stop(self) -> None:
        for name in ("c", "b", "a"):
            self.kill_node(name)
        for suffix in ("", "b", "c"):  # the nodes' temp folders (logs, sockets) go with them
            shutil.rmtree(f"{self.temp}{suffix}", ignore_errors=True)


@contextlib.contextmanager
def ray_test_cluster(cpus: int = 1, grpc_env: bool = True):
    """`grpc_env`: the nodes run with GRPC_ENV, which Ray Client's server needs here and which costs every
    worker's training steps (bench/RESULTS.md, "Ray against torchrun")."""
    cluster = RayTestCluster(cpus, grpc_env)
    try:
        cluster.start_head()
        cluster.start_node_b()
        yield cluster
    finally:
        cluster.stop()


if __name__ == "__main__":  # a cluster by hand: prints its addresses, ends its processes on Enter
    with ray_test_cluster() as c:
        print(c.gcs, c.client, c.dashboard, flush=True)
        sys.stdin.readline()
