"""The article-style table, built from a sweep's output folder, rendered as Rich, markdown or CSV.

    step |  Post-LN | Post-RMS |   Pre-LN |  Pre-RMS        rows: report steps; columns: variants
       0 |   2.7399 |   2.7438 |   2.6015 |   2.6482        cells: the value, or mean ± std over seeds
      30 |   2.2052 |   2.2034 |   0.0201 |   0.0121
    Trained (final loss < ln(10)/10 = 0.230): Pre-LN, Pre-RMS.  Did not train: Post-LN, Post-RMS.

Columns are the runs grouped by the column keys (default: every varying config key but the seed);
runs that differ only in seed are one column. Labels follow the article: `Post-LN`, `Pre-RMS`...

Every aggregate says what it covers. A mean is taken over the runs whose loss is finite at that step;
where that is not every run of the cell, the cell says so (`0.0512 ± 0.0031 (2 of 4)`: the other two
diverged), a cell whose runs all diverged reads `diverged` (never `—`, which means "no run"), and the
verdict line counts diverged runs per column. Each run is judged against its own n_classes.
Only verified runs count; a line under the table names the runs missing, failed or corrupt.
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from normexp.config import ReportConfig, key_label
from normexp.results import (
    ResultsError,
    check_metric,
    config_columns,
    finished_runs,
    load_metrics,
    load_summary,
    missing_note,
    unfinished_runs,
    varying_keys,
)
from normexp.store import SWEEP_FILE

PLACEMENT_LABELS = {"post": "Post", "pre": "Pre", "sandwich": "Sandwich", "peri": "Peri",
                    "deepnorm": "DeepNorm", "mixln": "MixLN", "none": "NoNorm", "rezero": "ReZero",
                    "respost": "ResPost", "resdual": "ResiDual", "admin": "Admin", "b2t": "B2T"}
KIND_LABELS = {"layernorm": "LN", "rmsnorm": "RMS", "rmsnorm_torch": "RMSt", "rmsnorm_llama": "RMSl",
               "rmsnorm_gemma": "RMSg", "prmsnorm": "pRMS", "scalenorm": "Scale", "dyt": "DyT", "derf": "Derf"}
TRAINED_FRACTION = 0.1  # trained: final loss under a tenth of chance, ln(n_classes) / 10
WIDE = 6  # more variants than this: the table is transposed (variants down, steps across)


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str) -> list[str]:
    """A markdown table's lines; `align` has one letter per column, l(eft) or r(ight). Every cell, the
    header's too, goes through `markdown_cell`, so that a `|` in its text (`max |diff|`) stays in it."""
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(markdown_cell(c) for c in cells) + " |"

    rule = "|" + "".join("---|" if a == "l" else "---:|" for a in align)
    return [line(header), rule, *map(line, rows)]


def markdown_cell(text: object) -> str:
    """`text` as one cell of a markdown (GFM) table: a `|` escaped, and a backslash where it would
    escape what follows (before ASCII punctuation; `lr \\ warmup` stays as it is); a line break as
    `<br>` (a raw one would end the row)."""
    text = "<br>".join(str(text).replace("\r\n", "\n").replace("\r", "\n").split("\n"))
    return _ESCAPING_BACKSLASH.sub(r"\\\\", text).replace("|", "\\|")


_ESCAPING_BACKSLASH = re.compile(r"\\(?=[!-/:-@\[-`{-~])")  # CommonMark: a backslash escapes ASCII punctuation


def _rich_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str, title: str | None = None):
    """The same table as a rich.table.Table (rich is imported lazily), titled on the left. A cell too wide
    for the terminal wraps, folding a long word across lines, never cut to "…" (an identifier or number
    must be read whole); off a terminal, cli.show prints the table at its own width."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for name, a in zip(header, align):
        table.add_column(name, justify="left" if a == "l" else "right", overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def variant_label(values: dict[str, object]) -> str:
    """'Post-LN', 'Pre-RMS lr=0.001', ... from a column's key values."""
    parts = []
    placement, kind = values.get("norm.placement"), values.get("norm.kind")
    if placement is not None or kind is not None:
        head = PLACEMENT_LABELS.get(str(placement), "") if placement is not None else ""
        if kind is not None:
            head = f"{head}-{KIND_LABELS.get(str(kind), kind)}" if head else str(KIND_LABELS.get(str(kind), kind))
        parts.append(head)
    parts += [f"{key_label(key)}={'null' if _is_null(value) else value}" for key, value in values.items()
              if key not in ("norm.placement", "norm.kind")]
    return " ".join(parts) or "run"


