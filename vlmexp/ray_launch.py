"""`launch.launcher: ray`: a training stage as Ray Train workers on a running cluster; this is its driver.

`python -m vlmexp.ray_launch train STAGE --config C --in-process ...` (what vlmexp.launch.stage_command gives)
connects to launch.ray.address, checks the cluster (the resources asked for; every node sees the output
folder), then runs Ray Train's TorchTrainer: each worker calls `vlmexp.cli.main` with these same arguments,
the function each torchrun rank runs (Ray sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and the process
group; accelerate and TRL use them). Checkpoints are the stage's own, in the shared output folder: a worker
group that Ray restarts (launch.ray.max_failures) runs the stage again, which resumes from the newest complete
one.

The workers' output comes back here through Ray's log streaming, each line prefixed with the worker's rank
and node, so the pipeline's task log shows them. <output_dir>/ray/<stage>/ holds Ray Train's run folder,
run.json (the cluster, Ray's job id and run name) and workers.json (each rank's node and resources).

A stop (Ctrl-C, SIGTERM, SIGHUP) aborts the Ray run, then the driver waits until the run's actors and
placement groups are gone from the cluster and exits 128 + the signal; a second stop kills the run's
controller at once. Otherwise the exit code is the stage's: 0, 1 (failed) or 2 (refused before any work).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from vlmexp.config.schema import RayLaunchConfig

# seconds a stopped run's actors and placement groups have to leave the cluster (the pipeline kills a stage's
# driver STOP_GRACE = 15 s after passing a stop on)
LEFTOVER_WAIT = 12.0
# Ray Train's one actor per cluster, shared by every Train run (detached, named AutoscalingCoordinator,
# created by the first run on the cluster and reused by the later ones): the cluster's, not a run's
CLUSTER_SERVICES = ("_AutoscalingCoordinatorActor",)
# Ray Train's switches (read from the driver's environment and passed on to its controller and workers) that
# leave a worker's output and logging as torchrun's ranks have them. Otherwise Ray configures each worker's
# root logger (the stage's log format is lost) and patches `print` to send every printed line to it as well,
# also lines printed into a captured stdout: dill's disassembly of the functions that `datasets` hashes
# (dill.detect.nestedglobals reads `dis.dis` output that way) reached the stage's log
WORKER_OUTPUT_AS_TORCHRUN = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
                             "RAY_TRAIN_ENABLE_WORKER_STRUCTURED_LOGGING": "0"}


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
        write_marker,
    )

    args, extra = build_parser().parse_known_args(argv)
    try:
        cfg = load_config(args.config, [*args.overrides, *extra], check_paths=False, check_trl=False)
    except VlmexpError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ray_cfg = cfg.launch.ray
    assert ray_cfg is not None  # the schema refuses launcher ray without it
    if problem := ray_missing() or address_problem(ray_cfg.address):
        print(f"error: launch.ray: {problem}", file=sys.stderr)
        return 2
    connect(ray_cfg)
    folder = ray_dir(cfg, args.stage)
    if problems := connected_problems(ray_cfg, Path(cfg.run.output_dir)):
        print("error: launch.ray:\n  - " + "\n  - ".join(problems), file=sys.stderr)
        return 2
    import ray

    name = f"{cfg.run.name}-{args.stage}-{time.strftime('%Y%m%d-%H%M%S')}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "workers.json").unlink(missing_ok=True)  # an earlier run's; this run's workers write theirs
    run = {"address": ray_cfg.address, "job_id": ray.get_runtime_context().get_job_id(), "run_name": name,
           "nodes": sum(1 for n in ray.nodes() if n["Alive"]), "storage": str(folder)}
    (folder / "run.json").write_text(json.dumps(run, indent=1) + "\n")
    marker = write_marker(Path(cfg.run.output_dir))
    work = {"argv": list(argv), "cwd": os.getcwd(), "marker": str(marker), "folder": str(folder),
            "chdir": not (ray_cfg.runtime_env or {}).get("working_dir")}
    print(f"Ray job {run['job_id']} on {ray_cfg.address}: {args.stage} as run {name}, "
          f"{ray_cfg.num_workers} workers", flush=True)
    for key, value in WORKER_OUTPUT_AS_TORCHRUN.items():  # a value the user set stays
        os.environ.setdefault(key, value)
    try:
        return _fit(build_trainer(ray_cfg, work, name, folder), run["job_id"])
    finally:
        marker.unlink(missing_ok=True)


def build_trainer(ray_cfg: RayLaunchConfig, work: dict[str, Any], name: str, folder: Path):
    """The TorchTrainer whose workers run `run_worker(work)` as launch.ray places them."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    class Trainer(TorchTrainer):
        # Ray Train takes SIGINT for itself (aborting the run's controller); this driver stops on SIGTERM and
        # SIGHUP too and waits until the run left the cluster, so it keeps the controller's handle instead
        def _register_sigint_handler(self, controller) -> None:
            self.controller = controller

        # the stage reads its own data: no Ray Datasets. Ray Train's callback for them starts an actor (a
        # process) and has every worker import Ray Data before the stage starts, whatever the datasets
        def _create_default_callbacks(self) -> list:
            from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

            return [c for c in super()._create_default_callbacks() if not isinstance(c, DatasetsCallback)]

    each = {"CPU": ray_cfg.cpus_per_worker, "GPU": ray_cfg.gpus_per_worker, **ray_cfg.resources_per_worker}
    scaling = ScalingConfig(num_workers=ray_cfg.num_workers, use_gpu=ray_cfg.gpus_per_worker > 0,
                            resources_per_worker=each,
                            placement_strategy=ray_cfg.placement_strategy)
    return Trainer(run_worker, train_loop_config=work, scaling_config=scaling,
                   run_config=RunConfig(name=name, storage_path=str(folder),
                                        failure_config=FailureConfig(max_failures=ray_cfg.max_failures)))


