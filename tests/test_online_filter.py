"""GRPO's online filter (grpo.online_filter): the config's refusals, the TRL shapes it relies on, and real
GRPO steps on the tiny Qwen2.5-VL whose rewards (tests/rewards_for_tests.py) make known groups flat or out of
band: the groups trained are exactly the kept ones, refilled from new prompts; the metrics reach MLflow, also
after a resume; the zoom tool's multi-turn groups are filtered; when the rounds run out the filled groups
train nothing; two torchrun processes filter alike."""

from __future__ import annotations

import ast
import inspect
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vlmexp.checks.loader import load_config
from vlmexp.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
ODD = "grpo.rewards=[{name: 'rewards_for_tests:odd_rows_vary'}]"  # even source rows: flat groups
BAND = "grpo.rewards=[{name: 'rewards_for_tests:band_by_row'}]"  # group mean by source_row % 4
MIXED = ["data.demo.width=[84,196]", "data.demo.height=[84,196]"]  # prompts of many lengths and grids
STEPS = ["grpo.args.per_device_train_batch_size=8", "grpo.args.num_generations=4",
         "grpo.args.gradient_accumulation_steps=1", "grpo.args.max_completion_length=8",
         "grpo.args.logging_steps=1", "grpo.args.warmup_steps=0", "grpo.args.learning_rate=0.01"]


@pytest.mark.parametrize(("overrides", "message"), [
    (["grpo.online_filter.key=accuracy", "grpo.online_filter.low=0.1"],
     "online_filter.key 'accuracy' is not std, overall nor one of grpo.rewards ['format', 'iou']"),
    (["grpo.online_filter.low=0.1"], "key std drops the groups whose rewards are all equal and has no "
                                     "bounds"),
    (["grpo.online_filter.key=iou"], "key 'iou' judges a group's mean against low/high and neither is set"),
    (["grpo.online_filter.key=overall", "grpo.online_filter.low=0.5", "grpo.online_filter.high=0.5"],
     "low (0.5) must be below high (0.5)"),
    (["grpo.online_filter.max_extra_rounds=-1"], "greater than or equal to 0"),
    (["grpo.online_filter.refill=half"], "grpo.online_filter.refill = 'half': Input should be 'whole' or "
                                         "'needed'"),
])
def test_config_refusals(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "configs/demo.yaml", overrides)
    assert message in str(e.value) and "grpo" in str(e.value)


def test_off_by_default_and_allowed_with_tools():
    cfg = load_config(REPO / "configs/demo.yaml", ["grpo.online_filter.key=iou",
                                                   "grpo.online_filter.low=0.1"])
    assert not cfg.grpo.online_filter.enabled and cfg.grpo.online_filter.max_extra_rounds == 4
    from vlmexp.config.stages import GRPOStageConfig

    GRPOStageConfig(online_filter={"enabled": True}, tools={"names": ["zoom"]})  # unlike difficulty_filter


def _output_keys(function) -> set[str]:
    """The keys `function` writes into its `output` dict: `output = {...}` and `output[...] = ...`."""
    tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(function)))
    keys = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (isinstance(target, ast.Name) and target.id == "output"
                        and isinstance(node.value, ast.Dict)):
                    keys |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
                if (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name)
                        and target.value.id == "output" and isinstance(target.slice, ast.Constant)):
                    keys.add(target.slice.value)
    return keys


