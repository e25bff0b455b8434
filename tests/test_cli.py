"""The `vlmexp` command end to end: help is fast, tiny model and demo data commands, `run` on the demo."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def vlmexp(*args, cwd=REPO, env=None):
    return subprocess.run([sys.executable, "-m", "vlmexp.cli", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, env=env)


def test_help_does_not_import_heavy_libraries():
    code = ("import sys, vlmexp.cli; vlmexp.cli.build_parser(); "
            "print(sorted(m for m in ('torch', 'transformers', 'trl', 'prefect', 'mlflow') if m in "
            "sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    start = time.perf_counter()
    assert vlmexp("--help").returncode == 0
    assert time.perf_counter() - start < 10  # generous: the point is no 5 s torch import


def test_make_tiny_model_and_demo_data_commands(tmp_path):
    r = vlmexp("make-tiny-model", tmp_path / "m", "--family", "qwen3_vl")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "qwen3_vl"
    assert vlmexp("make-tiny-model", tmp_path / "m").returncode == 2  # refuses to overwrite
    r = vlmexp("make-demo-data", tmp_path / "d", "--train", 5, "--val", 3, "--seed", 1)
    assert r.returncode == 0, r.stderr
    rows = json.loads((tmp_path / "d" / "train.json").read_text())
    # the demo's loose annotator
    assert len(rows) == 5 and all(r["demonstration"] != r["solution"] for r in rows)
    assert len(list((tmp_path / "d" / "images").glob("*.png"))) == 8
    r = vlmexp("make-demo-data", tmp_path / "g", "--train", 2, "--val", 1, "--width", 112, 112, "--height",
               96, 96, "--objects", 1, 1, "--background", "gradient", "--annotator-loose", 0,
               "--annotator-jitter", 0)
    assert r.returncode == 0, r.stderr
    assert all("demonstration" not in r for r in json.loads((tmp_path / "g" / "train.json").read_text()))
    from PIL import Image

    assert Image.open(tmp_path / "g" / "images" / "train_00000.png").size == (112, 96)
    r = vlmexp("make-demo-data", tmp_path / "b", "--width", 300, 200)
    assert (r.returncode == 2 and "--width" in r.stderr and "[300, 200]" in r.stderr
            and not (tmp_path / "b").exists())
    r = vlmexp("make-demo-data", tmp_path / "c", "--annotator-loose", 2)
    assert (r.returncode == 2 and "--annotator-loose" in r.stderr and "loose 2.0" in r.stderr
            and not (tmp_path / "c").exists())


@pytest.mark.slow  # runs the command line in subprocesses
def test_the_temporary_server_waits_longer_than_prefects_20_s_unless_told():
    """A start of Prefect's temporary server with its database in place took 19-26 s on an idle 2-core machine
    that caches no bytecode: the pipeline waits START_TIMEOUT_S for it unless
    PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS says otherwise, and a start that creates the database at
    least FIRST_START_TIMEOUT_S."""
    import os

    code = "from flows.temporary_server import start_timeout as t; print(t(False), t(True))"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"}
    waits = {}
    for given in (None, "5", "300"):
        told = {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": given} if given else {}
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                           timeout=120, env={**env, **told})
        assert r.returncode == 0, r.stderr
        waits[given] = r.stdout.split()
    assert waits == {None: ["90.0", "180.0"], "5": ["5.0", "180.0"], "300": ["300.0", "300.0"]}


def test_first_run_on_a_new_machine_splits_a_val_fraction_builds_the_model_and_samples(tmp_path, demo_data):
    """The first `vlmexp run` on a new machine: Prefect's database does not exist yet and its start-up timeout
    is Prefect's default (20 s); the temporary server's first start runs Prefect's migrations, which take
    longer than that on a 2-core machine, and the run waits for them, saying why. PREFECT_HOME is under a
    folder that does not exist yet either (Prefect makes PREFECT_HOME only). The same run holds out a
    quarter of its data (data.val_fraction), builds the tiny model, and starts each stage with its resolved
    config."""
    import os

    out = tmp_path / "o"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run: {{output_dir: {out}, seed: 3}}\nmodel: {{path: tiny:qwen2_5_vl}}\n"
                   f"data:\n  data_yaml: {demo_data / 'train.yaml'}\n  val_fraction: 0.25\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL",
                                                            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")}
    # the split and the stages' start are what is tested: a step per stage, no evaluation (TRL's defaults
    # trained GRPO for 4 minutes here)
    r = vlmexp("run", cfg, "sft.args.max_steps=1", "grpo.args.max_steps=1",
               "grpo.args.max_completion_length=16", "eval.enabled=false", cwd=tmp_path,
               env={**env, "PREFECT_HOME": str(tmp_path / "new" / ".prefect")})
    assert r.returncode == 0, r.stderr
    database = tmp_path / "new" / ".prefect" / "prefect.db"
    assert f"Creating Prefect's database {database}" in r.stdout + r.stderr and database.stat().st_size > 0
    train = (out / "data/train.jsonl").read_text().splitlines()
    val = (out / "data/val.jsonl").read_text().splitlines()
    assert (len(train), len(val)) == (18, 6) and not set(train) & set(val)
    assert list((out / "models").glob("tiny-qwen2_5_vl-*/model.safetensors"))
    # the terminal: no progress bar of a model's save (the tiny model's build, each stage's checkpoint and
    # final model, the export), which --verbose shows (tests/test_train.py)
    assert "Writing model shards" not in r.stdout + r.stderr, r.stderr[-3000:]
    # each stage is started with the run's resolved config, which the pipeline checked when it wrote it
    resolved = out / "config.resolved.yaml"
    assert resolved.is_file()
    for stage in ("sft", "grpo"):
        assert f"train {stage} --config {resolved} --in-process --checked" in r.stdout + r.stderr
    manifest = json.loads((out / "data/train.manifest.json").read_text())
    assert manifest["rows"] == 18 and manifest["sources"][0]["record_format"] == "rec"
    assert json.loads((out / "data/val.manifest.json").read_text())["rows"] == 6


def test_run_bad_config_exits_2_before_writing(tmp_path, prefect_home):
    r = vlmexp("run", REPO / "configs/demo.yaml", f"run.output_dir={tmp_path / 'o'}", "grpo.args.beta=-x",
               cwd=tmp_path)
    assert r.returncode == 2 and "grpo.args.beta" in r.stderr
    assert "Traceback" not in r.stdout + r.stderr  # Prefect logs the failed task without its traceback
    assert not (tmp_path / "o").exists()


def test_prefect_setup_refuses_without_a_server_and_below_prefects_heartbeat(tmp_path):
    """Automations on a temporary server would vanish with it; a window under Prefect's 30 s heartbeat would
    crash healthy runs: both refused with exit 2 and the fix, before any server is asked."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    none = subprocess.run([sys.executable, "-m", "vlmexp.cli", "prefect-setup"], capture_output=True,
                          text=True, cwd=REPO, env={**env, "PREFECT_HOME": str(tmp_path)}, check=False)
    assert (none.returncode == 2 and "PREFECT_API_URL is not set" in none.stderr
            and "export PREFECT_API_URL=" in none.stderr)
    short = subprocess.run([sys.executable, "-m", "vlmexp.cli", "prefect-setup", "--heartbeat-seconds", "10"],
                           capture_output=True, text=True, cwd=REPO, check=False,
                           env={**env, "PREFECT_HOME": str(tmp_path),
                                "PREFECT_API_URL": "http://127.0.0.1:9/api"})
    assert (short.returncode == 2
            and "--heartbeat-seconds 10: Prefect sends flow-run heartbeats at most every 30 s"
            in short.stderr)


