"""What mattered: an ANOVA of a grid's final metric on its axes, seeds as replicates (pure numpy/pandas).

The model holds every axis's main effect and every two-way interaction; three-way and higher
interactions are pooled with the seed noise into the residual. Sums of squares are type II: each term
is measured against the model of every term that does not contain it (statsmodels' `anova_lm(typ=2)`,
which tests/test_anova.py checks it against). On a balanced full factorial grid (every cell of the
axes' product holds the same number of finite runs) the terms are orthogonal, so type I, II and III
agree and the terms' sums of squares plus the residual add up to the total: `share` is then each
term's part of the variance. Elsewhere the decomposition is still exact for type II, but the shares
need not add up to 1, and `notes` says so, and which terms could not be estimated (empty cells, no
residual degrees of freedom).

`what_mattered` runs it on a sweep folder: the varying config keys but the seed (and `sweep`, for
folders compared side by side) as factors, each run's final value of the metric (`final_values`) as the
response. A sampled search is no factorial grid: it is refused, and so is a factor of more than
MAX_LEVELS values (its interactions would need more runs than any folder holds).

The F distribution's tail is computed here (the regularized incomplete beta function by its continued
fraction, Numerical Recipes 6.4), so that a plain install without scipy gives the same p values.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from normexp.results import Folder, ResultsError, as_folder, check_metric, varying_keys

COLUMNS = ("term", "df", "sum_sq", "mean_sq", "F", "p", "share")
RESIDUAL = "Residual"
MAX_DESIGN_COST = 2e10  # cells x model columns^2 x fits of an unbalanced grid's least squares (seconds, not hours)
MAX_LEVELS = 30  # a factor with more values than this is no grid axis (a sampled search): no ANOVA


@dataclass(frozen=True)
class Anova:
    """The table (one row per estimated term, then the residual; `COLUMNS`) and what limits it."""

    table: pd.DataFrame
    metric: str
    factors: tuple[str, ...]
    n_runs: int
    balanced: bool
    replicates: int  # runs per cell on a balanced grid; 0 where the grid is unbalanced
    notes: list[str] = field(default_factory=list)


def term_name(factors: Sequence[str]) -> str:
    """A term's name: an axis, or two joined by ':' (statsmodels' spelling, without C())."""
    return ":".join(factors)


def anova(frame: pd.DataFrame, factors: Sequence[str], metric: str) -> Anova:
    """The type-II ANOVA of `metric` on `factors` (main effects and two-way interactions) over the rows
    of `frame`, one row per run; rows whose metric is not finite (diverged, missing) are left out and
    counted in the notes."""
    values = pd.to_numeric(frame[metric], errors="coerce").astype(float)
    finite = np.isfinite(values.to_numpy())
    notes: list[str] = []
    if (~finite).any():
        notes.append(f"{int((~finite).sum())} of {len(frame)} runs left out: their {metric} is not finite "
                     "(diverged or not recorded)")
    data = frame.loc[finite]
    y = values.to_numpy()[finite]
    levels = {key: _levels(data[key]) for key in factors}
    constant = [key for key in factors if len(levels[key]) < 2]
    if constant:
        notes.append(f"no effect can be estimated for {', '.join(constant)}: one value only")
    used = tuple(key for key in factors if key not in constant)
    codes = {key: data[key].map(_level_code(levels[key])).to_numpy() for key in used}
    counts = _cell_counts(codes, levels, used)
    balanced = bool(counts.size) and counts.min() == counts.max() and counts.min() > 0
    replicates = int(counts.min()) if balanced else 0
    if not balanced and used:
        empty = int((counts == 0).sum())
        notes.append(f"unbalanced grid: cells hold {int(counts.min())}-{int(counts.max())} runs"
                     + (f" ({empty} of {counts.size} empty)" if empty else "")
                     + "; type II sums of squares no longer add up to the total, so shares are not a partition")
    terms = [(key,) for key in used] + list(itertools.combinations(used, 2))
    if balanced:  # orthogonal terms: each one's sum of squares from the means, in time linear in the runs
        rows, residual = _balanced(y, codes, levels, terms)
    else:
        if _design_cost(int((counts > 0).sum()), levels, terms) > MAX_DESIGN_COST:
            raise ValueError(f"unbalanced grid of {int((counts > 0).sum())} cells and {_columns_count(levels, terms)} "
                             "model columns: too large for an exact least-squares ANOVA here")
        rows, residual = _type2(y, codes, levels, terms, notes)
    total = float(((y - y.mean()) ** 2).sum()) if len(y) else math.nan
    table = _table(rows, residual, total, notes)
    if balanced and replicates == 1:
        notes.append("one run per cell (no seed replicates): the residual is the pooled higher-order "
                     "interactions, not seed noise")
    return Anova(table=table, metric=metric, factors=used, n_runs=len(y), balanced=balanced,
                 replicates=replicates, notes=notes)


def what_mattered(source: str | Path | Folder, metric: str | None = None, only_last: bool = False,
                  trained_below: float | None = None) -> Anova:
    """`anova` of a sweep folder's final `metric` (default: the sweep's report.metric) on its varying
    config keys but the seed, one row per finished run (a diverged run's final value is not finite: left
    out, and counted in the notes). ResultsError where nothing varies, where the runs are sampled points
    rather than a grid, or where a key takes more than MAX_LEVELS values."""
    from normexp.analysis.finals import final_values, is_sampled, numeric_axes  # finals imports results too
    from normexp.analysis.variants import distinct_keys

    folder = as_folder(source)
    metric = metric or folder.sweep.report.metric
    tidy = folder.metrics(all_config=True, only_last=only_last)
    check_metric(tidy, metric)
    table = final_values(tidy, metric, folder.trained_rule(trained_below))
    factors, aliases = distinct_keys(table, [key for key in varying_keys(table) if key != "seed"])
    if not factors:
        raise ResultsError("what mattered: no config key varies among these runs (only the seed), so no effect "
                           "can be estimated")
    numeric = numeric_axes(table)
    sweeps = [one.sweep for _, one in getattr(folder, "folders", ())] or [folder.sweep]  # compared: each
    if any(sweep.sampled_keys for sweep in sweeps) or (len(numeric) >= 2 and is_sampled(table, numeric[0], numeric[1])):
        raise ResultsError("what mattered: these runs are sampled points, not a factorial grid; an ANOVA needs "
                           "every combination of the axes' values (plot the sampled keys against the final loss)")
    many = [f"{key} ({table[key].nunique(dropna=False)} values)" for key in factors
            if table[key].nunique(dropna=False) > MAX_LEVELS]
    if many:
        raise ResultsError(f"what mattered: {', '.join(many)}: more than {MAX_LEVELS} values, no grid axis an "
                           "ANOVA can take")
    frame = table.assign(**{metric: table["final"]})
    try:
        result = anova(frame, factors, metric)
    except ValueError as exc:  # an unbalanced grid too large to fit
        raise ResultsError(f"what mattered: {exc}") from None
    for key, twins in aliases.items():  # one factor, said once: the sweep compared is its depth
        result.notes.insert(0, f"{', '.join(twins)} varies with {key}: one factor, {key}")
    return result


def f_sf(f: float, df1: float, df2: float) -> float:
    """P(F > f) for the F distribution with (df1, df2) degrees of freedom."""
    if not (math.isfinite(f) and df1 > 0 and df2 > 0):
        return math.nan
    if f <= 0:
        return 1.0
    return regularized_beta(df2 / (df2 + df1 * f), df2 / 2, df1 / 2)


def regularized_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b), by the continued fraction on whichever side converges fast (Numerical Recipes 6.4)."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return math.exp(log_front) * _beta_fraction(x, a, b) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(1 - x, b, a) / b


def _beta_fraction(x: float, a: float, b: float, tiny: float = 1e-300, eps: float = 1e-16) -> float:
    """The continued fraction of the incomplete beta function, by the modified Lentz method."""
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 10_000):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < eps:
            break
    return result


def _levels(column: pd.Series) -> list:
    """A factor's levels in a stable order: numbers by value, anything else by its text."""
    unique = list(dict.fromkeys(column.tolist()))
    try:
        return sorted(unique)
    except TypeError:
        return sorted(unique, key=repr)


