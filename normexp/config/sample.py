"""Value ranges and sampled search: `logspace(a, b, n)` / `linspace(a, b, n)` written as a grid value (or
in `--set`), and a sweep file's `sample:` section, which draws `n` points of continuous (or categorical)
axes, seeded, so that the same file always gives the same runs.

    grid:
      optim.lr: logspace(1e-4, 1e-1, 7)      # 1e-4 ... 1e-1, 7 values evenly spaced in log10
      optim.warmup_steps: linspace(0, 100, 5)  # 0, 25, 50, 75, 100 (ints: both ends are ints)
    sample:
      n: 32
      seed: 0
      method: sobol                      # or random (the default)
      optim.lr: {loguniform: [1e-4, 1e-1]}
      optim.beta2: {uniform: [0.9, 0.999]}
      norm.placement: {choice: [pre, post]}

A range may stand among listed values, also in YAML's flow list (`[0, linspace(10, 100, 4)]`, which YAML
cuts at the range's commas: joined again here).

`logspace` takes the two end VALUES (numpy's `geomspace`), not exponents as `numpy.logspace` does.
Values are rounded to 12 significant digits (so `logspace(1e-4, 1e-1, 4)` is 1e-4, 1e-3, 1e-2, 1e-1, not
0.0010000000000000002); the ends are exactly a and b. Between two integers, either gives integers where
every value is one (`logspace(2, 64, 6)`: depths 2, 4, 8, 16, 32, 64). A sampled value is rounded to 6
significant digits (readable in tables and run ids; two points closer than that would be one run). An axis
whose bounds are both integers (`uniform: [0, 100]`) samples integers, each equally likely.

`random` draws with Python's `random.Random(seed)` (its stream is fixed across Python versions); `sobol`
with scipy's scrambled Sobol sequence (`scipy.stats.qmc.Sobol(d, scramble=True, seed=seed)`, the extra
`normexp[sobol]`): n a power of 2 keeps its balance properties. Either way, sweep.yaml records the drawn
points (`sample.points`), so that a folder reads back the runs it holds even where another scipy would
draw others; a `sample:` section that lists `points:` itself uses them as they are.
"""

from __future__ import annotations

import math
import random
import re
from typing import Any

from normexp.config.errors import ConfigError, _brief

RANGE = re.compile(r"\s*(?P<fn>logspace|linspace)\s*\((?P<args>[^()]*)\)\s*")
DISTRIBUTIONS = ("loguniform", "uniform", "choice")
METHODS = ("random", "sobol")
SAMPLE_OPTIONS = ("n", "seed", "method", "points", "axes")
MAX_SAMPLES = 1_000_000  # a range's n
# A sample's n (or its listed points): at most the default run limit (grid.DEFAULT_MAX_RUNS). More points
# make more runs than the limit allows, or repeat runs already drawn: refused before any is drawn.
MAX_POINTS = 100_000


def _number(text: str, where: str) -> int | float:
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{where}: {text!r} is not a number") from None
    if not math.isfinite(value):
        raise ConfigError(f"{where}: {text!r} is not a finite number")
    return value


def _round(value: float, digits: int) -> float:
    return float(f"{value:.{digits}g}")


def is_range(value: Any) -> bool:
    """Whether `value` is a `logspace(...)` or `linspace(...)` string."""
    return isinstance(value, str) and RANGE.fullmatch(value) is not None


