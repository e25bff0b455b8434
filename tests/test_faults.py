"""Faults during training: a killed or disk-full GRPO process resumes from its newest complete checkpoint,
recomputes at most save_steps steps, and leaves MLflow a history without duplicated or backwards steps.

The faults are real: SIGKILL of the training process (planted by tests/faults/sitecustomize.py in the
subprocess), and a small tmpfs that fills while a checkpoint is written, then grows; the rerun is what the
pipeline's retried task runs: the same command, the same stage folder, the same MLflow run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import SMALL_BATCHES

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
SAVE_STEPS, MAX_STEPS = 2, 10
OUTAGE_STEPS = 20
GRPO = ["tracking.backend=mlflow", "data.demo.train=16", "data.demo.val=4",
        f"grpo.args.max_steps={MAX_STEPS}", f"grpo.args.save_steps={SAVE_STEPS}", "grpo.args.logging_steps=1",
        "grpo.args.per_device_train_batch_size=4", "grpo.args.num_generations=4",
        "grpo.args.max_completion_length=8", "grpo.args.temperature=1.5",
        "grpo.rewards=[{name: 'rewards_for_tests:char_variety'}]", *SMALL_BATCHES]
# One training on a small real file system, crashed by each fault in turn: every run after the first resumes
# the one before it, and is itself crashed by the next fault. (fault, exit code of the crashed run, newest
# complete checkpoint the next run resumes from)
FAULTS = [("kill_at_step:3", -signal.SIGKILL, 2),   # preempted between checkpoints
          ("kill_in_save:6", -signal.SIGKILL, 4)]   # killed while checkpoint-6 is half written
FULL_AT = 8  # then the disk fills for real while checkpoint-8 is written; it grows, and the last run finishes


def _train(out: Path, env: dict[str, str], uri: str, run_id: str, log: Path | None = None):
    """The stage command, run to its end; with `log`, started with its stderr going there."""
    command = [sys.executable, "-m", "vlmexp.cli", "train", "grpo", "--config", "configs/demo.yaml",
               "--mlflow-run-id", run_id, f"run.output_dir={out}", f"tracking.tracking_uri={uri}", *GRPO]
    if log is None:
        return subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env)
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log.open("w"), cwd=REPO, env=env)


def _resumed_from(stderr: str) -> int:
    return int(stderr.split("(resume: ")[1].split(")")[0].rsplit("-", 1)[1])


@contextmanager
def small_disk(folder: Path, megabytes: int) -> Iterator[Path]:
    """A real tmpfs of `megabytes` mounted at `folder` (CI runs the tests as root, as this needs)."""
    folder.mkdir(parents=True)
    if os.geteuid() != 0:
        pytest.fail("this test fills a real file system: it mounts a tmpfs, which needs root (CI runs the "
                    f"tests as root); run it as root, not as uid {os.geteuid()}")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs at {folder} ({mounted.stderr.strip()}); this test needs a real "
                    "small file system to fill: run it where `mount -t tmpfs` works (a container needs "
                    "CAP_SYS_ADMIN)")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def _fill(disk: Path, leave: int) -> None:
    """Fill `disk` with a file of the test's own (growing or shrinking it) until `leave` bytes are free."""
    filler = disk / "filler"
    have = filler.stat().st_size if filler.exists() else 0
    target = max(0, have + shutil.disk_usage(disk).free - leave)
    with open(filler, "ab") as f:
        if target < have:
            f.truncate(target)
        else:
            f.write(b"\0" * (target - have))


