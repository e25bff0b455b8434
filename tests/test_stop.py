"""A stop means stop: Ctrl-C or SIGTERM ends a stage's launcher and every process it started, also workers
in sessions of their own (as torchrun starts them); an interrupted stage is not retried."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import as_a_terminal_job
from vlmexp.pipeline.processes import STOP_GRACE

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


def _start_driver(tmp_path, launcher: str, grace: float = STOP_GRACE) -> tuple[subprocess.Popen, int]:
    """A command that streams `launcher` as `vlmexp run` streams a stage, in a process group of its own (as a
    terminal starts a job), giving a stopped stage `grace` seconds to end; returns it and the pid of the
    launcher's worker."""
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(f"""
        import sys
        from vlmexp.cli import main
        from vlmexp import commands
        from vlmexp.pipeline import processes

        processes.STOP_GRACE = {grace!r}

        def fake_run(args):  # what `vlmexp run` does around a stage: stream the launcher's output
            processes.run_streaming([sys.executable, "-c", {launcher!r}], {{}}, """
                                      """lambda line: print(line, flush=True))
            return 0

        commands.cmd_validate = fake_run
        sys.exit(main(["validate", "x.yaml"]))
    """))
    proc = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
                            start_new_session=True, preexec_fn=as_a_terminal_job)
    line = proc.stdout.readline()
    assert line.startswith("worker "), (line, proc.stderr.read() if proc.poll() is not None else "")
    worker = int(line.split()[1])
    assert _alive(worker)
    return proc, worker


