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


def test_the_test_order_names_test_modules_that_exist():
    """tests/conftest.py orders the modules by MODULE_SECONDS: a renamed module would fall back to the end."""
    from conftest import MODULE_SECONDS

    missing = [name for name in MODULE_SECONDS if not (REPO / "tests" / f"{name}.py").is_file()]
    assert not missing, f"tests/conftest.py MODULE_SECONDS names modules that are gone: {missing}"
