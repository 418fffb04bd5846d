"""What the report page's charts and run table carry, computed from a folder's tables (pure pandas, no
drawing): JSON-ready dicts that normexp/page/page.js draws with Plotly.

Every chart aggregates, and says over what; nothing is sampled. A curve is a variant's mean over the
runs whose loss is finite at each step, with a band of ± one standard error of that mean (std / sqrt(n),
n the runs it covers at the step; it narrows as seeds are added, where a min-max band would widen), and
its hover says n, and why runs are not covered (stopped early, diverged). Past MAX_LINES variants (or
MAX_PANELS phase panels), the keys with the most values are pooled into the mean, and the chart says
which. The parallel coordinates and the run table hold every run.

Numbers are carried to DIGITS significant digits (the charts' hover shows 4); the run table's final
value is exact (repr), so that sorting by it is sorting by the run's own number.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from normexp.analysis.finals import final_values, is_sampled, last_rows
from normexp.analysis.realtext import text_floors
from normexp.analysis.variants import axis_label, chance_levels, is_null, trained_limits, value_label, variant_label

MAX_LINES = 24  # curves in one chart; more variants: the keys with the most values are pooled
MAX_PANELS = 12  # phase-diagram panels; more: pooled likewise
MAX_PARALLEL = 2000  # parallel-coordinate lines; more runs: one line per configuration (its seeds' mean)
DIGITS = 6
LOSSES = ("loss", "val_loss")
DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
CATEGORICAL = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
               "#bcbd22", "#17becf", "#393b79", "#e7969c", "#637939", "#8c6d31", "#843c39", "#7b4173",
               "#3182bd", "#fd8d3c", "#74c476", "#9e9ac8", "#969696", "#6baed6", "#fdae6b", "#a1d99b")
VIRIDIS = ("#440154", "#482878", "#3e4a89", "#31688e", "#26828e", "#1f9e89", "#35b779", "#6ece58", "#b5de2b",
           "#fde725")


def rounded(value: object) -> float | None:
    """A number for the page's JSON: DIGITS significant digits; None for a missing or non-finite one."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return float(f"{value:.{DIGITS}g}") if math.isfinite(value) else None


def numbers(values: Sequence[object]) -> list[float | None]:
    return [rounded(v) for v in values]


def pooled_keys(frame: pd.DataFrame, keys: Sequence[str], limit: int) -> tuple[list[str], list[str]]:
    """`keys` split into those that keep their groups apart and those pooled, so that at most `limit`
    groups remain: the key with the most values is pooled first (the last listed, on a tie)."""
    kept = list(keys)
    pooled: list[str] = []
    while kept and _combinations(frame, kept) > limit:
        counts = {k: frame[k].nunique(dropna=False) for k in kept}
        widest = max(reversed(kept), key=counts.__getitem__)
        kept.remove(widest)
        pooled.append(widest)
    return kept, pooled


def _combinations(frame: pd.DataFrame, keys: Sequence[str]) -> int:
    return len(frame[list(keys)].drop_duplicates()) if keys else 1


def pooled_note(pooled: Sequence[str], frame: pd.DataFrame, what: str) -> str:
    """'each curve pools over learning rate (12 values): more than 24 variants' or ''."""
    if not pooled:
        return ""
    named = ", ".join(f"{axis_label(k)} ({frame[k].nunique(dropna=False)} values)" for k in pooled)
    return f"each {what} pools its runs over {named}, so that no more than the chart can show are drawn"


def _styles(frame: pd.DataFrame, keys: Sequence[str], combos: list[tuple]) -> list[dict]:
    """A colour and dash per combination of `keys`: the placement (where others vary too) by its dash,
    the rest by colour: a sequential palette for one numeric key of more than 2 values, else categorical."""
    dash_key = "norm.placement" if "norm.placement" in keys and len(keys) > 1 else None
    colour_keys = [k for k in keys if k != dash_key]
    colour_values = list(dict.fromkeys(tuple(c[keys.index(k)] for k in colour_keys) for c in combos))
    numeric = len(colour_keys) == 1 and _numeric(frame[colour_keys[0]]) and len(colour_values) > 2
    colour_values.sort(key=lambda v: _order(v[0])) if numeric else None
    colours = {}
    for i, value in enumerate(colour_values):
        if numeric:
            colours[value] = VIRIDIS[round(i * (len(VIRIDIS) - 1) / max(1, len(colour_values) - 1) * 0.9)]
        else:
            colours[value] = CATEGORICAL[i % len(CATEGORICAL)]
    dashes = {}
    if dash_key:
        for i, value in enumerate(dict.fromkeys(c[keys.index(dash_key)] for c in combos)):
            dashes[value] = DASHES[i % len(DASHES)]
    return [{"color": colours[tuple(c[keys.index(k)] for k in colour_keys)],
             "dash": dashes.get(c[keys.index(dash_key)], "solid") if dash_key else "solid"} for c in combos]


