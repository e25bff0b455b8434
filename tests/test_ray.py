"""launch.launcher: ray on a real 2-node Ray cluster started on this machine (tests/ray_cluster.py, shared by
the module's tests, its processes ended by PID): the pipeline's stages as Ray workers on different
nodes, their losses against torchrun's, a lost node, each stop signal, and each refusal before any
work."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import SMALL_BATCHES, as_a_terminal_job
from tests.ray_cluster import RayTestCluster, free_port, ray_test_cluster

REPO = Path(__file__).resolve().parents[1]
DEMO = str(REPO / "configs/demo.yaml")
QWEN3_5 = str(REPO / "configs/demo_qwen3_5.yaml")
STEPS = ["data.demo.train=32", "data.demo.val=8", *SMALL_BATCHES, "sft.args.logging_steps=1",
         "grpo.args.logging_steps=1", "grpo.args.max_completion_length=8", "eval.enabled=false",
         "export.enabled=false", "pipeline.retry_delay_seconds=1"]


# a line of Python bytecode disassembly (`dis.dis`), as dill prints it into a captured stdout while `datasets`
# hashes a function: Ray Train's print patch (an earlier version of the launcher ran it) sent them to the log
DISASSEMBLY = re.compile(r"^.*\b(RESUME|LOAD_GLOBAL|LOAD_FAST|RETURN_VALUE)\b +\d.*$", re.M)


def on_ray(address: str | None, **more) -> list[str]:
    """`launch.launcher: ray` on the cluster at `address` (None: no address, Ray's own rule finds it)."""
    ray = {**({"address": address} if address else {}), "num_workers": 2,
           "placement_strategy": "STRICT_SPREAD", **more}
    return ["launch.launcher=ray", f"launch.ray={json.dumps(ray)}"]


@pytest.fixture(scope="module")
def cluster():
    with ray_test_cluster() as c:
        yield c


class Run:
    """`vlmexp run` on the demo config in a process group of its own (as a terminal's job); its log, its
    MLflow store read back."""

    def __init__(self, out: Path, overrides: list[str]):
        self.out = out
        self.cmd = [sys.executable, "-m", "vlmexp.cli", "run", DEMO, f"run.output_dir={out}", *overrides]
        self.env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}

    def start(self, name: str) -> subprocess.Popen:
        self.log = self.out.parent / f"{name}.log"
        return subprocess.Popen(self.cmd, cwd=REPO, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                env=self.env, start_new_session=True, preexec_fn=as_a_terminal_job)

    def text(self) -> str:
        return self.log.read_text()

    def stage_runs(self):
        from mlflow.tracking import MlflowClient

        client = MlflowClient(f"sqlite:///{self.out / 'mlflow.db'}")
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
        return client, {r.info.run_name: r for r in runs}


