"""Where the runs train: the final value of a metric on a grid of two numeric keys, and the share of
runs that trained on a grid of two keys.

- `phase_figure`: for two numeric grid axes (learning rate across, warmup up, by default), a heatmap
  of the final value of the metric asked for (mean over seeds), one panel per other variant, one
  shared colour scale; the cells whose every run trained are outlined, the others hatched. Sampled
  points (a sweep's `sample:` section) are drawn as a scatter instead (`phase_scatter_figure`).
- `trained_fraction_figure`: the share of runs that trained on a grid of two keys (placement x norm kind).
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.colors import LogNorm, Normalize
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from normexp.analysis.finals import final_values, is_sampled
from normexp.analysis.variants import (
    axis_label,
    distinct_keys,
    is_trained,
    n_choices,
    thresholds,
    trained_limits,
    value_label,
)
from normexp.figures.facets import (
    LOSSES,
    Facets,
    choose_facets,
    constants_text,
    coverage,
    figure_title,
    filled_panels,
    number_texts,
    panels,
    plain_log_ticks,
    subplots,
)
from normexp.results import finished_runs, varying_keys

FINAL_LABELS = {"loss": "final training loss", "acc": "final training accuracy", "grad_norm": "final gradient norm",
                "lr": "final learning rate", "val_loss": "final held-out loss", "val_acc": "final held-out accuracy"}


TRAINED_EDGE = "red"  # the border of the trained region on a phase diagram


STOPPED_MARKER = "v"  # the phase diagram's mark on a cell where train.stop_when stopped a run early


def phase_figure(tidy: pd.DataFrame, x_key: str, y_key: str, metric: str = "loss",
                 facets: Facets | None = None, trained_below: float | None = None) -> Figure:
    """The final `metric` (mean over seeds) on the x_key x y_key grid, one panel per other variant
    (`facets`' rows and columns; its hue joins the rows), cells whose every run trained hatched."""
    table = final_values(tidy, metric, trained_below)
    others, _ = distinct_keys(table, [k for k in varying_keys(table) if k not in ("seed", x_key, y_key)])
    facets = facets or choose_facets(others)
    facets = Facets([*facets.row, *facets.hue, *facets.style], facets.col, [])
    if is_sampled(table, x_key, y_key):
        return phase_scatter_figure(table, x_key, y_key, metric, facets, trained_below)
    grid, n_rows, n_cols = panels(table, facets)
    values = table["final"].dropna()
    accuracy = metric.endswith("acc")
    if accuracy:
        scale, cmap = Normalize(0, 1), "viridis"
    else:  # the scale reaches down to the trained threshold, so that a cell's colour says how near it is
        positive = values[values > 0]
        limits = trained_limits(table, trained_below) if metric in LOSSES else []
        low, high = (positive.min(), positive.max()) if len(positive) else (1e-3, 10)
        low = min([low, *(0.8 * v for v in limits)])
        scale, cmap = LogNorm(vmin=low, vmax=max(high, low * 1.01)), "viridis_r"
    n_x, n_y = table[x_key].nunique(dropna=False), table[y_key].nunique(dropna=False)
    panel = (max(3.2, 0.55 * n_x + 1.2), max(2.3, 0.42 * n_y + 1.1))
    fig, axes = subplots(n_rows, n_cols, legend=False, panel=panel)
    image = None
    for ax, title, runs in filled_panels(grid, axes):
        image = _phase_panel(ax, runs, x_key, y_key, scale, cmap)
        ax.set_title(f"{title} ({coverage(runs)})" if title else coverage(runs), fontsize="small")
    for ax in axes.flat:
        if ax.get_visible():
            ax.label_outer()
    if image is not None:
        bar = fig.colorbar(image, ax=axes, shrink=0.9,
                           label=FINAL_LABELS.get(metric, metric) + ("" if accuracy else " (log scale)"))
        bar.ax.tick_params(labelsize="small")
        if not accuracy:
            plain_log_ticks(bar.ax.yaxis)
            for limit in trained_limits(table, trained_below) if metric in LOSSES else []:
                bar.ax.axhline(limit, color="black", linestyle="--", linewidth=1.2)
    rule = _rule_text(table, trained_below)
    handles = [Line2D([], [], color=TRAINED_EDGE, linewidth=2.5, label=f"every run trained: {rule}"),
               Patch(facecolor="none", edgecolor="grey", hatch="xx", label="not every run trained")]
    if metric in LOSSES:
        handles.append(Line2D([], [], color="black", linestyle="--", label="the threshold (colour bar)"))
    if table["stopped"].any():
        handles.append(Line2D([], [], marker=STOPPED_MARKER, markersize=4, color="black", linestyle="",
                              label="a run stopped early (train.stop_when)"))
    wide = fig.get_figwidth() >= 11
    fig.legend(handles=handles, loc="outside lower center", fontsize="small", frameon=False,
               ncols=len(handles) if wide else 1)
    diverged = (table["status"] == "diverged").any()
    figure_title(fig, f"Where do the runs train? {_capital(FINAL_LABELS.get(metric, metric))} on {axis_label(x_key)} "
                      f"× {axis_label(y_key)}, mean over seeds",
           constants_text(table) + (". k/n: the mean of the k of n runs that did not diverge; div: all diverged"
                                    if diverged else ""), legend=False)
    return fig


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def _rule_text(table: pd.DataFrame, trained_below: float | None) -> str:
    if trained_below is not None:
        return f"final training loss < {trained_below:g}"
    limits = ", ".join(f"{v:.3g}" for v in trained_limits(table, None))
    return f"final training loss < {limits} (ln(C)/10)"


def _phase_panel(ax, runs: pd.DataFrame, x_key: str, y_key: str, scale, cmap: str):
    stats = runs.groupby([y_key, x_key], dropna=False).agg(mean=("final", "mean"), finite=("final", "count"),
                                                            runs=("final", "size"), trained=("trained", "sum"),
                                                            stopped=("stopped", "sum"))
    xs = sorted(runs[x_key].unique(), key=_order)
    ys = sorted(runs[y_key].unique(), key=_order)
    cells = np.full((len(ys), len(xs)), np.nan)
    image = ax.imshow(cells, norm=scale, cmap=cmap, aspect="auto", origin="lower")
    for (y, x), row in stats.iterrows():
        i, j = ys.index(y), xs.index(x)
        cells[i, j] = row["mean"]
    image.set_data(np.ma.masked_invalid(cells))
    trained = np.zeros((len(ys), len(xs)), dtype=bool)
    for (y, x), row in stats.iterrows():
        i, j = ys.index(y), xs.index(x)
        value = row["mean"]
        colour = "black" if math.isnan(value) else _text_colour(cmap, float(scale(value)))
        trained[i, j] = bool(row["runs"]) and row["trained"] == row["runs"]
        if row["runs"] and not trained[i, j]:  # not every run trained: hatched
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="xx", edgecolor=colour,
                                   linewidth=0, alpha=0.35))
        ax.text(j, i, _phase_text(value, row["finite"], row["runs"]), ha="center", va="center", fontsize=7,
                color=colour)
        if row["stopped"]:  # train.stop_when stopped a run of this cell early: a small mark in its corner
            ax.plot(j + 0.36, i + 0.3, marker=STOPPED_MARKER, markersize=4, color=colour, linestyle="")
    _outline(ax, trained)
    ax.set_xticks(range(len(xs)), number_texts(xs), rotation=45 if len(xs) > 4 else 0,
                  fontsize="small")
    ax.set_yticks(range(len(ys)), number_texts(ys), fontsize="small")
    ax.set_xlabel(axis_label(x_key))
    ax.set_ylabel(axis_label(y_key))
    return image