def test_grpo_faults_resume_from_the_newest_complete_checkpoint(tmp_path):
    """On a small tmpfs: a kill between checkpoints, a kill while a checkpoint is half written, then the disk
    filling for real while a checkpoint is written (the MLflow store on it too): after each, the same command
    resumes from the newest complete checkpoint, recomputing at most save_steps steps. The full disk is said
    as such (folder, file, room left, a checkpoint's size), again on a retry with too little room (warned
    before training), and once the file system grows the same command finishes with each step in MLflow
    once."""
    from mlflow.tracking import MlflowClient

    with small_disk(tmp_path / "disk", 96) as disk:
        out = disk / "run"
        uri = f"sqlite:///{out / 'mlflow.db'}"
        client = MlflowClient(uri)
        run_id = client.create_run(client.create_experiment("faults")).info.run_id
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "faults"),
                                                            str(REPO / "tests"), str(REPO)])}
        grpo = out / "grpo"
        resumed_from = None  # the first run starts from the start
        for fault, crash, newest in FAULTS:
            run = _train(out, {**env, "VLMEXP_FAULT": fault}, uri, run_id)
            assert run.returncode == crash, (fault, run.stderr[-3000:])
            if resumed_from is not None:
                assert _resumed_from(run.stderr) == resumed_from, (fault, run.stderr[-3000:])
            step = int(fault.split(":")[1])
            assert not (grpo / "final").exists()
            if "save" in fault:  # the half-written checkpoint is there but has no trainer_state.json
                assert ((grpo / f"checkpoint-{step}").is_dir()
                        and not (grpo / f"checkpoint-{step}" / "trainer_state.json").exists()), fault
            assert (grpo / f"checkpoint-{newest}" / "trainer_state.json").is_file(), fault
            assert step - newest <= SAVE_STEPS  # at most save_steps steps recomputed
            resumed_from = newest
        checkpoint = sum(p.stat().st_size for p in (grpo / "checkpoint-4").rglob("*") if p.is_file())
        _disk_fills_during_a_save(out, env, uri, run_id, checkpoint, resumed_from)
        subprocess.run(["mount", "-o", "remount,size=256m", str(disk)], check=True)  # room again
        last = _train(out, env, uri, run_id)
        assert last.returncode == 0, last.stderr[-3000:]
        assert _resumed_from(last.stderr) == FULL_AT - SAVE_STEPS, last.stderr[-3000:]
        assert "skipping incomplete checkpoint" in last.stderr  # the torn checkpoint-8
        state = json.loads((grpo / f"checkpoint-{MAX_STEPS}" / "trainer_state.json").read_text())
        assert state["global_step"] == MAX_STEPS and (grpo / "final" / "model.safetensors").is_file()
        for key in ("loss", "reward", "rewards/rewards_for_tests:char_variety/mean"):
            steps = [m.step for m in client.get_metric_history(run_id, key)]
            assert steps == list(range(1, MAX_STEPS + 1)), (key, steps)


