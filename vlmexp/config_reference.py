"""Render the config reference (README section) from the pydantic models, so it never drifts."""

from __future__ import annotations

import json
import re
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from vlmexp.config import Config


def _type_name(annotation) -> str:
    text = str(annotation).replace("typing.", "")
    if isinstance(annotation, type) and not typing.get_args(annotation):
        text = annotation.__name__
    text = text.replace("vlmexp.config.", "")
    text = re.sub(r"Annotated\[int, Gt\(gt=0\)\]", "int > 0", text)
    text = re.sub(r"Optional\[(.*)\]$", r"\1 | None", text)
    return text.replace("|", "\\|")


def _default(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    value = field.default_factory() if field.default_factory else field.default
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        value = [v.model_dump() for v in value]
    text = json.dumps(value)
    return f"`{text}`" if len(text) < 60 else "(see configs/)"


def _section(name: str, model: type[BaseModel], out: list[str]) -> None:
    doc = (model.__doc__ or "").strip().splitlines()
    out.append(f"\n#### `{name}`\n")
    if doc and not doc[0].startswith("!!!"):
        out.append(doc[0] + "\n")
    out.append("| key | type | default | meaning |\n|---|---|---|---|")
    nested = []
    for key, field in model.model_fields.items():
        out.append(f"| `{field.alias or key}` | {_type_name(field.annotation)} | {_default(field)} | {field.description or ''} |")
        for arg in (field.annotation, *typing.get_args(field.annotation)):
            inner = typing.get_args(arg)[0] if typing.get_origin(arg) is list else arg
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                nested.append((f"{name}.{key}" + ("[]" if typing.get_origin(arg) is list else ""), inner))
                break
    for sub_name, sub_model in nested:
        _section(sub_name, sub_model, out)


def render_reference() -> str:
    out: list[str] = []
    for key, field in Config.model_fields.items():
        _section(key, field.annotation, out)
    return "\n".join(out).lstrip("\n") + "\n"
