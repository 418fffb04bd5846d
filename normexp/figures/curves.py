"""Lines over a sweep's runs: a metric per step, and the final loss against the learning rate or a
numeric key.

- `curves_figure`: per panel, one line per value of the hue (the mean over seeds) with a shaded
  min–max band over seeds; panels by row and column keys (`Facets`); log y for a loss, chance level
  ln(n) as a dotted line (n: n_classes, or a Transformer's vocab), a text task's unigram and bigram
  floors dash-dotted, and the trained threshold as a dashed one. Steps without a value (val_loss
  between evaluations, `train.eval_every`) are left out of a line, not gaps in it. Each panel's title
  says how many runs it covers and how many diverged.
- `lr_figure`: final training loss against the learning rate (log x), the trained threshold dashed.
- `final_loss_figure`: final training loss against a numeric key (e.g. model.depth), one line per variant.
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from normexp.analysis.sensitivity import LR_KEY
from normexp.analysis.variants import CHOICE_KEYS, axis_label, chance_levels, short_number, variant_groups
from normexp.figures.facets import (
    LEGEND_WIDTH,
    LOSSES,
    Facets,
    Style,
    choose_facets,
    constants_text,
    coverage,
    figure_legend,
    figure_title,
    filled_panels,
    groups,
    hue_title,
    label_bottoms,
    line_styles,
    number_texts,
    panels,
    plain_log_ticks,
    reference_lines,
    subplots,
    value_counts,
    values_label,
)
from normexp.results import finished_runs, varying_keys

METRIC_LABELS = {"loss": "training loss (cross-entropy)", "acc": "training accuracy",
                 "grad_norm": "gradient norm (global L2)", "lr": "learning rate",
                 "val_loss": "held-out loss (answer positions)", "val_acc": "held-out accuracy (answer positions)",
                 "z_loss": "z-loss term, coef x mean log(Z)^2 (train.z_loss)"}


QUESTIONS = {"loss": "Which variants train, and how fast?", "val_loss": "Which variants generalise?",
             "acc": "Which variants fit their labels?", "val_acc": "Which variants answer held-out sequences?",
             "grad_norm": "Where do gradients grow or vanish?", "lr": "What learning rate did each step use?"}


def _mark_diverged(ax, runs: pd.DataFrame, stats: pd.DataFrame, style: Style) -> None:
    """Where some of a line's runs diverged: an x at the line's end, with 'k/n div' in its colour."""
    status = runs.groupby("run_id")["status"].first()
    diverged = int((status == "diverged").sum())
    if diverged and len(stats):
        x, y = stats.index[-1], stats["mean"].iloc[-1]
        ax.plot([x], [y], marker="x", color=style.color, markersize=6, linestyle="none")
        ax.annotate(f"{diverged}/{len(status)} div", (x, y), xytext=(3, 3), textcoords="offset points",
                    fontsize=6, color=style.color)


def curves_figure(tidy: pd.DataFrame, keys: list[str], metric: str = "loss", title: str = "",
                  facets: Facets | None = None, trained_below: float | None = None) -> Figure:
    """Mean curve per hue value with a min–max band over seeds, in panels by `facets` (default:
    `choose_facets(keys)`); the chance level and the trained threshold on a loss."""
    facets = facets or choose_facets(keys, counts=value_counts(tidy, keys))
    used = [*facets.keys, "run_id", "status", "step", "loss", metric, *CHOICE_KEYS, "data.task"]  # the panels read
    frame = tidy[[c for c in dict.fromkeys(used) if c in tidy]]  # each panel a copy of these alone
    grid, n_rows, n_cols = panels(frame, facets)
    styles, handles = line_styles(frame, facets)
    fig, axes = subplots(n_rows, n_cols, sharex=True, sharey=True)
    extra: dict[str, object] = {}
    for ax, panel, runs in filled_panels(grid, axes):
        for values, group in groups(runs, facets.lines):
            style = styles[values]
            # a step without a value (val_loss between two of train.eval_every's) is left out, not a gap
            finite = group[np.isfinite(group["loss"].astype(float)) & group[metric].notna()]
            stats = finite.groupby("step")[metric].agg(["mean", "min", "max"])
            ax.plot(stats.index, stats["mean"], color=style.color, linestyle=style.linestyle,
                    marker=style.marker, markevery=max(1, len(stats) // 6), markersize=3, linewidth=1.3,
                    label=f"{values_label(facets.lines, values)} ({coverage(group)})")
            _mark_diverged(ax, group, stats, style)
            if group["run_id"].nunique() > 1:
                ax.fill_between(stats.index, stats["min"], stats["max"], color=style.color, alpha=0.15,
                                linewidth=0)
        if metric in LOSSES:
            for handle in reference_lines(ax, runs, trained_below, chance=metric == "loss"):
                extra.setdefault(handle.get_label(), handle)
        if metric in ("loss", "val_loss", "grad_norm"):
            ax.set_yscale("log")
            plain_log_ticks(ax.yaxis)
        ax.set_title(f"{panel} ({coverage(runs)})" if panel else f"all runs ({coverage(runs)})",
                     fontsize="small")
        ax.grid(True, which="both", alpha=0.25)
        ax.label_outer()
    if metric in LOSSES:
        clipped = _clip_blowups(axes, tidy, metric)
        if clipped:
            extra[clipped] = Line2D([], [], linestyle="none", marker="^", color="black", label=clipped)
    label_bottoms(axes, "optimizer step")
    for ax in axes[:, 0]:
        ax.set_ylabel(METRIC_LABELS.get(metric, metric), fontsize="small")
    figure_legend(fig, [*handles, *extra.values()], hue_title(facets.hue))
    label = METRIC_LABELS.get(metric, metric)
    figure_title(fig, title or f"{QUESTIONS.get(metric, f'How does the {metric} evolve?')} "
                               f"{label[0].upper()}{label[1:]} per step: mean over seeds, band min–max",
                 constants_text(tidy))
    return fig


BLOWUP_FACTOR = 10  # a loss curve's axis ends at this many times the larger of chance and the first step's loss


def _clip_blowups(axes: np.ndarray, tidy: pd.DataFrame, metric: str) -> str:
    """Where a run's loss blows up (far above where the runs start), the shared y axis ends at BLOWUP_FACTOR
    times the larger of the chance level and the highest first-step loss, so that the curves that train
    stay apart; returns the legend's note on what was clipped ('' where nothing was)."""
    values = tidy[metric].astype(float)
    finite = values[np.isfinite(values)]
    first = values[tidy["step"] == tidy["step"].min()]
    first = first[np.isfinite(first)]
    if finite.empty or first.empty:
        return ""
    top = BLOWUP_FACTOR * max(first.max(), *(math.log(n) for n in chance_levels(tidy)))
    if finite.max() <= top:
        return ""
    for ax in axes.flat:
        if ax.get_visible():
            ax.set_ylim(top=top)
    return f"axis clipped at {top:.3g}\n(highest {finite.max():.2g})"


