"""The demo's learning claim across seeds and CPU arithmetics: one process per cell, one JSON per cell.

    .venv/bin/python bench/demo_matrix.py [--config configs/demo.yaml] [--seeds 42 7 1]
        [--arithmetic default avx2 avx512] [--dpo configs/demo_dpo.yaml] [--threads N] [--jobs N]
        [--out-dir DIR] [k=v ...]
    .venv/bin/python bench/demo_matrix.py --table [--out-dir DIR] [--readme README.md]

Float results differ between CPUs: the same seed trains other weights under AVX-512, AVX2 and plain kernels.
Each cell runs in its own process with torch and its BLAS told which kernels to use (ATEN_CPU_CAPABILITY,
MKL_ENABLE_INSTRUCTIONS, DNNL_MAX_CPU_ISA), so one machine computes as the others would; a machine can only
step down (an AVX2 CPU cannot compute as AVX-512, and such a cell is refused). Thread count changes the
arithmetic too, so it is set and recorded (default: the cores of this machine, as `make demo` uses them).

A cell calls the stages' own functions as `vlmexp run` chains them, with tracking off: data and the tiny
model, SFT, GRPO from the SFT model (and with --dpo, DPO as that config says, from the same SFT model), then
evaluation of every model on the held-out records. Its JSON holds each model's metrics, each stage's gain over
SFT with the paired standard error over the held-out records, the seconds of each phase and the machine.
--table prints the markdown table of the cells in --out-dir; with --readme it replaces the table between the
README's demo-table markers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARITHMETIC = {  # what each setting makes torch, MKL and oneDNN use
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX512",
               "DNNL_MAX_CPU_ISA": "AVX512_CORE"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2"},
    "default": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
                "DNNL_MAX_CPU_ISA": "SSE41"},
}
NEEDS_FLAG = {"avx512": "avx512f", "avx2": "avx2", "default": "sse4_2"}
MARKERS = ("<!-- demo-table:start -->", "<!-- demo-table:end -->")
ZOOM_MARKERS = ("<!-- zoom-table:start -->", "<!-- zoom-table:end -->")  # configs/demo_zoom.yaml's cells


def cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    line = next((x for x in text.splitlines() if x.startswith("flags")), "flags :")
    return set(line.split(":", 1)[1].split())


def machine() -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((x.split(":", 1)[1].strip() for x in text.splitlines() if x.startswith("model name")),
                platform.processor())
    best = next(a for a in ARITHMETIC if NEEDS_FLAG[a] in cpu_flags())
    return f"{os.cpu_count()}-core {name} ({best} at best)"


def paired(a: list[float], b: list[float]) -> dict[str, float]:
    """Mean of b - a over the same records, its standard error, and how many records went up and down."""
    diffs = [y - x for x, y in zip(a, b, strict=True)]
    mean = sum(diffs) / len(diffs)
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1))
    return {"gain": mean, "se": sd / math.sqrt(len(diffs)), "better": sum(d > 0 for d in diffs),
            "worse": sum(d < 0 for d in diffs)}


def run_cell(config: str, seed: int, dpo_config: str | None, overrides: list[str]) -> dict:
    """Train and evaluate one cell in this process (its environment already set); the cell's record."""
    seconds: dict[str, float] = {}
    clock = time.monotonic()

    def lap(name: str) -> None:
        nonlocal clock
        seconds[name] = round(time.monotonic() - clock, 1)
        clock = time.monotonic()
        print(f"demo_matrix seed {seed}: {name} took {seconds[name]} s", flush=True)

    import torch

    from vlmexp.checks.loader import load_config
    from vlmexp.data.run_data import prepare_data
    from vlmexp.evaluate import evaluate
    from vlmexp.files import read_jsonl
    from vlmexp.modeling import resolve_model
    from vlmexp.train.dpo import run_dpo
    from vlmexp.train.grpo import run_grpo
    from vlmexp.train.sft import run_sft

    with tempfile.TemporaryDirectory() as tmp:
        common = [f"run.output_dir={tmp}", "tracking.backend=none", f"run.seed={seed}", *overrides]
        cfg = load_config(REPO / config, common)
        dpo_cfg = load_config(REPO / dpo_config, common) if dpo_config else None
        if dpo_cfg is not None:
            for section in ("model", "data", "sft"):
                if getattr(dpo_cfg, section) != getattr(cfg, section):
                    raise SystemExit(f"{dpo_config}'s {section} section differs from {config}'s: "
                                     f"DPO must start from the SFT model that {config} trains; "
                                     "make the sections equal")
        data = prepare_data(cfg)
        base, _ = resolve_model(cfg.model, Path(tmp))
        lap("start-up")
        models = {"base": base}
        models["sft"] = run_sft(cfg)
        lap("sft")
        models["grpo"] = run_grpo(cfg, str(models["sft"]))
        lap("grpo")
        if dpo_cfg is not None:
            models["dpo"] = run_dpo(dpo_cfg, str(models["sft"]))
            lap("dpo")
        metrics, scores, tool_scores = {}, {}, {}
        for name, model in models.items():
            result = evaluate(cfg, str(model), data.val, Path(tmp) / "eval" / name)
            metrics[name] = result.metrics
            scores[name] = [row["score"] for row in read_jsonl(result.samples_path)]
            with_tool = result.samples_path.with_name("samples_tool.jsonl")  # eval.tools: on or both
            if with_tool.is_file():
                tool_scores[name] = [row["score"] for row in read_jsonl(with_tool)]
        lap("evaluation")
    gains = {name: paired(scores["sft"], scores[name]) for name in models if name not in ("base", "sft")}
    extra = {}
    if tool_scores:  # with the tool: each stage's gain over SFT, and each model's gain from the tool
        extra["tool_gains_over_sft"] = {name: paired(tool_scores["sft"], tool_scores[name])
                                        for name in models if name not in ("base", "sft")}
        extra["tool_gains_over_no_tool"] = {name: paired(scores[name], tool_scores[name]) for name in models}
    return {"seed": seed, "metrics": metrics, "gains_over_sft": gains, **extra, "seconds": seconds,
            "total_s": round(sum(seconds.values()), 1), "torch_threads": torch.get_num_threads(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}


def cell_name(seed: int, arithmetic: str) -> str:
    return f"seed{seed}-{arithmetic}.json"


def launch(args: argparse.Namespace, seed: int, arithmetic: str) -> Path:
    """Run one cell in a child process with its arithmetic's environment, over a pipeline stage's; its JSON's
    path."""
    from vlmexp.pipeline.processes import stage_env

    out = Path(args.out_dir) / cell_name(seed, arithmetic)
    env = {**stage_env(), **ARITHMETIC[arithmetic], "OMP_NUM_THREADS": str(args.threads),
           "MKL_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, __file__, "--cell", str(seed), "--config", args.config,
           *(["--dpo", args.dpo] if args.dpo else []),
           "--cell-out", str(out), *args.overrides]
    log = out.with_suffix(".log")
    with open(log, "w") as handle:
        code = subprocess.run(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO).returncode
    if code != 0:
        raise SystemExit(f"cell seed {seed} {arithmetic} failed with exit {code}; see {log}")
    record = json.loads(out.read_text())
    record.update(arithmetic=arithmetic, environment=ARITHMETIC[arithmetic], threads=args.threads,
                  machine=machine(), config=args.config, overrides=args.overrides,
                  commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True, cwd=REPO).stdout.strip())
    out.write_text(json.dumps(record, indent=2) + "\n")
    best = record["gains_over_sft"]
    print(f"seed {seed} {arithmetic}: "
          + ", ".join(f"{k} {v['gain']:+.4f} (SE {v['se']:.4f})" for k, v in best.items()),
          flush=True)
    return out


