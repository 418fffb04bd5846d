"""Figures from a sweep's output folder (matplotlib, Agg backend: no display needed; no torch).

- `facets`: the panels, palettes, legend, titles and reference lines every sweep figure shares;
- `curves`: a metric per step (`curves_figure`), the final loss against the learning rate (`lr_figure`)
  or a numeric key (`final_loss_figure`);
- `phase`: where the runs train: the phase diagram (`phase_figure`, a scatter for sampled points) and
  the share of runs trained (`trained_fraction_figure`);
- `sweep`: a folder's figures drawn (`sweep_figures`) and saved (`save_plots`) as PNG, PDF or SVG;
- `blocks`: per-block heatmaps of blocks.csv (`normexp plot --blocks`);
- `sharpness`: sharpness.csv's eigenvalues against their stability thresholds (`normexp plot --sharpness`);
- `gradnorm`: the gradnorm study's figures (`normexp gradnorm`).

They take the tidy frames of `normexp.results` and the numbers of `normexp.analysis` and return a
Figure. What a figure reads of the runs (each run's final value, trained or not, stopped early or not;
the numeric axes) is `normexp.analysis.finals`.
"""

import matplotlib

matplotlib.use("Agg")  # before any figure module imports pyplot: no display is needed, nor looked for

from normexp.figures.blocks import BLOCK_METRIC_LABELS, blocks_figure, save_blocks_plot  # noqa: E402
from normexp.figures.curves import BLOWUP_FACTOR, curves_figure, final_loss_figure, lr_figure  # noqa: E402
from normexp.figures.facets import Facets, choose_facets, number_texts  # noqa: E402
from normexp.figures.gradnorm import gradnorm_figure, layer_gradnorm_figure, save_gradnorm_plot  # noqa: E402
from normexp.figures.phase import (  # noqa: E402
    STOPPED_MARKER,
    TRAINED_EDGE,
    phase_figure,
    phase_scatter_figure,
    trained_fraction_figure,
)
from normexp.figures.sharpness import save_sharpness_plot, sharpness_figure  # noqa: E402
from normexp.figures.sweep import FORMATS, save_plots, sweep_figures  # noqa: E402

__all__ = ["BLOCK_METRIC_LABELS", "BLOWUP_FACTOR", "FORMATS", "STOPPED_MARKER", "TRAINED_EDGE", "Facets",
           "blocks_figure", "choose_facets", "curves_figure", "final_loss_figure", "gradnorm_figure",
           "layer_gradnorm_figure", "lr_figure", "number_texts", "phase_figure", "phase_scatter_figure",
           "save_blocks_plot", "save_gradnorm_plot", "save_plots", "save_sharpness_plot", "sharpness_figure",
           "sweep_figures", "trained_fraction_figure"]
