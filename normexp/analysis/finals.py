"""What a table or a figure reads of each run: its row at its last step, and whether it trained. Pure
pandas: no torch, rich or matplotlib.

- `last_rows` and `variant_finals`: each run's row at its last recorded step, and per variant its rows
  and its runs' last rows judged by the trained rule (the report's columns).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from normexp.analysis.variants import is_trained, n_choices, thresholds, variant_groups


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
