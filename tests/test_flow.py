"""The vlm-pipeline flow end to end on the tiny model, against a Prefect server of its own, read back from
MLflow."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from conftest import SMALL_BATCHES

REPO = Path(__file__).resolve().parents[1]
DEMO = str(REPO / "configs/demo.yaml")
pytestmark = pytest.mark.slow

SMALL = ["data.demo.train=32", "data.demo.val=8", "sft.args.max_steps=4", "sft.args.save_steps=4",
         "sft.args.logging_steps=1", "grpo.args.max_steps=3", "grpo.args.save_steps=1",
         "grpo.args.logging_steps=1", "grpo.args.per_device_train_batch_size=4",
         "grpo.args.num_generations=4", "grpo.args.max_completion_length=12", "grpo.args.temperature=1.5",
         "tracking.completions_every=2", "pipeline.retry_delay_seconds=0", "eval.max_new_tokens=12",
         "tracking.system_metrics_seconds=0.5", *SMALL_BATCHES]


@pytest.fixture(scope="module")
def prefect(tmp_path_factory, prefect_database):
    from conftest import prefect_api
    from prefect.settings import (
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        PREFECT_LOCAL_STORAGE_PATH,
        temporary_settings,
    )

    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    sys.path.insert(0, str(REPO / "tests"))
    storage = tmp_path_factory.mktemp("prefect-results")
    with prefect_api(prefect_database), temporary_settings(
            {PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None, PREFECT_LOCAL_STORAGE_PATH: storage}):
        yield


def _run(config, overrides, force=False):
    from flows.pipeline import vlm_pipeline

    state = vlm_pipeline(config=config, overrides=overrides, force=force, return_state=True)
    assert state.is_completed(), state
    return state.result()


def _task_states(flow_run_id):
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter

    async def read():
        async with get_client() as client:
            runs = await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                task_run_filter=TaskRunFilter())
            return [(r.name.rsplit("-", 1)[0], r.state.name) for r in runs]

    return asyncio.run(read())


def _mlflow(out: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    exp = client.get_experiment_by_name("demo")
    return client, exp, {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}


def _artifacts(client, run_id, path=None):
    out = []
    for a in client.list_artifacts(run_id, path):
        out += _artifacts(client, run_id, a.path) if a.is_dir else [a.path]
    return out


ENV_SECRET, CONFIG_SECRET = "planted-env-secret-4711", "planted-config-secret-0815"


def test_pipeline_runs_every_stage_tracks_it_in_mlflow_and_skips_it_when_nothing_changed(prefect, tmp_path,
                                                                                         monkeypatch):
    out = tmp_path / "run"
    rewards = ("grpo.rewards=[{name: format, weight: 0.5}, {name: iou}, "
               "{name: 'rewards_for_tests:char_variety'}]")
    monkeypatch.setenv("VLMEXP_TEST_API_TOKEN", ENV_SECRET)  # secrets in the environment and in the config
    secret = f"sft.args.hub_token={CONFIG_SECRET}"
    rotate = "grpo.args.save_total_limit=2"  # checkpoints 1-3 saved, checkpoint-1 rotated away at step 3
    result = _run(DEMO, [f"run.output_dir={out}", *SMALL, rewards, secret, rotate])

    client, exp, runs = _mlflow(out)
    assert exp.artifact_location == (out / "mlartifacts").as_uri()
    parent = runs["demo-pipeline"]
    assert set(runs) == {"demo-pipeline", "demo-sft", "demo-grpo", "eval"}
    for name in ("demo-sft", "demo-grpo", "eval"):
        assert runs[name].data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert runs[name].info.status == "FINISHED"
    # the parent: flattened config params (prefixed), provenance tags, config + manifests + comparison +
    # summary
    assert parent.data.params["config.grpo.args.max_steps"] == "3"
    assert parent.data.params["config.model.path"] == "tiny:qwen2_5_vl"
    tags = parent.data.tags
    from vlmexp.provenance import command_name

    assert tags["git_commit"] and tags["version.trl"] and tags["prefect.flow_run_id"]
    for run in runs.values():  # the runs table's Source column: the command and the code's commit, every run
        source = run.data.tags
        assert (source["mlflow.source.type"] == "LOCAL"
                and source["mlflow.source.name"] == command_name()), source
        assert source["mlflow.source.git.commit"] == tags["git_commit"].removesuffix("-dirty")
        assert source["git_dirty"] == str(tags["git_commit"].endswith("-dirty")).lower()
    assert len(tags["data.content_sha256"]) == 64 and tags["stage.grpo"] == "trained"
    # the Dataset column: the sampled data as dataset inputs, the same digest (the content's) in every run
    content = {split: json.loads((out / "data" / f"{split}.manifest.json").read_text())["content_sha256"][:16]
               for split in ("train", "val")}

    def inputs(run):
        return {(d.dataset.name, d.dataset.digest,
                 next(t.value for t in d.tags if t.key == "mlflow.data.context"))
                for d in client.get_run(run.info.run_id).inputs.dataset_inputs}

    assert inputs(parent) == {("train", content["train"], "training"), ("val", content["val"], "evaluation")}
    assert inputs(runs["demo-sft"]) == inputs(runs["demo-grpo"]) == {("train", content["train"], "training")}
    assert {"config.resolved.yaml", "data/train.manifest.json", "evaluation/comparison.json",
            "summary.md", "export/manifest.json"} <= set(_artifacts(client, parent.info.run_id))
    # the GRPO child: TRL's step metrics, one point per logged step, completion tables, the curve plot
    grpo = runs["demo-grpo"].info.run_id
    for key in ("loss", "rewards/format/mean", "rewards/iou/mean",
                "rewards/rewards_for_tests:char_variety/std", "frac_reward_zero_std",
                "completions/mean_length", "clip_ratio/region_mean", "rewards/iou/unparsable/no_answer"):
        assert [m.step for m in client.get_metric_history(grpo, key)] == [1, 2, 3], key
    grpo_files = set(_artifacts(client, grpo))
    assert {"completions/step_000002.json", "plots/curves.png"} <= grpo_files
    table = json.loads(Path(client.download_artifacts(grpo, "completions/step_000002.json",
                                                      str(tmp_path))).read_text())
    assert {"completion", "prompt", "reward/iou",
            "reward/rewards_for_tests:char_variety"} <= set(table["columns"])
    assert [m.step for m in client.get_metric_history(runs["demo-sft"].info.run_id, "loss")] == [1, 2, 3, 4]
    # the System metrics tab: MLflow's monitor sampled each stage process into the run it joined (no GPU here)
    for stage in ("demo-sft", "demo-grpo"):
        system = {k for k in runs[stage].data.metrics if k.startswith("system/")}
        assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes",
                "system/system_memory_usage_percentage"} <= system, (stage, system)
        assert client.get_metric_history(runs[stage].info.run_id, "system/cpu_utilization_percentage")
    # evaluation: per-model metrics and tables
    ev = runs["eval"]
    assert {"base/rec_mean_iou", "sft/rec_mean_iou", "grpo/format_rate", "grpo/count"} <= set(ev.data.metrics)
    assert {"evaluation/base_samples.json",
            "evaluation/grpo_samples.json"} <= set(_artifacts(client, ev.info.run_id))
    assert [row["model"] for row in result.evaluation] == ["base", "sft", "grpo"]
    assert (out / "export" / "model.safetensors").is_file()
    manifest = json.loads((out / "export" / "manifest.json").read_text())
    assert manifest["mlflow_parent_run_id"] == parent.info.run_id and len(manifest["config_sha256"]) == 64
    assert (manifest["data_content_sha256"] == tags["data.content_sha256"]
            and manifest["evaluation"][2]["model"] == "grpo")
    # registry: the first export becomes the champion, with its metric on the version
    assert result.promotion.promoted and result.promotion.version == "1"
    assert "promoted to `champion`" in result.summary and tags["export.promoted"] == "true"
    champion = client.get_model_version_by_alias("vlmexp-demo", "champion")
    assert float(champion.tags["metric.rec_mean_iou"]) == ev.data.metrics["grpo/rec_mean_iou"]
    assert manifest["registration"]["mode"] == "copy"  # a tiny model: under export.copy_max_gib
    _assert_logged_models(client, exp, runs, champion, ev, content["val"])
    _assert_headline_charts(client, runs, ev)

    _assert_no_secret_in_mlflow(client, exp, tmp_path / "scan")
    assert "<redacted>" in (out / "export" / "vlmexp_config.yaml").read_text()

    states = _task_states(tags["prefect.flow_run_id"])
    assert all(state == "Completed" for _, state in states), states
    assert {name for name, _ in states} >= {"validate-config", "sample-data", "train-stage", "evaluate",
                                            "export"}

    again = _run(DEMO, [f"run.output_dir={out}", *SMALL, rewards, secret, rotate])
    assert "skipped: inputs unchanged" in again.summary
    rerun = _latest_parent(out)  # the rerun is its own pipeline run in MLflow, with the skip recorded
    assert rerun.info.run_id != parent.info.run_id and rerun.data.tags["stage.grpo"] == "skipped"
    states = _task_states(rerun.data.tags["prefect.flow_run_id"])
    assert [s for name, s in states if name == "train-stage"] == ["Cached", "Cached"], states
    # the cached export is not registered again
    assert len(client.search_model_versions("name='vlmexp-demo'")) == 1


def _assert_logged_models(client, exp, runs, champion, ev, val_digest):
    """The Models tab: every checkpoint and final model of each stage and the export, linked to the run and
    step that made them; evaluated models carry their evaluation; the registered version is the export's
    model, whose files MLflow holds (copied: a tiny model), while checkpoints are referenced by path only."""
    models = {m.name: m for m in client.search_logged_models([exp.experiment_id])}
    # grpo's checkpoint-1 was rotated away (save_total_limit 2): its Models entry went with its folder
    assert set(models) == {"sft-checkpoint-4", "sft-final", "grpo-checkpoint-2", "grpo-checkpoint-3",
                           "grpo-final", "run-export"}, set(models)
    assert not (Path(models["grpo-checkpoint-2"].tags["vlmexp.path"]).parent / "checkpoint-1").exists()
    sft, grpo, parent = (runs[n].info.run_id for n in ("demo-sft", "demo-grpo", "demo-pipeline"))
    outputs = {run: {(o.model_id, o.step) for o in client.get_run(run).outputs.model_outputs}
               for run in (sft, grpo)}
    kept = ({(models[f"grpo-checkpoint-{i}"].model_id, i) for i in (2, 3)}
            | {(models["grpo-final"].model_id, 3)})
    # the run's history stays
    assert kept <= outputs[grpo] and [step for _, step in outputs[grpo] - kept] == [1]
    assert outputs[sft] == {(models["sft-checkpoint-4"].model_id, 4), (models["sft-final"].model_id, 4)}
    checkpoint = models["grpo-checkpoint-2"]
    assert checkpoint.source_run_id == grpo and checkpoint.tags["mlflow.model.isExternal"] == "true"
    assert Path(checkpoint.tags["vlmexp.path"], "model.safetensors").is_file()
    # no weights
    assert [a.path for a in client.list_logged_model_artifacts(checkpoint.model_id)] == ["MLmodel"]
    at_step = {m.key: m.value for m in checkpoint.metrics if m.step == 2}  # the run's step-2 values
    assert [at_step["loss"]] == [m.value for m in client.get_metric_history(grpo, "loss") if m.step == 2]
    # evaluated: its metrics, on the val data
    for name, stage in (("sft-final", "sft"), ("grpo-final", "grpo")):
        evaluated = {m.key: (m.value, m.dataset_digest) for m in models[name].metrics
                     if m.key.startswith("eval/")}
        assert evaluated["eval/rec_mean_iou"] == (ev.data.metrics[f"{stage}/rec_mean_iou"], val_digest), name
    assert {i.model_id for i in client.get_run(ev.info.run_id).inputs.model_inputs} == {
        models["sft-final"].model_id, models["grpo-final"].model_id}
    export = models["run-export"]
    assert (export.source_run_id == parent
            and export.tags["vlmexp.exported_from"] == models["grpo-final"].model_id)
    # the registered version is that model: its source, its id, and the model lists the version
    assert champion.source == f"models:/{export.model_id}" and champion.tags["model_id"] == export.model_id
    assert champion.tags["registration"] == "copy" == export.tags["vlmexp.registration"]
    assert json.loads(export.tags["mlflow.modelVersions"]) == [{"name": "vlmexp-demo", "version": "1"}]
    assert "model.safetensors" in {a.path for a in client.list_logged_model_artifacts(export.model_id)}
    assert ({m.key: m.value for m in export.metrics}["eval/rec_mean_iou"]
            == ev.data.metrics["grpo/rec_mean_iou"])
    # the weights are not copied twice
    assert not [a for a in _artifacts(client, parent) if a.startswith("model/")]


def _assert_headline_charts(client, runs, ev):
    """The first section of a run page's charts (MLflow's UI sorts sections by name, upper case first, and
    puts keys without a section last): "Summary", holding the reward and the main evaluation metric."""
    grpo, sft, parent = (runs[n].info.run_id for n in ("demo-grpo", "demo-sft", "demo-pipeline"))

    def history(run, key):
        return [(m.step, m.value) for m in client.get_metric_history(run, key)]

    assert history(grpo, "Summary/reward") == history(grpo, "reward") and len(history(grpo, "reward")) == 3
    assert history(grpo, "Summary/rec_mean_iou") == [(3, ev.data.metrics["grpo/rec_mean_iou"])]
    assert history(sft, "Summary/rec_mean_iou") == [(4, ev.data.metrics["sft/rec_mean_iou"])]
    headline = {k: v for k, v in client.get_run(parent).data.metrics.items() if k.startswith("Summary/")}
    assert headline == {"Summary/rec_mean_iou": ev.data.metrics["grpo/rec_mean_iou"],
                        "Summary/reward": history(grpo, "reward")[-1][1]}
    for run in (grpo, parent):
        sections = sorted({k.rsplit("/", 1)[0] for k in client.get_run(run).data.metrics
                           if "/" in k and not k.startswith("system/")})
        assert sections[0] == "Summary", sections


def _assert_no_secret_in_mlflow(client, exp, scan: Path):
    """Neither planted secret is in any run's params, tags or metrics names, nor in any artifact's bytes."""
    for run in client.search_runs([exp.experiment_id]):
        texts = [*run.data.params.items(), *run.data.tags.items(), *run.data.metrics]
        assert not [t for t in map(str, texts) if ENV_SECRET in t or CONFIG_SECRET in t], run.info.run_name
        local = Path(client.download_artifacts(run.info.run_id, "", str(scan / run.info.run_id)))
        _assert_no_secret_in(local)
    import mlflow

    for model in client.search_logged_models([exp.experiment_id]):  # the export's files live in its model
        _assert_no_secret_in(Path(mlflow.artifacts.download_artifacts(artifact_uri=model.artifact_location,
                                                                      dst_path=str(scan / model.model_id))))


def _assert_no_secret_in(folder: Path):
    for f in (p for p in folder.rglob("*") if p.is_file()):
        data = f.read_bytes()
        assert ENV_SECRET.encode() not in data and CONFIG_SECRET.encode() not in data, f


def _latest_parent(out):
    client, exp, _ = _mlflow(out)
    [run] = client.search_runs([exp.experiment_id], "tags.mlflow.runName = 'demo-pipeline'",
                               order_by=["attributes.start_time DESC"], max_results=1)
    return run


def test_a_failing_stage_is_retried_and_resumes_from_its_checkpoint(prefect, tmp_path, monkeypatch,
                                                                   run_inputs):
    out = tmp_path / "run"
    marker = tmp_path / "failed-once"
    monkeypatch.setenv("VLMEXP_TEST_FAIL_MARKER", str(marker))
    result = _run(DEMO, [f"run.output_dir={out}", *SMALL, *run_inputs(out), "sft.enabled=false",
                         "eval.enabled=false",
                         "export.enabled=false", "tracking.backend=none", "pipeline.retries=1",
                         ("grpo.rewards=[{name: 'rewards_for_tests:fail_once'}, "
                          "{name: 'rewards_for_tests:char_variety'}]")])
    assert marker.is_file()  # the first attempt failed at its second step...
    first_checkpoint = out / "grpo" / "checkpoint-1" / "trainer_state.json"
    assert first_checkpoint.stat().st_mtime <= marker.stat().st_mtime  # kept, not redone: the retry resumed
    state = json.loads((out / "grpo" / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3  # ...and the retry finished the stage
    assert result.model == str(out / "grpo" / "final")
    logged = [h["step"] for h in state["log_history"] if "loss" in h]
    assert logged == [1, 2, 3]  # step 1 restored from checkpoint-1, steps 2-3 trained by the retry


def test_bad_data_into_an_existing_run_touches_none_of_its_files(prefect, tmp_path):
    """A finished run's folder, then a run with a malformed data line into it: the flow fails at sampling,
    naming file:line, and every file of the earlier run is byte for byte as it was."""
    import hashlib

    out = tmp_path / "run"
    _run(DEMO, [f"run.output_dir={out}", *SMALL, "sft.enabled=false", "grpo.enabled=false",
                "eval.enabled=false", "tracking.backend=none"])
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.rglob("*") if p.is_file()}
    assert out / "config.resolved.yaml" in before and out / "data" / "train.jsonl" in before

    [demo_json] = (out).glob("demo_data-*/train.json")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"image": str(demo_json.parent / "images" / "train_00000.png"), "problem": "p",
                               "solution": [1, 1, 9, 9]}) + "\n{not json\n")
    from flows.pipeline import vlm_pipeline

    state = vlm_pipeline(config=DEMO, overrides=[f"run.output_dir={out}", *SMALL, "data.demo=null",
                                                 f"data.datasets=[{{json_path: {bad}}}]",
                                                 "tracking.backend=none"],
                         return_state=True)
    assert state.is_failed()
    assert f"{bad}:2" in str(state.message) or f"{bad}:2" in repr(state.result(raise_on_failure=False))
    after = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.rglob("*") if p.is_file()}
    assert {p: h for p, h in after.items() if p in before} == before  # nothing of the earlier run changed
    assert {p.name for p in after.keys() - before.keys()} <= {".config.pending.yaml"}  # nothing half-written
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:  # bad input is not retried: the same data fails the same way
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    [sampling] = [r for r in runs if r.name.startswith("sample-data")]
    assert sampling.run_count == 1 and sampling.state.is_failed()


def test_a_pipeline_run_on_a_folder_another_run_holds_fails_at_once_naming_it(prefect, tmp_path):
    """The flow a deployment run, the scheduled retrain or `vlmexp run` runs, while `vlmexp train` by hand (a
    process of its own) holds the output folder: Failed before any task, the holder named; nothing written;
    the holder's file untouched."""
    from test_hold import _holder

    from flows.pipeline import vlm_pipeline
    from vlmexp.pipeline.hold import HOLD_NAME, read_holder

    out = tmp_path / "run"
    holder = _holder(out, "run-manual", 120)
    try:
        state = vlm_pipeline(config=DEMO, overrides=[f"run.output_dir={out}", "tracking.backend=none"],
                             return_state=True)
        message = str(state.message)
        assert state.is_failed() and f"held by test holder run-manual (process {holder.pid} on " in message
        assert sorted(p.name for p in out.iterdir()) == [HOLD_NAME]  # nothing written, the hold not taken
        assert read_holder(out).run_id == "run-manual"
    finally:
        holder.kill()
        holder.wait()
