"""Load a sweep's output folder into pandas, for the report, the plots and users' own analysis.

    from normexp.results import load_metrics
    df = load_metrics("runs/warmup")          # one row per run and recorded step
    df.groupby(["norm.placement", "norm.kind", "step"]).loss.mean()
    blocks = load_blocks("runs/blocks")       # one row per run, logged step and block (train.log_blocks)
    sharp = load_sharpness("runs/sharp")      # one row per run and measured step (train.log_sharpness)

Floats are read with round-trip precision, so losses compare bit for bit with the training run.
This module imports pandas but never torch.

Nothing here trusts a file it has not checked: the summary is rebuilt from the run folders as
`folder.inspect_run` verifies them (summary.csv is a cache of that table), so a missing or corrupt run
is never counted as a result: its status says what it is, and `missing_note` names it.

A command reads a folder once: `load_folder` verifies each run once and keeps the summary, and each
`Folder` loads the runs' metrics (or blocks) on first use and keeps them; the report, the pivot, the LR
sensitivity, the figures and the studies' verdicts all take a `Folder` (or a path, loaded then).
"""

from __future__ import annotations

import io
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from normexp.config import Sweep, run_keys
from normexp.folder import (
    BLOCKS_FILE,
    FINISHED_STATUSES,
    METRICS_FILE,
    SHARPNESS_FILE,
    RunState,
    StoreError,
    cached_statuses,
    folder_run_ids,
    lock_owner,
    read_sweep,
    rows_csv,
    summary_rows,
)
from normexp.registry import references_unchecked

FINISHED = FINISHED_STATUSES
MISSING_LISTED = 5  # runs named in a missing-runs note before "and N more"
# pandas < 3 needs round_trip to parse repr() floats exactly; pandas 3 does so by default
_EXACT = {"float_precision": "round_trip"} if int(pd.__version__.split(".")[0]) < 3 else {}


class ResultsError(ValueError):
    """The folder is not a sweep's output (no readable sweep.yaml) or has no finished run."""


@dataclass
class Folder:
    """A sweep folder, read and verified once: `summary` holds every run it has (the latest sweep's and
    the verified runs of earlier invocations, as `load_summary` describes), `latest` the latest sweep's
    runs alone, `sweep` the latest sweep (its `report:` section, notes and tags). Metrics and blocks are
    read on first use and kept."""

    path: Path
    sweep: Sweep
    summary: pd.DataFrame
    latest: pd.DataFrame
    _tables: dict[tuple[str, bool, bool], pd.DataFrame] = field(default_factory=dict, repr=False)

    def view(self, only_last: bool = False) -> pd.DataFrame:
        return self.latest if only_last else self.summary

    def metrics(self, all_config: bool = False, only_last: bool = False) -> pd.DataFrame:
        """`load_metrics` of this folder (a copy: callers may add columns)."""
        key = (METRICS_FILE, all_config, only_last)
        if key not in self._tables:
            summary = self.view(only_last)
            finished = require_finished(summary, self.path)
            self._tables[key] = _attach(self.path, summary, finished, METRICS_FILE, all_config)
        return _copy(self._tables[key])

    def blocks(self, all_config: bool = False) -> pd.DataFrame:
        """`load_blocks` of this folder (a copy)."""
        key = (BLOCKS_FILE, all_config, False)
        if key not in self._tables:
            self._tables[key] = _blocks(self.path, self.summary, all_config)
        return _copy(self._tables[key])

    def sharpness(self, all_config: bool = False) -> pd.DataFrame:
        """`load_sharpness` of this folder (a copy)."""
        key = (SHARPNESS_FILE, all_config, False)
        if key not in self._tables:
            self._tables[key] = _sharpness(self.path, self.summary, all_config)
        return _copy(self._tables[key])

    def has_sharpness(self) -> bool:
        """Whether any finished run of this folder measured sharpness (train.log_sharpness)."""
        return not _sharpness_runs(self.summary).empty

    def trained_rule(self, trained_below: float | None = None) -> float | None:
        """The trained rule a command judges by: `trained_below` (--trained-below) where given, else the
        sweep's `report.trained_below` (None: ln(C)/10)."""
        return trained_below if trained_below is not None else self.sweep.report.trained_below


def load_folder(run_dir: str | Path) -> Folder:
    """Read the sweep folder `run_dir` once: each run it holds is verified once (`folder.inspect_run`)."""
    run_dir = Path(run_dir)
    try:
        with references_unchecked():  # a user's placement or kind: read as written, never imported
            return _load_folder(run_dir)
    except StoreError as exc:
        raise ResultsError(str(exc)) from None
    except OSError as exc:  # a name too long for the file system, a folder that cannot be listed
        raise ResultsError(f"{run_dir}: cannot read: {exc.strerror or exc}") from None


def _load_folder(run_dir: Path) -> Folder:
    sweep = read_sweep(run_dir)
    found: dict[str, RunState] = {}
    runs = folder_run_ids(run_dir, sweep, found)
    rows = summary_rows(run_dir, runs, cached_statuses(run_dir), sweep.report.trained_below, found)
    first = next(iter(runs.values()), None)
    latest = rows_csv(rows[:len(sweep.runs)], first)  # the latest sweep's runs come first
    return Folder(run_dir, sweep, _frame(latest + rows_csv(rows[len(sweep.runs):], first, header=False)),
                  _frame(latest))


def as_folder(source: str | Path | Folder) -> Folder:
    """`source` itself if it is a loaded `Folder`, else the folder at that path, loaded."""
    return source if isinstance(source, Folder) else load_folder(source)


def _frame(text: str) -> pd.DataFrame:
    return pd.read_csv(io.StringIO(text), keep_default_na=False, na_values=["nan", "NaN", ""], **_EXACT)


def _copy(table: pd.DataFrame) -> pd.DataFrame:
    """A copy of `table` the caller may change: under pandas' copy-on-write (pandas 3) a shallow one is
    (a change copies what it changes), else a deep one."""
    copy = table.copy(deep=not _COPY_ON_WRITE)
    copy.attrs = dict(table.attrs)
    return copy


_COPY_ON_WRITE = int(pd.__version__.split(".")[0]) >= 3


def load_summary(run_dir: str | Path | Folder, only_last: bool = False) -> pd.DataFrame:
    """One row per run the folder holds (run_id, flattened config, status, final/min loss...), as in
    summary.csv but rebuilt from the verified run folders: a corrupt run has status `corrupt` (and
    its problem under `error`), a missing one `pending` (or `interrupted`), neither has numbers.
    The folder holds the latest sweep's runs and every verified run of earlier invocations
    (`folder.folder_runs`); `only_last` keeps the latest sweep's grid alone."""
    return as_folder(run_dir).view(only_last).copy()


def finished_runs(summary: pd.DataFrame) -> pd.DataFrame:
    """The rows of runs that finished training (completed or diverged): those with metrics."""
    return summary[summary["status"].isin(FINISHED)]


def require_finished(summary: pd.DataFrame, run_dir: str | Path) -> pd.DataFrame:
    """`finished_runs(summary)`, or ResultsError saying there are none yet (and which runs are missing)."""
    finished = finished_runs(summary)
    if finished.empty:
        note = missing_note(summary, run_dir)
        raise ResultsError(f"{run_dir}: no finished runs yet" + (f"; {note}" if note else ""))
    return finished


def unfinished_runs(summary: pd.DataFrame) -> dict[str, str]:
    """run_id -> status of the runs that have no verified result (missing, corrupt, failed...)."""
    rows = summary[~summary["status"].isin(FINISHED)]
    return dict(zip(rows["run_id"], rows["status"]))