def final_loss_figure(summary: pd.DataFrame, x_key: str, trained_below: float | None = None) -> Figure:
    """Final loss against a numeric key (e.g. model.depth), one line per other variant: the mean over
    seeds, with the min–max band; chance dotted, the trained threshold dashed."""
    finished = finished_runs(summary).copy()
    finished["final_loss"] = finished["final_loss"].astype(float).where(np.isfinite(finished["final_loss"]))
    others = [k for k in varying_keys(summary) if k not in ("seed", x_key)]
    fig, ax = plt.subplots(figsize=(5.8 + LEGEND_WIDTH, 4.2), layout="constrained")
    for label, group in variant_groups(finished, others):
        stats = group.groupby(x_key)["final_loss"].agg(["mean", "min", "max"])
        line, = ax.plot(stats.index, stats["mean"], marker="o", label=f"{label} ({coverage(group)})")
        ax.fill_between(stats.index, stats["min"], stats["max"], color=line.get_color(), alpha=0.15, linewidth=0)
    reference_lines(ax, finished, trained_below)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    plain_log_ticks(ax.yaxis)
    values = sorted(finished[x_key].dropna().unique())
    ax.set_xticks(values, number_texts(values))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel(axis_label(x_key))
    ax.set_ylabel("final training loss")
    ax.grid(True, which="both", alpha=0.3)
    handles, _ = ax.get_legend_handles_labels()
    figure_legend(fig, handles, hue_title(others) if others else "")
    figure_title(fig, f"How does the {axis_label(x_key)} change what trains? Final training loss vs "
                      f"{axis_label(x_key)}: mean over seeds, band min–max", constants_text(finished))
    return fig


def lr_figure(table: pd.DataFrame, keys: list[str], facets: Facets | None = None,
              trained_below: float | None = None) -> Figure:
    """Final training loss against the learning rate (log x) from `sensitivity.lr_table`: one line per
    hue value (mean over seeds) with its min–max band, in panels by `facets` (default `choose_facets`),
    the trained threshold dashed."""
    facets = facets or choose_facets(keys, counts=value_counts(table, keys))
    grid, n_rows, n_cols = panels(table, facets)
    styles, handles = line_styles(table, facets)
    fig, axes = subplots(n_rows, n_cols, sharex=True, sharey=True)
    extra: dict[str, object] = {}
    for ax, panel, runs in filled_panels(grid, axes):
        for values, group in groups(runs, facets.lines):
            style = styles[values]
            stats = group.groupby(LR_KEY)["clipped"].agg(["mean", "min", "max"])
            ax.plot(stats.index, stats["mean"], marker=style.marker or "o", markersize=3.5, color=style.color,
                    linestyle=style.linestyle, linewidth=1.3, label=values_label(facets.lines, values))
            ax.fill_between(stats.index, stats["min"], stats["max"], color=style.color, alpha=0.15, linewidth=0)
        for handle in reference_lines(ax, runs, trained_below, chance=False):
            extra.setdefault(handle.get_label(), handle)
        ax.set_xscale("log")
        ax.set_yscale("log")
        lrs = sorted(table[LR_KEY].unique())
        if len(lrs) <= 8:  # a tick at each learning rate of the grid
            ax.set_xticks(lrs, [short_number(v, True) for v in lrs])
        else:
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: short_number(v, True)))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        plain_log_ticks(ax.yaxis)
        ax.set_title(f"{panel} ({coverage(runs)})" if panel else f"all runs ({coverage(runs)})",
                     fontsize="small")
        ax.grid(True, which="both", alpha=0.25)
        ax.label_outer()
    label_bottoms(axes, axis_label(LR_KEY))
    for ax in axes[:, 0]:
        ax.set_ylabel("final training loss", fontsize="small")
    figure_legend(fig, [*handles, *extra.values()], hue_title(facets.hue))
    figure_title(fig, "Which learning rates train? Final training loss vs learning rate",
           "line: mean over seeds; band: min–max; a diverged run, or one that ends above its loss at init, "
           f"counts as its loss at init. {constants_text(table)}")
    return fig