def _outline(ax, region: np.ndarray) -> None:
    """A thick red line around the cells of `region` (the trained ones): the border of where runs train."""
    n_y, n_x = region.shape
    padded = np.pad(region, 1)
    for i in range(n_y + 1):  # horizontal edges between row i-1 and row i
        for j in range(n_x):
            if padded[i, j + 1] != padded[i + 1, j + 1]:
                ax.plot([j - 0.5, j + 0.5], [i - 0.5, i - 0.5], color=TRAINED_EDGE, linewidth=2.5,
                        solid_capstyle="projecting", clip_on=False)
    for i in range(n_y):
        for j in range(n_x + 1):  # vertical edges between column j-1 and column j
            if padded[i + 1, j] != padded[i + 1, j + 1]:
                ax.plot([j - 0.5, j - 0.5], [i - 0.5, i + 0.5], color=TRAINED_EDGE, linewidth=2.5,
                        solid_capstyle="projecting", clip_on=False)
    ax.set_xlim(-0.5, n_x - 0.5)
    ax.set_ylim(-0.5, n_y - 0.5)


def _order(value: object) -> float:
    return -math.inf if pd.isna(value) else float(value)


def phase_scatter_figure(table: pd.DataFrame, x_key: str, y_key: str, metric: str, facets: Facets,
                         trained_below: float | None = None) -> Figure:
    """Sampled points (`final_values`' table): one marker per sampled (x, y) of a panel, coloured by the mean
    final `metric` of its seeds that did not diverge (never one seed's colour over another's), ringed red
    where every seed trained and orange where some did, with 'k/n' beside it where only k of its n seeds
    are in the mean; a red cross where every seed diverged. Panels as the phase diagram's. A scatter of
    what ran, never an interpolated map."""
    grid, n_rows, n_cols = panels(table, facets)
    values = table["final"].dropna()
    accuracy = metric.endswith("acc")
    positive = values[values > 0]
    scale = (Normalize(0, 1) if accuracy else
             LogNorm(vmin=positive.min() if len(positive) else 1e-3,
                     vmax=max(positive.max(), positive.min() * 1.01) if len(positive) else 10))
    cmap = "viridis" if accuracy else "viridis_r"
    fig, axes = subplots(n_rows, n_cols, legend=False, panel=(4.4, 3.6))
    image = None
    seeds = int(table.groupby([x_key, y_key, *facets.row, *facets.col], dropna=False).size().max())
    for ax, title, runs in filled_panels(grid, axes):
        points = _sampled_points(runs, x_key, y_key)
        ok, bad = points[points["finite"] > 0], points[points["finite"] == 0]
        edges = np.select([ok["trained"] == ok["runs"], ok["trained"] > 0], [TRAINED_EDGE, PARTLY_EDGE], "black")
        image = ax.scatter(ok[x_key], ok[y_key], c=ok["mean"], norm=scale, cmap=cmap, s=34, edgecolors=edges,
                           linewidths=np.where(ok["trained"] > 0, 1.6, 0.3))
        ax.scatter(bad[x_key], bad[y_key], marker="x", color="red", s=30)
        for _, point in ok[ok["finite"] < ok["runs"]].iterrows():
            ax.annotate(f"{int(point['finite'])}/{int(point['runs'])}", (point[x_key], point[y_key]),
                        xytext=(4, 3), textcoords="offset points", fontsize=6, color="darkred")
        for key, set_scale in ((x_key, ax.set_xscale), (y_key, ax.set_yscale)):
            column = table[key].astype(float)
            if (column > 0).all() and column.max() / column.min() > 20:
                set_scale("log")
        ax.set_xlabel(axis_label(x_key), fontsize="small")
        ax.set_ylabel(axis_label(y_key), fontsize="small")
        ax.set_title(f"{title} ({coverage(runs)})" if title else coverage(runs), fontsize="small")
        ax.grid(True, which="both", alpha=0.25)
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.9, label=FINAL_LABELS.get(metric, metric) + " (mean over seeds"
                     + ("" if accuracy else ", log scale") + ")")
    rule = _rule_text(table, trained_below)
    handles = [Line2D([], [], marker="o", linestyle="", markerfacecolor="none", markeredgecolor=TRAINED_EDGE,
                      markeredgewidth=1.6, label=f"every seed trained: {rule}"),
               Line2D([], [], marker="o", linestyle="", markerfacecolor="none", markeredgecolor=PARTLY_EDGE,
                      markeredgewidth=1.6, label="some seeds trained"),
               Line2D([], [], marker="x", linestyle="", color="red", label="every seed diverged")]
    fig.legend(handles=handles, loc="outside lower center", fontsize="small", frameon=False, ncols=3)
    per = f"the mean over its {seeds} seeds" if seeds > 1 else "one run each"
    figure_title(fig, f"Where do the sampled runs train? {_capital(FINAL_LABELS.get(metric, metric))} at each "
                      f"sampled point, {per} (a scatter, not interpolated)",
                 constants_text(table) + ("; k/n: the mean of the k of n seeds that did not diverge"
                                          if (table["final"].isna()).any() else ""), legend=False)
    return fig