def _level_code(levels: list) -> dict:
    return {level: index for index, level in enumerate(levels)}


def _cell_counts(codes: dict[str, np.ndarray], levels: dict[str, list], used: Sequence[str]) -> np.ndarray:
    if not used:
        return np.zeros(0, dtype=int)
    shape = tuple(len(levels[key]) for key in used)
    flat = np.ravel_multi_index(tuple(codes[key] for key in used), shape)
    return np.bincount(flat, minlength=int(np.prod(shape)))


def _columns(term: tuple[str, ...], codes: dict[str, np.ndarray], levels: dict[str, list]) -> np.ndarray:
    """A term's treatment-coded columns (first level dropped), products for an interaction."""
    blocks = [np.eye(len(levels[key]))[codes[key]][:, 1:] for key in term]
    columns = blocks[0]
    for block in blocks[1:]:
        columns = (columns[:, :, None] * block[:, None, :]).reshape(len(columns), -1)
    return columns


def _balanced(y: np.ndarray, codes: dict[str, np.ndarray], levels: dict[str, list],
              terms: list[tuple[str, ...]]) -> tuple[list[tuple], tuple[float, int]]:
    """Type II sums of squares of a balanced grid (every cell of the axes' product holds the same number
    of runs): its terms are orthogonal, so each main effect's is sum n_a (mean_a - mean)^2 and each
    interaction's sum n_ab (mean_ab - mean_a - mean_b + mean)^2, exactly what the least squares of
    `_type2` gives; the residual is measured from the fitted values, not as a difference of totals."""
    grand = float(y.mean())
    fitted = np.full(len(y), grand)
    effects: dict[str, np.ndarray] = {}  # per main effect, each run's level mean - grand mean
    rows = []
    for term in terms:
        if len(term) == 1:
            deviation = _group_means(y, codes[term[0]], len(levels[term[0]])) - grand
            effects[term[0]] = deviation
            df = len(levels[term[0]]) - 1
        else:
            a, b = term
            flat = codes[a] * len(levels[b]) + codes[b]
            deviation = (_group_means(y, flat, len(levels[a]) * len(levels[b])) - effects[a] - effects[b] - grand)
            df = (len(levels[a]) - 1) * (len(levels[b]) - 1)
        fitted += deviation
        rows.append((term_name(term), df, float(deviation @ deviation)))
    residual = y - fitted
    return rows, (float(residual @ residual), len(y) - 1 - sum(df for _, df, _ in rows))


