"""The studies' figures, drawn into each study's folder beside its runs: the sweep's own figures
(normexp/figures/), the placements' trained share, final loss against an axis, the per-block heat maps,
and the instabilities study's panels."""

from __future__ import annotations

from pathlib import Path

from normexp.analysis.variants import variant_label
from normexp.results import Folder, varying_keys
from normexp.studies.verdicts import flag

BLOCKS_FIGURES = ("fc2_update", "fc2_grad", "stream_rms")
HEATMAP_LR = 0.1  # the heat maps: the grid's lr nearest this, where logits grow without qk-norm


def study_figures(folder: Folder, x_key: str | None = None) -> list[str]:
    """The figures of one study's folder, as paths relative to the studies' folder (REPORT.md's links)."""
    import matplotlib.pyplot as plt

    from normexp.figures import final_loss_figure, save_blocks_plot, save_plots, trained_fraction_figure

    run_dir = folder.path
    if run_dir.name == "instabilities":  # 24 designs x 9 lrs: one panel per design, not one line per variant
        return [str(p.relative_to(run_dir.parent)) for p in instabilities_figures(folder)]
    paths = save_plots(folder, run_dir / "loss.png")
    varying = varying_keys(folder.latest)
    if "norm.placement" in varying and "norm.kind" in varying:  # the placements study: where each pair trains
        fig = trained_fraction_figure(folder.latest, "norm.placement", "norm.kind", folder.trained_rule())
        fig.savefig(run_dir / "trained.png", dpi=150)
        plt.close(fig)
        paths.append(run_dir / "trained.png")
    if x_key:
        fig = final_loss_figure(folder.latest.copy(), x_key, folder.trained_rule())
        fig.savefig(run_dir / "final_loss.png", dpi=120)
        paths.append(run_dir / "final_loss.png")
    if run_dir.name == "blocks":
        paths += [save_blocks_plot(folder, metric=metric) for metric in BLOCKS_FIGURES]
    return [str(p.relative_to(run_dir.parent)) for p in paths]


def instabilities_figures(folder: Folder) -> list[Path]:
    """final_loss-lr.png: per design (placement across, kind down) the final loss against lr, one line per
    (qk-norm, z-loss), mean over seeds (a diverged run at its loss at init, as the LR sensitivity counts
    it); then the block heat maps of the largest attention logit, the attention entropy and log Z at lr
    the grid's lr nearest HEATMAP_LR, the widest width, without the z-loss: placements across, kind x qk-norm down."""
    import matplotlib.pyplot as plt

    from normexp.analysis.sensitivity import lr_table
    from normexp.figures import BLOCK_METRIC_LABELS, blocks_figure

    table, _ = lr_table(folder)
    table["model.qk_norm"] = table["model.qk_norm"].map(flag)
    table["train.z_loss"] = table["train.z_loss"].astype(float)
    table["optim.lr"] = table["optim.lr"].astype(float)
    placements = list(dict.fromkeys(table["norm.placement"]))
    kinds = list(dict.fromkeys(table["norm.kind"]))
    fig, axes = plt.subplots(len(kinds), len(placements), figsize=(4.2 * len(placements), 3.4 * len(kinds)),
                             squeeze=False, sharex=True, sharey=True, layout="constrained")
    for (placement, kind), group in table.groupby(["norm.placement", "norm.kind"], sort=False):
        ax = axes[kinds.index(kind), placements.index(placement)]
        widths = sorted(group["model.width"].astype(int).unique())
        for (qk, z, width), line in group.groupby(["model.qk_norm", "train.z_loss", group["model.width"].astype(int)]):
            mean = line.groupby("optim.lr")["clipped"].mean()
            shown = f", width {width}" if len(widths) > 1 else ""  # a width axis: one line per width, wider darker
            ax.plot(mean.index, mean.to_numpy(), marker="o", linestyle="-" if qk else "--",
                    alpha=0.4 + 0.6 * (widths.index(width) + 1) / len(widths),
                    label=f"qk-norm {'on' if qk else 'off'}, z-loss {z:g}{shown}")
        ax.set_xscale("log")
        ax.set_title(variant_label({"norm.placement": placement, "norm.kind": kind}))
        ax.set_xlabel("optim.lr")
        ax.grid(True, alpha=0.3)
    axes[0, 0].set_ylabel("final loss (mean over seeds)")
    axes[0, 0].legend(fontsize="small")
    fig.suptitle("final training loss vs learning rate per design (a diverged run counts as its loss at init)")
    paths = [folder.path / "final_loss-lr.png"]
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)

    tidy = folder.blocks(all_config=True)
    lrs = tidy["optim.lr"].astype(float)
    near = float(lrs.iloc[(lrs - HEATMAP_LR).abs().argmin()])  # the grid's lr nearest HEATMAP_LR
    widest = tidy["model.width"].astype(int).max()
    chosen = tidy[(lrs == near) & (tidy["train.z_loss"].astype(float) == 0.0)
                  & (tidy["model.width"].astype(int) == widest)]
    if chosen.empty:
        return paths
    for metric in ("attn_logit_max", "attn_entropy", "log_z"):
        fig = blocks_figure(chosen.copy(), ["norm.placement", "norm.kind", "model.qk_norm"], metric)
        fig.suptitle(f"per-block dynamics: {BLOCK_METRIC_LABELS[metric]} (lr {near:.3g}, width {widest}, no z-loss)")
        path = folder.path / f"blocks-{metric}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths
