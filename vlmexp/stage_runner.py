"""The pipeline's steps as plain functions (no Prefect here): resolving the config, keys that decide
whether a stage must run again, stage folders, and running a stage's launch command as a subprocess."""

from __future__ import annotations

import collections
import hashlib
import io
import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from vlmexp.config import Config
from vlmexp.path_checks import KEY_FILE, foreign_stage_dir
from vlmexp.results import Evaluation, Result, StageResult

R = TypeVar("R", bound=Result)

RESOLVED_NAME = "config.resolved.yaml"
PENDING_NAME = ".config.pending.yaml"


class StageFailed(RuntimeError):
    """A stage's process exited non-zero; the message has the exit code and its last output lines."""


class StageInterrupted(StageFailed):
    """A stage's process was stopped by SIGINT or SIGTERM (Ctrl-C, a cancel): a stop, not a failure to retry."""


INTERRUPT_CODES = (130, 143, -2, -15)  # exit codes of a process ended by SIGINT / SIGTERM (shell and Popen forms)


def stop_process_tree(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Stop `proc` gently (SIGTERM), then every process it started, wherever they went: the descendants are
    listed before the launcher is signalled, so workers that torchrun starts in their own sessions, and that
    outlive it, are found too. SIGKILL for what is still alive after `grace` seconds."""
    import psutil

    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    alive = [p for p in tree if p.is_running()]
    for p in alive:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(alive, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)


def check_pipeline_parameters(config: object, overrides: object) -> None:
    """The flow's parameters as a deployment may pass them: `config` a path, `overrides` a list of k=v
    strings. Raises ConfigError naming the parameter, the value and the fix."""
    from vlmexp.errors import ConfigError, Problem

    problems = []
    if not isinstance(config, str) or not config.strip():
        problems.append(Problem("flow parameter", "config", "give the path of a config YAML", config))
    if overrides is not None and (not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides)):
        problems.append(Problem("flow parameter", "overrides", "give a list of strings like "
                                "'grpo.args.learning_rate=1e-6' (or leave it out)", overrides))
    if problems:
        raise ConfigError(problems, title="invalid pipeline parameters")


def resolve_config(config: str, overrides: list[str]) -> tuple[Config, Path]:
    """Load and validate (all problems at once); write the resolved config as <output_dir>/.config.pending.yaml.

    It becomes config.resolved.yaml (`commit_resolved`) only once the data sampled cleanly, so a run that
    fails on its input leaves an existing run's config.resolved.yaml as it was.
    """
    from vlmexp.config_loader import dump_config, load_config

    cfg = load_config(config, overrides, check_paths=True, import_rewards=True)
    return cfg, dump_config(cfg, Path(cfg.run.output_dir) / PENDING_NAME)


def commit_resolved(pending: str | Path) -> Path:
    """Move the pending resolved config into place (atomic rename); return config.resolved.yaml's path."""
    pending = Path(pending)
    final = pending.with_name(RESOLVED_NAME)
    os.replace(pending, final)
    return final


def load_resolved(resolved: str | Path) -> Config:
    from vlmexp.config_loader import load_config

    return load_config(resolved, [], check_paths=False, check_trl=False)


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def stage_key(cfg: Config, stage: str, data_hash: str, upstream: str = "") -> str:
    """What a stage's result depends on: the output folder (relative to the working directory), the model, the data settings and the sampled
    data, the seed, the stage's own section (sft, grpo, eval or export), the DeepSpeed config, and the
    upstream stage's key. Tracking, retries and the launcher's process layout do not count."""
    section = getattr(cfg, stage).model_dump(mode="json")
    return _digest(stage, portable_path(cfg.run.output_dir), cfg.model.model_dump(mode="json"),
                   cfg.data.model_dump(mode="json"), cfg.run.seed, section, cfg.launch.deepspeed, data_hash, upstream)


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
        archive = stage_dir.parent / "archive" / f"{stage_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}-{(previous or 'unknown')[:8]}"
        archive.parent.mkdir(parents=True, exist_ok=True)
        stage_dir.rename(archive)
    stage_dir.mkdir(parents=True, exist_ok=True)
    (stage_dir / KEY_FILE).write_text(json.dumps({"key": key}) + "\n")
    return stage_dir


def stage_env() -> dict[str, str]:
    """The environment of a stage subprocess: this process's, with unbuffered output (streamed to the log).
    Nothing else: what the stage needs is in its command line (config, model, MLflow run id)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


_PERCENT = re.compile(r"(\d{1,3})%\|")  # tqdm's "45%|████▌     | 9/20 [...]"


class ProgressLines:
    """Passes output lines to `on_line`, but a progress bar's redraws (text ending in \\r) only at a readable
    rate: when the bar reaches another tenth (a new bar starts at its first), or `every` seconds after the
    last one shown; and its last state (its final draw, or the last redraw when the output ends)."""

    def __init__(self, on_line: Callable[[str], None], every: float = 30.0):
        self.on_line, self.every = on_line, every
        self.shown_at, self.tenth, self.pending = -float("inf"), None, None

    def line(self, text: str) -> None:
        if _PERCENT.search(text):  # a bar's final draw (ended by a newline): its last state, shown
            self.tenth, self.pending = None, None
        self.on_line(text)

    def redraw(self, text: str) -> None:
        match = _PERCENT.search(text)
        tenth = int(match.group(1)) // 10 if match else None
        if tenth != self.tenth or time.monotonic() - self.shown_at >= self.every:
            self.tenth, self.shown_at, self.pending = tenth, time.monotonic(), None
            self.on_line(text)
        else:
            self.pending = text

    def flush(self) -> None:
        if self.pending is not None:
            self.on_line(self.pending)
            self.pending = None


def run_streaming(cmd: list[str], env: Mapping[str, str], on_line: Callable[[str], None], tail: int = 40,
                  cwd: str | Path | None = None, progress_every: float = 30.0) -> None:
    """Run `cmd`, passing its output lines (stdout and stderr merged) to `on_line`, progress bar redraws at a
    readable rate (`ProgressLines`); raise StageFailed with the exit code and the last `tail` lines shown
    when it fails."""
    last: collections.deque[str] = collections.deque(maxlen=tail)

    def show(line: str) -> None:
        last.append(line)
        on_line(line)

    progress = ProgressLines(show, progress_every)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(env), cwd=cwd)
    try:
        assert proc.stdout is not None
        # newline="": lines come with their ending, so a redraw (ended by the \r that starts the next one)
        # is told apart from a line
        for raw in io.TextIOWrapper(proc.stdout, encoding="utf-8", errors="replace", newline=""):
            line = raw.rstrip("\r\n")
            if not line.strip():
                continue
            (progress.redraw if raw.endswith("\r") else progress.line)(line)
        progress.flush()
        rc = proc.wait()
    except BaseException:  # Ctrl-C, SIGTERM (raised as KeyboardInterrupt by the command line), a cancel
        stop_process_tree(proc)
        raise
    if rc in INTERRUPT_CODES:
        stop_process_tree(proc)  # the launcher is gone; its workers may not be
        raise StageInterrupted(f"{' '.join(cmd[:3])} ... was stopped by a signal (exit code {rc}); last lines:\n"
                               + "\n".join(last))
    if rc != 0:
        raise StageFailed(f"{' '.join(cmd[:3])} ... exited with code {rc}; last lines:\n" + "\n".join(last))


RESULT_NAME = "stage_result.json"


def run_training_stage(stage: str, resolved: str, key: str, model: str | None, parent_run_id: str,
                       on_line: Callable[[str], None], force: bool = False) -> StageResult:
    """One training stage, wherever it runs (the flow's train task, or the `vlm-stage` flow on another pool).

    The stage folder belongs to `key`: a retry (same key) resumes from the newest checkpoint and reuses the
    stage's MLflow child run; new inputs archive the old folder first. The launched subprocess logs TRL's
    step metrics into that child run. The result is also written to <stage folder>/stage_result.json,
    which is how a flow on another machine reads it (the output folder is shared).
    """
    from vlmexp.launch import stage_command
    from vlmexp.tracking import curve_keys, make_tracker, plot_curves

    cfg = load_resolved(resolved)
    stage_dir = Path(cfg.run.output_dir) / stage
    resuming = not force and stage_dir.is_dir() and (stage_dir / KEY_FILE).is_file()
    claim_stage_dir(stage_dir, key, fresh=force)
    tracker = make_tracker(cfg)
    run_file = stage_dir / "mlflow_run_id"
    run_id = run_file.read_text().strip() if resuming and run_file.is_file() else ""
    if not run_id:
        run_id = tracker.start_stage(parent_run_id, stage, {"stage_key": key})
        run_file.write_text(run_id + "\n")
    command = stage_command(cfg.launch, stage, resolved, model, run_id=f"{cfg.run.name}-{stage}",
                            mlflow_run_id=run_id or None)
    on_line("running " + " ".join(command))
    start = time.monotonic()
    try:
        run_streaming(command, stage_env(), on_line)
    except BaseException:
        tracker.end(run_id, "FAILED")
        raise
    seconds = time.monotonic() - start
    png = plot_curves(tracker, run_id, curve_keys(tracker, run_id, stage), stage_dir / "curves.png",
                      f"{cfg.run.name} {stage}: {'rewards' if stage == 'grpo' else 'loss'} by step")
    if png:
        tracker.log_artifact(run_id, png, "plots")
    for pairs in (stage_dir / "pairs.jsonl", stage_dir / "pairs.json"):  # DPO's sampled pairs and their counts
        if pairs.is_file():
            tracker.log_artifact(run_id, pairs, "pairs")
    memory, counts = stage_dir / "peak_memory.json", stage_dir / "pairs.json"
    tracker.log_metrics(run_id, {"stage_seconds": seconds, **(json.loads(memory.read_text()) if memory.is_file() else {}),
                                 **({f"pairs/{k}": v for k, v in json.loads(counts.read_text()).items()}
                                    if counts.is_file() else {})})
    tracker.end(run_id, "FINISHED")
    result = StageResult(stage=stage, final=str(stage_dir / "final"), key=key, run_id=run_id, seconds=seconds)
    return write_result(stage_dir, result)


def write_result(folder: Path, result: R) -> R:
    """Record a stage's result next to its outputs as stage_result.json (through a temporary file and a rename)."""
    from vlmexp.files import atomic_write

    atomic_write(folder / RESULT_NAME, result.model_dump_json(indent=1) + "\n")
    return result


def remote_result(deployment: str, flow_run: str, state: str, message: str | None, folder: Path,
                  key: str, kind: type[R]) -> R:
    """The result of a stage that ran as deployment `deployment` (flow run `flow_run`, final state `state`).

    A run that did not complete raises StageFailed with its state message (the stage's error), so the
    calling task fails and its retry starts the deployment again, which resumes from the checkpoint. A
    completed run's result is read from `folder`/stage_result.json, which must carry `key`, as a `kind`.
    """
    if state != "COMPLETED":
        raise StageFailed(f"stage deployment {deployment} (flow run {flow_run}) ended {state}: "
                          f"{(message or 'no message').strip()[-3000:]}")
    path = folder / RESULT_NAME
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise StageFailed(f"stage deployment {deployment} (flow run {flow_run}) completed but {path} is not "
                          f"readable here ({e}); the output folder must be shared between the flow's and the "
                          "stage's machines (the same path on both)") from e
    if result.get("key") != key:
        raise StageFailed(f"{path} belongs to stage key {str(result.get('key'))[:12]}, not {key[:12]}: "
                          "another run wrote the folder; retrying")
    return kind.model_validate(result)


def run_evaluation(name: str, resolved: str, key: str, model: str, records: str) -> Evaluation:
    """Generate on the held-out `records` with `model` and score with the training rewards, into
    <output_dir>/eval/<name>/ (with stage_result.json, as `run_training_stage`)."""
    from vlmexp.evaluate import evaluate

    cfg = load_resolved(resolved)
    start = time.monotonic()
    folder = Path(cfg.run.output_dir) / "eval" / name
    result = evaluate(cfg, model, records, folder)
    return write_result(folder, Evaluation(name=name, model=model, metrics=result.metrics,
                                           samples=str(result.samples_path), key=key,
                                           seconds=time.monotonic() - start))