def test_the_trl_shapes_the_filter_relies_on():
    """Fails, naming what moved, when TRL changes a method the filter overrides or calls, or adds an output
    key the merge of rounds does not know."""
    from trl import GRPOTrainer
    from trl.trainer import utils

    from vlmexp.train.online_filter import PAD_SIDE, PER_SAMPLE, RECOUNTED

    def params(f):
        return list(inspect.signature(f).parameters)

    assert params(GRPOTrainer._generate_and_score_completions) == ["self", "inputs"]
    assert params(GRPOTrainer._calculate_rewards) == ["self", "inputs", "prompts", "completions",
                                                      "completion_ids_list"]
    assert params(utils.split_pixel_values_by_grid) == params(utils.unsplit_pixel_values_by_grid) == ["batch"]
    assert params(utils.pad)[:3] == ["tensors", "padding_value", "padding_side"]
    attributes = inspect.getsource(GRPOTrainer.__init__) + inspect.getsource(GRPOTrainer.training_step)
    for name in ("self.reward_weights", "self.num_generations", "self._tokenizer", "self._step",
                 "self._metrics"):
        assert name in attributes, name
    keys = _output_keys(GRPOTrainer._generate_and_score_completions)
    assert {"prompt_ids", "completion_mask", "advantages", "num_items_in_batch", "pixel_values"} <= keys
    unknown = keys - set(PAD_SIDE) - set(PER_SAMPLE) - set(RECOUNTED)
    assert not unknown, f"TRL's generation output has keys the online filter's merge table lacks: {unknown}"
    # TRL counts the loss's tokens as the filter recounts them
    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert "num_items_in_batch = self.accelerator.gather(loss_mask.sum()).sum()" in source
    assert "completion_mask if tool_mask is None else completion_mask * tool_mask" in source


def _cfg(out: Path, model: Path, *overrides: str):
    return load_config(REPO / "configs/demo.yaml", [
        f"run.output_dir={out}", f"model.path={model}", "tracking.backend=none", "sft.enabled=false",
        "data.demo.train=12", "data.demo.val=2", *MIXED, "grpo.online_filter.enabled=true", *STEPS,
        *overrides])


def _train(cfg, refills: list[int] | None = None):
    """Train the GRPO stage of `cfg`; (trainer, the generation batches the loss got, the labels of their
    records' rows that train: advantages and completion mask not zeroed). `refills` gets each extra round's
    rows."""
    from vlmexp.train.grpo import build_grpo_trainer
    from vlmexp.train.grpo_pairing import EXPECTED
    from vlmexp.train.stage import train_and_save

    trainer, inputs, rows = build_grpo_trainer(cfg)
    batches, generate = [], trainer._generate_and_score_completions
    if refills is not None:
        refill = trainer._refill
        trainer._refill = lambda size, *rest: refills.append(size) or refill(size, *rest)

    def keep(generation_batch):  # the merged batch, as TRL's _prepare_inputs receives it
        batches.append(output := generate(generation_batch))
        return output

    trainer._generate_and_score_completions = keep
    train_and_save(trainer, inputs, rows)
    trained = [[label for (label, *_), live in zip(b[EXPECTED], b["completion_mask"].any(1), strict=True)
                if live] for b in batches]
    return trainer, batches, trained


def _row(label: str) -> int:
    return int(label.removeprefix("record "))


def _logged(trainer, name: str) -> list[float]:
    return [h[name] for h in trainer.state.log_history if name in h]


@pytest.mark.slow
def test_flat_groups_are_dropped_and_refilled_from_new_prompts(tmp_path, tiny_models):
    """odd_rows_vary: even source rows score flat. Each step's 2 groups are refilled until both are odd rows,
    and the merged batch is whole: 8 rows, token counts recounted, a pixel row block per sample (the pairing
    guard checks every micro-batch against its record), images of several sizes."""
    from vlmexp.train.grpo_pairing import EXPECTED

    trainer, batches, trained = _train(_cfg(tmp_path, tiny_models["qwen2_5_vl"], ODD, "grpo.args.max_steps=3",
                                            "grpo.online_filter.max_extra_rounds=8"))
    assert len(batches) == 3 and all(len(t) == 8 for t in trained)
    assert len({tuple(layout.flatten().tolist()) for b in batches for _, _, layout, _ in b[EXPECTED]}) > 1
    assert all(_row(label) % 2 for t in trained for label in t)
    for batch in batches:
        assert batch["num_items_in_batch"].item() == batch["completion_mask"].sum().item()
        assert batch["advantages"].abs().min() > 0.5  # every kept group has signal
    generated = _logged(trainer, "online_filter/groups_generated")
    assert _logged(trainer, "online_filter/groups_kept") == [2.0] * 3 and max(generated) > 2
    # a round may bring more in-band groups than the batch still needs: those are left out
    flat = _logged(trainer, "online_filter/dropped_flat")
    assert max(flat) > 0 and all(0 <= g - 2 - f < 2 for g, f in zip(generated, flat, strict=True))
    assert _logged(trainer, "online_filter/groups_short") == [0.0] * 3
    assert max(_logged(trainer, "online_filter/rounds")) > 0
    assert all(s > 0 for s in _logged(trainer, "online_filter/generation_seconds"))