PARTLY_EDGE = "orange"  # a sampled point where some of its seeds trained, not all


def _sampled_points(runs: pd.DataFrame, x_key: str, y_key: str) -> pd.DataFrame:
    """Per sampled (x, y): the mean final value of its runs that did not diverge, and how many runs it has,
    how many are in the mean and how many trained."""
    return (runs.groupby([x_key, y_key], dropna=False)
            .agg(mean=("final", "mean"), finite=("final", "count"), runs=("final", "size"), trained=("trained", "sum"))
            .reset_index())


def _phase_text(mean: float, finite: float, runs: float) -> str:
    """A phase cell's label: the mean, with k/n when only k of its n runs did not diverge."""
    if pd.isna(runs) or runs == 0:
        return ""
    if finite == 0:
        return "div"
    return f"{mean:.2g}" if finite == runs else f"{mean:.2g}\n{int(finite)}/{int(runs)}"


def _text_colour(cmap: str, level: float) -> str:
    """Black or white text, whichever reads on the colour `level` (0..1) of `cmap`."""
    r, g, b, _ = plt.get_cmap(cmap)(level)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"


def trained_fraction_figure(summary: pd.DataFrame, row_key: str = "norm.placement", col_key: str = "norm.kind",
                            trained_below: float | None = None) -> Figure:
    """The share of finished runs that trained (by the trained rule) on the row_key x col_key grid,
    each cell 'k/n'; a run that did not finish counts in no cell (the title says how many there are)."""
    finished = finished_runs(summary).copy()
    finished["trained"] = is_trained(finished["final_loss"].astype(float), finished["status"], n_choices(finished),
                                     thresholds(finished, trained_below))
    stats = finished.groupby([row_key, col_key], sort=False, dropna=False)["trained"].agg(["sum", "count"])
    rows = list(dict.fromkeys(finished[row_key]))
    cols = list(dict.fromkeys(finished[col_key]))
    share = np.full((len(rows), len(cols)), np.nan)
    # at least 5.5 x 3.6 inches: the title (the rule and the constants) wraps to the width, and a map of two
    # rows left room for neither it nor the colour bar
    fig, ax = plt.subplots(figsize=(max(5.5, 2.7 + 0.75 * len(cols)), max(3.6, 2.4 + 0.36 * len(rows))),
                           layout="constrained")
    for (r, c), row in stats.iterrows():
        share[rows.index(r), cols.index(c)] = row["sum"] / row["count"]
    image = ax.imshow(np.ma.masked_invalid(share), cmap="Greens", vmin=0, vmax=1, aspect="auto")
    for (r, c), row in stats.iterrows():
        i, j = rows.index(r), cols.index(c)
        ax.text(j, i, f"{int(row['sum'])}/{int(row['count'])}", ha="center", va="center", fontsize=7,
                color="white" if share[i, j] > 0.6 else "black")
    ax.set_xticks(range(len(cols)), [value_label(col_key, c) for c in cols], rotation=40, ha="right",
                  fontsize="small")
    ax.set_yticks(range(len(rows)), [value_label(row_key, r) for r in rows], fontsize="small")
    ax.set_xlabel(axis_label(col_key))
    ax.set_ylabel(axis_label(row_key))
    fig.colorbar(image, ax=ax, label="share of runs trained", shrink=0.8)
    unfinished = len(summary) - len(finished)
    figure_title(fig, f"Which {axis_label(row_key)} and {axis_label(col_key)} train? Share of runs trained "
                      f"({_rule_text(finished, trained_below)})",
           constants_text(summary) + (f"; {unfinished} runs unfinished, in no cell" if unfinished else ""),
           legend=False)
    return fig
