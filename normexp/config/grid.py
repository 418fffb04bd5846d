"""A sweep: the sweep file's schema, `--set` overrides, and grid expansion (the Cartesian product of the
grid axes in file order, `--set` axes replacing or appending, then the `sample:` section's points, seeds
innermost). A grid value may be `logspace(a, b, n)` or `linspace(a, b, n)` (config/sample.py)."""

from __future__ import annotations

import functools
import itertools
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError

from normexp.config.errors import (
    ConfigError,
    TooManyRuns,
    _brief,
    _closest,
    _describe,
    _error_lines,
    _errors,
    _key_path,
    _loc,
    _tuple_field_at,
)
from normexp.config.fields import _Section, _unsigned_zero
from normexp.config.loader import parse_yaml, read_mapping
from normexp.config.sample import check_sample, draw_points, expand_values, sample_axes
from normexp.config.schema import (
    ACTS_ONLY_UNDER_BY_SECTION,
    NAME_PATTERN,
    RESOLVED_PER_RUN,
    ReportConfig,
    RunConfig,
    flatten,
    inert_keys,
    run_keys,
    validate_run,
)

DEFAULT_MAX_RUNS = 100_000


class SweepFile(_Section):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    base: dict[str, Any] = Field(default_factory=dict)
    grid: dict[str, list[Any]] = Field(default_factory=dict)
    sample: dict[str, Any] | None = None  # checked by config/sample.py's check_sample
    seeds: list[Annotated[int, Field(ge=0, le=2**63 - 1)]] | None = None  # RunConfig.seed's bounds
    report: ReportConfig = ReportConfig()
    notes: str = ""  # free text about the sweep: kept in sweep.yaml, shown in the report's title area
    tags: list[str] = Field(default_factory=list)


@dataclass(frozen=True)
class Sweep:
    """A validated sweep: its name, the grid (after `--set`), and the runs it expands to."""

    name: str
    base: RunConfig
    grid: dict[str, list[Any]]
    seeds: list[int]
    report: ReportConfig
    runs: list[RunConfig]
    open_keys: tuple[str, ...] = ()  # keys of RESOLVED_PER_RUN that the base leaves to each run
    notes: str = ""  # the sweep file's notes and tags: about the sweep, never part of a run (or its id)
    tags: tuple[str, ...] = ()
    sample: dict[str, Any] | None = None  # the sample: section as it ran, its drawn `points` included

    @property
    def sampled_keys(self) -> list[str]:
        return list(sample_axes(self.sample)) if self.sample else []

    def base_mapping(self, mode: Literal["python", "json"] = "python") -> dict[str, Any]:
        """The base as a mapping of sections, its open keys put back to None (resolved per run)."""
        return _open_mapping(self.base, self.open_keys, mode)

    @functools.cached_property
    def flat_runs(self) -> list[dict[str, Any]]:
        """Each run's config as `flatten` writes it (computed once: a 10,000-run grid's take a second)."""
        return [flatten(cfg) for cfg in self.runs]

    @property
    def varying_keys(self) -> list[str]:
        """Grid keys whose runs take more than one value (`1` and `1.0` are one value, null is a value of
        its own), then `seed` if several seeds."""
        flat = self.flat_runs
        keys = [k for k in [*self.grid, *self.sampled_keys] if len({json.dumps(f[k]) for f in flat}) > 1]
        return keys + (["seed"] if len(self.seeds) > 1 else [])

    def to_yaml(self) -> str:
        """The resolved sweep, as it ran: loadable again with `load_sweep`."""
        doc = {
            "name": self.name,
            "base": self.base_mapping("json"),
            "grid": self.grid,
            **({"sample": self.sample} if self.sample else {}),
            "seeds": self.seeds,
            "report": self.report.model_dump(mode="json"),
            **({"notes": self.notes} if self.notes else {}),
            **({"tags": list(self.tags)} if self.tags else {}),
        }
        return yaml.safe_dump(doc, sort_keys=False)


