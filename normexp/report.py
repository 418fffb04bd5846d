"""The article-style table, built from a sweep's output folder, rendered as Rich, markdown or CSV.

    step |  Post-LN | Post-RMS |   Pre-LN |  Pre-RMS        rows: report steps; columns: variants
       0 |   2.7399 |   2.7438 |   2.6015 |   2.6482        cells: the value, or mean ± std over seeds
      30 |   2.2052 |   2.2034 |   0.0201 |   0.0121
    Trained (final loss < ln(10)/10 = 0.230): Pre-LN, Pre-RMS.  Did not train: Post-LN, Post-RMS.

Columns are the runs grouped by the column keys (default: every varying config key but the seed);
runs that differ only in seed are one column. Labels follow the article: `Post-LN`, `Pre-RMS`...

Every aggregate says what it covers. A mean is taken over the runs whose loss is finite at that step;
where that is not every run of the cell, the cell says so (`0.0512 ± 0.0031 (2 of 4)`: the other two
diverged), a cell whose runs all diverged reads `diverged` (never `—`, which means "no run", or no
measurement: val_loss between two of train.eval_every's), and the verdict line counts diverged runs per
column. Each run is judged against its own n_classes.
Only verified runs count; a line under the table names the runs missing, failed or corrupt.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from normexp.analysis.finals import LIMIT, TRAINED, hold_stopped, variant_finals
from normexp.analysis.variants import (
    CHOICE_KEYS,
    PLACEMENT_LABELS,
    axis_label,
    constants,
    engine_note,
    is_null,
    mixed_note,
    n_choices,
    rule_text,
    stopped_note,
    variant_groups,
)
from normexp.config import Sweep, key_label
from normexp.results import (
    Folder,
    ResultsError,
    as_folder,
    check_metric,
    config_columns,
    finished_runs,
    missing_note,
    require_finished,
    unfinished_runs,
    varying_keys,
)
from normexp.tables import csv_number, markdown_table, number, rich_table

WIDE = 6  # more variants than this: the table is transposed (variants down, steps across)


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


PARTIAL_NOTE = ("(k of n): the mean covers the k runs of the cell whose loss is still finite; the other n - k diverged "
                "or are missing (named below), or did not measure it there (val_loss between evaluations). A run "
                "that ended before a step (a shorter train.steps) counts in no cell past its last step; a run that "
                "train.stop_when stopped early (and did not diverge) is not among them: it holds its last value in "
                "every later cell of its train.steps.")


@dataclass(frozen=True)
class Column:
    label: str
    values: dict[str, object]  # the column keys' values
    cells: dict[int, tuple[float, float, int, int]]  # step -> (mean, std, finite runs, runs that reached it)
    trained: int  # runs whose final loss is under their own threshold
    runs: int
    unit: str  # "seeds" when the column's runs differ only by seed, else "runs" (pooled over other keys)
    diverged: int = 0  # runs that diverged (they count as not trained)
    missing: int = 0  # runs of the sweep in this column with no verified result (missing, failed, corrupt)
    threshold: float = math.nan  # the final loss under which its runs count as trained (nan: runs differ)


@dataclass(frozen=True)
class Report:
    title: str
    metric: str
    steps: list[int]
    columns: list[Column]
    n_classes: tuple[int, ...]  # every n_classes among the runs: each run is judged by its own
    missing: str = ""  # names the runs left out (missing, failed or corrupt), or ""
    engines: str = ""  # `engine_note`: the cells that average exact and fast-engine runs, or ""
    trained_below: float | None = None  # the trained rule (report.trained_below); None: ln(C)/10
    pooled: tuple[str, ...] = ()  # varying keys (not the seed) that no column separates: pooled in each cell
    keys: tuple[str, ...] = ()  # the column keys
    stopped: str = ""  # `stopped_note`: the runs train.stop_when stopped early, or ""
    rule_from: str = "report.trained_below"  # where trained_below was set: the sweep, or --trained-below
    transposed: bool | None = None  # variants down, steps across; None: past WIDE variants (`fit_report` sets it)
    fit: str = ""  # `fit_report`'s line: which steps it left out to fit the terminal, or what would fit

    @property
    def is_transposed(self) -> bool:
        return len(self.columns) > WIDE if self.transposed is None else self.transposed

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

    @property
    def rule(self) -> str:
        return rule_text(self.n_classes, self.trained_below, self.rule_from)

    def verdict_line(self, full: bool = False) -> str:
        """Which columns trained: their names (`full`, or at most WIDE columns), else counts per group
        of the first column key ("Post: 0/8 cells trained; Pre: 8/8")."""
        if not full and len(self.columns) > WIDE and self.keys:
            return self.verdict_counts()
        rule = self.rule
        # a variant is judged by its finished runs; a missing run is evidence of nothing, so it is named, not counted
        trained = [_verdict_label(c) for c in self.columns if c.trained == c.runs]
        partly = [_verdict_label(c) for c in self.columns if 0 < c.trained < c.runs]
        failed = [_verdict_label(c) for c in self.columns if c.trained == 0 < c.runs]
        parts = [f"Trained ({rule}): {', '.join(trained) or 'none'}."]
        if partly:
            unit = "seeds" if all(c.unit == "seeds" for c in self.columns) else "runs"
            parts.append(f"Trained in some {unit}: {', '.join(partly)}.")
        parts.append(f"Did not train: {', '.join(failed) or 'none'}.")
        diverged = [f"{c.label} ({c.diverged} of {c.runs + c.missing} {c.unit})" for c in self.columns if c.diverged]
        if diverged:
            parts.append(f"Diverged: {', '.join(diverged)}.")
        return "  ".join(parts)

    def verdict_counts(self) -> str:
        """Per value of the first column key, how many of its columns (cells) trained in every run, in
        some, and had a diverged run: 'Trained (final loss < ...), per placement: Post: 0/8 cells trained;
        Pre: 8/8'."""
        key = self.keys[0]
        groups: dict[str, list[Column]] = {}
        for column in self.columns:
            groups.setdefault(_value_label(key, column.values[key]), []).append(column)
        parts = []
        for label, columns in groups.items():
            whole = sum(c.trained == c.runs > 0 and not c.missing for c in columns)
            partly = sum(0 < c.trained and not (c.trained == c.runs and not c.missing) for c in columns)
            diverged = sum(c.diverged > 0 for c in columns)
            extra = [f"{partly} partly" if partly else "", f"{diverged} with a diverged run" if diverged else ""]
            parts.append(f"{label}: {whole}/{len(columns)}{' cells trained' if not parts else ''}" +
                         "".join(f", {e}" for e in extra if e))
        return (f"Trained ({self.rule}), per {axis_label(key)}: " + "; ".join(parts) +
                ". A cell trained when every run of it did (report --verdicts full names them).")


