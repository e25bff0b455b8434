"""What each `vlmexp` command does; `vlmexp.cli` parses the arguments and calls one of these.

Heavy libraries are imported inside each command, so `vlmexp --help` is instant. Bad input raises VlmexpError
(the command line exits with status 2 and the list of problems on stderr). `vlmexp run` and `vlmexp
prefect-setup` are the library's one reach up into flows/ (the library itself never imports prefect).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vlmexp.errors import Problem, VlmexpError
from vlmexp.families import BUDGET_KNOBS, get_family


def check_arguments(command: str, *checks: tuple[str, object, str | None]) -> None:
    """Refuse the command's own arguments before any work: (option, value, problem or None) each."""
    problems = [Problem(f"vlmexp {command}", option, message, value) for option, value, message in checks
                if message]
    if problems:
        raise VlmexpError(problems, title=f"invalid arguments to vlmexp {command}")


def cmd_validate(args: argparse.Namespace) -> int:
    from vlmexp.checks.loader import load_config

    cfg = load_config(args.config, args.overrides, check_paths=not args.no_check_paths, import_rewards=True)
    print(f"{args.config}: ok (model {cfg.model.path}, output_dir {cfg.run.output_dir})")
    return 0


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from vlmexp.paths import check_output_dir
    from vlmexp.tiny import make_tiny_model

    check_arguments("make-tiny-model", ("DIR", args.dir, check_output_dir(args.dir)))
    out = make_tiny_model(args.dir, args.family)
    print(f"wrote tiny {args.family} model to {out}")
    return 0


def cmd_make_demo_data(args: argparse.Namespace) -> int:
    from vlmexp.data.demo import Annotator, Scenes, make_demo_data
    from vlmexp.paths import check_output_dir

    counts = [(f"--{k}", getattr(args, k), None if getattr(args, k) > 0 else "must be a positive count")
              for k in ("train", "val")]
    check_arguments("make-demo-data", ("DIR", args.dir, check_output_dir(args.dir)), *counts)
    try:
        scenes = Scenes(tuple(args.width), tuple(args.height), tuple(args.objects), args.background)
    except ValueError as e:
        raise VlmexpError([Problem("make-demo-data", "--width/--height/--objects",
                                   f"{e}; give LOW HIGH with 0 < LOW <= HIGH, "
                                   "images at least 64 pixels a side")]) from e
    try:
        annotator = Annotator(jitter=args.annotator_jitter, loose=args.annotator_loose)
    except ValueError as e:
        raise VlmexpError([Problem("make-demo-data", "--annotator-jitter/--annotator-loose",
                                   f"{e}; 0 0 writes the exact boxes only")]) from e
    out = make_demo_data(args.dir, train=args.train, val=args.val, seed=args.seed, scenes=scenes,
                         annotator=annotator)
    print(f"wrote {args.train} train and {args.val} val records to {out} (data YAMLs: train.yaml, val.yaml)")
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    from vlmexp.data.sampling import format_report, sample_sources
    from vlmexp.data.sources import load_data_yaml
    from vlmexp.paths import check_output_file

    manifest = Path(args.out).with_name(Path(args.out).name.removesuffix(".jsonl") + ".manifest.json")
    check_arguments("sample", ("--out", args.out, check_output_file(args.out) or check_output_file(manifest)))
    result = sample_sources(load_data_yaml(args.data_yaml), args.out, seed=args.seed, judged=args.judged)
    print(format_report(result, explain=args.explain))
    print(f"wrote {result.rows} records to {result.path} (manifest {result.manifest_path})")
    return 0


def show_every_metric(verbose: bool) -> None:
    """`--verbose`: transformers' log level INFO here and in the stage processes this command starts (they
    inherit it as TRANSFORMERS_VERBOSITY, the variable transformers itself reads), so that each stage shows
    the Trainer's dict of every metric at each logging step (vlmexp.train.progress). Below that level, no
    progress bar for this process's model saves (a tiny model's build, the export), as in its stages."""
    import os

    from vlmexp.train.verbosity import quiet_model_saves

    if verbose:
        os.environ["TRANSFORMERS_VERBOSITY"] = "info"
    quiet_model_saves()


