"""What every sweep figure shares: its panels, palettes, legend, title and reference lines.

Every figure labels a config key as a reader names it (`AXIS_LABELS`: "learning rate", "warmup steps"),
puts one legend outside its panels, colours a categorical hue with a categorical palette (tab10, then
line styles and markers past 10 values) and a numeric one with a sequential palette, and says in its
title the constants that define its runs.

- `Facets` and `choose_facets`: which keys make the rows of panels, their columns and the lines within
  a panel (by default a column per placement, or per the slowest-varying key, the hue for the fastest,
  a row for the next);
- `panels`, `subplots`, `filled_panels`: the grid of panels, each titled by `panel_title`;
- `palette`, `line_styles`: a style per line and the legend's entries;
- `figure_title`, `figure_legend`, `label_bottoms`, `plain_log_ticks`, `number_texts`: the text around them;
- `reference_lines`: chance ln(n) dotted and the trained threshold dashed on a loss axis.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.text import Annotation

from normexp.analysis.realtext import text_floors
from normexp.analysis.variants import (
    axis_label,
    chance_levels,
    constants,
    distinct_keys,
    short_number,
    trained_limits,
    value_label,
    variant_label,
)
from normexp.results import ResultsError, varying_keys

PANEL = (3.6, 2.7)  # one panel's size in inches
LEGEND_WIDTH = 2.4  # inches beside the panels for the one legend
WRAP = 4  # panels per row when one key makes them all
LOSSES = ("loss", "val_loss")  # metrics the trained threshold and the chance level apply to
STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
SWEEP_KEY = "sweep"  # the column naming a run's sweep folder when several are compared


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


def values_label(keys: Sequence[str], values: object, texts: dict[str, dict] | None = None) -> str:
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


def groups(frame: pd.DataFrame, keys: Sequence[str]) -> list[tuple[object, pd.DataFrame]]:
    """The rows of `frame` per combination of `keys` (a tuple), numbers sorted, else in order of appearance."""
    if not keys:
        return [((), frame)]
    groups = list(frame.groupby(list(keys), sort=False, dropna=False))
    numeric = all(pd.api.types.is_numeric_dtype(frame[k]) and not pd.api.types.is_bool_dtype(frame[k]) for k in keys)
    if numeric:
        groups.sort(key=lambda item: tuple(-math.inf if pd.isna(v) else v for v in _tuple(item[0])))
    return [(_tuple(values), group) for values, group in groups]


def _tuple(values: object) -> tuple:
    """A group's key as a tuple, a missing value (a null in the grid, NaN in the frame) as None: NaN is not
    equal to itself, so no style or label keyed by it could be found again."""
    values = values if isinstance(values, tuple) else (values,)
    return tuple(None if isinstance(v, float) and math.isnan(v) else v for v in values)


@dataclass(frozen=True)
class Style:
    color: object
    linestyle: str
    marker: str | None


def palette(frame: pd.DataFrame, keys: Sequence[str]) -> dict[tuple, Style]:
    """A style per combination of `keys`: one numeric key, a sequential palette (viridis, by rank: low
    dark, high light); otherwise categorical: tab10, then past 10 values line styles and markers too."""
    combos = [values for values, _ in groups(frame, keys)]
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
    values = [v[0] for v, _ in groups(frame, facets.style)]
    dashes = {v: STYLES[i % len(STYLES)] for i, v in enumerate(values)}
    texts = _key_texts(frame, facets.style).get(key, {})
    styles = {}
    for combo, _ in groups(frame, facets.lines):
        colour = colours[combo[:len(facets.hue)]]
        styles[combo] = Style(colour.color, dashes[combo[-1]], colour.marker)
    handles.append(Line2D([], [], linestyle="none", label=f"{axis_label(key)}:"))
    handles += [Line2D([], [], color="grey", linestyle=dashes[v], label=texts.get(v) or value_label(key, v))
                for v in values]
    return styles, handles


def panels(frame: pd.DataFrame, facets: Facets) -> tuple[list[list[tuple[str, pd.DataFrame | None]]], int, int]:
    """The panels as a grid (rows of (title, runs or None for an empty slot)): rows by `facets.row`,
    columns by `facets.col`. One key of columns alone wraps past WRAP panels; a grid of rows and columns
    that would leave a slot empty (folders compared whose keys do not cross: depth 4 with Post-LN, depth 8
    with Pre-LN) lists its filled panels instead, wrapped the same way: no empty panel is drawn."""
    rows = groups(frame, facets.row)
    cols = [values for values, _ in groups(frame, facets.col)]
    keys = [*facets.col, *facets.row]
    texts = _key_texts(frame, keys)
    grid = []
    for row_values, row_frame in rows:
        line = []
        for col_values in cols:
            runs = _select(row_frame, facets.col, col_values)
            title = panel_title(keys, (*col_values, *row_values), texts)
            line.append((title, runs if len(runs) else None))
        grid.append(line)
    if facets.row and all(runs is not None for line in grid for _, runs in line):
        return grid, len(grid), max(1, len(cols))
    cells = [cell for line in grid for cell in line if cell[1] is not None] or [("", frame)]
    n_cols = wrap_columns(len(cells)) if len(cells) > WRAP or facets.row else len(cells)
    wrapped = [cells[i:i + n_cols] for i in range(0, len(cells), n_cols)]
    wrapped[-1] += [("", None)] * (n_cols - len(wrapped[-1]))
    return wrapped, len(wrapped), n_cols


def wrap_columns(count: int) -> int:
    """Panels per row for `count` panels of one list: all in one row up to WRAP + 1, else 3 to WRAP + 1 a
    row, whichever leaves the fewest empty slots (then the nearest to WRAP)."""
    if count <= WRAP + 1:
        return max(1, count)
    return min(range(3, WRAP + 2), key=lambda n: ((-count) % n, abs(n - WRAP)))


def filled_panels(grid: list[list[tuple[str, pd.DataFrame | None]]], axes: np.ndarray):
    """(ax, title, runs) for each filled slot of `panels`' grid; an empty slot's axes are hidden."""
    for i, line in enumerate(grid):
        for j, (title, runs) in enumerate(line):
            if runs is None:
                axes[i, j].set_visible(False)
            else:
                yield axes[i, j], title, runs


def panel_title(keys: Sequence[str], values: tuple, texts: dict[str, dict] | None = None) -> str:
    """'Pre-RMS lr=1e-3': the article's label for a placement and a kind, then the other keys' values."""
    named = dict(zip(keys, values))
    sweep = str(named.pop(SWEEP_KEY)) if SWEEP_KEY in named else ""
    methods = {k: named.pop(k) for k in ("norm.placement", "norm.kind") if k in named}
    head = variant_label(methods) if methods else ""
    rest = " ".join(filter(None, [head, values_label(list(named), tuple(named.values()), texts=texts)]))
    return f"{sweep}: {rest}" if sweep and rest else sweep or rest  # "t1: Post-LN", or "t1" alone


def _select(frame: pd.DataFrame, keys: Sequence[str], values: tuple) -> pd.DataFrame:
    mask = pd.Series(True, index=frame.index)
    for key, value in zip(keys, values):
        mask &= frame[key].isna() if pd.isna(value) else frame[key] == value
    return frame[mask]


def subplots(n_rows: int, n_cols: int, legend: bool = True, panel: tuple[float, float] | None = None, **kwargs):
    """A grid of panels, each PANEL inches (larger where there are only one or two), beside the legend."""
    if panel is None:
        panel = {1: (5.8, 3.9), 2: (4.6, 3.3)}.get(n_rows * n_cols, PANEL)
    width = panel[0] * n_cols + (LEGEND_WIDTH if legend else 0)
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(max(width, 5.5), panel[1] * n_rows + 0.9), squeeze=False,
                             layout="constrained", **kwargs)
    return fig, axes


def label_bottoms(axes: np.ndarray, label: str) -> None:
    """The x label and tick labels on each column's lowest shown panel (a wrapped grid's last row has
    empty slots: the panel above one is that column's lowest)."""
    n_rows, n_cols = axes.shape
    for j in range(n_cols):
        shown = [i for i in range(n_rows) if axes[i, j].get_visible()]
        if shown:
            axes[shown[-1], j].set_xlabel(label)
            axes[shown[-1], j].xaxis.set_tick_params(labelbottom=True)