def _disk_fills_during_a_save(out: Path, env: dict[str, str], uri: str, run_id: str, checkpoint: int,
                              resumed_from: int) -> None:
    """A run that resumes, whose disk the test fills once checkpoint-6 is saved, leaving half a checkpoint:
    checkpoint-8's save fails for real. Then the same command with half a checkpoint free: warned before
    training, and said again."""
    import time

    disk, log = out.parent, out.parent.parent / "filling.log"  # the log off the small disk
    train = _train(out, env, uri, run_id, log)
    saved = out / "grpo" / f"checkpoint-{FULL_AT - SAVE_STEPS}" / "trainer_state.json"
    while not saved.is_file():
        assert train.poll() is None, log.read_text()[-3000:]
        time.sleep(0.1)
    _fill(disk, checkpoint // 2)
    train.wait(timeout=600)
    stderr = log.read_text()
    assert train.returncode == 1, stderr[-3000:]
    assert _resumed_from(stderr) == resumed_from
    _assert_said_as_disk_full(stderr, out)
    assert f"writing {out / 'grpo' / f'checkpoint-{FULL_AT}'}" in stderr.splitlines()[-1], stderr[-2000:]
    # the same command with too little room: warned with both figures before training, and said again
    _fill(disk, checkpoint // 2)
    retry = _train(out, env, uri, run_id)
    assert retry.returncode == 1, retry.stderr[-3000:]
    assert f"{out} has " in retry.stderr and "free, and one checkpoint of" in retry.stderr
    _assert_said_as_disk_full(retry.stderr, out)


def _assert_said_as_disk_full(stderr: str, out: Path) -> None:
    last = stderr.strip().splitlines()[-1].partition("error: ")[2]  # after TRL's progress bar
    assert last.startswith(f"the disk holding {out} is full: writing "), stderr[-3000:]
    assert " free there; one checkpoint of this model needs about " in last, last
    assert "run the same command again: it resumes from the newest complete checkpoint" in last, last
    # the stage's error is the last word even when MLflow, whose store is on the same disk, could not close
    # the run (MLflow logs that failure with its traceback)
    closing = stderr.rfind("MLflow could not close the run")
    assert closing == -1 or closing < stderr.rfind("error: the disk holding"), stderr[-3000:]


def test_killed_pipeline_reruns_without_redoing_finished_stages(tmp_path, prefect_home, run_inputs):
    """Two `vlmexp run`s of one command 2 s apart: one holds the output folder, the other is refused naming
    it; a third during GRPO is refused too. SIGKILL the whole running process group (flow, temporary server,
    training) during GRPO; the same command then takes the dead run's hold over and finishes: SFT comes from
    the cache, GRPO resumes from its checkpoint."""
    import time

    import psutil

    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests"),
           "PREFECT_LOCAL_STORAGE_PATH": str(prefect_home / "storage")}
    command = [sys.executable, "-m", "vlmexp.cli", "run", "configs/demo.yaml", f"run.output_dir={out}",
               "data.demo.train=16", "data.demo.val=4", "sft.args.max_steps=4", "sft.args.save_steps=4",
               "grpo.args.max_steps=10", "grpo.args.save_steps=2", "grpo.args.per_device_train_batch_size=4",
               "grpo.args.num_generations=4", "grpo.args.max_completion_length=8", "eval.enabled=false",
               "grpo.rewards=[{name: 'rewards_for_tests:char_variety'}]", *SMALL_BATCHES, *run_inputs(out)]
    # the same command twice, 2 s apart (a retrain fired while a manual run starts): one holds the folder,
    # the other is refused at once, naming it
    logs = [tmp_path / "first.log", tmp_path / "twin.log"]
    runs = []
    for log in logs:
        runs.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                     stderr=log.open("w"), start_new_session=True))
        time.sleep(2)
    deadline = time.monotonic() + 600  # a shared 2-core machine under load
    while all(r.poll() is None for r in runs):
        assert time.monotonic() < deadline, "neither run ended nor was refused"
        time.sleep(0.5)
    [(refused, refused_log)] = [(r, log) for r, log in zip(runs, logs) if r.poll() is not None]
    [(first, first_log)] = [(r, log) for r, log in zip(runs, logs) if r is not refused]
    _assert_refused(refused.returncode, refused_log.read_text(), out, first.pid)
    while not (out / "grpo" / "checkpoint-2" / "trainer_state.json").is_file():
        assert first.poll() is None and time.monotonic() < deadline, \
            f"GRPO never wrote checkpoint-2 (exit {first.poll()}):\n{first_log.read_text()[-3000:]}"
        time.sleep(0.5)
    # half a run apart: refused as well, while the first trains, before a Prefect server starts
    late = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    _assert_refused(late.returncode, late.stderr, out, first.pid)
    assert "Starting temporary server" not in late.stderr
    assert first.poll() is None, f"the first run ended (exit {first.poll()}) before it could be killed"
    # Prefect's temporary server and the stage run in sessions of their own (a terminal's Ctrl-C reaches only
    # `vlmexp run`, which records the stop and passes it on): the group's SIGKILL misses them, and they still
    # go with the run
    tied = psutil.Process(first.pid).children()
    assert sorted("uvicorn" in " ".join(p.cmdline()) for p in tied) == [False, True], [
        p.cmdline() for p in tied]
    tied += [p for p in tied[0].children(recursive=True) + tied[1].children(recursive=True)]
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    _, alive = psutil.wait_procs(tied, timeout=15)
    for p in alive:
        p.kill()
    assert not alive, f"outlived the killed run: {[p.cmdline() for p in alive]}"
    assert not (out / "grpo" / "final").exists()

    second = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    log = second.stdout + second.stderr
    # the killed run's hold: its process is gone, so the rerun takes it over, saying so
    assert f"its process {first.pid} is gone: taking it over" in log
    assert not (out / ".vlmexp-hold.json").exists() and not list(out.glob(".config.pending*"))
    assert "| sft | skipped: inputs unchanged" in log  # finished before the kill: not redone
    assert "(resume: " in log and "/grpo/checkpoint-" in log.split("(resume: ")[1].split(")")[0]
    assert ((out / "grpo" / "final" / "model.safetensors").is_file()
            and (out / "export" / "manifest.json").is_file())


