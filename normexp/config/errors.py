"""Config errors: `ConfigError` and the messages that name a key path (`base.optim.lr: must be > 0`),
with the closest valid key for a typo."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, get_args, get_origin

from pydantic import BaseModel, ValidationError


class ConfigError(ValueError):
    """A bad config or command-line value. The message names the offending key path."""


class TooManyRuns(ConfigError):
    """The grid expands to more runs than the limit (`normexp sweep --max-runs` sets it)."""

    def __init__(self, total: int, limit: int, option: str = "the limit of", distinct: bool = True) -> None:
        super().__init__(f"grid: expands to {total} runs, more than {option} {limit}" if distinct else
                         f"grid: expands to more than {option} {limit} distinct runs ({total} combinations)")
        self.total, self.limit, self.distinct = total, limit, distinct


def _section_fields(model: type[BaseModel]) -> dict[str, type[BaseModel] | None]:
    out: dict[str, type[BaseModel] | None] = {}
    for name, field in model.model_fields.items():
        ann = field.annotation
        out[name] = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return out


# The names other tools taught ML users, and normexp's key for each (the "did you mean" hint names it
# before any spelling match: `learning_rate` is nearer `optim.name` in letters than `optim.lr`). A name
# may be dotted (`norm.type`) or a bare word, which matches in any section (`optim.learning_rate`).
ALIASES = {
    "learning_rate": "optim.lr", "lr": "optim.lr",
    "warmup": "schedule.warmup_steps", "warmup_steps": "schedule.warmup_steps",
    "warmup_iters": "schedule.warmup_steps", "scheduler": "schedule.kind", "lr_schedule": "schedule.kind",
    "norm.type": "norm.kind", "norm_type": "norm.kind", "normalization": "norm.kind",
    "norm.position": "norm.placement", "norm_position": "norm.placement", "norm_placement": "norm.placement",
    "batch_size": "data.batch_size", "bs": "data.batch_size",
    "seed": "seeds", "random_seed": "seeds",
    "weight_decay": "optim.weight_decay", "wd": "optim.weight_decay",
    "grad_clip": "optim.clip_norm", "clip_grad_norm": "optim.clip_norm", "max_grad_norm": "optim.clip_norm",
    "n_layers": "model.depth", "num_layers": "model.depth", "layers": "model.depth",
    "d_model": "model.width", "hidden_size": "model.width", "num_heads": "model.n_heads",
    "max_steps": "train.steps", "steps": "train.steps", "iterations": "train.steps",
}


def _alias(word: str, section: str = "") -> str | None:
    """normexp's key for a name from another tool (ALIASES), written as it would be at `section`
    (`optim.learning_rate` -> `lr` inside `optim`, `optim.lr` elsewhere); None if it is no such name."""
    full = f"{section}.{word}" if section else word
    for name in (full, word, word.rpartition(".")[2]):
        target = ALIASES.get(name)
        if target is not None and target != full:
            return target.removeprefix(f"{section}.") if section else target
    return None


def _closest(word: str, choices: Iterable[str], section: str = "") -> str:
    """The hint for an unknown `word` (at `section`, dotted, for a nested key): the key a name from
    another tool means, else the nearest valid one in spelling, else nothing."""
    match = [_alias(str(word), section)] if _alias(str(word), section) else difflib.get_close_matches(
        str(word), list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _valid_keys_at(model: type[BaseModel], loc: Sequence[Any]) -> list[str]:
    """The field names valid at `loc` inside `model` (for the 'did you mean' hint)."""
    for part in loc[:-1]:
        sub = _section_fields(model).get(str(part)) if isinstance(part, str) else None
        if sub is None:
            return []
        model = sub
    return list(model.model_fields)


def _describe(err: dict, model: type[BaseModel]) -> str:
    kind, ctx, value = err["type"], err.get("ctx", {}), err.get("input")
    if kind == "extra_forbidden":
        section = ".".join(str(part) for part in err["loc"][:-1] if isinstance(part, str))
        return "unknown key" + _closest(err["loc"][-1], _valid_keys_at(model, err["loc"]), section)
    if kind == "missing":
        return "required key is missing"
    if kind == "literal_error":
        own = (", or package.module:Attribute of your own (docs/extending.md)"
               if tuple(map(str, err["loc"][-2:])) in (("norm", "placement"), ("norm", "kind")) else "")
        return f"must be one of {ctx.get('expected')}{own}, got {_brief(value)}" + _closest(
            value, re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        )
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        return f"must be {bounds[kind]} {limit}, got {_brief(value)}"
    if kind == "finite_number":
        return f"must be a finite number, got {_brief(value)}"
    names = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
             "string_type": "a string", "list_type": "a list", "dict_type": "a mapping",
             "model_type": "a mapping", "tuple_type": "a list", "int_from_float": "an integer"}
    if kind in names:
        return f"must be {names[kind]}, got {_brief(value)}"
    if kind == "string_pattern_mismatch":
        return f"must be letters, digits, '_', '.', '-' (start with a letter or digit), got {_brief(value)}"
    if kind == "invalid_key":
        return "a key must be a string"
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    if kind == "cross_key":
        return ctx["why"]
    if kind in ("too_short", "too_long"):
        return err["msg"].replace("Tuple", "list").lower()
    return err["msg"]


MAX_ERROR_LINES = 8


def _format_errors(exc: ValidationError, model: type[BaseModel], prefix: str) -> ConfigError:
    lines = [f"{_key_path(prefix, _loc(err))}: {_describe(err, model)}" for err in _errors(exc, model)]
    return _error_lines(lines)


TUPLE_SHAPE_ERRORS = ("missing", "too_short", "too_long", "tuple_type")
ITEM_NOUNS = {float: "numbers", int: "integers", str: "strings", bool: "true or false values"}
COUNT_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}


def _errors(exc: ValidationError, model: type[BaseModel]) -> list[dict]:
    """pydantic's errors, each one about the shape of a fixed-length list put as what that key must be.
    pydantic reports `betas: [0.9]` as item 1 "missing" and `[0.9, 0.9, 0.9]` in its own words about
    tuples; the user wrote a list of the wrong length, at the key `betas`."""
    return [_tuple_shape_error(err, model) or err for err in exc.errors()]


def _tuple_shape_error(err: dict, model: type[BaseModel]) -> dict | None:
    """`err` as one error at the tuple field it concerns, if it is about that field's shape; else None."""
    if err["type"] not in TUPLE_SHAPE_ERRORS:
        return None
    found = _tuple_field_at(model, err["loc"])
    if found is None:
        return None
    depth, field = found
    if len(err["loc"]) != depth + (err["type"] == "missing"):  # "missing" is about an item of the list
        return None
    items = get_args(field.annotation)
    kinds = {get_args(item)[0] if get_origin(item) is Annotated else item for item in items}
    noun = ITEM_NOUNS.get(next(iter(kinds)), "values") if len(kinds) == 1 else "values"
    why = (f"must be a list of {COUNT_WORDS.get(len(items), len(items))} {noun}, "
           f"e.g. {_brief(list(field.default))}, got {_brief(err['input'])}")
    return {"type": "tuple_shape", "loc": tuple(err["loc"][:depth]), "msg": why, "input": err["input"]}


