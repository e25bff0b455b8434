"""Library pieces the flow relies on: stage keys, stage folders, streaming subprocesses, trackers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vlmexp.checks.loader import load_config
from vlmexp.pipeline.keys import claim_stage_dir, read_key, stage_done, stage_key
from vlmexp.pipeline.processes import HELD_MEMORY, StageFailed, run_streaming, stage_env
from vlmexp.pipeline.steps import remote_result, write_result
from vlmexp.provenance import flatten
from vlmexp.results import StageResult
from vlmexp.tracking.tracker import NullTracker, make_tracker, sanitize_metric_name, ui_address

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs/demo.yaml"


def test_stage_keys_change_with_what_the_stage_depends_on_only():
    base = load_config(DEMO, [])
    key = stage_key(base, "sft", "data1")
    assert stage_key(load_config(DEMO, []), "sft", "data1") == key
    assert stage_key(base, "sft", "data2") != key  # new data
    for override in ("sft.args.learning_rate=0.5", "model.max_pixels=50000", "run.seed=1",
                     "data.demo.train=10"):
        assert stage_key(load_config(DEMO, [override]), "sft", "data1") != key, override
    for override in ("grpo.args.beta=0.1", "tracking.backend=none", "pipeline.retries=5",
                     "eval.batch_size=2"):
        assert stage_key(load_config(DEMO, [override]), "sft", "data1") == key, override
    assert stage_key(base, "grpo", "data1", upstream=key) != stage_key(base, "grpo", "data1",
                                                                       upstream="other")


def test_a_stage_deployment_run_fails_the_task_with_its_error_and_completes_with_its_result(tmp_path):
    crashed = "Process exited with status code: -9. Process exited due to a SIGKILL signal."
    with pytest.raises(StageFailed, match=r"vlm-stage/gpu \(flow run fr-1\) ended CRASHED: Process exited "
                                          r"with status code: -9"):
        remote_result("vlm-stage/gpu", "fr-1", "CRASHED", crashed, tmp_path, "key-a", StageResult)
    with pytest.raises(StageFailed,
                       match="completed but .*stage_result.json is not readable here .* must be shared"):
        remote_result("vlm-stage/gpu", "fr-2", "COMPLETED", None, tmp_path, "key-a", StageResult)
    other = StageResult(stage="grpo", final="x", key="key-b", run_id="r", seconds=1.5)
    write_result(tmp_path, other)
    with pytest.raises(StageFailed, match="belongs to stage key key-b"):
        remote_result("vlm-stage/gpu", "fr-3", "COMPLETED", None, tmp_path, "key-a", StageResult)
    mine = write_result(tmp_path, other.model_copy(update={"key": "key-a"}))
    assert remote_result("vlm-stage/gpu", "fr-4", "COMPLETED", None, tmp_path, "key-a", StageResult) == mine
    # a stage_result.json written before the results were typed (a plain dict of the same fields) still reads
    (tmp_path / "stage_result.json").write_text(json.dumps({"stage": "grpo", "final": "x", "key": "key-a",
                                                            "run_id": "r", "seconds": 1.5}))
    assert remote_result("vlm-stage/gpu", "fr-5", "COMPLETED", None, tmp_path, "key-a", StageResult) == mine


def test_a_stage_folder_of_other_inputs_is_archived_not_deleted(tmp_path):
    stage = tmp_path / "sft"
    claim_stage_dir(stage, "key-a")
    (stage / "checkpoint-5").mkdir()
    (stage / "final").mkdir()
    assert stage_done(stage, "key-a") and not stage_done(stage, "key-b")
    claim_stage_dir(stage, "key-a")  # same inputs: kept (a retry resumes from checkpoint-5)
    assert (stage / "checkpoint-5").is_dir()
    claim_stage_dir(stage, "key-b")
    [archived] = (tmp_path / "archive").iterdir()
    assert (archived / "checkpoint-5").is_dir() and read_key(archived) == "key-a"
    assert read_key(stage) == "key-b" and not (stage / "checkpoint-5").exists()


def test_a_failing_subprocess_reports_its_exit_code_and_last_lines():
    lines = []
    code = "import sys\nfor i in range(100): print('line', i)\nsys.exit(3)"
    with pytest.raises(StageFailed, match=r"exited with code 3; last lines:\nline 60\n(.|\n)*line 99$"):
        run_streaming([sys.executable, "-c", code], {"PATH": "/usr/bin"}, lines.append)
    assert len(lines) == 100  # every line streamed as it came


# a stage's process allocating, filling and freeing a 64 MiB buffer ten times: the pages the kernel faulted in
_REFILLS = """
import resource
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    buffer = b"x" * (64 << 20)
    del buffer
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_a_stage_keeps_freed_memory_for_its_next_step_unless_the_user_says_otherwise(monkeypatch):
    """A stage's environment holds glibc's freed memory in the process: a buffer freed and allocated again
    is not faulted in again (16,384 pages a fill otherwise, ten fills); a value the user set is kept."""
    pages = 64 << 20 >> 12
    for name in HELD_MEMORY:
        monkeypatch.delenv(name, raising=False)
    lines: list[str] = []
    run_streaming([sys.executable, "-c", _REFILLS], stage_env(), lines.append)
    assert int(lines[-1]) < 2 * pages, lines
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 << 10))  # the user's: glibc's default, fixed
    env = stage_env()
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(128 << 10) and env["MALLOC_TRIM_THRESHOLD_"] == str(1 << 30)
    run_streaming([sys.executable, "-c", _REFILLS], env, lines.append)
    assert int(lines[-1]) > 9 * pages, lines  # every fill a fresh mapping of the kernel's