def expand_range(text: str, where: str) -> list[int | float]:
    """The values of `logspace(a, b, n)` or `linspace(a, b, n)`; ConfigError naming `where` if malformed."""
    match = RANGE.fullmatch(text)
    if match is None:
        raise ConfigError(f"{where}: {_brief(text)} is not logspace(a, b, n) or linspace(a, b, n)")
    fn, args = match["fn"], [a for a in match["args"].split(",")]
    usage = f"{where}: {fn}(a, b, n) takes three numbers, the ends a and b and the count n"
    if len(args) != 3 or not all(a.strip() for a in args):
        raise ConfigError(f"{usage}, got {fn}({match['args'].strip()})")
    a, b = _number(args[0], f"{where}: {fn}'s a"), _number(args[1], f"{where}: {fn}'s b")
    n = _number(args[2], f"{where}: {fn}'s n")
    if not isinstance(n, int) or n < 2:
        raise ConfigError(f"{where}: {fn}'s n must be an integer >= 2, got {args[2].strip()}")
    if n > MAX_SAMPLES:
        raise ConfigError(f"{where}: {fn}'s n must be <= {MAX_SAMPLES}, got {n}")
    if fn == "logspace":
        if a <= 0 or b <= 0:
            raise ConfigError(f"{where}: logspace's ends must be > 0 (they are values, not exponents), "
                              f"got {args[0].strip()}, {args[1].strip()}")
        la, lb = math.log10(a), math.log10(b)
        values: list[int | float] = [_round(10 ** (la + (lb - la) * i / (n - 1)), 12) for i in range(n)]
    elif math.isfinite(float(b) - float(a)):
        values = [_round(a + (b - a) * i / (n - 1), 12) for i in range(n)]
    else:  # b - a overflows (linspace(1e308, -1e308, 3)): weigh the ends, each term finite
        values = [_round(a * ((n - 1 - i) / (n - 1)) + b * (i / (n - 1)), 12) for i in range(n)]
    if isinstance(a, int) and isinstance(b, int) and all(float(v).is_integer() for v in values):
        values = [int(v) for v in values]  # logspace(2, 64, 6): depths 2, 4, ..., 64, not 4.0
    values[0], values[-1] = a, b
    return values


def expand_values(values: Any, where: str) -> Any:
    """A grid axis with its ranges expanded: `logspace(...)` alone, or as items of a list (spliced in)."""
    if is_range(values):
        return expand_range(values, where)
    if isinstance(values, list):
        values = _rejoined(values, where)
    if isinstance(values, list) and any(is_range(v) for v in values):
        return [x for v in values for x in (expand_range(v, where) if is_range(v) else [v])]
    return values


OPENED = re.compile(r"\s*(?:logspace|linspace)\s*\([^()]*")  # a range cut at its first comma


def _rejoined(values: list[Any], where: str) -> list[Any]:
    """`values` with each range that YAML's flow list cut at its commas joined again: `[0, linspace(10,
    100, 4)]` reads as [0, 'linspace(10', 100, '4)'] (a plain scalar in brackets ends at a comma)."""
    joined: list[Any] = []
    pieces: list[str] | None = None
    for value in values:
        if pieces is None:
            if isinstance(value, str) and OPENED.fullmatch(value):
                pieces = [value]
            else:
                joined.append(value)
            continue
        pieces.append(value if isinstance(value, str) else str(value))
        if ")" in pieces[-1]:
            joined.append(",".join(pieces))
            pieces = None
    if pieces is not None:
        raise ConfigError(f"{where}: {_brief(', '.join(pieces))} is not logspace(a, b, n) or linspace(a, b, n): "
                          "no closing parenthesis")
    return joined


# ----------------------------------------------------------------------------- the sample: section


def sample_axes(section: dict[str, Any]) -> dict[str, Any]:
    """The axes of a `sample:` section: its dotted keys (or those under `axes:`), in file order."""
    axes = dict(section.get("axes") or {}) if isinstance(section.get("axes"), dict) else {}
    return {**{k: v for k, v in section.items() if k not in SAMPLE_OPTIONS}, **axes}


