"""A sweep folder's figures, drawn and saved: the curves, the final loss against the learning rate
when it has >= 3 values, and the phase diagram when two numeric axes vary (`save_plots`,
`sweep_figures`), as PNG, PDF or SVG.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from normexp.analysis.finals import hold_stopped, is_sampled, numeric_axes
from normexp.analysis.sensitivity import LR_KEY, MIN_LRS, lr_table
from normexp.analysis.variants import distinct_keys, engine_note
from normexp.figures.curves import curves_figure, lr_figure
from normexp.figures.facets import Facets, choose_facets, value_counts
from normexp.figures.phase import phase_figure
from normexp.results import Folder, as_folder, check_metric, finished_runs, missing_note, varying_keys

FORMATS = ("png", "pdf", "svg")
DPI = 150


def save_plots(source: str | Path | Folder, output: str | Path | None = None, metric: str | None = None,
               fmt: str | None = None, dpi: int = DPI, row: Sequence[str] | None = None,
               col: Sequence[str] | None = None, hue: Sequence[str] | None = None,
               trained_below: float | None = None) -> list[Path]:
    """Write the curves figure (and the final loss against the lr when the lr has >= 3 values, and the
    phase diagram of the metric when two numeric axes vary); return the paths. `metric` defaults to the
    sweep's report.metric, `trained_below` to its report.trained_below; `fmt` to `output`'s suffix, else
    png. Runs missing, failed or corrupt are drawn nowhere, and named at the foot of each figure."""
    folder = as_folder(source)
    metric = metric or folder.sweep.report.metric
    fmt = fmt or (Path(output).suffix.lstrip(".").lower() if output and Path(output).suffix else "png")
    output = Path(output) if output else folder.path / f"{metric}.{fmt}"
    output = output.with_suffix(f".{fmt}")
    return [_save(fig, output.with_name(f"{output.stem}{suffix}{output.suffix}"), note, dpi)
            for suffix, fig, note in sweep_figures(folder, metric, row, col, hue, trained_below)]


def sweep_figures(folder: Folder, metric: str | None = None, row: Sequence[str] | None = None,
                  col: Sequence[str] | None = None, hue: Sequence[str] | None = None,
                  trained_below: float | None = None) -> list[tuple[str, Figure, str]]:
    """`save_plots`' figures, drawn but not saved: (file-name suffix: '', '-lr', '-phase'; the figure; the
    note for its foot: engines mixed, runs missing)."""
    run_dir, summary = folder.path, folder.summary
    metric = metric or folder.sweep.report.metric
    rule = folder.trained_rule(trained_below)
    tidy = folder.metrics(all_config=True)
    check_metric(tidy, metric)
    # folders compared whose sweep varies with a key (each at its own depth): one key makes the panels, not two
    keys, _ = distinct_keys(summary, [k for k in varying_keys(summary) if k != "seed"])
    facets = choose_facets(keys, row, col, hue, value_counts(summary, keys))
    note = "\n".join(filter(None, [engine_note(summary, keys), missing_note(summary, run_dir)]))
    curves = curves_figure(hold_stopped(tidy), keys, metric, facets=facets, trained_below=rule)  # stopped: held
    figures = [("", curves, note)]
    axes = numeric_axes(summary)
    sampled_lr = any(is_sampled(finished_runs(summary), LR_KEY, k) for k in axes if k != LR_KEY)
    if LR_KEY in summary and summary[LR_KEY].nunique() >= MIN_LRS and not sampled_lr:  # else: the scatter
        table, others = lr_table(folder)
        others, _ = distinct_keys(table, others)
        lr_facets = (_lines_first(_without(facets, LR_KEY)) if LR_KEY in facets.keys
                     else choose_facets(others, counts=value_counts(table, others)))
        figures.append(("-lr", lr_figure(table, others, facets=lr_facets, trained_below=rule), note))
    if len(axes) >= 2:
        others = [k for k in keys if k not in axes[:2]]
        phase_facets = _without(_without(facets, axes[0]), axes[1]) if (row or col or hue) else choose_facets(
            others, hue=[])
        figures.append(("-phase", phase_figure(tidy, axes[0], axes[1], metric, phase_facets, rule), note))
    return figures


def _lines_first(facets: Facets) -> Facets:
    """Facets whose hue emptied (the lr was the curves' hue; on the lr figure it is the x axis): the
    panels' key becomes the hue (the line style's key, if any, the panels'), so that the variants are
    compared in one panel, not one line each."""
    if facets.hue:
        return facets
    if facets.col:
        return Facets(facets.row if facets.style else [], facets.style or facets.row, facets.col)
    return Facets([], facets.style, facets.row) if facets.row else Facets(facets.row, facets.col, facets.style)


def _without(facets: Facets, key: str) -> Facets:
    return Facets(*([k for k in keys if k != key] for keys in (facets.row, facets.col, facets.hue, facets.style)))


def _save(fig: Figure, path: Path, note: str = "", dpi: int = DPI) -> Path:
    _footnote(fig, note)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _footnote(fig: Figure, note: str) -> None:
    if note:
        fig.text(0.005, 0.005, note, fontsize="x-small", color="darkred", ha="left", va="bottom", wrap=True)
