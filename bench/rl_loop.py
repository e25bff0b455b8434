"""Validation during training and GRPO's difficulty filter on the demo: what they cost and what they change.

    .venv/bin/python bench/rl_loop.py [--seeds 42 7] [--arms plain filtered [plain-binary filtered-binary]]
        [--every 25] [--out-dir DIR]
        [--work DIR] [--sft SFT_FINAL] [k=v ...]

Per seed, in one process with tracking off (as bench/demo_matrix.py runs a cell): the demo's data and tiny
model, SFT (or, with --sft, an SFT model trained before: its folder's final/), then GRPO from that one SFT
model once per arm, every stage validating every --every steps
(`eval.every_steps`, greedy on 64 held-out records: it leaves the weights as they would be without it); then
every model evaluated on the 256 held-out records. Arms: `plain` is configs/demo.yaml's GRPO; `filtered` adds
`grpo.difficulty_filter.enabled=true` (the prompts the SFT model's samples all score alike are dropped first);
`plain-binary` and `filtered-binary` train on a 0/1 reward instead of IoU (`iou_threshold`: IoU >= 0.5), where
most groups of a weak model score all 0.

Each seed's JSON (bench/results/rl_loop/seed<S>.json) holds per stage: its wall seconds, each validation's
seconds and their share of the stage, the validation curve; per GRPO arm: its frac_reward_zero_std per logged
step, the filter's counts, the held-out gain over SFT with its paired standard error, and that gain per second
of GRPO (the filter's sampling included).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_matrix import machine, paired  # the bench folder is not a package

REPO = Path(__file__).resolve().parents[1]
# 1 when IoU >= 0.5
BINARY = "grpo.rewards=[{name: format, weight: 0.25}, {name: iou_threshold, weight: 1.0}]"
ARMS = {"plain": [], "filtered": ["grpo.difficulty_filter.enabled=true"],
        "plain-binary": [BINARY], "filtered-binary": [BINARY, "grpo.difficulty_filter.enabled=true"]}


def history(stage_dir: Path) -> list[dict]:
    """The Trainer's log history from the stage's newest checkpoint."""
    newest = max(stage_dir.glob("checkpoint-*"), key=lambda p: int(p.name.rsplit("-", 1)[1]))
    return json.loads((newest / "trainer_state.json").read_text())["log_history"]


def stage_record(stage_dir: Path, seconds: float) -> dict:
    """A stage's wall seconds, its validations' seconds and share, its val/rec_mean_iou curve and, for GRPO,
    its frac_reward_zero_std per logged step."""
    logs = history(stage_dir)
    val = [h["val/seconds"] for h in logs if "val/seconds" in h]
    record = {"seconds": round(seconds, 1), "validations": len(val),
              "validation_s": [round(v, 2) for v in val],
              "validation_share": round(sum(val) / seconds, 4),
              "val_rec_mean_iou": [[h["step"], round(h["val/rec_mean_iou"], 4)]
                                   for h in logs if "val/rec_mean_iou" in h]}
    zero = [[h["step"], h["frac_reward_zero_std"]] for h in logs if "frac_reward_zero_std" in h]
    if zero:
        record["frac_reward_zero_std"] = zero
        record["frac_reward_zero_std_mean"] = round(sum(v for _, v in zero) / len(zero), 4)
    counts = stage_dir / "difficulty.json"
    if counts.is_file():
        record["difficulty_filter"] = json.loads(counts.read_text())
    return record


def run_seed(seed: int, arms: list[str], every: int, overrides: list[str], tmp: str, sft: str | None) -> dict:
    import torch

    from vlmexp.checks.loader import load_config
    from vlmexp.data.run_data import prepare_data
    from vlmexp.evaluate import evaluate
    from vlmexp.files import read_jsonl
    from vlmexp.modeling import resolve_model
    from vlmexp.train.grpo import run_grpo
    from vlmexp.train.sft import run_sft

    out: dict = {"seed": seed, "every_steps": every, "stages": {}, "metrics": {}}
    common = ["tracking.backend=none", f"run.seed={seed}", f"eval.every_steps={every}", *overrides]
    cfg = load_config(REPO / "configs/demo.yaml", [f"run.output_dir={tmp}", *common])
    data = prepare_data(cfg)
    resolve_model(cfg.model, Path(tmp))
    start = time.monotonic()
    if sft:  # its stage record from its folder: seconds from the stage's marker to its final weights
        models = {"sft": Path(sft)}
        out["sft_from"] = sft
        folder = Path(sft).parent
        made, done = ((folder / ".vlmexp-made.json").stat().st_mtime,
                      (Path(sft) / "model.safetensors").stat().st_mtime)
        out["stages"]["sft"] = stage_record(folder, done - made)
    else:
        models = {"sft": run_sft(cfg)}
        out["stages"]["sft"] = stage_record(Path(tmp) / "sft", time.monotonic() - start)
        print(f"rl_loop seed {seed}: sft {out['stages']['sft']['seconds']} s", flush=True)
    # each arm in a folder of its own (the same data sampled again there), from one SFT model
    for arm in arms:
        arm_dir = Path(tmp) / arm
        arm_cfg = load_config(REPO / "configs/demo.yaml", [f"run.output_dir={arm_dir}", *common, *ARMS[arm]])
        start = time.monotonic()
        models[arm] = run_grpo(arm_cfg, str(models["sft"]))
        out["stages"][arm] = stage_record(arm_dir / "grpo", time.monotonic() - start)
        print(f"rl_loop seed {seed}: {arm} {out['stages'][arm]['seconds']} s", flush=True)
    scores = {}
    for name, model in models.items():
        result = evaluate(cfg, str(model), data.val, Path(tmp) / "eval" / name)
        out["metrics"][name] = result.metrics
        scores[name] = [row["score"] for row in read_jsonl(result.samples_path)]
    for arm in arms:
        gain = paired(scores["sft"], scores[arm])
        gain["per_grpo_second"] = gain["gain"] / out["stages"][arm]["seconds"]
        out.setdefault("gains_over_sft", {})[arm] = gain
    out.update(torch_threads=torch.get_num_threads(),
               torch_cpu_capability=torch.backends.cpu.get_cpu_capability())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 7])
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=["plain", "filtered"])
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--out-dir", default=str(REPO / "bench" / "results" / "rl_loop"))
    parser.add_argument("--work", default=None,
                        help="where each seed's folder is made (and kept with --keep)")
    parser.add_argument("--sft", default=None,
                        help="start GRPO from this SFT model (a final/ folder) instead of training SFT")
    parser.add_argument("--keep", action="store_true",
                        help="keep each seed's folder (its SFT model, for --sft)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True,
                            text=True, cwd=REPO).stdout.strip()
    for seed in args.seeds:
        folder = tempfile.mkdtemp(dir=args.work, prefix=f"rl_loop-seed{seed}-")
        try:
            record = run_seed(seed, args.arms, args.every, args.overrides, folder, args.sft)
        finally:
            if not args.keep:
                shutil.rmtree(folder)
        record.update(machine=machine(), threads=os.cpu_count(), commit=commit, overrides=args.overrides,
                      arms={a: ARMS[a] for a in args.arms})
        (out_dir / f"seed{seed}.json").write_text(json.dumps(record, indent=2) + "\n")
        print(json.dumps({k: record[k] for k in ("seed", "gains_over_sft") if k in record}), flush=True)


if __name__ == "__main__":
    main()