def _gone_soon(pid: int, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


@pytest.mark.parametrize("sig, to_group", [(signal.SIGTERM, False), (signal.SIGINT, False),
                                           (signal.SIGINT, True), (signal.SIGTERM, True),
                                           (signal.SIGHUP, True)])
def test_a_signal_stops_the_launcher_and_its_own_session_workers(tmp_path, sig, to_group):
    """To the command alone (`kill PID`) or to its process group (a terminal's Ctrl-C, a closed terminal): the
    command passes the signal on to the stage, whose worker in a session of its own goes too, and exits with
    128 + the signal. The launcher dies of the signal without passing it on (torchrun passes it on) and leaves
    its worker holding the stage's output open, so the worker goes when the stop's grace period runs out:
    one second here, not a user's `STOP_GRACE` (whose wait is the next test's)."""
    proc, worker = _start_driver(tmp_path, LAUNCHER, grace=1.0)
    start = time.monotonic()
    os.killpg(proc.pid, sig) if to_group else proc.send_signal(sig)
    rc = proc.wait(timeout=60)
    err = proc.stderr.read()
    assert rc == 128 + sig, err
    assert "was stopped by a signal" not in err and "Traceback" not in err, err  # a stop, said in one line
    assert time.monotonic() - start < 30
    assert _gone_soon(worker), "the worker in its own session outlived the stop"


def test_a_second_signal_kills_a_stage_that_has_not_stopped_at_once(tmp_path):
    """A worker that ignores the stop gets `STOP_GRACE` seconds; a second Ctrl-C to the group ends it at
    once."""
    stubborn = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                "signal.signal(signal.SIGTERM, signal.SIG_IGN); ")
    proc, worker = _start_driver(tmp_path, LAUNCHER.replace('"import time;', f'"{stubborn}import time;'))
    try:
        time.sleep(0.5)  # the worker has set its handlers
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(2)
        assert proc.poll() is None and _alive(worker), "the worker ignores the stop: the grace period runs"
        start = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=STOP_GRACE) == 130, proc.stderr.read()
        assert time.monotonic() - start < 5
        assert _gone_soon(worker, 2), "a second Ctrl-C left the worker running"
    finally:  # leave nothing of the test running
        for pid in (proc.pid, worker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_second_ctrl_c_kills_at_once_what_the_first_asked_to_stop(tmp_path):
    """A launcher and a worker that ignore SIGTERM get the grace period; a second Ctrl-C ends it with
    SIGKILL."""
    stubborn = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    launcher = stubborn + LAUNCHER.replace('"import time;', f'"{stubborn}import time;')
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(f"""
        import signal, subprocess, sys, time
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from vlmexp.pipeline.processes import stop_process_tree

        launcher = subprocess.Popen([sys.executable, "-c", {launcher!r}], stdout=subprocess.PIPE, text=True)
        print(launcher.pid, launcher.stdout.readline().split()[1], flush=True)
        time.sleep(0.5)  # the launcher has set its SIGTERM handler
        print("stopping", flush=True)
        try:
            stop_process_tree(launcher, grace=120)
        except KeyboardInterrupt:
            sys.exit(130)
    """))
    proc = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, text=True, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    pids = [int(pid) for pid in proc.stdout.readline().split()]
    try:
        assert proc.stdout.readline() == "stopping\n"
        time.sleep(1)
        assert all(_alive(pid) for pid in pids), "they ignore SIGTERM: the grace period runs"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 130
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in pids if _alive(pid)], ("a second Ctrl-C left the launcher or its worker "
                                                          "running")
    except BaseException:  # leave nothing of the test running
        for pid in [proc.pid, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        raise


# what the pipeline does once stopped takes CLOSE_SECONDS: 3 where the test waits for it to end; 30 where a
# third Ctrl-C must cut it short (a test process held up for seconds on a loaded machine still sends it in
# time)
CLOSING = textwrap.dedent("""
    import sys, time
    from vlmexp import cli, commands
    from vlmexp.pipeline import processes

    def fake_run(args):  # a stage, then what the pipeline does once it was stopped: close its runs (a while)
        try:
            processes.run_streaming([sys.executable, "-c", "import time; print('started', flush=True); "
                                     "time.sleep(600)"], {}, lambda line: print(line, flush=True))
        except processes.StageInterrupted:
            print("closing", flush=True)
            time.sleep(CLOSE_SECONDS)
            print("closed", flush=True)
            raise

    commands.cmd_validate = fake_run
    sys.exit(cli.main(["validate", "x.yaml"]))
""")


@pytest.mark.parametrize("signals, closed", [(2, True), (3, False)])
def test_a_second_ctrl_c_lets_the_stop_be_recorded_and_a_third_leaves_at_once(tmp_path, signals, closed):
    """Ctrl-C twice, the second after the stage has stopped: the run's records are still closed (a Prefect
    flow run Cancelled, not Crashed by an interrupt in the middle); a third Ctrl-C leaves without waiting."""
    driver = tmp_path / "driver.py"
    driver.write_text(CLOSING.replace("CLOSE_SECONDS", "3" if closed else "30"))
    proc = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
                            start_new_session=True, preexec_fn=as_a_terminal_job, bufsize=1)
    try:
        assert proc.stdout.readline() == "started\n", proc.stderr.read() if proc.poll() is not None else ""
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole foreground group
        # the stage's last lines (its KeyboardInterrupt)
        shown = list(iter(proc.stdout.readline, "closing\n"))
        assert proc.poll() is None and "started\n" not in shown, shown
        for _ in range(signals - 1):
            os.killpg(proc.pid, signal.SIGINT)
            time.sleep(0.2)
        assert proc.wait(timeout=20) == 130
        out, err = proc.communicate()
        assert ("closed\n" in out) is closed, (out, err)
        assert "a further signal leaves without" in err
        assert "stopped by Ctrl-C; run the same command again to resume" in err
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


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