def _tuple_field_at(model: type[BaseModel], loc: Sequence[Any]) -> tuple[int, Any] | None:
    """(how many parts of `loc` name it, its FieldInfo) for the fixed-length tuple field that `loc`
    leads to (through nested sections), else None."""
    for depth, part in enumerate(loc, 1):
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        if get_origin(field.annotation) is tuple and Ellipsis not in get_args(field.annotation):
            return depth, field
        if not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return None
        model = field.annotation
    return None


def _loc(err: dict) -> tuple[Any, ...]:
    """Where an error lies: pydantic's location, or for a check across keys the key it blames
    (a check on `model` that blames `model.n_heads` lies at ('model', 'n_heads'))."""
    if err["type"] != "cross_key":
        return tuple(err["loc"])
    key = tuple(err["ctx"]["key"].split("."))
    loc = tuple(err["loc"])
    return loc + key[len(loc):] if key[:len(loc)] == loc else key


def _key_path(prefix: str, loc: Sequence[Any]) -> str:
    """`base.optim.lr`, `seeds.2` for a list item, `base.model.1` for a bad key 1: the parts joined
    by dots, never an empty part (pydantic's `[key]` marker for a bad key is dropped)."""
    parts = [str(part) for part in (prefix, *loc) if part not in ("", "[key]")]
    return ".".join(parts) or "config"


def _error_lines(lines: Sequence[str]) -> ConfigError:
    """One ConfigError of at most MAX_ERROR_LINES lines (each already brief), repeated lines once."""
    lines = list(dict.fromkeys(lines))
    if len(lines) > MAX_ERROR_LINES:
        lines = [*lines[: MAX_ERROR_LINES - 1], f"... and {len(lines) - MAX_ERROR_LINES + 1} more errors"]
    return ConfigError("\n".join(lines))


def _brief(value: Any, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters: an error names a value, it never echoes the input."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
