"""One training stage as `vlmexp train` runs it in-process, with a callback that records each step.

    python bench/gpu/stage.py sft|dpo|grpo CONFIG RECORD.json [key=value ...] [--hide mlflow,prefect]

`--hide` makes those packages unimportable in this process, as on a GPU box that lacks them (CI checks
that `tracking.backend: none` trains without mlflow and prefect that way).

`vlmexp train` (launcher local) calls `run_sft(cfg)` / `run_dpo(cfg)` / `run_grpo(cfg)`; this calls the same
functions (`run_grpo` is `build_grpo_trainer` + `train_and_save`, done here in two steps so the GRPO phases
can be timed) with `StepRecorder` among the trainer's callbacks, and writes what it saw to RECORD.json:
per optimizer step its wall time, GRPO's generation / log-prob / update split and the seconds its pairing
guard took, the tokens TRL counted, peak GPU memory; and which of mlflow / prefect the run imported.
`--profile-step N --trace-dir DIR` (GRPO) records a torch.profiler trace of optimizer step N into DIR.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

from transformers import TrainerCallback

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepRecorder(TrainerCallback):
    """Wall time of each optimizer step (CUDA synchronised) and the phase times `timed` adds to `phases`."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.phases: dict[str, float] = {}
        self.logs: list[dict] = []
        self._t0 = 0.0
        self.model_info: dict = {}
        self.trainer = None  # GRPO: the trainer whose pairing guard's seconds each step records

    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        self.model_info = {**parameter_counts(model), "processor_class": type(processing_class).__name__}

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds

    def on_step_begin(self, args, state, control, **kwargs):
        sync()
        self.phases, self._t0 = {}, time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        import torch

        sync()
        step = {"step": state.global_step, "step_s": time.perf_counter() - self._t0, **self.phases}
        if self.trainer is not None:  # the guard's running total, less what the earlier steps took
            step["guard_s"] = self.trainer.guard_seconds - sum(s["guard_s"] for s in self.steps)
        if torch.cuda.is_available():
            step["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        self.steps.append(step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append({"step": state.global_step, **{k: v for k, v in (logs or {}).items()
                                                         if isinstance(v, (int, float))}})


class StepProfile(TrainerCallback):
    """A torch.profiler trace of one optimizer step (CPU and CUDA activity, with shapes): trace.json.gz (open
    in Perfetto or chrome://tracing) and ops.txt, the operators by total CUDA (else CPU) time, in `folder`."""

    def __init__(self, step: int, folder: Path):
        self.step, self.folder, self.profiler = step, folder, None

    def on_step_begin(self, args, state, control, **kwargs):
        import torch

        if state.global_step + 1 == self.step:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self.profiler.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        import gzip
        import shutil

        import torch

        if self.profiler is None or state.global_step != self.step:
            return
        sync()
        self.profiler.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        raw = self.folder / "trace.json"
        self.profiler.export_chrome_trace(str(raw))
        with raw.open("rb") as f, gzip.open(self.folder / "trace.json.gz", "wb") as z:
            shutil.copyfileobj(f, z)
        raw.unlink()
        key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        (self.folder / "ops.txt").write_text(self.profiler.key_averages().table(sort_by=key, row_limit=60))
        self.profiler = None


def timed(recorder: StepRecorder, phase, method):
    """Wrap a bound method so each call's synchronised wall time is added to `phase(args)`'s total."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        sync()
        t = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            sync()
            recorder.add(phase(), time.perf_counter() - t)

    return wrapper


def instrument_grpo(trainer, recorder: StepRecorder) -> None:
    """Time TRL's generation, the whole generate-and-score phase, and no-grad log-prob passes (old policy,
    reference model); the update is the rest of the step (forward, backward, optimizer)."""
    import torch

    recorder.trainer = trainer
    trainer._generate = timed(recorder, lambda: "generation_s", trainer._generate)
    trainer._generate_and_score_completions = timed(recorder, lambda: "generate_and_score_s",
                                                    trainer._generate_and_score_completions)
    trainer._get_per_token_logps_and_entropies = timed(
        recorder, lambda: "logprob_pass_s" if not torch.is_grad_enabled() else "policy_forward_s",
        trainer._get_per_token_logps_and_entropies)


def parameter_counts(model) -> dict[str, int]:
    # under ZeRO-3 a parameter's local tensor is an empty shard; DeepSpeed keeps the full size in ds_numel
    params = [(n, getattr(p, "ds_numel", p.numel()), p.requires_grad) for n, p in model.named_parameters()]
    return {"lm_parameters": sum(k for n, k, _ in params if "visual" not in n and "lora_" not in n),
            "vision_parameters": sum(k for n, k, _ in params if "visual" in n and "lora_" not in n),
            "trainable_parameters": sum(k for _, k, grad in params if grad)}


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=["sft", "dpo", "grpo"])
    parser.add_argument("config")
    parser.add_argument("record")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--hide", default="", help="comma-separated packages to make unimportable")
    parser.add_argument("--profile-step", type=int, default=0,
                        help="GRPO: trace this optimizer step (1-based)")
    parser.add_argument("--trace-dir", default=None, help="where --profile-step writes its trace")
    args = parser.parse_args()
    for name in filter(None, args.hide.split(",")):
        sys.modules[name] = None  # type: ignore[assignment]  # import fails, find_spec says absent
    stage, config, record, overrides = args.stage, args.config, args.record, args.overrides
    from vlmexp.checks.loader import load_config
    from vlmexp.train.dpo import run_dpo
    from vlmexp.train.grpo import build_grpo_trainer
    from vlmexp.train.sft import run_sft
    from vlmexp.train.stage import train_and_save

    cfg = load_config(config, overrides)
    recorder = StepRecorder()
    peft = getattr(cfg, stage).peft
    result: dict = {"stage": stage, "overrides": overrides, "peft": peft.method if peft else None,
                    "hidden_packages": args.hide}
    if stage == "sft":
        final = run_sft(cfg, callbacks=[recorder])
    elif stage == "dpo":
        final = run_dpo(cfg, callbacks=[recorder])
    else:
        profile = [StepProfile(args.profile_step, Path(args.trace_dir))] if args.profile_step else []
        trainer, inputs, rows = build_grpo_trainer(cfg, None, [recorder, *profile])
        instrument_grpo(trainer, recorder)
        final = train_and_save(trainer, inputs, rows)
        result["completions_per_step"] = (trainer.args.per_device_train_batch_size
                                          * trainer.args.gradient_accumulation_steps)
        result["trace_dir"] = args.trace_dir if args.profile_step else None
    result.update(recorder.model_info, final=str(final), steps=recorder.steps, logs=recorder.logs,
                  peak_memory=json.loads((Path(final).parent / "peak_memory.json").read_text()),
                  imported={m: sys.modules.get(m) is not None
                            for m in ("mlflow", "prefect", "torchvision", "deepspeed")})
    Path(record).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
