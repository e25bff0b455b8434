"""The code passes the rules pyproject.toml gives ruff (pyflakes, pycodestyle's errors, import order, lines
within 110 characters), over every Python file of the project, as an editor or a pre-commit hook running ruff
with the project's settings reports them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_code_passes_the_configured_ruff_rules():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "vlmexp",
                           "flows", "tasks", "tests", "bench"], cwd=REPO,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
