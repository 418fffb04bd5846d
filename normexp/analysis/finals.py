"""What a figure or a table reads of each run: its final value, trained or not, stopped early or not; and
which of a sweep's axes are numbers. Pure pandas: no torch, rich or matplotlib.

- `final_values`: one row per finished run, with its final value of a metric, `trained` (the trained
  rule, on the final training loss) and `stopped` (`stopped_early`: by train.stop_when);
- `last_rows` and `variant_finals`: each run's row at its last recorded step, and per variant its rows
  and its runs' last rows judged by the trained rule (the report's columns);
- `hold_stopped`: the per-step rows with each run that train.stop_when stopped (not diverged) held at its
  last value for the later steps, so that a per-step mean covers every seed, stopped or still running;
- `numeric_axes` and `is_sampled`: the varying keys a phase diagram can take, and whether their values
  are sampled points rather than a grid.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from normexp.analysis.sensitivity import LR_KEY
from normexp.analysis.variants import is_null, is_trained, n_choices, thresholds, variant_groups
from normexp.config import VAL_COLUMNS
from normexp.results import finished_runs, varying_keys


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


def hold_stopped(tidy: pd.DataFrame) -> pd.DataFrame:
    """The per-step rows, with each run that train.stop_when stopped before its last step and that did not
    diverge (`stopped_early` and status completed: it trained or stalled) held at its last recorded row for
    every later step that the frame records, up to its own train.steps. A per-step mean over seeds then
    covers every seed: stopped runs at the value they stopped at, rather than only the seeds still running
    (which made a mean rise while every run's loss fell). A stopped run's held-out score (val_loss, val_acc:
    its stopping step's) is left out of the rows of a step where a run still running was not scored (between
    two of train.eval_every's steps), its stopping step's own row too: it would be a mean of the stopped
    seeds alone there; it counts from the next step that scored them. A diverged run is not held: it counts
    as diverged.
    `tidy` needs train.steps and train.stop_when (all_config); without them it is returned as it is."""
    if tidy.empty or "train.steps" not in tidy or "train.stop_when" not in tidy:
        return tidy
    last = tidy.groupby("run_id", sort=False).tail(1)
    held = last[stopped_early(last) & (last["status"] == "completed")]
    if held.empty:
        return tidy
    steps = np.sort(tidy["step"].astype(int).unique())
    scored, unscored = _unscored_steps(tidy)
    added = []
    for index, row in held.iterrows():
        later = steps[(steps > int(row["step"])) & (steps <= int(row["train.steps"]))]
        if len(later):
            rows = pd.DataFrame([row] * len(later), index=[index] * len(later)).assign(step=later)
            rows.loc[rows["step"].isin(unscored), scored] = np.nan
            added.append(rows)
    stops = held.set_index("run_id")["step"].astype(int)
    own = tidy["run_id"].map(stops[stops.isin(unscored)]).eq(tidy["step"].astype(int))  # its stopping row
    if not added and not own.any():
        return tidy
    kept = tidy
    if own.any():
        kept = tidy.copy()
        kept.loc[own.to_numpy(), scored] = np.nan
    out = pd.concat([kept, *added]).astype(tidy.dtypes.to_dict())
    order = {rid: i for i, rid in enumerate(dict.fromkeys(tidy["run_id"]))}  # the runs keep their order
    out = out.iloc[np.lexsort((out["step"].astype(int).to_numpy(), out["run_id"].map(order).to_numpy()))]
    out.attrs = dict(tidy.attrs)
    return out.reset_index(drop=True)


def _unscored_steps(tidy: pd.DataFrame) -> tuple[list[str], set[int]]:
    """The frame's held-out columns, and the steps at which a run still running (a finite loss) of a task
    with a held-out split was not scored (between two of train.eval_every's steps)."""
    scored = [c for c in VAL_COLUMNS if c in tidy]
    if not scored:
        return scored, set()
    val = tidy[scored[0]].astype(float)
    splits = val.notna().groupby(tidy["run_id"]).transform("any")  # runs scored at some step: a held-out split
    running = np.isfinite(tidy["loss"].astype(float))
    return scored, set(tidy.loc[splits & running & val.isna(), "step"].astype(int))


def stopped_early(table: pd.DataFrame) -> pd.Series:
    """Per run (one row each): whether train.stop_when stopped it before its last step: summary.csv's
    stopped_at where the table has it, else a run under stop_when whose last recorded step is short of
    train.steps (a non-finite loss, which also ends a run early, makes it diverged: its cell says so)."""
    if "stopped_at" in table:
        return pd.to_numeric(table["stopped_at"], errors="coerce").notna()
    if "train.stop_when" not in table or "train.steps" not in table:
        return pd.Series(False, index=table.index)
    return ~table["train.stop_when"].map(is_null) & (table["step"].astype(int) < table["train.steps"].astype(int))


def last_rows(group: pd.DataFrame) -> pd.DataFrame:
    """Each run's row at its last recorded step. A tidy table holds each run's rows together, steps
    ascending (as its metrics.csv, verified): each run's last row, without sorting; else sorted."""
    rid, step = group["run_id"].to_numpy(), group["step"].to_numpy()
    ends = np.append(rid[1:] != rid[:-1], True)
    if len(set(rid[ends])) == int(ends.sum()) and bool((np.diff(step)[~ends[:-1]] > 0).all()):
        return group[ends]
    return group.sort_values("step").groupby("run_id").tail(1)


LIMIT, TRAINED = " limit", " trained"  # `variant_finals`' columns of each run's last row (no config key has a space)
Variant = tuple[str, pd.DataFrame, pd.DataFrame]  # a column's label, its rows, its runs' last rows


def variant_finals(tidy: pd.DataFrame, keys: list[str], trained_below: float | None) -> list[Variant]:
    """Each variant (`variant_groups` of `tidy` by `keys`): its label, its rows, and its runs' last rows
    with the final loss under which each counts as trained (LIMIT) and whether it did (TRAINED), judged
    for every run at once."""
    finals = last_rows(tidy)
    limits = thresholds(finals, trained_below)
    finals = finals.assign(**{LIMIT: limits, TRAINED: is_trained(finals["loss"], finals["status"], n_choices(finals),
                                                                 limits)})
    groups = variant_groups(tidy, keys, everything="run")
    if not keys:
        return [(label, group, finals) for label, group in groups]
    codes = tidy.groupby(keys, sort=False, dropna=False).ngroup()  # the order `variant_groups` lists them in
    by_code = dict(iter(finals.groupby(codes.loc[finals.index].to_numpy(), sort=True)))
    return [(label, group, by_code[code]) for code, (label, group) in enumerate(groups)]


def is_sampled(table: pd.DataFrame, x_key: str, y_key: str) -> bool:
    """Whether the runs' (x, y) values fill under half the cells of their x x y grid: sampled points (a
    sweep's `sample:` section), not a grid, so a heat map would be mostly empty cells."""
    pairs = table[[x_key, y_key]].drop_duplicates()
    cells = table[x_key].nunique(dropna=False) * table[y_key].nunique(dropna=False)
    return cells > 0 and len(pairs) < cells / 2