def _split_values(text: str) -> list[str]:
    """Split 'a,b,[1,2]' on top-level commas (brackets keep a list value together)."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char in "[{("
        depth -= char in "]})"
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
    values = expand_values(values, f"--set {key}")
    if len(values) > 1 and _tuple_field_at(RunConfig, key.split(".")) and not any(isinstance(v, list) for v in values):
        raise ConfigError(f"--set {key}={raw}: each value of {key} is a list, written in brackets (commas "
                          f"outside brackets separate the grid's values): {key}=[{raw}]")
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


def _open_keys(base: dict[str, Any]) -> tuple[str, ...]:
    """The keys of RESOLVED_PER_RUN that a base mapping leaves unset (or sets to null)."""
    def given(key: str) -> Any:
        section, _, leaf = key.partition(".")
        values = base.get(section)
        return values.get(leaf) if isinstance(values, dict) else None

    return tuple(key for key in RESOLVED_PER_RUN if given(key) is None)


def _open_mapping(cfg: RunConfig, open_keys: Sequence[str], mode: Literal["python", "json"]) -> dict[str, Any]:
    """`cfg` as a mapping of sections without the seed, with each of `open_keys` set to None."""
    data = cfg.model_dump(mode=mode, exclude={"seed"})
    for key in open_keys:
        section, _, leaf = key.partition(".")
        data[section] = {**data[section], leaf: None}
    return data


def _expand(sweep_file: SweepFile, base: RunConfig, seeds: list[int], max_runs: int,
            points: Sequence[dict[str, Any]] = ({},)) -> list[RunConfig]:
    """Each grid combination, then each sampled point (`points`), written into the base, then resolved
    alone (defaults that depend on other keys, such as AdamW's weight decay, resolve with that run's own
    values; keys the run does not use go back to their defaults). Runs that resolve alike are one run;
    `max_runs` bounds the distinct runs, counted as they come so that an absurd grid is refused without
    expanding it all."""
    total = math.prod(len(v) for v in sweep_file.grid.values()) * len(points) * len(seeds)
    base_data = _open_mapping(base, _open_keys(sweep_file.base), "python")
    runs: dict[RunConfig, None] = {}  # insertion-ordered set: a repeated grid value runs once
    keys, resolved = list(sweep_file.grid), 0
    fresh = _first_draws(points)  # a point drawn again adds no run: the work is bounded by the distinct points
    for combo in itertools.product(*sweep_file.grid.values()):
        for point, new in zip(points, fresh):
            if not new:  # its runs are in `runs` already
                resolved += len(seeds)
                continue
            data = {section: dict(values) for section, values in base_data.items()}
            for key, value in [*zip(keys, combo), *point.items()]:
                _set_dotted(data, key, value)
            try:  # once per grid point: no check reads the seed, and the seeds were checked with the file
                first = RunConfig.model_validate({**data, "seed": seeds[0]})
            except ValidationError as exc:
                error = _grid_error(exc, {**dict(zip(keys, combo)), **point}, {**data, "seed": seeds[0]}, base_data)
                raise _sampled_named(error, point) from None
            for seed in seeds:
                runs.setdefault(first if seed == seeds[0] else first.model_copy(update={"seed": seed}))
                resolved += 1
                if len(runs) > max_runs:
                    raise TooManyRuns(total, max_runs, distinct=len(runs) == resolved)
    return list(runs)


def _first_draws(points: Sequence[dict[str, Any]]) -> list[bool]:
    """Per point, whether it is the first draw of its values (a `choice` axis of 2 values drawn 100,000
    times has 2 first draws)."""
    seen: set[str] = set()
    first = []
    for point in points:
        key = json.dumps(point, sort_keys=True, default=repr)
        first.append(key not in seen)
        seen.add(key)
    return first


def _sampled_named(error: ConfigError, point: dict[str, Any]) -> ConfigError:
    """`error` with the sampled keys named as `sample.KEY`, not `grid.KEY`."""
    text = str(error)
    for key in point:
        text = text.replace(f"grid.{key}", f"sample.{key}")
    return ConfigError(text)


def _sample_points(section: Any, grid: dict[str, list[Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The `sample:` section as it runs (its drawn `points` recorded) and its points; ConfigError naming
    the key path for a bad section, an unknown key, or a key both sampled and in the grid."""
    n, seed, method, axes = check_sample(section)
    for key in axes:
        _check_grid_key(key, f"sample.{key}")
        if key in grid:
            raise ConfigError(f"sample.{key}: also a grid axis (grid.{key} or --set {key}); a key is either "
                              "sampled or listed, not both")
    points = section.get("points")
    if points is None:
        points = draw_points(n, seed, method, axes)
    elif not all(isinstance(p, dict) and list(p) == list(axes) for p in points):
        raise ConfigError(f"sample.points: each point must be a mapping of exactly the sampled keys "
                          f"({', '.join(axes)}), in that order")
    recorded = {"n": n, "seed": seed, "method": method, **{k: {kind: args} for k, (kind, args) in axes.items()},
                "points": [dict(p) for p in points]}
    return recorded, list(points)