def aggregate_cell(mean: float, std: float, finite: int, runs: int, missing: int = 0) -> str:
    """One aggregate as text: `mean ± std` over the `finite` runs of the cell's `runs` (`missing` of
    them have no verified result), saying "(k of n)" when some diverged or are missing, `missing` when
    all are, `diverged` when all that finished did, and `—` only where there is no run."""
    if runs == 0:
        return "—"
    if finite == 0 and missing >= runs:
        return "missing" if runs == 1 else f"all {runs} missing"
    if finite == 0 and missing:
        return f"— (0 of {runs})"
    if finite == 0:
        return "diverged" if runs == 1 else f"all {runs} diverged"
    value = number(mean) if finite == 1 else f"{number(mean)} ± {number(std)}"
    return value if finite == runs else f"{value} ({finite} of {runs})"


APPROXIMATE_ENGINES = ("fast",)  # close to the reference's numbers, not equal; reference and batched are its bits
ENGINES_LISTED = 6


def engine_note(summary: pd.DataFrame, keys: Sequence[str]) -> str:
    """A line saying that the finished runs come from an exact engine (reference, batched: the same
    bits) and from the fast one (close, not equal), naming the cells (grouped by `keys`) that average
    both; "" when one kind of engine trained every run (or the folder predates the engine column)."""
    finished = finished_runs(summary)
    if "engine" not in finished or finished.empty:
        return ""
    fast = finished["engine"].astype(str).isin(APPROXIMATE_ENGINES)
    if fast.all() or not fast.any():
        return ""
    exact = ", ".join(sorted(set(finished.loc[~fast, "engine"].astype(str))))
    mixed = []
    for label, group in variant_groups(finished, list(keys), everything="all runs"):
        in_fast = group["engine"].astype(str).isin(APPROXIMATE_ENGINES)
        if in_fast.any() and not in_fast.all():
            mixed.append(f"{label} ({int(in_fast.sum())} fast, {int((~in_fast).sum())} {exact})")
    more = f" and {len(mixed) - ENGINES_LISTED} more" if len(mixed) > ENGINES_LISTED else ""
    cells = (f"cells that average both: {', '.join(mixed[:ENGINES_LISTED])}{more}" if mixed else
             "no cell averages both, but cells of different engines are compared")
    return (f"Engines mixed: {int(fast.sum())} of {len(finished)} runs by the fast engine (close to the reference's "
            f"numbers, not equal), the others by {exact}; {cells}. For one engine throughout, rerun the sweep "
            "with --engine batched (it redoes the fast runs) or with --engine fast --force.")


PARTIAL_NOTE = ("(k of n): the mean covers the k runs of the cell whose loss is still finite; the other n - k diverged "
                "or are missing (named below), or, in the table, ended before that step (a shorter train.steps).")


def _is_null(value: object) -> bool:
    """A null config value: None, or the NaN that an empty summary.csv cell reads as."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def csv_number(value: float) -> str:
    """A number for a CSV cell, exactly (repr); empty where it is undefined (nan: a std over fewer than 2
    runs, a mean over none), so that a script reads a missing value, never a spread of 0."""
    value = float(value)
    return "" if math.isnan(value) else repr(value)


def number(value: float) -> str:
    """A loss as the article prints it (4 decimals); past 1e6 in scientific notation, so that a
    diverging run's cell stays narrow enough to be shown whole."""
    return f"{value:.4f}" if not abs(value) >= 1e6 or math.isinf(value) else f"{value:.4e}"


@dataclass(frozen=True)
class Column:
    label: str
    values: dict[str, object]  # the column keys' values
    cells: dict[int, tuple[float, float, int, int]]  # step -> (mean, std, finite runs, runs that reached it)
    trained: int  # runs whose final loss is under their own threshold
    runs: int
    unit: str  # "seeds" when the column's runs differ only by seed, else "runs"
    diverged: int = 0  # runs that diverged (they count as not trained)
    missing: int = 0  # runs of the sweep in this column with no verified result (missing, failed, corrupt)


