"""The GPU benchmark runs anywhere at the tiny shape, so it stays working between GPU sessions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_grpo_bench_runs_at_the_tiny_shape(tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "bench/gpu_grpo.py", "--tiny", "--repeats", "1", "--out", str(out)],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["shape"] == "tiny" and result["G"] == 2 and result["new_tokens"] == 16
    # every completion has exactly new_tokens tokens (EOS suppressed), so the token counts are fixed
    assert result["generation_tokens_per_s"] > 0 and result["update_tokens_per_s"] > 0
    assert 0 < result["update_mfu"] < 1 and set(result["phases_s"]) == {"generation_s", "logprob_pass_s", "update_s"}
