"""Configs: one run's typed config, a sweep file, YAML loading, `--set` overrides and grid expansion.

YAML stops here. Everything past this module receives validated pydantic objects
(`RunConfig` and its sections), never dicts:

- Every section forbids unknown keys and validates strictly (no "32" -> 32, no true -> 1).
- Every error is a `ConfigError` whose message names the key path (`base.optim.lr: must be > 0`)
  and, for a typo, the closest valid key. The CLI prints it and exits 2.
- YAML is read with a safe loader that also rejects duplicate keys and reads `1e-3` as a float
  (YAML 1.2), as users expect.

A sweep expands to runs in a fixed order: the Cartesian product of the grid axes (in file order,
with `--set` axes replacing or appending), then seeds innermost.
"""

from __future__ import annotations

import difflib
import itertools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

Placement = Literal["post", "pre", "sandwich", "peri", "deepnorm", "mixln", "none"]
NormKind = Literal[
    "layernorm", "rmsnorm", "rmsnorm_torch", "rmsnorm_llama", "rmsnorm_gemma", "prmsnorm", "scalenorm"
]
Init = Literal["xavier_uniform", "xavier_normal", "torch_default"]
OptimName = Literal["adam", "adamw", "sgd", "radam"]
ScheduleKind = Literal["constant", "linear_warmup", "inverse_sqrt", "cosine"]
Metric = Literal["loss", "acc", "grad_norm", "lr"]

PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Fraction = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]

DEFAULT_REPORT_STEPS = (0, 1, 2, 3, 5, 10, 20, 30)
DEFAULT_MAX_RUNS = 100_000
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$"


class ConfigError(ValueError):
    """A bad config or command-line value. The message names the offending key path."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ModelConfig(_Section):
    depth: int = Field(32, ge=1, le=10_000)
    width: int = Field(32, ge=1, le=65_536)
    hidden_mult: int = Field(4, ge=1, le=64)
    n_classes: int = Field(10, ge=2)
    final_norm: bool = True
    init: Init = "xavier_uniform"


class NormConfig(_Section):
    placement: Placement = "pre"
    kind: NormKind = "layernorm"
    eps: PositiveFloat = 1e-5
    peri_input_norm: bool = True
    mixln_fraction: Fraction = 0.25
    deepnorm_alpha: PositiveFloat | None = None  # None: (2N)^(1/4), DeepNet's encoder-only value
    deepnorm_beta: PositiveFloat | None = None  # None: (8N)^(-1/4)
    prms_fraction: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 0.0625


class DataConfig(_Section):
    task: Literal["random_labels"] = "random_labels"
    n_samples: int = Field(64, ge=1, le=10_000_000)


class OptimConfig(_Section):
    name: OptimName = "adam"
    lr: PositiveFloat = 0.01
    betas: Annotated[tuple[Fraction, Fraction], Field(strict=False)] = (0.9, 0.999)
    eps: PositiveFloat = 1e-8
    weight_decay: NonNegFloat | None = None  # None: the optimizer's own default (adamw 0.01, others 0)
    momentum: Fraction = 0.9  # sgd only

    @model_validator(mode="after")
    def _resolve_weight_decay(self) -> OptimConfig:
        if self.weight_decay is None:
            object.__setattr__(self, "weight_decay", 0.01 if self.name == "adamw" else 0.0)
        return self


class ScheduleConfig(_Section):
    kind: ScheduleKind = "constant"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: Fraction = 0.0  # cosine only

    @model_validator(mode="after")
    def _warmup_needs_a_schedule(self) -> ScheduleConfig:
        if self.kind == "constant" and self.warmup_steps > 0:
            raise ValueError(
                "warmup_steps has no effect with kind 'constant': "
                "use kind linear_warmup, inverse_sqrt or cosine"
            )
        return self


class TrainConfig(_Section):
    steps: int = Field(30, ge=0, le=10_000_000)
    threads: int | None = Field(None, ge=1, le=1024)  # torch intra-op threads; None: torch's default
    stop_on_nonfinite: bool = True
    log_blocks: bool = False  # write <run_id>/blocks.csv: per-block gradients, updates, activations
    log_every: int = Field(1, ge=1, le=10_000_000)  # blocks.csv keeps steps 0, k, 2k, ...

    @field_validator("log_every")
    @classmethod
    def _log_every_needs_log_blocks(cls, value: int, info: ValidationInfo) -> int:
        if value != 1 and not info.data.get("log_blocks"):
            raise ValueError(f"thins blocks.csv, so it needs log_blocks: true (got log_every {value} without it)")
        return value


class RunConfig(_Section):
    """One training run, fully resolved: enough to rerun it alone."""

    model: ModelConfig = ModelConfig()
    norm: NormConfig = NormConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    train: TrainConfig = TrainConfig()
    seed: int = Field(0, ge=0, le=2**63 - 1)


class ReportConfig(_Section):
    steps: list[Annotated[int, Field(ge=0)]] = list(DEFAULT_REPORT_STEPS)
    columns: list[str] | None = None  # dotted keys that make the table's columns; None: the grid keys
    metric: Metric = "loss"


class SweepFile(_Section):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    base: dict[str, Any] = Field(default_factory=dict)
    grid: dict[str, list[Any]] = Field(default_factory=dict)
    seeds: list[Annotated[int, Field(ge=0)]] | None = None
    report: ReportConfig = ReportConfig()


@dataclass(frozen=True)
class Sweep:
    """A validated sweep: its name, the grid (after `--set`), and the runs it expands to."""

    name: str
    base: RunConfig
    grid: dict[str, list[Any]]
    seeds: list[int]
    report: ReportConfig
    runs: list[RunConfig]

    @property
    def varying_keys(self) -> list[str]:
        """Grid keys with more than one value, then `seed` if several seeds."""
        keys = [k for k, values in self.grid.items() if len(values) > 1]
        return keys + (["seed"] if len(self.seeds) > 1 else [])

    def to_yaml(self) -> str:
        """The resolved sweep, as it ran: loadable again with `load_sweep`."""
        doc = {
            "name": self.name,
            "base": self.base.model_dump(mode="json", exclude={"seed"}),
            "grid": self.grid,
            "seeds": self.seeds,
            "report": self.report.model_dump(mode="json"),
        }
        return yaml.safe_dump(doc, sort_keys=False)


# ----------------------------------------------------------------------------- YAML


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys and reads YAML 1.2 floats such as `1e-3`."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    mapping: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in mapping
        except TypeError as exc:  # an unhashable key such as a list
            raise ConfigError(f"line {key_node.start_mark.line + 1}: a key must be a plain value") from exc
        if duplicate:
            raise ConfigError(f"{key}: duplicate key (line {key_node.start_mark.line + 1})")
        mapping[key] = loader.construct_object(value_node, deep=deep)
    return mapping


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str, source: str = "<string>") -> Any:
    """Parse YAML safely; every failure is a ConfigError naming the source and line."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - _StrictLoader derives from SafeLoader
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    except yaml.constructor.ConstructorError as exc:
        mark = exc.problem_mark
        where = f" (line {mark.line + 1})" if mark else ""
        raise ConfigError(f"{source}: unsupported or unsafe YAML: {exc.problem}{where}") from None
    except RecursionError:
        raise ConfigError(f"{source}: malformed YAML: nested too deeply") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{source}: malformed YAML: {where}{problem}") from None


