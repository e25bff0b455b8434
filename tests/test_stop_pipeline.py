"""A stop signal ends a whole `vlmexp run` as a user's tools send it: a terminal's Ctrl-C (SIGINT to the whole
foreground process group), `kill PID` (SIGTERM to the main process alone), a closed terminal (SIGHUP to the
group), and a second signal while the run is stopping. Each run is started as a terminal starts a job (a
process group of its own) and stopped once SFT saved its first checkpoint, under torchrun (2 CPU processes,
workers in sessions of their own) and under the local launcher; then the same command resumes."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import SMALL_BATCHES, as_a_terminal_job

REPO = Path(__file__).resolve().parents[1]
# SFT alone: the stop comes in SFT, the resume trains it to the end (a stage after a resumed one, the export
# after a resumed GRPO, is tests/test_faults.py's). The stop is sent once SFT's checkpoint-2 is complete
# and lands within a second (tenths of one on an idle machine); the 10 steps and 5 saves left after it (5-15 s
# on a loaded 2-core machine) keep it in SFT, and are all the SFT that the resume trains
SMALL_RUN = ["data.demo.train=32", "data.demo.val=8", "sft.args.max_steps=12", "sft.args.save_steps=2",
             "sft.args.logging_steps=1", *SMALL_BATCHES, "grpo.enabled=false", "eval.enabled=false",
             "export.enabled=false", "pipeline.retry_delay_seconds=1"]
LAUNCHERS = {"torchrun": ["launch.launcher=torchrun", "launch.nproc_per_node=2"],
             "local": ["launch.launcher=local"]}

# the run's flow runs (name, state type, state message) as its Prefect server stored them: read from the
# server's database in the run's PREFECT_HOME (the temporary server is gone with the run)
FLOW_RUNS = ("SELECT run.name, state.type, state.message FROM flow_run AS run "
             "JOIN flow_run_state AS state ON state.id = run.state_id ORDER BY run.created")


class Run:
    """`vlmexp run` on the demo config with small overrides, in a process group of its own (as a terminal's
    job)."""

    def __init__(self, tmp_path: Path, launcher: str, run_inputs):
        self.out, self.tmp = tmp_path / "out", tmp_path
        self.cmd = [sys.executable, "-m", "vlmexp.cli", "run", "configs/demo.yaml",
                    f"run.output_dir={self.out}", *SMALL_RUN, *LAUNCHERS[launcher], *run_inputs(self.out)]
        self.env = {**os.environ}  # PREFECT_HOME: the test's `prefect_home`
        self.env.pop("PREFECT_API_URL", None)

    def start(self, name: str) -> subprocess.Popen:
        self.log = self.tmp / f"{name}.log"
        return subprocess.Popen(self.cmd, cwd=REPO, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                env=self.env, start_new_session=True, preexec_fn=as_a_terminal_job)

    def text(self) -> str:
        return self.log.read_text()

    def flow_runs(self) -> list[list[str]]:
        import sqlite3

        database = Path(self.env["PREFECT_HOME"]) / "prefect.db"
        assert database.is_file(), database
        with contextlib.closing(sqlite3.connect(database)) as db:
            return [list(row) for row in db.execute(FLOW_RUNS)]

    def mlflow_runs(self) -> dict[str, str]:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(f"sqlite:///{self.out / 'mlflow.db'}")
        experiments = [e.experiment_id for e in client.search_experiments()]
        return {r.info.run_name: r.info.status for r in client.search_runs(experiments)}


def _wait_for_checkpoint(run: Run, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 600
    while not (run.out / "sft" / "checkpoint-2" / "trainer_state.json").is_file():
        assert proc.poll() is None and time.monotonic() < deadline, run.text()[-3000:]
        time.sleep(0.2)


def _processes_of(proc: subprocess.Popen) -> tuple[list, set[int]]:
    """The run's processes (the main one and everything it started), and the process groups and sessions they
    are in (the run's own, Prefect's temporary server's, the stage's, torchrun's workers'), which hold nothing
    else."""
    import psutil

    root = psutil.Process(proc.pid)
    processes = [root, *root.children(recursive=True)]
    return processes, {n for p in processes for n in _group_and_session(p.pid)}


def _left_running(processes: list, places: set[int]) -> list[str]:
    """What of the run is still running a few seconds after it exited: its processes, and anything in the
    process groups and sessions they were in."""
    import psutil

    deadline = time.monotonic() + 10
    while True:
        left = [p for p in psutil.process_iter(["pid", "cmdline", "status"])
                if p.info["status"] != psutil.STATUS_ZOMBIE and p.pid != os.getpid()
                and (p in processes or _group_and_session(p.pid) & places)]
        if not left or time.monotonic() > deadline:
            return [f"{p.pid} {' '.join(p.info['cmdline'] or [])[:120]}" for p in left]
        time.sleep(0.2)


def _group_and_session(pid: int) -> set[int]:
    try:
        return {os.getpgid(pid), os.getsid(pid)}
    except ProcessLookupError:
        return set()


def _kill(processes: list) -> None:
    import psutil

    for p in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


def _stop(run: Run, proc: subprocess.Popen, sig: int, to_group: bool, second_after: float | None = None):
    """Signal the run as the user's tool does; return (exit code, seconds to exit, what was left running)."""
    processes, places = _processes_of(proc)
    names = " ".join(" ".join(p.cmdline()) for p in processes)
    assert "uvicorn" in names and "vlmexp.cli train sft" in names, names  # Prefect's server and the stage run
    start = time.monotonic()
    os.killpg(proc.pid, sig) if to_group else proc.send_signal(sig)
    if second_after is not None:
        time.sleep(second_after)
        assert proc.poll() is None, "ended before the second signal: nothing tested"
        os.killpg(proc.pid, sig) if to_group else proc.send_signal(sig)
    try:
        rc = proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        _kill(processes)
        pytest.fail("still running 90 s after the signal:\n" + run.text()[-3000:])
    seconds = time.monotonic() - start
    print(f"exit {proc.returncode} {seconds:.1f} s after the {'first ' if second_after else ''}signal")
    left = _left_running(processes, places)
    _kill(processes)
    return rc, seconds, left


