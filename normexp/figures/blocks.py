"""Per-block dynamics (`normexp plot --blocks`): per variant, a heatmap of one per-block quantity of
blocks.csv over (block, step), seeds averaged, one shared log colour scale, placements side by side;
under each, the first, middle and last block over steps.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.colors import LogNorm, Normalize, SymLogNorm
from matplotlib.figure import Figure

from normexp.analysis.variants import variant_groups
from normexp.results import Folder, as_folder, varying_keys

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


def blocks_figure(tidy: pd.DataFrame, keys: list[str], metric: str = "fc2_update") -> Figure:
    """Per variant (columns: placements side by side; rows: the other varying keys), a heatmap of
    `metric` over (step, block), the mean over seeds on one log colour scale shared by every panel,
    and under it the first, middle and last block over steps (mean, min–max band over seeds)."""
    across = [k for k in keys if k == "norm.placement"]
    down = [k for k in keys if k not in across]
    rows = variant_groups(tidy, down, everything="")
    n_cols = max(len(variant_groups(group, across)) for _, group in rows)
    fig, axes = plt.subplots(2 * len(rows), n_cols, figsize=(5.2 * n_cols, 7.4 * len(rows)), squeeze=False,
                             layout="constrained", height_ratios=[1.4, 1] * len(rows))
    values = tidy[metric].astype(float)
    positive = values[np.isfinite(values) & (values > 0)]
    scale = LogNorm(vmin=positive.min(), vmax=positive.max()) if len(positive) else LogNorm(1e-3, 1)
    finite = values[np.isfinite(values)]
    signed = metric in SIGNED_BLOCK_METRICS and bool((finite <= 0).any())
    if signed:  # an attention logit or a log Z at or below 0 is a value, not a gap: symmetric log, linear near 0
        scale = SymLogNorm(linthresh=1.0, vmin=finite.min(), vmax=max(finite.max(), finite.min() + 1e-9))
    for row, (row_label, row_group) in enumerate(rows):
        panels = variant_groups(row_group, across, everything="")
        image = None
        for col, (label, group) in enumerate(panels):
            title = " ".join(part for part in (label, row_label) if part) or "all runs"
            title += f" (n={group['run_id'].nunique()})"
            why = "" if signed and np.isfinite(group[metric].astype(float)).any() else _why_empty(group, metric)
            if why:  # nothing to draw on a log scale: an empty panel that says why, not a matplotlib error
                _empty_panel(axes[2 * row, col], title, why)
                _empty_panel(axes[2 * row + 1, col], "", why)
                continue
            image = _block_heatmap(axes[2 * row, col], group, metric, scale, title, signed)
            _block_lines(axes[2 * row + 1, col], group, metric, signed)
        for col in range(len(panels), n_cols):
            axes[2 * row, col].set_visible(False)
            axes[2 * row + 1, col].set_visible(False)
        if image is not None:
            fig.colorbar(image, ax=list(axes[2 * row]), shrink=0.9,
                         label=f"{metric} (mean over seeds, {'symmetric log' if signed else 'log'} scale)")
    fig.suptitle(f"per-block dynamics: {BLOCK_METRIC_LABELS.get(metric, metric)}")
    return fig


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
    note = ax.text(0.5, 0.5, textwrap.fill(why, 34), ha="center", va="center", transform=ax.transAxes,
                   fontsize="small")
    note.set_in_layout(False)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(title)


def _block_heatmap(ax, group: pd.DataFrame, metric: str, scale: Normalize, title: str, signed: bool = False):
    """Blocks up, steps across; empty cells: non-finite, or (`signed` false) zero or below (the last step
    has no update)."""
    grid = group.groupby(["block", "step"])[metric].mean().unstack("step")
    grid = grid.loc[:, grid.notna().any()]
    array = grid.to_numpy(dtype=float)
    cells = np.ma.masked_where(~np.isfinite(array) | ((array <= 0) & (not signed)), array)
    image = ax.pcolormesh(grid.columns, grid.index, cells, norm=scale, cmap="magma", shading="nearest")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("block (1 = input side)")
    ax.set_title(title)
    return image


def _block_lines(ax, group: pd.DataFrame, metric: str, signed: bool = False) -> None:
    depth = int(group["block"].max())
    picked = dict.fromkeys([1, (depth + 1) // 2, depth])  # first, middle, last (once each at small depth)
    for block, name in zip(picked, ("first", "middle", "last")):
        stats = group[group["block"] == block].groupby("step")[metric].agg(["mean", "min", "max"]).dropna()
        line, = ax.plot(stats.index, stats["mean"], marker=".", label=f"block {block} ({name})")
        ax.fill_between(stats.index, stats["min"], stats["max"], color=line.get_color(), alpha=0.15, linewidth=0)
    if signed:
        ax.set_yscale("symlog", linthresh=1.0)
    else:
        ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(metric)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")


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