def _assert_refused(returncode: int, stderr: str, out: Path, holder_pid: int) -> None:
    """A `vlmexp run` refused because another one holds its folder: exit 2, the holder named, the fix."""
    assert returncode == 2, stderr[-3000:]
    assert f"{out.resolve()}: run.output_dir: held by vlm-pipeline flow run " in stderr, stderr[-3000:]
    assert "one run at a time writes an output folder" in stderr, stderr[-3000:]
    assert f"(process {holder_pid} on " in stderr and "set run.on_busy=wait" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]


def _step_seconds(history, start: float, end: float) -> list[float]:
    """The time each step took (its log's timestamp minus the previous step's) for the steps logged between
    `start` and `end` (epoch seconds)."""
    points = sorted((m.step, m.timestamp / 1000) for m in history)
    return [t - before for (_, before), (_, t) in zip(points, points[1:], strict=False) if start <= before and
            t <= end]


def test_an_mlflow_outage_longer_than_its_retries_neither_slows_grpo_nor_loses_a_metric(tmp_path):
    """A real MLflow server, SIGKILLed once GRPO has written checkpoint-4 and started again on the same
    port and store once checkpoint-12 is written and at least 12 s have passed, six times the client's retry
    budget (about 2 s here), while a reward that sleeps a second a step makes the run outlast the outage on
    any machine: the steps during the outage take about as long as those before it, the stage
    ends 0, and afterwards every step of every metric, the completion tables and validation images logged
    during the outage, and the system metric samples are in the run, each once and in order."""
    import statistics
    import time

    from mlflow.tracking import MlflowClient
    from mlflow_server import free_port, kill_server, start_server

    from vlmexp.tracking.tracker import MlflowTracker

    def wait_for(step: int) -> None:
        while not (tmp_path / "grpo" / f"checkpoint-{step}" / "trainer_state.json").is_file():
            assert train.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)

    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = start_server(tmp_path, port)
    try:
        tracker = MlflowTracker(uri, "faults", (tmp_path / "artifacts").as_uri())
        run_id = tracker.start_pipeline("stage", {}, {})
        log = tmp_path / "train.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]),
               "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "2"}  # a retry budget of about 2 s
        train = subprocess.Popen([sys.executable, "-m", "vlmexp.cli", "train", "grpo", "--config",
                                  "configs/demo.yaml", "--mlflow-run-id", run_id,
                                  f"tracking.tracking_uri={uri}", f"run.output_dir={tmp_path}", *GRPO[:3],
                                  f"grpo.args.max_steps={OUTAGE_STEPS}", "grpo.args.save_steps=4", *GRPO[5:],
                                  "grpo.rewards=[{name: 'rewards_for_tests:char_variety'}, "
                                  "{name: 'rewards_for_tests:one_second_a_call'}]",
                                  "tracking.completions_every=3", "tracking.system_metrics_seconds=0.5",
                                  "eval.every_steps=10", "eval.during_training_samples=2",
                                  "eval.during_training_pictures=1", "eval.max_new_tokens=8"],
                                 cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log.open("w"))
        wait_for(4)
    finally:
        kill_server(server)
    down = time.time()
    try:
        wait_for(12)
        time.sleep(max(0.0, down + 12 - time.time()))
        back = time.time()  # the server's start (seconds of CPU) is not counted as outage
        server = start_server(tmp_path, port)
        train.wait(timeout=600)
        stderr = log.read_text()
        assert train.returncode == 0, stderr[-3000:]
        assert "MLflow store does not answer" in stderr, stderr[-3000:]
        if "MLflow answers again" not in stderr:  # a fast run ended before the restarted server answered:
            # what it kept is sent by the pipeline's next step, as the pipeline does after each stage
            from vlmexp.tracking.spool import send_spooled

            assert "they stay in" in stderr, stderr[-3000:]
            send_spooled(tmp_path / "grpo")
        client = MlflowClient(uri)
        loss = client.get_metric_history(run_id, "loss")
        assert max(m.timestamp for m in loss) / 1000 > back, "training ended before the outage did"
        before, during = _step_seconds(loss, 0, down), _step_seconds(loss, down, back)
        assert len(during) >= 6 and len(before) >= 2, (before, during)
        assert statistics.median(during) <= 2 * statistics.median(before), (before, during)
        for key in ("loss", "reward", "Summary/reward", "rewards/rewards_for_tests:char_variety/mean"):
            steps = [m.step for m in client.get_metric_history(run_id, key)]
            assert steps == list(range(1, OUTAGE_STEPS + 1)), (key, steps)
        samples = sorted(client.get_metric_history(run_id, "system/cpu_utilization_percentage"),
                         key=lambda m: m.step)
        assert [m.step for m in samples] == list(range(len(samples))), [m.step for m in samples]
        sampled = [m.timestamp / 1000 - down for m in samples if down <= m.timestamp / 1000 <= back]
        assert len(sampled) > (back - down) / 0.5 / 2, (back - down, sampled)  # sampled all along
        in_outage = [m.step for m in loss if down <= m.timestamp / 1000 <= back]
        tables = {a.path for a in client.list_artifacts(run_id, "completions")}
        assert {f"completions/step_{s:06d}.json" for s in in_outage if s % 3 == 0} <= tables, (
            in_outage, tables)
        images = [a.path for a in client.list_artifacts(run_id, "images") if a.path.endswith(".png")]
        assert sorted(int(p.split("+")[2]) for p in images) == [10, 20], images
        assert client.get_run(run_id).info.status == "FINISHED"
        assert not list((tmp_path / "grpo" / "mlflow_spool" / run_id / "files").iterdir())  # all sent
    finally:
        train.kill()
        kill_server(server)


def test_an_outage_that_outlasts_the_stage_logs_each_step_once(tmp_path):
    """A real MLflow server down from before GRPO starts until after it ended, twice: the stage command, then
    the same command again, as a task retries when the store did not take the records in time (what a long
    outage does and a short one does not). The retry trains no step past max_steps (the Trainer checks it
    only after a step: resumed at checkpoint-10 it trained and logged a step 11), and once the server is
    back the run's histories match the trainer's own log history, step for step."""
    from mlflow.tracking import MlflowClient
    from mlflow_server import free_port, kill_server, start_server

    from vlmexp.tracking.spool import send_spooled
    from vlmexp.tracking.tracker import MlflowTracker

    port, out = free_port(), tmp_path / "run"
    uri = f"http://127.0.0.1:{port}"
    server = start_server(tmp_path, port)
    try:
        run_id = MlflowTracker(uri, "faults", (tmp_path / "artifacts").as_uri()).start_pipeline("s", {}, {})
    finally:
        kill_server(server)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]),
           "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "2"}
    first = _train(out, env, uri, run_id)
    assert first.returncode == 0 and "they stay in" in first.stderr, first.stderr[-3000:]
    retry = _train(out, env, uri, run_id)
    assert retry.returncode == 0 and "training is over" in retry.stderr, retry.stderr[-3000:]
    grpo = out / "grpo"
    assert not (grpo / f"checkpoint-{MAX_STEPS + 1}").exists()
    state = json.loads((grpo / f"checkpoint-{MAX_STEPS}" / "trainer_state.json").read_text())
    server = start_server(tmp_path, port)
    try:
        send_spooled(grpo)
        client = MlflowClient(uri)
        for key in ("loss", "reward", "rewards/rewards_for_tests:char_variety/mean"):
            logged = [(e["step"], e[key]) for e in state["log_history"] if key in e]
            history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
            assert [s for s, _ in history] == [s for s, _ in logged] == list(range(1, MAX_STEPS + 1)), key
            assert [v for _, v in history] == pytest.approx([v for _, v in logged]), key
    finally:
        kill_server(server)


def test_a_resume_skips_the_training_steps_in_mlflow_not_the_system_metric_samples(tmp_path):
    """MLflow's system metrics count their samples in `step`: a slow run's count passes its training steps,
    and taking it for the last logged step would leave the resumed steps unlogged."""
    from mlflow.tracking import MlflowClient

    from vlmexp.tracking.stage_run import last_logged_step

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("faults")).info.run_id
    for step in range(1, 4):
        client.log_metric(run_id, "loss", 1.0 / step, step=step)
    for sample in range(30):
        client.log_metric(run_id, "system/cpu_utilization_percentage", 50.0, step=sample)
    assert last_logged_step(uri, run_id) == 3
