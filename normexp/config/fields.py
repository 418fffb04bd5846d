"""What every config section is made of: the strict, frozen section base (`_Section`), the number types its
keys take (`PositiveFloat`, `NonNegFloat`, `Fraction`, `Beta`), the error of a check across keys, and the
rule that puts a key its section leaves unused back to its default (`unused_keys`, `reset_unused_keys`).
The sections themselves are in `schema.py` (model, norm, data, train, `RunConfig`) and `optimizer.py`
(optim, schedule).
"""

from __future__ import annotations

import math
import struct
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, model_validator
from pydantic_core import PydanticCustomError

from normexp.config.errors import _brief

FLOAT32_TINIEST = 1.401298464324817e-45  # the smallest positive float32 (a subnormal, 2^-149)


def _not_0_in_float32(value: float) -> float:
    """Refuse a positive value that float32 rounds to 0: runs train in float32, where an eps, a learning
    rate or an init scale of 1e-50 is exactly 0 (a division by zero, a step that moves nothing), not the
    positive number the config shows. The value itself is kept as written (run ids are of it)."""
    try:
        in_float32 = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # beyond float32's largest: far from 0
        return value
    if in_float32 == 0:
        raise PydanticCustomError("zero_in_float32", "is 0 in float32 (training's precision; the smallest "
                                  "positive float32 is {tiniest}), got {value}",
                                  {"tiniest": f"{FLOAT32_TINIEST:.2g}", "value": _brief(value)})
    return value


# > 0, and > 0 in float32 too (a positive float is an eps, a learning rate or a scale in float32 training)
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False), AfterValidator(_not_0_in_float32)]
NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Fraction = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
Beta = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)]  # Adam's decay rates: 1 divides by 1 - 1

# A section's keys that act only under some values of another of its keys: key -> (the key that decides,
# the values under which it acts). Each section's table is in `schema.py` or `optimizer.py`.
ActsOnlyUnder = dict[str, tuple[str, frozenset[str]]]


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


def unused_keys(section: _Section, table: ActsOnlyUnder) -> list[str]:
    """The keys of `table` that the section's own deciding key (a placement, a kind, an optimizer's name)
    leaves unused."""
    return [key for key, (decider, where) in table.items() if getattr(section, decider) not in where]


def reset_unused_keys(section: _Section, table: ActsOnlyUnder, info: ValidationInfo) -> _Section:
    """Put each key that `section` leaves unused (`unused_keys`) back to its default, unless the context
    says `keep_inert` (a sweep's base, whose grid runs may use them): runs that train alike are one run."""
    if keeps_inert(info):
        return section
    for key in unused_keys(section, table):
        object.__setattr__(section, key, type(section).model_fields[key].default)
    return section


def keeps_inert(info: ValidationInfo) -> bool:
    """Whether this validation is of a sweep's base, which keeps the keys its own values leave unused."""
    return bool((info.context or {}).get("keep_inert"))


def cross_key_error(key: str, why: str) -> PydanticCustomError:
    """A check across keys, blamed on `key` (a dotted path): the error formatters put it in the path."""
    return PydanticCustomError("cross_key", "{key}: {why}", {"key": key, "why": why})