def figure_title(fig: Figure, head: str, detail: str = "", legend: bool = True) -> None:
    """The title: the question the figure answers (`head`), then in a smaller grey line what is constant
    among its runs (`detail`), each wrapped to the width the panels take and centred over them (the legend
    beside them has the rest), so that no line is cut at the figure's edge or runs into the legend. The
    title reserves blank lines for the detail, so that the layout leaves room for both."""
    width = fig.get_figwidth() - (LEGEND_WIDTH if legend else 0.8)
    chars = max(40, int(width * 10))
    heads = textwrap.wrap(head, chars)
    details = textwrap.wrap(detail, int(chars * 1.25)) if detail else []
    centre = width / 2 / fig.get_figwidth() if legend else 0.5
    reserve = math.ceil(len(details) * DETAIL_SIZE / TITLE_SIZE)  # the title's lines the detail takes
    title = fig.suptitle("\n".join(heads + [""] * reserve), fontsize=TITLE_SIZE, x=centre)
    if details:  # under the title's own lines, wherever the layout puts the title
        note = Annotation("\n".join(details), xy=(0.5, 1), xycoords=title, ha="center", va="top",
                          xytext=(0, -len(heads) * TITLE_SIZE * LINE), textcoords="offset points",
                          fontsize=DETAIL_SIZE, color="dimgrey")
        note.set_in_layout(False)
        fig.add_artist(note)