def _fit(trainer, job_id: str) -> int:
    """Run `trainer` to its end, or until a stop signal: the exit code."""
    import ray
    from ray.train import TrainingFailedError

    stops: list[int] = []

    def stop(signum, frame) -> None:
        stops.append(signum)
        controller = getattr(trainer, "controller", None)
        os.write(2, f"stopping the Ray run ({signal.Signals(signum).name})\n".encode())
        if controller is None:
            raise KeyboardInterrupt
        if len(stops) == 1:
            controller.abort.remote()
        else:
            ray.kill(controller)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
                if s != signal.SIGHUP or signal.getsignal(s) is not signal.SIG_IGN}
    try:
        trainer.fit()
        code = 0
    except TrainingFailedError as e:
        code = 128 + stops[0] if stops else 1
        if not stops:
            print(f"error: the Ray run failed: {e}", file=sys.stderr, flush=True)
    except (KeyboardInterrupt, ray.exceptions.RayActorError):
        if not stops:
            raise
        code = 128 + stops[0]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stops:
        left = wait_until_gone(job_id)
        print(f"stopped: the Ray run {'left ' + ', '.join(left) if left else 'left nothing'} on the cluster",
              file=sys.stderr, flush=True)
    return code


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
    return ([f"actor {a.class_name} ({a.state})" for a in actors
             if a.state != "DEAD" and a.class_name not in CLUSTER_SERVICES]
            + [f"placement group {g.placement_group_id} ({g.state})" for g in groups
               if g.creator_job_id == job_id and g.state != "REMOVED"])


def run_worker(work: dict[str, Any]) -> None:
    """One Ray Train worker: the stage function torchrun's ranks run (`vlmexp.cli.main` with the stage's
    arguments), after checking this node sees the driver's marker in the output folder; its output lines
    prefixed with its rank and node."""
    import ray
    import ray.train

    from vlmexp.ray_cluster import unseen_marker

    rank = ray.train.get_context().get_world_rank()
    node = ray.get_runtime_context().get_node_id()[:12]
    host = socket.gethostname()
    if problem := unseen_marker(work["marker"], node, host):
        raise RuntimeError(problem)
    if work["chdir"]:  # the driver's working folder, where the config's relative paths point
        os.chdir(work["cwd"])
    _record_placement(work["folder"], rank, node, host)
    from vlmexp.cli import main

    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (_Prefixed(s, f"[rank {rank} node {node} {host}] ") for s in (out, err))
    try:
        code = main(work["argv"])
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        sys.stdout, sys.stderr = out, err
    if code != 0:
        raise RuntimeError(f"rank {rank} on node {node} ({host}): vlmexp train exited with code {code}")


def _record_placement(folder: str, rank: int, node: str, host: str) -> None:
    """Every rank's node and resources, gathered over the process group Ray set up; rank 0 writes them to
    <folder>/workers.json (the pipeline tags the stage's MLflow run with them)."""
    import ray
    import torch.distributed as dist

    mine = {"rank": rank, "node_id": node, "host": host, "node_ip": ray.util.get_node_ip_address(),
            "resources": {k: v for k, v in ray.get_runtime_context().get_assigned_resources().items()
                          if not k.startswith("bundle_group")}}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        path = Path(folder) / "workers.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(everyone, indent=1) + "\n")
        tmp.replace(path)


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
