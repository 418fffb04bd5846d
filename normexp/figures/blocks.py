"""Per-block dynamics (`normexp plot --blocks`): small multiples, one heatmap per variant of one per-block
quantity of blocks.csv over (step across, block up), the mean over seeds, on one colour scale shared by
every panel, so that variants compare at a glance (qk-norm on and off side by side); each panel names its
largest value, so that "the largest logit falls from 461 to 11" reads off the figure. The placement and
the keys of fewest values make the columns (at most MAX_COLUMNS), the other keys the rows; a grid that
would leave a slot empty lists its panels instead. Blocks are ticked at whole layers, 4 to 32 of them.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.colors import LogNorm, Normalize, SymLogNorm
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from normexp.analysis.variants import distinct_keys
from normexp.figures.facets import Facets, constants_text, figure_title, filled_panels, panels, plain_log_ticks
from normexp.results import Folder, ResultsError, as_folder, varying_keys

# block metrics whose values at or below 0 are values (a largest attention logit, a log Z), drawn on a
# symmetric log scale when they have any; every other block metric is positive where it exists
SIGNED_BLOCK_METRICS = ("attn_logit_max", "log_z")
BLOCK_METRIC_LABELS = {  # the per-block columns of blocks.csv (normexp/blocklog.py)
    "fc1_grad": "||dLoss/dW|| of fc1", "fc2_grad": "||dLoss/dW|| of fc2",
    "fc1_update": "update ||ΔW|| / ||W|| of fc1", "fc2_update": "update ||ΔW|| / ||W|| of fc2",
    "stream_rms": "RMS of the residual stream at the block output", "norm_rms": "RMS of the block norm's output",
    "norm_out_rms": "RMS of the branch norm's output (Sandwich, Peri)",
    # the Transformer's (normexp/blocklog.py): Wortsman et al. 2023's attention-logit growth and output-logit
    # divergence, and the attention entropy
    "attn_logit_max": "largest attention logit q.k/sqrt(d_head) of the layer",
    "attn_entropy": "entropy of the layer's attention weights (mean over heads and queries)",
    "log_z": "log Z of the output logits (mean over the loss's tokens; the model's, in every row)",
}
TRANSFORMER_ONLY = ("attn_logit_max", "attn_entropy", "log_z")  # blocklog.ATTENTION_COLUMNS: a Transformer's only
MAX_COLUMNS = 6  # panels across; more variants go down


def blocks_figure(tidy: pd.DataFrame, keys: list[str], metric: str = "fc2_update") -> Figure:
    """One heatmap of `metric` over (step, block) per variant (the runs that differ only by seed among
    `keys`), the mean over seeds, one colour scale for every panel; a variant with nothing to draw gets a
    panel that says why. ResultsError where no run recorded `metric` (a Transformer's attention metric of
    FFN runs)."""
    check_block_metric(tidy, metric)
    kept, _ = distinct_keys(tidy, keys)
    facets = block_facets(tidy, kept)
    grid, n_rows, n_cols = panels(tidy, facets)
    depth = int(tidy["block"].max())
    height = min(3.4, max(1.9, 1.45 + 0.055 * depth))
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(2.75 * n_cols + 1.3, max(3.6, height * n_rows + 1.1)),
                             squeeze=False, layout="constrained")
    values = tidy[metric].astype(float)
    finite = values[np.isfinite(values)]
    signed = metric in SIGNED_BLOCK_METRICS and bool((finite <= 0).any())
    scale = _scale(values, signed)
    image = None
    for ax, title, group in filled_panels(grid, axes):
        title = f"{title} (n={group['run_id'].nunique()})" if title else f"all runs (n={group['run_id'].nunique()})"
        why = "" if signed and np.isfinite(group[metric].astype(float)).any() else _why_empty(group, metric)
        if why:  # nothing to draw on a log scale: an empty panel that says why, not a matplotlib error
            _empty_panel(ax, title, why)
            continue
        image = _block_heatmap(ax, group, metric, scale, title, signed)
    for (i, j), ax in np.ndenumerate(axes):  # the axes' names once: a row's first drawn panel, a column's lowest
        if ax.get_visible() and ax.collections:
            first = not any(axes[i, k].collections for k in range(j))
            ax.set_ylabel("block" if first else "", fontsize="small")
            ax.set_xlabel("optimizer step" if i == n_rows - 1 or not axes[i + 1, j].get_visible() else "",
                          fontsize="small")
    if image is not None:
        bar = fig.colorbar(image, ax=axes, shrink=0.9, aspect=25 if n_rows > 1 else 15)
        bar.set_label(f"{metric}, mean over seeds\n({'symmetric log' if signed else 'log'} scale)", fontsize="small")
        bar.ax.tick_params(labelsize="x-small")
        if not signed:
            plain_log_ticks(bar.ax.yaxis)
    label = BLOCK_METRIC_LABELS.get(metric, metric)
    figure_title(fig, f"How does it evolve, block by block? {label[:1].upper()}{label[1:]}: mean over seeds, per "
                      "optimizer step (across) and block (up, 1 = input side)", constants_text(tidy), legend=False)
    return fig


def check_block_metric(tidy: pd.DataFrame, metric: str) -> None:
    """ResultsError where no run of `tidy` has a `metric` column (a Transformer's attention metric or log Z of
    FFN runs: their blocks.csv has none), naming the metrics they did record. A column without a value (no
    update after step 0 of a 0-step run) is drawn as panels that say why."""
    if metric in tidy and (metric not in TRANSFORMER_ONLY or tidy[metric].notna().any()):
        return
    recorded = [m for m in BLOCK_METRIC_LABELS if m in tidy and (m not in TRANSFORMER_ONLY or tidy[m].notna().any())]
    why = ("recorded by Transformer runs only (model.arch: transformer); these runs are FFNs"
           if metric in TRANSFORMER_ONLY else "not recorded by these runs")
    raise ResultsError(f"--block-metric {metric}: {why}; choose one of {', '.join(recorded) or 'none'}")


def block_facets(tidy: pd.DataFrame, keys: list[str]) -> Facets:
    """The panels' columns: the placement, then the keys of fewest values, while at most MAX_COLUMNS panels
    go across; the other keys make the rows."""
    counts = {k: tidy[k].nunique(dropna=False) for k in keys}
    order = sorted(keys, key=lambda k: (k != "norm.placement", counts[k]))
    cols: list[str] = []
    for key in order:
        if math.prod(counts[k] for k in [*cols, key]) <= MAX_COLUMNS or not cols:
            cols.append(key)
    cols = [k for k in keys if k in cols]  # grid order: the slowest-varying first
    return Facets([k for k in keys if k not in cols], cols, [])


def _scale(values: pd.Series, signed: bool) -> Normalize:
    finite = values[np.isfinite(values)]
    if signed:  # an attention logit or a log Z at or below 0 is a value, not a gap: symmetric log, linear near 0
        return SymLogNorm(linthresh=1.0, vmin=finite.min(), vmax=max(finite.max(), finite.min() + 1e-9))
    positive = finite[finite > 0]
    if not len(positive):
        return LogNorm(1e-3, 1)
    return LogNorm(vmin=positive.min(), vmax=max(positive.max(), positive.min() * 1.0001))


def _why_empty(group: pd.DataFrame, metric: str) -> str:
    """Why a variant's runs have no value of `metric` to draw (none finite and positive), or ""."""
    values = group[metric].astype(float)
    if (np.isfinite(values) & (values > 0)).any():
        return ""
    if values.notna().any():
        return f"no {metric} above 0 (a log scale shows none)"
    if metric in ("norm_rms", "norm_out_rms"):
        what = "branch-output norm (only Sandwich and Peri-LN have one)" if metric == "norm_out_rms" else \
            "block norm (none and ReZero have none)"
        return f"no {metric}: this placement's blocks have no {what}"
    if metric.endswith("_update") and int(group["step"].max()) == 0:
        return f"no {metric}: train.steps 0, so no update followed step 0"
    return f"no {metric} was recorded for these runs"