@pytest.mark.slow
def test_a_needed_refill_generates_about_the_missing_groups(tmp_path, tiny_models):
    """refill: needed, 4 groups a step: each extra round generates the groups still missing over the step's
    in-band share so far, fewer than a batch when most were kept; the batch still holds 4 odd rows' groups."""
    from vlmexp.train.online_filter import refill_groups

    refills = []
    cfg = _cfg(tmp_path, tiny_models["qwen2_5_vl"], ODD, "grpo.args.max_steps=3",
               "grpo.args.per_device_train_batch_size=16", "grpo.online_filter.max_extra_rounds=8",
               "grpo.online_filter.refill=needed")
    trainer, _, trained = _train(cfg, refills)
    assert all(len(t) == 16 for t in trained) and all(_row(label) % 2 for t in trained for label in t)
    assert _logged(trainer, "online_filter/groups_kept") == [4.0] * 3
    assert _logged(trainer, "online_filter/groups_short") == [0.0] * 3
    assert refills and all(r % 4 == 0 and r <= 16 for r in refills) and min(refills) < 16
    assert sum(_logged(trainer, "online_filter/groups_generated")) == 3 * 4 + sum(refills) // 4
    opts = trainer.online_filter
    assert [refill_groups(opts, 4, s, k, g) for s, k, g in ((1, 3, 4), (3, 1, 4), (2, 0, 4), (1, 6, 8))] == [
        2, 4, 4, 2]
    whole = opts.model_copy(update={"refill": "whole"})
    assert refill_groups(whole, 4, 1, 3, 4) == 4


@pytest.mark.slow
def test_a_band_keeps_exactly_the_groups_whose_mean_lies_in_it(tmp_path, tiny_models):
    """band_by_row: means 0.05, 0.3, 0.55, 0.8 by source_row % 4; the band (0.2, 0.6) keeps rows 1 and 2.
    A generation batch of 2 groups serves 2 steps (steps_per_generation) twice (num_iterations): TRL then
    keeps the old log-probabilities, merged with the rest."""
    trainer, batches, trained = _train(_cfg(
        tmp_path, tiny_models["qwen2_5_vl"], BAND, "grpo.args.max_steps=8", "grpo.online_filter.key=overall",
        "grpo.online_filter.low=0.2", "grpo.online_filter.high=0.6", "grpo.online_filter.max_extra_rounds=8",
        "grpo.args.per_device_train_batch_size=4", "grpo.args.steps_per_generation=2",
        "grpo.args.num_iterations=2"))
    assert len(batches) == 2 and all(len(t) == 8 for t in trained)
    assert all(b["old_per_token_logps"].shape == b["completion_ids"].shape for b in batches)
    assert {_row(label) % 4 for t in trained for label in t} <= {1, 2}
    dropped = [lo + hi for lo, hi in zip(_logged(trainer, "online_filter/dropped_low"),
                                         _logged(trainer, "online_filter/dropped_high"), strict=True)]
    assert max(dropped) > 0 and all(0 <= g - 2 - d < 2 for g, d in zip(
        _logged(trainer, "online_filter/groups_generated"), dropped, strict=True))