@dataclass(frozen=True)
class Report:
    title: str
    metric: str
    steps: list[int]
    columns: list[Column]
    n_classes: tuple[int, ...]  # every n_classes among the runs: each run is judged by its own
    missing: str = ""  # names the runs left out (missing, failed or corrupt), or ""
    engines: str = ""  # `engine_note`: the cells that average exact and fast-engine runs, or ""

    def cell(self, column: Column, step: int) -> str:
        """The cell's aggregate; a mean over fewer than the column's runs says "(k of n)" with n every
        run of the column, whether the others diverged, are missing or ended before this step."""
        if step not in column.cells:
            return "—"
        mean, std, finite, reached = column.cells[step]
        return aggregate_cell(mean, std, finite, column.runs + column.missing if finite else reached, column.missing)

    @property
    def partial(self) -> bool:
        """Some cell's mean covers only part of its column's runs."""
        return any(0 < c.cells[s][2] < c.runs + c.missing for c in self.columns for s in self.steps if s in c.cells)

    def verdict(self, column: Column) -> str:
        if column.runs == 1 and not column.missing:
            return "trained" if column.trained else "diverged" if column.diverged else "did not train"
        diverged = f", {column.diverged} diverged" if column.diverged else ""
        missing = f", {column.missing} missing" if column.missing else ""
        return f"trained in {column.trained} of {column.runs + column.missing} {column.unit}{diverged}{missing}"

    def verdict_line(self) -> str:
        rule = ", ".join(f"ln({n})/10 = {trained_threshold(n):.3f}" for n in self.n_classes)
        if len(self.n_classes) > 1:
            rule = f"each run's ln(n_classes)/10: {rule}"
        rule = f"final loss < {rule}"
        # a variant is judged by its finished runs; a missing run is evidence of nothing, so it is named, not counted
        trained = [_verdict_label(c) for c in self.columns if c.trained == c.runs]
        partly = [_verdict_label(c) for c in self.columns if 0 < c.trained < c.runs]
        failed = [_verdict_label(c) for c in self.columns if c.trained == 0 < c.runs]
        parts = [f"Trained ({rule}): {', '.join(trained) or 'none'}."]
        if partly:
            parts.append(f"Trained in some seeds: {', '.join(partly)}.")
        parts.append(f"Did not train: {', '.join(failed) or 'none'}.")
        diverged = [f"{c.label} ({c.diverged} of {c.runs + c.missing} {c.unit})" for c in self.columns if c.diverged]
        if diverged:
            parts.append(f"Diverged: {', '.join(diverged)}.")
        return "  ".join(parts)


def _verdict_label(column: Column) -> str:
    """'Pre', 'Pre (1/2 seeds)' when only some trained, 'Pre (1 of 2 seeds; 1 missing)' when some are missing."""
    c = column
    if c.missing:
        return f"{c.label} ({c.trained} of {c.runs + c.missing} {c.unit}; {c.missing} missing)"
    return c.label if c.trained in (0, c.runs) else f"{c.label} ({c.trained}/{c.runs} {c.unit})"


def sweep_report_section(run_dir: Path) -> ReportConfig:
    """The `report:` section of the sweep that wrote `run_dir` (the defaults if it is unreadable)."""
    try:
        data = yaml.safe_load((run_dir / SWEEP_FILE).read_text())
        return ReportConfig.model_validate(data["report"])
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError):
        return ReportConfig()


def _check_keys(keys: Sequence[str], summary: pd.DataFrame, option: str) -> None:
    unknown = [k for k in keys if k not in config_columns(summary)]
    if unknown:
        raise ResultsError(f"{option} {','.join(unknown)}: not a config key of this sweep")


def build_report(run_dir: str | Path, steps: Sequence[int] | None = None, metric: str | None = None,
                 by: Sequence[str] | None = None, only_last: bool = False) -> Report:
    """Group a folder's finished runs (every invocation's, or the latest sweep's with `only_last`)
    into the table's columns and compute each cell. Unset arguments come from the latest sweep's
    `report:` section, then from the defaults. Its columns are extended by every key that varies
    only across invocations (another depth run into the folder), so no two configs share a column
    unless `by` says so."""
    run_dir = Path(run_dir)
    section = sweep_report_section(run_dir)
    summary = load_summary(run_dir, only_last)
    tidy = load_metrics(run_dir, all_config=True, only_last=only_last)
    varying = [k for k in varying_keys(summary) if k != "seed"]
    if by:
        keys = list(by)
    elif section.columns:
        latest = set(varying_keys(load_summary(run_dir, only_last=True)))
        keys = [*section.columns, *(k for k in varying if k not in section.columns and k not in latest)]
    else:
        keys = varying
    _check_keys(keys, summary, "--by")
    metric = metric or section.metric
    recorded = set(tidy["step"])
    missing = [s for s in steps or () if s not in recorded]
    if missing:
        raise ResultsError(f"--steps {','.join(map(str, missing))}: not recorded by any run "
                           f"(steps {min(recorded)} to {max(recorded)})")
    if not steps and recorded:  # the sweep's report steps, and always each run's last step
        steps = sorted({*(s for s in section.steps if s in recorded), max(recorded),
                        *(recorded & set(tidy["train.steps"]))})
    check_metric(tidy, metric)
    n_classes = tuple(int(n) for n in dict.fromkeys(n_choices(tidy)))
    unfinished = summary[summary["run_id"].isin(unfinished_runs(summary))]
    missing = {label: len(group) for label, group in variant_groups(unfinished, keys, everything="run")}
    columns = [_column(label, group, keys, steps, metric, missing.get(label, 0))
               for label, group in variant_groups(tidy, keys, everything="run")]
    return Report(_title(summary, metric) + _mixed(summary) + _about(run_dir), metric, steps, columns, n_classes,
                  missing_note(summary, run_dir), engine_note(summary, keys))