def _verdict_label(column: Column) -> str:
    """'Pre', 'Pre (1/2 seeds)' when only some trained, 'Pre (1 of 2 seeds; 1 missing)' when some are missing."""
    c = column
    if c.missing:
        return f"{c.label} ({c.trained} of {c.runs + c.missing} {c.unit}; {c.missing} missing)"
    return c.label if c.trained in (0, c.runs) else f"{c.label} ({c.trained}/{c.runs} {c.unit})"


def _value_label(key: str, value: object) -> str:
    """A key's value as a verdict names it: a placement by its label ('Post'), else `key=value`."""
    if key == "norm.placement":
        return PLACEMENT_LABELS.get(str(value), str(value))
    if key == "sweep":
        return str(value)
    return f"{key_label(key)}={_key_value(value)}"


def _check_keys(keys: Sequence[str], summary: pd.DataFrame, option: str) -> None:
    unknown = [k for k in keys if k not in config_columns(summary)]
    if unknown:
        raise ResultsError(f"{option} {','.join(unknown)}: not a config key of this sweep")


def build_report(source: str | Path | Folder, steps: Sequence[int] | None = None, metric: str | None = None,
                 by: Sequence[str] | None = None, only_last: bool = False,
                 trained_below: float | None = None) -> Report:
    """Group a folder's finished runs (every invocation's, or the latest sweep's with `only_last`)
    into the table's columns and compute each cell. Unset arguments (`trained_below` too: the trained
    rule) come from the latest sweep's `report:` section, then from the defaults. Its columns are
    extended by every key that varies only across invocations (another depth run into the folder), so
    no two configs share a column unless `by` says so."""
    folder = as_folder(source)
    run_dir, section = folder.path, folder.sweep.report
    summary = folder.view(only_last)
    tidy = hold_stopped(folder.metrics(all_config=True, only_last=only_last))  # a stopped run holds its value
    varying = [k for k in varying_keys(summary) if k != "seed"]
    if by:
        keys = list(by)
    elif section.columns:
        latest = set(varying_keys(folder.latest))
        keys = [*section.columns, *(k for k in varying if k not in section.columns and k not in latest)]
    else:
        keys = varying
    _check_keys(keys, summary, "--by")
    metric = metric or section.metric
    rule = folder.trained_rule(trained_below)
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
    pooled = tuple(k for k in varying if k not in keys)
    used = [*keys, *pooled, "run_id", "seed", "status", "step", "loss", metric, *CHOICE_KEYS]  # what `_column` reads
    read = tidy[[c for c in dict.fromkeys(used) if c in tidy]]
    columns = [_column(label, group, finals, keys, steps, metric, missing.get(label, 0), pooled)
               for label, group, finals in variant_finals(read, keys, rule)]
    title = _title(summary, metric, pooled) + mixed_note(summary) + _about(folder.sweep)
    return Report(title, metric, steps, columns, n_classes, missing_note(summary, run_dir), engine_note(summary, keys),
                  rule, pooled, tuple(keys), stopped=stopped_note(summary),
                  rule_from="--trained-below" if trained_below is not None else "report.trained_below")


