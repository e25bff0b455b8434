"""Export (LoRA merged, reloads and generates in plain transformers) and registry promotion both ways."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlmexp.checks.loader import load_config
from vlmexp.export import beats, register_and_promote
from vlmexp.tracking.tracker import make_tracker

REPO = Path(__file__).resolve().parents[1]
COPY = {"mode": "copy"}


@pytest.fixture(scope="module")
def adapter(tiny_models, tmp_path_factory) -> Path:
    """A LoRA adapter on the tiny model with non-zero B matrices, so merging changes the weights."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from vlmexp.families import get_family
    from vlmexp.processor import load_processor

    base = tiny_models["qwen2_5_vl"]
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForImageTextToText.from_pretrained(base),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    out = tmp_path_factory.mktemp("adapter") / "final"
    model.save_pretrained(out)
    load_processor(base, get_family("qwen2_5_vl")).save_pretrained(out)
    return out


def test_export_merges_lora_reloads_and_generates(tmp_path, adapter, vlmexp_main):
    import torch
    from peft import PeftModel
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from vlmexp.families import get_family
    from vlmexp.processor import load_processor

    # the command line's own entry (parser, dispatch, exit status) in this process, which has torch, peft and
    # transformers loaded already: a process of its own would import them again (tests/test_safety.py runs
    # `vlmexp export` as a process)
    out = tmp_path / "export"
    code, _, err = vlmexp_main("export", adapter, "--config", "configs/demo.yaml", "--out", out,
                               f"run.output_dir={tmp_path}")
    assert code == 0, err[-2000:]
    assert not (out / "adapter_config.json").exists() and (out / "model.safetensors").is_file()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["merged_lora"] is True and manifest["source"] == str(adapter)
    assert len(manifest["config_sha256"]) == 64 and manifest["git_commit"]
    assert (out / "vlmexp_config.yaml").is_file() and (out / "chat_template.jinja").is_file()

    exported = AutoModelForImageTextToText.from_pretrained(out)
    base_path = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    merged = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base_path),
                                       adapter).merge_and_unload()
    base_sd, merged_sd, exported_sd = (AutoModelForImageTextToText.from_pretrained(base_path).state_dict(),
                                       merged.state_dict(), exported.state_dict())
    assert exported_sd.keys() == merged_sd.keys()
    assert all(torch.equal(exported_sd[k], merged_sd[k]) for k in merged_sd)
    # LoRA was merged
    assert not torch.equal(exported_sd["model.language_model.layers.0.self_attn.q_proj.weight"],
                           base_sd["model.language_model.layers.0.self_attn.q_proj.weight"])

    processor = load_processor(out, get_family("qwen2_5_vl"))  # AutoProcessor where torchvision is installed
    messages = [{"role": "user",
                 "content": [{"type": "image"}, {"type": "text", "text": "Find the red circle."}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[Image.new("RGB", (112, 84), "red")], return_tensors="pt")
    generated = exported.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert generated.shape[1] == inputs["input_ids"].shape[1] + 6


def test_export_keeps_the_adapter_when_merge_is_off(tmp_path, adapter):
    from vlmexp.export import export_model

    cfg = load_config(REPO / "configs/demo.yaml", [f"run.output_dir={tmp_path}", "export.merge_lora=false"])
    out = export_model(cfg, str(adapter), tmp_path / "export", {"note": "x"})
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
    assert json.loads((out / "manifest.json").read_text())["merged_lora"] is False


@pytest.mark.parametrize(("direction", "values", "champions"), [
    ("maximize", [0.30, 0.20, 0.30, 0.45], ["1", "1", "1", "4"]),
    ("minimize", [0.30, 0.40, 0.10, None], ["1", "1", "3", "3"]),
])
def test_registry_promotes_only_a_better_model(tmp_path, mlflow_store, tiny_models, direction, values,
                                               champions):
    from mlflow.tracking import MlflowClient

    cfg = load_config(REPO / "configs/demo.yaml", [f"run.output_dir={mlflow_store(tmp_path)}"])
    tracker = make_tracker(cfg)
    decisions = []
    for value in values:
        run = tracker.start_pipeline("p", {}, {})
        decisions.append(register_and_promote(tracker, run, tiny_models["qwen2_5_vl"], "demo-model",
                                              "rec_mean_iou", value, direction, registration=COPY))
        tracker.end(run)
    client = MlflowClient(tracker.uri)
    assert [d.version for d in decisions] == ["1", "2", "3", "4"]  # every export is kept as a version
    assert [d.promoted for d in decisions] == [a != b for a, b in zip(champions, [None, *champions[:-1]])]
    assert str(client.get_model_version_by_alias("demo-model", "champion").version) == champions[-1]
    assert "not better" in decisions[1].reason and decisions[1].champion_value == 0.30
    if direction == "maximize":
        assert "=" in decisions[2].reason and not decisions[2].promoted  # a tie keeps the champion
    else:
        assert "no value" in decisions[3].reason
    versions = {str(v.version): v for v in client.search_model_versions("name='demo-model'")}
    assert versions["1"].tags["metric.rec_mean_iou"] == "0.3"


def test_registered_champion_downloads_and_loads(tmp_path, mlflow_store, tiny_models, monkeypatch):
    import mlflow
    from transformers import AutoModelForImageTextToText

    cfg = load_config(REPO / "configs/demo.yaml", [f"run.output_dir={mlflow_store(tmp_path)}"])
    tracker = make_tracker(cfg)
    run = tracker.start_pipeline("p", {}, {})
    register_and_promote(tracker, run, tiny_models["qwen2_5_vl"], "demo-model", "rec_mean_iou", 0.5,
                         "maximize", registration=COPY)
    # models:/ URIs resolve through the registry's store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracker.uri)
    local = mlflow.artifacts.download_artifacts("models:/demo-model@champion", dst_path=str(tmp_path / "dl"))
    model = AutoModelForImageTextToText.from_pretrained(local)
    assert model.config.model_type == "qwen2_5_vl"


def test_registration_copies_small_exports_and_references_large_ones(tmp_path):
    """export.registration: auto decides on the folder's size against export.copy_max_gib; copy and reference
    are taken as asked; the plan says why."""
    from vlmexp.tracking.registration import plan_registration

    (tmp_path / "model.safetensors").write_bytes(b"\0" * 4096)
    plan = {over: plan_registration(load_config(REPO / "configs/demo.yaml", over, check_paths=False).export,
                                    tmp_path)
            for over in ((), ("export.copy_max_gib=2e-6",),
                         ("export.registration=copy", "export.copy_max_gib=2e-6"),
                         ("export.registration=reference", "export.reference_uri=s3://bucket/m"))}
    assert plan[()]["mode"] == "copy" and plan[()]["reason"] == "0.00 GiB <= export.copy_max_gib 1"
    assert plan[()]["size_bytes"] == 4096 and plan[()]["reference_uri"] is None
    assert plan[("export.copy_max_gib=2e-6",)]["mode"] == "reference"  # 2e-6 GiB is 2147 bytes < 4096
    assert "> export.copy_max_gib 2e-06" in plan[("export.copy_max_gib=2e-6",)]["reason"]
    forced = plan[("export.registration=copy", "export.copy_max_gib=2e-6")]
    assert forced["mode"] == "copy" and forced["reason"] == "export.registration is copy"
    assert plan[("export.registration=reference",
                 "export.reference_uri=s3://bucket/m")]["reference_uri"] == "s3://bucket/m"


def test_register_by_reference_points_at_the_files_and_copies_none(tmp_path, mlflow_store, tiny_models,
                                                                   monkeypatch):
    """A large export (here: any, with the threshold at 0) is registered by reference: its manifest says so,
    the version points at a snapshot of hard links (not one byte copied) that the next export into the same
    folder leaves as it was, the logged model holds no weights, and the champion downloads and loads from it.
    export.reference_uri is taken only where it holds this export."""
    import shutil

    import mlflow
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForImageTextToText

    from vlmexp.errors import ConfigError
    from vlmexp.export import export_model

    cfg = load_config(REPO / "configs/demo.yaml", [f"run.output_dir={mlflow_store(tmp_path)}",
                                                   "export.copy_max_gib=1e-9"])
    out = export_model(cfg, str(tiny_models["qwen2_5_vl"]), tmp_path / "export", {})
    plan = json.loads((out / "manifest.json").read_text())["registration"]
    assert plan["mode"] == "reference" and plan["size_bytes"] > (out / "model.safetensors").stat().st_size
    tracker = make_tracker(cfg)
    run = tracker.start_pipeline("p", {}, {})
    register_and_promote(tracker, run, out, "big-model", "rec_mean_iou", 0.5, "maximize", registration=plan)
    client = MlflowClient(tracker.uri)
    version = client.get_model_version("big-model", "1")
    snapshot = Path(version.source.removeprefix("file://"))
    assert snapshot.parent == tmp_path / "registered" and version.tags["registration"] == "reference"
    weights = (out / "model.safetensors").stat()
    # linked
    assert (snapshot / "model.safetensors").stat().st_ino == weights.st_ino and weights.st_nlink == 2
    model = client.get_logged_model(version.tags["model_id"])
    assert model.tags["mlflow.model.isExternal"] == "true" and model.tags["vlmexp.files"] == version.source
    # no weights in MLflow
    assert [a.path for a in client.list_logged_model_artifacts(model.model_id)] == ["MLmodel"]

    # replaces export/
    export_model(cfg, str(tiny_models["qwen2_5_vl"]), tmp_path / "export", {"again": True})
    assert (snapshot / "model.safetensors").stat().st_ino == weights.st_ino
    # the registered files, as they were
    assert "again" not in json.loads((snapshot / "manifest.json").read_text())
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracker.uri)
    local = mlflow.artifacts.download_artifacts("models:/big-model@champion", dst_path=str(tmp_path / "dl"))
    assert AutoModelForImageTextToText.from_pretrained(local).config.model_type == "qwen2_5_vl"

    # where the user keeps a copy: taken once it holds this export
    elsewhere = tmp_path / "bucket" / "big-model-v2"
    with pytest.raises(ConfigError,
                       match=r"export\.reference_uri = .*manifest\.json is not this export's manifest"):
        register_and_promote(tracker, run, out, "big-model", "rec_mean_iou", 0.4, "maximize",
                             registration={**plan, "reference_uri": elsewhere.as_uri()})
    shutil.copytree(out, elsewhere)
    register_and_promote(tracker, run, out, "big-model", "rec_mean_iou", 0.4, "maximize",
                         registration={**plan, "reference_uri": elsewhere.as_uri()})
    assert client.get_model_version("big-model", "2").source == elsewhere.as_uri()


def test_beats_explains_itself():
    assert beats(0.5, None, "maximize") == (True, "there is no champion with a value for the metric yet")
    assert beats(0.5, 0.4, "maximize")[0] and not beats(0.5, 0.4, "minimize")[0]
    assert beats(0.4, 0.5, "maximize")[1] == "0.4000 < champion's 0.5000 (maximize): not better"


def test_export_metric_must_be_one_evaluation_produces():
    """A typo in export.metric would report "not promoted" forever: refused at config load, with the names."""
    from vlmexp.config.stages import METRIC_KEYS
    from vlmexp.errors import ConfigError

    with pytest.raises(ConfigError,
                       match=r"export\.metric = 'rec_mean_iuo'(.|\n)*use one of count, format_rate, "
                             r"rec_mean_iou, rec_acc50, rec_acc75, math_accuracy, exact_accuracy"):
        load_config(REPO / "configs/demo.yaml", ["export.metric=rec_mean_iuo"], check_paths=False)
    for metric in METRIC_KEYS:
        assert load_config(REPO / "configs/demo.yaml", [f"export.metric={metric}"],
                           check_paths=False).export.metric == metric