def _numeric(column: pd.Series) -> bool:
    return pd.api.types.is_numeric_dtype(column) and not pd.api.types.is_bool_dtype(column)


def _order(value: object) -> float:
    try:
        return -math.inf if is_null(value) else float(value)
    except (TypeError, ValueError):
        return math.inf


def curves_data(tidy: pd.DataFrame, keys: Sequence[str], metric: str, trained_below: float | None) -> dict:
    """Per variant (the runs that differ only by seed; pooled past MAX_LINES), the mean of `metric` per step
    over the runs whose loss is finite there, ± its standard error, and per step how many runs that is
    and why the others are not in it."""
    runs = tidy.drop_duplicates("run_id")
    kept, pooled = pooled_keys(runs, keys, MAX_LINES)
    groups = list(tidy.groupby(kept, sort=False, dropna=False)) if kept else [((), tidy)]
    combos = [values if isinstance(values, tuple) else (values,) for values, _ in groups]
    styles = _styles(runs, kept, combos) if kept else [{"color": CATEGORICAL[0], "dash": "solid"}]
    lines = []
    for (_, group), combo, style in zip(groups, combos, styles):
        label = variant_label(dict(zip(kept, combo))) if kept else "all runs"
        lines.append({"name": label, **style, **_curve(group, metric)})
    order = sorted(range(len(lines)), key=lambda i: [_order(v) if _numeric(runs[k]) else str(v)
                                                     for k, v in zip(kept, combos[i])])
    limits = trained_limits(runs, trained_below) if metric in LOSSES else []
    floors = text_floors(runs) if metric in LOSSES else {}
    log = metric in ("loss", "val_loss", "grad_norm")
    shown, clipped = _clip(tidy, [lines[i] for i in order], metric, log)
    return {"metric": metric, "lines": [lines[i] for i in order], "log": log, "range": shown, "clipped": clipped,
            "pooled": pooled_note(pooled, runs, "curve"), "limits": numbers(limits),
            "floors": [{"name": name, "y": rounded(value)} for name, value in floors.items()],
            "keys": [axis_label(k) for k in kept]}


BLOWUP_FACTOR = 10  # as the figures': a loss axis ends at this many times the larger of chance and step 0's loss


def _clip(tidy: pd.DataFrame, lines: list[dict], metric: str, log: bool) -> tuple[list[float] | None, str]:
    """Where a mean blows up (far above where the runs start), the loss axis's first range ends at
    BLOWUP_FACTOR x the larger of chance and the highest step-0 mean, so that the curves that train stay
    apart, and a note says so (the chart zooms out on a double click); else no range, no note."""
    if metric not in LOSSES:
        return None, ""
    means = [y for line in lines for y in line["y"] if y is not None]
    firsts = [line["y"][0] for line in lines if line["y"] and line["y"][0] is not None]
    if not means or not firsts:
        return None, ""
    top = BLOWUP_FACTOR * max(max(firsts), *(math.log(n) for n in chance_levels(tidy)))
    if max(means) <= top:
        return None, ""
    low = min(y for y in means if y > 0) if log else min(means)
    shown = [math.log10(low) - 0.05, math.log10(top)] if log else [low, top]
    return numbers(shown), (f"the axis ends at {top:.3g} (the highest mean reaches {max(means):.3g}); "
                            "double-click the chart to see all")


def _curve(group: pd.DataFrame, metric: str) -> dict:
    loss = group["loss"].astype(float).to_numpy()
    finite = group[np.isfinite(loss)]
    valued = finite[finite[metric].notna()]  # a step without a value (val_loss between evaluations): no point
    stats = valued[metric].astype(float).groupby(valued["step"]).agg(["mean", "std", "count"])
    ends = last_rows(group)
    total = len(ends)
    diverged = (ends["status"] == "diverged").to_numpy()
    # a run is in a step's mean while its loss is finite there: past its last finite step it stopped (early,
    # or a shorter train.steps) or diverged
    last_finite = finite.groupby("run_id")["step"].max().reindex(ends["run_id"]).fillna(-1).to_numpy()
    notes = []
    for step in stats.index:
        gone = last_finite < step
        parts = [f"{int((gone & ~diverged).sum())} ended before", f"{int((gone & diverged).sum())} diverged"]
        notes.append(", ".join(p for p in parts if not p.startswith("0 ")))
    stderr = stats["std"] / np.sqrt(stats["count"])
    return {"x": [int(s) for s in stats.index], "y": numbers(stats["mean"]), "se": numbers(stderr),
            "n": [int(c) for c in stats["count"]], "why": notes, "runs": total, "diverged": int(diverged.sum())}


