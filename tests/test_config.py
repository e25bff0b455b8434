"""Config loading: every shipped config, overrides, and every bad input answered with where/value/fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vlmexp.checks.loader import dump_config, load_config
from vlmexp.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"demo.yaml", "qwen2_5_vl_3b_rec.yaml", "geometry3k_math.yaml", "demo_internvl.yaml",
            "internvl3_2b_rec.yaml", "demo_qwen3_5.yaml", "qwen3_5_4b_rec.yaml", "qwen3_5_4b_zoom.yaml",
            "qwen3_5_35b_a3b_gspo.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates_and_names_its_command(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("#"), f"{path.name} must open with a comment giving its command"
    head = "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))
    assert f"vlmexp run configs/{path.name}" in head
    cfg = load_config(path, check_paths=path.name == "demo.yaml")
    assert cfg.run.output_dir


def _write(tmp_path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


BASE = "model:\n  path: tiny:qwen2_5_vl\ndata:\n  demo: {train: 4, val: 2}\n"


def _problems(path, overrides=()) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(path, list(overrides))
    return [str(p) for p in e.value.problems]


def test_minimal_config_defaults(tmp_path):
    cfg = load_config(_write(tmp_path, BASE))
    assert cfg.run.output_dir == "outputs/vlmexp"
    assert cfg.model.family == "qwen2_5_vl" and cfg.model.trust_remote_code is False
    assert [r.name for r in cfg.grpo.rewards] == ["format", "iou"]


def test_overrides_apply_with_types(tmp_path):
    cfg = load_config(_write(tmp_path, BASE), ["grpo.args.learning_rate=1e-6", "run.seed=7",
                                               "sft.enabled=false", "data.demo.train=9"])
    assert cfg.grpo.args["learning_rate"] == "1e-6"  # raw; TRL pass-through converts it (below)
    assert cfg.run.seed == 7 and cfg.sft.enabled is False and cfg.data.demo.train == 9
    from vlmexp.config.trl_args import coerce_trl_args

    converted, problems = coerce_trl_args("grpo", cfg.grpo.args)
    assert problems == [] and converted["learning_rate"] == pytest.approx(1e-6)


def test_unknown_key_names_line_and_suggests(tmp_path):
    p = _write(tmp_path, BASE + "run:\n  nmae: x\n")
    [msg] = _problems(p)
    assert f"{p}:6" in msg and "run.nmae" in msg and "did you mean 'name'" in msg


def test_all_errors_reported_at_once(tmp_path):
    p = _write(tmp_path, BASE + "run:\n  seed: abc\neval:\n  batch_size: 0\nlaunch:\n  launcher: mpi\n")
    msgs = _problems(p)
    assert len(msgs) == 3
    joined = "\n".join(msgs)
    assert "run.seed = 'abc'" in joined and f"{p}:6" in joined
    assert "eval.batch_size = 0" in joined and "greater than 0" in joined
    assert "launch.launcher = 'mpi'" in joined and "'local'" in joined


def test_yaml_syntax_error_shows_line(tmp_path):
    p = _write(tmp_path, BASE + "run:\n  name: [unclosed\n  seed: 1\n")
    [msg] = _problems(p)
    assert "YAML syntax error" in msg and f"{p}:" in msg


def test_missing_file_and_missing_section(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.yaml")
    msgs = _problems(_write(tmp_path, "model:\n  path: tiny:qwen2_5_vl\n"))
    assert any("data" in m and "required" in m for m in msgs)


def test_override_errors_name_the_override(tmp_path):
    msgs = _problems(_write(tmp_path, BASE), ["run.sede=3", "novalue", "run.seed.x=1"])
    joined = "\n".join(msgs)
    assert "override 'run.sede=3'" in joined and "did you mean 'seed'" in joined
    assert "override 'novalue'" in joined and "section.key=value" in joined
    assert "override 'run.seed.x=1'" in joined


def test_trl_args_checked_by_building_trl_configs(tmp_path):
    p = _write(tmp_path, BASE + "grpo:\n  args:\n    learning_rat: 1.0e-6\n    max_steps: many\n"
                                "    output_dir: /tmp/x\n")
    joined = "\n".join(_problems(p))
    assert "grpo.args.learning_rat" in joined and "did you mean 'learning_rate'" in joined
    assert "grpo.args.max_steps = 'many'" in joined and "valid integer" in joined
    assert "grpo.args.output_dir" in joined and "run.output_dir" in joined
    p = _write(tmp_path, BASE + "grpo:\n  args:\n    save_strategy: no\n")  # YAML 1.1: no is False
    [msg] = _problems(p)
    assert "grpo.args.save_strategy = False" in msg and 'quote it, e.g. save_strategy: "no"' in msg
    p = _write(tmp_path, BASE + "grpo:\n  sft_adapter: yes\n")  # the typed config tree says the same
    [msg] = _problems(p)
    assert "grpo.sft_adapter = True" in msg and 'quote it, e.g. sft_adapter: "yes"' in msg
    p = _write(tmp_path, BASE + "grpo:\n  args:\n    num_generations: 3\n"
                                "    per_device_train_batch_size: 4\n")
    [msg] = _problems(p)
    assert "divisible by num_generations" in msg and f"{p}:6" in msg


@pytest.mark.parametrize("body, needle", [
    ("model:\n  path: tiny:llama\ndata:\n  demo: {}\n", "unknown tiny family"),
    ("model:\n  path: tiny:qwen2_5_vl\n  min_pixels: 9000\n  max_pixels: 100\ndata:\n  demo: {}\n",
     "swap them"),
    ("model:\n  path: tiny:qwen2_5_vl\ndata:\n  demo: {}\n  data_yaml: x.yaml\n", "exactly one of"),
    ("model:\n  path: tiny:qwen2_5_vl\ndata:\n  demo: {}\n  prompt_templates: {rec: 'find {thing}'}\n",
     "only {problem} and {frame}"),
    ("model:\n  path: tiny:qwen2_5_vl\ndata:\n  demo: {}\n  datasets: null\n  val_fraction: 1.5\n",
     "less than 1"),
    (BASE + "launch:\n  launcher: torchrun\n  nnodes: 2\n", "rdzv_endpoint"),
    (BASE + "run:\n  name: 'bad name!'\n", "letters, digits"),
    (BASE + "pipeline:\n  stage_deployments: {gpro: vlm-stage/gpu}\n",
     "unknown stage 'gpro'; stages that can run"),
    (BASE + "pipeline:\n  stage_deployments: {grpo: gpu}\n", "write 'flow/deployment'"),
    (BASE + "grpo:\n  rewards: [{name: accuracy}]\n", "unknown reward 'accuracy'"),
    ("model:\n  path: tiny:qwen2_5_vl\ndata:\n  datasets:\n    - {json_path: a.json, sampling_strategy: "
     "'middle:3'}\n", "unknown sampling strategy"),
])
def test_semantic_errors_say_the_fix(tmp_path, body, needle):
    p = _write(tmp_path, body)
    joined = "\n".join(_problems(p))
    assert needle in joined


def test_schema_imports_pydantic_and_the_family_table_only():
    code = ("import sys, vlmexp.config.schema\n"
            "print(sorted(m for m in sys.modules if m.startswith('vlmexp') or m.split('.')[0] in "
            "('yaml', 'PIL', 'numpy', 'torch', 'trl', 'datasets')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    modules = eval(out.stdout)  # the family table is the families package: its modules import nothing heavy
    schema = ["vlmexp", "vlmexp.config", "vlmexp.config.base", "vlmexp.config.generated_data",
              "vlmexp.config.schema", "vlmexp.config.stages", "vlmexp.config.tiny_model", "vlmexp.families"]
    assert modules[:8] == schema, modules
    assert modules[8:] and all(m.startswith("vlmexp.families.") for m in modules[8:]), modules


def test_validation_runs_user_code_only_behind_the_switch(tmp_path, monkeypatch, capsys):
    """Config.model_validate and a plain load_config name-check a module:function reward without importing
    it; load_config(import_rewards=True) and `vlmexp validate` import it in a child process."""
    from vlmexp.cli import main
    from vlmexp.config.schema import Config

    marker = tmp_path / "imported.txt"
    (tmp_path / "marking_reward.py").write_text(f"open({str(marker)!r}, 'a').write('x')\n"
                                                "def score(prompts, completions, **kw):\n"
                                                "    return [0.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    p = _write(tmp_path, BASE + "grpo:\n  rewards: [{name: 'marking_reward:score'}]\n")
    Config.model_validate({"model": {"path": "tiny:qwen2_5_vl"}, "data": {"demo": {}},
                           "grpo": {"rewards": [{"name": "marking_reward:score"}]}})
    assert load_config(p).grpo.rewards[0].name == "marking_reward:score"
    assert not marker.exists(), "validation without the switch must not import the reward's module"
    load_config(p, import_rewards=True)
    assert marker.read_text() == "x" and "marking_reward" not in sys.modules  # imported once, in a child
    assert main(["validate", "--no-check-paths", str(p)]) == 0 and marker.read_text() == "xx"
    capsys.readouterr()
    missing = _write(tmp_path, BASE + "grpo:\n  rewards: [{name: format}, {name: 'nosuchmod:fn'}]\n")
    load_config(missing)  # the form is right; only importing finds that the module does not exist
    with pytest.raises(ConfigError) as e:
        load_config(missing, import_rewards=True)
    [msg] = [str(p) for p in e.value.problems]
    assert f"{missing}:6" in msg and "grpo.rewards.1.name = 'nosuchmod:fn'" in msg and "cannot import" in msg


def test_names_are_checked_with_the_schema_problems_at_once(tmp_path):
    """Names the schema leaves to the check phase (rewards, strategies, columns) are reported together with
    the schema's own problems, each at its line."""
    p = _write(tmp_path, "model:\n  path: tiny:qwen2_5_vl\ndata:\n  datasets:\n"
                         "    - {json_path: a.json, sampling_strategy: 'middle:3', columns: {problm: q}}\n"
                         "eval:\n  batch_size: 0\ngrpo:\n  rewards: [{name: fromat}]\n")
    joined = "\n".join(_problems(p))
    assert f"{p}:5: data.datasets.0.sampling_strategy = 'middle:3': unknown sampling strategy" in joined
    assert f"{p}:5: data.datasets.0.columns" in joined and "did you mean 'problem'" in joined
    assert f"{p}:7: eval.batch_size = 0" in joined
    assert f"{p}:9: grpo.rewards.0.name = 'fromat': unknown reward 'fromat'" in joined