def _grid_error(exc: ValidationError, combo: dict[str, Any], point: dict, base_data: dict) -> ConfigError:
    lines = []
    for err in _errors(exc, RunConfig):
        loc, why = _loc(err), _describe(err, RunConfig)
        culprits = [] if _blame(loc, combo).startswith("grid.") else _culprits(combo, point, base_data)
        if culprits:
            values = ", ".join(f"grid.{key} = {_brief(combo[key])}" for key in culprits)
            lines.append(f"{values} makes {_key_path('base', loc)} invalid: {why}")
        else:
            lines.append(f"{_blame(loc, combo)}: {why}")
    return _error_lines(lines)


def _culprits(combo: dict[str, Any], point: dict, base_data: dict) -> list[str]:
    """The grid keys of `combo` whose value, put back to the base's, makes the grid point valid: the
    grid values that broke a check across keys blamed on a key the grid does not set."""
    culprits = []
    for key in combo:
        reverted = {section: dict(values) if isinstance(values, dict) else values for section, values in point.items()}
        section, _, leaf = key.partition(".")
        _set_dotted(reverted, key, base_data[section][leaf] if leaf else base_data[section])
        try:
            RunConfig.model_validate(reverted)
        except ValidationError:
            continue
        culprits.append(key)
    return culprits


def _blame(loc: Sequence[Any], combo: dict[str, Any]) -> str:
    """Where an error in one grid point comes from: the grid keys it involves (a check over a whole
    section, such as warmup_steps with kind constant, involves each of the section's grid keys), else base."""
    key = ".".join(str(p) for p in loc[:2])
    if key in combo:
        return f"grid.{key}"
    if len(loc) == 1:
        involved = [f"grid.{k}" for k in combo if k.startswith(f"{loc[0]}.")]
        if involved:
            return ", ".join(involved)
    return _key_path("base", loc)