def cmd_run(args: argparse.Namespace) -> int:
    """The whole pipeline in this process: Prefect's temporary server, the configured MLflow store.

    One of the two commands that reach up into flows/ (the library itself never imports prefect): `vlmexp
    run` is a shortcut for calling the flow; `vlmexp prefect-setup` the other.
    """
    import os

    from vlmexp.pipeline.hold import refuse_if_held
    from vlmexp.pipeline.keys import run_folder

    found = run_folder(args.config, args.overrides)
    if found is not None and found[1].run.on_busy == "refuse":  # before a server starts: the flow holds it
        refuse_if_held(found[0])
    show_every_metric(args.verbose)  # after the refusal: it imports transformers' logging (seconds)
    if not os.environ.get("PREFECT_API_URL"):
        # Prefect's temporary server: its telemetry heartbeat has no use offline and, racing the flow for the
        # fresh sqlite database, logs "database is locked" tracebacks into the demo's output.
        os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from flows.pipeline import vlm_pipeline
    from flows.temporary_server import temporary_server

    # without a PREFECT_API_URL, a temporary server that a terminal's Ctrl-C does not reach: the flow can
    # still record the stop, and its last logs and events are sent before the server stops
    with temporary_server():
        state = vlm_pipeline(config=args.config, overrides=args.overrides, force=args.force,
                             return_state=True)
    if state.is_cancelled():  # stopped by a signal: the flow closed its runs; exit as the signal says
        raise KeyboardInterrupt(state.message)
    print(state.result().summary)
    return 0