def _empty_panel(ax, title: str, why: str) -> None:
    # broken into lines by hand and kept out of the layout: a long line made constrained layout squeeze the
    # empty panel to a sliver and run its text across its neighbours
    note = ax.text(0.5, 0.5, textwrap.fill(why, 30), ha="center", va="center", transform=ax.transAxes,
                   fontsize="x-small")
    note.set_in_layout(False)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(title, fontsize="small")


def block_ticks(depth: int) -> list[int]:
    """Whole layers to tick: every one up to 8, else 1 and every 2nd, 4th or 8th layer up to the last."""
    if depth <= 8:
        return list(range(1, depth + 1))
    every = next(n for n in (2, 4, 8, 16) if depth / n <= 6)
    return sorted({1, *range(every, depth + 1, every), depth})


def _block_heatmap(ax, group: pd.DataFrame, metric: str, scale: Normalize, title: str, signed: bool = False):
    """Blocks up, steps across; empty cells: non-finite, or (`signed` false) zero or below (the last step
    has no update). Its largest value (the mean over seeds), with its block and step, in a corner."""
    grid = group.groupby(["block", "step"])[metric].mean().unstack("step")
    grid = grid.loc[:, grid.notna().any()]
    array = grid.to_numpy(dtype=float)
    cells = np.ma.masked_where(~np.isfinite(array) | ((array <= 0) & (not signed)), array)
    image = ax.pcolormesh(grid.columns, grid.index, cells, norm=scale, cmap="magma", shading="nearest")
    ax.set_yticks(block_ticks(int(grid.index.max())))
    ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))  # whole steps
    ax.tick_params(labelsize="x-small")
    ax.set_title(title, fontsize="small")
    if cells.count():
        i, j = np.unravel_index(np.ma.argmax(cells), cells.shape)
        ax.text(0.98, 0.97, f"max {cells[i, j]:.3g} (block {grid.index[i]}, step {grid.columns[j]})",
                transform=ax.transAxes, ha="right", va="top", fontsize=6.5,
                bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "alpha": 0.8, "linewidth": 0})
    return image


def save_blocks_plot(source: str | Path | Folder, output: str | Path | None = None,
                     metric: str = "fc2_update") -> Path:
    """Write `blocks_figure` of a sweep folder's blocks.csv files; return the path."""
    folder = as_folder(source)
    output = Path(output) if output else folder.path / f"blocks-{metric}.png"
    tidy = folder.blocks(all_config=True)
    keys = [k for k in varying_keys(tidy) if k != "seed"]  # among the runs that logged blocks
    fig = blocks_figure(tidy, keys, metric)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output
