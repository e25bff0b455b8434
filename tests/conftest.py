"""Shared fixtures: tiny models and demo data are built once per test run (offline, seconds) and shared by
the processes of a parallel run; a skipped test fails the run unless the machine itself rules the test out."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from filelock import FileLock

# A parallel run's test processes share the machine's cores: each process (and what it starts) computes with
# its share of them. torch's default, a thread per core in every process, oversubscribes the cores: two
# processes training side by side on 2 cores took 4 x as long with 2 threads each as with 1 (an SFT of 40
# steps: 161-165 s against 40-42 s). Set before anything imports torch; a variable the caller set is kept.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

from vlmexp.data.demo import Scenes

REPO = Path(__file__).resolve().parents[1]
# The test processes share the 2-core machines CI runs on: a `vlmexp run` that a test starts gives Prefect's
# temporary server two minutes to answer, not the 90 s it waits on a user's machine
# (flows/temporary_server.py; a user who needs more sets the same variable)
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
# Prefect keeps its database and settings in PREFECT_HOME (~/.prefect): a test process and everything it
# starts use a folder of their own, never the user's. A test that starts a Prefect server takes
# `prefect_home`.
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="vlmexp-tests-prefect-home-")
atexit.register(shutil.rmtree, os.environ["PREFECT_HOME"], ignore_errors=True)
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


# The whole suite from a fresh clone, `make test` with its install, on the 2-core AMD EPYC machine with
# nothing else running: 13 min 48 s to 15 min 39 s, 776-901 s of pytest for 610-615 tests (2026-11-29),
# against 1,092-1,284 s of pytest for fewer tests when the 15-minute goal was set (746cca2); bench/RESULTS.md.
# The run is CPU-bound (both cores busy from the install's end to the last test): a test that waits costs no
# wall time, a test that computes does, and a fourth test process gains nothing (875 s, within three's
# 808-876 s).
# Wall seconds of each test module's tests in one whole-suite run (3 test processes on the 2-core machine,
# 2026-11-26), for the order below; a module under ten seconds is left out. Only the order depends on it, and
# it goes stale as modules change: pytest-xdist gives a process its next module as soon as the current one has
# two tests or fewer left, so a one-test module of minutes commits the next module to that process early. With
# a table measured before the stop, fault and deployment runs got cheaper, one process ran
# test_prefect_automations' four minutes (mostly waiting on the automations' windows) after the other two had
# finished: 1,448 s in all, against 1,275 s for the same suite before those runs changed.
MODULE_SECONDS = {
    "test_ray": 540, "test_bench": 528, "test_faults": 500, "test_stop_pipeline": 490,
    "test_stage_deployments": 366, "test_demo_learns": 254, "test_prefect_automations": 238, "test_cli": 235,
    "test_validation": 110, "test_flow": 170, "test_spool": 150, "test_launch": 96, "test_dpo": 77,
    "test_model_rewards": 120, "test_stop": 63,
    "test_train": 63, "test_train_modes": 43, "test_mlflow_ui": 41, "test_hostile_inputs": 39,
    "test_shapes": 34, "test_pictures": 33, "test_grpo_mixed_sizes": 30, "test_generation": 29,
    "test_difficulty": 23, "test_safety": 18, "test_internvl": 14, "test_pipeline_lib": 14,
    "test_hold": 45, "test_source_columns": 13, "test_config": 11, "test_fuzz_inputs": 10, "test_zoom": 75,
    "test_zoom_parts": 5, "test_tool_data": 80, "test_zoom_demo": 150, "test_qwen3_5": 125,
    "test_qwen3_5_runs": 320, "test_online_filter": 240,
}


def pytest_collection_modifyitems(config, items):
    """The longest modules first (MODULE_SECONDS; a module it does not name after them, one with slow tests
    first), each module's tests together and in their order. `make test` hands out whole modules (`--dist
    loadfile`, so a module's fixtures are built once) in this order to whichever test process is free: the
    longest start at once and every process ends on short ones at about the same time (list scheduling,
    longest first). In the collection order, with work stealing, two minutes-long tests were left to the end
    and ran in one process for a run's last 160 s (a run sharing the machine with an install) while the
    other two had nothing to do."""
    slow = {item.module.__name__ for item in items if item.get_closest_marker("slow")}

    def weight(item) -> tuple[int, bool]:
        name = item.module.__name__.rpartition(".")[2]
        return -MODULE_SECONDS.get(name, 0), item.module.__name__ not in slow

    items.sort(key=weight)  # a stable sort: the order kept otherwise


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


# What Prefect's server does to its database when it starts (prefect.server.api.server.create_app's lifespan):
# every one of Prefect's migrations, then its block types registered. The same two steps without the server
# around them (uvicorn, the API's import, its background services): 19 s of CPU against 26 s on the 2-core
# machine. A server started on a copy registers any block type it knows beyond these (it does so at every
# start on a database it has not seen); tests/test_cli.py's first `vlmexp run` on a new machine has the server
# create the database itself.
_PREFECT_DATABASE = """
import asyncio

from prefect.server.database import provide_database_interface
from prefect.server.models.block_registration import run_block_auto_registration


async def create():
    db = provide_database_interface()
    await db.create_db()
    async with await db.session() as session:
        await run_block_auto_registration(session=session)


asyncio.run(create())
"""


def _create_prefect_database(home: Path) -> None:
    """Prefect's database in `home`, as a server's first start creates it: migrated to Prefect's newest
    revision, its block types registered."""
    home.mkdir(parents=True)
    env = {**os.environ, "PREFECT_HOME": str(home)}
    env.pop("PREFECT_API_URL", None)
    env.pop("PREFECT_SERVER_DATABASE_CONNECTION_URL", None)
    subprocess.run([sys.executable, "-c", _PREFECT_DATABASE], cwd=REPO, env=env, check=True, timeout=600)
    import sqlite3

    with contextlib.closing(sqlite3.connect(home / "prefect.db")) as db:  # all of it in the one file
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")


@pytest.fixture(scope="session")
def prefect_database(tmp_path_factory) -> Path:
    """A Prefect home whose database was created once per test run (every test reads a copy)."""
    return shared(tmp_path_factory, "prefect-home", _create_prefect_database)


@pytest.fixture
def prefect_home(prefect_database, tmp_path, monkeypatch) -> Path:
    """PREFECT_HOME for this test (inherited by what it starts): a copy of a created database, as on a machine
    that ran Prefect before, so a server starts in seconds instead of running Prefect's migrations again
    (tests/test_cli.py's first `vlmexp run` on a new machine runs them)."""
    home = tmp_path / "prefect-home"
    shutil.copytree(prefect_database, home)
    monkeypatch.setenv("PREFECT_HOME", str(home))
    return home


def _create_mlflow_store(folder: Path) -> None:
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    folder.mkdir(parents=True)
    SqlAlchemyStore(f"sqlite:///{folder / 'mlflow.db'}", (folder / "mlartifacts").as_uri())


@pytest.fixture
def mlflow_store(tmp_path_factory) -> Callable[[Path], Path]:
    """`mlflow_store(output_dir)` puts a copy of an empty MLflow store, created once per test run, where a run
    in `output_dir` keeps its store (mlflow.db): a test that logs to a store and reads it back skips MLflow's
    migrations (2 s of CPU a store on the 2-core machine). The pipeline's tests have MLflow create theirs."""
    template = shared(tmp_path_factory, "mlflow-store", _create_mlflow_store)

    def place(output_dir: Path) -> Path:
        output_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(template / "mlflow.db", output_dir / "mlflow.db")
        return output_dir

    return place


@pytest.fixture
def run_inputs(tiny_models, mlflow_store) -> Callable[[Path], list[str]]:
    """`run_inputs(output_dir)`: the overrides and files that spare a `vlmexp run` on the demo config the
    model build and MLflow's migrations (6 s of CPU a run on the 2-core machine) where the test's claim is not
    about them: the shared tiny model as model.path, and a copy of an empty MLflow store in `output_dir`.
    tests/test_cli.py's first run and `make demo` build both themselves."""

    def place(output_dir: Path) -> list[str]:
        mlflow_store(output_dir)
        return [f"model.path={tiny_models['qwen2_5_vl']}"]

    return place


@pytest.fixture
def vlmexp_main(monkeypatch, capsys) -> Callable[..., tuple[int, str, str]]:
    """`vlmexp_main(*args, cwd=REPO, **env)`: the `vlmexp` command's own `main` (the parser, the dispatch, the
    exit status `entry()` exits with) in this test's process, from `cwd` with `env` set; its exit status,
    stdout and stderr. For a test whose claim is what a command does rather than the command line itself: a
    process of its own would import TRL again for the config check, some ten seconds a command on a 2-core
    machine."""
    from vlmexp.cli import main

    def run(*args, cwd: Path = REPO, **env) -> tuple[int, str, str]:
        capsys.readouterr()
        with monkeypatch.context() as m:
            m.chdir(cwd)
            for name, value in env.items():
                m.setenv(name, str(value))
            rc = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return rc, out, err

    return run


@contextlib.contextmanager
def prefect_api(database: Path) -> Iterator[None]:
    """This process's flows against a server of their own (the pipeline's temporary server, as `vlmexp run`
    starts it) on a copy of the created database: Prefect's test harness, without its migrations."""
    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL, temporary_settings

    from flows.temporary_server import temporary_server

    folder = Path(tempfile.mkdtemp(prefix="prefect-api-"))
    shutil.copy(database / "prefect.db", folder / "prefect.db")
    try:
        with temporary_settings({PREFECT_SERVER_DATABASE_CONNECTION_URL:
                                 f"sqlite+aiosqlite:///{folder / 'prefect.db'}"}), temporary_server():
            yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)


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