# (launcher, signal, to the whole process group, resumed after): the resume is checked under torchrun (2
# processes, the harder case); the local launcher's resume after a killed run is tests/test_faults.py's. A
# signal to the main process alone (`kill PID`, Kubernetes' SIGTERM to PID 1) is passed on by the same code
# whatever the launcher and signal: it is checked once, under torchrun, where it has the most to reach
STOPS = [("torchrun", signal.SIGINT, True, True), ("torchrun", signal.SIGTERM, False, False),
         ("torchrun", signal.SIGTERM, True, False), ("local", signal.SIGINT, True, False),
         ("local", signal.SIGHUP, True, False)]
STARTS = re.compile(r"- running .*-m vlmexp\.cli train sft")  # the pipeline's line for each start of SFT
NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}


@pytest.mark.slow
@pytest.mark.parametrize("launcher, sig, to_group, resumed", STOPS,
                         ids=[f"{launcher}-{sig.name}-to-the-{'group' if group else 'main-process'}"
                              for launcher, sig, group, _ in STOPS])
def test_one_stop_signal_ends_the_run_and_the_same_command_resumes(tmp_path, prefect_home, run_inputs,
                                                                   launcher, sig, to_group, resumed):
    """One signal: the run exits with 128 + the signal within 30 s, nothing of it left running (torchrun's
    workers in their own sessions included), SFT started once and never retried, its MLflow runs KILLED, its
    flow run Cancelled; the same command again resumes SFT from its checkpoint and finishes (checked once,
    under torchrun)."""
    run = Run(tmp_path, launcher, run_inputs)
    first = run.start("first")
    _wait_for_checkpoint(run, first)
    rc, seconds, left = _stop(run, first, sig, to_group)
    log = run.text()
    assert rc == 128 + sig, log[-3000:]
    assert seconds < 30, (seconds, log[-3000:])
    assert not left, left
    stopped = f"stopped by {NAMES[sig]}; run the same command again to resume"
    assert stopped in log, log[-3000:]
    assert len(STARTS.findall(log)) == 1 and "Retry 1/" not in log, log[-3000:]  # started once, never retried
    assert not (run.out / "sft" / "final").exists()
    assert run.mlflow_runs() == {"demo-pipeline": "KILLED", "demo-sft": "KILLED"}
    assert [state[1:] for state in run.flow_runs()] == [["CANCELLED", stopped]]
    if not resumed:
        return

    second = run.start("second")
    assert second.wait(timeout=900) == 0, run.text()[-3000:]
    again = run.text()
    assert f"(resume: {run.out / 'sft' / 'checkpoint-'}" in again, again[-3000:]
    assert (run.out / "sft" / "final" / "model.safetensors").is_file()
    assert sorted(state for _, state, _ in run.flow_runs()) == ["CANCELLED", "COMPLETED"]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "local"])
def test_a_second_signal_while_stopping_ends_the_run_at_once(tmp_path, prefect_home, run_inputs, launcher):
    """Ctrl-C twice in a terminal: the second, while the stage is still stopping, kills every process of the
    run at once; the run exits 130 within seconds, leaves nothing running, and is recorded as stopped."""
    run = Run(tmp_path, launcher, run_inputs)
    first = run.start("first")
    _wait_for_checkpoint(run, first)
    rc, seconds, left = _stop(run, first, signal.SIGINT, to_group=True, second_after=0.3)
    log = run.text()
    assert rc == 130, log[-3000:]
    assert seconds < 15, (seconds, log[-3000:])
    assert not left, left
    assert len(STARTS.findall(log)) == 1 and "Retry 1/" not in log, log[-3000:]
    assert run.mlflow_runs() == {"demo-pipeline": "KILLED", "demo-sft": "KILLED"}
    stopped = "stopped by Ctrl-C; run the same command again to resume"
    assert [state[1:] for state in run.flow_runs()] == [["CANCELLED", stopped]]
