"""Qwen3.5-MoE's runs beyond one process and one stage: SFT SIGKILLed and resumed, 2 processes under
torchrun validating on the main one with the expert counts summed over the ranks, DPO with LoRA on the fused
experts exported merged, evaluated and registered; and Qwen3-VL's MoE sibling (`qwen3_vl_moe`), whose fused
experts take LoRA as Qwen3.5-MoE's do. (The MoE under Ray: tests/test_ray.py; the stages on one process:
tests/test_qwen3_5.py.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import SMALL_BATCHES
from test_qwen3_5 import ATTENTION, _changed, _lora_counts, _record_forwards, _weights

from vlmexp.checks.loader import load_config
from vlmexp.families import detect_family, get_family

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _sft_command(config: str, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "vlmexp.cli", "train", "sft", "--config", config, *overrides]


def _env(**more: str) -> dict[str, str]:
    """The stage command's environment: tests/faults first on the path (its sitecustomize plants
    VLMEXP_FAULT's SIGKILL in the training process)."""
    import os

    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "faults"), str(REPO)]), **more}


def test_moe_sft_killed_then_resumed_matches_an_uninterrupted_run(tiny_models, tmp_path):
    """Qwen3.5-MoE SFT, the stage command SIGKILLed after step 3 (a lost machine; checkpoint-2 saved), and a
    checkpoint-3 torn while saving: the same stage resumes from checkpoint-2, trains steps 3-4 once, and ends
    on the uninterrupted run's weights."""
    import signal
    import subprocess

    import torch
    from safetensors.torch import load_file

    from vlmexp.train.sft import run_sft
    from vlmexp.train.stage import last_checkpoint

    def overrides(out):
        return [f"run.output_dir={out}", f"model.path={tiny_models['qwen3_5_moe']}", "tracking.backend=none",
                "data.demo.train=16", "data.demo.val=4", "sft.args.max_steps=4", "sft.args.save_steps=2",
                "sft.args.logging_steps=1", "sft.args.per_device_train_batch_size=4", "grpo.enabled=false"]

    config = str(REPO / "configs/demo_qwen3_5.yaml")
    # the killed command starts first and imports while the uninterrupted run trains here
    with (tmp_path / "killed.log").open("w") as log:
        killed = subprocess.Popen(_sft_command(config, overrides(tmp_path / "b")), stdout=subprocess.DEVNULL,
                                  stderr=log, cwd=REPO, env=_env(VLMEXP_FAULT="kill_at_step:3"))
    try:
        straight = run_sft(load_config(config, overrides(tmp_path / "a")))
        killed.wait(timeout=900)
    finally:
        killed.kill()  # nothing once it has ended
    assert killed.returncode == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-3000:]
    stage = tmp_path / "b" / "sft"
    assert not (stage / "final").exists()
    (stage / "checkpoint-3").mkdir()
    (stage / "checkpoint-3" / "model.safetensors").write_bytes(b"partial")
    assert last_checkpoint(stage) == str(stage / "checkpoint-2")
    resumed = run_sft(load_config(config, overrides(tmp_path / "b")))
    history = json.loads((stage / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
    assert [h["step"] for h in history if "loss" in h] == [1, 2, 3, 4]
    assert any("aux_loss" in h for h in history)  # TRL's router aux loss, logged
    first, second = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert any("mlp.experts" in k for k in first)
    for k in first:
        torch.testing.assert_close(first[k], second[k], rtol=1e-4, atol=1e-5, msg=k)


def test_torchrun_two_processes_train_the_moe_validate_on_the_main_one_and_sum_the_expert_counts(
        tmp_path, tiny_models, mlflow_store):
    """The torchrun launcher with 2 CPU processes (DDP over gloo) on the tiny Qwen3.5-MoE, full fine-tuning
    with validation at every step (a layer's experts are one 3-D parameter: DDP sees it used, with zero rows
    for the experts a rank's batch leaves out): the launcher starts both and they share the data; the main
    process generates and scores, the other waits and takes the same decisions (a save at each new best);
    nothing hangs. The experts' weights move, the main process writes the model and the MLflow run, and the
    expert counts are summed over both ranks: the tokens routed in a step are at least the step's real
    tokens of both ranks (TRL's gathered `num_tokens`); rank 0's alone would be about half. (One run for
    both: the launcher's validation is the family's as much as the launcher's, and each torchrun start costs
    three processes' imports.)"""
    import subprocess

    from mlflow.tracking import MlflowClient

    out = mlflow_store(tmp_path / "out")
    uri = f"sqlite:///{out / 'mlflow.db'}"
    overrides = [f"run.output_dir={out}", f"model.path={tiny_models['qwen3_5_moe']}",
                 "tracking.backend=mlflow", f"tracking.tracking_uri={uri}", "tracking.system_metrics=false",
                 "data.demo.train=16", "data.demo.val=4", *SMALL_BATCHES, "sft.args.max_steps=2",
                 "sft.args.save_steps=2", "sft.args.logging_steps=1", "sft.args.warmup_steps=0",
                 "sft.args.per_device_train_batch_size=2", "eval.every_steps=1", "eval.max_new_tokens=8",
                 "launch.launcher=torchrun", "launch.nproc_per_node=2"]
    r = subprocess.run(_sft_command("configs/demo_qwen3_5.yaml", overrides), capture_output=True, text=True,
                       cwd=REPO, timeout=900, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    assert "launching: " in r.stderr and "--nproc_per_node=2" in r.stderr
    assert r.stderr.count("PyTorch reference kernels") == 2  # once a process, not once a kernel function
    assert r.stderr.count("logging to MLflow run") == 1  # the main process's run only
    assert r.stderr.count("validation on 4 held-out records x 1") == 2  # steps 1 and 2, one process
    state = json.loads((out / "sft" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["epoch"] == pytest.approx(0.5)  # 2 steps x 2 rows x 2 processes = 8 of 16 rows
    assert [h["step"] for h in state["log_history"] if "val/rec_mean_iou" in h] == [1, 2]
    assert (out / "sft" / f"checkpoint-{state['best_global_step']}").is_dir()
    assert (out / "sft" / "final" / "model.safetensors").is_file()
    changed = _changed(_weights(tiny_models["qwen3_5_moe"]), _weights(out / "sft" / "final"))
    assert any(".mlp.experts." in k for k in changed) and any(".linear_attn." in k for k in changed)

    client = MlflowClient(uri)
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])

    def history(key):
        return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}

    routed, seen = history("moe/routed_tokens"), history("num_tokens")
    assert sorted(routed) == [1, 2] and sorted(history("moe/expert_load_cv")) == [1, 2]
    assert sorted(history("val/rec_mean_iou")) == [1, 2]
    for step in (1, 2):  # a step's real tokens, both ranks (TRL's count is cumulative), against the routed
        assert routed[step] >= seen[step] - seen.get(step - 1, 0) > 0, (routed, seen)


def _recording(seen: list):
    """A Trainer callback: at the start, `_record_forwards`' list of the trainer's model into `seen`."""
    from transformers import TrainerCallback

    class Record(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            seen.append(_record_forwards(base))

    return Record()


def test_moe_dpo_with_lora_on_the_experts_exports_merged_loads_in_plain_transformers_and_registers(
        tiny_models, tmp_path, mlflow_store):
    """Qwen3.5-MoE DPO on pairs from its own samples, LoRA on the attention layers and the fused experts
    (target_parameters), validated during training: the loss forwards carry each image's pixel rows and
    mm_token_type_ids; the export merges the adapter (the experts' 3-D weights moved, the router's not) into
    a folder plain transformers loads as Qwen3_5MoeForConditionalGeneration; evaluated, and registered as the
    champion in MLflow's registry with its evaluation's value."""
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForImageTextToText

    from vlmexp.evaluate import evaluate
    from vlmexp.export import export_model, register_and_promote
    from vlmexp.tracking.tracker import make_tracker
    from vlmexp.train.dpo import run_dpo

    sys.path.insert(0, str(Path(__file__).parent))  # rewards_for_tests
    out = mlflow_store(tmp_path / "out")
    cfg = load_config(REPO / "configs/demo_qwen3_5.yaml", [
        f"run.output_dir={out}", f"model.path={tiny_models['qwen3_5_moe']}", "tracking.backend=none",
        "data.demo.train=8", "data.demo.val=2", "sft.enabled=false", "grpo.enabled=false",
        "dpo.enabled=true", "dpo.pairs.from=samples", "dpo.pairs.num_samples=3",
        "dpo.pairs.max_new_tokens=8", "dpo.pairs.temperature=1.5", "dpo.pairs.min_margin=0.05",
        "dpo.args.max_steps=1", "dpo.args.save_steps=1", "dpo.args.per_device_train_batch_size=4",
        "dpo.args.learning_rate=1e-2", "dpo.args.max_length=256", "eval.every_steps=1",
        "eval.during_training_samples=2", "eval.max_new_tokens=8",
        "dpo.peft={r: 4, dropout: 0, target_parameters: [mlp.experts.gate_up_proj, mlp.experts.down_proj]}",
        "grpo.rewards=[{name: 'rewards_for_tests:char_variety'}]"])
    seen: list = []
    adapter = run_dpo(cfg, callbacks=[_recording(seen)])
    loss = [s for s in seen[-1] if s["grad"]]
    assert loss and all(s["types"] is not None and s["types"].sum() > 0 for s in loss)
    assert all(s["rows"] == int(s["grid"].prod(-1).sum()) for s in loss)
    assert (adapter / "adapter_config.json").is_file()
    validated = json.loads((out / "dpo" / "validation.json").read_text())
    assert [step for step, _ in validated["history"]] == [1]  # validation during training, on the MoE

    exported = export_model(cfg, str(adapter), out / "export", {"stage": "dpo"})
    manifest = json.loads((exported / "manifest.json").read_text())
    assert manifest["merged_lora"] and not (exported / "adapter_config.json").exists()
    model = AutoModelForImageTextToText.from_pretrained(exported)
    assert type(model).__name__ == "Qwen3_5MoeForConditionalGeneration"
    before, after = _weights(tiny_models["qwen3_5_moe"]), _weights(exported)
    assert set(before) == set(after)  # the same names: no LoRA weights left behind
    changed = _changed(before, after)
    experts = {k for k in before if ".mlp.experts." in k}  # saved per expert (the checkpoint's own layout)
    assert len(experts) == 2 * 4 * 3 and experts <= changed, sorted(experts - changed)  # whole 3-D tensors
    assert not any(".mlp.gate." in k or ".visual." in k for k in changed), sorted(changed)

    result = evaluate(cfg, str(exported), out / "data" / "val.jsonl", out / "eval")
    assert result.metrics["count"] == 2 and "rec_mean_iou" in result.metrics
    tracker = make_tracker(load_config(REPO / "configs/demo_qwen3_5.yaml", [f"run.output_dir={out}"]))
    run = tracker.start_pipeline("p", {}, {})
    promoted = register_and_promote(tracker, run, exported, "qwen3-5-moe", "rec_mean_iou",
                                    result.metrics["rec_mean_iou"], "maximize",
                                    registration=manifest["registration"])
    tracker.end(run)
    assert promoted.promoted and promoted.version == "1"
    client = MlflowClient(tracker.uri)
    assert str(client.get_model_version_by_alias("qwen3-5-moe", "champion").version) == "1"


def test_qwen3_vl_moe_detected_lora_per_layer_and_a_grpo_step_on_its_experts(tiny_models, tmp_path):
    """Qwen3-VL-MoE (Qwen3-VL-30B-A3B's architecture; Qwen3-VL's processor, template and grid): detected from
    config.json; LoRA's default adapts the attention of every (sparse) layer and nothing in the vision tower,
    target_parameters the fused experts; one GRPO step moves the experts' LoRA weights, its loss forward
    carrying every image's pixel rows."""
    import torch
    from transformers import AutoModelForImageTextToText

    from vlmexp.train.grpo import build_grpo_trainer
    from vlmexp.train.stage import train_and_save

    path = tiny_models["qwen3_vl_moe"]
    family = detect_family(path)
    assert family is get_family("qwen3_vl_moe") and family.moe and family.box_frame == "grid1000"
    model = AutoModelForImageTextToText.from_pretrained(path)
    found = _lora_counts(model)
    assert found.pop("vision") == set()
    assert found["full_attention:0"] == found["full_attention:1"] == ATTENTION

    sys.path.insert(0, str(Path(__file__).parent))  # rewards_for_tests
    cfg = load_config(REPO / "configs/demo.yaml", [
        f"run.output_dir={tmp_path}", f"model.path={path}", "model.min_pixels=4096",
        "model.max_pixels=102400", "tracking.backend=none", "data.demo.train=4", "data.demo.val=2",
        "sft.enabled=false",
        "grpo.peft={r: 4, dropout: 0, target_parameters: [mlp.experts.gate_up_proj, mlp.experts.down_proj]}",
        "grpo.args.max_steps=1", "grpo.args.save_steps=1", "grpo.args.warmup_steps=0",
        "grpo.args.per_device_train_batch_size=4", "grpo.args.num_generations=2",
        "grpo.args.gradient_accumulation_steps=1", "grpo.args.max_completion_length=6",
        "grpo.args.temperature=1.5", "grpo.rewards=[{name: 'rewards_for_tests:char_variety'}]"])
    trainer, inputs, rows = build_grpo_trainer(cfg)
    seen = _record_forwards(trainer.model.get_base_model())
    experts = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
               if p.requires_grad and "experts" in n}
    assert experts
    train_and_save(trainer, inputs, rows)
    assert any(not torch.equal(p, experts[n]) for n, p in trainer.model.named_parameters() if n in experts)
    [loss] = [s for s in seen if s["grad"]]
    assert loss["rows"] == int(loss["grid"].prod(-1).sum()) and loss["grid"].shape[0] == 4