def sweep_report(run_dir: str | Path | Folder) -> Report:
    """What `normexp sweep` prints once its runs are done: the table of the grid it ran (the latest sweep's
    runs, as `report --only-last`), whatever else the folder holds. Runs of earlier invocations in the same
    folder (the README's "change an axis" example run into the default folder) would add a column key and
    turn the article's table into another; `report DIR` shows them all."""
    return build_report(run_dir, only_last=True)


def _about(sweep: Sweep) -> str:
    """The latest sweep's tags and notes, for the title area ("" where it has neither)."""
    text = f" · tags: {', '.join(map(str, sweep.tags))}" if sweep.tags else ""
    return text + (f"\n{sweep.notes.strip()}" if sweep.notes.strip() else "")


def _column(label: str, group: pd.DataFrame, finals: pd.DataFrame, keys: list[str], steps: list[int], metric: str,
            missing: int = 0, pooled: Sequence[str] = ()) -> Column:
    """One variant's column from its rows and its runs' last rows (`variant_finals`); its `missing` runs (no
    verified result) count in every cell's n. Its runs are "seeds" only where no `pooled` key varies
    among them."""
    values = {k: group[k].iloc[0] for k in keys}
    last, diverged_run = finals["step"].to_numpy(), (finals["status"] == "diverged").to_numpy()
    step_of, finite = group["step"].to_numpy(), np.isfinite(group["loss"].astype(float).to_numpy())
    measured = group[metric].astype(float).to_numpy()
    unmeasured = finite & np.isnan(measured)  # val_loss between two of train.eval_every's: no measurement
    cells = {}
    for step in steps:
        # the runs that reached this step, or would have but diverged (they stop at a non-finite loss), less
        # those that did not measure the metric there
        runs = int(((last >= step) | diverged_run).sum()) + missing - int((unmeasured & (step_of == step)).sum())
        series = pd.Series(measured[(step_of == step) & finite & ~unmeasured])  # the runs' values, in run order
        std = float(series.std(ddof=1)) if len(series) > 1 else math.nan  # one run has no spread, not 0
        if runs:
            cells[step] = (float(series.mean()) if len(series) else math.nan, std, len(series), runs)
    limits = finals[LIMIT]
    same = all(finals[k].nunique(dropna=False) <= 1 for k in pooled if k in finals)
    unit = "seeds" if same and finals["seed"].nunique() == len(finals) else "runs"  # a run's seed is its last row's
    threshold = float(limits.iloc[0]) if limits.nunique() == 1 else math.nan
    return Column(label, values, cells, int(finals[TRAINED].sum()), len(finals), unit, int(diverged_run.sum()),
                  missing, threshold)