def read_cells(out_dir: Path) -> list[dict]:
    """Every cell's record in `out_dir`, sorted by seed and arithmetic."""
    cells = [json.loads(p.read_text()) for p in sorted(out_dir.glob("seed*.json"))]
    if not cells:
        raise SystemExit(f"no cell JSON in {out_dir}; run the matrix first")
    order = list(ARITHMETIC)
    return sorted(cells, key=lambda c: (c["seed"], order.index(c["arithmetic"])))


def table(out_dir: Path) -> str:
    """The markdown table of every cell in `out_dir`, sorted by seed and arithmetic (the zoom demo's cells,
    evaluated with the tool too: `zoom_table`)."""
    cells = read_cells(out_dir)
    if "tool_gains_over_sft" in cells[0]:
        return zoom_table(cells, out_dir)
    has_dpo = any("dpo" in c["metrics"] for c in cells)
    head = "| seed | arithmetic | base | SFT | GRPO | GRPO - SFT (paired SE) | acc50 SFT -> GRPO |"
    rule = "|---|---|---|---|---|---|---|"
    if has_dpo:
        head += " DPO - SFT (paired SE) |"
        rule += "---|"
    rows = [head, rule]
    for c in cells:
        m, g = c["metrics"], c["gains_over_sft"]
        row = (f"| {c['seed']} | {c['arithmetic']} | {m['base']['rec_mean_iou']:.3f} | "
               f"{m['sft']['rec_mean_iou']:.3f} | "
               f"{m['grpo']['rec_mean_iou']:.3f} | {g['grpo']['gain']:+.3f} ({g['grpo']['se']:.3f}) | "
               f"{m['sft']['rec_acc50']:.3f} -> {m['grpo']['rec_acc50']:.3f} |")
        if has_dpo:
            row += f" {g['dpo']['gain']:+.3f} ({g['dpo']['se']:.3f}) |" if "dpo" in g else " - |"
        rows.append(row)
    machines = sorted({c["machine"] for c in cells})
    threads = sorted({c["threads"] for c in cells})
    folder = out_dir.relative_to(REPO) if out_dir.is_relative_to(REPO) else out_dir
    note = (f"\nMeasured on {', '.join(machines)}, {'/'.join(map(str, threads))} thread(s), config "
            f"`{cells[0]['config']}` at {', '.join(sorted({c['commit'] for c in cells}))}; "
            f"held-out rec_mean_iou of 256 records (bench/demo_matrix.py, one JSON per cell in {folder}, "
            "each with its phases' seconds).")
    return "\n".join(rows) + "\n" + note


