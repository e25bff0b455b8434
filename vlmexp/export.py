"""Export: one self-contained folder that loads in plain transformers (LoRA merged into its base)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from vlmexp.config import Config


def export_model(cfg: Config, model_path: str, out_dir: str | Path, manifest: dict[str, Any]) -> Path:
    """Write safetensors, processor, chat template and manifest.json to `out_dir`, replacing it atomically."""
    from vlmexp.evaluate import load_for_inference

    out = Path(out_dir)
    model, processor, _ = load_for_inference(cfg, model_path)  # an adapter is merged here
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), is_main_process=True)
    processor.save_pretrained(str(tmp))
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    return out
