"""Variants and their labels, the trained rule, and which engines trained a folder's runs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from normexp.config import key_label, trained_threshold
from normexp.registry import KINDS, PLACEMENTS
from normexp.registry import label as method_label
from normexp.results import finished_runs

PLACEMENT_LABELS = {name: method.label for name, method in PLACEMENTS.items()}  # normexp/registry.py


KIND_LABELS = {name: method.label for name, method in KINDS.items()}


AXIS_LABELS = {  # what a reader calls a config key, in figures' axes and legends and in the report's prose
    "norm.placement": "placement", "norm.kind": "norm kind", "optim.lr": "learning rate",
    "schedule.warmup_steps": "warmup steps", "schedule.kind": "schedule", "model.depth": "depth",
    "model.width": "width", "model.n_classes": "classes", "model.arch": "architecture", "data.task": "task",
    "data.vocab": "vocabulary", "train.steps": "training steps", "optim.name": "optimizer", "seed": "seed",
    "optim.weight_decay": "weight decay", "model.hidden_mult": "hidden multiplier", "model.init": "init",
    "sweep": "sweep"}


def axis_label(key: str) -> str:
    """A config key as a reader names it ('learning rate', 'warmup steps'), else its `key_label`."""
    return AXIS_LABELS.get(key, key_label(key))


def value_label(key: str, value: object) -> str:
    """One value of a key as a legend or panel shows it: a placement's or kind's label ('Pre', 'RMS'),
    a number in short form (1e-3 style), null for an unset key."""
    if is_null(value):
        return "null"
    if key == "norm.placement":
        return method_label(str(value), PLACEMENTS)
    if key == "norm.kind":
        return method_label(str(value), KINDS)
    if isinstance(value, float):
        return short_number(value)
    return str(value)


def short_number(value: float, scientific: bool | None = None) -> str:
    """A number as a figure writes it: 1e-3 or 3.2e-4 below 0.01 and from 1e5 up (or wherever
    `scientific` says), else 0.05 or 200."""
    value = float(value)
    if scientific is None:
        scientific = value != 0 and (abs(value) < 0.01 or abs(value) >= 1e5)
    if not scientific or value == 0 or not math.isfinite(value):
        return f"{value:g}"
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


TITLE_KEYS = {  # the constants that define a sweep's runs, named in titles where they do not vary
    "arch": "model.arch", "task": "data.task", "placement": "norm.placement", "kind": "norm.kind",
    "depth": "model.depth", "width": "model.width", "n_classes": "model.n_classes", "vocab": "data.vocab",
    "optim": "optim.name", "lr": "optim.lr", "schedule": "schedule.kind", "warmup": "schedule.warmup_steps",
    "steps": "train.steps"}


def constants(frame: pd.DataFrame) -> str:
    """'arch=ffn task=random_labels kind=layernorm depth=6 ...': every TITLE_KEYS key that one value
    covers among `frame`'s runs (a Transformer's vocab, an FFN's n_classes: what its loss chooses among)."""
    first = frame.iloc[0]
    transformer = "model.arch" in frame and (frame["model.arch"] == "transformer").all()
    skip = "n_classes" if transformer else "vocab"
    return " ".join(f"{name}={'null' if is_null(first[key]) else first[key]}" for name, key in TITLE_KEYS.items()
                    if name != skip and key in frame and frame[key].nunique(dropna=False) == 1)


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


STOPPED_LISTED = 3  # runs named one by one in the early-stopping note; more are counted per reason


def _trained_stop(row: pd.Series) -> str:
    """A `stop_when: trained` stop in words: "trained" under the trained rule's own threshold; under a
    train.stop_below of its own, the condition it met ("loss < 1 (train.stop_below)"), and, where the
    trained rule judges the run not trained, that too: the stop and the verdict never contradict."""
    below = row.get("train.stop_below")
    if below is None or is_null(below):
        return "trained"
    text = f"loss < {float(below):g} (train.stop_below)"
    if "trained" in row and str(row["trained"]).strip().lower() in ("false", "0", "0.0"):
        text += ", not trained by the trained rule"
    return text


