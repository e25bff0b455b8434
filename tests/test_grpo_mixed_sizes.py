"""GRPO with images of different sizes: many prompts per generation batch train, each completion is scored
against its own record, and the pairing guard stops a run whose completions meet the wrong images."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import SMALL_BATCHES

from vlmexp.checks.loader import load_config

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
sys.path.insert(0, str(Path(__file__).parent))  # rewards_for_tests

MIXED = ["data.demo.train=16", "data.demo.val=4", "data.demo.width=[64,90]", "data.demo.height=[64,90]"]
REWARDS = "grpo.rewards=[{name: 'rewards_for_tests:record_check'}, {name: 'rewards_for_tests:char_variety'}]"


def _cfg(out, *overrides):
    return load_config(REPO / "configs/demo.yaml", [f"run.output_dir={out}", "tracking.backend=none",
                                                    *SMALL_BATCHES, *MIXED,
                                                    "grpo.args.max_completion_length=4",
                                                    "grpo.args.temperature=1.5", "grpo.args.logging_steps=1",
                                                    "grpo.args.save_steps=100", REWARDS, *overrides])


def _records(cfg):
    from vlmexp.data.record import read_sampled
    from vlmexp.data.run_data import prepare_data

    return {r.source_row: r for r in read_sampled(prepare_data(cfg).train)}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_the_guards_expected_grid_is_the_processors_for_any_size_and_budget(tiny_models, family):
    """No false alarm on real data: sizes below min_pixels, above max_pixels, odd, tall and wide."""
    from PIL import Image

    from vlmexp.families import detect_family
    from vlmexp.processor import load_processor

    sizes = [[64, 64], [333, 217], [84, 140], [1000, 90], [90, 700], [2048, 1536], [29, 57]]
    for min_pixels, max_pixels in ((3136, 102400), (3136, 12845056), (65536, 262144)):
        fam = detect_family(tiny_models[family])
        proc = load_processor(tiny_models[family], fam, {"min_pixels": min_pixels, "max_pixels": max_pixels})
        got = proc.image_processor(images=[Image.new("RGB", tuple(s)) for s in sizes], return_tensors="pt")
        budget = fam.image_budget(proc)
        assert [fam.image_layout([s], budget).tolist()[0] for s in sizes] == got["image_grid_thw"].tolist()


def test_mixed_sizes_train_8_prompts_x_8_per_step_each_scored_against_its_own_record(tmp_path):
    import rewards_for_tests
    import torch

    from vlmexp.train.grpo import build_grpo_trainer
    from vlmexp.train.stage import train_and_save

    # 8 prompts x 8 completions per optimizer step, in 2 micro-batches of 4 prompts each (fewer, larger
    # micro-batches than one prompt each: the same samples in less time on 2 CPU cores)
    cfg = _cfg(tmp_path, "grpo.args.max_steps=2", "grpo.args.per_device_train_batch_size=32",
               "grpo.args.gradient_accumulation_steps=2", "grpo.args.num_generations=8")
    records = _records(cfg)
    trainer, inputs, rows = build_grpo_trainer(cfg)
    sizes = {tuple(map(tuple, r.image_sizes)) for r in records.values()}
    grids = {tuple(inputs.family.image_layout(r.image_sizes, inputs.budget).flatten().tolist())
             for r in records.values()}
    assert len(sizes) >= 3 and len(grids) >= 3, (sizes, grids)
    check = rewards_for_tests.record_check
    check.records, check.mismatches, check.seen = records, [], 0
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}

    train_and_save(trainer, inputs, rows)

    assert trainer.state.global_step == 2
    assert check.seen == 2 * 8 * 8 and check.mismatches == []  # 8 prompts x 8 completions per step
    key = "rewards/rewards_for_tests:record_check/mean"
    assert [h[key] for h in trainer.state.log_history if key in h] == [1.0, 1.0]
    changed = [n for n, p in trainer.model.named_parameters()
               if p.requires_grad and not torch.equal(p, before[n])]
    assert changed, "GRPO changed no parameter"
    assert trainer.guard_seconds > 0


def _rotate_after_shuffle(monkeypatch, keys):
    """TRL's shuffle, except what `keys` hold moves one sample on (the kind of slip a future TRL could
    make)."""
    from trl.trainer import grpo_trainer

    shuffle = grpo_trainer.shuffle_sequence_dict

    def shuffled_then_rotated(batch):
        out = shuffle(batch)
        for key in keys:
            out[key] = out[key][1:] + out[key][:1]
        return out

    monkeypatch.setattr(grpo_trainer, "shuffle_sequence_dict", shuffled_then_rotated)


def _mispair(monkeypatch):
    """The images move one sample on."""
    _rotate_after_shuffle(monkeypatch, ("pixel_values", "image_grid_thw"))


def _right_pad(monkeypatch):
    """The trl 1.16 fault this project fixes: a processor that pads on the right."""
    monkeypatch.setattr("vlmexp.train.grpo_pairing.left_pad", lambda processor: None)


def _drop_images(monkeypatch):
    """What GRPOTrainer does when a sample's image-token count does not match its grids ('Drop all
    images')."""
    from trl import GRPOTrainer

    generate = GRPOTrainer._generate_and_score_completions

    def dropped(self, inputs):
        out = generate(self, inputs)
        for key in ("pixel_values", "image_grid_thw", "num_images"):
            out.pop(key, None)
        return out

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", dropped)


