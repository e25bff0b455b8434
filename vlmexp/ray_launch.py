"""`launch.launcher: ray`: a training stage as Ray actors on a running cluster; this is its driver.

`python -m vlmexp.ray_launch train STAGE --config C --in-process ...` (what vlmexp.launch.stage_command gives)
connects to launch.ray.address, checks the cluster (the resources asked for; every node sees the output
folder), reserves one placement-group bundle per worker (launch.ray's resources and strategy) and starts one
actor in each. Every actor calls `vlmexp.cli.main` with these same arguments, the function each torchrun rank
runs, with the environment torchrun gives its ranks (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
NODE_RANK, MASTER_ADDR and MASTER_PORT of rank 0's node; CUDA_VISIBLE_DEVICES: the GPUs of every worker on
the node, as torchrun's ranks see them); accelerate and TRL set up the process group from it. This is how
verl and OpenRLHF place their workers (a placement group and plain actors), without Ray Train's controller
and helper actors, whose start-up cost 20 s of a CPU stage's first step here (bench/RESULTS.md).

A worker group that fails (a worker's stage failed, a worker or its node lost) is ended, actors and placement
group, and started again up to launch.ray.max_failures times, once the cluster has the resources again; each
start runs the stage again, which resumes from its newest complete checkpoint in the shared output folder.

The workers' output comes back here through Ray's log streaming, each line prefixed with the worker's rank
and node, so the pipeline's task log shows them. <output_dir>/ray/<stage>/ holds run.json (the cluster, Ray's
job id and the run's name) and workers.json (each rank's node and resources).

A stop (Ctrl-C, SIGTERM, SIGHUP) ends the workers and the placement group, waits until they are gone from
the cluster and exits 128 + the signal. Otherwise the exit code is the stage's: 0, 1 (failed) or 2 (refused
before any work).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmexp.config.schema import RayLaunchConfig

# seconds a stopped run's actors and placement groups have to leave the cluster (the pipeline kills a stage's
# driver STOP_GRACE = 15 s after passing a stop on)
LEFTOVER_WAIT = 12.0
# how often the driver looks at its workers and at a stop signal, and says it still waits for resources
POLL_SECONDS = 0.5
WAITING_SAY_EVERY = 30.0
# what `vlmexp.cli.main` returns for a stage refused before any work: no restart runs it again
REFUSED = 2


def main(argv: list[str]) -> int:
    """Drive one stage on the cluster; `argv`: the `vlmexp train STAGE ...` arguments each worker runs."""
    from vlmexp.checks.loader import load_config
    from vlmexp.cli import build_parser
    from vlmexp.errors import VlmexpError
    from vlmexp.ray_cluster import (
        address_problem,
        connect,
        connected_problems,
        ray_dir,
        ray_missing,
        with_address,
        write_marker,
    )

    args, extra = build_parser().parse_known_args(argv)
    try:
        cfg = load_config(args.config, [*args.overrides, *extra], check_paths=False, check_trl=False)
    except VlmexpError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    assert cfg.launch.ray is not None  # the schema gives launcher ray its defaults
    if missing := ray_missing():
        print(f"error: launch.ray: {missing}", file=sys.stderr)
        return 2
    found = with_address(cfg.launch.ray)
    if isinstance(found, str):
        print(f"error: launch.ray.address: {found}", file=sys.stderr)
        return 2
    ray_cfg, address_from = found
    if problem := address_problem(ray_cfg.address):
        print(f"error: launch.ray: {problem}", file=sys.stderr)
        return 2
    if refused := connect(ray_cfg):
        print(f"error: launch.ray.address: {refused}", file=sys.stderr)
        return 2
    folder = ray_dir(cfg, args.stage)
    if problems := connected_problems(ray_cfg, Path(cfg.run.output_dir)):
        print("error: launch.ray:\n  - " + "\n  - ".join(problems), file=sys.stderr)
        return 2
    import ray

    name = f"{cfg.run.name}-{args.stage}-{time.strftime('%Y%m%d-%H%M%S')}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "workers.json").unlink(missing_ok=True)  # an earlier run's: this run's are written once placed
    run = {"address": ray_cfg.address, "address_from": address_from,
           "gcs_address": ray.get_runtime_context().gcs_address,
           "job_id": ray.get_runtime_context().get_job_id(), "run_name": name,
           "nodes": sum(1 for n in ray.nodes() if n["Alive"])}
    (folder / "run.json").write_text(json.dumps(run, indent=1) + "\n")
    marker = write_marker(Path(cfg.run.output_dir))
    work = {"argv": list(argv), "cwd": os.getcwd(), "marker": str(marker),
            "chdir": not (ray_cfg.runtime_env or {}).get("working_dir")}
    print(f"Ray job {run['job_id']} on {ray_cfg.address}: {args.stage} as run {name}, "
          f"{ray_cfg.num_workers} workers", flush=True)
    stops: list[int] = []

    def stop(signum, frame) -> None:
        stops.append(signum)
        os.write(2, f"stopping the Ray run ({signal.Signals(signum).name})\n".encode())

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
                if s != signal.SIGHUP or signal.getsignal(s) is not signal.SIG_IGN}
    try:
        code = _drive(ray_cfg, work, folder, stops)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        marker.unlink(missing_ok=True)
    if stops:
        left = wait_until_gone(run["job_id"])
        print(f"stopped: the Ray run {'left ' + ', '.join(left) if left else 'left nothing'} on the cluster",
              file=sys.stderr, flush=True)
        return 128 + stops[0]
    return code


def _drive(ray_cfg: RayLaunchConfig, work: dict[str, Any], folder: Path, stops: list[int]) -> int:
    """Start the worker group until the stage ends, restarting it after a failure up to max_failures times:
    the stage's exit code (anything once a stop signal came)."""
    starts = 0
    while True:
        starts += 1
        group = WorkerGroup(ray_cfg)
        try:
            failure = group.run(work, folder, stops)
        finally:
            group.end()
        if stops or failure is None:
            return 0
        if failure.refused:
            print(f"error: the Ray run's stage was refused: {failure.what}", file=sys.stderr, flush=True)
            return REFUSED
        if starts > ray_cfg.max_failures:
            print(f"error: the Ray run failed: {failure.what} (worker group start {starts}; "
                  f"launch.ray.max_failures {ray_cfg.max_failures})", file=sys.stderr, flush=True)
            return 1
        print(f"the Ray run's worker group failed: {failure.what}; starting it again (restart {starts} of "
              f"launch.ray.max_failures {ray_cfg.max_failures}): the stage resumes from its newest complete "
              "checkpoint", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Failure:
    """What ended a worker group: said in one line; `refused`: the stage refused before any work."""

    what: str
    refused: bool = False


class WorkerGroup:
    """One start of the stage's workers: a placement group of launch.ray.num_workers bundles and one actor
    (`StageWorker`) in each."""

    def __init__(self, ray_cfg: RayLaunchConfig):
        from ray.util.placement_group import placement_group

        self.cfg = ray_cfg
        self.bundle = {k: v for k, v in {"CPU": ray_cfg.cpus_per_worker, "GPU": ray_cfg.gpus_per_worker,
                                         **ray_cfg.resources_per_worker}.items() if v}
        self.pg = placement_group([self.bundle] * ray_cfg.num_workers, strategy=ray_cfg.placement_strategy)
        self.actors: list[Any] = []

    def run(self, work: dict[str, Any], folder: Path, stops: list[int]) -> Failure | None:
        """The stage on this group to its end: None when every worker's stage returned 0 (or a stop signal
        came), else what failed."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not self._resources_ready(stops):
            return None
        worker = ray.remote(StageWorker)
        self.actors = [worker.options(
            num_cpus=self.cfg.cpus_per_worker, num_gpus=self.cfg.gpus_per_worker,
            resources=self.cfg.resources_per_worker, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
        ).remote() for i in range(self.cfg.num_workers)]
        places = self._gather([a.place.remote(work["marker"]) for a in self.actors], stops, "starting")
        if not isinstance(places, list):
            return places
        if seen := [p["problem"] for p in places if p["problem"]]:
            return Failure("; ".join(seen), refused=True)
        envs, ranks = rank_environments(places)
        _write_workers(folder, places, ranks)
        names = [f"rank {r} on node {p['node_id'][:12]} ({p['host']})"
                 for p, r in zip(places, ranks, strict=True)]
        codes = self._gather([a.run.remote(work, env) for a, env in zip(self.actors, envs, strict=True)],
                             stops, "running", names)
        return codes if not isinstance(codes, list) else None

    def _resources_ready(self, stops: list[int]) -> bool:
        """Wait until the cluster reserved every bundle (a lost node's replacement, say), saying so every
        WAITING_SAY_EVERY s; False when a stop signal came first."""
        import ray

        ready, said = self.pg.ready(), time.monotonic()
        while not stops:
            if ray.wait([ready], timeout=POLL_SECONDS)[0]:
                return True
            if time.monotonic() - said > WAITING_SAY_EVERY:
                print(f"waiting for the cluster to have {self.cfg.num_workers} x {self.bundle} "
                      f"({self.cfg.placement_strategy})", file=sys.stderr, flush=True)
                said = time.monotonic()
        return False

    def _gather(self, refs: list, stops: list[int], doing: str,
                names: list[str] | None = None) -> list | Failure | None:
        """Every ref's value in order, or a Failure as soon as one worker is lost, raises or (`names` given:
        its stage's run) returns an exit code other than 0 (the others are then ended with the group); None
        when a stop signal came first."""
        import ray

        pending, values = list(refs), {}
        while pending and not stops:
            done, pending = ray.wait(pending, num_returns=1, timeout=POLL_SECONDS)
            for ref in done:
                i = refs.index(ref)
                who = names[i] if names else f"worker {i}"
                try:
                    values[i] = ray.get(ref)
                except ray.exceptions.RayError as e:
                    return Failure(f"{who} {_what_went_wrong(e)} while {doing}")
                if names and values[i] != 0:
                    return Failure(f"{who}: vlmexp train exited with code {values[i]}",
                                   refused=values[i] == REFUSED)
        return None if stops else [values[i] for i in range(len(refs))]

    def end(self) -> None:
        """End the actors and remove the placement group (they leave the cluster within a second or two)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        remove_placement_group(self.pg)


def _what_went_wrong(e: Exception) -> str:
    """`e` (from a worker's call) in one line: the worker lost, or the exception its call raised."""
    import ray

    if isinstance(e, ray.exceptions.RayActorError):
        return f"was lost ({' '.join(str(e).split())[:300]})"
    cause = getattr(e, "cause", None)  # a RayTaskError's own exception
    text = f"{type(cause).__name__}: {cause}" if cause is not None else str(e)
    return f"raised {' '.join(text.split())[:300]}"


def rank_environments(places: list[dict]) -> tuple[list[dict[str, str]], list[int]]:
    """Each worker's torch.distributed environment as torchrun gives its ranks, and each worker's rank: ranks
    node by node (nodes in the order of their first bundle), by GPU within a node; rank 0's node serves the
    rendezvous at the port its worker found free. On a node with GPUs, CUDA_VISIBLE_DEVICES lists every GPU
    of its workers (as on a torchrun node, so NCCL sees its peers) and ACCELERATE_TORCH_DEVICE names the
    worker's own among them, which accelerate (so TRL) trains on: LOCAL_RANK alone would pick another GPU
    where workers share one (gpus_per_worker below 1)."""
    nodes: dict[str, int] = {}
    for p in places:
        nodes.setdefault(p["node_id"], len(nodes))
    order = sorted(range(len(places)), key=lambda i: (nodes[places[i]["node_id"]], places[i]["gpu_ids"], i))
    ranks = [order.index(i) for i in range(len(places))]
    master = places[order[0]]
    envs = []
    for i, p in enumerate(places):
        local = [j for j in order if places[j]["node_id"] == p["node_id"]]
        env = {"RANK": str(ranks[i]), "WORLD_SIZE": str(len(places)), "LOCAL_RANK": str(local.index(i)),
               "LOCAL_WORLD_SIZE": str(len(local)), "NODE_RANK": str(nodes[p["node_id"]]),
               "GROUP_RANK": str(nodes[p["node_id"]]), "MASTER_ADDR": master["node_ip"],
               "MASTER_PORT": str(master["port"])}
        gpus = list(dict.fromkeys(g for j in local for g in places[j]["gpu_ids"]))
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
            env["ACCELERATE_TORCH_DEVICE"] = f"cuda:{gpus.index(p['gpu_ids'][0])}"
        envs.append(env)
    return envs, ranks


def _write_workers(folder: Path, places: list[dict], ranks: list[int]) -> None:
    """<folder>/workers.json: every rank's node and resources (the pipeline tags the stage's MLflow run with
    them)."""
    workers = sorted(({"rank": r, "node_id": p["node_id"][:12], "host": p["host"], "node_ip": p["node_ip"],
                       "resources": p["resources"]} for p, r in zip(places, ranks, strict=True)),
                     key=lambda w: w["rank"])
    path = folder / "workers.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(workers, indent=1) + "\n")
    tmp.replace(path)


class StageWorker:
    """One worker (a Ray actor): where it runs, then the stage function torchrun's ranks run."""

    def place(self, marker: str) -> dict[str, Any]:
        """This worker's node, host, IP, GPUs and resources, a port free on its node (for rank 0's
        rendezvous), and whether this node sees the driver's marker in the output folder (None: it does)."""
        import ray

        from vlmexp.ray_cluster import unseen_marker

        context = ray.get_runtime_context()
        node, host = context.get_node_id(), socket.gethostname()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return {"node_id": node, "host": host, "node_ip": ray.util.get_node_ip_address(), "port": port,
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "resources": {k: v for k, v in context.get_assigned_resources().items()
                              if "_group_" not in k},
                "problem": unseen_marker(marker, node[:12], host)}

    def run(self, work: dict[str, Any], env: dict[str, str]) -> int:
        """`vlmexp.cli.main` with the stage's arguments in `env`, its output lines prefixed with the rank and
        node; its exit code."""
        import ray

        os.environ.update(env)
        if work["chdir"]:  # the driver's working folder, where the config's relative paths point
            os.chdir(work["cwd"])
        from vlmexp.cli import main

        node = ray.get_runtime_context().get_node_id()[:12]
        out, err = sys.stdout, sys.stderr
        prefix = f"[rank {env['RANK']} node {node} {socket.gethostname()}] "
        sys.stdout, sys.stderr = _Prefixed(out, prefix), _Prefixed(err, prefix)
        try:
            return main(work["argv"])
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            sys.stdout, sys.stderr = out, err


def wait_until_gone(job_id: str, wait: float = LEFTOVER_WAIT) -> list[str]:
    """Wait until job `job_id`'s actors and placement groups are gone from the cluster; what is left."""
    from ray.experimental.internal_kv import _internal_kv_get

    dashboard = _internal_kv_get("dashboard", namespace="dashboard")  # where the head serves the state API
    if not dashboard:
        return ["what could not be read: the cluster runs no dashboard (Ray's state API)"]
    left: list[str] = []
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        left = leftovers(job_id, f"http://{dashboard.decode()}")
        if not left:
            break
        time.sleep(0.5)
    return left


def leftovers(job_id: str, address: str) -> list[str]:
    """The actors and placement groups of job `job_id` still on the cluster, read through Ray's state API at
    `address` (the head's dashboard)."""
    from ray.util.state import list_actors, list_placement_groups

    actors = list_actors(address=address, filters=[("job_id", "=", job_id)], raise_on_missing_output=False)
    groups = list_placement_groups(address=address, detail=True, raise_on_missing_output=False)
    return ([f"actor {a.class_name} ({a.state})" for a in actors if a.state != "DEAD"]
            + [f"placement group {g.placement_group_id} ({g.state})" for g in groups
               if g.creator_job_id == job_id and g.state != "REMOVED"])


class _Prefixed:
    """A text stream that writes each line of what it is given to `stream` after `prefix`."""

    def __init__(self, stream, prefix: str):
        self.stream, self.prefix, self.at_line_start = stream, prefix, True

    def write(self, text: str) -> int:
        for i, piece in enumerate(text.split("\n")):  # a progress bar's \r redraws stay on their line
            if i:
                self.stream.write("\n")
                self.at_line_start = True
            if piece:
                self.stream.write((self.prefix if self.at_line_start else "") + piece)
                self.at_line_start = False
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


if __name__ == "__main__":
    from vlmexp.cli import exit_without_teardown

    exit_without_teardown(main(sys.argv[1:]))