def check_sample(section: Any) -> tuple[int, int, str, dict[str, tuple[str, list[Any]]]]:
    """Validate a `sample:` section: (n, seed, method, {key: (distribution, arguments)}). ConfigError
    naming the key path (`sample.optim.lr: ...`) otherwise. Keys are checked against the run's keys by
    the caller."""
    if not isinstance(section, dict):
        raise ConfigError(f"sample: must be a mapping (n, seed, method and the axes), got {_brief(section)}")
    if "axes" in section and not isinstance(section["axes"], dict):
        raise ConfigError(f"sample.axes: must be a mapping of keys to distributions, got {_brief(section['axes'])}")
    n, seed, method = section.get("n"), section.get("seed", 0), section.get("method", "random")
    points = section.get("points")
    if points is not None and (not isinstance(points, list) or not points or len(points) > MAX_POINTS):
        raise ConfigError(f"sample.points: must be a list of 1 to {MAX_POINTS} points (each a mapping of the "
                          f"sampled keys), got {_brief(points) if not isinstance(points, list) else len(points)}")
    if points is not None and n is not None and n != len(points):
        raise ConfigError(f"sample.n: {_brief(n)}, but sample.points lists {len(points)} points; give one of them "
                          "(or both, equal)")
    if points is None:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_POINTS:
            raise ConfigError(f"sample.n: must be an integer from 1 to {MAX_POINTS} (the points drawn; the run "
                              f"limit), got {_brief(n)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ConfigError(f"sample.seed: must be an integer from 0 to 2**32 - 1, got {_brief(seed)}")
    if method not in METHODS:
        raise ConfigError(f"sample.method: must be one of {', '.join(METHODS)}, got {_brief(method)}")
    axes = {}
    for key, spec in sample_axes(section).items():
        where = f"sample.{key}"
        if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in DISTRIBUTIONS:
            raise ConfigError(f"{where}: must be one of {{loguniform: [lo, hi]}}, {{uniform: [lo, hi]}} or "
                              f"{{choice: [v1, v2, ...]}}, got {_brief(spec)}")
        (kind, args), = spec.items()
        if not isinstance(args, list) or not args:
            raise ConfigError(f"{where}.{kind}: must be a non-empty list, got {_brief(args)}")
        if kind != "choice":
            if len(args) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                         and math.isfinite(v) for v in args):
                raise ConfigError(f"{where}.{kind}: must be two finite numbers [lo, hi], got {_brief(args)}")
            if not args[0] < args[1]:
                raise ConfigError(f"{where}.{kind}: lo must be < hi, got {_brief(args)}")
            if kind == "loguniform" and args[0] <= 0:
                raise ConfigError(f"{where}.loguniform: lo must be > 0, got {_brief(args[0])}")
        axes[key] = (kind, list(args))
    if not axes:
        raise ConfigError("sample: names no axis to sample (e.g. optim.lr: {loguniform: [1e-4, 1e-1]})")
    return (len(points) if isinstance(points, list) else n), seed, method, axes


def draw_points(n: int, seed: int, method: str, axes: dict[str, tuple[str, list[Any]]]) -> list[dict[str, Any]]:
    """`n` points of the sample's axes, each a {key: value} mapping, seeded (see the module docstring)."""
    unit = _unit_points(n, len(axes), seed, method)
    return [{key: _value(kind, args, u) for (key, (kind, args)), u in zip(axes.items(), row)} for row in unit]


def _unit_points(n: int, d: int, seed: int, method: str) -> list[list[float]]:
    """n points of the unit cube [0, 1)^d."""
    if method == "random":
        rng = random.Random(seed)
        return [[rng.random() for _ in range(d)] for _ in range(n)]
    try:
        import warnings

        from scipy.stats import qmc
    except ImportError:
        raise ConfigError("sample.method: sobol needs scipy, which is not installed: "
                          "pip install 'normexp[sobol]' (or use method: random)") from None
    with warnings.catch_warnings():  # n not a power of 2: scipy warns that balance is lost (documented)
        warnings.simplefilter("ignore")
        sobol = qmc.Sobol(d, scramble=True, seed=seed)
        return [[float(u) for u in row] for row in sobol.random(n)]


def _value(kind: str, args: list[Any], u: float) -> Any:
    if kind == "choice":
        return args[min(int(u * len(args)), len(args) - 1)]
    lo, hi = args
    if kind == "uniform" and isinstance(lo, int) and isinstance(hi, int):
        return min(lo + int(u * (hi - lo + 1)), hi)
    if kind == "loguniform":
        value = math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))
        return int(round(value)) if isinstance(lo, int) and isinstance(hi, int) else _round(value, 6)
    return _round(lo + u * (hi - lo), 6)