PAIRED_WRONG = r"completions paired with images that are not their prompt's .*"


@pytest.mark.parametrize(("breakage", "message"), [
    (_mispair, PAIRED_WRONG + (r"sample \d+ \(record \d+\): "
                               r"(grid \[\[1, \d+, \d+\]\], its record's \[\[1, \d+, \d+\]\]|"
                               r"pixels of another image)")),
    (_right_pad, PAIRED_WRONG + r"image-token types do not line up with its image tokens"),
    (_drop_images, (r"the records of this batch have \d+ image\(s\) but the batch reaching the loss "
                    r"has none: TRL dropped the images of the whole batch")),
])
def test_the_guard_stops_a_broken_pairing_before_the_first_update(tmp_path, monkeypatch, breakage, message):
    import rewards_for_tests
    import torch

    from vlmexp.train.grpo import run_grpo
    from vlmexp.train.grpo_pairing import PairingError

    cfg = _cfg(tmp_path, "grpo.args.max_steps=1", "grpo.args.per_device_train_batch_size=4",
               "grpo.args.gradient_accumulation_steps=4", "grpo.args.num_generations=4")
    check = rewards_for_tests.record_check
    check.records, check.mismatches, check.seen = _records(cfg), [], 0
    breakage(monkeypatch)
    seen = []
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **k: seen.append(1))
    with pytest.raises(PairingError, match=r"GRPO step 0: " + message):
        run_grpo(cfg)
    assert not seen and not (tmp_path / "grpo" / "final").exists()


INTERNVL = ["model.path=tiny:internvl", "model.min_pixels=null", "model.max_pixels=null",
            "model.max_patches=6",
            "data.demo.width=[64,250]"]  # aspect ratios 0.7 to 3.9: 1 to 7 tiles an image


def test_internvl_tile_counts_differ_per_prompt_and_each_sample_keeps_its_own(tmp_path, monkeypatch):
    """TRL 1.16 carries InternVL's tiles per sample (`num_tiles`) through shuffle and split: 8 prompts x 4 per
    step over images of several tile counts train, each completion scored against its own record; the guard
    passes, and stops the same run when the tiles are moved to another sample."""
    import rewards_for_tests
    import torch

    from vlmexp.train.grpo import build_grpo_trainer
    from vlmexp.train.grpo_pairing import PairingError
    from vlmexp.train.stage import train_and_save

    steps = ["grpo.args.per_device_train_batch_size=16", "grpo.args.gradient_accumulation_steps=2",
             "grpo.args.num_generations=4"]
    cfg = _cfg(tmp_path / "ok", *INTERNVL, "grpo.args.max_steps=2", *steps)
    records = _records(cfg)
    trainer, inputs, rows = build_grpo_trainer(cfg)
    tiles = {inputs.budget.tiles(*r.image_sizes[0]) for r in records.values()}
    assert len(tiles) >= 3 and max(tiles) > 1, tiles
    check = rewards_for_tests.record_check
    check.records, check.mismatches, check.seen = records, [], 0
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    train_and_save(trainer, inputs, rows)
    assert trainer.state.global_step == 2 and check.seen == 2 * 8 * 4 and check.mismatches == []
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if p.requires_grad)
    assert trainer.guard_seconds > 0

    _rotate_after_shuffle(monkeypatch, ("pixel_values", "num_tiles"))  # InternVL's tiles move one sample on
    bad = _cfg(tmp_path / "bad", *INTERNVL, "grpo.args.max_steps=1", *steps)
    check.records = _records(bad)
    trainer, inputs, rows = build_grpo_trainer(bad)
    with pytest.raises(PairingError, match=r"GRPO step 0: completions paired with images that are not their "
                                           r"prompt's .*sample \d+ \(record \d+\): (tiles \[\d+\], its "
                                           r"record's \[\d+\]|pixels of another image)"):
        trainer.train()
    assert trainer.state.global_step == 0
