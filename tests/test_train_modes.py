"""LoRA, freezing, starting GRPO from an SFT adapter, the reference model, resume, and bad-hardware
refusals."""

from __future__ import annotations

import gc
import json
import sys
import weakref
from pathlib import Path

import pytest
import torch
from conftest import SMALL_BATCHES
from transformers import PreTrainedModel, TrainerCallback

from vlmexp.checks.loader import load_config
from vlmexp.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
sys.path.insert(0, str(Path(__file__).parent))  # rewards_for_tests


def _cfg(out, *overrides):
    return load_config(REPO / "configs/demo.yaml", [f"run.output_dir={out}", "tracking.backend=none",
                                                    "data.demo.train=16", "data.demo.val=4", *SMALL_BATCHES,
                                                    *overrides])


GRPO_SMALL = ["grpo.args.max_steps=2", "grpo.args.save_steps=2", "grpo.args.logging_steps=1",
              "grpo.args.per_device_train_batch_size=4", "grpo.args.num_generations=4",
              "grpo.args.max_completion_length=8", "grpo.args.temperature=1.5",
              "grpo.rewards=[{name: 'rewards_for_tests:char_variety'}, {name: iou}]"]


def _models() -> list[PreTrainedModel]:
    """Whole models (a Qwen-VL holds three PreTrainedModels inside: model, visual, language_model)."""
    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, PreTrainedModel) and type(o).__name__.endswith(
        "ForConditionalGeneration")]


class Observe(TrainerCallback):
    """Records what the trainer trains and how many full models it created before training starts."""

    def __init__(self):
        self.existing = weakref.WeakSet(_models())  # models earlier runs in this process left behind

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        self.models_alive = sum(m not in self.existing for m in _models())


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