def steps_logged(client, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


@pytest.mark.slow
def test_sft_runs_on_two_nodes_from_the_pipeline(cluster, tmp_path, prefect_home, run_inputs):
    """`vlmexp run` through Ray Client, 2 workers on different nodes: SFT completes; each worker's line comes
    back with its rank and node; each worker trains on its share of the data; the stage run's tags name the
    cluster, the nodes and each worker's node and resources; the first losses equal those of torchrun with 2
    processes on the same data and seed; launch.ray.runtime_env reaches the workers (its env_vars turn off
    the progress bars of the workers' model loading, which torchrun's ranks show). (GRPO on the cluster: the
    deployment test below.)"""
    out = tmp_path / "out"
    quiet = {"env_vars": {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}}
    run = Run(out, [*STEPS, "sft.args.max_steps=2", "grpo.enabled=false",
                    *on_ray(cluster.client, runtime_env=quiet), *run_inputs(out)])
    assert run.start("ray").wait(timeout=900) == 0, run.text()[-4000:]
    log = run.text()
    client, runs = run.stage_runs()
    assert "demo-sft" in runs, runs.keys()
    stage_run = runs["demo-sft"]
    assert stage_run.info.status == "FINISHED"
    tags = stage_run.data.tags
    assert tags["ray.cluster"] == cluster.client and tags["ray.nodes"] == "2", tags
    assert re.fullmatch(r"[0-9a-f]+", tags["ray.job_id"]), tags
    assert tags["ray.run_name"].startswith("demo-sft-"), tags
    nodes = [re.match(r"node (\w+) ", tags[f"ray.worker.{rank}"]).group(1) for rank in (0, 1)]
    assert nodes[0] != nodes[1] and all("1 CPU" in tags[f"ray.worker.{r}"] for r in (0, 1)), tags
    for rank, node in enumerate(nodes):  # the workers' lines, in the task's log
        assert f"[rank {rank} node {node} " in log, log[-3000:]
    # the stage's MLflow run is opened by rank 0 alone (rank 1's accelerate state knows it is rank 1)
    opened = re.findall(r"\[rank (\d) node \w+ [^\n]*logging to MLflow run", log)
    assert opened == ["0"], opened
    assert not DISASSEMBLY.search(log), DISASSEMBLY.search(log).group(0)
    assert "Loading weights" not in log, log[-3000:]  # the runtime_env's env_vars, in the workers
    assert steps_logged(client, stage_run.info.run_id, "loss") == [1, 2]
    # 2 workers x 8 records a step, of 32: an epoch is 2 steps (one worker alone would take 4)
    sft_log = json.loads((out / "sft" / "checkpoint-2" / "trainer_state.json").read_text())["log_history"]
    assert [e["epoch"] for e in sft_log if "loss" in e] == [0.5, 1.0]
    assert (out / "sft" / "final" / "model.safetensors").is_file()

    hand = tmp_path / "torchrun"
    r = subprocess.run([sys.executable, "-m", "vlmexp.cli", "train", "sft", "--config", DEMO,
                        f"run.output_dir={hand}", *STEPS, "sft.args.max_steps=2", "tracking.backend=none",
                        "launch.launcher=torchrun", "launch.nproc_per_node=2", *run_inputs(hand)],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Loading weights" in r.stderr, r.stderr[-3000:]
    torchrun_log = json.loads((hand / "sft/checkpoint-2/trainer_state.json").read_text())["log_history"]
    losses = [[e["loss"] for e in history if "loss" in e] for history in (sft_log, torchrun_log)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-4), losses


def _wait_for(path: Path, proc: subprocess.Popen, run: Run, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not path.is_file():
        assert proc.poll() is None and time.monotonic() < deadline, run.text()[-3000:]
        time.sleep(0.2)


def _newest_checkpoint(stage: Path) -> int:
    return max((int(p.parent.name.split("-")[1]) for p in stage.glob("checkpoint-*/trainer_state.json")),
               default=0)


def _stop_and_check_the_cluster(cluster, run: Run, proc: subprocess.Popen, sig: int, to_group: bool) -> None:
    """Once the stage saved a checkpoint newer than those before this start: `sig` to the run's process group
    (a terminal's Ctrl-C, a closed terminal's SIGHUP) or to its main process alone (`kill PID`). The run exits
    128 + `sig` within 30 s and leaves nothing of the Ray run on the cluster: no actor, no placement group
    (Ray's state API), no worker or controller process on any node."""
    sft = run.out / "sft"
    _wait_for(sft / f"checkpoint-{_newest_checkpoint(sft) + 2}" / "trainer_state.json", proc, run)
    job = json.loads((run.out / "ray" / "sft" / "run.json").read_text())["job_id"]
    start = time.monotonic()
    os.killpg(proc.pid, sig) if to_group else proc.send_signal(sig)
    assert proc.wait(timeout=60) == 128 + sig, run.text()[-3000:]
    assert time.monotonic() - start < 30, run.text()[-3000:]
    said = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}[sig]
    for line in ("stopped: the Ray run left nothing on the cluster",
                 f"stopped by {said}; run the same command again to resume"):
        assert line in run.text(), run.text()[-3000:]
    assert not _left_of(cluster, job), _left_of(cluster, job)
    assert not cluster.processes("ray::StageWorker")


RESUMED = re.compile(r"\(resume: \S+/sft/checkpoint-\d+\)")


@pytest.mark.slow
def test_a_lost_node_resumes_and_each_stop_signal_leaves_nothing_on_the_cluster(cluster, tmp_path,
                                                                                prefect_home, run_inputs):
    """A worker node killed after SFT's checkpoint-2 (its Ray processes, as a machine lost) and a node back
    in its place: the driver starts the worker group again, which resumes from the newest checkpoint. Then
    each stop as users send it, each after a newer checkpoint: Ctrl-C to the run's process group, SIGTERM to
    its main process alone (`kill PID`, a scheduler), SIGHUP to the group (a closed terminal). Each exits 128
    + the signal within 30 s, leaves nothing of the Ray run on the cluster, and the same command again resumes
    from the newest checkpoint; the last completes, every MLflow step logged once. The driver connects with
    the head's GCS address, as a driver on a node does (the other pipeline tests connect through Ray
    Client)."""
    out = tmp_path / "out"
    run = Run(out, [*STEPS, "sft.args.max_steps=22", "sft.args.save_steps=2", "grpo.enabled=false",
                    *on_ray(cluster.gcs, max_failures=1), *run_inputs(out)])
    first = run.start("first")
    _wait_for(out / "sft" / "checkpoint-2" / "trainer_state.json", first, run)
    cluster.kill_node("b")
    cluster.start_node_b()
    _wait_for(out / "sft" / "checkpoint-6" / "trainer_state.json", first, run)
    assert RESUMED.search(run.text()), run.text()[-3000:]  # the restarted group resumed
    _stop_and_check_the_cluster(cluster, run, first, signal.SIGINT, to_group=True)

    for name, sig, to_group in (("second", signal.SIGTERM, False), ("third", signal.SIGHUP, True)):
        _stop_and_check_the_cluster(cluster, run, run.start(name), sig, to_group)
        assert RESUMED.search(run.text()), run.text()[-3000:]

    last = run.start("last")
    assert last.wait(timeout=900) == 0, run.text()[-3000:]
    assert RESUMED.search(run.text()), run.text()[-3000:]
    client, runs = run.stage_runs()
    assert runs["demo-sft"].info.status == "FINISHED"
    assert steps_logged(client, runs["demo-sft"].info.run_id, "loss") == list(range(1, 23))


@pytest.mark.slow
def test_a_runtime_env_working_dir_carries_code_to_the_workers(cluster, tmp_path, run_inputs, tiny_models):
    """launch.ray.runtime_env {working_dir: JOB}, for nodes that lack the code: Ray uploads JOB, and each
    worker runs in its unpacked copy (not the driver's folder) and imports a reward module found only there;
    GRPO completes a step with it, on the tiny Qwen3.5-MoE (Ray's only run of Qwen3.5: the MoE has every layer
    kind of the dense model, linear and full attention, plus the fused experts; Qwen2.5-VL runs on the cluster
    in the other tests). No launch.ray.address: the driver takes RAY_ADDRESS, as Ray's tools do
    (a verl or EasyR1 job script sets it and nothing else), and records it in run.json and the run's tags."""
    from vlmexp.ray_cluster import run_tags

    job, out, where = tmp_path / "job", tmp_path / "out", tmp_path / "where.txt"
    job.mkdir()
    (job / "job_rewards.py").write_text(
        "import os\n\n\ndef where(prompts=None, completions=(), **kwargs):\n"
        "    with open(os.environ['VLMEXP_TEST_WHERE'], 'a') as f:\n"
        "        f.write(os.getcwd() + '\\n')\n"
        "    return [0.0 for _ in completions]\n")
    carried = {"working_dir": str(job), "env_vars": {"VLMEXP_TEST_WHERE": str(where)}}
    r = subprocess.run([sys.executable, "-m", "vlmexp.cli", "train", "grpo", "--config", QWEN3_5,
                        f"run.output_dir={out}", *STEPS, "grpo.args.max_steps=1", "tracking.backend=none",
                        "grpo.rewards=[{name: 'job_rewards:where'}]", *on_ray(None, runtime_env=carried),
                        *run_inputs(out), f"model.path={tiny_models['qwen3_5_moe']}"], cwd=job,
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "RAY_ADDRESS": cluster.gcs})
    assert r.returncode == 0, r.stderr[-3000:]
    assert f" on {cluster.gcs}: grpo as run " in r.stdout + r.stderr, r.stderr[-3000:]
    run = json.loads((out / "ray" / "grpo" / "run.json").read_text())
    assert (run["address"], run["address_from"]) == (cluster.gcs, "RAY_ADDRESS")
    assert run["gcs_address"].rsplit(":", 1)[1] == cluster.gcs.rsplit(":", 1)[1]  # as Ray names the head
    tags = run_tags(out / "ray" / "grpo")
    assert (tags["ray.cluster"], tags["ray.address_from"]) == (cluster.gcs, "RAY_ADDRESS"), tags
    places = set(where.read_text().split())
    assert places and all("working_dir_files" in p and Path(p) != job for p in places), places
    assert json.loads((out / "grpo" / "final" / "config.json").read_text())["model_type"] == "qwen3_5_moe"


@pytest.mark.slow
def test_asking_more_than_the_cluster_has_is_refused_before_any_work(cluster, tmp_path, vlmexp_main):
    """`vlmexp validate`: GPUs, CPUs and a custom resource beyond the cluster's totals, and more nodes than
    it has for STRICT_SPREAD, each named with both figures."""
    rc, _, err = vlmexp_main("validate", DEMO, f"run.output_dir={tmp_path}",
                             *on_ray(cluster.gcs, num_workers=3, gpus_per_worker=1, cpus_per_worker=2,
                                     resources_per_worker={"node_a": 1}))
    assert rc == 2, err
    for said in ("3 workers x 1 GPU ask for 3 GPU in all, and the cluster at", "has 0",
                 "3 workers x 2 CPU ask for 6 CPU in all", "has 2", "3 workers x 1 node_a ask for 3 node_a",
                 "has 1", "STRICT_SPREAD puts each of the 3 workers on a node of its own", "has 2 nodes"):
        assert said in err, err
    rc, _, err = vlmexp_main("validate", DEMO, f"run.output_dir={tmp_path}", *on_ray(cluster.gcs))
    assert rc == 0, err


@pytest.mark.slow
def test_an_output_folder_a_node_cannot_see_is_refused_naming_the_node_and_the_path(cluster, tmp_path,
                                                                                    vlmexp_main):
    """A third node whose view of the output folder is an empty tmpfs (its own mount namespace): `vlmexp
    validate` names that node and the marker's path; the two nodes that see the folder are not named."""
    hidden = tmp_path / "shared"
    (hidden / "out").mkdir(parents=True)  # it exists here (else the stage checks it, not validate)
    cluster.start_blind_node(hidden)
    try:
        rc, _, err = vlmexp_main("validate", DEMO, f"run.output_dir={hidden / 'out'}", *on_ray(cluster.gcs))
    finally:
        cluster.kill_node("c")
    assert rc == 2, err
    [said] = re.findall(r"node (\w+) \(\S+\) does not see (\S+), which the driver wrote into run.output_dir",
                        err)
    assert said[1].startswith(str(hidden / "out" / ".vlmexp-ray-marker-")), err
    assert "mount the same shared folder at the same path on every node" in err, err
    assert not list((hidden / "out").glob(".vlmexp-ray-marker-*"))  # the marker removed


@pytest.mark.slow
def test_a_cluster_with_token_authentication_refuses_a_machine_without_its_token(tmp_path, vlmexp_main):
    """A head started with Ray's token authentication (RAY_AUTH_MODE=token, its token in RAY_AUTH_TOKEN):
    `vlmexp validate` from a machine without the token says the cluster refused it and how to give it the
    token; with the token, it passes. (Where ~/.ray/auth_token exists, Ray itself sends that token.)"""
    token = "0f" * 32
    head = RayTestCluster(env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token})
    one = ["launch.launcher=ray", f"launch.ray={json.dumps({'address': head.gcs, 'num_workers': 1})}"]
    try:
        head.start_head()
        rc, _, err = vlmexp_main("validate", DEMO, f"run.output_dir={tmp_path}", *one,
                                 RAY_AUTH_MODE="disabled", RAY_AUTH_TOKEN="")
        assert rc == 2, err
        assert f"the cluster at {head.gcs} refused this machine's connection: it uses Ray's token " \
               "authentication" in err, err
        assert "RAY_AUTH_MODE=token with RAY_AUTH_TOKEN" in err and "launch.ray" in err, err
        rc, _, err = vlmexp_main("validate", DEMO, f"run.output_dir={tmp_path}", *one,
                                 RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
        assert rc == 0, err
    finally:
        head.stop()


def test_dry_run_prints_the_driver_and_what_it_submits(vlmexp_main):
    rc, out, err = vlmexp_main("train", "grpo", "--config", DEMO, "--dry-run", "launch.deepspeed=x.json",
                               *on_ray("ray://head:10001", gpus_per_worker=1, max_failures=2,
                                       resources_per_worker={"node_a": 1}))
    assert rc == 0, err
    command, submission = out.strip().splitlines()
    assert command.startswith(f"{sys.executable} -m vlmexp.ray_launch train grpo --config {DEMO} "
                              "--in-process")
    assert submission == ("Ray actors on ray://head:10001: 2 workers, each 1 GPU, 1 CPU, 1 "
                          "node_a; placement STRICT_SPREAD; up to 2 worker-group restarts from the newest "
                          "checkpoint; runtime_env none (the nodes have vlmexp installed)")


def test_an_address_nothing_answers_at_is_refused_with_how_to_start_a_cluster(vlmexp_main, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    rc, _, err = vlmexp_main("validate", DEMO, f"run.output_dir={tmp_path}", *on_ray(address))
    assert rc == 2
    assert f"no Ray cluster answers at {address}" in err and "ray start --head --port=6379" in err, err
    assert "launch.ray.address" in err, err


def test_without_ray_installed_the_extra_is_named():
    """`vlmexp validate` where `import ray` fails (as in an install without the extra)."""
    code = ("import sys; sys.modules['ray'] = None; from vlmexp.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "validate", DEMO, *on_ray("ray://head:10001")], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert "launcher 'ray' needs Ray, which is not installed here" in r.stderr, r.stderr
    assert "pip install 'vlmexp[ray]'" in r.stderr, r.stderr


def test_without_an_address_ray_s_own_rule_is_followed_and_none_found_is_refused(vlmexp_main, tmp_path,
                                                                                  monkeypatch):
    """No launch.ray.address: RAY_ADDRESS (refused when nothing answers there, or when it is the dashboard's
    http address, which `ray job submit` takes); without it, `auto` where this node is in a cluster; else
    refused naming both. A node in no cluster: Ray's temp folder (RAY_TMPDIR) holds no cluster address."""
    from vlmexp.checks.loader import load_config

    cfg = load_config(DEMO, ["launch.launcher=ray"])
    assert cfg.launch.ray is not None and cfg.launch.ray.address is None
    lone = {"RAY_TMPDIR": tmp_path / "no-cluster"}
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    rc, _, err = vlmexp_main("validate", DEMO, f"run.output_dir={tmp_path}", "launch.launcher=ray", **lone)
    assert rc == 2 and "launch.ray.address" in err, err
    assert "launch.ray.address is not set, RAY_ADDRESS is not set, and this node belongs to no cluster" in err
    assert "ray start --head --port=6379" in err, err
    address = f"127.0.0.1:{free_port()}"
    rc, _, err = vlmexp_main("validate", DEMO, f"run.output_dir={tmp_path}", "launch.launcher=ray",
                             RAY_ADDRESS=address, **lone)
    assert rc == 2 and f"no Ray cluster answers at {address}" in err, err
    rc, _, err = vlmexp_main("validate", DEMO, f"run.output_dir={tmp_path}", "launch.launcher=ray",
                             RAY_ADDRESS="http://127.0.0.1:8265", **lone)
    assert rc == 2 and "is the dashboard's address, which `ray job submit` takes" in err, err


@pytest.mark.parametrize(("overrides", "message"), [
    (["launch.ray={address: auto}"], "launch.ray is read by launcher ray only"),
    ([*on_ray("auto"), "launch.nproc_per_node=2"], "places launch.ray.num_workers workers itself"),
    ([*on_ray("auto", placement_strategy="ANYWHERE")], "STRICT_SPREAD"),
    ([*on_ray("auto", gpus_per_worker=-1)], "greater than or equal to 0"),
])
def test_ray_settings_that_cannot_work_are_refused(overrides, message):
    from vlmexp.checks.loader import load_config
    from vlmexp.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(DEMO, overrides)


@pytest.mark.slow
def test_a_deployment_run_sends_grpo_to_the_cluster(cluster, tmp_path, prefect_home, run_inputs):
    """`prefect deployment run 'vlm-pipeline/manual'` with GRPO on the stage deployment `vlm-stage/gpu`: the
    stage's flow run on the `gpu` pool submits GRPO to the cluster. Cancelled through Prefect's API (the UI's
    Cancel) once its Ray run started, the stage's flow run ends Cancelled and its Ray run leaves the cluster
    (no actor, no placement group of its job) within 30 s; the pipeline's retry sends GRPO again, its log has
    the workers' lines with their ranks and nodes, and the pipeline completes with GRPO's MLflow run tagged
    with the cluster's two nodes."""
    from mlflow.tracking import MlflowClient
    from prefect_server import create_pools_and_deploy, prefect_server
    from test_stage_deployments import _flow_runs

    out = tmp_path / "run"
    params = {"config": "configs/demo.yaml", "overrides": [
        *STEPS, f"run.output_dir={out}", *run_inputs(out), "sft.enabled=false", "grpo.args.max_steps=2",
        "pipeline.stage_deployments={grpo: vlm-stage/gpu}", "pipeline.retry_delay_seconds=1",
        *on_ray(cluster.client)]}
    with prefect_server(tmp_path, prefect_home) as server:
        create_pools_and_deploy(server)
        server.worker("gpu", query_seconds=3)
        watch = server.run_pipeline(params, tmp_path / "watch.log")
        server.worker("cpu", "--run-once")
        run_json = out / "ray" / "grpo" / "run.json"
        deadline = time.monotonic() + 900
        while not run_json.is_file():  # the stage's driver connected and is starting the Ray run
            assert watch.poll() is None and time.monotonic() < deadline, (tmp_path / "watch.log").read_text()
            time.sleep(0.5)
        job = json.loads(run_json.read_text())["job_id"]
        cancelled = _cancel_the_running_stage(server.url)
        start = time.monotonic()
        while _left_of(cluster, job) and time.monotonic() - start < 30:
            time.sleep(0.5)
        assert not _left_of(cluster, job), _left_of(cluster, job)
        assert watch.wait(1600) == 0, (tmp_path / "watch.log").read_text()[-3000:]
        runs, logs = _flow_runs(server.url)
    stages = {str(r.id): r for name, r, _ in runs if name == "vlm-stage"}
    assert stages.pop(cancelled).state.name == "Cancelled"
    [stage] = stages.values()
    log = logs[str(stage.id)]
    assert stage.work_pool_name == "gpu" and stage.state.name == "Completed"
    assert "-m vlmexp.ray_launch train grpo" in log and "[rank 1 node " in log, log[-3000:]
    assert not DISASSEMBLY.search(log), DISASSEMBLY.search(log).group(0)
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    run_id = (out / "grpo" / "mlflow_run_id").read_text().strip()
    tags = client.get_run(run_id).data.tags
    assert tags["ray.cluster"] == cluster.client and tags["ray.nodes"] == "2", tags
    assert [m.step for m in client.get_metric_history(run_id, "reward")] == [1, 2]
    assert (out / "grpo" / "final").is_dir()


def _cancel_the_running_stage(url: str) -> str:
    """Cancel the running vlm-stage flow run as Prefect's UI does (its state set to Cancelling: its worker
    then ends the run's processes); its id."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Cancelling

    with temporary_settings({PREFECT_API_URL: url}), get_client(sync_client=True) as client:
        flows = {f.id: f.name for f in client.read_flows()}
        [stage] = [r for r in client.read_flow_runs()
                   if flows[r.flow_id] == "vlm-stage" and r.state and r.state.is_running()]
        client.set_flow_run_state(stage.id, Cancelling(message="cancelled from the UI"))
    return str(stage.id)


def _left_of(cluster, job: str) -> list:
    """Job `job`'s actors that are not dead and placement groups not removed, read through Ray's state API."""
    from ray.util.state import list_actors, list_placement_groups

    actors = [a for a in list_actors(address=cluster.dashboard, filters=[("job_id", "=", job)])
              if a.state != "DEAD"]
    groups = [g for g in list_placement_groups(address=cluster.dashboard, detail=True)
              if g.creator_job_id == job and g.state != "REMOVED"]
    return actors + groups


def _place(node: str, gpus: list[str], port: int = 0) -> dict:
    return {"node_id": node, "host": node, "node_ip": f"10.0.0.{node[-1]}", "port": port, "gpu_ids": gpus}


def test_ranks_go_node_by_node_and_each_worker_trains_on_its_own_gpu():
    """The workers' torchrun environment from where Ray placed them (no cluster needed): ranks node by node
    and by GPU, rank 0's node and port as the rendezvous, every GPU of a node visible to its workers and each
    worker's own named for accelerate, also where two workers share a GPU."""
    from vlmexp.ray_launch import rank_environments

    places = [_place("n2", ["1"]), _place("n1", ["3"]), _place("n2", ["0"], port=29511), _place("n1", ["2"])]
    envs, ranks = rank_environments(places)
    assert ranks == [1, 3, 0, 2]  # node n2 first (the first bundle's), then by GPU within a node
    assert [envs[i]["LOCAL_RANK"] for i in range(4)] == ["1", "1", "0", "0"]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {("10.0.0.2", "29511")}
    assert [envs[i]["NODE_RANK"] for i in range(4)] == ["0", "1", "0", "1"]
    assert [envs[i]["CUDA_VISIBLE_DEVICES"] for i in range(4)] == ["0,1", "2,3", "0,1", "2,3"]
    assert [envs[i]["ACCELERATE_TORCH_DEVICE"] for i in range(4)] == ["cuda:1", "cuda:1", "cuda:0", "cuda:0"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"} and {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}

    shared = [_place("n1", ["0"]), _place("n1", ["0"]), _place("n1", ["1"]), _place("n1", ["1"])]
    envs, _ = rank_environments(shared)  # gpus_per_worker 0.5: two workers on each GPU
    assert {e["CUDA_VISIBLE_DEVICES"] for e in envs} == {"0,1"}
    assert [e["ACCELERATE_TORCH_DEVICE"] for e in envs] == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]

    envs, _ = rank_environments([_place("n1", []), _place("n2", [])])  # CPU workers
    assert not any("CUDA_VISIBLE_DEVICES" in e or "ACCELERATE_TORCH_DEVICE" in e for e in envs)
