"""The config loader's check phase: what the pure schema (`vlmexp.config.schema`) leaves to other modules.

Each check returns (location in the config, value, problem) triples; `load_config` turns the location into
the file:line (or override) that set it. Two kinds:

- `check_names` always runs. It reads nothing and runs no user code: reward names against the registry,
  sampling strategies and a source's `columns` against the data package. It works on the raw mapping, entry
  by entry, so its problems come with the schema's own, all at once. `check_sections` (always run too, on the
  validated config) checks what one section asks of another, naming the field that asks.
- The checks with side effects run only when the loader is asked to: `check_trl_config` builds TRL's argument
  classes (imports trl), `check_reward_imports` imports each module:function reward's module in a child
  process (its top-level code runs there), and `vlmexp.checks.config_paths` probes the file system.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from vlmexp.config.schema import TRAINING_STAGES, Config, DataSource
from vlmexp.config.stages import RewardSpec

Loc = tuple[str | int, ...]
Found = tuple[Loc, Any, str]  # (location in the config, value, problem with its fix)


def check_names(raw: dict[str, Any]) -> list[Found]:
    """Reward names and data sources of a raw (merged, overridden) config mapping; entries the schema refuses
    are left to the schema's own problems."""
    from vlmexp.data.sources import check_source
    from vlmexp.rewards import DEFAULT_MATCHES
    from vlmexp.rewards_loader import check_reward_name

    out: list[Found] = []
    for loc, spec in _entries(raw, ("grpo", "rewards"), RewardSpec):
        try:
            check_reward_name(spec.name, import_module=False)
        except ValueError as e:
            out.append(((*loc, "name"), spec.name, str(e)))
        out += _model_reward_problem(loc, spec)
        if spec.name == "math" and "grader" in spec.kwargs:  # refused before any work, with the install hint
            out += _grader_problem((*loc, "kwargs", "grader"), spec.kwargs["grader"])
        if spec.name == "exact" and spec.kwargs.get("default_match", "vlm_r1") not in DEFAULT_MATCHES:
            out.append(((*loc, "kwargs", "default_match"), spec.kwargs["default_match"],
                        "how the exact reward scores accu_reward_method 'default': one of "
                        f"{', '.join(DEFAULT_MATCHES)} "
                        "(vlm_r1: VLM-R1's default_accuracy_reward, partial credit; exact: equality)"))
    grader = (raw.get("eval") or {}).get("math_grader") if isinstance(raw.get("eval"), dict) else None
    if grader is not None:
        out += _grader_problem(("eval", "math_grader"), grader)
    for key in ("datasets", "val_datasets"):
        for loc, src in _entries(raw, ("data", key), DataSource):
            out += [((*loc, field), value, message) for field, value, message in check_source(src)]
    return out


def _model_reward_problem(loc: Loc, spec: RewardSpec) -> list[Found]:
    """A judge's or reward model's kwargs, checked by building the reward (which loads nothing)."""
    from dataclasses import fields

    from vlmexp.model_rewards import MODEL_REGISTRY

    if spec.name not in MODEL_REGISTRY:
        return []
    known = [f.name for f in fields(MODEL_REGISTRY[spec.name])]
    if unknown := sorted(set(spec.kwargs) - set(known)):
        return [((*loc, "kwargs"), spec.kwargs, f"unknown kwargs {unknown}; the {spec.name} reward takes "
                 f"{', '.join(known)} (docs/training.md)")]
    try:
        MODEL_REGISTRY[spec.name](**spec.kwargs)
    except (TypeError, ValueError) as e:
        return [((*loc, "kwargs"), spec.kwargs, str(e))]
    return []


def _grader_problem(loc: Loc, grader: Any) -> list[Found]:
    from vlmexp.answers import check_math_grader

    try:
        check_math_grader(grader)
    except ValueError as e:
        return [(loc, grader, str(e))]
    return []


