"""The code fits the line length pyproject.toml gives ruff (110): ruff's E501, over every Python file of the
project, as an editor or a pre-commit hook running ruff with the project's settings reports it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_line_fits_the_configured_length():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "E501", "--output-format",
                           "concise", "vlmexp", "flows", "tasks", "tests", "bench"], cwd=REPO,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
