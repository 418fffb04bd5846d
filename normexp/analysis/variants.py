"""Variants and their labels, the trained rule, and which engines trained a folder's runs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd

from normexp.config import key_label, trained_threshold
from normexp.registry import KINDS, PLACEMENTS
from normexp.registry import label as method_label
from normexp.results import finished_runs

PLACEMENT_LABELS = {name: method.label for name, method in PLACEMENTS.items()}  # normexp/registry.py


KIND_LABELS = {name: method.label for name, method in KINDS.items()}


def variant_label(values: dict[str, object]) -> str:
    """'Post-LN', 'Pre-RMS lr=0.001', ... from a column's key values."""
    parts = []
    placement, kind = values.get("norm.placement"), values.get("norm.kind")
    if placement is not None or kind is not None:
        head = method_label(str(placement), PLACEMENTS) if placement is not None else ""
        if kind is not None:
            head = f"{head}-{method_label(str(kind), KINDS)}" if head else method_label(str(kind), KINDS)
        parts.append(head)
    parts += [f"{key_label(key)}={'null' if is_null(value) else value}" for key, value in values.items()
              if key not in ("norm.placement", "norm.kind")]
    return " ".join(parts) or "run"


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


def is_null(value: object) -> bool:
    """A null config value: None, or the NaN that an empty summary.csv cell reads as."""
    return value is None or (isinstance(value, float) and math.isnan(value))


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


def is_trained(final_loss: pd.Series, status: pd.Series, n_classes: pd.Series | int) -> pd.Series:
    """Per run: completed (not diverged) with a final loss under `trained_threshold`."""
    threshold = (n_classes.astype(int).map(trained_threshold) if isinstance(n_classes, pd.Series)
                 else trained_threshold(n_classes))
    return (status == "completed") & (final_loss < threshold)
