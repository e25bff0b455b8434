"""The launch section: exact commands (--dry-run), real torchrun (2 CPU processes), DeepSpeed ZeRO-2/3
steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SMALL_BATCHES

from vlmexp.checks.loader import load_config
from vlmexp.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DEMO = str(REPO / "configs/demo.yaml")


def vlmexp(*args, env=None):
    return subprocess.run([sys.executable, "-m", "vlmexp.cli", *args], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO / "tests"), **(env or {})})


def dry_run(vlmexp_main, stage, *overrides):
    """What `vlmexp train STAGE --config DEMO --dry-run OVERRIDES` prints, from the command's own `main` in
    this process (a process per command would import TRL again for each, to print one line)."""
    rc, out, err = vlmexp_main("train", stage, "--config", DEMO, "--dry-run", *overrides)
    assert rc == 0, err
    return out.strip()


@pytest.mark.slow  # runs the command line in a subprocess
def test_dry_run_prints_the_exact_command_for_each_launcher(vlmexp_main):
    """The command line itself once (a process of its own), then each launcher's command from `main`."""
    r = vlmexp("train", "sft", "--config", DEMO, "--dry-run")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{sys.executable} -m vlmexp.cli train sft --config {DEMO} --in-process"
    assert dry_run(vlmexp_main, "sft") == (
        f"{sys.executable} -m vlmexp.cli train sft --config {DEMO} --in-process")
    assert dry_run(vlmexp_main, "sft", "--checked") == (
        f"{sys.executable} -m vlmexp.cli train sft --config {DEMO} --in-process --checked")
    assert dry_run(vlmexp_main, "grpo", "launch.launcher=torchrun", "launch.nproc_per_node=8") == (
        f"{BIN}/torchrun --nproc_per_node=8 --nnodes=1 --standalone -m vlmexp.cli train grpo --config {DEMO} "
        "--in-process launch.launcher=torchrun launch.nproc_per_node=8")
    node1 = ["launch.launcher=torchrun", "launch.nproc_per_node=8", "launch.nnodes=2", "launch.node_rank=1",
             "launch.rdzv_endpoint=10.1.2.3:29500"]
    assert dry_run(vlmexp_main, "grpo", *node1).startswith(
        f"{BIN}/torchrun --nproc_per_node=8 --nnodes=2 --node_rank=1 --rdzv_backend=c10d "
        "--rdzv_endpoint=10.1.2.3:29500 --rdzv_id=demo -m vlmexp.cli train grpo")
    acc = dry_run(vlmexp_main, "sft", "launch.launcher=accelerate",
                  "launch.accelerate_config=configs/accelerate/multi_gpu.yaml", "launch.nproc_per_node=4",
                  "launch.nnodes=2", "launch.rdzv_endpoint=node0:29500")
    assert acc.startswith(f"{BIN}/accelerate launch --config_file configs/accelerate/multi_gpu.yaml "
                          "--num_processes=8 --num_machines=2 --machine_rank=0 --main_process_ip=node0 "
                          "--main_process_port=29500 -m vlmexp.cli train sft")
    ds = dry_run(vlmexp_main, "grpo", "launch.launcher=deepspeed", "launch.nproc_per_node=8",
                 "launch.nnodes=2", "launch.hostfile=hostfile",
                 "launch.deepspeed=configs/deepspeed/zero3.json")
    assert ds.startswith(f"{BIN}/deepspeed --hostfile=hostfile --num_nodes=2 --num_gpus=8 --module "
                         "vlmexp.cli train grpo")


@pytest.mark.parametrize(("overrides", "message"), [
    (["launch.nproc_per_node=2"], "launcher 'local' runs one process"),
    (["launch.launcher=torchrun", "launch.nnodes=2"], "needs launch.rdzv_endpoint"),
    (["launch.launcher=torchrun", "launch.nnodes=2", "launch.rdzv_endpoint=node0"], "must be host:port"),
    (["launch.launcher=deepspeed", "launch.nnodes=2"], "needs launch.hostfile"),
    (["launch.launcher=torchrun", "launch.accelerate_config=configs/accelerate/multi_gpu.yaml"],
     "read by accelerate only"),
    (["sft.args.save_only_model=true"], "save_only_model.*resume: false"),
    (["grpo.sft_adapter=continue", "grpo.peft={r: 8}"], "remove grpo.peft"),
    (["sft.peft={r: 8}", "sft.freeze_vision=true"], "apply to full fine-tuning"),
])
def test_launch_and_stage_settings_that_cannot_work_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DEMO, overrides)


