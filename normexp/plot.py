"""Figures from a sweep's output folder (matplotlib, Agg backend: no display needed).

- `curves_figure`: per panel, one line per value of the hue (the mean over seeds) with a shaded
  min–max band over seeds; panels by row and column keys (`Facets`: by default a column per
  placement, or per the slowest-varying key, the hue for the fastest, a row for the next); log y for
  a loss, chance level ln(n) as a dotted line (n: n_classes, or a Transformer's vocab) and the trained
  threshold as a dashed one. Each panel's title says how many runs it covers and how many diverged.
- `phase_figure`: for two numeric grid axes (learning rate across, warmup up, by default), a heatmap
  of the final value of the metric asked for (mean over seeds), one panel per other variant, one
  shared colour scale; the cells whose every run trained are hatched: where does each placement train?
- `lr_figure`: final training loss against the learning rate (log x), the trained threshold dashed.
- `trained_fraction_figure`: the share of runs that trained on a grid of two keys (placement x norm kind).
- `blocks_figure` (`normexp plot --blocks`): per variant, a heatmap of one per-block quantity of
  blocks.csv over (block, step), seeds averaged, one shared log colour scale, placements side by side;
  under each, the first, middle and last block over steps.

Every figure labels a config key as a reader names it (`AXIS_LABELS`: "learning rate", "warmup steps"),
puts one legend outside its panels, colours a categorical hue with a categorical palette (tab10, then
line styles and markers past 10 values) and a numeric one with a sequential palette, and says in its
title the constants that define its runs. They take the tidy frames of `normexp.results` and return a
Figure; `save_plots` writes them as PNG, PDF or SVG.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.colors import LogNorm, Normalize, SymLogNorm  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

from normexp.analysis.gradnorm import SUBLAYERS, LayerGradnorm  # noqa: E402
from normexp.analysis.sensitivity import LR_KEY, MIN_LRS, lr_table  # noqa: E402
from normexp.analysis.variants import (  # noqa: E402
    CHOICE_KEYS,
    axis_label,
    constants,
    engine_note,
    is_null,
    is_trained,
    n_choices,
    short_number,
    thresholds,
    value_label,
    variant_groups,
    variant_label,
)
from normexp.results import (  # noqa: E402
    Folder,
    ResultsError,
    as_folder,
    check_metric,
    finished_runs,
    missing_note,
    varying_keys,
)

METRIC_LABELS = {"loss": "training loss (cross-entropy)", "acc": "training accuracy",
                 "grad_norm": "gradient norm (global L2)", "lr": "learning rate",
                 "val_loss": "held-out loss (answer positions)", "val_acc": "held-out accuracy (answer positions)",
                 "z_loss": "z-loss term, coef x mean log(Z)^2 (train.z_loss)"}
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
FINAL_LABELS = {"loss": "final training loss", "acc": "final training accuracy", "grad_norm": "final gradient norm",
                "lr": "final learning rate", "val_loss": "final held-out loss", "val_acc": "final held-out accuracy"}
FORMATS = ("png", "pdf", "svg")
DPI = 150
PANEL = (3.6, 2.7)  # one panel's size in inches
LEGEND_WIDTH = 2.4  # inches beside the panels for the one legend
WRAP = 4  # panels per row when one key makes them all
LOSSES = ("loss", "val_loss")  # metrics the trained threshold and the chance level apply to
STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
TRAINED_EDGE = "red"  # the border of the trained region on a phase diagram
SWEEP_KEY = "sweep"  # the column naming a run's sweep folder when several are compared


# ----------------------------------------------------------------------------- facets and palettes


@dataclass(frozen=True)
class Facets:
    """Which keys make the rows of panels, their columns, and the lines within a panel: their colour
    (the hue) and, for one key of few values beside it, their line style."""

    row: list[str]
    col: list[str]
    hue: list[str]
    style: list[str] = dataclasses.field(default_factory=list)  # at most one key: solid, dashed, dotted

    @property
    def keys(self) -> list[str]:
        return [*self.row, *self.col, *self.hue, *self.style]

    @property
    def lines(self) -> list[str]:
        return [*self.hue, *self.style]


STYLED = 3  # a key of at most this many values can draw line styles beside the hue


def choose_facets(keys: Sequence[str], row: Sequence[str] | None = None, col: Sequence[str] | None = None,
                  hue: Sequence[str] | None = None, counts: dict[str, int] | None = None) -> Facets:
    """Facets for the varying `keys` (in grid order: the first varies slowest). What is not given: the
    columns are the placement (else the sweep, else the slowest key); the hue the key left with the most
    values (`counts`; the fastest-varying on a tie, or without counts), and a key of at most STYLED values
    beside it the line style; the rows the next slowest key; any key still left joins the hue. One key
    alone is the hue (one panel)."""
    keys = list(keys)
    for option, given in (("--row", row), ("--col", col), ("--hue", hue)):
        unknown = [k for k in given or () if k not in keys]
        if unknown:
            raise ResultsError(f"{option} {','.join(unknown)}: not a varying config key of these runs "
                               f"(those: {', '.join(keys) or 'none'})")
    taken = [*(row or ()), *(col or ()), *(hue or ())]
    if len(set(taken)) < len(taken):
        raise ResultsError("--row, --col and --hue: a key can make only one of them")
    rest = [k for k in keys if k not in taken]
    if col is None and (len(rest) >= 2 or (hue is not None and rest)):
        first = SWEEP_KEY if SWEEP_KEY in rest else "norm.placement" if "norm.placement" in rest else rest[0]
        col, rest = [first], [k for k in rest if k != first]
    style: list[str] = []
    if hue is None:
        counts = counts or {}
        hue = [max(reversed(rest), key=lambda k: counts.get(k, 0))] if rest else []
        rest = [k for k in rest if k not in hue]
        few = [k for k in rest if 1 < counts.get(k, 0) <= STYLED]
        if hue and few:
            style = [min(reversed(few), key=lambda k: counts[k])]
            rest = [k for k in rest if k not in style]
    if row is None:
        row, rest = rest[:1], rest[1:]
    return Facets(list(row), list(col or []), [*rest, *hue], style)


def value_counts(frame: pd.DataFrame, keys: Sequence[str]) -> dict[str, int]:
    """How many values each key takes among `frame`'s runs (for `choose_facets`)."""
    return {k: int(frame[k].nunique(dropna=False)) for k in keys if k in frame}


