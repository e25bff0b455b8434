"""The `vlmexp` command. Heavy libraries are imported inside each command, so `vlmexp --help` is instant.

The parser, the dispatch and the process's exit; what each command does is in `vlmexp.commands`. Bad input
exits with status 2 and the list of problems on stderr.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from vlmexp import commands
from vlmexp.config.schema import TRAINING_STAGES
from vlmexp.errors import ReportedError, VlmexpError
from vlmexp.families import FAMILIES
from vlmexp.families.qwen import RELEASED_PIXELS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlmexp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate",
                       help="check a config (schema, names, TRL args, reward imports, paths); exit 0 or 2")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. grpo.args.learning_rate=1e-6")
    p.add_argument("--no-check-paths", action="store_true",
                   help="skip the path checks (the rest is still checked)")
    p.set_defaults(func=commands.cmd_validate)

    p = sub.add_parser("make-tiny-model", help="write a tiny random-weight model of a family (offline)")
    p.add_argument("dir")
    p.add_argument("--family", choices=list(FAMILIES), default="qwen2_5_vl")
    p.set_defaults(func=commands.cmd_make_tiny_model)

    p = sub.add_parser("make-demo-data", help="write the generated grounding dataset (VLM-R1 REC format)")
    p.add_argument("dir")
    # light: the defaults live there once (data.demo's)
    from vlmexp.config.generated_data import DemoDataConfig

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
    p.set_defaults(func=commands.cmd_make_demo_data)

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
    p.set_defaults(func=commands.cmd_sample)

    p = sub.add_parser("run", help="run the whole pipeline (Prefect flow) for a config, in this process")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--force", action="store_true", help="retrain even when config and data are unchanged")
    p.add_argument("--verbose", action="store_true",
                   help="show each logging step's every metric, as the Trainer prints it (transformers' log "
                        "level INFO, TRANSFORMERS_VERBOSITY=info) and the bars of model saves; default: one "
                        "progress line a step")
    p.set_defaults(func=commands.cmd_run)

    p = sub.add_parser("prefect-setup", help="create or update vlmexp's automations on the Prefect server at "
                                             "PREFECT_API_URL: zombie-run detection, "
                                             "and notifications with --notify")
    p.add_argument("--notify", metavar="TYPE/NAME", default=None, help="a notification block on the server "
                   "(e.g. slack-webhook/ops) to tell of failed or lost pipeline runs and of a new champion")
    p.add_argument("--heartbeat-seconds", type=int, default=None, help="the workers' "
                   "PREFECT_FLOWS_HEARTBEAT_FREQUENCY, if not this process's (default 180)")
    p.set_defaults(func=commands.cmd_prefect_setup)

    p = sub.add_parser("eval", help="evaluate a model folder (or LoRA adapter) on the held-out records")
    p.add_argument("checkpoint")
    p.add_argument("--config", required=True)
    p.add_argument("--records", help="sampled JSONL to evaluate on (default: the config's held-out split)")
    p.add_argument("--out", help="folder for metrics.json, samples.jsonl and pictures/ "
                   "(the first eval.pictures records with their boxes)")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=commands.cmd_eval)

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
    p.set_defaults(func=commands.cmd_score)

    p = sub.add_parser("export", help="merge a LoRA adapter (if any) and write a self-contained model folder")
    p.add_argument("checkpoint", help="a model folder or LoRA adapter folder (e.g. outputs/demo/grpo/final)")
    p.add_argument("--config", required=True)
    p.add_argument("--out", help="output folder (default: <run.output_dir>/export)")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=commands.cmd_export)

    p = sub.add_parser("ui", help="start the MLflow UI on 127.0.0.1 for a config's tracking store")
    p.add_argument("--config", help="the config whose store to show (default store: --store)")
    p.add_argument("--store", default="sqlite:///outputs/demo/mlflow.db")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=5000)
    p.set_defaults(func=commands.cmd_ui)

    p = sub.add_parser("train", help="run one training stage (sft, dpo or grpo) in this process")
    p.add_argument("stage", choices=TRAINING_STAGES)
    p.add_argument("--config", required=True)
    p.add_argument("--model", help="start from this model or adapter folder (e.g. the SFT stage's final/)")
    p.add_argument("--dry-run", action="store_true", help="print the launch command and exit")
    p.add_argument("--in-process", action="store_true",
                   help="train in this process, ignoring launch.launcher (each launched process gets it)")
    p.add_argument("--checked", action="store_true",
                   help="the config was written and checked by the pipeline (a run's config.resolved.yaml): "
                        "skip building TRL's three config classes and importing the reward modules at load; "
                        "the stage still builds its own TRL config before the model loads. No overrides")
    p.add_argument("--mlflow-run-id", help="log into this run of the config's MLflow store "
                                           "(the pipeline passes its stage run); default: a new run")
    p.add_argument("--held-by", metavar="RUN_ID", help="run inside the hold of run RUN_ID on the output "
                   "folder (the pipeline passes its own); default: hold the folder for this command's life, "
                   "or wait or refuse as run.on_busy says when another run holds it")
    p.add_argument("--verbose", action="store_true",
                   help="show each logging step's every metric, as the Trainer prints it (transformers' log "
                        "level INFO, TRANSFORMERS_VERBOSITY=info) and the bars of model saves; default: one "
                        "progress line a step")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=commands.cmd_train)

    p = sub.add_parser("config-reference", help="print the config reference (markdown)")
    p.add_argument("--write", metavar="FILE", default=None, help="write it, with its title, to FILE instead "
                   "(docs/config-reference.md)")
    p.set_defaults(func=commands.cmd_config_reference)
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

    from vlmexp.pipeline.processes import (
        STOP_SIGNALS,
        StageInterrupted,
        stop_outside_a_stage,
        stop_signal,
        stopped_by,
    )

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
    except ReportedError as e:  # the message names what failed and the fix: a traceback would add nothing
        print(f"error: {e}", file=sys.stderr)
        return 1
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