def phase_data(tidy: pd.DataFrame, x_key: str, y_key: str, others: Sequence[str], metric: str,
               trained_below: float | None) -> dict:
    """The final `metric` on the x_key x y_key grid, one panel per combination of `others` (pooled past
    MAX_PANELS): per cell the mean over its runs whose final value is finite, how many that is of how
    many, and how many trained; the trained region's border. Sampled points: one point per (x, y) and
    panel, the mean over its seeds, each seed's value in its hover."""
    table = final_values(tidy, metric, trained_below)
    kept, pooled = pooled_keys(table, others, MAX_PANELS)
    sampled = is_sampled(table, x_key, y_key)
    groups = list(table.groupby(kept, sort=False, dropna=False)) if kept else [((), table)]
    values = table["final"].astype(float)
    log = metric not in ("acc", "val_acc") and bool((values.dropna() > 0).all()) and values.notna().any()
    panels = []
    for combo, group in groups:
        combo = combo if isinstance(combo, tuple) else (combo,)
        title = variant_label(dict(zip(kept, combo))) if kept else ""
        panel = _scatter_panel(group, x_key, y_key, log) if sampled else _grid_panel(group, x_key, y_key, log)
        panels.append({"title": f"{title} (n={len(group)})" if title else f"all runs (n={len(group)})", **panel})
    limits = trained_limits(table, trained_below) if metric in LOSSES else []
    return {"metric": metric, "x": axis_label(x_key), "y": axis_label(y_key), "log": log, "sampled": sampled,
            "xlog": _log_axis(table[x_key]), "ylog": _log_axis(table[y_key]),
            "panels": panels, "pooled": pooled_note(pooled, table, "panel"),
            "limits": numbers(math.log10(v) if log else v for v in limits),
            "range": numbers(_range(values, log, limits))}


def _range(values: pd.Series, log: bool, limits: Sequence[float]) -> list[float]:
    finite = values[np.isfinite(values)]
    if log:
        finite = np.log10(finite[finite > 0])
        limits = [math.log10(v) for v in limits]
    if finite.empty:
        return [0.0, 1.0]
    low, high = min(float(finite.min()), *limits), max(float(finite.max()), *limits)
    return [low, high if high > low else low + 1e-9]


def _log_axis(column: pd.Series) -> bool:
    numbers_ = pd.to_numeric(column, errors="coerce").dropna()
    return bool(len(numbers_)) and bool((numbers_ > 0).all()) and numbers_.max() / numbers_.min() > 20


def _cell_value(mean: float, log: bool) -> float | None:
    if not math.isfinite(mean) or (log and mean <= 0):
        return None
    return rounded(math.log10(mean) if log else mean)


def _grid_panel(group: pd.DataFrame, x_key: str, y_key: str, log: bool) -> dict:
    stats = group.groupby([y_key, x_key], dropna=False).agg(
        mean=("final", "mean"), finite=("final", "count"), runs=("final", "size"), trained=("trained", "sum"),
        stopped=("stopped", "sum"))
    xs = sorted(group[x_key].unique(), key=_order)
    ys = sorted(group[y_key].unique(), key=_order)
    z = [[None] * len(xs) for _ in ys]
    text = [[""] * len(xs) for _ in ys]
    hover = [[""] * len(xs) for _ in ys]
    trained = np.zeros((len(ys), len(xs)), dtype=bool)
    for (y, x), row in stats.iterrows():
        i, j = ys.index(y), xs.index(x)
        mean, finite, runs = float(row["mean"]), int(row["finite"]), int(row["runs"])
        z[i][j] = _cell_value(mean, log)
        trained[i, j] = runs > 0 and int(row["trained"]) == runs
        text[i][j] = ("div" if finite == 0 else f"{mean:.2g}" + ("" if finite == runs else f" {finite}/{runs}"))
        said = "all diverged" if finite == 0 else f"{mean:.4g} (mean of {finite} of {runs} runs)"
        stopped = f"; {int(row['stopped'])} stopped early" if row["stopped"] else ""
        hover[i][j] = f"{said}<br>trained: {int(row['trained'])} of {runs}{stopped}"
    return {"xs": [value_label(x_key, v) for v in xs], "ys": [value_label(y_key, v) for v in ys],
            "z": z, "text": text, "hover": hover, "edges": _edges(trained)}