@pytest.mark.slow
def test_the_temporary_server_goes_with_a_killed_run(tmp_path, prefect_home):
    """`vlmexp run` starts Prefect's temporary server out of its process group (a terminal's Ctrl-C must not
    end it); SIGKILL of the run, which no handler sees, still ends the server."""
    import psutil

    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent("""
        import os, signal, sys
        from prefect.settings import PREFECT_API_URL
        from flows.temporary_server import temporary_server

        with temporary_server():
            print(PREFECT_API_URL.value(), flush=True)
            sys.stdin.readline()
            os.kill(os.getpid(), signal.SIGKILL)
    """))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen([sys.executable, str(driver)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=tmp_path, env=env)
    url = proc.stdout.readline().strip()
    assert url.startswith("http://127.0.0.1:") and url.endswith("/api"), url
    servers = [p for p in psutil.Process(proc.pid).children() if "uvicorn" in " ".join(p.cmdline())]
    assert len(servers) == 1 and os.getpgid(servers[0].pid) != os.getpgid(proc.pid)
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    _, alive = psutil.wait_procs(servers, timeout=15)
    for p in alive:
        p.kill()
    assert not alive, "the temporary server outlived the killed run"


@pytest.mark.slow
def test_a_stopped_pipeline_cancels_the_stage_runs_it_started_elsewhere(prefect_database):
    """A stage run on another work pool is a subflow of the pipeline's task; Prefect leaves it running when
    the pipeline stops, so the pipeline asks it to cancel (its worker then stops the stage's processes)."""
    from conftest import prefect_api
    from prefect import flow, get_client, task

    from flows.pipeline import vlm_pipeline
    from flows.stopping import cancel_child_runs, on_stopped

    # a pipeline run that is cancelled, crashes or fails leaves no stage run of its own running
    assert all(on_stopped in hooks for hooks in (vlm_pipeline.on_cancellation_hooks,
                                                 vlm_pipeline.on_crashed_hooks,
                                                 vlm_pipeline.on_failure_hooks))

    @flow(name="pipeline-like")
    def parent():
        pass

    @flow(name="stage-like")
    def child():
        pass

    @task(name="train-stage")
    def train():
        pass

    with prefect_api(prefect_database), get_client(sync_client=True) as client:
        parent_run = client.create_flow_run(parent)
        task_run = client.create_task_run(train, flow_run_id=parent_run.id, dynamic_key="0")
        running = client.create_flow_run(child, parent_task_run_id=task_run.id)
        from prefect.states import Completed, Running

        client.set_flow_run_state(running.id, Running(), force=True)
        done = client.create_flow_run(child, parent_task_run_id=task_run.id)
        client.set_flow_run_state(done.id, Completed(), force=True)
        other = client.create_flow_run(child)  # not this pipeline's

        assert cancel_child_runs(str(parent_run.id)) == [str(running.id)]
        assert client.read_flow_run(running.id).state.type.value == "CANCELLING"
        assert client.read_flow_run(done.id).state.type.value == "COMPLETED"
        assert client.read_flow_run(other.id).state.type.value == "PENDING"


def test_torchrun_stopped_by_a_signal_of_its_own_is_a_stop_not_a_failure(tmp_path):
    """torchrun reports a signal as exit code 1 with `SignalException: ... got signal`: a stage whose launcher
    alone was signalled (this process got nothing) is interrupted, not failed, so it is not retried."""
    import psutil

    from vlmexp.pipeline.processes import StageInterrupted, run_streaming, stop_signal

    worker = tmp_path / "worker.py"
    worker.write_text("import time\nprint('ready', flush=True)\ntime.sleep(600)\n")
    torchrun = str(Path(sys.executable).with_name("torchrun"))

    def on_line(line: str) -> None:
        if line == "ready":  # signal torchrun, the tied wrapper's exec
            [launcher] = [p for p in psutil.Process().children() if "torchrun" in " ".join(p.cmdline())]
            launcher.send_signal(signal.SIGINT)

    with pytest.raises(StageInterrupted, match=r"stopped by a signal \(exit code 1\)") as stopped:
        run_streaming([torchrun, "--nproc_per_node=1", "--standalone", str(worker)], os.environ, on_line)
    assert "got signal: 2" in str(stopped.value) and stop_signal() is None
