"""A pipeline run's resolved config, the keys that decide whether a stage must run again, and stage folders
(claimed for a key, archived when another key's, never a folder vlmexp did not write)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from vlmexp.config.schema import TRAINING_STAGES, Config
from vlmexp.paths import KEY_FILE, foreign_stage_dir

RESOLVED_NAME = "config.resolved.yaml"


PENDING_NAME = ".config.pending.yaml"  # `.config.pending-<run id>.yaml` for a run that holds the folder


def check_pipeline_parameters(config: object, overrides: object) -> None:
    """The flow's parameters as a deployment may pass them: `config` a path, `overrides` a list of k=v
    strings. Raises ConfigError naming the parameter, the value and the fix."""
    from vlmexp.errors import ConfigError, Problem

    problems = []
    if not isinstance(config, str) or not config.strip():
        problems.append(Problem("flow parameter", "config", "give the path of a config YAML", config))
    if overrides is not None and (not isinstance(overrides, list)
                                  or not all(isinstance(o, str) for o in overrides)):
        problems.append(Problem("flow parameter", "overrides", "give a list of strings like "
                                "'grpo.args.learning_rate=1e-6' (or leave it out)", overrides))
    if problems:
        raise ConfigError(problems, title="invalid pipeline parameters")


def resolve_config(config: str, overrides: list[str], run_id: str = "") -> tuple[Config, Path]:
    """Load and validate (all problems at once); write the resolved config as
    <output_dir>/.config.pending-<run_id>.yaml (each run's own).

    It becomes config.resolved.yaml (`commit_resolved`) only once the data sampled cleanly, so a run that
    fails on its input leaves an existing run's config.resolved.yaml as it was.
    """
    from vlmexp.checks.loader import dump_config, load_config

    cfg = load_config(config, overrides, check_paths=True, import_rewards=True)
    return cfg, dump_config(cfg, pending_path(cfg.run.output_dir, run_id))


def pending_path(output_dir: str | Path, run_id: str = "") -> Path:
    """Where run `run_id` keeps its resolved config until its data is sampled."""
    return Path(output_dir) / (PENDING_NAME.replace(".yaml", f"-{run_id}.yaml") if run_id else PENDING_NAME)


def run_folder(config: str, overrides: list[str] | None) -> tuple[Path, Config] | None:
    """The output folder a pipeline run of `config` writes, and the config (checked as far as its schema and
    names: nothing probed, nothing imported), or None when the config does not load (the pipeline's validate
    step then reports every problem)."""
    from vlmexp.checks.loader import load_config
    from vlmexp.errors import VlmexpError

    try:
        cfg = load_config(config, overrides or [], check_trl=False)
    except (VlmexpError, OSError):
        return None
    return Path(cfg.run.output_dir), cfg


def commit_resolved(pending: str | Path) -> Path:
    """Move the pending resolved config into place (atomic rename); return config.resolved.yaml's path."""
    pending = Path(pending)
    final = pending.with_name(RESOLVED_NAME)
    os.replace(pending, final)
    return final


def load_resolved(resolved: str | Path) -> Config:
    from vlmexp.checks.loader import load_config

    return load_config(resolved, [], check_paths=False, check_trl=False)


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def stage_key(cfg: Config, stage: str, data_hash: str, upstream: str = "") -> str:
    """What a stage's result depends on: the output folder (relative to the working directory), the model,
    the data settings and the sampled data, the seed, the stage's own section (sft, grpo, eval or export), the
    DeepSpeed config, and the upstream stage's key; for a training stage with validation during training, the
    eval section and the metric that picks the best checkpoint. Tracking, retries and the launcher's process
    layout do not count."""
    section = getattr(cfg, stage).model_dump(mode="json")
    parts = [stage, portable_path(cfg.run.output_dir), cfg.model.model_dump(mode="json"),
             cfg.data.model_dump(mode="json"), cfg.run.seed, section, cfg.launch.deepspeed, data_hash,
             upstream]
    # validation during training: its metrics, which checkpoint is best
    if stage in TRAINING_STAGES and cfg.eval.every_steps:
        parts.append([cfg.eval.model_dump(mode="json"), cfg.export.metric, cfg.export.direction])
    return _digest(*parts)


def portable_path(path: str | Path) -> str:
    """`path` relative to the working directory when inside it: moving the checkout changes no key."""
    p = Path(path).expanduser().resolve()
    try:
        return p.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return str(p)


def stage_done(stage_dir: Path, key: str) -> bool:
    """The stage finished with this key: final/ exists and the recorded key matches."""
    return (stage_dir / "final").is_dir() and read_key(stage_dir) == key


def read_key(stage_dir: Path) -> str | None:
    try:
        return json.loads((stage_dir / KEY_FILE).read_text())["key"]
    except (OSError, ValueError, KeyError):
        return None


def claim_stage_dir(stage_dir: Path, key: str, fresh: bool = False) -> Path:
    """Make `stage_dir` belong to `key`. A folder left by another key (other config or data), or any
    folder when `fresh`, is moved to <output_dir>/archive/ (never deleted), so a resume only ever
    continues a run of the same inputs."""
    previous = read_key(stage_dir)
    if refused := foreign_stage_dir(stage_dir):
        from vlmexp.errors import ConfigError, Problem

        raise ConfigError(Problem("run.output_dir", stage_dir.name, refused, str(stage_dir.parent)))
    if stage_dir.exists() and (fresh or previous != key) and any(stage_dir.iterdir()):
        archive = stage_dir.parent / "archive" / (f"{stage_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}-"
                                                  f"{(previous or 'unknown')[:8]}")
        archive.parent.mkdir(parents=True, exist_ok=True)
        stage_dir.rename(archive)
    stage_dir.mkdir(parents=True, exist_ok=True)
    (stage_dir / KEY_FILE).write_text(json.dumps({"key": key}) + "\n")
    return stage_dir