def cmd_prefect_setup(args: argparse.Namespace) -> int:
    """Create or update vlmexp's automations on the Prefect server at PREFECT_API_URL
    (flows/automations.py)."""
    from flows.automations import set_up

    try:
        done = set_up(args.notify, args.heartbeat_seconds)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, what in done.items():
        print(f"{what}: {name}")
    if not args.notify:
        print("no notifications: pass --notify TYPE/NAME (a notification block on the server) to add them")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Generate on the config's held-out records with CHECKPOINT and print the metrics as JSON."""
    import json

    from vlmexp.checks.loader import load_config
    from vlmexp.data.run_data import prepare_data
    from vlmexp.evaluate import check_sampled_records, evaluate
    from vlmexp.paths import check_checkpoint, check_output_dir

    cfg = load_config(args.config, args.overrides, check_paths=True)
    check_arguments("eval", ("CHECKPOINT", args.checkpoint, check_checkpoint(args.checkpoint)),
                    ("--out", args.out, args.out and check_output_dir(args.out)))
    if args.records:
        check_sampled_records(args.records)
    records = args.records or prepare_data(cfg).val
    if records is None:
        raise VlmexpError([Problem(args.config, "data.val_datasets",
                                   "no held-out records: set data.val_datasets, "
                                   "data.val_data_yaml or data.val_fraction, or pass --records FILE.jsonl")])
    out = args.out or str(Path(cfg.run.output_dir) / "eval" / Path(args.checkpoint).name)
    result = evaluate(cfg, args.checkpoint, records, out)
    print(json.dumps(result.metrics, indent=2))
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    """Score completions produced by any system with the rewards that train; metrics as JSON on stdout."""
    import json

    from vlmexp.evaluate import score_predictions
    from vlmexp.files import atomic_write
    from vlmexp.paths import check_output_file

    knobs = {k: getattr(args, k) for k in BUDGET_KNOBS if getattr(args, k) is not None}
    root = args.image_root
    check_arguments("score", *_budget_problems(get_family(args.family), knobs),
                    ("--per-sample", args.per_sample, args.per_sample and check_output_file(args.per_sample)),
                    ("--image-root", root,
                     root and not Path(root).is_dir() and "no such folder; fix the path"))
    check_arguments("score", ("--math-grader", args.math_grader, _grader_problem(args.math_grader)))
    cfg = None
    if args.config:
        from vlmexp.checks.loader import load_config

        cfg = load_config(args.config, [])
    metrics, rows = score_predictions(args.predictions, args.family, knobs, args.image_root,
                                      args.prefilled_think, args.math_grader, cfg)
    if args.per_sample:
        atomic_write(Path(args.per_sample), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(json.dumps(metrics, indent=2))
    return 0


def _budget_problems(family, knobs: dict[str, int]) -> list[tuple[str, object, str | None]]:
    """`vlmexp score`'s image-budget options: positive, low <= high, and the family's own (others refused)."""
    def option(knob: str) -> str:
        return "--" + knob.replace("_", "-")

    problems = [(option(k), v, "must be a positive number" if v <= 0 else None if k in family.budget_knobs
                 else f"does not apply to {family.name} ({family.budget_summary}); use "
                 f"{' / '.join(option(b) for b in family.budget_knobs)}") for k, v in knobs.items()]
    for low, high in (("min_pixels", "max_pixels"), ("min_patches", "max_patches")):
        if knobs.get(low, 0) > knobs.get(high, float("inf")):
            problems.append((option(low), knobs[low], f"exceeds {option(high)} {knobs[high]}; swap them"))
    return problems


def _grader_problem(grader: str | None) -> str | None:
    from vlmexp.answers import check_math_grader

    try:
        check_math_grader(grader or "math_verify")
    except ValueError as e:
        return str(e)
    return None


def cmd_export(args: argparse.Namespace) -> int:
    """Export CHECKPOINT (a model folder or LoRA adapter) as one folder that loads in plain transformers."""
    import tempfile

    from vlmexp.checks.config_paths import data_paths
    from vlmexp.checks.loader import dump_config, load_config
    from vlmexp.export import export_model
    from vlmexp.paths import check_checkpoint, check_output_dir, check_replaceable_folder
    from vlmexp.provenance import git_commit

    cfg = load_config(args.config, args.overrides, check_paths=True)
    out = Path(args.out or Path(cfg.run.output_dir) / "export").expanduser()
    file = out.exists() and not out.is_dir() and f"{out} is a file, not a folder; choose another path"
    check_arguments("export", ("CHECKPOINT", args.checkpoint, check_checkpoint(args.checkpoint)),
                    # replaced as a whole, from beside
                    ("--out", str(out), file or check_output_dir(out.parent)
                     or check_replaceable_folder(out, data_paths(cfg, args.checkpoint))))
    with tempfile.TemporaryDirectory() as tmp:
        resolved = dump_config(cfg, Path(tmp) / "config.resolved.yaml")
        export_model(cfg, args.checkpoint, out, {"config": args.config, "overrides": args.overrides,
                                                 "git_commit": git_commit()}, resolved_config=resolved)
    print(f"exported {args.checkpoint} to {out}")
    return 0


def cmd_ui(args: argparse.Namespace) -> int:
    """The MLflow UI for a run's store, bound to 127.0.0.1, in its low-memory form."""
    import os

    from vlmexp.checks.loader import load_config
    from vlmexp.tracking.tracker import store_uri, ui_address

    cfg = load_config(args.config, [], check_paths=False, check_trl=False) if args.config else None
    uri = store_uri(cfg) if cfg else args.store
    experiment = (cfg.tracking.experiment_name or cfg.run.name) if cfg else ""
    command = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", args.host,
               "--port", str(args.port), "--workers", "1"]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # 2 processes, ~0.5 GB instead of ~9
    print(f"MLflow UI for {uri} on {ui_address(args.host, args.port, uri, experiment)}", flush=True)
    os.execve(sys.executable, command, env)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """One training stage: through the configured launcher, or in this process (what the launcher starts).
    Started by hand, it holds the output folder for its life (vlmexp.pipeline.hold); a stage the pipeline
    starts runs inside the pipeline's hold (`--held-by`)."""
    import os

    show_every_metric(args.verbose)
    import shlex

    from vlmexp.checks.loader import load_config
    from vlmexp.disk import checkpoint_bytes, said_as_disk_full
    from vlmexp.launch import is_launched_process, stage_command
    from vlmexp.paths import check_checkpoint
    from vlmexp.pipeline.hold import check_held_by, holding

    overridden = args.checked and args.overrides and (
        "the config was checked when the pipeline wrote it, and overrides would change it unchecked: drop "
        "the overrides, or drop --checked to check the config with them")
    check_arguments(f"train {args.stage}", ("--checked", args.overrides, overridden))
    # a dry run works from any machine: no paths probed, no reward module imported. A --checked config (a
    # run's resolved config, what the pipeline starts each rank of a stage with) had its TRL args and reward
    # modules checked when it was written: here the stage builds its one TRL config and imports its rewards
    # itself; paths are probed once in every process, since a node's disks are its own. A Ray cluster is
    # checked by the driver this command starts, on its own connection, before any work (not twice: a
    # connection from a child process here took 12 s of a loaded start)
    cfg = load_config(args.config, args.overrides, check_paths=not args.dry_run, check_trl=not args.checked,
                      import_rewards=not (args.dry_run or args.checked), check_cluster=False)
    if args.model and not args.dry_run:
        check_arguments(f"train {args.stage}", ("--model", args.model, check_checkpoint(args.model)))
    if args.dry_run:
        print(shlex.join(stage_command(cfg.launch, args.stage, args.config, args.model, args.overrides,
                                       run_id=cfg.run.name, mlflow_run_id=args.mlflow_run_id,
                                       checked=args.checked, held_by=args.held_by)))
        if cfg.launch.launcher == "ray":
            from vlmexp.launch import ray_submission

            print(ray_submission(cfg.launch))
        return 0
    # a full disk (the weights, the optimizer state, the MLflow store, the hold) said as such
    full = getattr(cfg, args.stage).peft is None
    with said_as_disk_full(cfg.run.output_dir, lambda: checkpoint_bytes(_start_model(cfg, args.model), full)):
        if args.held_by:  # inside the hold of the run that started it
            check_held_by(cfg.run.output_dir, args.held_by)
            return _train_stage(args, cfg)
        if is_launched_process() and os.environ.get("RANK", os.environ["LOCAL_RANK"]) != "0":
            return _train_stage(args, cfg)  # a launch started by hand: its first process holds the folder
        with holding(cfg.run.output_dir, f"vlmexp train {args.stage}", on_busy=cfg.run.on_busy,
                     wait_seconds=cfg.run.busy_wait_seconds) as hold:
            if not is_launched_process():  # the processes it launches run inside its hold
                args.held_by = hold.run_id
            return _train_stage(args, cfg)