def _title(summary: pd.DataFrame, metric: str, pooled: Sequence[str] = ()) -> str:
    finished = len(finished_runs(summary))
    covered = f" · {finished} of {len(summary)} runs finished" if finished < len(summary) else ""
    return f"{metric} per step · {constants(summary)} · {_seeds(summary, pooled)}{covered}"


def _seeds(summary: pd.DataFrame, pooled: Sequence[str] = ()) -> str:
    """How many seeds each configuration has: '3 seeds', or '1 to 3 seeds per configuration' in a folder
    whose invocations ran some configurations with more seeds than others; with `pooled` keys (`--by`
    leaves them out of the columns), which keys each column pools over: its mean ± std is over runs."""
    others = [k for k in varying_keys(summary) if k != "seed"]
    if pooled:
        names = ", ".join(axis_label(k) for k in pooled)
        return f"each column pools its runs over {names} and the seeds: mean ± std over runs, not seeds"
    counts = summary.groupby(others, dropna=False)["seed"].nunique() if others else summary[["seed"]].nunique()
    low, high = int(counts.min()), int(counts.max())
    if low == high:
        return f"{low} seed{'s' if low > 1 else ''}"
    return f"{low} to {high} seeds per configuration"


def grid_cells(report: Report) -> tuple[list[str], list[list[str]]]:
    """The table as a header and rows: the article's layout (steps down, variants across), or, past
    `WIDE` variants, transposed (variants down, with their verdict; steps across) so it stays readable."""
    if not report.is_transposed:
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
    return ("l" if report.is_transposed else "r") + "r" * (n_columns - 1)


def to_rich(report: Report, full: bool = False):  # -> rich.console.Group (rich is imported lazily)
    """The title line, the table, and (for the loss) the verdict line (`full`: naming every column)."""
    from rich.console import Group
    from rich.text import Text

    header, rows = grid_cells(report)
    table = rich_table(header, rows, _grid_align(report, len(header)))
    parts = [Text(report.title, style="bold"), table]
    if report.fit:
        parts.append(Text(report.fit, style="italic"))
    if report.partial:
        parts.append(Text(PARTIAL_NOTE))
    if report.metric == "loss":
        parts.append(Text(report.verdict_line(full)))
    if report.stopped:
        parts.append(Text(report.stopped))
    if report.engines:
        parts.append(Text(report.engines, style="bold"))
    if report.missing:
        parts.append(Text(report.missing, style="bold"))
    return Group(*parts)


def to_markdown(report: Report, full: bool = False) -> str:
    header, rows = grid_cells(report)
    title, *notes = report.title.split("\n")  # the sweep's notes follow its title line
    lines = [f"**{title}**", *notes, "", *markdown_table(header, rows, _grid_align(report, len(header)))]
    if report.fit:
        lines += ["", f"_{report.fit}_"]
    if report.partial:
        lines += ["", PARTIAL_NOTE]
    if report.metric == "loss":
        lines += ["", report.verdict_line(full)]
    if report.stopped:
        lines += ["", report.stopped]
    if report.engines:
        lines += ["", f"**{report.engines}**"]
    if report.missing:
        lines += ["", f"**{report.missing}**"]
    return "\n".join(lines) + "\n"


