"""GRPO recipes for the zoom demo tried from one SFT model: SFT (and its evaluation) once, then each GRPO
recipe from that model, evaluated on the same held-out records and compared with SFT record by record.

    .venv/bin/python bench/zoom_probe.py sft --dir D --seed 42 [k=v ...]
    .venv/bin/python bench/zoom_probe.py grpo --dir D --name N --out F.json [--trained E.json] [k=v ...]
    .venv/bin/python bench/zoom_probe.py placed --val D/work/<zoom data>/val.jsonl R.json [R.json ...]

`sft` trains SFT with the config and overrides in D/work (kept: its model, sampled data and evaluation) and
writes D/sft.json (overrides, seconds, metrics). `grpo` loads the same config with sft.json's overrides and
its own (GRPO's recipe: grpo.* keys), trains GRPO from D's SFT model in D/<name>, evaluates it, and writes
F.json: both models' metrics, GRPO - SFT with the tool and without (paired SE over the held-out records, as
bench/demo_matrix.py computes them), the seconds of each phase and the load average. With data.zoom_demo.val
other than SFT's run, both models are evaluated on those held-out records (the training records are the same:
they are drawn first); `--trained E.json` evaluates D/<name>'s model again without training it. Tracking is
off; the CPU arithmetic and the threads are the caller's (ATEN_CPU_CAPABILITY, OMP_NUM_THREADS), recorded in
the JSON. Each evaluation also writes <F or D/sft>-records.json: per held-out record the score without and
with the tool and the zooms. `placed` reads those: how far each model's first zoom's centre lies from its
record's target's centre, and from another record's (the records shuffled): a zoom placed from the image is
nearer its own; how many first zooms hold their target whole, in part or not at all, with the tool's accuracy
in each; and the whole-hold's change from the first file's, record by record (paired SE).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from demo_matrix import machine, paired  # noqa: E402


def scores_of(eval_dir: Path) -> dict[str, list[float]]:
    from vlmexp.files import read_jsonl

    return {mode: [row["score"] for row in read_jsonl(eval_dir / name)]
            for mode, name in (("no_tool", "samples.jsonl"), ("tool", "samples_tool.jsonl"))}


def write_records(eval_dir: Path, out: Path) -> None:
    """Per held-out record [no-tool score, tool score, zooms] (compact, for `placed` and paired tests)."""
    from vlmexp.files import read_jsonl

    plain, tool = read_jsonl(eval_dir / "samples.jsonl"), read_jsonl(eval_dir / "samples_tool.jsonl")
    rows = [[p["score"], t["score"], t["zooms"]] for p, t in zip(plain, tool, strict=True)]
    out.write_text(json.dumps({"per_record": "[no-tool score, tool score, zooms]", "records": rows},
                              separators=(",", ":")))


def placed(val: Path, results: list[str]) -> None:
    """Print each results file's mean distance from its first zooms' centres to their own records' targets'
    centres, and to other records' (a seeded shuffle)."""
    import random

    from vlmexp.files import read_jsonl
    from vlmexp.tools.rewards import inside  # the share of a target inside a crop, as zoom_target pays it

    targets = [row["bbox"] for row in read_jsonl(val)]
    shuffled = random.Random(0).sample(targets, len(targets))

    def centre(box: list[float]) -> tuple[float, float]:
        return (box[0] + box[2]) / 2, (box[1] + box[3]) / 2

    def mean_distance(zooms: list, boxes: list) -> float:
        pairs = [(centre(z[0]), centre(b)) for z, b in zip(zooms, boxes, strict=True) if z]
        return sum(((a[0] - b[0]) ** 2 + (a[1] - b[1]) ** 2) ** 0.5 for a, b in pairs) / len(pairs)

    first = None
    for path in results:
        rows = json.loads(Path(path).read_text())["records"]
        zooms = [row[2] for row in rows]
        held = [inside(row[2][0], box) if row[2] else 0.0 for row, box in zip(rows, targets, strict=True)]
        kinds = {"whole": [], "part": [], "missed": []}
        for row, share in zip(rows, held, strict=True):
            kinds["whole" if share >= 1 else "part" if share > 0 else "missed"].append(row[1])
        shares = ", ".join(f"{kind} {len(scores)} (tool {sum(scores) / max(1, len(scores)):.3f})"
                           for kind, scores in kinds.items())
        whole = [float(share >= 1) for share in held]
        change = ""
        if first is None:
            first = whole
        else:  # the hold against the first file's, record by record
            moved = paired(first, whole)
            change = f"; whole against the first: {moved['gain']:+.3f} (paired SE {moved['se']:.3f})"
        print(f"{Path(path).name}: own {mean_distance(zooms, targets):.1f} px, "
              f"shuffled {mean_distance(zooms, shuffled):.1f} px; first zooms: {shares}{change}")


