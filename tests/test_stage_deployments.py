"""The deployments and stages on their own work pools, for real: a Prefect server, process pools `cpu` (the
flow) and `gpu` (the stages) with a worker each, the deployments from prefect.yaml (`prefect deploy --all`:
the Kubernetes pool from the repository's template, the scheduled retraining's schedule), and `prefect
deployment run 'vlm-pipeline/manual' --watch` with `pipeline.stage_deployments` set. The GRPO stage run's
processes (its flow run and the training process under it) are SIGKILLed after its first checkpoint, as a
preempted node would be; the train task's retry starts the stage deployment again, which resumes from that
checkpoint.

The `cpu` worker is started with `--run-once` once the pipeline's run exists: it submits that run and stays
until it ends, without asking the server for runs every second for the rest of the test. The `gpu` worker,
which the pipeline sends seven stage runs, asks every few seconds.

The module's tests share one server, its pools and its deployments (`server`), started and deployed once per
module instead of once per test (the second test's call: 92.8 s -> 79.6 s, the module 635 s -> 727 s, run
back to back with -n 0 on the shared, loaded 2-core machine, 2026-11-28: the load's swings exceed the gain).
Each test stops the workers it started, and
reads back what tells its runs from the other's (the other's pipeline run fails at once and starts no
stage)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import SMALL_BATCHES
from prefect_server import create_pools_and_deploy, prefect_server, stop

pytestmark = pytest.mark.slow
# the kill comes at checkpoint-2 and the retried run trains steps 3 and 4 (its last, and checkpoint-4): the
# kill has the two steps up to checkpoint-4 to land in, as it would with more steps after them
SAVE_STEPS, MAX_STEPS = 2, 4
STAGES = "pipeline.stage_deployments={sft: vlm-stage/gpu, grpo: vlm-stage/gpu, eval: vlm-stage/gpu}"


@pytest.fixture(scope="module")
def server(tmp_path_factory, prefect_database):
    """A Prefect server on a copy of the created database, with the pools and deployments of prefect.yaml."""
    home = tmp_path_factory.mktemp("prefect") / "prefect-home"
    shutil.copytree(prefect_database, home)
    with pytest.MonkeyPatch.context() as env, prefect_server(home.parent, home) as server:
        env.setenv("PREFECT_HOME", str(home))  # as conftest's prefect_home: what the tests start inherits it
        create_pools_and_deploy(server)
        yield server


@contextlib.contextmanager
def workers(server) -> Iterator[list[subprocess.Popen]]:
    """The workers a test starts (append them), stopped when it ends: the next test's runs are its own."""
    started: list[subprocess.Popen] = []
    try:
        yield started
    finally:
        for worker in started:
            stop(worker)


def _kill_stage_run(worker: subprocess.Popen, checkpoint: Path, watch: subprocess.Popen,
                    seconds: float = 600) -> list[str]:
    """SIGKILL every process the `gpu` worker started (the stage's flow run and its training process) once
    `checkpoint` is complete; the worker stays, as a replacement node would."""
    import psutil

    deadline = time.monotonic() + seconds
    while not (checkpoint / "trainer_state.json").is_file():
        assert watch.poll() is None and time.monotonic() < deadline, f"{checkpoint} never appeared"
        time.sleep(0.2)
    procs, commands = psutil.Process(worker.pid).children(recursive=True), []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):  # one that just exited
            commands.append(" ".join(p.cmdline())[:160])
            p.kill()
    psutil.wait_procs(procs, timeout=30)
    return commands


def _flow_runs(url: str) -> tuple[list, dict[str, str]]:
    """Every flow run, and the log text of each vlm-stage run, read back through the API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: url}), get_client(sync_client=True) as client:
        runs = client.read_flow_runs()
        flows = {f.id: f.name for f in client.read_flows()}
        logs = {}
        for r in (r for r in runs if flows[r.flow_id] == "vlm-stage"):
            lines, page = [], [None]
            while page:
                page = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[r.id])), limit=200,
                                        offset=len(lines))
                lines += [log.message for log in page]
            logs[str(r.id)] = "\n".join(lines)
        parents = {str(r.id): client.read_task_run(r.parent_task_run_id).flow_run_id
                   for r in runs if r.parent_task_run_id}
    return [(flows[r.flow_id], r, parents.get(str(r.id))) for r in runs], logs


def _scheduled_retrain_runs(url: str) -> list:
    """The runs the scheduler service created for `scheduled-retrain` (shortly after the deploy)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName, FlowRunFilter
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: url}), get_client(sync_client=True) as client:
        for _ in range(60):
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(), deployment_filter=DeploymentFilter(
                name=DeploymentFilterName(any_=["scheduled-retrain"])))
            if runs:
                return runs
            time.sleep(1)
    return []


def test_deployments_run_on_their_pools_the_schedule_creates_runs_and_a_killed_stage_resumes(tmp_path, server,
                                                                                          run_inputs):
    from mlflow.tracking import MlflowClient

    out = tmp_path / "run"
    # GRPO: one prompt and its 4 completions per step (the later overrides win over SMALL_BATCHES')
    params = {"config": "configs/demo.yaml", "overrides": [
        *SMALL_BATCHES, f"run.output_dir={out}", *run_inputs(out), STAGES, "pipeline.retry_delay_seconds=0",
        "data.demo.train=16", "data.demo.val=4", "sft.args.max_steps=1", f"grpo.args.max_steps={MAX_STEPS}",
        f"grpo.args.save_steps={SAVE_STEPS}",
        "grpo.args.logging_steps=1", "grpo.args.per_device_train_batch_size=4", "grpo.args.num_generations=4",
        "grpo.args.max_completion_length=8", "eval.max_new_tokens=8"]}
    with workers(server) as started:
        gpu = server.worker("gpu", query_seconds=3)
        started.append(gpu)
        watch = server.run_pipeline(params, tmp_path / "watch.log")
        started.append(server.worker("cpu", "--run-once"))
        killed = _kill_stage_run(gpu, out / "grpo" / f"checkpoint-{SAVE_STEPS}", watch)
        assert watch.wait(1600) == 0 and "Completed" in (tmp_path / "watch.log").read_text(), \
            (tmp_path / "watch.log").read_text()[-3000:]
        runs, logs = _flow_runs(server.url)
        scheduled = _scheduled_retrain_runs(server.url)
    assert scheduled and all(r.state.name == "Scheduled" for r in scheduled)
    assert all(r.expected_start_time.weekday() == 0 for r in scheduled)  # "0 3 * * 1": Mondays
    assert any("vlmexp.cli train grpo" in c for c in killed), killed  # the stage run and its training process

    pipeline = [r for name, r, _ in runs if name == "vlm-pipeline" and r.state.name == "Completed"]
    assert len(pipeline) == 1 and pipeline[0].work_pool_name == "cpu"
    stages = [(r.parameters["stage"], r.state.name, r, parent) for name, r, parent in runs
              if name == "vlm-stage"]
    assert all(r.work_pool_name == "gpu" for _, _, r, _ in stages)
    # linked as subflows of the pipeline's tasks
    assert all(parent == pipeline[0].id for *_, parent in stages)
    assert sorted(state for stage, state, *_ in stages if stage == "sft") == ["Completed"]
    assert sorted(state for stage, state, *_ in stages if stage == "grpo") == ["Completed", "Crashed"]
    # base, sft, grpo
    assert sorted(state for stage, state, *_ in stages if stage == "eval") == ["Completed"] * 3
    retried = next(r for stage, state, r, _ in stages if stage == "grpo" and state == "Completed")
    assert f"(resume: {out / 'grpo' / f'checkpoint-{SAVE_STEPS}'})" in logs[str(retried.id)]

    assert ((out / "grpo" / "final" / "model.safetensors").is_file()
            and (out / "export" / "manifest.json").is_file()
            and (out / "export" / "model.safetensors").is_file())
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    run_id = (out / "grpo" / "mlflow_run_id").read_text().strip()
    for key in ("loss", "reward"):
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        assert steps == list(range(1, MAX_STEPS + 1)), (key, steps)  # each step once, across the kill
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_scheduled_retrain_on_a_folder_a_manual_run_holds_fails_at_once_naming_it(tmp_path, server):
    """The scheduled retrain deployment, run while another run (here this test process) holds the output
    folder: its flow run fails at once, naming the holder, and nothing is written in the folder."""
    from vlmexp.pipeline.hold import holding

    out = tmp_path / "run"
    out.mkdir()
    params = {"config": "configs/demo.yaml", "overrides": [f"run.output_dir={out}"], "force": False}
    with holding(out, "vlmexp run (a manual run)") as hold, workers(server) as started:
        watch = server.run_pipeline(params, tmp_path / "watch.log", deployment="scheduled-retrain")
        # not --run-once: the scheduler's own runs of the deployment are next Monday's
        started.append(server.worker("cpu"))
        assert watch.wait(600) != 0
        runs, _ = _flow_runs(server.url)
        text = "\n".join(str(r.state.message) for _, r, _ in runs) + (tmp_path / "watch.log").read_text()
        holder = f"held by vlmexp run (a manual run) {hold.run_id} (process {os.getpid()} on "
        assert holder in text, text[-3000:]
        assert "one run at a time writes an output folder" in text, text[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [], list(out.iterdir())  # the hold released, nothing else
