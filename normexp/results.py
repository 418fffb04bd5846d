"""Load a sweep's output folder into pandas, for the report, the plots and users' own analysis.

    from normexp.results import load_metrics
    df = load_metrics("runs/warmup")          # one row per run and recorded step
    df.groupby(["norm.placement", "norm.kind", "step"]).loss.mean()

Floats are read with round-trip precision, so losses compare bit for bit with the training run.
This module imports pandas but never torch.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from normexp.config import run_keys
from normexp.store import METRICS_FILE, SUMMARY_FILE

FINISHED = ("completed", "diverged")
# pandas < 3 needs round_trip to parse repr() floats exactly; pandas 3 does so by default
_EXACT = {"float_precision": "round_trip"} if int(pd.__version__.split(".")[0]) < 3 else {}


class ResultsError(ValueError):
    """The folder is not a sweep's output (no summary.csv) or has no finished run."""


def load_summary(run_dir: str | Path) -> pd.DataFrame:
    """summary.csv: one row per run of the sweep (run_id, flattened config, status, final/min loss...)."""
    path = Path(run_dir) / SUMMARY_FILE
    if not path.is_file():
        raise ResultsError(f"{run_dir}: no {SUMMARY_FILE} here; is this a sweep's output folder?")
    return pd.read_csv(path, keep_default_na=False, na_values=["nan", "NaN", ""], **_EXACT)


def finished_runs(summary: pd.DataFrame) -> pd.DataFrame:
    """The rows of runs that finished training (completed or diverged): those with metrics."""
    return summary[summary["status"].isin(FINISHED)]


def config_columns(summary: pd.DataFrame) -> list[str]:
    return [k for k in run_keys() if k in summary.columns]


def varying_keys(summary: pd.DataFrame) -> list[str]:
    """Config keys that take more than one value across the sweep's runs (`seed` included). A null
    (an empty cell: e.g. DeepNorm's alpha left to its depth rule) is a value of its own."""
    return [k for k in config_columns(summary) if summary[k].nunique(dropna=False) > 1]


def load_metrics(run_dir: str | Path, all_config: bool = False) -> pd.DataFrame:
    """Every finished run's metrics, tidy: one row per (run, step) with run_id, `seed`, the varying
    config keys (or every config key with `all_config=True`), status, step, loss, acc, lr, grad_norm."""
    summary = load_summary(run_dir)
    finished = finished_runs(summary)
    if finished.empty:
        raise ResultsError(f"{run_dir}: no finished runs yet")
    keys = config_columns(summary) if all_config else [k for k in varying_keys(summary) if k != "seed"]
    attach = list(dict.fromkeys(["run_id", *keys, "seed", "status"]))
    frames = []
    for row in finished[attach].itertuples(index=False):
        metrics = pd.read_csv(Path(run_dir) / row.run_id / METRICS_FILE, **_EXACT)
        for column, value in zip(attach, row):
            metrics[column] = value
        frames.append(metrics)
    tidy = pd.concat(frames, ignore_index=True)
    return tidy[[*attach, *(c for c in tidy.columns if c not in attach)]]
