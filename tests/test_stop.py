"""A stop means stop: Ctrl-C or SIGTERM ends a stage's launcher and every process it started, also workers
in sessions of their own (as torchrun starts them); an interrupted stage is not retried."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A launcher like torchrun: it starts a worker in a new session, reports its pid, and waits on it.
LAUNCHER = textwrap.dedent("""
    import subprocess, sys, time
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    print(f"worker {worker.pid}", flush=True)
    worker.wait()
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().split()[2] != "Z"


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_stops_the_launcher_and_its_own_session_workers(tmp_path, sig, code):
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(f"""
        import sys
        from vlmexp.cli import main
        from vlmexp import cli
        from vlmexp.pipeline import processes

        def fake_run(args):  # what `vlmexp run` does around a stage: stream the launcher's output
            processes.run_streaming([sys.executable, "-c", {LAUNCHER!r}], {{}}, lambda line: print(line, flush=True))
            return 0

        cli.cmd_validate = fake_run
        sys.exit(main(["validate", "x.yaml"]))
    """))
    proc = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)})
    line = proc.stdout.readline()
    assert line.startswith("worker "), (line, proc.stderr.read() if proc.poll() is not None else "")
    worker = int(line.split()[1])
    assert _alive(worker)
    start = time.monotonic()
    proc.send_signal(sig)
    rc = proc.wait(timeout=60)
    assert rc == code, proc.stderr.read()
    assert time.monotonic() - start < 30
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker), "the worker in its own session outlived the stop"


def test_an_interrupted_stage_is_not_retried_and_a_failed_one_is():
    from tasks.stages import retry_unless_bad_input
    from vlmexp.pipeline.processes import StageFailed, StageInterrupted, run_streaming

    with pytest.raises(StageInterrupted, match="stopped by a signal"):
        run_streaming([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"], {},
                      lambda line: None)

    class State:
        def __init__(self, error):
            self.error = error

        def result(self):
            raise self.error

    assert retry_unless_bad_input(None, None, State(StageInterrupted("stopped"))) is False
    assert retry_unless_bad_input(None, None, State(KeyboardInterrupt())) is False
    assert retry_unless_bad_input(None, None, State(StageFailed("exit 1"))) is True