def check_sections(cfg: Config) -> list[Found]:
    """What one section asks of another (pure, always run): validation during training needs held-out records;
    exporting the best checkpoint needs validation during training, and checkpoints saved by step."""
    out: list[Found] = []
    d, every = cfg.data, cfg.eval.every_steps
    held_out = any(x is not None for x in (d.demo, d.zoom_demo, d.val_datasets, d.val_data_yaml,
                                           d.val_fraction))
    if every and not held_out:
        out.append((("eval", "every_steps"), every, "validation during training needs held-out records: set "
                    "data.val_datasets, data.val_data_yaml or data.val_fraction, or eval.every_steps: 0"))
    if cfg.export.checkpoint == "best":
        if not every:
            out.append((("export", "checkpoint"), "best", "export.checkpoint: best picks the checkpoint with "
                        "the best validation during training, and eval.every_steps is off: set "
                        "eval.every_steps (e.g. 25), or export.checkpoint: last"))
        for stage in TRAINING_STAGES:
            if getattr(cfg, stage).enabled and getattr(cfg, stage).args.get("save_strategy") == "no":
                out.append(((stage, "args", "save_strategy"), "no", "export.checkpoint: best keeps the best "
                            "validation's checkpoint, and save_strategy 'no' keeps none: remove it, or "
                            "export.checkpoint: last"))
    return out + check_tools(cfg)


def check_tools(cfg: Config) -> list[Found]:
    """GRPO's tools against the model family (when the config names it; a local checkpoint's family is
    checked by `vlmexp.checks.config_paths`) and evaluation with the tool against the tools offered."""
    from vlmexp.families import FAMILIES

    out: list[Found] = []
    names = cfg.grpo.tools.names
    if cfg.eval.tools in ("on", "both") and not names:
        out.append((("eval", "tools"), cfg.eval.tools, "evaluation with the tool needs a tool: set "
                    "grpo.tools.names (e.g. [zoom]), or eval.tools: off"))
    family = FAMILIES.get(cfg.model.family or "")
    if names and family is not None and family.tools_refusal:
        out.append((("grpo", "tools", "names"), names, family.tools_problem()))
    return out


def check_reward_imports(cfg: Config) -> list[Found]:
    """Import each module:function reward's module in a child process
    (`vlmexp.rewards_loader.check_custom_reward`): it must import, within the time limit, and name a
    callable; and probe each model reward (`vlmexp.model_rewards.probe`)."""
    from vlmexp.rewards_loader import REWARDS, check_custom_reward, check_reward_name

    out: list[Found] = []
    for i, spec in enumerate(cfg.grpo.rewards):
        try:
            check_reward_name(spec.name, import_module=False)
        except ValueError:
            continue  # check_names reports it
        if spec.name in REWARDS:
            continue
        try:
            check_custom_reward(spec.name)
        except ValueError as e:
            out.append((("grpo", "rewards", i, "name"), spec.name, str(e)))
    from vlmexp.model_rewards.probe import probe_rewards  # judge endpoints answer, reward models are there

    return out + probe_rewards(cfg.grpo.rewards)


def check_trl_config(cfg: Config) -> list[Found]:
    """Build each training stage's TRL config class from its `args`
    (`vlmexp.config.trl_args.check_trl_args`)."""
    from vlmexp.config.trl_args import check_trl_args

    out: list[Found] = []
    for stage in TRAINING_STAGES:
        for key, value, message in check_trl_args(stage, getattr(cfg, stage).args):
            out.append(((stage, "args", key) if key else (stage, "args"), value, message))
    return out


def _entries(raw: dict[str, Any], loc: Loc, model: type[BaseModel]):
    """(location, validated entry) of each entry of the list at `loc` in `raw` that `model` accepts."""
    node: Any = raw
    for key in loc:
        node = node.get(key) if isinstance(node, dict) else None
    for i, entry in enumerate(node if isinstance(node, list) else []):
        try:
            yield (*loc, i), model.model_validate(entry)
        except ValidationError:
            continue
