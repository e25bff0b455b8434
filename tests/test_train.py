"""Real TRL training steps on the tiny model (CPU): SFT learns, GRPO updates with per-reward metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from conftest import SMALL_BATCHES

from vlmexp.checks.loader import load_config

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def _cfg(tmp_path, *overrides):
    return load_config(REPO / "configs/demo.yaml", [f"run.output_dir={tmp_path}", "tracking.backend=none",
                                                    "data.demo.train=16", "data.demo.val=4", *SMALL_BATCHES,
                                                    *overrides])


def _deprecations(caught: list) -> list[str]:
    """transformers 5's "... is deprecated and will be removed in v6" warnings among `caught`."""
    return [str(w.message) for w in caught if "will be removed in v6" in str(w.message)]


def _log_history(stage_dir: Path) -> list[dict]:
    [ckpt] = sorted(stage_dir.glob("checkpoint-*"))
    return json.loads((ckpt / "trainer_state.json").read_text())["log_history"]


def test_sft_loss_falls_and_parameters_change(tmp_path):
    from vlmexp.train.sft import run_sft

    cfg = _cfg(tmp_path, "sft.args.max_steps=30", "sft.args.save_steps=30", "sft.args.logging_steps=5",
               "sft.args.per_device_train_batch_size=4")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        final = run_sft(cfg)
    assert not _deprecations(caught)
    [base] = (tmp_path / "models").glob("tiny-*")
    before, after = _weights(base), _weights(final)
    changed = [k for k in before if not (before[k] == after[k]).all()]
    assert any(k.startswith("model.layers.") for k in changed) and any("visual" in k for k in changed)
    losses = [h["loss"] for h in _log_history(tmp_path / "sft") if "loss" in h]
    assert len(losses) == 6 and losses[-1] < 0.8 * losses[0], losses
    assert (final / "processor_config.json").is_file()

    # `vlmexp eval` and `vlmexp score` share one scoring path: the model's completions, scored offline
    # from a predictions file, give the same metrics and per-sample scores
    from vlmexp.evaluate import evaluate, score_predictions

    records = tmp_path / "data" / "train.jsonl"
    result = evaluate(cfg, str(final), records, tmp_path / "eval")
    samples = [json.loads(line) for line in result.samples_path.read_text().splitlines()]
    preds = tmp_path / "predictions.jsonl"
    preds.write_text("".join(json.dumps({**json.loads(line), "completion": s["completion"]}) + "\n"
                             for line, s in zip(records.read_text().splitlines(), samples, strict=True)))
    metrics, rows = score_predictions(preds, "qwen2_5_vl", cfg.model.image_knobs)
    assert metrics == result.metrics and metrics["count"] == 16
    assert [r["score"] for r in rows] == [s["score"] for s in samples]
    assert {"image", "prompt", "completion", "answer", "score"} <= samples[0].keys()


def test_grpo_updates_and_logs_each_reward(tmp_path, capsys):
    from vlmexp.train.grpo import run_grpo

    sys.path.insert(0, str(Path(__file__).parent))
    cfg = _cfg(tmp_path, "grpo.args.max_steps=3", "grpo.args.save_steps=3", "grpo.args.logging_steps=1",
               "grpo.args.per_device_train_batch_size=4", "grpo.args.num_generations=4",
               "grpo.args.max_completion_length=12", "grpo.args.temperature=1.5",
               "grpo.rewards=[{name: format, weight: 0.5}, {name: iou}, "
               "{name: 'rewards_for_tests:char_variety'}, "
               "{name: 'rewards_for_tests:sometimes_broken'}]")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        final = run_grpo(cfg)
    assert not _deprecations(caught)  # no FutureWarning per step (activation checkpointing is on by default)
    [base] = (tmp_path / "models").glob("tiny-*")
    before, after = _weights(base), _weights(final)
    assert any(not (before[k] == after[k]).all() for k in before), "GRPO changed no parameter"
    history = [h for h in _log_history(tmp_path / "grpo") if "reward" in h]
    assert len(history) == 3
    for key in ("rewards/format/mean", "rewards/iou/mean", "rewards/rewards_for_tests:char_variety/mean",
                "frac_reward_zero_std", "completions/mean_length", "clip_ratio/region_mean"):
        assert key in history[0], key
    assert any(h["rewards/rewards_for_tests:char_variety/std"] > 0 for h in history)
    # a reward with NaN, inf and None scores: masked and counted, and no weight becomes NaN or inf
    import torch

    masked = {k.rsplit("/", 1)[1]: v for h in history for k, v in h.items()
              if k.startswith("rewards/rewards_for_tests:sometimes_broken/masked/")}
    assert set(masked) == {"nan", "inf", "none"}, masked
    assert all(torch.isfinite(v).all() for v in after.values())
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    # the terminal: one progress line a logging step with the reward and the IoU reward's mean (the format
    # reward's left out), no dict of metrics; every metric in the stage's metrics.jsonl
    shown = capsys.readouterr()
    lines = [line for line in shown.out.splitlines() if line.startswith("grpo  step ")]
    assert [line.split()[2] for line in lines] == ["1/3", "2/3", "3/3"], shown.out
    assert all(" left  reward " in line and "  iou " in line and "format" not in line
               for line in lines), lines
    assert "{'loss'" not in shown.out + shown.err and "'reward'" not in shown.out + shown.err
    assert "Writing model shards" not in shown.err, shown.err[-2000:]  # no bar at checkpoint-3's save
    assert "grpo  done: 3 steps in" in shown.out and str(tmp_path / "grpo" / "metrics.jsonl") in shown.out
    logged = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in logged if "reward" in h] == [1, 2, 3]
    assert all(key in logged[0] for key in ("rewards/format/mean", "frac_reward_zero_std",
                                            "clip_ratio/region_mean"))