def _edges(region: np.ndarray) -> list[list[float]]:
    """The border of `region` (the cells where every run trained) as segments [x0, y0, x1, y1] in cell
    coordinates (cell (i, j) spans j-0.5..j+0.5 across, i-0.5..i+0.5 up)."""
    n_y, n_x = region.shape
    padded = np.pad(region, 1)
    segments = []
    for i in range(n_y + 1):
        for j in range(n_x):
            if padded[i, j + 1] != padded[i + 1, j + 1]:
                segments.append([j - 0.5, i - 0.5, j + 0.5, i - 0.5])
    for i in range(n_y):
        for j in range(n_x + 1):
            if padded[i + 1, j] != padded[i + 1, j + 1]:
                segments.append([j - 0.5, i - 0.5, j - 0.5, i + 0.5])
    return segments


def _scatter_panel(group: pd.DataFrame, x_key: str, y_key: str, log: bool) -> dict:
    points = []
    for (x, y), runs in group.groupby([x_key, y_key], sort=False, dropna=False):
        finals = runs["final"].astype(float)
        finite = finals[np.isfinite(finals)]
        mean = float(finite.mean()) if len(finite) else math.nan
        seeds = "<br>".join(f"seed {s}: {'diverged' if not math.isfinite(v) else f'{v:.4g}'}"
                            for s, v in zip(runs["seed"], finals))
        said = f"{mean:.4g} (mean of {len(finite)} of {len(runs)} runs)" if len(finite) else "all diverged"
        points.append({"x": rounded(x), "y": rounded(y), "z": _cell_value(mean, log),
                       "trained": bool(runs["trained"].all()), "diverged": len(finite) == 0,
                       "hover": f"{said}<br>{seeds}"})
    return {"points": points}


def parallel_data(table: pd.DataFrame, keys: Sequence[str], metric: str) -> dict:
    """One line per run over the grid's axes (`keys`) and its final `metric`, coloured by that value: a
    number axis on a log scale where its values span more than 20x (ticks at its values), any other axis
    by its values in order; a diverged run sits above the highest value, on a tick of its own. Past
    MAX_PARALLEL runs (WebGL drawn in software, as in a headless browser, takes seconds per thousand
    lines), one line per configuration, the mean over its seeds (a configuration whose every seed
    diverged: diverged), pooling keys as the curves do if that is still too many; `note` says so."""
    runs, note = len(table), ""
    if runs > MAX_PARALLEL:
        kept, pooled = pooled_keys(table, keys, MAX_PARALLEL)
        table = (table.groupby(kept, sort=False, dropna=False)["final"].mean().reset_index() if kept
                 else pd.DataFrame({"final": [table["final"].mean()]}))
        keys = kept
        over = "its seeds" + (f" and {', '.join(axis_label(k) for k in pooled)}" if pooled else "")
        note = (f"one line per configuration, the mean final {metric} over {over} ({len(table)} lines for "
                f"{runs} runs: more than {MAX_PARALLEL} lines would take seconds to draw)")
    dimensions = []
    for key in keys:
        column = table[key]
        values = list(dict.fromkeys(column.tolist()))
        if _numeric(column) and not column.isna().any():
            values.sort()
            log = _log_axis(column)
            scale = (lambda v: math.log10(v)) if log else float
            dimensions.append({"label": axis_label(key), "values": numbers(scale(v) for v in column),
                               "tickvals": numbers(scale(v) for v in values),
                               "ticktext": [value_label(key, v) for v in values]})
        else:
            values.sort(key=lambda v: str(v))
            code = {repr(v): i for i, v in enumerate(values)}
            dimensions.append({"label": axis_label(key), "values": [code[repr(v)] for v in column],
                               "tickvals": list(range(len(values))),
                               "ticktext": [value_label(key, v) for v in values]})
    finals = table["final"].astype(float)
    log = metric not in ("acc", "val_acc") and bool((finals.dropna() > 0).all())
    shown = np.log10(finals.where(finals > 0)) if log else finals
    finite = shown[np.isfinite(shown)]
    low, high = (float(finite.min()), float(finite.max())) if len(finite) else (0.0, 1.0)
    top = high + max(0.1 * (high - low), 0.05)
    ticks = np.linspace(low, high, 5) if high > low else np.array([low])
    dimensions.append({"label": f"final {metric}", "values": numbers(shown.fillna(top)),
                       "tickvals": numbers([*ticks, top]) if (~np.isfinite(shown)).any() else numbers(ticks),
                       "ticktext": [_tick(t, log) for t in ticks] + (["diverged"] if (~np.isfinite(shown)).any()
                                                                      else []),
                       "range": numbers([low, top])})
    return {"dimensions": dimensions, "color": numbers(shown.fillna(top)), "log": log,
            "cmin": rounded(low), "cmax": rounded(top), "runs": runs, "lines": len(table), "note": note}


def _tick(value: float, log: bool) -> str:
    return f"{10 ** value:.3g}" if log else f"{value:.3g}"