def to_csv(report: Report) -> str:
    """Long form: one row per column and step: one column per column key (`norm.placement`, `optim.lr`,
    ...: the sweep's own names, so that a script filters on them), the variant's label, the step, mean,
    std, the number of runs the mean covers (n), the runs of the cell (finite or diverged), per column
    how many trained and diverged, the verdict, the trained threshold and the keys each row pools over."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    keys = list(report.keys)
    writer.writerow([*keys, "variant", "step", f"{report.metric}_mean", f"{report.metric}_std", "n", "runs",
                     "trained", "diverged", "verdict", "threshold", "pooled_over"])
    pooled = " ".join(report.pooled)
    for column in report.columns:
        for step in report.steps:
            if step in column.cells:
                mean, std, n, runs = column.cells[step]
                writer.writerow([*(_key_value(column.values[k]) for k in keys), column.label, step, csv_number(mean),
                                 csv_number(std), n, runs, column.trained, column.diverged, report.verdict(column),
                                 csv_number(column.threshold), pooled])
    return buffer.getvalue()


def spread_steps(steps: Sequence[int], count: int) -> list[int]:
    """`count` of `steps` (sorted), evenly spread, the first and the last always among them."""
    steps = sorted(steps)
    if count >= len(steps):
        return steps
    if count <= 1:
        return steps[-1:]
    picked = {steps[round(i * (len(steps) - 1) / (count - 1))] for i in range(count)}
    return sorted(picked)


def table_width(report: Report) -> int:
    """How many terminal columns `to_rich`'s table takes with no cell wrapped (rich is imported lazily)."""
    from rich.console import Console
    from rich.measure import Measurement

    header, rows = grid_cells(report)
    console = Console(width=1_000_000, highlight=False, markup=False, emoji=False)
    table = rich_table(header, rows, _grid_align(report, len(header)))
    return Measurement.get(console, console.options, table).maximum


def fit_report(report: Report, width: int) -> Report:
    """The report as it fits `width` terminal columns with every cell on one line: as it is where it does;
    else variants down and steps across (the transposed layout), with as many of its steps as fit, the first
    and the last always shown, and a line naming the steps left out and the --steps that shows them. Where
    not even two steps fit, the report as it is, with a line suggesting the narrower views (--pivot,
    --steps, --by). Only for a terminal: off one, nothing is cut (the commands print the whole table)."""
    if table_width(report) <= width:
        return report
    steps = list(report.steps)
    best = None
    for count in range(len(steps), 1, -1):
        shown = spread_steps(steps, count)
        candidate = replace(report, steps=shown, transposed=True)
        if table_width(candidate) <= width:
            best = candidate
            break
    if best is None:
        return replace(report, fit=f"the table is wider than this terminal ({table_width(report)} > {width} "
                                    f"columns): {_narrower(report, '--steps S1,S2 fewer steps, ')}"
                                    "--format markdown the whole table")
    left = [s for s in steps if s not in best.steps]
    said = (f"steps {', '.join(map(str, left))} left out to fit {width} columns: --steps "
            f"{','.join(map(str, steps))} shows them" if left else f"variants down to fit {width} columns")
    pivot = _narrower(report)
    return replace(best, fit=said + (f", {pivot.rstrip(', ')}" if pivot else ""))


def _narrower(report: Report, steps: str = "") -> str:
    """'--pivot optim.lr,schedule.warmup_steps the final loss by learning rate and warmup steps, ': a pivot
    of two column keys, numbers first (a phase diagram's axes), where two vary."""
    keys = [k for k in report.keys if k != "sweep"]
    numeric = [k for k in keys if all(_sort_value(c.values[k])[0] == 1 for c in report.columns)]
    keys = [*numeric, *(k for k in keys if k not in numeric)][:2]
    pivot = (f"--pivot {keys[0]},{keys[1]} the final loss by {axis_label(keys[0])} and {axis_label(keys[1])}, "
             if len(keys) == 2 else "")
    return pivot + steps


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