def missing_note(summary: pd.DataFrame, run_dir: str | Path) -> str:
    """A line naming the runs left out of every mean, cell and verdict, or "" if there are none."""
    missing = unfinished_runs(summary)
    if not missing:
        return ""
    named = [f"{rid} ({status})" for rid, status in list(missing.items())[:MISSING_LISTED]]
    more = f" and {len(missing) - MISSING_LISTED} more" if len(missing) > MISSING_LISTED else ""
    runs = "run" if len(missing) == 1 else "runs"
    superseded = summary[summary["status"] == "superseded"]
    why = ""
    if len(superseded):  # the earlier definition's folder is there, but it is not this run
        reasons = sorted({error.split(": ", 1)[1] for error in superseded["error"]})
        why = f"; {len(superseded)} of them {'; '.join(reasons)}"
    folders = summary.attrs.get("folders")  # several sweeps (normexp.compare): the folders that hold them
    where = ([folders[name] for name in dict.fromkeys(rid.split("/", 1)[0] for rid in missing) if name in folders]
             if folders else [str(run_dir)])
    writing = [path for path in where if lock_owner(Path(path)) is not None]
    if writing:  # its runs are pending, not lost; verify would refuse the folder while the sweep holds it
        named = [entry.replace(" (missing)", " (pending)") for entry in named]
        return (f"{len(missing)} {runs} not counted yet: pending, the sweep is still writing "
                f"{', '.join(writing)}: {', '.join(named)}{more}{why} (report again when it has finished)")
    verify = ", ".join(f"normexp verify {shlex.quote(path)}" for path in where)
    return f"{len(missing)} {runs} missing, failed or corrupt, not counted: {', '.join(named)}{more}{why} ({verify})"


def config_columns(summary: pd.DataFrame) -> list[str]:
    """The config keys among `summary`'s columns; `sweep` first where several folders are stacked
    (`normexp.compare`): it keys the runs like any other axis."""
    return [*(["sweep"] if "sweep" in summary.columns else []), *(k for k in run_keys() if k in summary.columns)]


def varying_keys(summary: pd.DataFrame) -> list[str]:
    """Config keys that take more than one value across the sweep's runs (`seed` included). A null
    (an empty cell: e.g. DeepNorm's alpha left to its depth rule) is a value of its own."""
    return [k for k in config_columns(summary) if summary[k].nunique(dropna=False) > 1]


def load_metrics(run_dir: str | Path | Folder, all_config: bool = False, only_last: bool = False) -> pd.DataFrame:
    """Every finished run's metrics, tidy: one row per (run, step) with run_id, `seed`, the varying
    config keys (or every config key with `all_config=True`), status, step, loss, acc, lr, grad_norm.
    Only verified runs are loaded; `.attrs["unfinished"]` maps the others' run_id to their status.
    `only_last`: the latest sweep's runs only (see `load_summary`)."""
    return as_folder(run_dir).metrics(all_config, only_last)


def load_blocks(run_dir: str | Path | Folder, all_config: bool = False) -> pd.DataFrame:
    """Every finished run's blocks.csv (runs with `train.log_blocks`), tidy like `load_metrics`: one
    row per (run, logged step, block) with the same config columns, then step, block, fc1_grad,
    fc2_grad, fc1_update, fc2_update, stream_rms, norm_rms, norm_out_rms (see normexp/blocklog.py)."""
    return as_folder(run_dir).blocks(all_config)


def _blocks(run_dir: Path, summary: pd.DataFrame, all_config: bool) -> pd.DataFrame:
    finished = finished_runs(summary)
    if "train.log_blocks" in finished:
        finished = finished[finished["train.log_blocks"].astype(str) == "True"]
    else:  # a folder written before per-block logging existed
        finished = finished.iloc[:0]
    return _attach_logged(run_dir, summary, finished, BLOCKS_FILE, all_config,
                          "logged per-block dynamics (set train.log_blocks: true)")


def load_sharpness(run_dir: str | Path | Folder, all_config: bool = False) -> pd.DataFrame:
    """Every finished run's sharpness.csv (runs with `train.log_sharpness`), tidy like `load_metrics`: one
    row per (run, measured step) with the same config columns, then step, lambda_max, precond_lambda_max,
    lr, threshold_gd, threshold_adam (see normexp/sharpness.py; nan and inf read back as floats)."""
    return as_folder(run_dir).sharpness(all_config)


def _sharpness_runs(summary: pd.DataFrame) -> pd.DataFrame:
    finished = finished_runs(summary)
    if "train.log_sharpness" not in finished:  # a folder written before sharpness was measured
        return finished.iloc[:0]
    return finished[pd.to_numeric(finished["train.log_sharpness"], errors="coerce").notna()]


def _sharpness(run_dir: Path, summary: pd.DataFrame, all_config: bool) -> pd.DataFrame:
    return _attach_logged(run_dir, summary, _sharpness_runs(summary), SHARPNESS_FILE, all_config,
                          "measured sharpness (set train.log_sharpness: K)")


