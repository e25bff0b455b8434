"""Pass-through of `sft.args` / `grpo.args` to TRL's own config classes.

TRL documents and checks its arguments; we do not restate them. We add what TRL leaves out: unknown
keys get a "did you mean" hint, each value is type-checked against the dataclass annotation (TRL
accepts `learning_rate: "abc"` silently), and YAML 1.1 strings like "1e-6" become floats.
"""

from __future__ import annotations

import difflib
import typing
from functools import cache
from typing import Any

from vlmexp.errors import change_the_value

# Keys the pipeline sets itself, with where to set them instead.
RESERVED = {
    "output_dir": "set run.output_dir instead",
    "report_to": "set tracking.backend instead (mlflow or none)",
    "deepspeed": "set launch.deepspeed instead",
    "trust_remote_code": "set model.trust_remote_code instead",
}


def trl_config_class(stage: str) -> type:
    import trl

    return {"sft": trl.SFTConfig, "dpo": trl.DPOConfig, "grpo": trl.GRPOConfig}[stage]


@cache
def _field_types(stage: str) -> dict[str, Any]:
    import dataclasses

    cls = trl_config_class(stage)
    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls) if f.init}


def _adapter(annotation: Any):
    from pydantic import ConfigDict, TypeAdapter

    try:  # "nan" or "inf" as a string is a float to pydantic: refused like the config tree's own numbers
        return TypeAdapter(annotation, config=ConfigDict(allow_inf_nan=False))
    except Exception:  # noqa: BLE001 - some annotations (arbitrary classes) have no pydantic schema:
        return None  # those fields are left to TRL's own checks, which run on every value anyway


def coerce_trl_args(stage: str, args: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, Any, str]]]:
    """Type-check and convert each value; return (converted args, problems as (key, value, message))."""
    from pydantic import ValidationError

    types = _field_types(stage)
    cls_name = trl_config_class(stage).__name__
    out: dict[str, Any] = {}
    problems: list[tuple[str, Any, str]] = []
    for key, value in args.items():
        if key in RESERVED:
            problems.append((key, value, f"set by the pipeline; {RESERVED[key]}"))
            continue
        if key not in types:
            hint = difflib.get_close_matches(key, list(types), n=1)
            fix = f"did you mean {hint[0]!r}?" if hint else f"see the fields of trl.{cls_name}"
            problems.append((key, value, f"not a trl.{cls_name} field; {fix}"))
            continue
        adapter = _adapter(types[key])
        if adapter is None:
            out[key] = value
            continue
        try:
            out[key] = adapter.validate_python(value)
        except ValidationError as e:
            reason = e.errors()[0]["msg"]
            finite = e.errors()[0]["type"] == "finite_number"
            fix = "write a finite number, not NaN or infinity" if finite else change_the_value(key, value)
            problems.append((key, value, f"{reason} (trl.{cls_name}.{key} is {types[key]}); {fix}"))
    return out, problems


def build_trl_config(stage: str, args: dict[str, Any], output_dir: str, **pipeline_args: Any):
    """Build trl.SFTConfig / DPOConfig / GRPOConfig from our args: the one build in a process that trains (a
    config checked when it was written, as a run's resolved config, is not built again before). Raises
    ConfigError naming each field, its value and the fix, or TRL's own refusal.

    On a machine without CUDA, `bf16` defaults to False (TRL defaults it to True) and `use_cpu` to True.
    """
    import torch

    from vlmexp.errors import ConfigError, Problem

    converted, problems = coerce_trl_args(stage, args)
    if problems:
        raise ConfigError([Problem(f"{stage}.args.{key}", "", msg, value) for key, value, msg in problems])
    kwargs = current_names(stage, {**pipeline_args, **converted})
    if not torch.cuda.is_available():
        kwargs.setdefault("bf16", False)
    kwargs["use_cpu"] = runs_on_cpu(kwargs)
    try:
        return trl_config_class(stage)(output_dir=output_dir, **kwargs)
    except (ValueError, TypeError) as e:
        raise ConfigError(Problem(f"{stage}.args", "", f"trl.{trl_config_class(stage).__name__} refuses "
                                  f"these args: {e}", args)) from e


def runs_on_cpu(args: dict[str, Any]) -> bool:
    """Whether a stage with these args trains on the CPU: `use_cpu` as given, else when there is no CUDA."""
    import torch

    return bool(args.get("use_cpu", not torch.cuda.is_available()))


def current_names(stage: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with activation checkpointing under transformers 5's names. TRL's configs set the older
    ones (gradient_checkpointing defaults to True), which transformers deprecates with a FutureWarning at
    every config built; the same values pass under the current names."""
    fields = trl_config_class(stage).__dataclass_fields__
    out = dict(kwargs)
    for old, new in (("gradient_checkpointing", "activation_checkpointing"),
                     ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
        if new not in out:
            out[new] = out.pop(old, fields[old].default)
    return out


def check_trl_args(stage: str, args: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """Problems with a stage's args as (key or '', value, message); empty when TRL accepts them.

    Hardware is not checked here: a GPU recipe validates on a CPU machine (use_cpu is implied).
    """
    import tempfile

    converted, problems = coerce_trl_args(stage, args)
    if problems:
        return problems
    kwargs = current_names(stage, converted)
    kwargs.setdefault("use_cpu", True)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            trl_config_class(stage)(output_dir=tmp, **kwargs)
        except (ValueError, TypeError) as e:
            return [("", args, f"trl.{trl_config_class(stage).__name__} refuses these args: {e}")]
    return []