COUNT_TRL_CONFIGS = """
import json, sys, trl
from vlmexp.cli import main

built = {}
for cls in (trl.SFTConfig, trl.DPOConfig, trl.GRPOConfig):
    def counted(self, *args, _init=cls.__init__, _name=cls.__name__, **kwargs):
        built[_name] = built.get(_name, 0) + 1
        _init(self, *args, **kwargs)
    cls.__init__ = counted
for config, flags in json.loads(sys.argv[1]):
    built.clear()
    rc = main(["train", "sft", "--config", config, "--in-process", *flags])
    if rc:
        sys.exit(rc)
    print("built", json.dumps(built), flush=True)
"""


def _resolved_demo(out: Path) -> Path:
    """A run's resolved config (`<out>/config.resolved.yaml`) for one SFT step, written as the pipeline
    writes it."""
    from vlmexp.pipeline.keys import commit_resolved, resolve_config

    _, pending = resolve_config(str(REPO / "configs/demo.yaml"), [
        f"run.output_dir={out}", "data.demo.train=4", "data.demo.val=2", "tracking.backend=none",
        "sft.args.max_steps=1", "grpo.enabled=false", "eval.enabled=false", "eval.every_steps=0"])
    return commit_resolved(pending)


def _trl_configs_built(tmp_path: Path, *runs: tuple[Path, list[str]]) -> list[dict[str, int]]:
    """`vlmexp train sft --config CONFIG --in-process FLAGS` for each (CONFIG, FLAGS) of `runs`, one after
    the other in one fresh process: the TRL config classes each built."""
    r = subprocess.run([sys.executable, "-c", COUNT_TRL_CONFIGS, json.dumps([[str(c), f] for c, f in runs])],
                       capture_output=True, text=True, cwd=tmp_path, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line.removeprefix("built ")) for line in r.stdout.splitlines()
            if line.startswith("built {")]


