"""What every config section shares: `Section`, strict and frozen, unknown keys refused, -0.0 read as 0.0;
and `cross_key_error`, a check across keys blamed on one key (the error formatters put it in the path).

The run's sections are in schema.py (model, norm, optim, schedule, train, the run) and data.py (data).
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    @model_validator(mode="after")
    def _unsigned_zeros(self) -> _Section:
        """-0.0 is 0.0 (weight_decay: -0.0 trains as 0.0): written as 0.0, so that both are one run id."""
        for name in type(self).model_fields:
            value = getattr(self, name)
            unsigned = _unsigned_zero(value)
            if unsigned is not value:
                object.__setattr__(self, name, unsigned)
        return self


def _unsigned_zero(value: Any) -> Any:
    """`value` with any float -0.0 in it (a tuple's items too) made 0.0; `value` itself if it has none."""
    if isinstance(value, float) and value == 0 and math.copysign(1.0, value) < 0:
        return 0.0
    if isinstance(value, tuple) and any(_unsigned_zero(v) is not v for v in value):
        return tuple(_unsigned_zero(v) for v in value)
    return value


def cross_key_error(key: str, why: str) -> PydanticCustomError:
    """A check across keys, blamed on `key` (a dotted path): the error formatters put it in the path."""
    return PydanticCustomError("cross_key", "{key}: {why}", {"key": key, "why": why})