def _group_means(y: np.ndarray, codes: np.ndarray, n: int) -> np.ndarray:
    """Each run's group mean (`codes` numbers the groups 0..n-1)."""
    return (np.bincount(codes, weights=y, minlength=n) / np.bincount(codes, minlength=n))[codes]


def _columns_count(levels: dict[str, list], terms: list[tuple[str, ...]]) -> int:
    return 1 + sum(math.prod(len(levels[key]) - 1 for key in term) for term in terms)


def _design_cost(cells: int, levels: dict[str, list], terms: list[tuple[str, ...]]) -> float:
    return float(cells) * _columns_count(levels, terms) ** 2 * (2 * len(terms) + 1)


def _fit(y: np.ndarray, parts: list[np.ndarray], intercept: np.ndarray) -> tuple[float, int]:
    """The residual sum of squares and the rank of the least-squares fit on `intercept` and `parts`."""
    x = np.hstack([intercept[:, None], *parts])
    coef, _, rank, _ = np.linalg.lstsq(x, y, rcond=None)
    residual = y - x @ coef
    return float(residual @ residual), int(rank)


def _type2(y: np.ndarray, codes: dict[str, np.ndarray], levels: dict[str, list],
           terms: list[tuple[str, ...]], notes: list[str]) -> tuple[list[tuple], tuple[float, int]]:
    """Type II sums of squares by least squares. Every model here is a function of a run's cell (its
    factors' levels), so each fit is made on one row per non-empty cell, its mean, weighted by the square
    root of its runs: the same residuals as on every run, less the spread within the cells, which no
    model explains and which is added back to the residual (10,240 runs of 512 cells: 20x fewer rows)."""
    keys = list(dict.fromkeys(key for term in terms for key in term))
    if keys:
        flat = np.ravel_multi_index(tuple(codes[k] for k in keys), tuple(len(levels[k]) for k in keys))
        _, first, inverse, counts = np.unique(flat, return_index=True, return_inverse=True, return_counts=True)
    else:
        first, inverse, counts = np.zeros(1, dtype=int), np.zeros(len(y), dtype=int), np.array([len(y)])
    means = np.bincount(inverse, weights=y) / counts
    within = float(((y - means[inverse]) ** 2).sum())
    weight = np.sqrt(counts)
    cells = {k: codes[k][first] for k in keys}
    columns = {term: _columns(term, cells, levels) * weight[:, None] for term in terms}
    target = means * weight

    def fit(parts: list[np.ndarray]) -> tuple[float, int]:
        return _fit(target, parts, weight)

    full_ss, full_rank = fit([columns[term] for term in terms])
    full_ss += within
    rows = []
    for term in terms:
        others = [other for other in terms if not set(term) <= set(other)]
        without_ss, without_rank = fit([columns[other] for other in others])
        with_ss, with_rank = fit([columns[other] for other in others] + [columns[term]])
        df = with_rank - without_rank
        if df == 0:
            notes.append(f"{term_name(term)} cannot be estimated: the grid has no runs that separate it "
                         "from the other terms (empty cells)")
            continue
        rows.append((term_name(term), df, max(without_ss - with_ss, 0.0)))
    return rows, (full_ss, len(y) - full_rank)


def _table(rows: list[tuple], residual: tuple[float, int], total: float, notes: list[str]) -> pd.DataFrame:
    residual_ss, residual_df = residual
    residual_ms = residual_ss / residual_df if residual_df > 0 else math.nan
    if residual_df <= 0 and rows:
        notes.append("no residual degrees of freedom (one run per cell and no higher-order interaction "
                     "left): F and p cannot be computed; add seeds")
    records = []
    for term, df, ss in rows:
        ms = ss / df
        f = ms / residual_ms if residual_df > 0 and residual_ms > 0 else math.nan
        records.append({"term": term, "df": float(df), "sum_sq": ss, "mean_sq": ms, "F": f,
                        "p": f_sf(f, df, residual_df)})
    records.append({"term": RESIDUAL, "df": float(residual_df), "sum_sq": residual_ss, "mean_sq": residual_ms,
                    "F": math.nan, "p": math.nan})
    table = pd.DataFrame.from_records(records)
    table["share"] = table["sum_sq"] / total if total > 0 else math.nan
    return table.loc[:, list(COLUMNS)]
