"""Sampling sources larger than memory: wall time and peak RSS of `vlmexp.data.sampling.sample_sources`.

Builds (once, under --work) a VLM-R1 REC JSONL of --records records over 1,000 image files, the same
records as 10 parquet shards, and a parquet of --embedded records with embedded PNGs (all different), then
samples each with the strategies below, every case in a fresh process that reports its peak RSS (VmHWM).
`--code DIR` runs the cases against another checkout (e.g. a worktree of an older commit: "before").

    .venv/bin/python bench/data_sampling.py --records 10000000 --out bench/results/data_sampling.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = [  # (name, source file or glob under --work, strategy)
    ("jsonl random:1%", "rec.jsonl", "random:1%"),
    ("jsonl first:1000", "rec.jsonl", "first:1000"),
    ("parquet shards random:1%", "shards/rec-*.parquet", "random:1%"),
    ("parquet shards first:1000", "shards/rec-*.parquet", "first:1000"),
    ("embedded-image parquet all", "embedded.parquet", "all"),
]


def build(work: Path, records: int, embedded: int) -> None:
    import io

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    images = work / "images"
    if not images.is_dir():
        images.mkdir(parents=True)
        for i in range(1000):
            Image.new("RGB", (64 + i % 50, 48 + i % 30), (i % 255, 100, 50)).save(images / f"{i}.png")
    jsonl = work / "rec.jsonl"
    if not jsonl.is_file():
        tmp = jsonl.with_suffix(".tmp")
        with tmp.open("w") as f:
            for start in range(0, records, 100_000):
                f.write("".join(json.dumps({"image": f"images/{i % 1000}.png",
                                            "problem": f"the object number {i}",
                                            "solution": [1, 2, 30, 40]}) + "\n"
                                for i in range(start, min(records, start + 100_000))))
        tmp.rename(jsonl)
    shards = work / "shards"
    if not shards.is_dir():
        shards.mkdir()
        per = -(-records // 10)
        for s in range(10):
            ids = np.arange(s * per, min(records, (s + 1) * per))
            pq.write_table(pa.table({"image": [f"../images/{i % 1000}.png" for i in ids],
                                     "problem": [f"the object number {i}" for i in ids],
                                     "solution": [[1.0, 2.0, 30.0, 40.0]] * len(ids)}),
                           shards / f"rec-{s:05d}.parquet")
    emb = work / "embedded.parquet"
    if not emb.is_file():
        rng = np.random.default_rng(0)
        writer = None
        for start in range(0, embedded, 1000):
            rows = []
            for i in range(start, min(embedded, start + 1000)):
                buf = io.BytesIO()
                Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(buf, format="PNG")
                rows.append({"images": [{"bytes": buf.getvalue(), "path": None}], "problem": f"q{i}",
                             "answer": "1"})
            table = pa.Table.from_pylist(rows)
            writer = writer or pq.ParquetWriter(emb.with_suffix(".tmp"), table.schema)
            writer.write_table(table)
        writer.close()
        emb.with_suffix(".tmp").rename(emb)


def run_case(code: Path, work: Path, source: str, strategy: str) -> dict:
    """One sampling in a fresh process: wall seconds, peak RSS in MiB, rows kept."""
    script = ("import sys, time, shutil; from pathlib import Path; "
              "from vlmexp.config.schema import DataSource; "
              "from vlmexp.data.sampling import sample_sources; out = Path(sys.argv[3]); "
              "shutil.rmtree(out, True); "
              "t = time.perf_counter(); r = sample_sources([DataSource(json_path=sys.argv[1], "
              "sampling_strategy=sys.argv[2])], out / 'train.jsonl', 1); "
              "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]; "
              "print(time.perf_counter() - t, r.rows, hwm)")
    args = [sys.executable, "-c", script, str(work / source), strategy, str(work / "out")]
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out_f, tempfile.TemporaryFile("w+") as err_f:  # no pipe can fill up
        # cwd: no checkout shadows --code
        proc = subprocess.Popen(args, stdout=out_f, stderr=err_f, text=True, cwd=work,
                                env={**os.environ, "PYTHONPATH": str(code)})
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        out_f.seek(0), err_f.seek(0)
        out, err = out_f.read(), err_f.read()
    if status != 0:
        last = err.strip().splitlines()[-1] if err.strip() else f"exit {status}"
        return {"error": last[:300], "error_output_bytes": len(err), "wall_s": round(wall, 2),
                "peak_rss_mib_incl_parent": round(usage.ru_maxrss / 1024)}
    inner, rows, hwm_kib = out.split()
    # VmHWM: this process image's own peak (ru_maxrss would also count the parent's pages at fork)
    return {"wall_s": round(wall, 2), "sample_s": round(float(inner), 2),
            "peak_rss_mib": round(int(hwm_kib) / 1024), "rows": int(rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=10_000_000)
    p.add_argument("--embedded", type=int, default=20_000)
    p.add_argument("--work", default="/tmp/vlmexp-bench-data")
    p.add_argument("--code", default=str(Path(__file__).resolve().parents[1]),
                   help="checkout whose vlmexp runs")
    p.add_argument("--cases", default="", help="comma-separated case numbers (0-based); default all")
    p.add_argument("--out", help="write the results JSON here")
    a = p.parse_args()
    work = Path(a.work) / f"r{a.records}-e{a.embedded}"
    t = time.perf_counter()
    build(work, a.records, a.embedded)
    print(f"data ready in {time.perf_counter() - t:.1f} s: {work}", flush=True)
    chosen = [CASES[int(i)] for i in a.cases.split(",")] if a.cases else CASES
    results = {"records": a.records, "embedded": a.embedded, "code": a.code, "cases": {}}
    for name, source, strategy in chosen:
        results["cases"][name] = run_case(Path(a.code), work, source, strategy)
        print(name, results["cases"][name], flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
