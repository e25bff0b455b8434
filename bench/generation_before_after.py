"""Generation before and after the generation module, side by side in one process: the base commit's
`vlmexp.evaluate.generate` (loaded from an unpacked `git archive` of that commit) and
`vlmexp.generation.Generator` as the `generation:` section's CPU default resolves (eager, dynamic cache, no
buckets), alternating call by call on the same held-out prompts of the demo's tiny model; outputs compared,
seconds per call.

    git archive 6026eae | tar -x -C /tmp/base
    .venv/bin/python bench/generation_before_after.py /tmp/base [--calls 6] [--prompts 16] [--new-tokens 24]

Alternating in one process takes a shared machine's load out of the comparison (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="an unpacked git archive of the commit before the generation module")
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--out-dir", default=None,
                        help="where the demo's model and data are built (default: temp)")
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("base_evaluate", Path(args.base) / "vlmexp" / "evaluate.py")
    base = importlib.util.module_from_spec(spec)
    sys.modules["base_evaluate"] = base
    spec.loader.exec_module(base)

    from vlmexp.checks.loader import load_config
    from vlmexp.data.record import read_sampled
    from vlmexp.data.run_data import prepare_data
    from vlmexp.generation import Generator
    from vlmexp.modeling import load_for_inference, resolve_model
    from vlmexp.prompts import build_prompt, load_images

    out_dir = args.out_dir or tempfile.mkdtemp(prefix="vlmexp-gen-")
    cfg = load_config(REPO / "configs/demo.yaml", [f"run.output_dir={out_dir}", "tracking.backend=none"])
    model_path, _ = resolve_model(cfg.model, cfg.run.output_dir)
    records = read_sampled(prepare_data(cfg, reuse=True).val)[: args.prompts]
    model, processor, family = load_for_inference(cfg, model_path)
    prompts = [build_prompt(r, cfg.data, family) for r in records]
    images = [load_images(r.images) for r in records]
    new = Generator.for_config(cfg, model, processor, family)
    calls = {"before": lambda: base.generate(model, processor, family, prompts, images, args.new_tokens,
                                             0.0, 8),
             "after": lambda: new(prompts, images, args.new_tokens, 0.0, 8)}
    seconds, outputs = {"before": [], "after": []}, {}
    for i in range(args.calls):
        for name in ("before", "after") if i % 2 == 0 else ("after", "before"):
            start = time.perf_counter()
            outputs.setdefault(name, []).append(calls[name]())
            seconds[name].append(time.perf_counter() - start)
    result = {"settings": str(new.settings), "calls": args.calls, "prompts": len(prompts),
              "new_tokens": args.new_tokens, "identical_outputs": outputs["before"] == outputs["after"],
              **{name: {"median_s": statistics.median(v), "all_s": [round(x, 3) for x in v]}
                 for name, v in seconds.items()},
              "ratio_after_before": statistics.median(seconds["after"])
                                    / statistics.median(seconds["before"])}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