def _values_label(keys: Sequence[str], values: object, texts: dict[str, dict] | None = None) -> str:
    """'Pre', 'lr=1e-3 warmup=2': one combination of `keys`' values as a legend or panel says it;
    `texts` (`_key_texts`) writes a key's numbers in its axis's one style."""
    values = values if isinstance(values, tuple) else (values,)
    if not keys:
        return ""

    def text(key: str, value: object) -> str:
        return (texts or {}).get(key, {}).get(value) or value_label(key, value)

    if len(keys) == 1 and keys[0] in ("norm.placement", "norm.kind", SWEEP_KEY):
        return text(keys[0], values[0])
    return " ".join(f"{_short(k)}={text(k, v)}" if k not in ("norm.placement", "norm.kind", SWEEP_KEY)
                    else text(k, v) for k, v in zip(keys, values))


def _key_texts(frame: pd.DataFrame, keys: Sequence[str]) -> dict[str, dict]:
    """Per numeric key, each of its values in `frame` written in one style (`number_texts`)."""
    out = {}
    for key in keys:
        column = frame[key]
        if pd.api.types.is_numeric_dtype(column) and not pd.api.types.is_bool_dtype(column):
            values = [v for v in dict.fromkeys(column) if not pd.isna(v)]
            out[key] = dict(zip(values, number_texts(values)))
    return out


def _short(key: str) -> str:
    return {"optim.lr": "lr", "schedule.warmup_steps": "warmup"}.get(key, axis_label(key).replace(" ", "_"))


def _groups(frame: pd.DataFrame, keys: Sequence[str]) -> list[tuple[object, pd.DataFrame]]:
    """The rows of `frame` per combination of `keys` (a tuple), numbers sorted, else in order of appearance."""
    if not keys:
        return [((), frame)]
    groups = list(frame.groupby(list(keys), sort=False, dropna=False))
    numeric = all(pd.api.types.is_numeric_dtype(frame[k]) and not pd.api.types.is_bool_dtype(frame[k]) for k in keys)
    if numeric:
        groups.sort(key=lambda item: tuple(-math.inf if pd.isna(v) else v for v in _tuple(item[0])))
    return [(_tuple(values), group) for values, group in groups]


def _tuple(values: object) -> tuple:
    return values if isinstance(values, tuple) else (values,)


@dataclass(frozen=True)
class Style:
    color: object
    linestyle: str
    marker: str | None