def read_mapping(path: str | Path) -> dict:
    """Read a YAML file that must hold a mapping."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    data = parse_yaml(text, str(path))
    if data is None:
        raise ConfigError(f"{path}: the file is empty")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must be a mapping of keys to values, got {type(data).__name__}")
    return data


# ----------------------------------------------------------------------------- keys and errors


def _section_fields(model: type[BaseModel]) -> dict[str, type[BaseModel] | None]:
    out: dict[str, type[BaseModel] | None] = {}
    for name, field in model.model_fields.items():
        ann = field.annotation
        out[name] = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return out


def run_keys() -> list[str]:
    """Every dotted leaf key of a run config: `model.depth`, ..., `seed`."""
    keys = []
    for name, sub in _section_fields(RunConfig).items():
        keys += [f"{name}.{leaf}" for leaf in sub.model_fields] if sub else [name]
    return keys


def _closest(word: str, choices: Iterable[str]) -> str:
    match = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
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
        return "unknown key" + _closest(err["loc"][-1], _valid_keys_at(model, err["loc"]))
    if kind == "missing":
        return "required key is missing"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}, got {value!r}" + _closest(
            value, re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        )
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        return f"must be {bounds[kind]} {limit}, got {value!r}"
    if kind == "finite_number":
        return f"must be a finite number, got {value!r}"
    names = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
             "string_type": "a string", "list_type": "a list", "dict_type": "a mapping",
             "model_type": "a mapping", "tuple_type": "a list", "int_from_float": "an integer"}
    if kind in names:
        return f"must be {names[kind]}, got {value!r}"
    if kind == "string_pattern_mismatch":
        return f"must be letters, digits, '_', '.', '-' (start with a letter or digit), got {value!r}"
    if kind == "invalid_key":
        return "a key must be a string"
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    if kind in ("too_short", "too_long"):
        return err["msg"].replace("Tuple", "list").lower()
    return err["msg"]


def _format_errors(exc: ValidationError, model: type[BaseModel], prefix: str) -> ConfigError:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
        lines.append(f"{loc}: {_describe(err, model)}")
    return ConfigError("\n".join(lines))


def validate_run(data: dict, prefix: str = "") -> RunConfig:
    """Validate one run's config mapping, naming bad keys under `prefix` (e.g. 'base')."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: must be a mapping, got {type(data).__name__}")
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise _format_errors(exc, RunConfig, prefix) from None


def load_run_config(path: str | Path) -> RunConfig:
    """Load a single run's `config.yaml` (as written into a run folder)."""
    return validate_run(read_mapping(path))


