"""Shared fixtures: tiny models and demo data are built once per test run (offline, seconds) and shared by
the processes of a parallel run; a skipped test fails the run unless the machine itself rules the test out."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

from vlmexp.data.demo import Scenes

REPO = Path(__file__).resolve().parents[1]
# Two test processes share the 2-core machines CI runs on: a `vlmexp run` that a test starts gives Prefect's
# temporary server two minutes to answer, not the 20 s a user's idle machine needs (a user who needs more sets
# the same variable)
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
# configs/demo.yaml batches 32 SFT records and 8 GRPO prompts (64 completions) per step for its demo run;
# tests that train a few steps from it take one prompt (and 8 records) per step
SMALL_BATCHES = ["sft.args.per_device_train_batch_size=8", "grpo.args.per_device_train_batch_size=8",
                 "grpo.args.gradient_accumulation_steps=1"]


# A skip means the test did not run. `make test` installs everything the tests need (Chromium, pycocotools,
# mathruler, hypothesis), so a skip hides an untested path: it fails the run, saying what is missing. The
# reasons below are the machine ruling a test out, not something an install would bring: they stay skips.
ALLOWED_SKIPS = ("this machine has CUDA",)


def _skip_fails(report: pytest.TestReport | pytest.CollectReport) -> None:
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not any(allowed in reason for allowed in ALLOWED_SKIPS):
        report.outcome = "failed"
        report.longrepr = (f"skipped, so it did not run: {reason}\n`make install` installs what every test "
                           "needs (tests/conftest.py ALLOWED_SKIPS lists the skips that stay skips)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _skip_fails(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _skip_fails(outcome.get_result())


def shared(tmp_path_factory, name: str, build: Callable[[Path], Path]) -> Path:
    """`build(folder)` once per test run, in a folder every process of a parallel (xdist) run finds: the
    first process builds it under a lock, the others wait and reuse it. Nothing may write into it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # an xdist worker's basetemp is a folder in the run's
        root = root.parent
    folder = root / "shared" / name
    done = folder.with_name(folder.name + ".done")
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if not done.exists():
            build(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """A built tiny model folder per family, created lazily."""
    from vlmexp.tiny import make_tiny_model

    class Models(dict):
        def __missing__(self, family: str) -> Path:
            self[family] = shared(tmp_path_factory, f"tiny/{family}",
                                  lambda out: make_tiny_model(out, family))
            return self[family]

    return Models()


# 2-3 shapes on plain images of many sizes (not the demo recipe's): what the frame and caption tests need
VARIED_SCENES = Scenes(width=(160, 320), height=(120, 280), objects=(2, 3), background="plain")


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    from vlmexp.data.demo import make_demo_data

    return shared(tmp_path_factory, "demo/data",
                  lambda out: make_demo_data(out, train=24, val=8, seed=0, scenes=VARIED_SCENES))


def as_a_terminal_job() -> None:
    """Popen's preexec_fn for a command started as a terminal's shell starts a job: SIGHUP and SIGINT at their
    defaults, whatever this test process inherited (`nohup` ignores SIGHUP, a background CI step SIGINT), so a
    test that closes the terminal or presses Ctrl-C tests what a user's terminal does."""
    import signal

    for sig in (signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)


def write_json(path: Path, obj) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))
    return path


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def make_png(path: Path, size=(64, 48), color="red") -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    return path
