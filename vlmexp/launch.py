"""The `launch:` section turned into the command that starts a training stage.

`local` runs one process; `torchrun` and `accelerate` start `nproc_per_node` processes on each of `nnodes`
machines (run the same command on every node with its own `launch.node_rank`); `deepspeed` reads a
hostfile and starts every node from node 0 over ssh (pdsh); `ray` runs a driver (vlmexp.ray_launch) that
submits the stage to a running Ray cluster as Ray actors. Whatever the launcher, each process runs
`python -m vlmexp.cli train STAGE --config C --in-process` (with `--checked` when C is a run's resolved
config, as the pipeline starts a stage), and the DeepSpeed JSON reaches the Trainer through
`TrainingArguments.deepspeed` (so the same file works with every launcher).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlmexp.config.schema import LaunchConfig


def _tool(name: str) -> str:
    """The launcher next to this Python (the venv's), else whatever PATH finds, else the bare name."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else (shutil.which(name) or name)


def stage_command(launch: LaunchConfig, stage: str, config: str | Path, model: str | None = None,
                  overrides: Sequence[str] = (), run_id: str = "vlmexp",
                  mlflow_run_id: str | None = None, checked: bool = False,
                  held_by: str | None = None) -> list[str]:
    """The argv that runs `stage` with `config` under `launch` (`run_id` names the rendezvous; `mlflow_run_id`
    is the MLflow run the stage logs into, else it starts its own in the config's store; `checked`: the config
    is one the pipeline wrote and checked, a run's resolved config; `held_by`: the run holding the output
    folder, inside whose hold the stage runs)."""
    inner = ["vlmexp.cli", "train", stage, "--config", str(config), "--in-process",
             *(["--checked"] if checked else []), *(["--held-by", held_by] if held_by else []),
             *(["--model", str(model)] if model else []),
             *(["--mlflow-run-id", mlflow_run_id] if mlflow_run_id else []), *overrides]
    n, nodes = launch.nproc_per_node, launch.nnodes
    if launch.launcher == "local":
        return [sys.executable, "-m", *inner]
    if launch.launcher == "ray":  # the driver; each Ray worker runs `vlmexp.cli` with these arguments
        return [sys.executable, "-m", "vlmexp.ray_launch", *inner[1:]]
    if launch.launcher == "torchrun":
        cmd = [_tool("torchrun"), f"--nproc_per_node={n}", f"--nnodes={nodes}"]
        if nodes > 1:
            cmd += [f"--node_rank={launch.node_rank}", "--rdzv_backend=c10d",
                    f"--rdzv_endpoint={launch.rdzv_endpoint}", f"--rdzv_id={run_id}"]
        else:
            cmd += ["--standalone"]
        return [*cmd, "-m", *inner]
    if launch.launcher == "accelerate":
        cmd = [_tool("accelerate"), "launch"]
        if launch.accelerate_config:
            cmd += ["--config_file", launch.accelerate_config]
        cmd += [f"--num_processes={n * nodes}", f"--num_machines={nodes}"]
        if n * nodes > 1 and not launch.accelerate_config:
            cmd += ["--multi_gpu"]
        if nodes > 1:
            host, _, port = launch.rdzv_endpoint.rpartition(":")
            cmd += [f"--machine_rank={launch.node_rank}", f"--main_process_ip={host}",
                    f"--main_process_port={port}"]
        return [*cmd, "-m", *inner]
    # deepspeed
    cmd = [_tool("deepspeed")]
    if launch.hostfile:
        cmd += [f"--hostfile={launch.hostfile}", f"--num_nodes={nodes}"]
    if launch.rdzv_endpoint:
        host, _, port = launch.rdzv_endpoint.rpartition(":")
        cmd += [f"--master_addr={host}", f"--master_port={port}"]
    return [*cmd, f"--num_gpus={n}", "--module", *inner]


def ray_submission(launch: LaunchConfig) -> str:
    """What the Ray driver submits, in words (`vlmexp train --dry-run`): the cluster, the workers, each
    worker's resources, their placement, the restarts and the runtime environment."""
    r = launch.ray
    assert r is not None
    each = {"GPU": r.gpus_per_worker, "CPU": r.cpus_per_worker, **r.resources_per_worker}
    where = r.address or "the cluster RAY_ADDRESS names, else this node's (auto)"
    return (f"Ray actors on {where}: {r.num_workers} workers, each "
            + ", ".join(f"{v:g} {k}" for k, v in each.items())
            + f"; placement {r.placement_strategy}; up to {r.max_failures} worker-group restarts from the "
            f"newest checkpoint; runtime_env {r.runtime_env or 'none (the nodes have vlmexp installed)'}")


def process_count(launch: LaunchConfig) -> int:
    """The training processes a launch starts over all its nodes: Ray's workers, or nproc_per_node on each
    of nnodes (1 for local)."""
    if launch.launcher == "ray":
        assert launch.ray is not None
        return launch.ray.num_workers
    return launch.nproc_per_node * launch.nnodes


def is_zero3(deepspeed: Any) -> bool:
    """Whether a DeepSpeed config (launch.deepspeed's JSON, read) shards the parameters: ZeRO stage 3."""
    return isinstance(deepspeed, dict) and (deepspeed.get("zero_optimization") or {}).get("stage") == 3


def sharded_validation_problem(processes: int, zero3: bool, fsdp: bool) -> str | None:
    """Why validation during training cannot run on `processes` processes whose parameters DeepSpeed ZeRO-3
    or FSDP shards over them, with the fix; None when it can. (`vlmexp.train.validation.check_sharding` in
    each rank; `vlmexp.checks.config_paths` before anything starts.)"""
    if processes == 1 or not (zero3 or fsdp):
        return None
    scheme = "DeepSpeed ZeRO-3" if zero3 else "FSDP"
    return (f"validation during training generates on the main process alone, and {scheme} shards the "
            f"parameters over the {processes} processes, so that generate would wait forever for the others; "
            "use ZeRO-2 (configs/deepspeed/zero2.json) or DDP, or set eval.every_steps: 0 and evaluate after "
            "the stage")


def is_launched_process() -> bool:
    """True inside a process a distributed launcher started (it sets these for every rank)."""
    import os

    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