def stopped_note(summary: pd.DataFrame) -> str:
    """A line on the finished runs that train.stop_when stopped early ("Stopped early (train.stop_when):
    post-layernorm-s0-... at step 12 (trained)", or per reason "5 trained, at steps 12 to 30"), or "" where
    none did (or the folder predates the stopped_at column). They record no step after theirs; a per-step
    mean holds each at its last value (`finals.hold_stopped`), unless it diverged."""
    finished = finished_runs(summary)
    if "stopped_at" not in finished or finished.empty:
        return ""
    at = pd.to_numeric(finished["stopped_at"], errors="coerce")
    stopped = finished[at.notna()].assign(at=at[at.notna()].astype(int))
    if stopped.empty:
        return ""
    reason = stopped["train.stop_when"].astype(str) if "train.stop_when" in stopped else pd.Series("?", stopped.index)
    reason = reason.where(reason != "trained", [_trained_stop(row) for _, row in stopped.iterrows()])
    if len(stopped) <= STOPPED_LISTED:
        parts = [f"{rid} at step {step} ({why})" for rid, step, why in zip(stopped["run_id"], stopped["at"], reason)]
    else:
        parts = []
        for why, group in stopped.groupby(reason, sort=True):
            first, last = int(group["at"].min()), int(group["at"].max())
            steps = f"step {first}" if first == last else f"steps {first} to {last}"
            parts.append(f"{len(group)} {why}, at {steps}")
    runs = "run" if len(finished) == 1 else "runs"
    return (f"Stopped early (train.stop_when), {len(stopped)} of {len(finished)} {runs}: {'; '.join(parts)}; "
            "each per-step mean holds a stopped run at its last value (a diverged stop counts as diverged).")


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


def mixed_note(summary: pd.DataFrame) -> str:
    """' · mixed engine: batched, fast' where the folder's finished runs (of several invocations) were
    trained by the fast engine and an exact one, or with several thread counts: their last digits are
    not comparable bit for bit. The exact engines (reference, batched) give the same bits: one
    `--engine auto` sweep may train its runs on both, and that is no mix."""
    finished = finished_runs(summary)
    parts = []
    if "engine" in finished:
        engines = set(finished["engine"].astype(str))
        if engines & set(APPROXIMATE_ENGINES) and engines - set(APPROXIMATE_ENGINES):
            parts.append(f"mixed engine: {', '.join(sorted(engines))}")
    if "threads" in finished and finished["threads"].nunique() > 1:
        parts.append(f"mixed threads: {', '.join(map(str, sorted(set(finished['threads']))))}")
    return "".join(f" · {part}" for part in parts)


def is_null(value: object) -> bool:
    """A null config value: None, or the NaN that an empty summary.csv cell reads as."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def distinct_keys(frame: pd.DataFrame, keys: Sequence[str]) -> tuple[list[str], dict[str, list[str]]]:
    """`keys` less those that vary together with another (the same partition of `frame`'s rows: the sweep of
    folders compared side by side, each at its own depth), so that a figure or a model shows each
    difference once; and for each key kept, the keys it stands for. A config key is kept over `sweep`
    (it names what differs), else the first listed."""
    order = sorted(keys, key=lambda k: k == "sweep")  # stable: config keys first, `sweep` last
    codes = {k: frame[k].astype(str).factorize()[0] for k in order}
    kept: list[str] = []
    aliases: dict[str, list[str]] = {}
    for key in order:
        twin = next((k for k in kept if _same_partition(codes[k], codes[key])), None)
        if twin is None:
            kept.append(key)
        else:
            aliases.setdefault(twin, []).append(key)
    return [k for k in keys if k in kept], aliases


def _same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two codings of the same rows group them alike (a one-to-one map between their values)."""
    pairs = set(zip(a.tolist(), b.tolist()))
    return len(pairs) == len(set(a.tolist())) == len(set(b.tolist()))