def test_check_paths(tmp_path):
    body = ("model:\n  path: ./no/such/model\ndata:\n  datasets:\n"
            "    - {json_path: missing.jsonl, image_root: nodir}\n"
            "launch:\n  launcher: torchrun\n  deepspeed: nope.json\n")
    p = _write(tmp_path, body)
    load_config(p)  # schema alone is fine
    with pytest.raises(ConfigError) as e:
        load_config(p, check_paths=True)
    joined = str(e.value)
    assert "model.path = './no/such/model'" in joined and "not a hub id" in joined
    assert "data.datasets.0.json_path" in joined and "data.datasets.0.image_root" in joined
    assert "launch.deepspeed" in joined
    hub = _write(tmp_path, "model:\n  path: Qwen/Qwen2.5-VL-3B-Instruct\ndata:\n  demo: {}\n")
    load_config(hub, check_paths=True)  # a hub id is accepted as such


def test_dump_and_reload_round_trip(tmp_path):
    cfg = load_config(_write(tmp_path, BASE), ["grpo.args.beta=0.04"])
    out = dump_config(cfg, tmp_path / "resolved.yaml")
    again = load_config(out)
    assert again == cfg


@pytest.mark.slow  # runs the command line in a subprocess
def test_validate_cli_exit_codes(vlmexp_main):
    """`vlmexp validate` exits 0 on a good config and 2 on a bad one: the command line in a process of its own
    for a refusal, the command's `main` (whose return is the exit status) in this process for the rest."""
    bad = subprocess.run([sys.executable, "-m", "vlmexp.cli", "validate", str(REPO / "configs/demo.yaml"),
                          "grpo.args.num_generations=3"], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and "divisible by num_generations" in bad.stderr

    ok = vlmexp_main("validate", REPO / "configs/demo.yaml")  # from REPO, where the command above ran
    assert ok[0] == 0, ok[2]
    paths = vlmexp_main("validate", REPO / "configs/qwen2_5_vl_3b_rec.yaml")
    assert paths[0] == 2 and "file not found" in paths[2]
    schema = vlmexp_main("validate", "--no-check-paths", REPO / "configs/qwen2_5_vl_3b_rec.yaml")
    assert schema[0] == 0, schema[2]


def test_docs_config_reference_is_current():
    from vlmexp.config.reference import REFERENCE_HEADER, render_reference

    text = (REPO / "docs" / "config-reference.md").read_text()
    assert text == REFERENCE_HEADER + render_reference(), (
        "docs/config-reference.md is stale: "
        ".venv/bin/vlmexp config-reference --write docs/config-reference.md")


def test_every_config_field_has_a_description():
    """Each field says what it is for (TRL documents every field); docs/config-reference.md shows it."""
    from vlmexp.config.reference import config_sections

    missing = [f"{name}.{key}".lstrip(".") for name, model in config_sections()
               for key, field in model.model_fields.items() if not (field.description or "").strip()]
    assert not missing, f"config fields without a description (add Field(description=...)): {missing}"


def test_system_metrics_on_a_gpu_without_nvidia_ml_py_are_refused_with_the_fix(monkeypatch):
    """A stage on a CUDA GPU without nvidia-ml-py stops before training (MLflow alone would log no GPU use and
    say so only at info level). No GPU here: torch is made to report one, and pynvml to be missing."""
    import importlib.util

    import torch

    from vlmexp.tracking.stage_run import start_system_metrics

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pynvml" else find_spec(name, *a))
    cfg = load_config(REPO / "configs/demo.yaml", [], check_paths=False)
    with pytest.raises(ConfigError, match=r"tracking\.system_metrics = True: a CUDA GPU is here but "
                                          r"nvidia-ml-py is not installed.*pip install nvidia-ml-py.*"
                                          r"tracking\.system_metrics: false"):
        start_system_metrics(cfg)
    off = load_config(REPO / "configs/demo.yaml", ["tracking.system_metrics=false"], check_paths=False)
    assert start_system_metrics(off) is False
