"""How an exported model is registered in MLflow: by copy (its files uploaded into MLflow's artifact store) or
by reference (the registered version points at files that stay where they are). Large models default to a
reference: uploading a 3B model in bf16 (about 7 GB) through a tracking server is slow and a known source of
timeouts, and on a shared output folder the files are already where every machine can read them.

`plan_registration` decides (`export.registration`, `export.copy_max_gib`) and the export's manifest.json
records the plan; `reference_target` gives a version by reference files that stay as registered: a snapshot of
the export under `<output_dir>/registered/<model id>/` made of hard links (no bytes copied; the next export
replaces `export/` with new files and leaves the snapshot's alone), or `export.reference_uri`, which must
already hold this export (its manifest.json, byte for byte).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from vlmexp.config.stages import ExportConfig
from vlmexp.errors import ConfigError, Problem

GIB = 2**30
SNAPSHOTS = "registered"  # <output_dir>/registered/<model id>/: the files of versions registered by reference


def folder_bytes(folder: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def plan_registration(export: ExportConfig, folder: str | Path) -> dict[str, Any]:
    """{"mode": "copy" | "reference", "size_bytes", "reason", "reference_uri"} for the export in `folder`."""
    size = folder_bytes(folder)
    limit = int(export.copy_max_gib * GIB)
    if export.registration != "auto":
        mode, reason = export.registration, f"export.registration is {export.registration}"
    elif size <= limit:
        mode, reason = "copy", f"{size / GIB:.2f} GiB <= export.copy_max_gib {export.copy_max_gib:g}"
    else:
        mode, reason = "reference", f"{size / GIB:.2f} GiB > export.copy_max_gib {export.copy_max_gib:g}"
    return {"mode": mode, "size_bytes": size, "reason": reason,
            "reference_uri": export.reference_uri if mode == "reference" else None}


def reference_target(folder: str | Path, model_id: str, reference_uri: str | None) -> str:
    """The URI a version registered by reference points at: `reference_uri` once it is checked to hold this
    export, else the file URI of a hard-linked snapshot of `folder` under
    `<output_dir>/registered/<model_id>/`."""
    folder = Path(folder).resolve()
    if reference_uri:
        check_reference(folder, reference_uri)
        return reference_uri.rstrip("/")
    from vlmexp.files import MARKER, new_folder

    snapshot = folder.parent / SNAPSHOTS / model_id
    if not snapshot.is_dir():
        try:
            with new_folder(snapshot, what="registered model files (hard links to the export's)") as tmp:
                shutil.copytree(folder, tmp, copy_function=os.link, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns(MARKER))
        except OSError as e:
            raise ConfigError(Problem("export.registration", "",
                                      "registering by reference keeps each version's files as hard links "
                                      f"under {snapshot.parent}, which failed ({e}); this filesystem may not "
                                      "support hard links: set export.registration: copy, or "
                                      "export.reference_uri to where a copy of the export lives",
                                      "reference")) from e
    return snapshot.as_uri()


def check_reference(folder: Path, uri: str) -> None:
    """Refuse `uri` unless its manifest.json is this export's, byte for byte (read through MLflow's artifact
    repositories: a local path, file://, s3://, gs://, ...)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    with tempfile.TemporaryDirectory() as tmp:
        try:
            there = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"{uri.rstrip('/')}/manifest.json",
                                                             dst_path=tmp)).read_bytes()
        except (MlflowException, OSError) as e:
            there, why = None, str(e).splitlines()[0][:300]
        else:
            why = "it differs from this export's"
    if there != (folder / "manifest.json").read_bytes():
        raise ConfigError(Problem("export.reference_uri", "",
                                  f"{uri}/manifest.json is not this export's manifest ({why}): copy {folder} "
                                  "there first, or leave export.reference_uri unset to register a snapshot "
                                  "in the output folder", uri))