def build_pivot(source: str | Path | Folder, rows: str, cols: str) -> Pivot:
    folder = as_folder(source)
    run_dir, summary = folder.path, folder.summary
    _check_keys([rows, cols], summary, "--pivot")
    finished = require_finished(summary, run_dir)
    planned = summary.copy()  # every run of the sweep: a missing one counts in its cell's n, not in its mean
    loss = planned["final_loss"].astype(float)
    planned["final_loss"] = loss.where(loss.map(math.isfinite) & planned.index.isin(finished.index))
    planned["lost"] = (~planned.index.isin(finished.index)).astype(int)
    others = [k for k in varying_keys(summary) if k not in ("seed", rows, cols)]
    # a sampled key's values come in the order they were drawn: its rows, columns and panels go by value
    sampled = {k for _, one in getattr(folder, "folders", None) or [("", folder)] for k in one.sweep.sampled_keys}
    panels, lost = [], []
    groups = variant_groups(planned, others)
    if sampled & set(others):
        groups.sort(key=lambda item: tuple(_sort_value(v) for v in item[1][others].iloc[0]))
    for title, group in groups:
        cells = group.groupby([rows, cols], sort=False, dropna=False)
        stats = cells["final_loss"].agg(["mean", "std", "count", "size"])
        mean, std, n, runs = (_by_value(stats[c].unstack(cols), rows in sampled, cols in sampled)
                              for c in ("mean", "std", "count", "size"))
        panels.append((title, mean, std, n.fillna(0), runs.fillna(0)))  # std: nan below 2 finite runs
        lost.append(cells["lost"].sum().unstack(cols).reindex_like(mean).fillna(0))
    return Pivot(rows, cols, panels, lost, missing_note(summary, run_dir), engine_note(summary, [*others, rows, cols]))


def _sort_value(value: object) -> tuple:
    """A value's place among a key's values: numbers by value (null first), anything else by its text."""
    if is_null(value):
        return (0, 0.0, "")
    if isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
        return (1, float(value), "")
    return (2, 0.0, str(value))


def _by_value(table: pd.DataFrame, rows: bool, cols: bool) -> pd.DataFrame:
    """`table` with its rows (and columns) in order of value where they are a sampled key's."""
    if rows:
        table = table.iloc[sorted(range(len(table.index)), key=lambda i: _sort_value(table.index[i]))]
    if cols:
        table = table.iloc[:, sorted(range(len(table.columns)), key=lambda i: _sort_value(table.columns[i]))]
    return table


def _count(value: float) -> int:
    return 0 if pd.isna(value) else int(value)


def _short(key: str) -> str:
    return key_label(key)


def _key_value(value: object) -> str:
    """A key's value as the labels write it: a null (an unset key, read back as nan) is `null`."""
    return "null" if is_null(value) else str(value)


def _pivot_cells(pivot: Pivot, corner: str, panel: int) -> tuple[list[str], list[list[str]], str]:
    """One panel's header, rows and alignment; `corner` labels the row and column keys."""
    _, mean, std, n, runs = pivot.panels[panel]
    lost = pivot.lost[panel]
    header = [corner, *(_key_value(c) for c in mean.columns)]
    rows = [[_key_value(row), *(pivot.cell(mean.at[row, c], std.at[row, c], n.at[row, c], runs.at[row, c],
                                           lost.at[row, c]) for c in mean.columns)] for row in mean.index]
    return header, rows, "l" + "r" * len(mean.columns)


def pivot_to_rich(pivot: Pivot):  # -> rich.console.Group
    from rich.console import Group
    from rich.text import Text

    corner = f"{_short(pivot.rows)} \\ {_short(pivot.cols)}"
    parts = [rich_table(*_pivot_cells(pivot, corner, i), title=f"final loss · {title}")
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
                  *markdown_table(*_pivot_cells(pivot, f"{pivot.rows} \\ {pivot.cols}", i)), ""]
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
