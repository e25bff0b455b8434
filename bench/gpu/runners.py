"""How bench/gpu/harness.py runs each kind of case in its own process, and turns a stage's record into
figures."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WHEELS = REPO / ".whl"


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> dict:
    """Run `cmd` from the repository root; its output goes to `log`. Failure keeps the output's last lines."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1", **(env or {})}
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        with log.open("w") as f:
            rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env,
                                timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return {"status": f"failed: over the {timeout:.0f} s left in the budget",
                "log_tail": log.read_text()[-3000:]}
    if rc:
        return {"status": f"failed: exit status {rc}", "log_tail": log.read_text()[-3000:]}
    return {"status": "ok"}


def deepspeed_env(work: Path, timeout: float) -> tuple[dict | None, str]:
    """(environment for a process that imports deepspeed, or None; how it was found or why not)."""
    single = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517", "RANK": "0", "LOCAL_RANK": "0",
              "WORLD_SIZE": "1"}
    if importlib.util.find_spec("deepspeed"):
        return single, "installed"
    sdists = sorted(WHEELS.glob("deepspeed-*.tar.gz"))
    if not sdists:
        return None, "skipped: deepspeed not installed and no deepspeed sdist in .whl/"
    target = work / "ds-site"
    r = run_logged([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-build-isolation", "--target", str(target), str(sdists[-1])],
                   work / "logs" / "deepspeed-install.log", timeout, env={"DS_BUILD_OPS": "0"})
    if r["status"] != "ok":
        return None, (f"skipped: DS_BUILD_OPS=0 pip install {sdists[-1].name} {r['status']}: "
                      f"{r['log_tail'][-500:]}")
    path = os.pathsep.join([str(target), str(REPO), os.environ.get("PYTHONPATH", "")])
    return {**single, "PYTHONPATH": path}, f"installed from {sdists[-1].name}"


def run_case(name: str, case: dict, config: Path, work: Path, tiny: bool, timeout: float, hide: str = "",
             out: Path | None = None) -> dict:
    """Run one case; return {'status': ..., and the raw record of what it measured}. A case with
    `profile_step` leaves its torch.profiler trace and operator table in `out`/traces/<case>/."""
    log, record = work / "logs" / f"{name}.log", work / "records" / f"{name}.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    env = None
    if case["kind"] == "autoprocessor":
        if not importlib.util.find_spec("torchvision"):
            return {"status": "skipped: torchvision not installed (AutoProcessor needs it for Qwen-VL)"}
        model_dir = json.loads(Path(config).with_name("model.json").read_text())["model_dir"]
        cmd = [sys.executable, "-c", (
            "import json, sys; from transformers import AutoProcessor; "
            "p = AutoProcessor.from_pretrained(sys.argv[1]);"
            "json.dump({k: type(getattr(p, k, None)).__name__ for k in ('image_processor', "
            "'video_processor', 'tokenizer')} | {'processor': type(p).__name__}, open(sys.argv[2], 'w'))"),
               model_dir, str(record)]
    elif case["kind"] == "demo":  # one seed of the embedded demo; its cell JSON is the record
        demo_dir = work / "demo"
        cmd = [sys.executable, str(REPO / "bench" / "demo_matrix.py"), "--seeds", "42", "--arithmetic",
               "avx2", "--out-dir", str(demo_dir),
               *(["data.demo.train=16", "data.demo.val=4", "sft.args.max_steps=2", "grpo.args.max_steps=1"]
                 if tiny else []),
               *case.get("overrides", [])]
        record = demo_dir / "seed42-avx2.json"
    elif case["kind"] == "gpu_grpo":
        cmd = [sys.executable, str(REPO / "bench" / "gpu_grpo.py"), "--repeats", "2", "--out", str(record),
               *(["--tiny"] if tiny else []), *case.get("args", [])]
    else:
        if case["kind"] == "deepspeed":
            env, how = deepspeed_env(work, timeout)
            if env is None:
                return {"status": how}
        cmd = [sys.executable, str(HERE / "stage.py"), case["stage"], str(config), str(record),
               *case["overrides"], f"run.output_dir={work / 'runs' / name}", "--hide", hide]
        if case.get("profile_step"):
            cmd += ["--profile-step", str(case["profile_step"]), "--trace-dir",
                    str((out or work) / "traces" / name)]
    result = run_logged(cmd, log, timeout, env)
    runs = work / "runs" / name
    # the case's saved model (7.5 GB at the 3B shape, full): the record has what it measured
    if runs.is_dir():
        shutil.rmtree(runs)
    if result["status"] == "ok":
        result["record"] = json.loads(record.read_text())
    return result


def median_after_warmup(values: list[float]) -> float | None:
    """Median over all steps but the first (kernels, allocator and caches warm up in it)."""
    values = values[1:] if len(values) > 1 else values
    return statistics.median(values) if values else None


def per_step_tokens(logs: list[dict]) -> list[float]:
    """TRL logs `num_tokens` as a running total: the tokens of each step are its differences."""
    totals = [log["num_tokens"] for log in logs if "num_tokens" in log]
    return [b - a for a, b in zip([0.0, *totals], totals)]


def stage_figures(rec: dict, peak_tflops: float, generations: int) -> dict:
    """Per-step medians: time, tokens/s, MFU (model FLOPs against the measured bf16 matmul peak), GPU
    memory."""
    steps = rec["steps"]
    # FLOPs per parameter and token: forward 2 + backward 4 (LoRA: no weight gradients, 2)
    k = 4 if rec["peft"] else 6
    med = {key: median_after_warmup([s.get(key, 0.0) for s in steps])
           for key in ("step_s", "generation_s", "generate_and_score_s", "logprob_pass_s")}
    tokens = median_after_warmup(per_step_tokens(rec["logs"]))
    compiled = [log for log in rec["logs"] if "generation/compilations" in log]
    out = {"steps": len(steps), "step_s": med["step_s"], "tokens_per_step": tokens,
           "compilations": compiled[-1]["generation/compilations"] if compiled else None,
           "unexplained_compilations": (compiled[-1]["generation/unexplained_compilations"]
                                        if compiled else None),
           "peak_gpu_memory_gib": max((s["peak_gpu_memory_gib"] for s in steps if "peak_gpu_memory_gib" in s),
                                      default=None),
           "trainable_parameters": rec["trainable_parameters"], "lm_parameters": rec["lm_parameters"],
           "processor_class": rec.get("processor_class"), "imported": rec["imported"], "peft": rec["peft"],
           "flops_per_parameter_token": k}
    busy = med["step_s"]
    if rec["stage"] == "grpo":
        out["guard_s"] = median_after_warmup([s.get("guard_s", 0.0) for s in steps])
        lengths = [log["completions/mean_length"] for log in rec["logs"] if "completions/mean_length" in log]
        completions = rec.get("completions_per_step", generations)  # G a prompt x prompts a step
        generated = median_after_warmup(lengths) * completions if lengths else None
        busy = med["step_s"] - med["generate_and_score_s"]
        out.update(generation_s=med["generation_s"], logprob_pass_s=med["logprob_pass_s"],
                   generate_and_score_s=med["generate_and_score_s"], update_s=busy,
                   generated_tokens_per_step=generated,
                   generation_tokens_per_s=(generated / med["generation_s"]
                                            if generated and med["generation_s"] else None))
    out["tokens_per_s"] = tokens / busy if tokens and busy else None
    out["mfu"] = k * rec["lm_parameters"] * tokens / busy / (peak_tflops * 1e12) if tokens and busy else None
    return out


def summarise(result: dict, generations: int, peak_tflops: float) -> dict:
    """The case's entry in results.json: status, figures (stage cases), the raw record."""
    rec = result.get("record")
    if result["status"] != "ok" or rec is None or "steps" not in rec:
        return result
    return {**result, "figures": stage_figures(rec, peak_tflops, generations)}
