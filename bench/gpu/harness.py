"""Both training stages at Qwen2.5-VL-3B's shape on one GPU, results as JSON.

    bench/gpu/run.sh OUT_DIR                 # on the GPU box (installs .whl/ first; see bench/gpu/README.md)
    python bench/gpu/harness.py OUT_DIR [--tiny] [--dry-run] [--only CASE,...] [--budget-s 540]

Cases (each a fresh process, `bench/gpu/stage.py`, i.e. `vlmexp train` in-process plus a step recorder): SFT,
DPO and GRPO x full / LoRA r 64 x activation checkpointing on / off, random weights at the 3B shape (bf16,
sdpa, 448 x 448 images, GRPO 8 generations x 256 new tokens; DPO's pairs from the model's own samples), then
the `AutoProcessor` check, GRPO with 8 prompts of mixed image sizes a step (the pairing guard's cost), the
GRPO phase benchmark (bench/gpu_grpo.py), DeepSpeed ZeRO-2 and ZeRO-3 for two SFT steps when it installs, and
the embedded demo (bench/demo_matrix.py, one seed) on the GPU. Cases run in that order (or --only's) until
--budget-s is spent; the rest are recorded as skipped. OUT_DIR/results.json is rewritten after every case, so
a run cut off still leaves what it measured. `--tiny` runs the same at the tiny shape on CPU (what CI tests);
`--dry-run` writes the plan and the environment without training.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(HERE)]

from runners import run_case, summarise  # noqa: E402 - beside this file

PACKAGES = ("torch", "torchvision", "transformers", "trl", "peft", "accelerate", "datasets", "tokenizers",
            "pydantic", "deepspeed", "mlflow", "prefect", "flash-attn", "vllm")
LORA = ["{stage}.peft={{method: lora, r: 64, alpha: 128, dropout: 0.0}}"]


def stage_cases() -> dict[str, dict]:
    cases = {}
    for stage in ("sft", "dpo", "grpo"):
        for mode, peft in (("full", []), ("lora64", LORA)):
            for ckpt in ("on", "off"):
                cases[f"{stage}-{mode}-ckpt{ckpt}"] = {
                    "kind": "stage", "stage": stage,
                    "overrides": [o.format(stage=stage) for o in peft]
                    + [f"{stage}.args.activation_checkpointing={'true' if ckpt == 'on' else 'false'}"]
                    + (["grpo.rewards=[{name: 'pair_reward:char_variety', weight: 1.0}]"]
                       if stage == "dpo" else [])}
    return cases


def mixed_size_case(s: dict) -> dict:
    """GRPO with 8 prompts per optimizer step whose images differ in size (224-672 pixels a side, so several
    image grids in every generation batch): what the pairing guard (vlmexp/train/grpo_pairing.py) costs."""
    side = s["side"]
    return {"kind": "stage", "stage": "grpo", "overrides": [
        LORA[0].format(stage="grpo"), "grpo.args.activation_checkpointing=true",
        f"data.demo.width=[{max(64, side // 2)},{side * 3 // 2}]",
        f"data.demo.height=[{max(64, side // 2)},{side * 3 // 2}]",
        "grpo.args.gradient_accumulation_steps=8", f"grpo.args.max_completion_length={s['new_tokens'] // 2}",
        f"grpo.args.generation_kwargs={{min_new_tokens: {s['new_tokens'] // 2}}}"]}


EAGER = ["generation.compile=off"]  # generation as before the generation section: eager, dynamic cache
# 64 completions a step (8 prompts x 8), generated in one call and trained as 8 micro-batches of 8 (on-policy)
SIXTY_FOUR = ["grpo.args.gradient_accumulation_steps=8", "grpo.args.steps_per_generation=8"]


def speed_cases() -> dict[str, dict]:
    """Generation and update speed: each figure before (generation.compile=off, what the pipeline did before
    the generation section) and after (the default on CUDA: compiled, static cache, prompt buckets), same
    call."""
    grpo = stage_cases()["grpo-full-ckpton"]

    def with_args(*extra: str) -> dict:
        return {**grpo, "overrides": [*grpo["overrides"], *extra]}

    return {"grpo-full-ckpton-eager": with_args(*EAGER),
            "grpo64-full-ckpton-eager": with_args(*SIXTY_FOUR, *EAGER),
            "grpo64-full-ckpton": with_args(*SIXTY_FOUR),
            # the update's time at 64 completions: a torch.profiler trace of the second step into
            # OUT_DIR/traces
            "grpo64-full-ckpton-profile": {**with_args(*SIXTY_FOUR), "profile_step": 2},
            # lean-update trials: activation checkpointing off (memory allowing), the model compiled for
            # training
            "grpo64-full-ckptoff": with_args(*SIXTY_FOUR, "grpo.args.activation_checkpointing=false"),
            "grpo64-full-ckpton-torch-compile": with_args(*SIXTY_FOUR, "grpo.args.torch_compile=true"),
            # raw `generate` at the same shape, compiled (static cache): what generation through TRL is
            # held to
            "raw-generate-compiled-8": {"kind": "gpu_grpo", "args": ["--generations", "8", "--compile"]},
            "raw-generate-compiled-64": {"kind": "gpu_grpo", "args": ["--generations", "64", "--compile",
                                                                              "--generate-only"]}}


def all_cases(tiny: bool = False) -> dict[str, dict]:
    zero = {z: {"kind": "deepspeed", "stage": "sft", "overrides": [
        "launch.deepspeed=" + str(REPO / f"configs/deepspeed/{z}.json"), "sft.args.max_steps=2"]}
        for z in ("zero2", "zero3")}
    mixed = mixed_size_case(shape(tiny))
    return {**stage_cases(), **speed_cases(), "autoprocessor": {"kind": "autoprocessor"},
            "grpo-mixed-sizes-lora64": mixed,
            "grpo-mixed-sizes-lora64-eager": {**mixed, "overrides": [*mixed["overrides"], *EAGER]},
            "gpu_grpo_phases": {"kind": "gpu_grpo"},
            "deepspeed-zero2-sft": zero["zero2"], "deepspeed-zero3-sft": zero["zero3"],
            # ZeRO-2 on one GPU partitions nothing: full fine-tuning's fp32 master weights and Adam states
            # (16 bytes a parameter) do not fit 80 GB at 3.75 B; with LoRA they are the adapters' only
            "deepspeed-zero2-sft-lora64": {**zero["zero2"], "overrides": [*zero["zero2"]["overrides"],
                                                                        LORA[0].format(stage="sft")]},
            "demo": {"kind": "demo"}, "demo-eager": {"kind": "demo", "overrides": EAGER}}


# the speed targets in two device calls of under 10 minutes each (bench/gpu/README.md)
SUITES = {"speed-a": ["grpo-full-ckpton-eager", "grpo-full-ckpton", "raw-generate-compiled-8",
                      "raw-generate-compiled-64", "grpo64-full-ckpton-eager", "grpo64-full-ckpton"],
          "speed-b": ["grpo64-full-ckpton-profile", "grpo-mixed-sizes-lora64-eager",
                      "grpo-mixed-sizes-lora64", "demo-eager", "demo", "grpo64-full-ckptoff",
                      "grpo64-full-ckpton-torch-compile"]}


def selected(cases: dict[str, dict], only: str = "", suite: str | None = None) -> list[str]:
    """The cases a run measures, in order: --only's (comma-separated), else --suite's, else every case."""
    return [c for c in only.split(",") if c] or SUITES.get(suite) or list(cases)


def shape(tiny: bool) -> dict:
    """What the cases run at: the 3B shape on GPU, the tiny one on CPU."""
    if tiny:
        return dict(spec="tiny", dtype="float32", bf16=False, side=112, G=2, new_tokens=8, sft_steps=3,
                    grpo_steps=3, sft_batch=2)
    return dict(spec="qwen2.5-vl-3b", dtype="bfloat16", bf16=True, side=448, G=8, new_tokens=256, sft_steps=6,
                grpo_steps=3, sft_batch=8)


def write_config(work: Path, model_dir: Path, s: dict) -> Path:
    import yaml

    side = s["side"]
    args = dict(logging_steps=1, save_strategy="no", bf16=s["bf16"], learning_rate=1e-6)
    cfg = {
        "run": {"name": "gpu-bench", "output_dir": str(work / "run"), "seed": 0},
        "model": {"path": str(model_dir), "dtype": s["dtype"], "attn_implementation": "sdpa",
                  "min_pixels": 3136, "max_pixels": side * side},
        "data": {"demo": {"train": 64, "val": 8, "seed": 0, "width": [side, side], "height": [side, side],
                          "objects": [1, 1], "background": "gradient"}, "system_prompt": None},
        "sft": {"args": {**args, "max_steps": s["sft_steps"], "per_device_train_batch_size": s["sft_batch"],
                         "max_length": 4096}},
        # pairs from the model's own samples, scored by pair_reward.py (random weights score 0 on IoU)
        "dpo": {"enabled": True, "pairs": {"from": "samples", "num_samples": 2, "temperature": 1.0,
                                           "max_new_tokens": max(8, s["new_tokens"] // 4), "min_margin": 0.0,
                                           "batch_size": s["sft_batch"]},
                "args": {**args, "max_steps": s["sft_steps"], "per_device_train_batch_size": s["sft_batch"],
                         "max_length": 4096}},
        "grpo": {"args": {**args, "max_steps": s["grpo_steps"], "per_device_train_batch_size": s["G"],
                          "num_generations": s["G"], "max_completion_length": s["new_tokens"], "beta": 0.0,
                          "temperature": 1.0, "generation_kwargs": {"min_new_tokens": s["new_tokens"]}},
                 "rewards": [{"name": "format", "weight": 1.0}, {"name": "iou", "weight": 1.0}]},
        "tracking": {"backend": "none"},
        "launch": {"launcher": "local"},
    }
    path = work / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def environment() -> dict:
    import torch

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    cuda = torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name() if cuda else "cpu", "cuda": cuda,
            "python": sys.version.split()[0], "packages": versions}


def matmul_peak_tflops(tiny: bool) -> float:
    sys.path.insert(0, str(REPO / "bench"))
    import torch
    from gpu_grpo import matmul_peak

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return matmul_peak(device, dtype, 1024 if tiny else 8192) / 1e12


def build_model(work: Path, s: dict) -> tuple[Path, float]:
    import torch

    from vlmexp.tiny import SHAPES, TinySpec, make_tiny_model

    t = time.perf_counter()
    spec = TinySpec() if s["spec"] == "tiny" else SHAPES[s["spec"]]
    device = "cuda" if torch.cuda.is_available() else None
    folder = make_tiny_model(work / "model", "qwen2_5_vl", spec,
                             dtype=None if s["spec"] == "tiny" else s["dtype"], device=device)
    torch.cuda.empty_cache() if device else None
    return folder, time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="folder for results.json and the per-case logs")
    parser.add_argument("--tiny", action="store_true", help="tiny shape on CPU (what CI runs)")
    parser.add_argument("--dry-run", action="store_true",
                        help="write the plan and environment, train nothing")
    parser.add_argument("--only", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--suite", choices=sorted(SUITES), default=None,
                        help="a named list of cases (--only's alternative): " + "; ".join(
                            f"{k}: {', '.join(v)}" for k, v in SUITES.items()))
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="stop starting cases after this many seconds")
    parser.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--hide", default="mlflow,prefect",
                        help="packages the training processes must not import (made unimportable there)")
    args = parser.parse_args()
    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = all_cases(args.tiny)
    wanted = selected(cases, args.only, args.suite)
    unknown = sorted(set(wanted) - set(cases))
    if unknown:
        parser.error(f"--only: unknown case(s) {', '.join(unknown)}; choose from {', '.join(cases)}")
    s = shape(args.tiny)
    results = {"shape": s, "environment": environment(), "budget_s": args.budget_s,
               "cases": {name: {"status": "planned" if name in wanted else "not selected", **cases[name]}
                         for name in cases}}
    save = lambda: (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")  # noqa: E731
    save()
    if args.dry_run:
        return
    work = Path(args.work or tempfile.mkdtemp(prefix="vlmexp-gpu-"))
    model_dir, results["model_build_s"] = build_model(work, s)
    results["matmul_peak_tflops"] = matmul_peak_tflops(args.tiny)
    config = write_config(work, model_dir, s)
    (work / "model.json").write_text(json.dumps({"model_dir": str(model_dir)}))
    for name in wanted:
        left = args.budget_s - (time.perf_counter() - start)
        if left < 20:
            results["cases"][name]["status"] = "skipped: time budget spent"
            continue
        result = run_case(name, cases[name], config=config, work=work, tiny=args.tiny, timeout=left,
                          hide=args.hide, out=out)
        results["cases"][name].update(summarise(result, s["G"], results["matmul_peak_tflops"]))
        save()
    results["wall_s"] = time.perf_counter() - start
    save()
    print(json.dumps({n: c["status"] for n, c in results["cases"].items()}, indent=1))


if __name__ == "__main__":
    main()
