"""A running Ray cluster as `launch.launcher: ray` needs it, checked before any work: Ray installed, the
address answering, the resources the workers ask for present in the cluster as a whole, and the output folder
seen by every node (each node looks for a marker this machine wrote). Also what of a run is left on the
cluster after it ended (its actors and placement groups), read from Ray's state.

Ray is imported inside the functions: it is an extra (`pip install 'vlmexp[ray]'`). `vlmexp validate` runs
the checks that need a connection in a child process (`python -m vlmexp.ray_cluster`), so that the command
itself never becomes a Ray driver; the stage's driver (vlmexp.ray_launch) runs them on its own connection.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vlmexp.config.schema import Config, RayLaunchConfig

RAY_EXTRA = "pip install 'vlmexp[ray]'"
START_A_CLUSTER = ("start one with `ray start --head --port=6379` on the head node and `ray start "
                   "--address=HEAD:6379` on each other node (docs/training.md, 'Ray'), or fix "
                   "launch.ray.address")
MARKER_PREFIX = ".vlmexp-ray-marker-"


def ray_missing() -> str | None:
    """Why Ray cannot be used here (not installed, with the extra to install), or None."""
    try:
        import ray.util.state  # noqa: F401
    except ImportError as e:
        return f"launcher 'ray' needs Ray, which is not installed here ({e}): {RAY_EXTRA}"
    return None


def cluster_address(ray_cfg: RayLaunchConfig) -> tuple[str, str] | str:
    """(the address, where it came from) by Ray's convention (ray.init(), `ray job submit`):
    launch.ray.address, else RAY_ADDRESS, else `auto` where this node belongs to a cluster (the GCS address
    `ray start` left in Ray's temp folder); else why there is none, naming both and how to start a cluster."""
    import os

    if ray_cfg.address:
        return ray_cfg.address, "launch.ray.address"
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    if this_node_cluster() is not None:
        return "auto", "auto"
    return ("no Ray cluster to run on: launch.ray.address is not set, RAY_ADDRESS is not set, and this node "
            "belongs to no cluster (auto finds none): set launch.ray.address or RAY_ADDRESS (as `ray job "
            f"submit` reads it) to the cluster's address, or {START_A_CLUSTER}")


def this_node_cluster() -> str | None:
    """The GCS address of the cluster this node joined (`ray start`), as Ray's `auto` finds it, or None."""
    try:
        from ray._private.services import find_bootstrap_address  # Ray's own lookup behind `auto`

        return find_bootstrap_address(None) or None
    except Exception:  # noqa: BLE001 - Ray's private lookup changed or failed: no cluster found
        return None


def with_address(ray_cfg: RayLaunchConfig) -> tuple[RayLaunchConfig, str] | str:
    """`ray_cfg` with the address Ray's convention gives (`cluster_address`) and where it came from, or why
    there is none."""
    found = cluster_address(ray_cfg)
    if isinstance(found, str):
        return found
    return ray_cfg.model_copy(update={"address": found[0]}), found[1]


def host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of `address` (ray://HOST:PORT or HOST:PORT); None for `auto` (this node's cluster)."""
    if address == "auto":
        return None
    host, _, port = address.removeprefix("ray://").rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


def address_problem(address: str, timeout: float = 5.0) -> str | None:
    """None when something answers at `address`; else what is wrong and how to start a cluster."""
    if address == "auto":
        return None
    if address.startswith(("http://", "https://")):
        return (f"{address!r} is the dashboard's address, which `ray job submit` takes; a driver connects "
                "with ray://HEAD:10001 (Ray Client) or HEAD:6379 (the GCS address): set launch.ray.address "
                "to one of them")
    where = host_port(address)
    if where is None:
        return (f"{address!r} is not a Ray address: write ray://HEAD:10001 (Ray Client), HEAD:6379 (the "
                "head's GCS port, from a node of the cluster) or auto")
    try:
        socket.create_connection(where, timeout=timeout).close()
    except OSError as e:
        return f"no Ray cluster answers at {address} ({e.strerror or e}): {START_A_CLUSTER}"
    return None


def resource_problems(ray_cfg: RayLaunchConfig, totals: Mapping[str, float], alive_nodes: int) -> list[str]:
    """What the workers ask for in all beyond what the cluster has in all (`totals`:
    ray.cluster_resources())."""
    n = ray_cfg.num_workers
    asks = {"GPU": ray_cfg.gpus_per_worker, "CPU": ray_cfg.cpus_per_worker, **ray_cfg.resources_per_worker}
    out = [f"{n} workers x {each:g} {name} ask for {n * each:g} {name} in all, and the cluster at "
           f"{ray_cfg.address} has {totals.get(name, 0):g}: lower launch.ray.num_workers or the per-worker "
           "ask, or add nodes that have it"
           for name, each in asks.items() if each and n * each > totals.get(name, 0) + 1e-9]
    if ray_cfg.placement_strategy == "STRICT_SPREAD" and n > alive_nodes:
        out.append(f"placement_strategy STRICT_SPREAD puts each of the {n} workers on a node of its own, and "
                   f"the cluster at {ray_cfg.address} has {alive_nodes} nodes: lower launch.ray.num_workers, "
                   "add nodes, or use SPREAD")
    return out


def write_marker(folder: Path) -> Path:
    """A marker file in `folder` (created if missing) for the nodes to look for."""
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / f"{MARKER_PREFIX}{uuid.uuid4().hex}"
    marker.write_text("written by vlmexp's Ray driver: every node that runs a worker must see this file\n")
    return marker


def unseen_marker(marker: str, node: str, host: str) -> str | None:
    """On a node: None when it sees `marker`; else the problem, naming the node and the path."""
    if Path(marker).is_file():
        return None
    return (f"node {node} ({host}) does not see {marker}, which the driver wrote into run.output_dir "
            f"{Path(marker).parent}: the workers write checkpoints there and later stages read them; mount "
            "the same shared folder at the same path on every node, or set run.output_dir to a path they "
            "share")


def folder_problems(folder: Path) -> list[str]:
    """Every alive node looks for a marker written into `folder` (needs a connection: ray.init)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0, max_retries=0)
    def look(path: str, node: str) -> str | None:
        return unseen_marker(path, node, socket.gethostname())

    marker = write_marker(folder)
    try:
        refs = [look.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                .remote(str(marker), n["NodeID"][:12]) for n in ray.nodes() if n["Alive"]]
        return [p for p in ray.get(refs, timeout=300) if p]
    finally:
        marker.unlink(missing_ok=True)


def connected_problems(ray_cfg: RayLaunchConfig, folder: Path | None) -> list[str]:
    """Resources and the shared folder (None: not checked), on this process's connection to the cluster."""
    import ray

    alive = sum(1 for n in ray.nodes() if n["Alive"])
    problems = resource_problems(ray_cfg, ray.cluster_resources(), alive)
    if folder is not None and not problems:
        problems += folder_problems(folder)
    return problems


def connect(ray_cfg: RayLaunchConfig) -> str | None:
    """This process as a driver of the cluster at launch.ray.address (with its runtime environment): None, or
    why the cluster refused it."""
    import logging

    import ray

    try:
        ray.init(address=ray_cfg.address, runtime_env=ray_cfg.runtime_env, log_to_driver=True,
                 logging_level=logging.WARNING, configure_logging=False)
    except (ConnectionError, RuntimeError, ray.exceptions.AuthenticationError) as e:
        chain = [e]  # ray.init wraps the GCS client's AuthenticationError (in its text) in two more errors
        while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
            chain.append(chain[-1].__cause__ or chain[-1].__context__)
        if not any(isinstance(c, ray.exceptions.AuthenticationError) or "InvalidAuthToken" in str(c)
                   for c in chain):
            raise
        return (f"the cluster at {ray_cfg.address} refused this machine's connection: it uses Ray's token "
                "authentication, and this machine has no token or not the cluster's (InvalidAuthToken): give "
                "this machine the cluster's token (RAY_AUTH_MODE=token with "
                "RAY_AUTH_TOKEN, or RAY_AUTH_TOKEN_PATH, or the head's ~/.ray/auth_token copied here)")
    return None


def check_ray_launch(cfg: Config) -> list[tuple[tuple[str, ...], Any, str]]:
    """`launch.launcher: ray`, checked from a command that is not itself a driver: installed, answering,
    then resources and the shared output folder from a child process that connects. (loc, value, problem)."""
    if cfg.launch.ray is None:
        return []
    if msg := ray_missing():
        return [(("launch", "launcher"), "ray", msg)]
    found = with_address(cfg.launch.ray)
    if isinstance(found, str):
        return [(("launch", "ray", "address"), None, found)]
    ray_cfg, _ = found
    if msg := address_problem(ray_cfg.address):
        return [(("launch", "ray", "address"), ray_cfg.address, msg)]
    folder = Path(cfg.run.output_dir)
    child = subprocess.run([sys.executable, "-m", "vlmexp.ray_cluster", ray_cfg.model_dump_json(),
                            str(folder) if folder.is_dir() else ""], capture_output=True, text=True,
                           timeout=600)
    if child.returncode != 0:
        return [(("launch", "ray", "address"), ray_cfg.address,
                 f"connecting to the Ray cluster failed: {child.stderr.strip()[-1500:]}")]
    return [(("launch", "ray"), ray_cfg.address, p) for p in json.loads(child.stdout.splitlines()[-1])]


if __name__ == "__main__":  # the child process of check_ray_launch: the problems as a JSON list
    _cfg = RayLaunchConfig.model_validate_json(sys.argv[1])
    _refused = connect(_cfg)
    _folder = Path(sys.argv[2]) if sys.argv[2] else None
    print(json.dumps([_refused] if _refused else connected_problems(_cfg, _folder)))


def ray_dir(cfg: Config, stage: str) -> Path:
    """<output_dir>/ray/<stage>: the Ray run's files (beside the stage folder, which the stage owns)."""
    return Path(cfg.run.output_dir) / "ray" / stage


def run_tags(folder: Path) -> dict[str, str]:
    """The stage run's MLflow tags from a Ray run's files in `folder` (ray_dir): the cluster, Ray's job id and
    run name, the node count, each worker's node and resources. What is not written yet is left out."""
    tags: dict[str, str] = {}
    with contextlib.suppress(OSError, ValueError):
        run = json.loads((folder / "run.json").read_text())
        tags |= {"ray.cluster": run["address"], "ray.job_id": run["job_id"], "ray.run_name": run["run_name"],
                 "ray.cluster_nodes": str(run["nodes"])}
        tags |= {f"ray.{k}": run[k] for k in ("address_from", "gcs_address") if run.get(k)}
    with contextlib.suppress(OSError, ValueError):
        workers = json.loads((folder / "workers.json").read_text())
        tags["ray.nodes"] = str(len({w["node_id"] for w in workers}))
        for w in workers:
            held = ", ".join(f"{v:g} {k}" for k, v in sorted(w["resources"].items()))
            tags[f"ray.worker.{w['rank']}"] = f"node {w['node_id']} ({w['host']}, {w['node_ip']}): {held}"
    return tags