def test_progress_bar_redraws_reach_the_log_at_a_readable_rate():
    # a real child process drawing a tqdm-style bar on stderr (each redraw starts with \r) between two lines
    code = ("import sys\nprint('start', flush=True)\n"
            "for i in range(201):\n"
            "    sys.stderr.write(f'\\r{i * 100 // 200:3d}%|bar| {i}/200'); sys.stderr.flush()\n"
            "sys.stderr.write('\\n'); sys.stderr.flush(); print('done', flush=True)")
    lines = []
    run_streaming([sys.executable, "-c", code], {"PATH": "/usr/bin"}, lines.append)
    bars = [line for line in lines if "|bar|" in line]
    assert lines[0] == "start" and lines[-1] == "done"
    # each tenth once (0 % .. 90 %), then the final draw: 11 lines for 201 redraws
    assert [int(b.split("%")[0]) for b in bars] == [0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100], bars
    every = []  # with no minimum interval every redraw is shown
    run_streaming([sys.executable, "-c", code], {"PATH": "/usr/bin"}, every.append, progress_every=0)
    assert len([line for line in every if "|bar|" in line]) == 201
    # a bar cut off by a crash: its last redraw still reaches the log and the failure's last lines
    crash = code.replace("range(201)", "range(151)").replace("sys.stderr.write('\\n')", "sys.exit(4)")
    shown = []
    with pytest.raises(StageFailed, match=r"code 4(.|\n)*150/200$"):
        run_streaming([sys.executable, "-c", crash], {"PATH": "/usr/bin"}, shown.append)
    assert shown[-1].endswith("150/200")


def test_params_are_flattened_and_metric_names_sanitised():
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": None}, "config.") == {
        "config.a.b": "1", "config.a.c": "[1, 2]", "config.d": "None"}
    assert sanitize_metric_name("rewards/m:f(x)@5/mean") == "rewards/m:f_x__5/mean"


def test_tracking_off_is_a_null_tracker_and_an_unusable_store_fails_with_the_fix(tmp_path):
    assert isinstance(make_tracker(load_config(DEMO, ["tracking.backend=none"])), NullTracker)
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("x")
    cfg = load_config(DEMO, [f"run.output_dir={tmp_path}/out", f"tracking.tracking_uri=sqlite:///{blocked}/db.sqlite"])
    with pytest.raises(ConnectionError, match="cannot be used.*tracking.backend: none"):
        make_tracker(cfg)


