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
        import signal, sys
        signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started from a shell's background job
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


def test_a_second_ctrl_c_kills_at_once_what_the_first_asked_to_stop(tmp_path):
    """A launcher and a worker that ignore SIGTERM get the grace period; a second Ctrl-C ends it with SIGKILL."""
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
        assert not [pid for pid in pids if _alive(pid)], "a second Ctrl-C left the launcher or its worker running"
    except BaseException:  # leave nothing of the test running
        for pid in [proc.pid, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        raise


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


SMALL_RUN = ["data.demo.train=32", "data.demo.val=8", "sft.args.max_steps=60", "sft.args.save_steps=2",
             "sft.args.logging_steps=1", "sft.args.per_device_train_batch_size=4", "grpo.args.max_steps=2",
             "grpo.args.per_device_train_batch_size=4", "grpo.args.num_generations=4",
             "grpo.args.max_completion_length=12", "eval.max_new_tokens=12",
             "launch.launcher=torchrun", "launch.nproc_per_node=2"]


def _flow_run_states(prefect_home: Path) -> list[tuple[str, str, str]]:
    """(flow name, state type, state message) of every flow run in the Prefect database under `prefect_home`:
    `vlmexp run`'s temporary server is gone once it exits, its sqlite database is not."""
    import sqlite3

    with sqlite3.connect(prefect_home / "prefect.db") as db:
        return db.execute("SELECT flow.name, flow_run.state_type, flow_run_state.message FROM flow_run "
                          "JOIN flow ON flow.id = flow_run.flow_id "
                          "JOIN flow_run_state ON flow_run_state.id = flow_run.state_id").fetchall()


# a terminal's Ctrl-C reaches its whole foreground process group (vlmexp, Prefect's temporary server, torchrun);
# `kill PID` reaches the one process
@pytest.mark.slow
@pytest.mark.parametrize("sig, code, by, to_group", [(signal.SIGINT, 130, "Ctrl-C", True),
                                                     (signal.SIGTERM, 143, "SIGTERM", False)],
                         ids=["ctrl-c-to-the-group", "sigterm-to-the-process"])
def test_a_signal_stops_a_pipeline_run_under_torchrun_and_a_rerun_resumes(tmp_path, sig, code, by, to_group):
    """`vlmexp run` with SFT under torchrun (2 processes), stopped once its first checkpoint is saved: it exits
    with the signal's status within seconds, no process it started is left, its MLflow runs are KILLED, its
    flow run ends Cancelled (read back from the run's Prefect database: the temporary server is gone), and
    the same command again resumes SFT from that checkpoint and finishes."""
    import psutil
    from mlflow.tracking import MlflowClient

    out, prefect_home = tmp_path / "out", tmp_path / "prefect"
    cmd = [sys.executable, "-m", "vlmexp.cli", "run", "configs/demo.yaml", f"run.output_dir={out}", *SMALL_RUN]
    env = {**os.environ, "PREFECT_HOME": str(prefect_home)}
    env.pop("PREFECT_API_URL", None)

    def start(log):
        return subprocess.Popen(cmd, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                                env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.default_int_handler))

    first = start(tmp_path / "first.log")
    deadline = time.monotonic() + 300
    while not (out / "sft" / "checkpoint-2" / "trainer_state.json").is_file():
        assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-3000:]
        time.sleep(0.2)
    tree = psutil.Process(first.pid).children(recursive=True)
    assert any("torchrun" in " ".join(p.cmdline()) for p in tree)
    assert any("uvicorn" in " ".join(p.cmdline()) for p in tree)  # Prefect's temporary server
    start_stop = time.monotonic()
    os.killpg(first.pid, sig) if to_group else first.send_signal(sig)
    try:
        rc = first.wait(timeout=60)
    except subprocess.TimeoutExpired:
        for p in [psutil.Process(first.pid), *tree]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        pytest.fail("still running 60 s after the signal:\n" + (tmp_path / "first.log").read_text()[-3000:])
    log = (tmp_path / "first.log").read_text()
    assert rc == code, log[-3000:]
    assert time.monotonic() - start_stop < 30, log[-3000:]
    assert f"stopped by {by}; run the same command again" in log
    time.sleep(1)
    assert not [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], "left running"
    assert not (out / "sft" / "final").exists()
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    runs = {r.info.run_name: r.info.status for r in client.search_runs([e.experiment_id for e in client.search_experiments()])}
    assert runs == {"demo-pipeline": "KILLED", "demo-sft": "KILLED"}, runs
    stopped = f"stopped by {by}; run the same command again to resume"
    assert _flow_run_states(prefect_home) == [("vlm-pipeline", "CANCELLED", stopped)]

    second = start(tmp_path / "second.log")
    assert second.wait(timeout=600) == 0, (tmp_path / "second.log").read_text()[-3000:]
    again = (tmp_path / "second.log").read_text()
    assert f"(resume: {out / 'sft' / 'checkpoint-'}" in again, again[-3000:]
    assert (out / "sft" / "final").is_dir() and (out / "grpo" / "final").is_dir()
    assert sorted(state for _, state, _ in _flow_run_states(prefect_home)) == ["CANCELLED", "COMPLETED"]


@pytest.mark.slow
def test_the_temporary_server_goes_with_a_killed_run(tmp_path):
    """`vlmexp run` starts Prefect's temporary server out of its process group (a terminal's Ctrl-C must not end
    it); SIGKILL of the run, which no handler sees, still ends the server."""
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
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen([sys.executable, str(driver)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=tmp_path, env=env)
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
def test_a_stopped_pipeline_cancels_the_stage_runs_it_started_elsewhere():
    """A stage run on another work pool is a subflow of the pipeline's task; Prefect leaves it running when the
    pipeline stops, so the pipeline asks it to cancel (its worker then stops the stage's processes)."""
    from prefect import flow, get_client, task
    from prefect.testing.utilities import prefect_test_harness

    from flows.pipeline import vlm_pipeline
    from flows.stopping import cancel_child_runs, on_stopped

    # a pipeline run that is cancelled, crashes or fails leaves no stage run of its own running
    assert all(on_stopped in hooks for hooks in (vlm_pipeline.on_cancellation_hooks, vlm_pipeline.on_crashed_hooks,
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

    with prefect_test_harness(server_startup_timeout=60), get_client(sync_client=True) as client:
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