@pytest.mark.slow  # two SFT steps in a subprocess
def test_a_stage_builds_its_trl_config_once_from_a_checked_resolved_config_and_all_of_them_without(
        tmp_path, capsys):
    """The pipeline starts every rank of a stage with the run's resolved config and --checked, since it
    checked the TRL args when it wrote it: the stage process builds its own TRL config once and no other (the
    first command of a fresh process, so nothing was built before it). The file's name proves nothing:
    without --checked a config.resolved.yaml is checked as any config is, every stage's TRL config class
    built at load, then the stage's own once more. A resolved config edited by hand is still refused before
    the model loads, naming the field and the fix."""
    checked, unchecked = _resolved_demo(tmp_path / "checked"), _resolved_demo(tmp_path / "unchecked")
    assert unchecked.name == "config.resolved.yaml"
    assert _trl_configs_built(tmp_path, (checked, ["--checked"]), (unchecked, [])) == [
        {"SFTConfig": 1}, {"SFTConfig": 2, "DPOConfig": 1, "GRPOConfig": 1}]
    assert (tmp_path / "checked" / "sft" / "final").is_dir()
    assert (tmp_path / "unchecked" / "sft" / "final").is_dir()

    edited = checked.read_text().replace("max_steps: 1", "max_steps: 1\n    learnin_rate: 0.001")
    assert edited != checked.read_text()
    checked.write_text(edited)
    from vlmexp.cli import main

    capsys.readouterr()
    assert main(["train", "sft", "--config", str(checked), "--in-process", "--checked"]) == 2
    stderr = capsys.readouterr().err
    assert "sft.args.learnin_rate = 0.001" in stderr and "did you mean 'learning_rate'?" in stderr
    assert "Traceback" not in stderr


def test_checked_with_overrides_is_refused_before_anything_is_read(tmp_path):
    """A checked config changed by overrides would train on args nobody checked: exit 2, saying why and the
    fix, with nothing written."""
    r = vlmexp("train", "sft", "--config", tmp_path / "config.resolved.yaml", "--checked",
               "sft.args.max_steps=1", cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    assert ("invalid arguments to vlmexp train sft" in r.stderr
            and "--checked = ['sft.args.max_steps=1']" in r.stderr
            and "overrides would change it unchecked: drop the overrides, or drop --checked" in r.stderr)
    assert "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []
