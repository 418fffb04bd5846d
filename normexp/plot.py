"""Figures from a sweep's output folder (matplotlib, Agg backend: no display needed).

- `curves_figure`: one line per variant (the mean over seeds), a shaded min–max band over seeds,
  log y for the loss, chance level ln(n) as a dotted line (n: n_classes, or a Transformer's vocab).
  Each legend entry says how many runs its line covers and how many of them diverged (their curves
  stop, so later means cover fewer).
- `phase_figure`: for two numeric grid axes (e.g. optim.lr x schedule.warmup_steps), a heatmap of
  the final loss per placement (one panel each, one shared log colour scale): where does each
  placement train? Where the two axes were sampled (a sweep's `sample:` section: their values are no
  grid, most (x, y) cells would be empty), a scatter of the points instead, labelled as such
  (`phase_scatter_figure`), never an interpolated map.
- `blocks_figure` (`normexp plot --blocks`): per variant, a heatmap of one per-block quantity of
  blocks.csv over (block, step), seeds averaged, one shared log colour scale, placements side by side;
  under each, the first, middle and last block over steps.

Both take the tidy frames of `normexp.results` and return a Figure; `save_plots` writes the PNGs.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from normexp.analysis.gradnorm import SUBLAYERS, LayerGradnorm  # noqa: E402
from normexp.analysis.sensitivity import LR_KEY, MIN_LRS, lr_table  # noqa: E402
from normexp.analysis.variants import engine_note, n_choices, trained_threshold, variant_groups  # noqa: E402
from normexp.results import (  # noqa: E402
    Folder,
    as_folder,
    check_metric,
    finished_runs,
    missing_note,
    varying_keys,
)

METRIC_LABELS = {"loss": "training loss (cross-entropy)", "acc": "training accuracy",
                 "grad_norm": "gradient norm (global L2)", "lr": "learning rate",
                 "val_loss": "held-out loss (answer positions)", "val_acc": "held-out accuracy (answer positions)"}
BLOCK_METRIC_LABELS = {  # the per-block columns of blocks.csv (normexp/blocklog.py)
    "fc1_grad": "||dLoss/dW|| of fc1", "fc2_grad": "||dLoss/dW|| of fc2",
    "fc1_update": "update ||ΔW|| / ||W|| of fc1", "fc2_update": "update ||ΔW|| / ||W|| of fc2",
    "stream_rms": "RMS of the residual stream at the block output", "norm_rms": "RMS of the block norm's output",
    "norm_out_rms": "RMS of the branch norm's output (Sandwich, Peri)",
}


def curves_figure(tidy: pd.DataFrame, keys: list[str], metric: str = "loss", title: str = "") -> Figure:
    """Mean curve per variant with a min–max band over seeds. More than 8 variants are split into
    one panel per value of the first key, so that each panel stays readable."""
    n_variants = len(variant_groups(tidy, keys))
    facet = keys[:1] if n_variants > 8 and len(keys) > 1 else []
    panels = variant_groups(tidy, facet) if facet else [("", tidy)]
    cols = min(len(panels), 2)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, 4.8 * rows), squeeze=False, sharey=True,
                             layout="constrained")
    for ax, (panel, group) in zip(axes.flat, panels):
        _draw_curves(ax, group, [k for k in keys if k not in facet], metric)
        ax.set_title(panel)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title or f"{metric} per step (line: mean over seeds, band: min–max)")
    return fig


def _draw_curves(ax, tidy: pd.DataFrame, keys: list[str], metric: str) -> None:
    variants = variant_groups(tidy, keys)
    colours = plt.get_cmap("tab10" if len(variants) <= 10 else "viridis")
    for i, (label, group) in enumerate(variants):
        colour = colours(i if len(variants) <= 10 else i / max(1, len(variants) - 1))
        finite = group[group["loss"].astype(float).map(math.isfinite)]
        stats = finite.groupby("step")[metric].agg(["mean", "min", "max", "count"])
        ax.plot(stats.index, stats["mean"], color=colour, label=f"{label}{_coverage(group)}")
        if group["run_id"].nunique() > 1:
            ax.fill_between(stats.index, stats["min"], stats["max"], color=colour, alpha=0.15, linewidth=0)
    if metric in ("loss", "grad_norm"):
        ax.set_yscale("log")
    if metric == "loss" and "model.n_classes" in tidy:
        for n in _chances(tidy):
            ax.axhline(math.log(n), color="grey", linestyle=":", linewidth=1, label=f"chance, ln {n}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(METRIC_LABELS.get(metric, metric))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="x-small" if len(variants) > 8 else "small")


def _chances(frame: pd.DataFrame) -> list[int]:
    """Each distinct number of choices among the runs (`report.n_choices`: n_classes, or a Transformer's
    vocabulary): one chance line, ln(n), per value."""
    return list(dict.fromkeys(int(n) for n in n_choices(frame)))


def _coverage(runs: pd.DataFrame) -> str:
    """' (n=4, 2 diverged)': how many runs an aggregate covers and how many diverged ('' for one
    run that did not diverge)."""
    status = runs.groupby("run_id")["status"].first()
    diverged = int((status == "diverged").sum())
    if len(status) == 1:
        return " (diverged)" if diverged else ""
    return f" (n={len(status)}, {diverged} diverged)" if diverged else f" (n={len(status)})"


def _tick(value: object) -> str:
    return "null" if pd.isna(value) else f"{value:g}"


def numeric_axes(summary: pd.DataFrame) -> list[str]:
    """Varying config keys (not the seed) whose values are numbers: candidates for a phase diagram."""
    out = []
    for key in varying_keys(summary):
        column = summary[key]
        if key != "seed" and pd.api.types.is_numeric_dtype(column) and not pd.api.types.is_bool_dtype(column):
            out.append(key)
    return out


def phase_figure(summary: pd.DataFrame, x_key: str, y_key: str) -> Figure:
    """Final loss (mean over seeds) on the x_key x y_key grid, one panel per other variant (a scatter where
    the two axes were sampled: `phase_scatter_figure`)."""
    finished = finished_runs(summary).copy()
    finished["final_loss"] = finished["final_loss"].astype(float).where(np.isfinite(finished["final_loss"]))
    if is_sampled(finished, x_key, y_key):
        return phase_scatter_figure(finished, x_key, y_key)
    others = [k for k in varying_keys(summary) if k not in ("seed", x_key, y_key)]
    panels = variant_groups(finished, others)
    values = finished["final_loss"].dropna()
    vmin, vmax = max(values.min(), 1e-4) if len(values) else 1e-4, max(values.max(), 1e-3) if len(values) else 10
    cols = min(len(panels), 3)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.8 * rows), squeeze=False, layout="constrained")
    image = None
    for ax, (label, group) in zip(axes.flat, panels):
        stats = group.groupby([y_key, x_key], dropna=False)["final_loss"].agg(["mean", "count", "size"])
        grid, finite, runs = (stats[c].unstack(x_key) for c in ("mean", "count", "size"))
        image = ax.imshow(grid.to_numpy(dtype=float), norm=LogNorm(vmin=vmin, vmax=vmax), cmap="viridis_r",
                          aspect="auto", origin="lower")
        ax.set_xticks(range(len(grid.columns)), [_tick(v) for v in grid.columns], rotation=45)
        ax.set_yticks(range(len(grid.index)), [_tick(v) for v in grid.index])
        ax.set_xlabel(x_key)
        ax.set_ylabel(y_key)
        ax.set_title(label)
        for (i, j), value in np.ndenumerate(grid.to_numpy(dtype=float)):
            ax.text(j, i, _phase_text(value, finite.iat[i, j], runs.iat[i, j]), ha="center", va="center",
                    fontsize="x-small",
                    color="white" if not math.isnan(value) and value > math.sqrt(vmin * vmax) else "black")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if image is not None:
        fig.colorbar(image, ax=axes, label="final loss (mean over seeds, log scale)")
    fig.suptitle(f"phase diagram: final loss over {y_key} x {x_key} (div: all diverged; k/n: mean of the k of n "
                 "runs that did not diverge)")
    return fig


def _phase_text(mean: float, finite: float, runs: float) -> str:
    """A phase cell's label: the mean, with k/n when only k of its n runs did not diverge."""
    if pd.isna(runs) or runs == 0:
        return ""
    if finite == 0:
        return "div"
    return f"{mean:.2g}" if finite == runs else f"{mean:.2g}\n{int(finite)}/{int(runs)}"


def save_plots(source: str | Path | Folder, output: str | Path | None = None, metric: str = "loss") -> list[Path]:
    """Write the curves figure (and the phase diagram when two numeric axes vary); return the paths.
    Runs missing, failed or corrupt are drawn nowhere, and named at the foot of each figure."""
    folder = as_folder(source)
    run_dir, summary = folder.path, folder.summary
    output = Path(output) if output else run_dir / f"{metric}.png"
    tidy = folder.metrics(all_config=True)
    check_metric(tidy, metric)
    keys = [k for k in varying_keys(summary) if k != "seed"]
    note = "\n".join(filter(None, [engine_note(summary, keys), missing_note(summary, run_dir)]))
    paths = []
    fig = curves_figure(tidy, keys, metric)
    _footnote(fig, note)
    fig.savefig(output, dpi=120)
    plt.close(fig)
    paths.append(output)
    axes = numeric_axes(summary)
    finished = finished_runs(summary)
    sampled_lr = any(is_sampled(finished, LR_KEY, k) for k in axes if k != LR_KEY)  # the phase scatter shows it
    if summary["optim.lr"].nunique() >= MIN_LRS and not sampled_lr:
        fig = lr_figure(*lr_table(folder))
        _footnote(fig, note)
        by_lr = output.with_name(f"{output.stem}-lr{output.suffix}")
        fig.savefig(by_lr, dpi=120)
        plt.close(fig)
        paths.append(by_lr)
    if len(axes) >= 2:
        fig = phase_figure(summary, axes[0], axes[1])
        _footnote(fig, note)
        phase = output.with_name(f"{output.stem}-phase{output.suffix}")
        fig.savefig(phase, dpi=120)
        plt.close(fig)
        paths.append(phase)
    return paths


def _footnote(fig: Figure, note: str) -> None:
    if note:
        fig.text(0.005, 0.005, note, fontsize="x-small", color="darkred", ha="left", va="bottom", wrap=True)


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


def final_loss_figure(summary: pd.DataFrame, x_key: str) -> Figure:
    """Final loss against a numeric key (e.g. model.depth), one line per other variant: the mean over
    seeds, with the min–max band."""
    finished = finished_runs(summary).copy()
    finished["final_loss"] = finished["final_loss"].astype(float).where(np.isfinite(finished["final_loss"]))
    others = [k for k in varying_keys(summary) if k not in ("seed", x_key)]
    fig, ax = plt.subplots(figsize=(7.5, 4.8), layout="constrained")
    for label, group in variant_groups(finished, others):
        stats = group.groupby(x_key)["final_loss"].agg(["mean", "min", "max"])
        line, = ax.plot(stats.index, stats["mean"], marker="o", label=f"{label}{_coverage(group)}")
        ax.fill_between(stats.index, stats["min"], stats["max"], color=line.get_color(), alpha=0.15, linewidth=0)
    classes = _chances(finished)
    for n in classes:
        ax.axhline(math.log(n), color="grey", linestyle=":", label=f"chance, ln {n}")
        ax.axhline(trained_threshold(n), color="grey", linestyle="--", linewidth=0.8,
                   label="trained below" + (f", {n} choices" if len(classes) > 1 else ""))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(x_key)
    ax.set_ylabel("final training loss")
    ax.set_title(f"final loss vs {x_key} (line: mean over seeds, band: min–max)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def lr_figure(table: pd.DataFrame, keys: list[str]) -> Figure:
    """Final loss against the learning rate (log x) from `sensitivity.lr_table`: one line per variant
    (mean over seeds) with its min–max band, one panel per warmup when the warmup varies."""
    facet = ["schedule.warmup_steps"] if "schedule.warmup_steps" in keys else []
    panels = variant_groups(table, facet) if facet else [("", table)]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False, sharey=True,
                             layout="constrained")
    lines = [k for k in keys if k not in facet]
    for ax, (panel, group) in zip(axes.flat, panels):
        variants = variant_groups(group, lines)
        colours = plt.get_cmap("tab10" if len(variants) <= 10 else "viridis")
        for i, (label, runs) in enumerate(variants):
            colour = colours(i if len(variants) <= 10 else i / max(1, len(variants) - 1))
            stats = runs.groupby(LR_KEY)["clipped"].agg(["mean", "min", "max", "count"])
            diverged = int((runs["status"] == "diverged").sum())
            ax.plot(stats.index, stats["mean"], marker="o", color=colour,
                    label=f"{label} (n={int(stats['count'].max())}" + (f", {diverged} div)" if diverged else ")"))
            ax.fill_between(stats.index, stats["min"], stats["max"], color=colour, alpha=0.15, linewidth=0)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(LR_KEY)
        ax.set_title(panel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="x-small" if len(variants) > 8 else "small")
    axes.flat[0].set_ylabel("final training loss, min(final, loss at init)")
    fig.suptitle("final training loss vs learning rate (whatever plot --metric)\n"  # two lines: one panel is narrow
                 "line: mean over seeds, band: min–max; a diverged run counts as its loss at init", fontsize="medium")
    return fig


# ----------------------------------------------------------------------------- per-block dynamics


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
    for row, (row_label, row_group) in enumerate(rows):
        panels = variant_groups(row_group, across, everything="")
        image = None
        for col, (label, group) in enumerate(panels):
            title = " ".join(part for part in (label, row_label) if part) or "all runs"
            title += f" (n={group['run_id'].nunique()})"
            why = _why_empty(group, metric)
            if why:  # nothing to draw on a log scale: an empty panel that says why, not a matplotlib error
                _empty_panel(axes[2 * row, col], title, why)
                _empty_panel(axes[2 * row + 1, col], "", why)
                continue
            image = _block_heatmap(axes[2 * row, col], group, metric, scale, title)
            _block_lines(axes[2 * row + 1, col], group, metric)
        for col in range(len(panels), n_cols):
            axes[2 * row, col].set_visible(False)
            axes[2 * row + 1, col].set_visible(False)
        if image is not None:
            fig.colorbar(image, ax=list(axes[2 * row]), label=f"{metric} (mean over seeds, log scale)", shrink=0.9)
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


def _block_heatmap(ax, group: pd.DataFrame, metric: str, scale: LogNorm, title: str):
    """Blocks up, steps across; empty cells: non-finite or zero (the last step has no update)."""
    grid = group.groupby(["block", "step"])[metric].mean().unstack("step")
    grid = grid.loc[:, grid.notna().any()]
    cells = np.ma.masked_where(~np.isfinite(grid.to_numpy(dtype=float)) | (grid.to_numpy(dtype=float) <= 0),
                               grid.to_numpy(dtype=float))
    image = ax.pcolormesh(grid.columns, grid.index, cells, norm=scale, cmap="magma", shading="nearest")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("block (1 = input side)")
    ax.set_title(title)
    return image


def _block_lines(ax, group: pd.DataFrame, metric: str) -> None:
    depth = int(group["block"].max())
    picked = dict.fromkeys([1, (depth + 1) // 2, depth])  # first, middle, last (once each at small depth)
    for block, name in zip(picked, ("first", "middle", "last")):
        stats = group[group["block"] == block].groupby("step")[metric].agg(["mean", "min", "max"]).dropna()
        line, = ax.plot(stats.index, stats["mean"], marker=".", label=f"block {block} ({name})")
        ax.fill_between(stats.index, stats["min"], stats["max"], color=line.get_color(), alpha=0.15, linewidth=0)
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


def is_sampled(finished: pd.DataFrame, x_key: str, y_key: str) -> bool:
    """Whether the runs' (x, y) values fill under half the cells of their x x y grid: sampled points (a
    sweep's `sample:` section), not a grid, so a heatmap would be mostly empty cells."""
    pairs = finished[[x_key, y_key]].drop_duplicates()
    cells = finished[x_key].nunique(dropna=False) * finished[y_key].nunique(dropna=False)
    return cells > 0 and len(pairs) < cells / 2


def phase_scatter_figure(finished: pd.DataFrame, x_key: str, y_key: str) -> Figure:
    """Sampled points: each run's (x, y) coloured by its final loss (log scale, one shared scale), a cross
    where it diverged; one panel per other variant. A scatter of what ran, not an interpolated map."""
    others = [k for k in varying_keys(finished) if k not in ("seed", x_key, y_key)]
    panels = variant_groups(finished, others)
    values = finished["final_loss"].dropna()
    norm = LogNorm(vmin=max(values.min(), 1e-4) if len(values) else 1e-4,
                   vmax=max(values.max(), 1e-3) if len(values) else 10)
    cols = min(len(panels), 3)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.8 * rows), squeeze=False, layout="constrained")
    image = None
    for ax, (label, group) in zip(axes.flat, panels):
        ok = group[group["final_loss"].notna()]
        bad = group[group["final_loss"].isna()]
        image = ax.scatter(ok[x_key], ok[y_key], c=ok["final_loss"], norm=norm, cmap="viridis_r", s=28,
                           edgecolors="black", linewidths=0.3)
        if len(bad):
            ax.scatter(bad[x_key], bad[y_key], marker="x", color="red", s=28, label=f"diverged ({len(bad)})")
            ax.legend(fontsize="x-small", loc="best")
        for key, setter in ((x_key, ax.set_xscale), (y_key, ax.set_yscale)):
            column = group[key].astype(float)
            if (column > 0).all() and column.max() / column.min() > 20:
                setter("log")
        ax.set_xlabel(x_key)
        ax.set_ylabel(y_key)
        ax.set_title(f"{label} ({len(group)} runs)")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if image is not None:
        fig.colorbar(image, ax=axes, label="final loss (each run, log scale)")
    fig.suptitle(f"sampled points, a scatter (not interpolated): final loss of each run\nover {y_key} x {x_key}"
                 + ("; x: diverged" if finished["final_loss"].isna().any() else ""))
    return fig
