"""The article-style table, built from a sweep's output folder, rendered as Rich, markdown or CSV.

    step |  Post-LN | Post-RMS |   Pre-LN |  Pre-RMS        rows: report steps; columns: variants
       0 |   2.7399 |   2.7438 |   2.6015 |   2.6482        cells: the value, or mean ± std over seeds
      30 |   2.2052 |   2.2034 |   0.0201 |   0.0121
    Trained (final loss < ln(10)/10 = 0.230): Pre-LN, Pre-RMS.  Did not train: Post-LN, Post-RMS.

Columns are the runs grouped by the column keys (default: every varying config key but the seed);
runs that differ only in seed are one column. Labels follow the article: `Post-LN`, `Pre-RMS`...
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from normexp.config import DEFAULT_REPORT_STEPS
from normexp.results import ResultsError, load_metrics, load_summary, varying_keys
from normexp.store import SWEEP_FILE

PLACEMENT_LABELS = {"post": "Post", "pre": "Pre", "sandwich": "Sandwich", "peri": "Peri",
                    "deepnorm": "DeepNorm", "mixln": "MixLN", "none": "NoNorm"}
KIND_LABELS = {"layernorm": "LN", "rmsnorm": "RMS", "rmsnorm_torch": "RMSt", "rmsnorm_llama": "RMSl",
               "rmsnorm_gemma": "RMSg", "prmsnorm": "pRMS", "scalenorm": "Scale"}
TRAINED_FRACTION = 0.1  # trained: final loss under a tenth of chance, ln(n_classes) / 10


def variant_label(values: dict[str, object]) -> str:
    """'Post-LN', 'Pre-RMS lr=0.001', ... from a column's key values."""
    parts = []
    placement, kind = values.get("norm.placement"), values.get("norm.kind")
    if placement is not None or kind is not None:
        head = PLACEMENT_LABELS.get(str(placement), "") if placement is not None else ""
        if placement != "none" and kind is not None:
            head = f"{head}-{KIND_LABELS.get(str(kind), kind)}" if head else str(KIND_LABELS.get(str(kind), kind))
        parts.append(head)
    parts += [f"{key.rsplit('.', 1)[-1]}={value}" for key, value in values.items()
              if key not in ("norm.placement", "norm.kind")]
    return " ".join(parts) or "run"


@dataclass(frozen=True)
class Column:
    label: str
    values: dict[str, object]  # the column keys' values
    cells: dict[int, tuple[float, float, int]]  # step -> (mean, std, n)
    trained: int  # runs whose final loss is under the threshold
    runs: int
    unit: str  # "seeds" when the column's runs differ only by seed, else "runs"


@dataclass(frozen=True)
class Report:
    title: str
    metric: str
    steps: list[int]
    columns: list[Column]
    threshold: float  # the trained/did-not-train threshold on the final loss
    n_classes: int

    def cell(self, column: Column, step: int) -> str:
        if step not in column.cells:
            return "—"
        mean, std, n = column.cells[step]
        return f"{mean:.4f}" if n == 1 else f"{mean:.4f} ± {std:.4f}"

    def verdict(self, column: Column) -> str:
        if column.runs == 1:
            return "trained" if column.trained else "did not train"
        return f"trained in {column.trained} of {column.runs} {column.unit}"

    def verdict_line(self) -> str:
        rule = f"final loss < ln({self.n_classes})/10 = {self.threshold:.3f}"
        trained = [c.label for c in self.columns if c.trained == c.runs]
        partly = [f"{c.label} ({c.trained}/{c.runs} {c.unit})" for c in self.columns if 0 < c.trained < c.runs]
        failed = [c.label for c in self.columns if c.trained == 0]
        parts = [f"Trained ({rule}): {', '.join(trained) or 'none'}."]
        if partly:
            parts.append(f"Trained in some seeds: {', '.join(partly)}.")
        parts.append(f"Did not train: {', '.join(failed) or 'none'}.")
        return "  ".join(parts)


def sweep_report_steps(run_dir: Path) -> list[int]:
    """The `report.steps` of the sweep that wrote `run_dir` (the defaults if it is unreadable)."""
    try:
        data = yaml.safe_load((run_dir / SWEEP_FILE).read_text())
        return [int(s) for s in data["report"]["steps"]]
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError):
        return list(DEFAULT_REPORT_STEPS)


def build_report(run_dir: str | Path, steps: Sequence[int] | None = None, metric: str = "loss",
                 by: Sequence[str] | None = None) -> Report:
    """Group a sweep's finished runs into the table's columns and compute each cell."""
    run_dir = Path(run_dir)
    summary = load_summary(run_dir)
    tidy = load_metrics(run_dir, all_config=True)
    keys = list(by) if by else [k for k in varying_keys(summary) if k != "seed"]
    unknown = [k for k in keys if k not in summary.columns or k in ("run_id", "status")]
    if unknown:
        raise ResultsError(f"--by {','.join(unknown)}: not a config key of this sweep")
    steps = list(steps) if steps else sweep_report_steps(run_dir)
    steps = [s for s in steps if s in set(tidy["step"])]
    n_classes = int(tidy["model.n_classes"].iloc[0])
    threshold = math.log(n_classes) * TRAINED_FRACTION
    columns = [_column(group, keys, steps, metric, threshold)
               for _, group in _groups(tidy, keys)]
    return Report(_title(summary, keys, metric), metric, steps, columns, threshold, n_classes)


def _groups(tidy: pd.DataFrame, keys: list[str]) -> list[tuple[object, pd.DataFrame]]:
    if not keys:
        return [((), tidy)]
    return list(tidy.groupby(keys, sort=False, dropna=False))


def _column(group: pd.DataFrame, keys: list[str], steps: list[int], metric: str, threshold: float) -> Column:
    values = {k: group[k].iloc[0] for k in keys}
    cells = {}
    for step, at_step in group[group["step"].isin(steps)].groupby("step"):
        series = at_step[metric].astype(float)
        std = float(series.std(ddof=1)) if len(series) > 1 else 0.0
        cells[int(step)] = (float(series.mean()), std, len(series))
    finals = group.sort_values("step").groupby("run_id").tail(1)
    trained = int(((finals["loss"] < threshold) & (finals["status"] == "completed")).sum())
    unit = "seeds" if group["seed"].nunique() == len(finals) else "runs"
    return Column(variant_label(values), values, cells, trained, len(finals), unit)


def _title(summary: pd.DataFrame, keys: list[str], metric: str) -> str:
    first = summary.iloc[0]
    fixed = {"depth": "model.depth", "width": "model.width", "optim": "optim.name", "lr": "optim.lr",
             "schedule": "schedule.kind", "warmup": "schedule.warmup_steps", "steps": "train.steps"}
    parts = [f"{name}={first[key]}" for name, key in fixed.items() if key not in keys and key in first]
    seeds = summary["seed"].nunique()
    return f"{metric} per step · {' '.join(parts)} · {seeds} seed{'s' if seeds > 1 else ''}"


def to_rich(report: Report):  # -> rich.console.Group (rich is imported lazily)
    """The title line, the table, and (for the loss) the verdict line."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table()
    table.add_column("step", justify="right")
    for column in report.columns:
        table.add_column(column.label, justify="right")
    for step in report.steps:
        table.add_row(str(step), *(report.cell(c, step) for c in report.columns))
    parts = [Text(report.title, style="bold"), table]
    if report.metric == "loss":
        parts.append(Text(report.verdict_line()))
    return Group(*parts)


def to_markdown(report: Report) -> str:
    lines = [f"**{report.title}**", "", "| step | " + " | ".join(c.label for c in report.columns) + " |",
             "|---:|" + "---:|" * len(report.columns)]
    for step in report.steps:
        lines.append(f"| {step} | " + " | ".join(report.cell(c, step) for c in report.columns) + " |")
    if report.metric == "loss":
        lines += ["", report.verdict_line()]
    return "\n".join(lines) + "\n"


def to_csv(report: Report) -> str:
    """Long form: one row per column and step, with mean, std and the number of seeds."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["variant", "step", f"{report.metric}_mean", f"{report.metric}_std", "n", "verdict"])
    for column in report.columns:
        for step in report.steps:
            if step in column.cells:
                mean, std, n = column.cells[step]
                writer.writerow([column.label, step, repr(mean), repr(std), n, report.verdict(column)])
    return buffer.getvalue()
