"""The gradnorm study's figures (`normexp gradnorm`): gradients and hidden-state norms at init against
depth and layer, beside Xiong et al. 2020's predictions.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from normexp.analysis.gradnorm import SUBLAYERS, LayerGradnorm


def gradnorm_figure(summary) -> Figure:  # summary: normexp.analysis.gradnorm.GradnormSummary
    """Left: the last block's gradient against depth (log-log) with the fitted slope per placement.
    Right: ||x_l||^2/d along the deepest model's stream, with Xiong et al.'s Lemma 2 predictions."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6), layout="constrained")
    depths = np.array(summary.depths, dtype=float)
    for placement, stats in summary.last_grad.items():
        means = np.array([m for m, _ in stats])
        stds = np.array([s for _, s in stats])
        line = left.errorbar(depths, means, yerr=np.nan_to_num(stds), marker="o", capsize=3,  # nan: one seed
                             label=f"{placement} (slope {summary.slopes[placement]:+.2f})")[0]
        if len(depths) > 1:  # a slope needs two depths
            fit = np.polyfit(np.log(depths), np.log(means), 1)
            left.plot(depths, np.exp(np.polyval(fit, np.log(depths))), color=line.get_color(), linestyle="--",
                      alpha=0.6)
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("depth L (blocks)")
    left.set_ylabel("||dLoss / dW_fc2|| of block L, at init")
    left.set_title("last-block gradient vs depth (Xiong: Post flat, Pre ~ L^-1/2)")
    left.grid(True, which="both", alpha=0.3)
    left.legend()
    for placement, stream in summary.stream_sq.items():
        blocks = np.arange(1, len(stream) + 1)
        right.plot(blocks, stream, marker=".", label=f"{placement}: ||x_l||^2/d (stream)")
        norm_in = np.array(summary.norm_in_sq[placement])
        if placement.split()[0] == "post" and not np.all(np.isnan(norm_in)):
            right.plot(blocks, norm_in, marker=".", label="post: ||x + F(x)||^2/d (norm input)")
    blocks = np.arange(1, summary.depths[-1] + 1)
    right.plot(blocks, 1 + (blocks - 1) / 2, color="grey", linestyle=":", label="Lemma 2, Pre-LN: 1 + l/2")
    right.axhline(1.5, color="black", linestyle=":", label="Lemma 2, Post-LN: 3/2")
    right.set_xlabel("block l")
    right.set_ylabel("||x||^2 / d, mean over samples and seeds")
    right.set_title(f"hidden-state norms at init, L = {summary.depths[-1]}")
    right.grid(True, alpha=0.3)
    right.legend(fontsize="small")
    return fig


def layer_gradnorm_figure(summary) -> Figure:  # summary: normexp.analysis.gradnorm.LayerGradnorm
    """The Transformer's gradient norm at init against the layer index, one panel per sublayer's output
    projection, one line per variant (mean ± std over seeds): Xiong et al. 2020, Figure 3."""
    fig, axes = plt.subplots(1, len(SUBLAYERS), figsize=(12, 4.6), layout="constrained")
    for ax, (column, label) in zip(axes, SUBLAYERS.items()):
        for variant, grads in summary.grads.items():
            stats = np.array(grads[column], dtype=float)
            own = ~np.isnan(stats[:, 0])  # the layers this variant's model has (a shallower depth: fewer)
            ax.errorbar(np.array(summary.layers)[own], stats[own, 0], yerr=np.nan_to_num(stats[own, 1]), marker="o",
                        capsize=3, label=f"{variant} (last/first {summary.ratio(variant, column):.2f})")
        ax.set_yscale("log")
        ax.set_xlabel("layer l")
        ax.set_ylabel(f"||dLoss / dW|| of the {label} projection, at init")
        ax.set_title(f"{label}: Xiong Fig. 3 (Post grows with l, Pre flat)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    return fig


def save_gradnorm_plot(summary, path: str | Path) -> Path:  # summary: GradnormSummary | LayerGradnorm
    """Draw a gradnorm study's summary (`normexp.diagnostics.gradnorm_study`) to `path`."""
    figure = layer_gradnorm_figure(summary) if isinstance(summary, LayerGradnorm) else gradnorm_figure(summary)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return Path(path)
