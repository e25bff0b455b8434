"""Render the config reference (README section) from the pydantic models, so it never drifts."""

from __future__ import annotations

import inspect
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


def config_sections(name: str = "", model: type[BaseModel] = Config) -> list[tuple[str, type[BaseModel]]]:
    """(dotted name, model) of every section of the config tree, depth first, `Config` itself first."""
    out = [(name, model)]
    for key, field in model.model_fields.items():
        for arg in (field.annotation, *typing.get_args(field.annotation)):
            inner = typing.get_args(arg)[0] if typing.get_origin(arg) is list else arg
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                dotted = f"{name}.{key}".lstrip(".") + ("[]" if typing.get_origin(arg) is list else "")
                out += config_sections(dotted, inner)
                break
    return out


def _section(name: str, model: type[BaseModel], out: list[str]) -> None:
    doc = inspect.cleandoc(model.__doc__ or "").split("\n\n")[0].replace("\n", " ")  # its first paragraph
    out.append(f"\n#### `{name}`\n" if name else "\n#### Sections\n")
    if doc and not doc.startswith("!!!"):
        out.append(doc + "\n")
    out.append("| key | type | default | meaning |\n|---|---|---|---|")
    for key, field in model.model_fields.items():
        meaning = (field.description or "").replace("|", "\\|")
        out.append(f"| `{field.alias or key}` | {_type_name(field.annotation)} | {_default(field)} | {meaning} |")


def render_reference() -> str:
    out: list[str] = []
    for name, model in config_sections():
        _section(name, model, out)
    return "\n".join(out).lstrip("\n") + "\n"