def palette(frame: pd.DataFrame, keys: Sequence[str]) -> dict[tuple, Style]:
    """A style per combination of `keys`: one numeric key, a sequential palette (viridis, by rank: low
    dark, high light); otherwise categorical: tab10, then past 10 values line styles and markers too."""
    combos = [values for values, _ in _groups(frame, keys)]
    numeric = len(keys) == 1 and pd.api.types.is_numeric_dtype(frame[keys[0]]) and \
        not pd.api.types.is_bool_dtype(frame[keys[0]]) and len(combos) > 2
    if numeric:
        cmap = plt.get_cmap("viridis")
        return {v: Style(cmap(0.9 * i / max(1, len(combos) - 1)), "-", None) for i, v in enumerate(combos)}
    cmap = plt.get_cmap("tab10")
    many = len(combos) > 10
    return {v: Style(cmap(i % 10), STYLES[(i // 10) % len(STYLES)] if many else "-",
                     MARKERS[i % len(MARKERS)] if many else None) for i, v in enumerate(combos)}


def line_styles(frame: pd.DataFrame, facets: Facets) -> tuple[dict[tuple, Style], list]:
    """Each line's style (keyed by its values of `facets.lines`) and the legend's entries: a colour per
    hue value (`palette`), then, with a style key, a line style per its value under the key's name."""
    colours = palette(frame, facets.hue)
    handles = _handles(colours, facets.hue, frame)
    if not facets.style:
        return colours, handles
    key = facets.style[0]
    values = [v[0] for v, _ in _groups(frame, facets.style)]
    dashes = {v: STYLES[i % len(STYLES)] for i, v in enumerate(values)}
    texts = _key_texts(frame, facets.style).get(key, {})
    styles = {}
    for combo, _ in _groups(frame, facets.lines):
        colour = colours[combo[:len(facets.hue)]]
        styles[combo] = Style(colour.color, dashes[combo[-1]], colour.marker)
    handles.append(Line2D([], [], linestyle="none", label=f"{axis_label(key)}:"))
    handles += [Line2D([], [], color="grey", linestyle=dashes[v], label=texts.get(v) or value_label(key, v))
                for v in values]
    return styles, handles


def _panels(frame: pd.DataFrame, facets: Facets) -> tuple[list[list[tuple[str, pd.DataFrame | None]]], int, int]:
    """The panels as a grid (rows of (title, runs or None for an empty slot)): rows by `facets.row`,
    columns by `facets.col`; one key of columns alone wraps past WRAP panels."""
    rows = _groups(frame, facets.row)
    cols = [values for values, _ in _groups(frame, facets.col)]
    if not facets.row and len(cols) > WRAP:  # wrap a long single row of panels
        n_cols = WRAP if len(cols) > 6 else len(cols)
        texts = _key_texts(frame, facets.col)
        cells = [(_panel_title(facets.col, v, texts), _select(frame, facets.col, v)) for v in cols]
        grid = [cells[i:i + n_cols] for i in range(0, len(cells), n_cols)]
        grid[-1] += [("", None)] * (n_cols - len(grid[-1]))
        return grid, len(grid), n_cols
    grid = []
    texts = _key_texts(frame, [*facets.col, *facets.row])
    for row_values, row_frame in rows:
        line = []
        for col_values in cols:
            runs = _select(row_frame, facets.col, col_values)
            title = _panel_title([*facets.col, *facets.row], (*col_values, *row_values), texts)
            line.append((title, runs if len(runs) else None))
        grid.append(line)
    return grid, len(grid), max(1, len(cols))


def _filled_panels(grid: list[list[tuple[str, pd.DataFrame | None]]], axes: np.ndarray):
    """(ax, title, runs) for each filled slot of `_panels`' grid; an empty slot's axes are hidden."""
    for i, line in enumerate(grid):
        for j, (title, runs) in enumerate(line):
            if runs is None:
                axes[i, j].set_visible(False)
            else:
                yield axes[i, j], title, runs


def _panel_title(keys: Sequence[str], values: tuple, texts: dict[str, dict] | None = None) -> str:
    """'Pre-RMS lr=1e-3': the article's label for a placement and a kind, then the other keys' values."""
    named = dict(zip(keys, values))
    sweep = str(named.pop(SWEEP_KEY)) if SWEEP_KEY in named else ""
    methods = {k: named.pop(k) for k in ("norm.placement", "norm.kind") if k in named}
    head = variant_label(methods) if methods else ""
    rest = " ".join(filter(None, [head, _values_label(list(named), tuple(named.values()), texts=texts)]))
    return f"{sweep}: {rest}" if sweep and rest else sweep or rest  # "t1: Post-LN", or "t1" alone


def _select(frame: pd.DataFrame, keys: Sequence[str], values: tuple) -> pd.DataFrame:
    mask = pd.Series(True, index=frame.index)
    for key, value in zip(keys, values):
        mask &= frame[key].isna() if pd.isna(value) else frame[key] == value
    return frame[mask]


def _subplots(n_rows: int, n_cols: int, legend: bool = True, panel: tuple[float, float] | None = None, **kwargs):
    """A grid of panels, each PANEL inches (larger where there are only one or two), beside the legend."""
    if panel is None:
        panel = {1: (5.8, 3.9), 2: (4.6, 3.3)}.get(n_rows * n_cols, PANEL)
    width = panel[0] * n_cols + (LEGEND_WIDTH if legend else 0)
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(max(width, 5.5), panel[1] * n_rows + 0.9), squeeze=False,
                             layout="constrained", **kwargs)
    return fig, axes


def _label_bottoms(axes: np.ndarray, label: str) -> None:
    """The x label and tick labels on each column's lowest shown panel (a wrapped grid's last row has
    empty slots: the panel above one is that column's lowest)."""
    n_rows, n_cols = axes.shape
    for j in range(n_cols):
        shown = [i for i in range(n_rows) if axes[i, j].get_visible()]
        if shown:
            axes[shown[-1], j].set_xlabel(label)
            axes[shown[-1], j].xaxis.set_tick_params(labelbottom=True)


def _title(fig: Figure, head: str, detail: str = "", legend: bool = True) -> None:
    """The title, then a detail (the runs' constants), each wrapped to the width the panels take and
    centred over them (the legend beside them has the rest), so that no line is cut at the figure's
    edge or runs into the legend."""
    width = fig.get_figwidth() - (LEGEND_WIDTH if legend else 0.8)
    chars = max(40, int(width * 10))
    lines = textwrap.wrap(head, chars) + (textwrap.wrap(detail, int(chars * 1.1)) if detail else [])
    centre = width / 2 / fig.get_figwidth() if legend else 0.5
    fig.suptitle("\n".join(lines), fontsize="medium", x=centre)


def _legend(fig: Figure, handles: list, title: str) -> None:
    """One legend for the figure, outside the panels, on the right."""
    if handles:
        fig.legend(handles=handles, loc="outside right upper", title=title, fontsize="small", title_fontsize="small",
                   frameon=False)


def _handles(styles: dict[tuple, Style], keys: Sequence[str], frame: pd.DataFrame | None = None) -> list:
    """The legend's entries, one per hue value; a key's numbers all in one style (1e-3 and 1e-2, never
    1e-3 and 0.01). No hue: no entry (the one line per panel is named by its title)."""
    if not keys:
        return []
    combos = list(styles)
    texts = []
    for i, key in enumerate(keys):
        values = list(dict.fromkeys(c[i] for c in combos))
        numbers = all(isinstance(v, (int, float, np.number)) and not isinstance(v, bool) for v in values)
        texts.append(dict(zip(values, number_texts(values))) if numbers else {v: value_label(key, v) for v in values})
    def label(combo: tuple) -> str:
        if len(keys) == 1:
            return texts[0][combo[0]]
        return " ".join(texts[i][v] if k in ("norm.placement", "norm.kind", SWEEP_KEY) else f"{_short(k)}={texts[i][v]}"
                        for i, (k, v) in enumerate(zip(keys, combo)))
    return [Line2D([], [], color=s.color, linestyle=s.linestyle, marker=s.marker, markersize=4, label=label(v))
            for v, s in styles.items()]


def _hue_title(keys: Sequence[str]) -> str:
    return ", ".join(axis_label(k) for k in keys)


def number_texts(values: Sequence[object]) -> list[str]:
    """One axis's tick labels: integers as they are; floats all in 1e-3 style where any is below 0.01
    or from 1e5 up (so that an axis never mixes 1e-3 with 0.03), else as 0.05; null for none."""
    floats = [float(v) for v in values if not pd.isna(v) and not isinstance(v, (int, np.integer))]
    scientific = any(v != 0 and (abs(v) < 0.01 or abs(v) >= 1e5) for v in floats)
    return ["null" if pd.isna(v) else str(v) if isinstance(v, (int, np.integer)) else short_number(v, scientific)
            for v in values]


def _plain_log_ticks(axis) -> None:
    """Label a log axis 0.3, 1, 2 (or 1e-3 below 0.01), never 3 x 10^-1; minor ticks labelled only where
    the axis spans too little for its decades to be labelled (matplotlib's own rule)."""
    def minor(value: float, _: object) -> str:
        low, high = axis.get_view_interval()
        if value <= 0 or low <= 0:
            return ""
        span = math.log10(high / low)
        coefficient = round(value / 10 ** math.floor(math.log10(value)))
        shown = (2, 3, 4, 5, 6, 8) if span <= 0.6 else (2, 3, 5) if span <= 1.3 else ()
        return short_number(value) if coefficient in shown else ""

    axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: short_number(v)))
    axis.set_minor_formatter(matplotlib.ticker.FuncFormatter(minor))


