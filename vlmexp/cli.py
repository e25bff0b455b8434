"""The `vlmexp` command. Heavy libraries are imported inside each command, so `vlmexp --help` is instant.

Bad input exits with status 2 and the list of problems on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

from vlmexp.config.schema import TRAINING_STAGES
from vlmexp.errors import Problem, VlmexpError
from vlmexp.families import BUDGET_KNOBS, FAMILIES, get_family
from vlmexp.families.qwen import RELEASED_PIXELS


def check_arguments(command: str, *checks: tuple[str, object, str | None]) -> None:
    """Refuse the command's own arguments before any work: (option, value, problem or None) each."""
    problems = [Problem(f"vlmexp {command}", option, message, value) for option, value, message in checks
                if message]
    if problems:
        raise VlmexpError(problems, title=f"invalid arguments to vlmexp {command}")


def cmd_validate(args: argparse.Namespace) -> int:
    from vlmexp.config.loader import load_config

    cfg = load_config(args.config, args.overrides, check_paths=not args.no_check_paths, import_rewards=True)
    print(f"{args.config}: ok (model {cfg.model.path}, output_dir {cfg.run.output_dir})")
    return 0


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from vlmexp.config.path_checks import check_output_dir
    from vlmexp.tiny import make_tiny_model

    check_arguments("make-tiny-model", ("DIR", args.dir, check_output_dir(args.dir)))
    out = make_tiny_model(args.dir, args.family)
    print(f"wrote tiny {args.family} model to {out}")
    return 0


