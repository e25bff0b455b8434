"""The demo's learning table for one seed, and where its wall time goes, without Prefect or MLflow.

    .venv/bin/python bench/demo_seeds.py configs/demo_mixed.yaml run.seed=42 [k=v ...] [--out FILE]

Calls the stages' own functions in this process, as `vlmexp run` chains them: data and the tiny model
(start-up), `run_sft`, `run_grpo` from the SFT model, then `evaluate` of the base, SFT and GRPO models on
the held-out records. Writes each model's `rec_mean_iou`, GRPO - SFT, and the seconds of each phase.
Tracking is off (`tracking.backend=none`): the orchestration and tracking share is bench/pipeline_overhead.py's.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    seconds: dict[str, float] = {}
    clock = time.monotonic()

    def lap(name: str) -> None:
        nonlocal clock
        seconds[name] = round(time.monotonic() - clock, 1)
        clock = time.monotonic()
        print(f"demo_seeds: {name} took {seconds[name]} s", flush=True)  # a run cut short keeps its laps

    from vlmexp.config_loader import load_config
    from vlmexp.data.splits import prepare_data
    from vlmexp.evaluate import evaluate
    from vlmexp.modeling import resolve_model
    from vlmexp.train.grpo import run_grpo
    from vlmexp.train.sft import run_sft

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(REPO / args.config, [f"run.output_dir={tmp}", "tracking.backend=none", *args.overrides])
        data = prepare_data(cfg)
        base, _ = resolve_model(cfg.model, Path(tmp))
        lap("start-up (imports, data, tiny model)")
        sft = run_sft(cfg)
        lap("sft")
        grpo = run_grpo(cfg, str(sft))
        lap("grpo")
        iou = {}
        for name, model in (("base", base), ("sft", sft), ("grpo", grpo)):
            iou[name] = evaluate(cfg, str(model), data.val, Path(tmp) / "eval" / name).metrics["rec_mean_iou"]
            print(f"demo_seeds: {name} rec_mean_iou {iou[name]:.4f}", flush=True)
        lap("evaluation (3 models)")
    result = {"config": args.config, "overrides": args.overrides, "rec_mean_iou": iou,
              "grpo_minus_sft": iou["grpo"] - iou["sft"], "seconds": seconds, "total_s": sum(seconds.values())}
    text = json.dumps(result, indent=2) + "\n"
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