def _text_colour(cmap: str, level: float) -> str:
    """Black or white text, whichever reads on the colour `level` (0..1) of `cmap`."""
    r, g, b, _ = plt.get_cmap(cmap)(level)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"


def constants_text(frame: pd.DataFrame) -> str:
    """The constants that define the runs, as the report's title says them (arch, task, kind, depth...)."""
    return constants(frame)


def _chances(frame: pd.DataFrame) -> list[int]:
    """Each distinct number of choices among the runs (`n_choices`: n_classes, or a Transformer's
    vocabulary), in order of appearance: one chance line, ln(n), per value."""
    return list(dict.fromkeys(int(n) for n in n_choices(_choices(frame))))


def _limits(frame: pd.DataFrame, trained_below: float | None) -> list[float]:
    """Each distinct trained threshold among the runs."""
    return sorted(set(thresholds(_choices(frame), trained_below).round(12)))


def _choices(frame: pd.DataFrame) -> pd.DataFrame:
    """The distinct combinations of what `n_choices` reads, in order of appearance: the same values, once."""
    return frame[[k for k in CHOICE_KEYS if k in frame]].drop_duplicates()


def _reference_lines(ax, frame: pd.DataFrame, trained_below: float | None, chance: bool = True) -> list:
    """Chance (dotted) and the trained threshold (dashed) on a loss axis; their legend handles."""
    handles = []
    if chance and "model.n_classes" in frame:
        for n in _chances(frame):
            handles.append(ax.axhline(math.log(n), color="grey", linestyle=":", linewidth=1, label=f"chance, ln {n}"))
    for limit in _limits(frame, trained_below):
        handles.append(ax.axhline(limit, color="black", linestyle="--", linewidth=0.9,
                                  label=f"trained below {limit:.3g}"))
    return handles