def _history(stage_dir: Path) -> list[dict]:
    ckpt = max(stage_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return json.loads((ckpt / "trainer_state.json").read_text())["log_history"]


def test_lora_sft_then_grpo_continues_the_adapter_against_it_as_reference(tmp_path):
    from vlmexp.train.grpo import run_grpo
    from vlmexp.train.sft import run_sft

    seen = Observe()
    sft = run_sft(_cfg(tmp_path, "sft.args.max_steps=3", "sft.args.save_steps=3", "sft.peft={r: 8}"), [seen])
    assert seen.trainable and all("lora_" in n and "language_model" in n
                                  for n in seen.trainable), seen.trainable
    adapter = _tensors(sft / "adapter_model.safetensors")
    assert not any("visual" in k for k in adapter)
    assert any(k.endswith(f"{proj}.lora_A.weight") for k in adapter for proj in ("q_proj", "down_proj"))
    assert not (sft / "model.safetensors").exists()

    seen = Observe()
    final = run_grpo(_cfg(tmp_path / "g", *GRPO_SMALL, "grpo.args.beta=0.04", "grpo.sft_adapter=continue"),
                     str(sft), [seen])
    assert seen.models_alive == 1  # the reference is the policy with the SFT adapter copy, not a second model
    assert all("lora_" in n for n in seen.trainable)
    after = _tensors(final / "adapter_model.safetensors")
    assert any(not torch.equal(adapter[k], after[k]) for k in adapter)
    assert all("kl" in h for h in _history(tmp_path / "g" / "grpo") if "reward" in h)


def test_grpo_merges_an_sft_adapter_and_trains_a_new_one(tmp_path):
    from vlmexp.train.grpo import run_grpo
    from vlmexp.train.sft import run_sft

    sft = run_sft(_cfg(tmp_path, "sft.args.max_steps=2", "sft.args.save_steps=2", "sft.peft={r: 8}"))
    seen = Observe()
    final = run_grpo(_cfg(tmp_path / "g", *GRPO_SMALL, "grpo.args.beta=0.04", "grpo.peft={r: 4}"), str(sft),
                     [seen])
    merged = tmp_path / "g" / "grpo" / "start-merged"
    assert (merged / "model.safetensors").is_file()
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == str(merged)
    assert json.loads((final / "adapter_config.json").read_text())["r"] == 4
    assert seen.models_alive == 1  # LoRA: the reference is the adapter-disabled (merged) model


def test_reference_model_is_loaded_only_when_beta_is_positive(tmp_path):
    from vlmexp.train.grpo import run_grpo

    counts = {}
    for beta in (0.0, 0.04):
        seen = Observe()
        run_grpo(_cfg(tmp_path / str(beta), *GRPO_SMALL, f"grpo.args.beta={beta}"), None, [seen])
        history = [h for h in _history(tmp_path / str(beta) / "grpo") if "reward" in h]
        counts[beta] = (seen.models_alive, all("kl" in h for h in history))
        # unparsable completions are counted per reason and logged next to the reward
        assert any(h.get("rewards/iou/unparsable/no_answer", 0) > 0 for h in history)
    assert counts == {0.0: (1, False), 0.04: (2, True)}


def test_freeze_vision_keeps_the_tower_fixed_and_trains_the_merger(tmp_path):
    from vlmexp.train.sft import run_sft

    final = run_sft(_cfg(tmp_path, "sft.args.max_steps=2", "sft.args.save_steps=2", "sft.freeze_vision=true"))
    [base] = (tmp_path / "models").glob("tiny-*")
    before, after = _tensors(base / "model.safetensors"), _tensors(final / "model.safetensors")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    tower = {k for k in before if "visual." in k and "merger" not in k}
    assert tower and not tower & changed
    assert any("merger" in k for k in changed) and any(k.startswith("model.language_model.") or
                                                        k.startswith("model.layers.") for k in changed)


def test_resume_continues_from_the_newest_complete_checkpoint_and_matches_an_uninterrupted_run(tmp_path):
    from stop_at_step import StopAtStep

    from vlmexp.train.sft import run_sft
    from vlmexp.train.stage import last_checkpoint

    args = ["sft.args.max_steps=6", "sft.args.save_steps=2", "sft.args.logging_steps=1",
            "sft.args.per_device_train_batch_size=4"]
    straight = run_sft(_cfg(tmp_path / "a", *args))

    run_sft(_cfg(tmp_path / "b", *args), [StopAtStep(4)])  # "preempted" after step 4 (checkpoint-4 saved)
    stage = tmp_path / "b" / "sft"
    assert json.loads((stage / "checkpoint-4" / "trainer_state.json").read_text())["global_step"] == 4
    cut = stage / "checkpoint-5"  # killed while saving: weights written, trainer_state.json never
    cut.mkdir()
    (cut / "model.safetensors").write_bytes(b"partial")
    assert last_checkpoint(stage) == str(stage / "checkpoint-4")

    resumed = run_sft(_cfg(tmp_path / "b", *args))
    history = _history(stage)
    steps = [h["step"] for h in history if "loss" in h]
    assert steps == [1, 2, 3, 4, 5, 6]  # 1-4 restored from the checkpoint, 5-6 trained now, none twice
    first, second = _tensors(straight / "model.safetensors"), _tensors(resumed / "model.safetensors")
    for k in first:
        torch.testing.assert_close(first[k], second[k], rtol=1e-4, atol=1e-5, msg=k)
    straight_losses = [h["loss"] for h in _history(tmp_path / "a" / "sft") if "loss" in h]
    assert [h["loss"] for h in history if "loss" in h] == pytest.approx(straight_losses, rel=1e-4)


def test_qlora_is_refused_on_cpu_before_anything_is_written(tmp_path):
    from vlmexp.train.sft import run_sft

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match=r"sft\.peft\.method = 'qlora'.*CUDA GPU.*method: lora"):
        run_sft(_cfg(tmp_path / "out", "sft.peft={method: qlora}"))
    assert not (tmp_path / "out").exists()