def test_train_cli_runs_a_stage_without_mlflow(tmp_path):
    """With tracking none a stage needs no mlflow: it trains in a Python where mlflow cannot be imported (as
    on a GPU machine without it; where it is installed, TRL and DeepSpeed import it themselves). Run with
    `--verbose`, it shows the Trainer's dict of metrics at each logging step, in place of the progress line
    (tests/test_train.py's GRPO test checks the line)."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\n"
                                           "sys.modules['mlflow'] = None  # import mlflow fails\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hide), str(REPO)])}
    r = subprocess.run([sys.executable, "-m", "vlmexp.cli", "train", "sft", "--config",
                        str(REPO / "configs/demo.yaml"), f"run.output_dir={tmp_path}",
                        "tracking.backend=none", "data.demo.train=8", "data.demo.val=2",
                        "sft.args.max_steps=2", "sft.args.save_steps=2", "sft.args.logging_steps=1",
                        "--verbose"],
                       capture_output=True, text=True, cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("{'loss': ") == 2 and "sft  step " not in r.stdout, r.stdout[-2000:]
    assert "Writing model shards" in r.stderr, r.stderr[-2000:]  # the saves' bars too
    assert (tmp_path / "sft" / "final" / "model.safetensors").is_file()
    assert (tmp_path / "sft" / "checkpoint-2" / "trainer_state.json").is_file()
    hidden = subprocess.run([sys.executable, "-c", "import mlflow"], capture_output=True, text=True, env=env)
    assert hidden.returncode != 0 and "ModuleNotFoundError" in hidden.stderr


def test_a_stage_run_by_hand_logs_to_the_configured_store(tmp_path):
    """No environment handoff: the stage process finds its store in the config, starts a run of its own there,
    and leaves nothing in its working folder (no ./mlflow.db, no ./mlruns)."""
    from mlflow.tracking import MlflowClient

    store, cwd = f"sqlite:///{tmp_path / 'store.db'}", tmp_path / "cwd"
    cwd.mkdir()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "vlmexp.cli", "train", "sft", "--config",
                        str(REPO / "configs/demo.yaml"), f"run.output_dir={tmp_path / 'out'}",
                        "tracking.backend=mlflow", f"tracking.tracking_uri={store}", "data.demo.train=8",
                        "data.demo.val=2", "sft.args.max_steps=2", "sft.args.save_steps=2",
                        "sft.args.logging_steps=1", "tracking.system_metrics=false"],
                       capture_output=True, text=True, cwd=cwd, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert list(cwd.iterdir()) == []
    client = MlflowClient(store)
    [run] = client.search_runs([client.get_experiment_by_name("demo").experiment_id])
    assert run.info.run_name == "demo-sft" and run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2]
    # switched off (on: tests/test_flow.py)
    assert not [k for k in run.data.metrics if k.startswith("system/")]


def test_a_stage_samples_only_when_the_files_are_not_what_the_config_asks_for(tmp_path, monkeypatch):
    """Decided from files, the same for a stage run by hand and one the pipeline starts after sampling."""
    from vlmexp.train.stage import prepare_stage

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    first = prepare_stage(_cfg(tmp_path), "sft").train_path
    assert len(first.read_text().splitlines()) == 16
    stamp = first.stat().st_mtime_ns
    prepare_stage(_cfg(tmp_path), "sft")  # the files are what this config asks for: kept as they are
    assert first.stat().st_mtime_ns == stamp
    # the data section changed since the last run into this folder: the stage trains on the new sample
    prepare_stage(_cfg(tmp_path, "data.demo.train=10"), "sft")
    assert len(first.read_text().splitlines()) == 10
    # the sampled file no longer holds what its manifest records: sampled again
    first.write_text(first.read_text().splitlines()[0] + "\n")
    prepare_stage(_cfg(tmp_path, "data.demo.train=10"), "sft")
    assert len(first.read_text().splitlines()) == 10
    # a source file changed (here only its modification time): sampled again
    stamp = first.stat().st_mtime_ns
    [source] = tmp_path.glob("demo_data-10-*/train.json")
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10**9))
    prepare_stage(_cfg(tmp_path, "data.demo.train=10"), "sft")
    assert first.stat().st_mtime_ns != stamp