def test_secret_named_params_never_reach_mlflow(tmp_path, mlflow_store):
    cfg = load_config(DEMO, [f"run.output_dir={mlflow_store(tmp_path)}"])
    tracker = make_tracker(cfg)
    run = tracker.start_pipeline("p", {"config.model.path": "x", "env.HF_TOKEN": "hf_planted",
                                       "config.api_key": "k"}, {})
    params = tracker.client.get_run(run).data.params
    assert params == {"config.model.path": "x"}


@pytest.mark.slow
def test_eval_command_prints_the_metrics(tmp_path, tiny_models):
    r = subprocess.run([sys.executable, "-m", "vlmexp.cli", "eval", str(tiny_models["qwen2_5_vl"]),
                        "--config", str(DEMO), f"run.output_dir={tmp_path}", "data.demo.train=8",
                        "data.demo.val=5", "eval.max_new_tokens=4"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    metrics = json.loads(r.stdout[r.stdout.index("{"):])
    assert metrics["count"] == 5 and set(metrics) == {"count", "format_rate", "rec_mean_iou", "rec_acc50",
                                                      "rec_acc75"}
    assert (tmp_path / "eval" / "qwen2_5_vl" / "samples.jsonl").read_text().count("\n") == 5
    # the records drawn with the ground truth (green, on its box's edges) and this model's boxes, and
    # their grid
    from PIL import Image

    from vlmexp.data.record import read_sampled
    from vlmexp.pictures import COLOURS, MAX_SIDE, PANEL

    pictures = tmp_path / "eval" / "qwen2_5_vl" / "pictures"
    assert sorted(p.name for p in pictures.iterdir()) == ["grid.png",
                                                          *(f"record_{i:03d}.png" for i in range(5))]
    record = read_sampled(tmp_path / "data" / "val.jsonl")[0]
    picture = Image.open(pictures / "record_000.png").convert("RGB")
    scale = (MAX_SIDE - PANEL) / max(record.image_sizes[0])
    x1, y1, _, y2 = (v * scale for v in record.solution)
    assert (max(picture.size) <= MAX_SIDE
            and picture.getpixel((int(x1) + 1, int((y1 + y2) / 2))) == COLOURS["truth"][1])


def test_the_experiment_opens_as_model_training_in_the_mlflow_ui(tmp_path):
    """The UI reads the experiment tag mlflow.experimentKind; without it the pipeline's experiment opens in
    the GenAI view. New experiments get "finetuning"; an untagged older one is tagged; a kind set by hand
    stays."""
    from mlflow.tracking import MlflowClient

    tracker = make_tracker(load_config(DEMO, [f"run.output_dir={tmp_path}"]))
    client = MlflowClient(tracker.uri)
    assert client.get_experiment(tracker.experiment_id).tags["mlflow.experimentKind"] == "finetuning"
    # MLflow 3.17's UI picks its view from a switch in the browser, which this query sets: `vlmexp ui`
    # prints it
    assert ui_address("127.0.0.1", 5000, tracker.uri, "demo") == (f"http://127.0.0.1:5000/#/experiments/"
                                                                  f"{tracker.experiment_id}?workflowType=machine_learning")
    assert ui_address("h", 1, tracker.uri, "absent") == "http://h:1/#/experiments?workflowType=machine_learning"
    older = client.create_experiment("older", artifact_location=(tmp_path / "older").as_uri())
    assert "mlflow.experimentKind" not in client.get_experiment(older).tags
    again = [f"run.output_dir={tmp_path}", "tracking.experiment_name=older"]
    assert make_tracker(load_config(DEMO, again)).experiment_id == older
    assert client.get_experiment(older).tags["mlflow.experimentKind"] == "finetuning"
    client.set_experiment_tag(older, "mlflow.experimentKind", "custom_model_development")
    make_tracker(load_config(DEMO, again))
    assert client.get_experiment(older).tags["mlflow.experimentKind"] == "custom_model_development"
