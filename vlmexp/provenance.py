"""What a run records about itself, in the pipeline's process and in a stage's: the config as MLflow params
(secret-named values redacted), the code's commit and the versions of the packages that train."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD", re.IGNORECASE)


PACKAGES = ("vlmexp", "torch", "transformers", "trl", "peft", "accelerate", "datasets", "deepspeed",
            "prefect", "mlflow")


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Dotted keys -> strings, for MLflow params. Lists are kept as JSON."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return out


def command_name() -> str:
    """The command this process runs as a person typed it: the program and its subcommand, never the arguments
    (they may hold paths or values a person would not publish)."""
    return " ".join([Path(sys.argv[0]).name, *sys.argv[1:2]]) if sys.argv and sys.argv[0] else "python"


def source_tags() -> dict[str, str]:
    """MLflow's own source tags, which fill the runs table's Source column and the run page's source and
    commit: the entry point (the command), the code's git commit, and whether the checkout had local
    changes."""
    commit = git_commit()
    tags = {"mlflow.source.type": "LOCAL", "mlflow.source.name": command_name(),
            "git_dirty": str(commit.endswith("-dirty")).lower()}
    if commit != "unknown":
        tags["mlflow.source.git.commit"] = commit.removesuffix("-dirty")
    return tags


def run_tags(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Git commit of the code, the source MLflow shows (`source_tags`), the versions of the packages that
    train."""
    from importlib.metadata import PackageNotFoundError, version

    tags = {"git_commit": git_commit(), **source_tags()}
    for pkg in PACKAGES:
        try:
            tags[f"version.{pkg}"] = version(pkg)
        except PackageNotFoundError:
            pass
    tags.update(extra or {})
    return tags


def redact(obj: Any) -> Any:
    """A copy of a config tree with the values of secret-named keys (TOKEN, KEY, SECRET, PASSWORD) hidden."""
    if isinstance(obj, dict):
        return {k: "<redacted>" if SECRET_NAME.search(str(k)) and v is not None else redact(v)
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    return obj


def redacted_yaml(path: str | Path) -> str:
    """A YAML file's text with secret-named keys' values hidden: what may be logged or exported."""
    import yaml

    return yaml.safe_dump(redact(yaml.safe_load(Path(path).read_text())), sort_keys=False)


def git_commit() -> str:
    root = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if out.returncode != 0:
        return "unknown"
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=10).stdout.strip()
    return out.stdout.strip() + ("-dirty" if dirty else "")