def _start_model(cfg, model: str | None) -> str:
    """The folder a stage starts from: `--model`, else the config's model (a tiny one as built)."""
    from vlmexp.modeling import resolve_model

    return model or resolve_model(cfg.model, cfg.run.output_dir)[0]


def _train_stage(args: argparse.Namespace, cfg) -> int:
    """`vlmexp train`'s stage, through the configured launcher or in this process."""
    import logging
    import shlex
    import subprocess

    from vlmexp.launch import is_launched_process, stage_command

    if cfg.launch.launcher != "local" and not args.in_process and not is_launched_process():
        command = stage_command(cfg.launch, args.stage, args.config, args.model, args.overrides,
                                run_id=cfg.run.name, mlflow_run_id=args.mlflow_run_id, checked=args.checked,
                                held_by=args.held_by)
        print(f"launching: {shlex.join(command)}", file=sys.stderr, flush=True)
        from vlmexp.pipeline.processes import stop_process_tree

        launcher = subprocess.Popen(command)
        try:
            return launcher.wait()
        except KeyboardInterrupt:  # a stop: the launcher and its workers (in sessions of their own) stop too
            stop_process_tree(launcher)
            raise
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.stage == "sft":
        from vlmexp.train.sft import run_sft

        final = run_sft(cfg, mlflow_run_id=args.mlflow_run_id)
    elif args.stage == "dpo":
        from vlmexp.train.dpo import run_dpo

        final = run_dpo(cfg, args.model, mlflow_run_id=args.mlflow_run_id)
    else:
        from vlmexp.train.grpo import run_grpo

        final = run_grpo(cfg, args.model, mlflow_run_id=args.mlflow_run_id)
    print(f"{args.stage}: final model in {final}")
    return 0


def cmd_config_reference(args: argparse.Namespace) -> int:
    from vlmexp.config.reference import REFERENCE_HEADER, render_reference

    if args.write is None:
        print(render_reference(), end="")
        return 0
    from vlmexp.files import atomic_write

    atomic_write(Path(args.write), REFERENCE_HEADER + render_reference())
    print(f"wrote the config reference to {args.write}")
    return 0
