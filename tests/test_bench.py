"""The benchmarks run here at small sizes, so they keep working between the runs that record figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_pipeline_bench_splits_the_wall_time_by_prefect_log_timestamps():
    import datetime

    sys.path.insert(0, str(REPO / "bench"))
    from pipeline_overhead import prefect_phases

    start = datetime.datetime(2026, 11, 21, 23, 59, 58).timestamp()
    log = "\n".join([
        "23:59:59.000 | INFO    | prefect - Starting temporary server on http://127.0.0.1:8814",
        ("00:00:04.500 | INFO    | Flow run 'bold-lab' - Beginning flow run 'bold-lab' for flow "
         "'vlm-pipeline'"),
        "00:00:05.000 | INFO    | Task run 'train-stage-0c0' - running python -m vlmexp.cli train sft",
        "00:00:09.000 | INFO    | Task run 'train-stage-0c0' - Finished in state Completed()",
        "some subprocess line without a timestamp",
        "00:00:12.000 | INFO    | Task run 'train-stage-1ab' - Finished in state Completed()",
        "00:00:12.250 | INFO    | Flow run 'bold-lab' - Finished in state Completed()",
    ])
    phases = prefect_phases(log, start, start + 15.0)
    assert phases == {"python and prefect import": 1.0, "temporary server start": 5.5, "train-stage": 7.5,
                      "flow end": 0.25, "exit after the last log line": 0.75}


@pytest.fixture(scope="module")
def grpo_shared(tmp_path_factory) -> Path:
    """The tiny model and the sampled demo data the GRPO benches train from, built once for the runs here by
    their own prepare_shared (a one-step `vlmexp train sft`); each run links it in with --shared."""
    sys.path.insert(0, str(REPO / "bench"))
    from grpo_overhead import prepare_shared

    work = tmp_path_factory.mktemp("grpo-bench")
    prepare_shared(work)
    return work / "shared"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["processes", "in-process"])
def test_grpo_overhead_bench_times_both_sides_on_the_same_work(tmp_path, mode, grpo_shared):
    out = tmp_path / "r.json"
    flags = ["--in-process"] if mode == "in-process" else []
    r = subprocess.run([sys.executable, "bench/grpo_overhead.py", "--rounds", "1", "--steps", "4",
                        "--prompts-per-step", "1", *flags, "--shared", str(grpo_shared), "--out", str(out)],
                       capture_output=True, text=True, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["mode"] == mode
    assert result["args"]["gradient_accumulation_steps"] == 1 and result["args"]["num_generations"] == 8
    for side in ("plain_trl_step_s", "vlmexp_step_s"):  # 4 steps, the first two dropped as warm-up
        assert result[side]["n"] == 2 and result[side]["median"] > 0
    assert result["ratio"] == result["vlmexp_step_s"]["median"] / result["plain_trl_step_s"]["median"]
    if mode == "in-process":  # each step's whole turn: logging, batch, step, optimizer update
        turns = result["turn_s"]
        for side, step_s in (("plain", "plain_trl_step_s"), ("vlmexp", "vlmexp_step_s")):
            assert turns[side]["n"] == 2 and turns[side]["median"] >= result[step_s]["median"]
        assert result["turn_ratio"] == turns["vlmexp"]["median"] / turns["plain"]["median"]
    else:
        assert "turn_s" not in result
    # same prompt text, seed and arguments: both sides generate the same completions
    plain, ours = result["plain_completion_length"], result["vlmexp_completion_length"]
    assert 0 < plain <= 48 and abs(ours - plain) <= 0.02 * plain


@pytest.mark.slow
def test_grpo_defaults_bench_measures_each_variant(tmp_path, grpo_shared):
    out = tmp_path / "d.json"
    r = subprocess.run([sys.executable, "bench/grpo_defaults.py", "--rounds", "1", "--steps", "4",
                        "--prompts-per-step", "1", "--shared", str(grpo_shared), "--out", str(out)],
                       capture_output=True, text=True, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    variants = json.loads(out.read_text())["variants"]
    default = "defaults (beta 0, activation checkpointing on)"
    assert set(variants) == {default, "beta 0.04 (reference model)", "activation checkpointing off"}
    for v in variants.values():
        assert (v["step_s"]["n"] == 2 and v["turn_s"]["n"] == 2
                and v["turn_s"]["median"] >= v["step_s"]["median"])
        assert 0 < v["completion_length"] <= 48
    assert variants[default]["ratio_to_default"] == 1.0
    assert variants["beta 0.04 (reference model)"]["overrides"] == ["grpo.args.beta=0.04"]


GPU_CASES = {f"{stage}-{mode}-ckpt{ckpt}" for stage in ("sft", "dpo", "grpo") for mode in ("full", "lora64")
             for ckpt in ("on", "off")}
GPU_CASES |= {"autoprocessor", "grpo-mixed-sizes-lora64", "gpu_grpo_phases", "deepspeed-zero2-sft",
              "deepspeed-zero3-sft", "deepspeed-zero2-sft-lora64", "demo"}
SPEED_CASES = {"grpo-full-ckpton-eager", "grpo64-full-ckpton-eager", "grpo64-full-ckpton",
               "grpo64-full-ckpton-profile", "grpo64-full-ckptoff", "grpo64-full-ckpton-torch-compile",
               "raw-generate-compiled-8", "raw-generate-compiled-64", "grpo-mixed-sizes-lora64-eager",
               "demo-eager"}
GPU_CASES |= SPEED_CASES


def test_gpu_harness_dry_run_plans_every_case(tmp_path):
    r = subprocess.run([sys.executable, "bench/gpu/harness.py", str(tmp_path), "--dry-run"],
                       capture_output=True, text=True, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((tmp_path / "results.json").read_text())
    assert set(result) == {"shape", "environment", "budget_s", "cases"} and set(result["cases"]) == GPU_CASES
    shape = result["shape"]
    assert (shape["spec"], shape["dtype"], shape["side"], shape["G"], shape["new_tokens"]) == (
        "qwen2.5-vl-3b", "bfloat16", 448, 8, 256)
    assert all(c["status"] == "planned" for c in result["cases"].values())
    assert result["environment"]["packages"]["transformers"] and "device" in result["environment"]
    lora = result["cases"]["grpo-lora64-ckptoff"]["overrides"]
    assert any("r: 64" in o for o in lora) and "grpo.args.activation_checkpointing=false" in lora
    cases = result["cases"]
    assert cases["grpo-full-ckpton-eager"]["overrides"] == [*cases["grpo-full-ckpton"]["overrides"],
                                                            "generation.compile=off"]
    assert "grpo.args.steps_per_generation=8" in cases["grpo64-full-ckpton"]["overrides"]
    assert cases["grpo64-full-ckpton-profile"]["profile_step"] == 2
    # the two speed calls (--suite speed-a, --suite speed-b) measure every speed case and the compiled
    # defaults they are compared with; what a run selects is read from the harness itself, without a process
    # that imports torch for its environment
    harness = gpu_harness()
    suites = {suite: set(harness.selected(harness.all_cases(), suite=suite)) for suite in harness.SUITES}
    assert set(suites) == {"speed-a", "speed-b"} and all(suites[s] <= GPU_CASES for s in suites)
    assert suites["speed-a"] | suites["speed-b"] == SPEED_CASES | {"grpo-full-ckpton",
                                                                   "grpo-mixed-sizes-lora64", "demo"}
    assert harness.selected(harness.all_cases(), "demo,autoprocessor", "speed-a") == ["demo", "autoprocessor"]


def gpu_harness():
    """bench/gpu/harness.py as a module (it puts its folder on sys.path to import runners.py; put back
    after)."""
    import importlib.util

    path = sys.path[:]
    spec = importlib.util.spec_from_file_location("gpu_harness", REPO / "bench" / "gpu" / "harness.py")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
    return module


@pytest.mark.slow
def test_gpu_harness_tiny_trains_every_stage_and_the_speed_cases_without_mlflow_or_prefect(tmp_path):
    """One harness run at the tiny shape on CPU (one model build, one matmul peak, one results.json) over a
    case of each stage, then speed cases, mlflow and prefect made unimportable in the training processes (as
    on a GPU box that lacks them): each case trains and reports its figures; 64-completion GRPO leaves its
    profiler trace in the results folder; raw compiled generate (compiled on CPU, as on a GPU) is
    bench/gpu_grpo.py at the tiny shape. The budget is the timeout's, so no case is skipped on a loaded
    machine."""
    out = tmp_path / "out"
    cases = ["sft-lora64-ckpton", "dpo-full-ckptoff", "grpo-mixed-sizes-lora64", "grpo64-full-ckpton-profile",
             "raw-generate-compiled-8"]
    r = subprocess.run([sys.executable, "bench/gpu/harness.py", str(out), "--tiny", "--work",
                        str(tmp_path / "work"), "--budget-s", "1200", "--only", ",".join(cases)],
                       check=False, capture_output=True, text=True, cwd=REPO, timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((out / "results.json").read_text())
    assert (set(result["cases"]) == GPU_CASES and result["model_build_s"] > 0
            and result["matmul_peak_tflops"] > 0)
    sft, grpo = result["cases"]["sft-lora64-ckpton"], result["cases"]["grpo64-full-ckpton-profile"]
    assert sft["status"] == grpo["status"] == "ok", (sft.get("log_tail"), grpo.get("log_tail"))
    assert result["cases"]["sft-full-ckpton"]["status"] == "not selected"
    common = {"steps", "step_s", "tokens_per_step", "tokens_per_s", "mfu", "peak_gpu_memory_gib",
              "trainable_parameters", "lm_parameters", "processor_class", "imported", "peft"}
    assert common <= set(sft["figures"]) and sft["figures"]["peft"] == "lora"
    assert common | {"generation_s", "logprob_pass_s", "update_s", "generated_tokens_per_step",
                     "generation_tokens_per_s"} <= set(grpo["figures"])
    for case in (sft, grpo):
        f = case["figures"]
        assert f["steps"] == 3 and f["step_s"] > 0 and f["tokens_per_s"] > 0 and 0 < f["mfu"] < 1
        assert f["imported"]["mlflow"] is False and f["imported"]["prefect"] is False
    # a LoRA step trains the adapters only; 8 prompts x G 2 completions x 8 new tokens, EOS held back by
    # min_new_tokens
    assert sft["figures"]["trainable_parameters"] < sft["figures"]["lm_parameters"]
    assert grpo["record"]["completions_per_step"] == 2 * 8
    assert grpo["figures"]["generated_tokens_per_step"] == 2 * 8 * 8 and grpo["figures"]["update_s"] > 0
    # the update's profiler trace of the second step in the results folder
    trace = out / "traces" / "grpo64-full-ckpton-profile"
    assert (trace / "trace.json.gz").stat().st_size > 1000 and "Self CPU" in (trace / "ops.txt").read_text()
    # DPO on pairs of the model's own samples; GRPO over mixed image sizes, the pairing guard timed per step
    dpo, mixed = result["cases"]["dpo-full-ckptoff"], result["cases"]["grpo-mixed-sizes-lora64"]
    assert dpo["status"] == mixed["status"] == "ok", (dpo.get("log_tail"), mixed.get("log_tail"))
    assert (dpo["figures"]["steps"] == 3 and dpo["figures"]["peft"] is None
            and dpo["figures"]["tokens_per_s"] > 0)
    assert mixed["figures"]["steps"] == 3 and 0 < mixed["figures"]["guard_s"] < mixed["figures"]["step_s"]
    assert mixed["figures"]["generated_tokens_per_step"] == 8 * 2 * 4  # 8 prompts x G 2 x 4 new tokens
    # bench/gpu_grpo.py at the tiny shape, as the harness runs it: 8 sequences of exactly 16 new tokens (EOS
    # suppressed, so the token counts are fixed), generated compiled, each phase timed
    raw = result["cases"]["raw-generate-compiled-8"]
    assert raw["status"] == "ok", raw.get("log_tail")
    rec = raw["record"]
    assert rec["shape"] == "tiny" and rec["G"] == 8 and rec["new_tokens"] == 16 and rec["compiled_generation"]
    assert rec["generation_tokens_per_s"] > 0 and rec["update_tokens_per_s"] > 0
    assert (0 < rec["update_mfu"] < 1
            and set(rec["phases_s"]) == {"generation_s", "logprob_pass_s", "update_s"})


@pytest.mark.slow
def test_grpo_guard_bench_times_the_guard_per_step(tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "bench/grpo_guard.py", "--steps", "3", "--prompts-per-step", "2",
                        "--new-tokens", "4", "--out", str(out)],
                       check=False, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(out.read_text())
    assert (result["image_grids_in_data"] >= 3
            and "grpo.args.gradient_accumulation_steps=2" in result["overrides"])
    assert 0 < result["guard_s_per_step"]["median"] < result["step_time_s"]["median"]


@pytest.mark.slow
def test_demo_matrix_bench_writes_a_cell_per_arithmetic_and_the_readme_table(tmp_path):
    """One cell: SFT, GRPO and DPO from the same SFT model, under an arithmetic set by environment, in its own
    process; the JSON says what the process computed with; --table writes between the README's markers."""
    out = tmp_path / "cells"
    r = subprocess.run([sys.executable, "bench/demo_matrix.py", "--seeds", "3", "--arithmetic", "default",
                        "--threads", "1", "--dpo", "configs/demo_dpo.yaml", "--out-dir", str(out),
                        "data.demo.train=16", "data.demo.val=4", "sft.args.max_steps=2",
                        "sft.args.per_device_train_batch_size=8", "grpo.args.max_steps=1",
                        "grpo.args.per_device_train_batch_size=8", "grpo.args.max_completion_length=4",
                        "dpo.args.max_steps=1", "dpo.pairs.num_samples=3", "dpo.pairs.max_new_tokens=12",
                        "grpo.rewards=[{name: 'rewards_for_tests:char_variety'}]", "eval.max_new_tokens=4"],
                       check=False, capture_output=True, text=True, cwd=REPO, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(REPO / "tests")})  # the test reward gives pairs
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    cell = json.loads((out / "seed3-default.json").read_text())
    assert cell["torch_cpu_capability"] == "DEFAULT" and cell["threads"] == 1 and cell["torch_threads"] == 1
    assert cell["environment"]["ATEN_CPU_CAPABILITY"] == "default" and cell["seed"] == 3
    assert (set(cell["metrics"]) == {"base", "sft", "grpo", "dpo"}
            and set(cell["gains_over_sft"]) == {"grpo", "dpo"})
    assert all(k in cell["gains_over_sft"]["grpo"] for k in ("gain", "se", "better", "worse"))
    assert list(cell["seconds"]) == ["start-up", "sft", "grpo", "dpo", "evaluation"]
    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- demo-table:start -->\nold\n<!-- demo-table:end -->\ntail\n")
    t = subprocess.run([sys.executable, "bench/demo_matrix.py", "--table", "--out-dir", str(out), "--readme",
                        str(readme)], check=False, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert t.returncode == 0, t.stderr
    text = readme.read_text()
    assert ("old" not in text and "| 3 | default |" in text
            and text.endswith("<!-- demo-table:end -->\ntail\n"))
    bad = subprocess.run([sys.executable, "bench/demo_matrix.py", "--table", "--out-dir",
                          str(tmp_path / "none")],
                         check=False, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert bad.returncode != 0 and "no cell JSON" in bad.stderr


@pytest.mark.slow
def test_sft_checkpoints_bench_evaluates_every_checkpoint_with_and_without_the_tool(tmp_path):
    """One SFT run of the zoom demo saving each step; each checkpoint and the final model evaluated on the
    held-out records, with the tool and without."""
    out = tmp_path / "probe.json"
    r = subprocess.run([sys.executable, "bench/sft_checkpoints.py", "--config", "configs/demo_zoom.yaml",
                        "--seed", "3", "--out", str(out), "data.zoom_demo.train=8", "data.zoom_demo.val=2",
                        "sft.args.max_steps=2", "sft.args.save_steps=1",
                        "sft.args.per_device_train_batch_size=4", "eval.max_new_tokens=8"],
                       check=False, capture_output=True, text=True, cwd=REPO, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    record = json.loads(out.read_text())
    assert record["seed"] == 3 and record["torch_threads"] == 1 and record["sft_s"] > 0
    assert list(record["evals"])[:2] == ["checkpoint-1", "checkpoint-2"] and len(record["evals"]) == 3
    for metrics in record["evals"].values():
        assert metrics["count"] == metrics["tool_count"] == 2 and "tool_zoom_on_target" in metrics


def _recorded_cells(markers_name: str, folder: Path) -> list[dict]:
    """The cells in `folder`, after checking that the README's table between bench/demo_matrix.py's markers
    (`markers_name`: MARKERS or ZOOM_MARKERS) is the table it makes of them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_matrix", REPO / "bench" / "demo_matrix.py")
    matrix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(matrix)
    markers = getattr(matrix, markers_name)
    readme = (REPO / "README.md").read_text()
    start, end = (readme.index(m) for m in markers)
    assert readme[start + len(markers[0]):end].strip() == matrix.table(folder).strip(), (
        f"README table between {markers[0]} and {markers[1]} is stale: run .venv/bin/python "
        f"bench/demo_matrix.py --table --out-dir {folder.relative_to(REPO)} --readme README.md")
    return [json.loads(p.read_text()) for p in folder.glob("seed*.json")]


def test_readme_demo_table_is_the_recorded_matrix():
    """The README's demo table is generated from bench/results/demo_matrix/*.json and claims what they
    show."""
    cells = _recorded_cells("MARKERS", REPO / "bench" / "results" / "demo_matrix")
    assert ({c["seed"] for c in cells} >= {42, 7, 1}
            and {c["arithmetic"] for c in cells} >= {"default", "avx2"})
    for c in cells:  # the README's claim, cell by cell: GRPO >= +0.03 and 3 paired SE, DPO >= 2 paired SE
        g = c["gains_over_sft"]["grpo"]
        assert g["gain"] >= 0.03 and g["gain"] >= 3 * g["se"], (c["seed"], c["arithmetic"], "grpo", g)
        if (d := c["gains_over_sft"].get("dpo")) is not None:
            assert d["gain"] >= 2 * d["se"], (c["seed"], c["arithmetic"], "dpo", d)
        assert c["metrics"]["grpo"]["rec_acc50"] >= c["metrics"]["sft"]["rec_acc50"]


def test_readme_zoom_table_is_the_recorded_matrix():
    """The README's zoom table is generated from bench/results/demo_zoom/*.json and claims what they show,
    cell by cell (seeds 42 and 7 on both arithmetics, 1,000 held-out records): the base model answers nothing
    in form; with the tool the SFT and GRPO models zoom on every record and read what a zoom shows, the tool
    adding 10 paired SE or more; without it SFT guesses; GRPO answers better than SFT with the tool in every
    cell, by 3 paired SE or more, and its zooms hold the whole target more often than SFT's in every cell (the
    README's zoom text names the figures)."""
    cells = _recorded_cells("ZOOM_MARKERS", REPO / "bench" / "results" / "demo_zoom")
    recorded = {(c["seed"], c["arithmetic"]) for c in cells}
    assert recorded == {(seed, arithmetic) for seed in (42, 7) for arithmetic in ("avx2", "default")}
    for c in cells:
        m, cell = c["metrics"], (c["seed"], c["arithmetic"])
        assert m["base"]["exact_accuracy"] == m["base"]["tool_exact_accuracy"] == 0.0, cell
        assert m["grpo"]["count"] == m["grpo"]["tool_count"] == 1000, cell
        assert 0.2 <= m["sft"]["exact_accuracy"] <= 0.3, cell  # a guess: 0.25, four colours held out equally
        for stage in ("sft", "grpo"):
            assert m[stage]["tool_zooms_per_answer"] >= 0.99, (cell, stage)
            assert m[stage]["exact_accuracy"] <= 0.3, cell
            gain = c["tool_gains_over_no_tool"][stage]  # with the tool, over the same model without it
            assert gain["gain"] > 0 and gain["gain"] >= 10 * gain["se"], (cell, stage, gain)
        rl = c["tool_gains_over_sft"]["grpo"]  # GRPO over SFT, both with the tool
        assert rl["gain"] > 0 and rl["gain"] >= 3 * rl["se"], (cell, rl)
        held = m["sft"]["tool_zoom_on_target"], m["grpo"]["tool_zoom_on_target"]
        assert held[1] > held[0], (cell, held)


@pytest.mark.slow
def test_rl_loop_bench_records_validation_cost_and_the_filter(tmp_path):
    small = ["data.demo.train=8", "data.demo.val=4", "sft.args.max_steps=2",
             "sft.args.per_device_train_batch_size=4", "grpo.args.max_steps=2",
             "grpo.args.per_device_train_batch_size=8", "grpo.args.num_generations=4",
             "grpo.args.logging_steps=1", "grpo.args.max_completion_length=8",
             "grpo.difficulty_filter.num_samples=2",
             "grpo.rewards=[{name: 'rewards_for_tests:odd_rows_vary'}]", "eval.max_new_tokens=8",
             "eval.during_training_samples=2"]
    r = subprocess.run([sys.executable, "bench/rl_loop.py", "--seeds", "3", "--arms", "plain", "filtered",
                        "--every", "1", "--out-dir", str(tmp_path),
                        "--work", str(tmp_path), *small], check=False, capture_output=True, text=True,
                       cwd=REPO, timeout=900,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])})
    assert r.returncode == 0, r.stderr[-3000:]
    record = json.loads((tmp_path / "seed3.json").read_text())
    assert record["stages"]["sft"]["validations"] == 2 and record["stages"]["plain"]["validations"] == 2
    assert 0 < record["stages"]["plain"]["validation_share"] < 1
    assert record["stages"]["filtered"]["difficulty_filter"]["kept"] == 4  # the odd rows of 8
    assert (set(record["gains_over_sft"]) == {"plain", "filtered"}
            and "per_grpo_second" in record["gains_over_sft"]["plain"])
    assert not list(tmp_path.glob("rl_loop-seed3-*"))  # the seed's folder is removed without --keep
