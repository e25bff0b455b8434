"""Export and promotion.

`export_model` writes one self-contained folder that loads in plain transformers (a LoRA adapter merged
into its base unless `export.merge_lora` is false) with a manifest tying it to its config, data, code
and runs. `register_and_promote` registers that folder in the MLflow Model Registry and moves the
`champion` alias to it only when its evaluation metric beats the current champion's.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from vlmexp.config.schema import Config
from vlmexp.results import Promotion

ALIAS = "champion"


def export_model(cfg: Config, model_path: str, out_dir: str | Path, manifest: dict[str, Any],
                 resolved_config: str | Path | None = None) -> Path:
    """Write safetensors (or the adapter), processor, chat template and manifest.json to `out_dir`,
    replacing it atomically: a reader sees the old folder or the new one, never a mix."""
    from vlmexp.files import new_folder
    from vlmexp.modeling import adapter_base, load_for_inference
    from vlmexp.provenance import redacted_yaml
    from vlmexp.tracking.registration import plan_registration

    out = Path(out_dir)
    base = adapter_base(model_path)
    with new_folder(out, replace=True) as tmp:
        if base is not None and not cfg.export.merge_lora:
            shutil.copytree(model_path, tmp, ignore=shutil.ignore_patterns("checkpoint-*", "*.pt", "*.pth"),
                            dirs_exist_ok=True)
        else:
            model, processor, _ = load_for_inference(cfg, model_path)  # an adapter is merged here
            model.save_pretrained(str(tmp), is_main_process=True)
            processor.save_pretrained(str(tmp))
        full = {"source": str(model_path), "merged_lora": base is not None and cfg.export.merge_lora,
                "adapter_base": base, **manifest}
        # copy or reference (vlmexp/tracking/registration.py)
        full["registration"] = plan_registration(cfg.export, tmp)
        if resolved_config:
            full["config_sha256"] = hashlib.sha256(Path(resolved_config).read_bytes()).hexdigest()
            # it travels with the model
            (tmp / "vlmexp_config.yaml").write_text(redacted_yaml(resolved_config))
        (tmp / "manifest.json").write_text(json.dumps(full, indent=2, default=str) + "\n")
    return out


def beats(value: float | None, champion_value: float | None, direction: str) -> tuple[bool, str]:
    """Whether a candidate with `value` should replace a champion with `champion_value`, and why."""
    if value is None:
        return False, "the candidate has no value for the metric (was evaluation switched off?)"
    if champion_value is None:
        return True, "there is no champion with a value for the metric yet"
    better = value > champion_value if direction == "maximize" else value < champion_value
    relation = ">" if value > champion_value else "<" if value < champion_value else "="
    verdict = "better" if better else "not better"
    return better, f"{value:.4f} {relation} champion's {champion_value:.4f} ({direction}): {verdict}"


def register_and_promote(tracker, run_id: str, folder: str | Path, name: str, metric: str,
                         value: float | None, direction: str, *, registration: dict[str, Any],
                         metrics: dict[str, Any] | None = None,
                         dataset: str | Path | None = None) -> Promotion:
    """Register `folder` as a new version of `name`, by copy or by reference as `registration` (the export
    manifest's plan, `vlmexp.tracking.registration`) says; give it the champion alias only if it beats the
    current champion on `metric` (the value is stored on each version as tag `metric.<metric>`). The folder is
    a logged model of `run_id` holding its evaluation `metrics` (on the `dataset` manifest's data)."""
    tags = {"metric_name": metric, "direction": direction, "mlflow_run_id": run_id,
            "registration": registration["mode"]}
    if value is not None:
        tags[f"metric.{metric}"] = repr(float(value))
    current = tracker.champion(name, ALIAS)
    version = tracker.register_model(run_id, folder, name, tags, metrics, dataset, registration)
    champion_version, champion_value = None, None
    if current is not None:
        champion_version = current[0]
        raw = current[1].get(f"metric.{metric}")
        champion_value = float(raw) if raw is not None else None
    promoted, reason = beats(value, champion_value, direction)
    if promoted:
        tracker.set_alias(name, version, ALIAS)
    return Promotion(name, version, metric, value, champion_version, champion_value, promoted, reason)
