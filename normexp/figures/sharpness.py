"""Sharpness against its stability thresholds (`normexp plot --sharpness`, and with the other figures where
the folder's runs measured it): one panel per variant, seeds as thin lines, over the measured steps:

    lambda_max           the top Hessian eigenvalue, beside 2/lr (gradient descent's threshold)
    precond_lambda_max   Adam's preconditioned one, beside (2 + 2 beta1) / ((1 - beta1) lr)

on a log y axis (sharpness.csv's columns, normexp/sharpness.py). A value at or below 0, nan (no second moment
yet, SGD) or inf (lr 0) is not drawn.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from normexp.analysis.variants import variant_groups
from normexp.results import Folder, as_folder, varying_keys

# (sharpness column, its threshold column, colour, label)
SHARPNESS_CURVES = (
    ("lambda_max", "threshold_gd", "tab:blue", "λ_max", "2/lr"),
    ("precond_lambda_max", "threshold_adam", "tab:orange", "preconditioned λ_max", "(2+2β1)/((1-β1) lr)"),
)
PANEL_COLUMNS = 4  # panels per row at most


def sharpness_figure(tidy: pd.DataFrame, keys: list[str]) -> Figure:
    """One panel per variant (the runs grouped by `keys`): each seed's lambda_max and precond_lambda_max
    (solid) and their thresholds (dashed) over steps, log y."""
    panels = variant_groups(tidy, keys)
    n_cols = min(PANEL_COLUMNS, len(panels))
    n_rows = math.ceil(len(panels) / n_cols)
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(4.6 * n_cols, 3.6 * n_rows), squeeze=False,
                             layout="constrained", sharey=True)
    for ax, (label, group) in zip(axes.flat, panels):
        drawn = False
        for value, threshold, colour, value_label, threshold_label in SHARPNESS_CURVES:
            for i, (_, run) in enumerate(group.groupby("run_id", sort=False)):
                run = run.sort_values("step")
                drawn |= _line(ax, run["step"], run[value], colour, "-", value_label if i == 0 else None)
                drawn |= _line(ax, run["step"], run[threshold], colour, "--", threshold_label if i == 0 else None,
                               alpha=0.6)
        ax.set_title(textwrap.fill(f"{label} (n={group['run_id'].nunique()})", 48), fontsize="small")
        ax.set_xlabel("optimizer step")
        ax.grid(True, which="both", alpha=0.3)
        if drawn:
            ax.set_yscale("log")
            ax.legend(fontsize="x-small")
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel("eigenvalue / threshold")
    fig.suptitle("sharpness against its stability thresholds (dashed)")
    return fig


def _line(ax, steps: pd.Series, values: pd.Series, colour: str, style: str, label: str | None,
          alpha: float = 0.9) -> bool:
    """Draw the finite positive points of `values`; whether there were any."""
    y = values.astype(float).to_numpy()
    keep = np.isfinite(y) & (y > 0)
    if not keep.any():
        return False
    ax.plot(steps.to_numpy()[keep], y[keep], style, color=colour, alpha=alpha, linewidth=1.1, label=label)
    return True


def save_sharpness_plot(source: str | Path | Folder, output: str | Path | None = None,
                        keys: list[str] | None = None) -> Path:
    """Write `sharpness_figure` of a sweep folder's sharpness.csv files (default: FOLDER/sharpness.png), one
    panel per value of `keys` (default: every key that varies among them but the seed)."""
    folder = as_folder(source)
    output = Path(output) if output else folder.path / "sharpness.png"
    tidy = folder.sharpness(all_config=True)
    keys = keys if keys is not None else [k for k in varying_keys(tidy) if k != "seed"]
    fig = sharpness_figure(tidy, keys)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output