@pytest.mark.slow
def test_when_the_rounds_run_out_the_filled_groups_train_nothing(tmp_path, tiny_models, caplog):
    """A band no group reaches (every mean is at most 0.85): after one extra round the batch is filled with
    dropped groups, advantages and completion masks zeroed, and the step leaves the weights as they were;
    the same step without the filter moves them."""
    import torch

    def weights(folder: Path):
        from safetensors.torch import load_file

        return load_file(folder / "grpo" / "final" / "model.safetensors")

    args = (BAND, "grpo.args.max_steps=1", "grpo.online_filter.key=overall", "grpo.online_filter.low=0.9",
            "grpo.online_filter.max_extra_rounds=1")
    with caplog.at_level(logging.WARNING, logger="vlmexp.train"):
        trainer, batches, trained = _train(_cfg(tmp_path / "short", tiny_models["qwen2_5_vl"], *args))
    assert "trained on 0 of 2 groups in band after 1 extra rounds" in caplog.text
    assert _logged(trainer, "online_filter/groups_short") == [2.0] and trained == [[]]
    [batch] = batches
    assert not batch["advantages"].any() and batch["num_items_in_batch"].item() == 0
    from safetensors.torch import load_file

    base = load_file(Path(tiny_models["qwen2_5_vl"]) / "model.safetensors")
    after = weights(tmp_path / "short")
    assert all(torch.equal(base[k], after[k]) for k in base)
    _train(_cfg(tmp_path / "plain", tiny_models["qwen2_5_vl"], *args, "grpo.online_filter.enabled=false"))
    moved = weights(tmp_path / "plain")
    assert any(not torch.equal(base[k], moved[k]) for k in base)


def _history(client, run, name: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]


@pytest.mark.slow
def test_the_metrics_reach_mlflow_and_a_resumed_run_goes_on_filtering(tmp_path, tiny_models, mlflow_store):
    """Step 1 saves a checkpoint and stops; a second run resumes there and filters again at step 2. Each run's
    online_filter/* metrics are read back from the MLflow store."""
    from mlflow.tracking import MlflowClient

    out = mlflow_store(tmp_path / "out")
    resumed = []
    for step in (1, 2):
        trainer, _, trained = _train(_cfg(out, tiny_models["qwen2_5_vl"], ODD, f"grpo.args.max_steps={step}",
                                          "grpo.args.save_steps=1", "tracking.backend=mlflow",
                                          "grpo.online_filter.max_extra_rounds=8"))
        resumed.append(trainer.state.global_step)
        assert trained[-1] and all(_row(label) % 2 for label in trained[-1])
    assert resumed == [1, 2] and (out / "grpo" / "checkpoint-1").is_dir()

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("demo").experiment_id], order_by=["start_time"])
    assert [_history(client, r, "online_filter/groups_kept") for r in runs] == [[(1, 2.0)], [(2, 2.0)]]
    for run in runs:
        for name in ("groups_generated", "dropped_low", "dropped_high", "dropped_flat", "rounds",
                     "generation_seconds", "groups_short"):
            assert len(_history(client, run, f"online_filter/{name}")) == 1, name
        generated = _history(client, run, "online_filter/groups_generated")[0][1]
        flat = _history(client, run, "online_filter/dropped_flat")[0][1]
        assert generated >= 2 + flat and _history(client, run, "online_filter/groups_short")[0][1] == 0


def _scripted_zoom_trainer(tmp_path: Path, tiny_models, *band: str):
    """A GRPO trainer over four scripted zoom records (tests/test_zoom.py), 4 groups of 2 in one step, the
    filter keyed on the exact reward with `band`."""
    from test_zoom import scripted, tool_cfg, write_records

    from vlmexp.train.grpo import build_grpo_trainer

    records = write_records(tmp_path / "data", ["zoom", "outside", "malformed", "forever"])
    cfg = tool_cfg(tmp_path / "out", tiny_models["qwen2_5_vl"], records, "grpo.args.max_steps=1",
                   "grpo.args.per_device_train_batch_size=8", "grpo.args.num_generations=2",
                   "grpo.args.gradient_accumulation_steps=1", "grpo.online_filter.enabled=true",
                   "grpo.online_filter.key=exact", *band)
    trainer, inputs, rows = build_grpo_trainer(cfg)
    scripted(trainer.model, inputs.processor, inputs.family, inputs.budget)
    return trainer, inputs, rows


