"""Learning-rate sensitivity: one number per variant for "how much does this design care about the lr?"

Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer training instabilities",
arXiv 2309.14322) compare interventions by how much the final loss degrades across a log-spaced
learning-rate sweep. For a sweep with an `optim.lr` axis of at least 3 values, per variant (the runs
that share every other varying key) and per run r at learning rate lr:

    c_r       = min(final loss_r, loss_r at step 0)     a diverged run (nan / inf) counts as c_r = l0_r:
                                                         no progress, not infinity
    m(lr)     = mean over the variant's seeds of c_r
    l*        = min over the lr grid of m(lr)            the best lr's seed-mean of the clipped loss
    LR sensitivity = mean over the lr grid of [m(lr) - l*]

The seed spread is the standard deviation over seeds of each seed's own sensitivity, the same formula on
that seed's runs alone: mean_lr [c_s(lr) - min over the lr grid of c_s] (seeds that miss an lr are left
out of it). It answers "is a difference between two sensitivities beyond the seed noise?": how much the
number itself moves from seed to seed. (Each seed's mean_lr [c_s - l*] against the shared l* would measure
how much a seed's loss level moves instead: a seed that is better at every lr alike is no noise in how
much the lr matters.)

Comparing two arms (a design without and with an intervention): each arm's sensitivity against its own l*
is the paper's formula, but an intervention that lowers the best loss itself (a rescue) then reads as a
rise, since the arm's other lrs are measured from a lower floor. `arm_change` reports both readings: each
arm against its own l*, and each against the best l* of the two arms,

    shared sensitivity = mean over the lr grid of [m(lr) - min(l*_a, l*_b)] = sensitivity + l* - min(l*_a, l*_b)

and judges the change on the shared one (an arm is not called more sensitive for reaching a lower loss).
A change is "beyond the seed spread" only with at least 2 seeds in both arms and a spread to judge by
(the larger of the two arms' seed spreads); with one seed it cannot tell. A variant with an lr of the grid that
has no finished run gets no number: a missing run is shown as missing. Every row says how many seeds,
runs and diverged runs it covers. This module imports pandas but never torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from normexp.analysis.variants import engine_note, is_null, variant_groups
from normexp.config import METRIC_COLUMNS, VAL_COLUMNS
from normexp.results import Folder, ResultsError, as_folder, varying_keys

LR_KEY = "optim.lr"
MIN_LRS = 3


@dataclass(frozen=True)
class Sensitivity:
    """One variant's LR sensitivity, with what it covers."""

    label: str
    values: dict[str, object]  # the variant's keys (the other varying keys) and values
    sensitivity: float  # nan when an lr of the grid has no finished run
    spread: float  # std over seeds of each seed's own sensitivity (its own l*; nan below 2 complete seeds)
    best_lr: float
    best_loss: float  # l*
    lrs: int  # learning rates of the grid with at least one finished run
    grid_lrs: int
    seeds: int
    runs: int  # finished runs (completed or diverged)
    diverged: int
    missing: int  # runs of the sweep that have not finished (pending, failed, or unreadable)


CANNOT_TELL = "cannot tell"  # one seed: no spread to judge a change by


@dataclass(frozen=True)
class ArmChange:
    """How an intervention moves a design's LR sensitivity, in both readings (see the module docstring)."""

    own: tuple[float, float]  # (before, after), each arm against its own l*: the paper's formula
    shared: tuple[float, float]  # (before, after), each against the best l* of the two arms
    best: tuple[float, float]  # (before, after) l*
    effect: str  # on the shared reading: lowers, raises, leaves within noise, or CANNOT_TELL
    own_effect: str  # the same judgement on the own-l* reading
    seeds: int  # the fewer of the two arms' seeds


def against_best(row: Sensitivity, best_loss: float) -> float:
    """`row`'s sensitivity scored against the l* `best_loss` instead of its own: mean_lr [m(lr) - best_loss]."""
    return row.sensitivity + row.best_loss - best_loss


def judge(before: float, after: float, noise: float, seeds: int) -> str:
    """lowers / raises / leaves within noise, the change against `noise` (a seed spread); CANNOT_TELL below
    2 seeds or without a finite spread."""
    if seeds < 2 or not math.isfinite(noise):
        return CANNOT_TELL
    delta = after - before
    return "lowers" if delta < -noise else "raises" if delta > noise else "leaves within noise"


def arm_change(before: Sensitivity, after: Sensitivity) -> ArmChange:
    """The change from arm `before` to arm `after` (both complete), both readings, judged against the larger
    finite seed spread of the two."""
    best = min(before.best_loss, after.best_loss)
    shared = (against_best(before, best), against_best(after, best))
    spreads = [s for s in (before.spread, after.spread) if math.isfinite(s)]
    noise = max(spreads) if spreads else math.nan
    seeds = min(before.seeds, after.seeds)
    return ArmChange((before.sensitivity, after.sensitivity), shared, (before.best_loss, after.best_loss),
                     judge(*shared, noise, seeds), judge(before.sensitivity, after.sensitivity, noise, seeds), seeds)