# ----------------------------------------------------------------------------- overrides and grid


def _split_values(text: str) -> list[str]:
    """Split 'a,b,[1,2]' on top-level commas (brackets keep a list value together)."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char in "[{"
        depth -= char in "]}"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current]


def parse_set(option: str) -> tuple[str, list[Any]]:
    """Parse one `--set key=v1,v2` into a key and its values (each read as a YAML scalar)."""
    key, sep, raw = option.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {option}: expected KEY=VALUE[,VALUE...], e.g. optim.lr=0.01,0.001")
    if not raw.strip():
        raise ConfigError(f"--set {key}: no values given")
    values = [parse_yaml(part.strip(), f"--set {key}") for part in _split_values(raw)]
    return key, values


def _check_grid_key(key: str, where: str) -> None:
    if key in ("seed", "seeds"):
        raise ConfigError(f"{where}: seeds are set with the 'seeds' list (or --set seeds=0,1,2)")
    if key not in run_keys():
        raise ConfigError(f"{where}: unknown key{_closest(key, run_keys())}")


def _set_dotted(data: dict, key: str, value: Any) -> None:
    section, _, leaf = key.partition(".")
    if not leaf:
        data[section] = value
        return
    existing = data.get(section)
    data[section] = {**(existing if isinstance(existing, dict) else {}), leaf: value}


def _expand(sweep_file: SweepFile, base: RunConfig, seeds: list[int], max_runs: int) -> list[RunConfig]:
    total = math.prod(len(v) for v in sweep_file.grid.values()) * len(seeds)
    if total > max_runs:
        raise ConfigError(f"grid: expands to {total} runs, more than --max-runs {max_runs}")
    base_data = base.model_dump(mode="python", exclude={"seed"})
    runs: dict[RunConfig, None] = {}  # insertion-ordered set: a repeated grid value runs once
    keys = list(sweep_file.grid)
    for combo in itertools.product(*sweep_file.grid.values()):
        data = {section: dict(values) for section, values in base_data.items()}
        for key, value in zip(keys, combo):
            _set_dotted(data, key, value)
        for seed in seeds:
            try:
                runs.setdefault(RunConfig.model_validate({**data, "seed": seed}))
            except ValidationError as exc:
                raise _grid_error(exc, dict(zip(keys, combo))) from None
    return list(runs)


def _grid_error(exc: ValidationError, combo: dict[str, Any]) -> ConfigError:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"][:2])
        where = f"grid.{key}" if key in combo else f"base.{key}"
        lines.append(f"{where}: {_describe(err, RunConfig)}")
    return ConfigError("\n".join(dict.fromkeys(lines)))


def build_sweep(data: dict, overrides: Sequence[str] = (), max_runs: int = DEFAULT_MAX_RUNS) -> Sweep:
    """Validate a sweep mapping, apply `--set` overrides, and expand it into runs."""
    data = dict(data)
    grid = data.get("grid")
    grid = dict(grid) if isinstance(grid, dict) else grid
    for option in overrides:
        key, values = parse_set(option)
        if key == "seeds":
            data["seeds"] = values
            continue
        _check_grid_key(key, f"--set {key}")
        if isinstance(grid, dict):
            grid[key] = values
        elif grid is None:
            grid = {key: values}
    if grid is not None:
        data["grid"] = grid
    try:
        sweep_file = SweepFile.model_validate(data)
    except ValidationError as exc:
        raise _format_errors(exc, SweepFile, "") from None
    for key, values in sweep_file.grid.items():
        _check_grid_key(key, f"grid.{key}")
        if not values:
            raise ConfigError(f"grid.{key}: the list is empty, so the grid expands to no runs")
    if sweep_file.seeds is not None and not sweep_file.seeds:
        raise ConfigError("seeds: the list is empty, so the grid expands to no runs")
    if sweep_file.report.columns:
        for column in sweep_file.report.columns:
            if column not in run_keys():
                raise ConfigError(f"report.columns: unknown key '{column}'{_closest(column, run_keys())}")
    base = validate_run(sweep_file.base, "base")
    seeds = list(dict.fromkeys(sweep_file.seeds if sweep_file.seeds is not None else [base.seed]))
    runs = _expand(sweep_file, base, seeds, max_runs)
    return Sweep(sweep_file.name, base, sweep_file.grid, seeds, sweep_file.report, runs)


def load_sweep(path: str | Path, overrides: Sequence[str] = (), max_runs: int = DEFAULT_MAX_RUNS) -> Sweep:
    """Load, validate and expand a sweep file. Raises ConfigError with the key path on any problem."""
    return build_sweep(read_mapping(path), overrides, max_runs)


def flatten(cfg: RunConfig) -> dict[str, Any]:
    """A run config as one flat mapping of dotted keys (tuples become lists)."""
    flat = {}
    for section, values in cfg.model_dump(mode="json").items():
        if isinstance(values, dict):
            flat.update({f"{section}.{k}": v for k, v in values.items()})
        else:
            flat[section] = values
    return flat