def environment() -> dict:
    import torch

    return {"machine": machine(), "torch_threads": torch.get_num_threads(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=REPO).stdout.strip(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def run_sft_once(args: argparse.Namespace) -> None:
    from vlmexp.checks.loader import load_config
    from vlmexp.data.run_data import prepare_data
    from vlmexp.evaluate import evaluate
    from vlmexp.modeling import resolve_model
    from vlmexp.train.sft import run_sft

    work = args.dir / "work"
    cfg = load_config(REPO / args.config, [f"run.output_dir={work}", "tracking.backend=none",
                                           f"run.seed={args.seed}", *args.overrides])
    data = prepare_data(cfg)
    resolve_model(cfg.model, work)
    clock = time.monotonic()
    model = run_sft(cfg)
    sft_s = round(time.monotonic() - clock, 1)
    result = evaluate(cfg, str(model), data.val, work / "eval" / "sft")
    record = {"config": args.config, "seed": args.seed, "overrides": args.overrides, "model": str(model),
              "val": str(data.val), "sft_s": sft_s, "eval_s": round(time.monotonic() - clock - sft_s, 1),
              "metrics": result.metrics, "load_after": os.getloadavg(), **environment()}
    (args.dir / "sft.json").write_text(json.dumps(record, indent=1) + "\n")
    write_records(work / "eval" / "sft", args.dir / "sft-records.json")
    print(json.dumps({k: round(v, 3) for k, v in result.metrics.items()}), flush=True)


def run_grpo_variant(args: argparse.Namespace) -> None:
    from vlmexp.checks.loader import load_config
    from vlmexp.data.run_data import prepare_data
    from vlmexp.evaluate import evaluate
    from vlmexp.files import read_jsonl
    from vlmexp.train.grpo import run_grpo

    sft = json.loads((args.dir / "sft.json").read_text())
    work = args.dir / args.name
    cfg = load_config(REPO / sft["config"], [f"run.output_dir={work}", "tracking.backend=none",
                                             f"run.seed={sft['seed']}", *sft["overrides"], *args.overrides])
    load_before = os.getloadavg()
    clock = time.monotonic()
    if args.trained:  # D/<name>'s GRPO model evaluated again (other held-out records); its training's seconds
        model, grpo_s = work / "grpo" / "final", json.loads(args.trained.read_text())["grpo_s"]
        clock -= grpo_s
    else:
        model = run_grpo(cfg, sft["model"])
        grpo_s = round(time.monotonic() - clock, 1)
    val = str(prepare_data(cfg, reuse=True).val)
    result = evaluate(cfg, str(model), val, work / "eval" / "grpo")
    sft_eval = args.dir / "work" / "eval" / "sft"
    if val != sft["val"]:  # held-out records other than SFT's run evaluated (data.zoom_demo.val): SFT on them
        sft_eval = args.dir / "work" / "eval" / f"sft-val{len(read_jsonl(val))}"  # D's SFT data, more records
        if not (sft_eval / "metrics.json").exists():
            sft["metrics"] = evaluate(cfg, sft["model"], val, sft_eval).metrics
        else:
            sft["metrics"] = {k: v for k, v in json.loads((sft_eval / "metrics.json").read_text()).items()
                              if k != "model"}
    before, after = scores_of(sft_eval), scores_of(work / "eval" / "grpo")
    kept = ("config", "seed", "overrides", "sft_s", "commit")
    record = {"name": args.name, "sft": {k: sft[k] for k in kept},
              "grpo_overrides": args.overrides, "grpo_s": grpo_s,
              "eval_s": round(time.monotonic() - clock - grpo_s, 1), "held_out": len(after["tool"]),
              "metrics": {"sft": sft["metrics"], "grpo": result.metrics},
              "grpo_minus_sft": {mode: paired(before[mode], after[mode]) for mode in before},
              "load_before": load_before, "load_after": os.getloadavg(), **environment()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    write_records(work / "eval" / "grpo", args.out.with_name(args.out.stem + "-records.json"))
    m = result.metrics
    gain = record["grpo_minus_sft"]["tool"]
    print(f"{args.name}: tool {sft['metrics']['tool_exact_accuracy']:.3f} -> {m['tool_exact_accuracy']:.3f} "
          f"({gain['gain']:+.3f}, SE {gain['se']:.3f}); held {sft['metrics']['tool_zoom_on_target']:.3f} -> "
          f"{m['tool_zoom_on_target']:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=("sft", "grpo", "placed"))
    parser.add_argument("--val", type=Path, help="placed: the held-out records' JSONL (their `bbox`)")
    parser.add_argument("--dir", type=Path, default=None, help="the probe's folder (SFT's model kept)")
    parser.add_argument("--config", default="configs/demo_zoom.yaml")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--name", default="grpo", help="grpo: the recipe's folder under --dir")
    parser.add_argument("--out", type=Path, default=None, help="grpo: the JSON to write")
    parser.add_argument("--trained", type=Path, default=None,
                        help="grpo: D/<name> is trained already, this is its JSON: evaluate only")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = parser.parse_intermixed_args()
    if args.stage == "placed":
        return placed(args.val, args.overrides)
    if args.dir is None:
        raise SystemExit(f"{args.stage} needs --dir D (the probe's folder)")
    args.dir = args.dir.resolve()
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.stage == "sft":
        run_sft_once(args)
    elif args.out is None:
        raise SystemExit("grpo needs --out F.json")
    else:
        run_grpo_variant(args)


if __name__ == "__main__":
    main()
