"""What every section of the config tree shares: the strict base model (unknown keys and NaN refused) and
the check of a `str.format` template's fields. Part of the pure schema (see `vlmexp.config.schema`)."""

from __future__ import annotations

import string

from pydantic import BaseModel, ConfigDict


def check_template(template: str, fields: tuple[str, ...], what: str) -> None:
    """Raise ValueError unless `template` is a str.format template using only `fields`, the first among
    them."""
    try:
        used = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ValueError(f"{what} is malformed ({e}); escape braces as {{{{ }}}}") from None
    unknown = used - set(fields)
    if unknown:
        raise ValueError(f"{what} uses {sorted(unknown)}; only "
                         f"{' and '.join('{' + f + '}' for f in fields)} exist "
                         "(escape literal braces as {{ }})")
    if fields[0] not in used:
        raise ValueError(f"{what} must contain {{{fields[0]}}}")


class Section(BaseModel):
    # NaN/inf: "Input should be a finite number"
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