def zoom_table(cells: list[dict], out_dir: Path) -> str:
    """Held-out accuracy of base, SFT and GRPO without the tool and with it, zooms per answer, the share of
    records whose zooms held the whole target, and the gains with their paired standard errors, one row per
    cell."""
    def pair(gain: dict) -> str:
        return f"{gain['gain']:+.3f} ({gain['se']:.3f})"

    rows = ["| seed | arithmetic | base: no tool / tool | SFT: no tool / tool | GRPO: no tool / tool "
            "| zooms per answer, base / SFT / GRPO | zoom held the target, SFT / GRPO "
            "| tool - no tool, SFT (paired SE) | tool - no tool, GRPO (paired SE) "
            "| GRPO - SFT, tool (paired SE) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        m = c["metrics"]
        acc = [f"{m[k]['exact_accuracy']:.3f} / {m[k]['tool_exact_accuracy']:.3f}"
               for k in ("base", "sft", "grpo")]
        zooms = " / ".join(f"{m[k]['tool_zooms_per_answer']:.2f}" for k in ("base", "sft", "grpo"))
        held = " / ".join(f"{m[k]['tool_zoom_on_target']:.3f}" for k in ("sft", "grpo"))
        rows.append(f"| {c['seed']} | {c['arithmetic']} | {' | '.join(acc)} | {zooms} | {held} | "
                    f"{pair(c['tool_gains_over_no_tool']['sft'])} | "
                    f"{pair(c['tool_gains_over_no_tool']['grpo'])} | "
                    f"{pair(c['tool_gains_over_sft']['grpo'])} |")
    machines = sorted({c["machine"] for c in cells})
    threads = sorted({c["threads"] for c in cells})
    folder = out_dir.relative_to(REPO) if out_dir.is_relative_to(REPO) else out_dir
    note = (f"\nMeasured on {', '.join(machines)}, {'/'.join(map(str, threads))} thread(s), config "
            f"`{cells[0]['config']}` at {', '.join(sorted({c['commit'] for c in cells}))}; held-out exact "
            f"accuracy (bench/demo_matrix.py, one JSON per cell in {folder}, each with its phases' seconds).")
    return "\n".join(rows) + "\n" + note


def write_readme(readme: Path, text: str, markers: tuple[str, str] = MARKERS) -> None:
    content = readme.read_text()
    start, end = (content.find(m) for m in markers)
    if start < 0 or end < start:
        raise SystemExit(f"{readme} has no {markers[0]} ... {markers[1]} block; add the two marker lines "
                         "where the demo table belongs")
    readme.write_text(content[: start + len(markers[0])] + "\n" + text + "\n" + content[end:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 7, 1])
    parser.add_argument("--arithmetic", nargs="+", choices=list(ARITHMETIC), default=None,
                        help="default: every one this CPU can compute")
    parser.add_argument("--dpo", default=None, metavar="DPO_CONFIG",
                        help="also train DPO as this config says (its model, data and SFT equal --config's), "
                             "from each cell's SFT model")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--jobs", type=int, default=1, help="cells at a time (each with --threads threads)")
    parser.add_argument("--out-dir", default=str(REPO / "bench" / "results" / "demo_matrix"))
    parser.add_argument("--table", action="store_true", help="print the table of the cells in --out-dir")
    parser.add_argument("--readme", default=None, help="with --table: write it between this file's markers")
    parser.add_argument("--cell", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cell-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.cell is not None:
        record = run_cell(args.config, args.cell, args.dpo, args.overrides)
        Path(args.cell_out).write_text(json.dumps(record, indent=2) + "\n")
        return
    out_dir = Path(args.out_dir).resolve()
    if args.table:
        text = table(out_dir)
        print(text)
        if args.readme:
            zoom = "tool_gains_over_sft" in read_cells(out_dir)[0]
            write_readme(Path(args.readme), text, ZOOM_MARKERS if zoom else MARKERS)
        return
    flags = cpu_flags()
    wanted = args.arithmetic or [a for a in ARITHMETIC if NEEDS_FLAG[a] in flags]
    missing = [a for a in wanted if NEEDS_FLAG[a] not in flags]
    if missing:
        raise SystemExit(f"this CPU cannot compute as {', '.join(missing)} (no {NEEDS_FLAG[missing[0]]} "
                         "flag); leave it out of --arithmetic")
    out_dir.mkdir(parents=True, exist_ok=True)
    args.out_dir = str(out_dir)
    cells = [(seed, arithmetic) for seed in args.seeds for arithmetic in wanted]
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda cell: launch(args, *cell), cells))
    print(table(out_dir))


if __name__ == "__main__":
    main()