def _mixed(summary: pd.DataFrame) -> str:
    """' · mixed engine: batched, fast' where the folder's finished runs (of several invocations) were
    trained by several engines or thread counts: their last digits are not comparable bit for bit."""
    finished = finished_runs(summary)
    parts = [f"mixed {key}: {', '.join(map(str, sorted(set(finished[key]))))}" for key in ("engine", "threads")
             if key in finished and finished[key].nunique() > 1]
    return "".join(f" · {part}" for part in parts)


def _about(run_dir: Path) -> str:
    """The latest sweep's tags and notes, for the title area ("" where it has neither)."""
    try:
        data = yaml.safe_load((run_dir / SWEEP_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return ""
    data = data if isinstance(data, dict) else {}
    tags, notes = data.get("tags") or [], data.get("notes") or ""
    text = f" · tags: {', '.join(map(str, tags))}" if isinstance(tags, list) and tags else ""
    return text + (f"\n{notes.strip()}" if isinstance(notes, str) and notes.strip() else "")


def variant_groups(frame: pd.DataFrame, keys: list[str], everything: str = "all runs",
                   ) -> list[tuple[str, pd.DataFrame]]:
    """The rows of `frame` grouped by `keys` in order of appearance, each with its variant label."""
    if not keys:
        return [(everything, frame)]
    return [(variant_label(dict(zip(keys, values if isinstance(values, tuple) else (values,)))), group)
            for values, group in frame.groupby(keys, sort=False, dropna=False)]


def n_choices(frame: pd.DataFrame) -> pd.Series:
    """Per row, how many classes the run's loss chooses among: model.n_classes, or for a Transformer
    (`model.arch: transformer`) its vocabulary, data.vocab. A folder from before the Transformer has
    no model.arch column: every run is an FFN."""
    classes = frame["model.n_classes"].astype(int)
    if "model.arch" not in frame:
        return classes
    return classes.where(frame["model.arch"] != "transformer", frame["data.vocab"]).astype(int)


def trained_threshold(n_classes: int) -> float:
    """A run trained if its final loss is under a tenth of chance, ln(n_classes) / 10."""
    return math.log(n_classes) * TRAINED_FRACTION


def is_trained(final_loss: pd.Series, status: pd.Series, n_classes: pd.Series | int) -> pd.Series:
    """Per run: completed (not diverged) with a final loss under `trained_threshold`."""
    threshold = (n_classes.astype(int).map(trained_threshold) if isinstance(n_classes, pd.Series)
                 else trained_threshold(n_classes))
    return (status == "completed") & (final_loss < threshold)


def _column(label: str, group: pd.DataFrame, keys: list[str], steps: list[int], metric: str,
            missing: int = 0) -> Column:
    """One variant's column; its `missing` runs (no verified result) count in every cell's n."""
    values = {k: group[k].iloc[0] for k in keys}
    finals = group.sort_values("step").groupby("run_id").tail(1)
    cells = {}
    for step in steps:
        # the runs that reached this step, or would have but diverged (they stop at a non-finite loss)
        runs = int(((finals["step"] >= step) | (finals["status"] == "diverged")).sum()) + missing
        at_step = group[(group["step"] == step) & group["loss"].astype(float).map(math.isfinite)]
        series = at_step[metric].astype(float)
        std = float(series.std(ddof=1)) if len(series) > 1 else math.nan  # one run has no spread, not 0
        if runs:
            cells[step] = (float(series.mean()) if len(series) else math.nan, std, len(series), runs)
    trained = int(is_trained(finals["loss"], finals["status"], n_choices(finals)).sum())
    unit = "seeds" if group["seed"].nunique() == len(finals) else "runs"
    diverged = int((finals["status"] == "diverged").sum())
    return Column(label, values, cells, trained, len(finals), unit, diverged, missing)


def _title(summary: pd.DataFrame, metric: str) -> str:
    first = summary.iloc[0]
    fixed = {"depth": "model.depth", "width": "model.width", "optim": "optim.name", "lr": "optim.lr",
             "schedule": "schedule.kind", "warmup": "schedule.warmup_steps", "steps": "train.steps"}
    varying = set(varying_keys(summary))
    parts = [f"{name}={first[key]}" for name, key in fixed.items() if key not in varying and key in first]
    seeds = summary["seed"].nunique()
    finished = len(finished_runs(summary))
    covered = f" · {finished} of {len(summary)} runs finished" if finished < len(summary) else ""
    return f"{metric} per step · {' '.join(parts)} · {seeds} seed{'s' if seeds > 1 else ''}{covered}"


def grid_cells(report: Report) -> tuple[list[str], list[list[str]]]:
    """The table as a header and rows: the article's layout (steps down, variants across), or, past
    `WIDE` variants, transposed (variants down, with their verdict; steps across) so it stays readable."""
    if len(report.columns) <= WIDE:
        header = ["step", *(c.label for c in report.columns)]
        rows = [[str(step), *(report.cell(c, step) for c in report.columns)] for step in report.steps]
        return header, rows
    header = ["variant", *(f"step {step}" for step in report.steps)]
    if report.metric == "loss":
        header.append("trained")
    rows = []
    for column in report.columns:
        verdict = [f"{column.trained}/{column.runs}"] if report.metric == "loss" else []
        rows.append([column.label, *(report.cell(column, step) for step in report.steps), *verdict])
    return header, rows


def _grid_align(report: Report, n_columns: int) -> str:
    """Numbers right-aligned; the variant names of a transposed table left-aligned."""
    return ("l" if len(report.columns) > WIDE else "r") + "r" * (n_columns - 1)


def to_rich(report: Report):  # -> rich.console.Group (rich is imported lazily)
    """The title line, the table, and (for the loss) the verdict line."""
    from rich.console import Group
    from rich.text import Text

    header, rows = grid_cells(report)
    table = _rich_table(header, rows, _grid_align(report, len(header)))
    parts = [Text(report.title, style="bold"), table]
    if report.partial:
        parts.append(Text(PARTIAL_NOTE))
    if report.metric == "loss":
        parts.append(Text(report.verdict_line()))
    if report.engines:
        parts.append(Text(report.engines, style="bold"))
    if report.missing:
        parts.append(Text(report.missing, style="bold"))
    return Group(*parts)


def to_markdown(report: Report) -> str:
    header, rows = grid_cells(report)
    title, *notes = report.title.split("\n")  # the sweep's notes follow its title line
    lines = [f"**{title}**", *notes, "", *_markdown_table(header, rows, _grid_align(report, len(header)))]
    if report.partial:
        lines += ["", PARTIAL_NOTE]
    if report.metric == "loss":
        lines += ["", report.verdict_line()]
    if report.engines:
        lines += ["", f"**{report.engines}**"]
    if report.missing:
        lines += ["", f"**{report.missing}**"]
    return "\n".join(lines) + "\n"


def to_csv(report: Report) -> str:
    """Long form: one row per column and step, with mean, std, the number of runs the mean covers (n),
    the runs of the cell (finite or diverged) and, per column, how many diverged."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["variant", "step", f"{report.metric}_mean", f"{report.metric}_std", "n", "verdict", "runs",
                     "diverged"])
    for column in report.columns:
        for step in report.steps:
            if step in column.cells:
                mean, std, n, runs = column.cells[step]
                writer.writerow([column.label, step, csv_number(mean), csv_number(std), n, report.verdict(column),
                                 runs, column.diverged])
    return buffer.getvalue()


# ----------------------------------------------------------------------------- final-loss pivot


@dataclass(frozen=True)
class Pivot:
    """Final loss (mean ± std over the seeds whose final loss is finite) with `rows` down and `cols`
    across, one panel per combination of the other varying keys; `n` counts the runs a mean covers,
    `runs` every run of the cell (the difference diverged or is missing)."""

    rows: str
    cols: str
    panels: list[tuple[str, pd.DataFrame, pd.DataFrame, pd.DataFrame, pd.DataFrame]]  # title, mean, std, n, runs
    lost: list[pd.DataFrame]  # per panel: how many runs of each cell have no verified result
    missing: str = ""  # names the runs left out (missing, failed or corrupt), or ""
    engines: str = ""  # `engine_note`: the cells that average exact and fast-engine runs, or ""

    def cell(self, mean: float, std: float, n: int, runs: int, lost: int = 0) -> str:
        return aggregate_cell(mean, std, _count(n), _count(runs), _count(lost))

    @property
    def partial(self) -> bool:
        return any(((n < runs) & (runs > 0)).to_numpy().any() for _, _, _, n, runs in self.panels)


def build_pivot(run_dir: str | Path, rows: str, cols: str) -> Pivot:
    summary = load_summary(run_dir)
    _check_keys([rows, cols], summary, "--pivot")
    finished = finished_runs(summary)
    if finished.empty:
        note = missing_note(summary, run_dir)
        raise ResultsError(f"{run_dir}: no finished runs yet" + (f"; {note}" if note else ""))
    planned = summary.copy()  # every run of the sweep: a missing one counts in its cell's n, not in its mean
    loss = planned["final_loss"].astype(float)
    planned["final_loss"] = loss.where(loss.map(math.isfinite) & planned.index.isin(finished.index))
    planned["lost"] = (~planned.index.isin(finished.index)).astype(int)
    others = [k for k in varying_keys(summary) if k not in ("seed", rows, cols)]
    panels, lost = [], []
    for title, group in variant_groups(planned, others):
        cells = group.groupby([rows, cols], sort=False, dropna=False)
        stats = cells["final_loss"].agg(["mean", "std", "count", "size"])
        mean, std, n, runs = (stats[c].unstack(cols) for c in ("mean", "std", "count", "size"))
        panels.append((title, mean, std, n.fillna(0), runs.fillna(0)))  # std: nan below 2 finite runs
        lost.append(cells["lost"].sum().unstack(cols).reindex_like(mean).fillna(0))
    return Pivot(rows, cols, panels, lost, missing_note(summary, run_dir), engine_note(summary, [*others, rows, cols]))


def _count(value: float) -> int:
    return 0 if pd.isna(value) else int(value)


def _short(key: str) -> str:
    return key_label(key)


def _pivot_cells(pivot: Pivot, corner: str, panel: int) -> tuple[list[str], list[list[str]], str]:
    """One panel's header, rows and alignment; `corner` labels the row and column keys."""
    _, mean, std, n, runs = pivot.panels[panel]
    lost = pivot.lost[panel]
    header = [corner, *(str(c) for c in mean.columns)]
    rows = [[str(row), *(pivot.cell(mean.at[row, c], std.at[row, c], n.at[row, c], runs.at[row, c], lost.at[row, c])
                         for c in mean.columns)] for row in mean.index]
    return header, rows, "l" + "r" * len(mean.columns)


def pivot_to_rich(pivot: Pivot):  # -> rich.console.Group
    from rich.console import Group
    from rich.text import Text

    corner = f"{_short(pivot.rows)} \\ {_short(pivot.cols)}"
    parts = [_rich_table(*_pivot_cells(pivot, corner, i), title=f"final loss · {title}")
             for i, (title, *_) in enumerate(pivot.panels)]
    parts.append(Text(f"rows: {pivot.rows}; columns: {pivot.cols}; cells: final loss, mean ± std over seeds"))
    if pivot.partial:
        parts.append(Text(PARTIAL_NOTE))
    if pivot.engines:
        parts.append(Text(pivot.engines, style="bold"))
    if pivot.missing:
        parts.append(Text(pivot.missing, style="bold"))
    return Group(*parts)


def pivot_to_markdown(pivot: Pivot) -> str:
    lines = []
    for i, (title, *_) in enumerate(pivot.panels):
        lines += [f"**final loss · {title}**", "",
                  *_markdown_table(*_pivot_cells(pivot, f"{pivot.rows} \\ {pivot.cols}", i)), ""]
    if pivot.partial:
        lines += [PARTIAL_NOTE, ""]
    if pivot.engines:
        lines += [f"**{pivot.engines}**", ""]
    if pivot.missing:
        lines += [f"**{pivot.missing}**", ""]
    return "\n".join(lines)


def pivot_to_csv(pivot: Pivot) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["panel", pivot.rows, pivot.cols, "final_loss_mean", "final_loss_std", "n", "runs", "missing"])
    for (title, mean, std, n, runs), lost in zip(pivot.panels, pivot.lost):
        for row in mean.index:
            for col in mean.columns:
                if runs.at[row, col] > 0:  # a cell whose runs all diverged or are missing is a row with n = 0
                    writer.writerow([title, row, col, csv_number(mean.at[row, col]), csv_number(std.at[row, col]),
                                     int(n.at[row, col]), int(runs.at[row, col]), int(lost.at[row, col])])
    return buffer.getvalue()


# ----------------------------------------------------------------------------- the gradnorm study


def gradnorm_tables(summary) -> tuple[list[str], list[list[str]], list[str]]:  # summary: GradnormSummary
    """Header, rows and closing lines of the gradnorm table (shared by Rich and markdown)."""
    from normexp.diagnostics import LayerGradnorm

    if isinstance(summary, LayerGradnorm):
        return layer_gradnorm_tables(summary)
    placements = list(summary.last_grad)
    header = ["depth L", *(f"{_gradnorm_label(p)}: ||grad W2_L||" for p in placements)]
    rows = [[str(depth), *(_mean_std(*summary.last_grad[p][i]) for p in placements)]
            for i, depth in enumerate(summary.depths)]
    deepest = summary.depths[-1]
    slopes = ", ".join(f"{_gradnorm_label(p)} {summary.slopes[p]:+.2f}" for p in placements)
    if len(summary.depths) < 2:
        slopes = "needs two depths or more (e.g. --set model.depth=8,16,32)"
    lines = [f"each cell: {_over_seeds(summary.seeds)}",
             f"fitted slope of log ||grad W2_L|| against log L: {slopes} (Xiong et al.: Post-LN 0, Pre-LN -0.5)"]
    for p in placements:
        stream, norm_in = summary.stream_sq[p], summary.norm_in_sq[p]
        lines.append(f"{_gradnorm_label(p)}, L={deepest}: ||x_l||^2/d entering blocks 1, L/2, L = "
                     f"{stream[0]:.2f}, {stream[len(stream) // 2]:.2f}, {stream[-1]:.2f}; "
                     f"||u||^2/d entering the norms, mean over blocks = {_nanmean(norm_in):.2f}")
    lines.append("Xiong et al. Lemma 2 (xavier_normal init): ||u||^2/d ~ 1.5 entering each Post-LN norm; "
                 "||x_l||^2/d ~ 1 + l/2 along the Pre-LN stream")
    gains = ", ".join(f"{_gradnorm_label(p)} {summary.measured_gain(p):.3f}" for p in placements)
    expected = f"{summary.branch_gain:.3f}" if summary.branch_gain is not None else "unknown for this init"
    lines.append(f"branch energy c = E||F(x)||^2/d per block, measured: {gains}; from the init, 2m/(1+m)^2 = "
                 f"{expected} (Xiong's N(0, 1/d) weights: 0.5). Lemma 2 with c: Post 1 + c, Pre 1 + c*l")
    return header, rows, lines


def layer_gradnorm_tables(summary) -> tuple[list[str], list[list[str]], list[str]]:  # LayerGradnorm
    """The Transformer's table: per layer, each variant's gradient of each sublayer's output projection;
    then per variant the last/first ratio and its verdict."""
    from normexp.diagnostics import GROWTH_FACTOR, SUBLAYERS

    columns = [(v, c) for v in summary.grads for c in SUBLAYERS]
    header = ["layer l", *(f"{_gradnorm_label(v)}: {SUBLAYERS[c]}" for v, c in columns)]
    rows = [[str(layer), *("—" if math.isnan(summary.grads[v][c][i][0]) else _mean_std(*summary.grads[v][c][i])
                           for v, c in columns)]
            for i, layer in enumerate(summary.layers)]
    lines = [f"each cell: {_over_seeds(summary.seeds)}"]
    if len(summary.depths) > 1:
        lines.append(f"depths {', '.join(map(str, summary.depths))}: each is its own variant (L=depth); "
                     "— where that model has no such layer")
    lines += [f"{_gradnorm_label(v)}: last/first layer " + ", ".join(
        f"{SUBLAYERS[c]} {summary.ratio(v, c):.2f} ({summary.verdict(v, c)})" for c in SUBLAYERS)
        for v in summary.grads]
    lines.append(f"verdict: grows above {GROWTH_FACTOR}x, shrinks below 1/{GROWTH_FACTOR}, flat between "
                 "(Xiong et al. Fig. 3: Post-LN grows with the layer index, Pre-LN flat)")
    return header, rows, lines


def _over_seeds(seeds: int) -> str:
    return f"mean ± std over {seeds} seed{'s' if seeds > 1 else ''}" + (
        " (one seed: no spread, so no std; add --set seeds=0,1,2)" if seeds == 1 else "")


def _mean_std(mean: float, std: float) -> str:
    """'mean ± std', or the mean alone where the std is undefined (nan: one seed)."""
    return f"{mean:.4f}" if math.isnan(std) else f"{mean:.4f} ± {std:.4f}"


def _gradnorm_label(variant: str) -> str:
    """'post kind="rmsnorm"' -> 'Post kind="rmsnorm"': the placement's label, then the other axes."""
    placement, _, rest = variant.partition(" ")
    return " ".join(filter(None, [PLACEMENT_LABELS.get(placement, placement), rest]))


def _nanmean(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan


def gradnorm_to_rich(summary):  # -> rich.console.Group
    from rich.console import Group
    from rich.text import Text

    header, rows, lines = gradnorm_tables(summary)
    table = _rich_table(header, rows, "l" + "r" * (len(header) - 1),
                        title=f"gradient norms at initialisation ({_over_seeds(summary.seeds)})")
    return Group(table, *(Text(line) for line in lines))


def gradnorm_to_markdown(summary) -> str:
    header, rows, lines = gradnorm_tables(summary)
    out = _markdown_table(header, rows, "l" + "r" * (len(header) - 1))
    return "\n".join(out + [""] + [f"- {line}" for line in lines]) + "\n"


# ----------------------------------------------------------------------------- norm facts and speed


def _fmt(value: object) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


PROPERTY_HEADER = ["check", "measured", "expected", "article", "result"]


def _property_rows(props) -> list[list[str]]:  # props: list[normexp.diagnostics.Property]
    return [[p.name, _fmt(p.measured), p.expectation, p.article, "pass" if p.passed else "FAIL"] for p in props]


def properties_to_rich(props):
    return _rich_table(PROPERTY_HEADER, _property_rows(props), "lllll",
                       title="RMSNorm facts (shared/seeds/001), measured here")


def properties_to_markdown(props) -> str:
    return "\n".join(_markdown_table(PROPERTY_HEADER, _property_rows(props), "lrlrl")) + "\n"


def _speed_rows(timings) -> list[list[str]]:
    rows = []
    for t in timings:
        ln = next(x for x in timings if x.kind == "layernorm" and x.shape == t.shape)
        rows.append([str(t.shape), t.kind, f"{t.forward_ms:.3f}", f"{t.forward_ms / ln.forward_ms:.2f}x",
                     f"{t.backward_ms:.3f}", f"{t.backward_ms / ln.backward_ms:.2f}x"])
    return rows


SPEED_HEADER = ["shape", "norm", "forward ms", "vs LayerNorm", "fwd+bwd ms", "vs LayerNorm"]


def speed_to_rich(timings):
    return _rich_table(SPEED_HEADER, _speed_rows(timings), "llrrrr",
                       title="norm speed on this machine (median of repeats, float32, CPU)")


def speed_to_markdown(timings) -> str:
    return "\n".join(_markdown_table(SPEED_HEADER, _speed_rows(timings), "llrrrr")) + "\n"


# ----------------------------------------------------------------------------- learning-rate sensitivity

SENSITIVITY_HEADER = ["variant", "LR sensitivity", "best lr", "l* (best seed-mean)", "lrs", "seeds", "runs",
                      "diverged", "missing"]
SENSITIVITY_NOTE = ("LR sensitivity = mean over the lr grid of [min(final loss, loss at init) - l*], l* the "
                    "variant's best seed-mean final loss; ± the std over seeds (Wortsman et al. 2023). "
                    "Lower: less sensitive.")


def _sensitivity_value(row) -> str:  # row: normexp.sensitivity.Sensitivity
    if math.isnan(row.sensitivity):
        return "— (an lr has no finished run)"
    return f"{row.sensitivity:.4f}" + ("" if math.isnan(row.spread) else f" ± {row.spread:.4f}")


def _sensitivity_rows(rows: list) -> list[list[str]]:
    return [[r.label, _sensitivity_value(r), f"{r.best_lr:g}", f"{r.best_loss:.4f}", f"{r.lrs}/{r.grid_lrs}",
             str(r.seeds), str(r.runs), str(r.diverged), str(r.missing)] for r in rows]


def sensitivity_to_markdown(rows: list, engines: str = "") -> str:
    """`engines`: `engine_note` of the sweep, a line under the table ("" for none)."""
    table = _markdown_table(SENSITIVITY_HEADER, _sensitivity_rows(rows), "lrrrrrrrr")
    return "\n".join([*table, "", SENSITIVITY_NOTE, *(["", f"**{engines}**"] if engines else [])]) + "\n"


def sensitivity_to_rich(rows: list, engines: str = ""):  # -> rich.console.Group
    from rich.console import Group
    from rich.text import Text

    table = _rich_table(SENSITIVITY_HEADER, _sensitivity_rows(rows), "lrrrrrrrr", title="learning-rate sensitivity")
    return Group(table, Text(SENSITIVITY_NOTE), *([Text(engines, style="bold")] if engines else []))


def sensitivity_to_csv(rows: list) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["variant", "lr_sensitivity", "seed_std", "best_lr", "best_loss", "lrs", "grid_lrs", "seeds",
                     "runs", "diverged", "missing"])
    for r in rows:
        writer.writerow([r.label, csv_number(r.sensitivity), csv_number(r.spread), csv_number(r.best_lr),
                         csv_number(r.best_loss), r.lrs, r.grid_lrs, r.seeds, r.runs, r.diverged, r.missing])
    return buffer.getvalue()


# ----------------------------------------------------------------------------- normexp verify


VERIFY_HEADER = ["path", "problem", "fix"]


def verification_to_rich(result):  # result: normexp.verify.Verification -> rich.console.Group
    """The findings of `normexp verify` as a table, then one line: clean, or what is left to do."""
    from rich.console import Group
    from rich.text import Text

    rows = [[f.path, f.problem if f.severity == "problem" else f"note: {f.problem}", f.remedy]
            for f in result.findings]
    title = f"{result.out_dir}: {result.verified} of {result.runs} runs verified"
    parts = [_rich_table(VERIFY_HEADER, rows, "lll", title=title)] if rows else [Text(title)]
    if result.clean:
        parts.append(Text("clean" + (" after the fixes above" if result.fixed and rows else ""), style="bold"))
    else:
        left = f"{result.remaining} problem{'s' if result.remaining != 1 else ''}"
        hint = (f"rerun the sweep (normexp sweep {result.out_dir / 'sweep.yaml'} --out {result.out_dir})"
                if result.fixed else f"normexp verify {result.out_dir} --fix")
        parts.append(Text(f"{left} {'left' if result.fixed else 'found'}: {hint}", style="bold"))
    return Group(*parts)