def clipped_final(final: pd.Series, initial: pd.Series, diverged: pd.Series | None = None) -> pd.Series:
    """min(final, initial) per run, a non-finite final loss (or a run whose status is `diverged`: it met
    a non-finite loss, even if it then went on to a finite one) counting as the initial one."""
    final = final.astype(float)
    ok = np.isfinite(final) if diverged is None else np.isfinite(final) & ~diverged.astype(bool)
    return np.minimum(final.where(ok, np.inf), initial.astype(float))


def lr_table(source: str | Path | Folder) -> tuple[pd.DataFrame, list[str]]:
    """One row per finished run: its config keys, seed, status, `initial` (loss at step 0), `final`
    (last recorded loss) and `clipped`; and the variant keys (varying keys but the seed and the lr).
    Raises ResultsError unless the sweep has an lr axis of at least MIN_LRS values."""
    folder = as_folder(source)
    summary = folder.summary
    lrs = sorted(summary[LR_KEY].astype(float).unique()) if LR_KEY in summary else []
    if len(lrs) < MIN_LRS:
        shown = ", ".join(f"{v:g}" for v in lrs) or "none"
        raise ResultsError(f"--lr-sensitivity: needs an {LR_KEY} axis of at least {MIN_LRS} values; "
                           f"this sweep has {len(lrs)} ({shown})")
    tidy = folder.metrics(all_config=True)  # in the sweep's order, each run's steps in order
    runs = tidy.groupby("run_id", sort=False)
    metrics = [*METRIC_COLUMNS, *VAL_COLUMNS]  # val_*: sequence tasks only
    table = runs.head(1).set_index("run_id").drop(columns=metrics, errors="ignore")
    # the loss of each run's first and last recorded row, nan included: GroupBy.first()/last() would skip
    # a diverged run's nan and hand back the loss of the step before it
    table["initial"] = runs.head(1).set_index("run_id")["loss"].astype(float)
    table["final"] = runs.tail(1).set_index("run_id")["loss"].astype(float)
    table["clipped"] = clipped_final(table["final"], table["initial"], table["status"] == "diverged")
    keys = [k for k in varying_keys(summary) if k not in ("seed", LR_KEY)]
    return table.reset_index(), keys


def variant_sensitivity(group: pd.DataFrame, grid_lrs: list[float]) -> tuple[float, float, float, float]:
    """(sensitivity, seed spread, best lr, l*) of one variant's rows of `lr_table`."""
    by_seed = group.pivot_table(index="seed", columns=LR_KEY, values="clipped", aggfunc="mean")
    by_seed = by_seed.reindex(columns=grid_lrs)
    means = by_seed.mean(axis=0, skipna=True)
    if means.isna().all():
        return math.nan, math.nan, math.nan, math.nan
    best_lr = float(means.idxmin())
    best = float(means.min())
    sensitivity = float((means - best).mean()) if not means.isna().any() else math.nan
    complete = by_seed.dropna(axis=0, how="any")
    per_seed = complete.sub(complete.min(axis=1), axis=0).mean(axis=1)  # each seed's own sensitivity
    spread = float(per_seed.std(ddof=1)) if len(per_seed) > 1 else math.nan
    return sensitivity, spread, best_lr, best


def sensitivity_engines(source: str | Path | Folder) -> str:
    """`report.engine_note` for the sensitivity's cells (a variant at one lr): which average runs of the
    fast engine with exact ones, or ""."""
    summary = as_folder(source).summary
    return engine_note(summary, [*(k for k in varying_keys(summary) if k not in ("seed", LR_KEY)), LR_KEY])


def build_sensitivity(source: str | Path | Folder) -> list[Sensitivity]:
    """Every variant's LR sensitivity, in the sweep's order."""
    folder = as_folder(source)
    table, keys = lr_table(folder)
    summary = folder.summary
    grid_lrs = sorted(summary[LR_KEY].astype(float).unique())
    out = []
    for label, group in variant_groups(table, keys):
        values = {k: group[k].iloc[0] for k in keys}
        in_sweep = summary
        for key, value in values.items():  # a null (unset) key reads back as nan, equal to nothing
            same = in_sweep[key].isna() if is_null(value) else in_sweep[key].astype(str) == str(value)
            in_sweep = in_sweep[same]
        sensitivity, spread, best_lr, best = variant_sensitivity(group, grid_lrs)
        out.append(Sensitivity(
            label, values, sensitivity, spread, best_lr, best, int(group[LR_KEY].nunique()), len(grid_lrs),
            int(group["seed"].nunique()), len(group), int((group["status"] == "diverged").sum()),
            len(in_sweep) - len(group)))
    return out