def variant_groups(frame: pd.DataFrame, keys: list[str], everything: str = "all runs",
                   ) -> list[tuple[str, pd.DataFrame]]:
    """The rows of `frame` grouped by `keys` in order of appearance, each with its variant label."""
    if not keys:
        return [(everything, frame)]
    return [(variant_label(dict(zip(keys, values if isinstance(values, tuple) else (values,)))), group)
            for values, group in frame.groupby(keys, sort=False, dropna=False)]


CHOICE_KEYS = ("model.n_classes", "model.arch", "data.vocab")  # the columns `n_choices` reads


def n_choices(frame: pd.DataFrame) -> pd.Series:
    """Per row, how many classes the run's loss chooses among: model.n_classes, or for a Transformer
    (`model.arch: transformer`) its vocabulary, data.vocab. A folder from before the Transformer has
    no model.arch column: every run is an FFN."""
    classes = frame["model.n_classes"].astype(int)
    if "model.arch" not in frame:
        return classes
    return classes.where(frame["model.arch"] != "transformer", frame["data.vocab"]).astype(int)


def thresholds(frame: pd.DataFrame, trained_below: float | None = None) -> pd.Series:
    """Per row, the final loss under which the run counts as trained: `trained_below` (the sweep's
    `report.trained_below`, or --trained-below) where set, else the default rule ln(C)/10."""
    if trained_below is not None:
        return pd.Series(float(trained_below), index=frame.index)
    return n_choices(frame).map(trained_threshold).astype(float)


def chance_levels(frame: pd.DataFrame) -> list[int]:
    """Each distinct number of choices among the runs (`n_choices`: n_classes, or a Transformer's
    vocabulary), in order of appearance: one chance line, ln(n), per value."""
    return list(dict.fromkeys(int(n) for n in n_choices(_choices(frame))))


def trained_limits(frame: pd.DataFrame, trained_below: float | None) -> list[float]:
    """Each distinct trained threshold among the runs."""
    return sorted(set(thresholds(_choices(frame), trained_below).round(12)))


def _choices(frame: pd.DataFrame) -> pd.DataFrame:
    """The distinct combinations of what `n_choices` reads, in order of appearance: the same values, once."""
    return frame[[k for k in CHOICE_KEYS if k in frame]].drop_duplicates()


def rule_text(n_classes: Sequence[int], trained_below: float | None = None,
              source: str = "report.trained_below") -> str:
    """The trained rule as the report states it: 'final loss < 0.2 (report.trained_below)' (`source`: where
    the rule was set, the sweep's report.trained_below or --trained-below), or 'final loss < ln(10)/10 =
    0.230' (each n_classes of the runs). A value is written as given (1e-320, not 9.99989e-321)."""
    if trained_below is not None:
        value = min(f"{trained_below:g}", repr(float(trained_below)), key=len)  # repr: a subnormal's own digits
        return f"final loss < {value} ({source})"
    rule = ", ".join(f"ln({n})/10 = {trained_threshold(n):.3f}" for n in n_classes)
    each = "each run's ln(n_classes)/10: " if len(n_classes) > 1 else ""
    return f"final loss < {each}{rule}"


def is_trained(final_loss: pd.Series, status: pd.Series, n_classes: pd.Series | int,
               threshold: pd.Series | float | None = None) -> pd.Series:
    """Per run: completed (not diverged) with a final loss under `threshold` (default: `trained_threshold`
    of its n_classes)."""
    if threshold is None:
        threshold = (n_classes.astype(int).map(trained_threshold) if isinstance(n_classes, pd.Series)
                     else trained_threshold(n_classes))
    return (status == "completed") & (final_loss < threshold)