TITLE_SIZE, DETAIL_SIZE, LINE = 11, 8.5, 1.2  # points; matplotlib's line spacing


def figure_legend(fig: Figure, handles: list, title: str) -> None:
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


def hue_title(keys: Sequence[str]) -> str:
    return ", ".join(axis_label(k) for k in keys)


def number_texts(values: Sequence[object]) -> list[str]:
    """One axis's tick labels: integers as they are; floats all in 1e-3 style where any is below 0.01
    or from 1e5 up (so that an axis never mixes 1e-3 with 0.03), else as 0.05; null for none."""
    floats = [float(v) for v in values if not pd.isna(v) and not isinstance(v, (int, np.integer))]
    scientific = any(v != 0 and (abs(v) < 0.01 or abs(v) >= 1e5) for v in floats)
    return ["null" if pd.isna(v) else str(v) if isinstance(v, (int, np.integer)) else short_number(v, scientific)
            for v in values]


def plain_log_ticks(axis) -> None:
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


def constants_text(frame: pd.DataFrame) -> str:
    """The constants that define the runs, as the report's title says them (arch, task, kind, depth...);
    folders compared whose sweep varies with a key (each at its own depth) say which is which."""
    text = constants(frame)
    if SWEEP_KEY in frame and frame[SWEEP_KEY].nunique() > 1:
        keys = [k for k in varying_keys(frame) if k not in (SWEEP_KEY, "seed")]
        _, aliases = distinct_keys(frame, [*keys, SWEEP_KEY])
        twin = next((key for key, twins in aliases.items() if SWEEP_KEY in twins), None)
        if twin is not None:
            pairs = frame[[SWEEP_KEY, twin]].drop_duplicates()
            texts = _key_texts(frame, [twin]).get(twin, {})
            said = ", ".join(f"{name} at {_short(twin)}={texts.get(value) or value_label(twin, value)}"
                             for name, value in zip(pairs[SWEEP_KEY], pairs[twin]))
            text = f"{text}; sweeps {said}" if text else f"sweeps {said}"
    return text


def reference_lines(ax, frame: pd.DataFrame, trained_below: float | None, chance: bool = True) -> list:
    """Chance (dotted), a text task's floors (dash-dot: `text_floors`) and the trained threshold (dashed) on
    a loss axis; their legend handles."""
    handles = []
    if chance and "model.n_classes" in frame:
        for n in chance_levels(frame):
            handles.append(ax.axhline(math.log(n), color="grey", linestyle=":", linewidth=1, label=f"chance, ln {n}"))
    for (label, floor), color in zip(text_floors(frame).items(), ("tab:brown", "tab:olive")):
        handles.append(ax.axhline(floor, color=color, linestyle="-.", linewidth=0.9, label=label))
    for limit in trained_limits(frame, trained_below):
        handles.append(ax.axhline(limit, color="black", linestyle="--", linewidth=0.9,
                                  label=f"trained below {limit:.3g}"))
    return handles


def coverage(runs: pd.DataFrame) -> str:
    """'n=4, 2 diverged': how many runs a panel or line covers and how many diverged."""
    status = runs.groupby("run_id")["status"].first()
    diverged = int((status == "diverged").sum())
    return f"n={len(status)}" + (f", {diverged} diverged" if diverged else "")