def _mark_diverged(ax, runs: pd.DataFrame, stats: pd.DataFrame, style: Style) -> None:
    """Where some of a line's runs diverged: an x at the line's end, with 'k/n div' in its colour."""
    status = runs.groupby("run_id")["status"].first()
    diverged = int((status == "diverged").sum())
    if diverged and len(stats):
        x, y = stats.index[-1], stats["mean"].iloc[-1]
        ax.plot([x], [y], marker="x", color=style.color, markersize=6, linestyle="none")
        ax.annotate(f"{diverged}/{len(status)} div", (x, y), xytext=(3, 3), textcoords="offset points",
                    fontsize=6, color=style.color)


def _coverage(runs: pd.DataFrame) -> str:
    """'n=4, 2 diverged': how many runs a panel or line covers and how many diverged."""
    status = runs.groupby("run_id")["status"].first()
    diverged = int((status == "diverged").sum())
    return f"n={len(status)}" + (f", {diverged} diverged" if diverged else "")


# ----------------------------------------------------------------------------- curves


def curves_figure(tidy: pd.DataFrame, keys: list[str], metric: str = "loss", title: str = "",
                  facets: Facets | None = None, trained_below: float | None = None) -> Figure:
    """Mean curve per hue value with a min–max band over seeds, in panels by `facets` (default:
    `choose_facets(keys)`); the chance level and the trained threshold on a loss."""
    facets = facets or choose_facets(keys, counts=value_counts(tidy, keys))
    used = [*facets.keys, "run_id", "status", "step", "loss", metric, *CHOICE_KEYS]  # what the panels read
    frame = tidy[[c for c in dict.fromkeys(used) if c in tidy]]  # each panel a copy of these alone
    grid, n_rows, n_cols = _panels(frame, facets)
    styles, handles = line_styles(frame, facets)
    fig, axes = _subplots(n_rows, n_cols, sharex=True, sharey=True)
    extra: dict[str, object] = {}
    for ax, panel, runs in _filled_panels(grid, axes):
        for values, group in _groups(runs, facets.lines):
            style = styles[values]
            finite = group[np.isfinite(group["loss"].astype(float))]
            stats = finite.groupby("step")[metric].agg(["mean", "min", "max"])
            ax.plot(stats.index, stats["mean"], color=style.color, linestyle=style.linestyle,
                    marker=style.marker, markevery=max(1, len(stats) // 6), markersize=3, linewidth=1.3,
                    label=f"{_values_label(facets.lines, values)} ({_coverage(group)})")
            _mark_diverged(ax, group, stats, style)
            if group["run_id"].nunique() > 1:
                ax.fill_between(stats.index, stats["min"], stats["max"], color=style.color, alpha=0.15,
                                linewidth=0)
        if metric in LOSSES:
            for handle in _reference_lines(ax, runs, trained_below, chance=metric == "loss"):
                extra.setdefault(handle.get_label(), handle)
        if metric in ("loss", "val_loss", "grad_norm"):
            ax.set_yscale("log")
            _plain_log_ticks(ax.yaxis)
        ax.set_title(f"{panel} ({_coverage(runs)})" if panel else f"all runs ({_coverage(runs)})",
                     fontsize="small")
        ax.grid(True, which="both", alpha=0.25)
        ax.label_outer()
    if metric in LOSSES:
        clipped = _clip_blowups(axes, tidy, metric)
        if clipped:
            extra[clipped] = Line2D([], [], linestyle="none", marker="^", color="black", label=clipped)
    _label_bottoms(axes, "optimizer step")
    for ax in axes[:, 0]:
        ax.set_ylabel(METRIC_LABELS.get(metric, metric), fontsize="small")
    _legend(fig, [*handles, *extra.values()], _hue_title(facets.hue))
    _title(fig, title or f"{METRIC_LABELS.get(metric, metric)} per step: mean over seeds, band min–max",
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
    top = BLOWUP_FACTOR * max(first.max(), *(math.log(n) for n in _chances(tidy)))
    if finite.max() <= top:
        return ""
    for ax in axes.flat:
        if ax.get_visible():
            ax.set_ylim(top=top)
    return f"axis clipped at {top:.3g}\n(highest {finite.max():.2g})"


# ----------------------------------------------------------------------------- phase diagram


def numeric_axes(summary: pd.DataFrame) -> list[str]:
    """Varying config keys (not the seed) whose values are numbers: candidates for a phase diagram,
    the learning rate first and the warmup second where they vary."""
    out = []
    for key in varying_keys(summary):
        column = summary[key]
        if key != "seed" and pd.api.types.is_numeric_dtype(column) and not pd.api.types.is_bool_dtype(column):
            out.append(key)
    order = {LR_KEY: 0, "schedule.warmup_steps": 1}
    return sorted(out, key=lambda k: order.get(k, 2))


STOPPED_MARKER = "v"  # the phase diagram's mark on a cell where train.stop_when stopped a run early


def final_values(tidy: pd.DataFrame, metric: str, trained_below: float | None = None) -> pd.DataFrame:
    """One row per finished run: its config keys, status, `final` (the metric at its last recorded step,
    nan for a diverged run) and `trained` (by the trained rule, on the final training loss). `tidy` may
    be a summary instead (the metric then is the loss)."""
    if "step" not in tidy:  # a summary: its final_loss is the loss at each run's last step
        tidy = finished_runs(tidy).assign(loss=lambda t: t["final_loss"].astype(float), step=0)
    runs = tidy.groupby("run_id", sort=False)
    table = runs.tail(1).set_index("run_id")
    final = table[metric].astype(float)
    table["final"] = final.where(np.isfinite(table["loss"].astype(float)) & (table["status"] != "diverged"))
    table["trained"] = is_trained(table["loss"].astype(float), table["status"], n_choices(table),
                                  thresholds(table, trained_below))
    table["stopped"] = stopped_early(table)
    return table.reset_index()


def stopped_early(table: pd.DataFrame) -> pd.Series:
    """Per run (one row each): whether train.stop_when stopped it before its last step: summary.csv's
    stopped_at where the table has it, else a run under stop_when whose last recorded step is short of
    train.steps (a non-finite loss, which also ends a run early, makes it diverged: its cell says so)."""
    if "stopped_at" in table:
        return pd.to_numeric(table["stopped_at"], errors="coerce").notna()
    if "train.stop_when" not in table or "train.steps" not in table:
        return pd.Series(False, index=table.index)
    return ~table["train.stop_when"].map(is_null) & (table["step"].astype(int) < table["train.steps"].astype(int))


def phase_figure(tidy: pd.DataFrame, x_key: str, y_key: str, metric: str = "loss",
                 facets: Facets | None = None, trained_below: float | None = None) -> Figure:
    """The final `metric` (mean over seeds) on the x_key x y_key grid, one panel per other variant
    (`facets`' rows and columns; its hue joins the rows), cells whose every run trained hatched."""
    table = final_values(tidy, metric, trained_below)
    others = [k for k in varying_keys(table) if k not in ("seed", x_key, y_key)]
    if SWEEP_KEY in table and table[SWEEP_KEY].nunique() > 1:
        others = [SWEEP_KEY, *others]
    facets = facets or choose_facets(others)
    facets = Facets([*facets.row, *facets.hue, *facets.style], facets.col, [])
    if is_sampled(table, x_key, y_key):
        return phase_scatter_figure(table, x_key, y_key, metric, facets, trained_below)
    grid, n_rows, n_cols = _panels(table, facets)
    values = table["final"].dropna()
    accuracy = metric.endswith("acc")
    if accuracy:
        scale, cmap = Normalize(0, 1), "viridis"
    else:  # the scale reaches down to the trained threshold, so that a cell's colour says how near it is
        positive = values[values > 0]
        limits = _limits(table, trained_below) if metric in LOSSES else []
        low, high = (positive.min(), positive.max()) if len(positive) else (1e-3, 10)
        low = min([low, *(0.8 * v for v in limits)])
        scale, cmap = LogNorm(vmin=low, vmax=max(high, low * 1.01)), "viridis_r"
    n_x, n_y = table[x_key].nunique(dropna=False), table[y_key].nunique(dropna=False)
    panel = (max(3.2, 0.55 * n_x + 1.2), max(2.3, 0.42 * n_y + 1.1))
    fig, axes = _subplots(n_rows, n_cols, legend=False, panel=panel)
    image = None
    for ax, title, runs in _filled_panels(grid, axes):
        image = _phase_panel(ax, runs, x_key, y_key, scale, cmap)
        ax.set_title(f"{title} ({_coverage(runs)})" if title else _coverage(runs), fontsize="small")
    for ax in axes.flat:
        if ax.get_visible():
            ax.label_outer()
    if image is not None:
        bar = fig.colorbar(image, ax=axes, shrink=0.9,
                           label=FINAL_LABELS.get(metric, metric) + ("" if accuracy else " (log scale)"))
        bar.ax.tick_params(labelsize="small")
        if not accuracy:
            _plain_log_ticks(bar.ax.yaxis)
            for limit in _limits(table, trained_below) if metric in LOSSES else []:
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
    _title(fig, f"where the runs train: {FINAL_LABELS.get(metric, metric)}, mean over seeds",
           constants_text(table) + (". k/n: the mean of the k of n runs that did not diverge; div: all diverged"
                                    if diverged else ""), legend=False)
    return fig


def _rule_text(table: pd.DataFrame, trained_below: float | None) -> str:
    if trained_below is not None:
        return f"final training loss < {trained_below:g}"
    limits = ", ".join(f"{v:.3g}" for v in _limits(table, None))
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


def is_sampled(table: pd.DataFrame, x_key: str, y_key: str) -> bool:
    """Whether the runs' (x, y) values fill under half the cells of their x x y grid: sampled points (a
    sweep's `sample:` section), not a grid, so a heat map would be mostly empty cells."""
    pairs = table[[x_key, y_key]].drop_duplicates()
    cells = table[x_key].nunique(dropna=False) * table[y_key].nunique(dropna=False)
    return cells > 0 and len(pairs) < cells / 2


def phase_scatter_figure(table: pd.DataFrame, x_key: str, y_key: str, metric: str, facets: Facets,
                         trained_below: float | None = None) -> Figure:
    """Sampled points (`final_values`' table): each run at its (x, y), coloured by its final `metric`, ringed
    where it trained, a red cross where it diverged; panels as the phase diagram's. A scatter of what ran,
    never an interpolated map."""
    grid, n_rows, n_cols = _panels(table, facets)
    values = table["final"].dropna()
    accuracy = metric.endswith("acc")
    positive = values[values > 0]
    scale = (Normalize(0, 1) if accuracy else
             LogNorm(vmin=positive.min() if len(positive) else 1e-3,
                     vmax=max(positive.max(), positive.min() * 1.01) if len(positive) else 10))
    cmap = "viridis" if accuracy else "viridis_r"
    fig, axes = _subplots(n_rows, n_cols, legend=False, panel=(4.4, 3.6))
    image = None
    for ax, title, runs in _filled_panels(grid, axes):
        ok, bad = runs[runs["final"].notna()], runs[runs["final"].isna()]
        image = ax.scatter(ok[x_key], ok[y_key], c=ok["final"], norm=scale, cmap=cmap, s=30,
                           edgecolors=np.where(ok["trained"], TRAINED_EDGE, "black"),
                           linewidths=np.where(ok["trained"], 1.6, 0.3))
        ax.scatter(bad[x_key], bad[y_key], marker="x", color="red", s=30)
        for key, set_scale in ((x_key, ax.set_xscale), (y_key, ax.set_yscale)):
            column = table[key].astype(float)
            if (column > 0).all() and column.max() / column.min() > 20:
                set_scale("log")
        ax.set_xlabel(axis_label(x_key), fontsize="small")
        ax.set_ylabel(axis_label(y_key), fontsize="small")
        ax.set_title(f"{title} ({_coverage(runs)})" if title else _coverage(runs), fontsize="small")
        ax.grid(True, which="both", alpha=0.25)
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.9,
                     label=FINAL_LABELS.get(metric, metric) + ("" if accuracy else " (log scale)"))
    handles = [Line2D([], [], marker="o", linestyle="", markerfacecolor="none", markeredgecolor=TRAINED_EDGE,
                      markeredgewidth=1.6, label=f"trained: {_rule_text(table, trained_below)}"),
               Line2D([], [], marker="x", linestyle="", color="red", label="diverged")]
    fig.legend(handles=handles, loc="outside lower center", fontsize="small", frameon=False, ncols=2)
    _title(fig, f"sampled points, a scatter (not interpolated): {FINAL_LABELS.get(metric, metric)} of each run",
           constants_text(table), legend=False)
    return fig


def _phase_text(mean: float, finite: float, runs: float) -> str:
    """A phase cell's label: the mean, with k/n when only k of its n runs did not diverge."""
    if pd.isna(runs) or runs == 0:
        return ""
    if finite == 0:
        return "div"
    return f"{mean:.2g}" if finite == runs else f"{mean:.2g}\n{int(finite)}/{int(runs)}"


# ----------------------------------------------------------------------------- trained fraction


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
    _title(fig, f"runs trained ({_rule_text(finished, trained_below)})",
           constants_text(summary) + (f"; {unfinished} runs unfinished, in no cell" if unfinished else ""),
           legend=False)
    return fig


# ----------------------------------------------------------------------------- saving


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
    keys = [k for k in varying_keys(summary) if k != "seed"]
    facets = choose_facets(keys, row, col, hue, value_counts(summary, keys))
    note = "\n".join(filter(None, [engine_note(summary, keys), missing_note(summary, run_dir)]))
    figures = [("", curves_figure(tidy, keys, metric, facets=facets, trained_below=rule), note)]
    axes = numeric_axes(summary)
    sampled_lr = any(is_sampled(finished_runs(summary), LR_KEY, k) for k in axes if k != LR_KEY)
    if LR_KEY in summary and summary[LR_KEY].nunique() >= MIN_LRS and not sampled_lr:  # else: the scatter
        table, others = lr_table(folder)
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


def final_loss_figure(summary: pd.DataFrame, x_key: str, trained_below: float | None = None) -> Figure:
    """Final loss against a numeric key (e.g. model.depth), one line per other variant: the mean over
    seeds, with the min–max band; chance dotted, the trained threshold dashed."""
    finished = finished_runs(summary).copy()
    finished["final_loss"] = finished["final_loss"].astype(float).where(np.isfinite(finished["final_loss"]))
    others = [k for k in varying_keys(summary) if k not in ("seed", x_key)]
    fig, ax = plt.subplots(figsize=(5.8 + LEGEND_WIDTH, 4.2), layout="constrained")
    for label, group in variant_groups(finished, others):
        stats = group.groupby(x_key)["final_loss"].agg(["mean", "min", "max"])
        line, = ax.plot(stats.index, stats["mean"], marker="o", label=f"{label} ({_coverage(group)})")
        ax.fill_between(stats.index, stats["min"], stats["max"], color=line.get_color(), alpha=0.15, linewidth=0)
    _reference_lines(ax, finished, trained_below)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    _plain_log_ticks(ax.yaxis)
    values = sorted(finished[x_key].dropna().unique())
    ax.set_xticks(values, number_texts(values))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel(axis_label(x_key))
    ax.set_ylabel("final training loss")
    ax.grid(True, which="both", alpha=0.3)
    handles, _ = ax.get_legend_handles_labels()
    _legend(fig, handles, _hue_title(others) if others else "")
    _title(fig, f"final training loss vs {axis_label(x_key)}: mean over seeds, band min–max",
           constants_text(finished))
    return fig


def lr_figure(table: pd.DataFrame, keys: list[str], facets: Facets | None = None,
              trained_below: float | None = None) -> Figure:
    """Final training loss against the learning rate (log x) from `sensitivity.lr_table`: one line per
    hue value (mean over seeds) with its min–max band, in panels by `facets` (default `choose_facets`),
    the trained threshold dashed."""
    facets = facets or choose_facets(keys, counts=value_counts(table, keys))
    grid, n_rows, n_cols = _panels(table, facets)
    styles, handles = line_styles(table, facets)
    fig, axes = _subplots(n_rows, n_cols, sharex=True, sharey=True)
    extra: dict[str, object] = {}
    for ax, panel, runs in _filled_panels(grid, axes):
        for values, group in _groups(runs, facets.lines):
            style = styles[values]
            stats = group.groupby(LR_KEY)["clipped"].agg(["mean", "min", "max"])
            ax.plot(stats.index, stats["mean"], marker=style.marker or "o", markersize=3.5, color=style.color,
                    linestyle=style.linestyle, linewidth=1.3, label=_values_label(facets.lines, values))
            ax.fill_between(stats.index, stats["min"], stats["max"], color=style.color, alpha=0.15, linewidth=0)
        for handle in _reference_lines(ax, runs, trained_below, chance=False):
            extra.setdefault(handle.get_label(), handle)
        ax.set_xscale("log")
        ax.set_yscale("log")
        lrs = sorted(table[LR_KEY].unique())
        if len(lrs) <= 8:  # a tick at each learning rate of the grid
            ax.set_xticks(lrs, [short_number(v, True) for v in lrs])
        else:
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: short_number(v, True)))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        _plain_log_ticks(ax.yaxis)
        ax.set_title(f"{panel} ({_coverage(runs)})" if panel else f"all runs ({_coverage(runs)})",
                     fontsize="small")
        ax.grid(True, which="both", alpha=0.25)
        ax.label_outer()
    _label_bottoms(axes, axis_label(LR_KEY))
    for ax in axes[:, 0]:
        ax.set_ylabel("final training loss", fontsize="small")
    _legend(fig, [*handles, *extra.values()], _hue_title(facets.hue))
    _title(fig, "final training loss vs learning rate",
           "line: mean over seeds; band: min–max; a diverged run, or one that ends above its loss at init, "
           f"counts as its loss at init. {constants_text(table)}")
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