def _attach_logged(run_dir: Path, summary: pd.DataFrame, finished: pd.DataFrame, name: str, all_config: bool,
                   what: str) -> pd.DataFrame:
    """`_attach` of the optional per-run file `name` that the `finished` runs logged: ResultsError where none
    did ("no finished run <what>") or where one's file is missing."""
    if finished.empty:
        raise ResultsError(f"{run_dir}: no finished run {what}")
    for run in finished["run_id"]:
        if not (Path(run_dir) / run / name).is_file():
            raise ResultsError(f"{run_dir}/{run}: {name} is missing; rerun the sweep with --force")
    return _attach(run_dir, summary, finished, name, all_config)


METRIC_RECORDED_BY = {"val_loss": "val_loss and val_acc: sequence tasks only",
                      "val_acc": "val_loss and val_acc: sequence tasks only",
                      "z_loss": "z_loss: Transformer runs with train.z_loss above 0 only"}  # which runs record it


def check_metric(tidy: pd.DataFrame, metric: str) -> None:
    """Refuse a metric the runs did not record, saying which runs record it (METRIC_RECORDED_BY)."""
    if metric not in tidy:
        why = METRIC_RECORDED_BY.get(metric)
        raise ResultsError(f"--metric {metric}: not recorded by these runs" + (f" ({why})" if why else ""))


def _attach(run_dir: str | Path, summary: pd.DataFrame, finished: pd.DataFrame, file: str,
            all_config: bool) -> pd.DataFrame:
    """Read `file` of each finished run and attach run_id, the config keys, seed and status in front."""
    keys = config_columns(summary) if all_config else [k for k in varying_keys(summary) if k != "seed"]
    attach = list(dict.fromkeys(["run_id", *keys, "seed", "status"]))
    data, repeats = _read_tables(Path(run_dir), list(finished["run_id"]), file)
    tidy = pd.concat([_repeated(finished[attach], repeats), data.drop(columns=[c for c in attach if c in data])],
                     axis=1)
    tidy.attrs["unfinished"] = unfinished_runs(summary)
    return tidy


def _repeated(runs: pd.DataFrame, repeats: list[int]) -> pd.DataFrame:
    """The runs' columns in front of their rows: row i of `runs` `repeats[i]` times, once for all rows (per
    run's frame they cost a minute at 10,000 runs). Each column is typed as pandas types the list of its
    values (as a column built from the repeated values would be), then repeated by position."""
    kept = [i for i, n in enumerate(repeats) if n]  # a run without rows has no value here
    values = pd.DataFrame({column: runs[column].iloc[kept].tolist() for column in runs})
    return values.take(np.repeat(np.arange(len(kept)), [repeats[i] for i in kept])).reset_index(drop=True)


def _read_tables(run_dir: Path, run_ids: list[str], file: str) -> tuple[pd.DataFrame, list[int]]:
    """`file` of each run, one table (rows in run order), and each run's row count. Files with one
    header are parsed as one CSV (10,000 runs' metrics in a second, instead of a parser per file);
    otherwise, or where the rows do not add up, each file on its own, as pandas reads it."""
    texts = []
    for rid in run_ids:
        try:
            with open(os.path.join(run_dir, rid, file), "rb") as f:  # not pathlib: 10,000 files
                texts.append(f.read().decode("utf-8"))
        except (OSError, ValueError) as exc:  # deleted or replaced after it was verified (a sweep writing?)
            raise ResultsError(f"{run_dir}/{rid}/{file}: changed while it was read "
                               f"({type(exc).__name__}); run the command again") from None
    heads, bodies = zip(*(text.partition("\n")[::2] for text in texts)) if texts else ((), ())
    if len(set(heads)) == 1 and all(body.endswith("\n") and "\n\n" not in body for body in bodies):
        repeats = [body.count("\n") for body in bodies]
        data = pd.read_csv(io.StringIO(heads[0] + "\n" + "".join(bodies)), **_EXACT)
        if len(data) == sum(repeats):
            return data, repeats
    frames = []
    for rid, text in zip(run_ids, texts):
        try:
            frames.append(pd.read_csv(io.StringIO(text), **_EXACT))
        except ValueError as exc:
            raise ResultsError(f"{run_dir}/{rid}/{file}: changed while it was read "
                               f"({type(exc).__name__}); run the command again") from None
    return pd.concat(frames, ignore_index=True), [len(frame) for frame in frames]