@pytest.mark.slow
def test_the_zoom_tools_multi_turn_groups_are_filtered(tmp_path, tiny_models):
    """Four scripted records (tests/test_zoom.py): two answer right (one after a zoom), two never do; key
    exact with low 0.5 keeps the first two, and a second round of the same records fills the batch with them.
    The pairing guard checks every micro-batch's images and crops against its record and environment."""
    from vlmexp.train.grpo_pairing import EXPECTED
    from vlmexp.train.stage import train_and_save

    trainer, inputs, rows = _scripted_zoom_trainer(tmp_path, tiny_models, "grpo.online_filter.low=0.5")
    batches, generate = [], trainer._generate_and_score_completions

    def keep(generation_batch):
        batches.append(output := generate(generation_batch))
        return output

    trainer._generate_and_score_completions = keep
    train_and_save(trainer, inputs, rows)
    [batch] = batches
    labels = [label for label, *_ in batch[EXPECTED]]
    assert sorted(labels) == ["record 0"] * 4 + ["record 1"] * 4 and batch["completion_mask"].any(1).all()
    assert batch["num_images"] and max(batch["num_images"]) == 2  # the zoom's crop travelled with its rows
    logs = {k: v for h in trainer.state.log_history for k, v in h.items()}
    assert (logs["online_filter/groups_kept"], logs["online_filter/dropped_low"], logs["online_filter/rounds"]
            ) == (4, 4, 1)


@pytest.mark.slow
def test_filled_groups_keep_their_crops_in_the_forward_and_train_nothing(tmp_path, tiny_models):
    """A band no zoom-run group reaches and no extra round: the batch is filled with dropped groups, among
    them rows whose completions hold the tool's crops. Their tool mask takes them out of the loss while their
    completion mask, the forward's attention, keeps every crop: the step runs and the pairing guard sees each
    row's images whole. Zeroed completion masks, as the fill once had, hide the crops from Qwen-VL's rope
    index (each later row then takes another image's grid): the guard refuses such a batch."""
    import copy

    import torch

    from vlmexp.train.grpo_pairing import PairingError, check_pairing
    from vlmexp.train.stage import train_and_save

    trainer, inputs, rows = _scripted_zoom_trainer(tmp_path, tiny_models, "grpo.online_filter.low=0.1",
                                                   "grpo.online_filter.high=0.5",
                                                   "grpo.online_filter.max_extra_rounds=0")
    batches, prepare = [], trainer._prepare_inputs

    def keep(generation_batch):
        batches.append(batch := prepare(generation_batch))  # the micro-batch the loss gets, guard passed
        return batch

    trainer._prepare_inputs = keep
    train_and_save(trainer, inputs, rows)
    [batch] = batches
    crops = [i for i, n in enumerate(batch["num_images"]) if n > 1]
    assert crops and len(crops) < len(batch["num_images"])  # rows with crops beside rows without
    assert not batch["advantages"].any() and batch["num_items_in_batch"].item() == 0
    assert batch["completion_mask"].any(1).all() and not batch["tool_mask"].any()
    logs = {k: v for h in trainer.state.log_history for k, v in h.items()}
    assert (logs["online_filter/groups_kept"], logs["online_filter/groups_short"]) == (0, 4)
    hidden = copy.copy(batch)
    hidden["completion_mask"] = batch["completion_mask"].clone()
    hidden["completion_mask"][crops] = 0
    with pytest.raises(PairingError, match=f"sample {crops[0]} .*an image masked out of the forward"):
        check_pairing(hidden, inputs.family, inputs.budget, trainer.image_token_id, 0)
    assert torch.equal(hidden["prompt_mask"], batch["prompt_mask"])