def cmd_make_demo_data(args: argparse.Namespace) -> int:
    from vlmexp.config.path_checks import check_output_dir
    from vlmexp.data.demo import Annotator, Scenes, make_demo_data

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
    from vlmexp.config.path_checks import check_output_file
    from vlmexp.data.sampling import format_report, sample_sources
    from vlmexp.data.sources import load_data_yaml

    manifest = Path(args.out).with_name(Path(args.out).name.removesuffix(".jsonl") + ".manifest.json")
    check_arguments("sample", ("--out", args.out, check_output_file(args.out) or check_output_file(manifest)))
    result = sample_sources(load_data_yaml(args.data_yaml), args.out, seed=args.seed, judged=args.judged)
    print(format_report(result, explain=args.explain))
    print(f"wrote {result.rows} records to {result.path} (manifest {result.manifest_path})")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """The whole pipeline in this process: Prefect's temporary server, the configured MLflow store.

    One of the two places the library's command line reaches up into flows/ (the library itself never
    imports prefect): `vlmexp run` is a shortcut for calling the flow; `vlmexp prefect-setup` the other.
    """
    import os

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

    from vlmexp.config.loader import load_config
    from vlmexp.config.path_checks import check_checkpoint, check_output_dir
    from vlmexp.data.run_data import prepare_data
    from vlmexp.evaluate import check_sampled_records, evaluate

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

    from vlmexp.config.path_checks import check_output_file
    from vlmexp.evaluate import score_predictions
    from vlmexp.files import atomic_write

    knobs = {k: getattr(args, k) for k in BUDGET_KNOBS if getattr(args, k) is not None}
    root = args.image_root
    check_arguments("score", *_budget_problems(get_family(args.family), knobs),
                    ("--per-sample", args.per_sample, args.per_sample and check_output_file(args.per_sample)),
                    ("--image-root", root,
                     root and not Path(root).is_dir() and "no such folder; fix the path"))
    check_arguments("score", ("--math-grader", args.math_grader, _grader_problem(args.math_grader)))
    cfg = None
    if args.config:
        from vlmexp.config.loader import load_config

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

    from vlmexp.config.loader import dump_config, load_config
    from vlmexp.config.path_checks import (
        check_checkpoint,
        check_output_dir,
        check_replaceable_folder,
        data_paths,
    )
    from vlmexp.export import export_model
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

    from vlmexp.config.loader import load_config
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
    """One training stage: through the configured launcher, or in this process (what the launcher starts)."""
    import logging
    import shlex
    import subprocess

    from vlmexp.config.loader import load_config
    from vlmexp.config.path_checks import check_checkpoint
    from vlmexp.launch import is_launched_process, stage_command

    from vlmexp.pipeline.keys import RESOLVED_NAME

    # a dry run works from any machine: no paths probed, no reward module imported. A run's resolved config
    # (what the pipeline starts each rank of a stage with) had its TRL args and reward modules checked when it
    # was written: here the stage builds its one TRL config and imports its rewards itself; paths are probed
    # once in every process, since a node's disks are its own
    validated = Path(args.config).name == RESOLVED_NAME and not args.overrides
    cfg = load_config(args.config, args.overrides, check_paths=not args.dry_run, check_trl=not validated,
                      import_rewards=not (args.dry_run or validated))
    if args.model and not args.dry_run:
        check_arguments(f"train {args.stage}", ("--model", args.model, check_checkpoint(args.model)))
    command = stage_command(cfg.launch, args.stage, args.config, args.model, args.overrides,
                            run_id=cfg.run.name, mlflow_run_id=args.mlflow_run_id)
    if args.dry_run:
        print(shlex.join(command))
        return 0
    if cfg.launch.launcher != "local" and not args.in_process and not is_launched_process():
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlmexp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate",
                       help="check a config (schema, names, TRL args, reward imports, paths); exit 0 or 2")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. grpo.args.learning_rate=1e-6")
    p.add_argument("--no-check-paths", action="store_true",
                   help="skip the path checks (the rest is still checked)")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("make-tiny-model", help="write a tiny random-weight model of a family (offline)")
    p.add_argument("dir")
    p.add_argument("--family", choices=list(FAMILIES), default="qwen2_5_vl")
    p.set_defaults(func=cmd_make_tiny_model)

    p = sub.add_parser("make-demo-data", help="write the generated grounding dataset (VLM-R1 REC format)")
    p.add_argument("dir")
    from vlmexp.config.schema import DemoDataConfig  # light: the defaults live there once (data.demo's)

    demo = DemoDataConfig()
    p.add_argument("--train", type=int, default=demo.train)
    p.add_argument("--val", type=int, default=demo.val)
    p.add_argument("--seed", type=int, default=demo.seed)
    p.add_argument("--width", type=int, nargs=2, default=demo.width, metavar=("LOW", "HIGH"),
                   help="image widths")
    p.add_argument("--height", type=int, nargs=2, default=demo.height, metavar=("LOW", "HIGH"),
                   help="image heights")
    p.add_argument("--objects", type=int, nargs=2, default=demo.objects, metavar=("LOW", "HIGH"),
                   help="shapes per image")
    p.add_argument("--background", choices=("plain", "gradient"), default=demo.background,
                   help="gradient: the shade encodes x and y (what configs/demo.yaml uses)")
    p.add_argument("--annotator-loose", type=float, default=demo.annotator_loose, metavar="SHARE",
                   help="training records' `demonstration` boxes (what SFT imitates) reach this share of the "
                        "side beyond each edge; 0 with --annotator-jitter 0 writes no demonstration")
    p.add_argument("--annotator-jitter", type=float, default=demo.annotator_jitter, metavar="SHARE",
                   help="and move each edge by a uniform draw of up to this share of the side")
    p.set_defaults(func=cmd_make_demo_data)

    p = sub.add_parser("sample", help="sample a VLM-R1 data YAML into one JSONL file plus a manifest")
    p.add_argument("data_yaml")
    p.add_argument("--out", required=True, help="output .jsonl file")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--explain", action="store_true",
                   help="also print which format each source was read as and why "
                        "(the fields that decided it)")
    p.add_argument("--judged", action="store_true",
                   help="keep records of accu_reward_method llm: the config that trains on them "
                        "has a judge reward")
    p.set_defaults(func=cmd_sample)

    p = sub.add_parser("run", help="run the whole pipeline (Prefect flow) for a config, in this process")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--force", action="store_true", help="retrain even when config and data are unchanged")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("prefect-setup", help="create or update vlmexp's automations on the Prefect server at "
                                             "PREFECT_API_URL: zombie-run detection, "
                                             "and notifications with --notify")
    p.add_argument("--notify", metavar="TYPE/NAME", default=None, help="a notification block on the server "
                   "(e.g. slack-webhook/ops) to tell of failed or lost pipeline runs and of a new champion")
    p.add_argument("--heartbeat-seconds", type=int, default=None, help="the workers' "
                   "PREFECT_FLOWS_HEARTBEAT_FREQUENCY, if not this process's (default 180)")
    p.set_defaults(func=cmd_prefect_setup)

    p = sub.add_parser("eval", help="evaluate a model folder (or LoRA adapter) on the held-out records")
    p.add_argument("checkpoint")
    p.add_argument("--config", required=True)
    p.add_argument("--records", help="sampled JSONL to evaluate on (default: the config's held-out split)")
    p.add_argument("--out", help="folder for metrics.json, samples.jsonl and pictures/ "
                   "(the first eval.pictures records with their boxes)")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("score",
                       help="score a predictions JSONL (data records + `completion`) from any system")
    p.add_argument("predictions",
                   help="JSONL: one data record per line (any format `sample` reads) plus `completion`")
    p.add_argument("--family", required=True, choices=list(FAMILIES), help="the box frame of the completions")
    p.add_argument("--min-pixels", type=int,
                   help="Qwen-VL: image processor min_pixels (default: released checkpoints', "
                        f"{RELEASED_PIXELS[0]})")
    p.add_argument("--max-pixels", type=int,
                   help="Qwen-VL: image processor max_pixels (default: released checkpoints', "
                        f"{RELEASED_PIXELS[1]})")
    p.add_argument("--min-patches", type=int,
                   help="InternVL: fewest tiles per image (default: released checkpoints', 1)")
    p.add_argument("--max-patches", type=int,
                   help="InternVL: most tiles per image (default: released checkpoints', 12)")
    p.add_argument("--image-root",
                   help="folder relative image paths resolve against (default: the file's folder)")
    p.add_argument("--per-sample", help="write each line's parsed answer and score to this JSONL")
    p.add_argument("--math-grader", choices=["math_verify", "mathruler"],
                   help="grader of math answers (default math_verify; mathruler is EasyR1's, "
                        "vlmexp[mathruler])")
    p.add_argument("--prefilled-think", action="store_true",
                   help="the completions begin inside a <think> block the chat template opened "
                        "(Qwen3-VL Thinking)")
    p.add_argument("--config",
                   help="score with this config's grpo.rewards (a judge, a reward model) and its prompts")
    p.set_defaults(func=cmd_score)

    p = sub.add_parser("export", help="merge a LoRA adapter (if any) and write a self-contained model folder")
    p.add_argument("checkpoint", help="a model folder or LoRA adapter folder (e.g. outputs/demo/grpo/final)")
    p.add_argument("--config", required=True)
    p.add_argument("--out", help="output folder (default: <run.output_dir>/export)")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("ui", help="start the MLflow UI on 127.0.0.1 for a config's tracking store")
    p.add_argument("--config", help="the config whose store to show (default store: --store)")
    p.add_argument("--store", default="sqlite:///outputs/demo/mlflow.db")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=5000)
    p.set_defaults(func=cmd_ui)

    p = sub.add_parser("train", help="run one training stage (sft, dpo or grpo) in this process")
    p.add_argument("stage", choices=TRAINING_STAGES)
    p.add_argument("--config", required=True)
    p.add_argument("--model", help="start from this model or adapter folder (e.g. the SFT stage's final/)")
    p.add_argument("--dry-run", action="store_true", help="print the launch command and exit")
    p.add_argument("--in-process", action="store_true",
                   help="train in this process, ignoring launch.launcher (each launched process gets it)")
    p.add_argument("--mlflow-run-id", help="log into this run of the config's MLflow store "
                                           "(the pipeline passes its stage run); default: a new run")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("config-reference", help="print the config reference (markdown)")
    p.add_argument("--write", metavar="FILE", default=None, help="write it, with its title, to FILE instead "
                   "(docs/config-reference.md)")
    p.set_defaults(func=cmd_config_reference)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # overrides may follow options (`train sft --config C k=v`); anything else is an error
        if not hasattr(args, "overrides") or not all("=" in x and not x.startswith("-") for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    import signal
    import threading

    from vlmexp.pipeline.processes import (STOP_SIGNALS, StageInterrupted, stop_outside_a_stage, stop_signal,
                                           stopped_by)

    # SIGTERM and SIGHUP stop a command as Ctrl-C does: its stage processes are stopped too
    # handlers only go to the main thread. SIGINT is taken even when it came ignored (a background job of a
    # script), as torchrun takes it; a SIGHUP ignored on purpose (nohup) stays ignored
    taken = [s for s in STOP_SIGNALS if s != signal.SIGHUP or signal.getsignal(s) is not signal.SIG_IGN]
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, stop_outside_a_stage) for s in taken} if main_thread else {}
    try:
        return args.func(args)
    except (KeyboardInterrupt, StageInterrupted) as e:
        if isinstance(e, StageInterrupted) and stop_signal() is None:
            raise  # a stage stopped from outside, not this command: its error
        signum = stop_signal() or signal.SIGINT
        print(f"stopped by {stopped_by(signum)}; run the same command again to resume", file=sys.stderr)
        return 128 + signum
    except VlmexpError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (FileExistsError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def exit_without_teardown(code: int) -> NoReturn:
    """Leave the process as Python's exit does (non-daemon threads joined, e.g. MLflow's async logging
    queue; atexit handlers run; streams flushed) but skip the interpreter's teardown of the module graph.

    After a training stage that teardown of torch's and transformers' modules costs seconds and does nothing
    of ours: 1.7-2.9 s against 0.1 s with this, three SFT stages each on the 2-core VM (bench/RESULTS.md,
    "Exit of a stage process"). Python versions without threading._shutdown exit normally."""
    import atexit
    import os
    import threading

    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is None:
        sys.exit(code)
    shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def entry() -> None:
    """The `vlmexp` command (and `python -m vlmexp.cli`, how stages are launched)."""
    exit_without_teardown(main())


if __name__ == "__main__":
    entry()