def test_shipped_accelerate_and_deepspeed_configs_load():
    from accelerate.commands.config.config_args import load_config_from_file

    accel = load_config_from_file(str(REPO / "configs/accelerate/multi_gpu.yaml"))
    assert accel.distributed_type.value == "MULTI_GPU"
    for name in ("zero2", "zero3", "zero3_offload"):
        ds = json.loads((REPO / f"configs/deepspeed/{name}.json").read_text())
        assert ds["zero_optimization"]["stage"] == (2 if name == "zero2" else 3)


def test_every_launched_process_of_a_checked_config_gets_checked():
    """`vlmexp train --checked` (how the pipeline starts a stage on its resolved config): each process the
    launcher starts is told so too; without it, none is."""
    from vlmexp.config.schema import LaunchConfig
    from vlmexp.launch import stage_command

    for launch in (LaunchConfig(), LaunchConfig(launcher="torchrun", nproc_per_node=2),
                   LaunchConfig(launcher="deepspeed", nproc_per_node=2)):
        config, model = "o/config.resolved.yaml", "o/sft/final"
        checked = " ".join(stage_command(launch, "grpo", config, model, checked=True))
        assert f"train grpo --config {config} --in-process --checked --model {model}" in checked
        assert "--checked" not in stage_command(launch, "grpo", config, model)


TRAIN = ["tracking.backend=none", "data.demo.train=16", "data.demo.val=4", *SMALL_BATCHES]


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "zero"), [("sft", "zero2"), ("grpo", "zero3")])
def test_deepspeed_zero_configs_run_training_steps(tmp_path, stage, zero):
    from transformers import AutoModelForImageTextToText

    extra = (["sft.args.max_steps=2", "sft.args.save_steps=2"] if stage == "sft" else
             ["grpo.args.max_steps=2", "grpo.args.save_steps=2", "grpo.args.per_device_train_batch_size=4",
              "grpo.args.num_generations=4", "grpo.args.max_completion_length=8", "grpo.args.beta=0.04",
              "grpo.args.logging_steps=1", "grpo.args.temperature=1.5",
              "grpo.rewards=[{name: 'rewards_for_tests:char_variety'}]"])
    extensions = tmp_path / "torch_extensions"  # where DeepSpeed would JIT-build an op (empty: none cached)
    r = vlmexp("train", stage, "--config", DEMO, f"run.output_dir={tmp_path}", *TRAIN, *extra,
               "launch.launcher=torchrun", f"launch.deepspeed=configs/deepspeed/{zero}.json",
               env={"TORCH_EXTENSIONS_DIR": str(extensions)})
    assert r.returncode == 0, r.stderr[-3000:]
    # on CPU, DeepSpeed's shared-memory all-reduce op (inference only) is not compiled before the first step
    assert "is not built" in r.stderr and not list(extensions.glob("**/*.so")), r.stderr[-3000:]
    ckpt = tmp_path / stage / "checkpoint-2"
    assert (ckpt / "global_step2").is_dir()  # DeepSpeed's own engine checkpoint: ZeRO was in charge
    [base] = (tmp_path / "models").glob("tiny-*")
    # ZeRO-3 gathers the 16-bit weights and saves them under the module's own names (model.model.*), which
    # from_pretrained maps back: compare what loads, which is what every later stage reads
    before, after = (AutoModelForImageTextToText.from_pretrained(p).state_dict()
                     for p in (base, tmp_path / stage / "final"))
    assert before.keys() == after.keys() and all(before[k].shape == after[k].shape for k in before)
    assert any(not (before[k] == after[k]).all() for k in before)  # full weights gathered and trained
    # trained from the base, not re-initialised
    assert all((before[k] - after[k]).abs().max() < 0.05 for k in before)
