"""How far SFT has got along its schedule: one SFT run of a config, then every checkpoint it saved and its
final model evaluated on the held-out records (with the tool and without, where `eval.tools` says so).

    .venv/bin/python bench/sft_checkpoints.py --config configs/demo_zoom.yaml --seed 7 --out F.json [k=v ...]

Tracking is off and the work folder is temporary, as bench/demo_matrix.py's cells; the CPU arithmetic and the
threads are the caller's (ATEN_CPU_CAPABILITY, OMP_NUM_THREADS). A checkpoint of a longer schedule is not the
end of a shorter one (its learning rate has not decayed), so it only bounds what the shorter schedule reaches.
The JSON (written after each evaluation) holds the SFT seconds and each checkpoint's metrics.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/demo_zoom.yaml")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = parser.parse_args()

    import torch

    from vlmexp.checks.loader import load_config
    from vlmexp.data.run_data import prepare_data
    from vlmexp.evaluate import evaluate
    from vlmexp.modeling import resolve_model
    from vlmexp.train.sft import run_sft

    record = {"config": args.config, "seed": args.seed, "overrides": args.overrides,
              "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "torch_threads": torch.get_num_threads(), "evals": {}}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(REPO / args.config, [f"run.output_dir={tmp}", "tracking.backend=none",
                                               f"run.seed={args.seed}", *args.overrides])
        data = prepare_data(cfg)
        resolve_model(cfg.model, Path(tmp))
        clock = time.monotonic()
        final = run_sft(cfg)
        record["sft_s"] = round(time.monotonic() - clock, 1)
        saved = sorted(Path(tmp).rglob("checkpoint-*"), key=lambda p: int(p.name.rsplit("-", 1)[1]))
        for model in [*saved, final]:
            result = evaluate(cfg, str(model), data.val, Path(tmp) / "eval" / model.name)
            record["evals"][model.name] = result.metrics
            print(model.name, {k: round(v, 3) for k, v in result.metrics.items() if "accuracy" in k
                               or "zoom_on_target" in k}, flush=True)
            args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