@pytest.mark.slow
def test_two_torchrun_processes_filter_their_own_groups(tmp_path, tiny_models):
    """Two CPU processes, one group each per step: both refill until their group has signal, as many rounds
    as the one furthest short; the metrics, summed over the processes, in the stage's metrics.jsonl."""
    import json

    r = subprocess.run([sys.executable, "-m", "vlmexp.cli", "train", "grpo", "--config", "configs/demo.yaml",
                        f"run.output_dir={tmp_path}", f"model.path={tiny_models['qwen2_5_vl']}",
                        "tracking.backend=none", "data.demo.train=12", "data.demo.val=2", *STEPS,
                        "grpo.args.per_device_train_batch_size=4", "grpo.args.max_steps=1",
                        "grpo.args.save_steps=1", ODD, "grpo.online_filter.enabled=true",
                        "grpo.online_filter.max_extra_rounds=8", "launch.launcher=torchrun",
                        "launch.nproc_per_node=2"],
                       capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])})
    assert r.returncode == 0, r.stderr[-3000:]
    [logged] = [m for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()
                if "online_filter/groups_kept" in (m := json.loads(line))]
    assert (logged["online_filter/groups_kept"], logged["online_filter/groups_short"]) == (2, 0)
    assert logged["online_filter/groups_generated"] >= 2 + logged["online_filter/dropped_flat"]


def test_judging_and_merging_by_hand():
    """The verdicts on literal rewards (unscored completions left out), and the merge of two rounds: each key
    padded on its side, the token types cut at the prompt, an unknown key of another shape refused."""
    import torch

    from vlmexp.config.stages import OnlineFilterConfig
    from vlmexp.train.online_filter import OnlineFilterError, join, judge

    nan, weights = float("nan"), torch.tensor([1.0, 0.5])
    rewards = torch.tensor([[1, 0], [1, 0], [0, 0], [1, 0], [nan, nan], [1, 0], [nan, nan], [nan, nan]])
    assert judge(rewards, weights, 2, OnlineFilterConfig(), None) == [
        ("flat", 0.0), ("kept", 0.0), ("flat", 0.0), ("flat", 0.0)]
    band = OnlineFilterConfig(key="overall", low=0.2, high=0.8)
    assert judge(rewards, weights, 2, band, None) == [
        ("high", pytest.approx(0.2)), ("kept", 0.0), ("high", pytest.approx(0.2)), ("low", float("inf"))]
    assert judge(rewards, weights, 2, OnlineFilterConfig(key="x", high=0.1), 1)[0] == ("kept", 0.0)

    def part(prompt: int, completion: int, **extra):
        return {"prompt_ids": torch.full((1, prompt), 7), "completion_ids": torch.full((1, completion), 8),
                "completion_mask": torch.ones(1, completion, dtype=torch.long),
                "mm_token_type_ids": torch.tensor([[1] * prompt + [0] * completion]),
                "advantages": torch.ones(1), "num_images": [1], **extra}

    merged = join([part(2, 3), part(4, 1)], pad_token_id=0)
    assert merged["prompt_ids"].tolist() == [[0, 0, 7, 7], [7, 7, 7, 7]]
    assert merged["completion_ids"].tolist() == [[8, 8, 8], [8, 0, 0]]
    assert merged["completion_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert merged["mm_token_type_ids"].tolist() == [[0, 0, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0]]
    assert merged["num_images"] == [1, 1] and merged["advantages"].tolist() == [1.0, 1.0]
    with pytest.raises(OnlineFilterError, match="'new_key' has shapes \\[\\[1, 2\\], \\[1, 3\\]\\]"):
        join([part(2, 3, new_key=torch.zeros(1, 2)), part(2, 3, new_key=torch.zeros(1, 3))], pad_token_id=0)