def _sweep_file_problem(err: dict) -> str:
    """What is wrong at one place of a sweep file, with a hint for the shape mistakes YAML invites: a
    run's section at the top (`model:` belongs under `base:`), one value where a list is expected."""
    loc, value = err["loc"], err.get("input")
    if err["type"] == "extra_forbidden" and len(loc) == 1 and loc[0] in RunConfig.model_fields:
        return f"unknown key (did you mean 'base.{loc[0]}'? a run's settings go under base:)"
    if err["type"] == "list_type" and loc[0] == "grid" and len(loc) == 2:
        return (f"must be a list of the axis's values, e.g. [{_brief(value)}], got {_brief(value)} "
                "(a value every run shares goes under base:)")
    if err["type"] == "list_type" and tuple(loc) == ("seeds",):
        return f"must be a list of seeds, e.g. [{_brief(value)}], got {_brief(value)}"
    return _describe(err, SweepFile)


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
    if isinstance(grid, dict):
        grid = {key: expand_values(values, f"grid.{key}") for key, values in grid.items()}
    if grid is not None:
        data["grid"] = grid
    try:
        sweep_file = SweepFile.model_validate(data)
    except ValidationError as exc:
        raise _error_lines([f"{_key_path('', _loc(err))}: {_sweep_file_problem(err)}"
                            for err in _errors(exc, SweepFile)]) from None
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
    base = validate_run(sweep_file.base, "base", keep_inert=True)
    seeds = list(dict.fromkeys(sweep_file.seeds if sweep_file.seeds is not None else [base.seed]))
    sample, points = _sample_points(sweep_file.sample, sweep_file.grid) if sweep_file.sample is not None \
        else (None, [{}])
    runs = _expand(sweep_file, base, seeds, max_runs, points)
    _refuse_unused_keys(base, sweep_file.grid, runs, {key: [p[key] for p in points] for key in sample_axes(sample)}
                        if sample else None)
    open_keys = _open_keys(sweep_file.base)
    return Sweep(sweep_file.name, base, sweep_file.grid, seeds, sweep_file.report, runs, open_keys,
                 sweep_file.notes, tuple(sweep_file.tags), sample)


def _refuse_unused_keys(base: RunConfig, grid: dict[str, list[Any]], runs: Sequence[RunConfig],
                        sampled: dict[str, list[Any]] | None = None) -> None:
    """A key of ACTS_ONLY_UNDER_BY_SECTION set away from its default where no run of the sweep uses it
    is a mistake (it would change nothing): refused, naming where it was set (a grid axis, a sampled
    axis with the values it drew, or the base)."""
    axes = {**{key: ("grid", values) for key, values in grid.items()},
            **{key: ("sample", values) for key, values in (sampled or {}).items()}}

    def set_in(dotted: str, default: Any, in_base: Any) -> list[str]:
        where, values = axes.get(dotted, ("", []))
        found = [f"{where}.{dotted}"] if any(not _same_value(v, default) for v in values) else []
        if dotted not in axes and not _same_value(in_base, default):
            found.append(f"base.{dotted}")
        return found

    for section, table in ACTS_ONLY_UNDER_BY_SECTION.items():
        for key, (decider, where) in table.items():
            default = _unsigned_zero(type(getattr(base, section)).model_fields[key].default)
            found = set_in(f"{section}.{key}", default, getattr(getattr(base, section), key))
            if found and all(key in inert_keys(getattr(run, section)) for run in runs):
                raise ConfigError(f"{found[0]}: has no effect: only {section}.{decider} "
                                  f"{' or '.join(sorted(where))} uses it, and no run of this sweep has that {decider}")
    for key in ("qk_norm_scope", "qk_norm_eps"):
        found = set_in(f"model.{key}", type(base.model).model_fields[key].default, getattr(base.model, key))
        if found and not any(run.model.qk_norm for run in runs):  # each run resets it: one run without qk-norm
            raise ConfigError(f"{found[0]}: has no effect: only model.qk_norm true uses it, and no run of this "
                              "sweep has qk-norm (set model.qk_norm: true)")


def _same_value(value: Any, default: Any) -> bool:
    """A grid or base value equal to a key's default, a YAML list matching a default tuple."""
    return _unsigned_zero(tuple(value) if isinstance(value, list) else value) == default


def load_sweep(path: str | Path, overrides: Sequence[str] = (), max_runs: int = DEFAULT_MAX_RUNS) -> Sweep:
    """Load, validate and expand a sweep file, or a run folder's `config.yaml` (a sweep of that one run,
    named after its folder). Raises ConfigError with the key path on any problem."""
    data = read_mapping(path)
    if "name" not in data and set(data) <= set(RunConfig.model_fields):
        folder = Path(path).resolve().parent.name
        data = {"name": folder if re.fullmatch(NAME_PATTERN, folder) else "run", "base": data}
    return build_sweep(data, overrides, max_runs)


