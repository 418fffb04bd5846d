"""The real-text warmup study's verdict (configs/realtext_warmup.yaml), computed from its numbers.

    runs = final_val_losses(metrics)                    # one row per run: its keys and its last val_loss
    verdict(runs, floors().unigram)                     # the paragraph; findings(...) the numbers behind it
    text_floors(tidy)                                   # the floors a loss figure of text runs draws

The study asks three things of each depth and learning rate, on Shakespeare by character (docs/realtext.md):

1. Does Post-LN without warmup stay at the unigram floor? A run is *at the floor* when its final val loss
   is not below the unigram floor less FLOOR_MARGIN nats, i.e. it has learnt no more than the character
   frequencies (a run without a finite val loss, a diverged one, counts as at the floor); it *escaped*
   otherwise.
2. Does warmup rescue it, and at which length? The shortest warmup of the grid at which every seed
   escapes; the counts at every warmup.
3. Is Pre-LN (and Peri-LN) indifferent to warmup within the seed spread? Each warmup's mean final val loss
   against no warmup's, beside the seed spread: the largest range (max - min over seeds) of any of that
   placement's warmup cells at this depth and learning rate. Indifferent when no mean differs from no
   warmup's by more than the spread (a warmup whose every seed diverged differs without bound); with
   fewer than two finite losses a cell there is no spread, and nothing is said.

The article's pattern holds at a depth and learning rate when all three do: Post-LN at the floor in every
seed without warmup, some warmup rescuing every seed, Pre-LN indifferent. Pure pandas: no torch here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd

from normexp.analysis.variants import PLACEMENT_LABELS
from normexp.config.data import TEXT_TASKS
from normexp.corpus import floors

FLOOR_MARGIN = 0.1  # nats below the unigram floor that a run must reach to have escaped it
KEYS = ("norm.placement", "model.depth", "optim.lr", "schedule.warmup_steps")  # the study's axes; then seed
INDIFFERENT = ("pre", "peri")  # the placements asked whether warmup matters to them


def final_val_losses(metrics: pd.DataFrame) -> pd.DataFrame:
    """One row per run of a tidy metrics frame (`load_metrics(folder, all_config=True)`: run_id, the keys,
    seed, status, step, val_loss): its keys and seed, and `val_loss`, its last evaluated (not nan) held-out
    loss; nan if it has none or diverged (its last evaluated loss then predates the divergence)."""
    keys = [k for k in (*KEYS, "seed") if k in metrics]
    ordered = metrics.sort_values(["run_id", "step"])
    if "status" in ordered:
        ordered = ordered.assign(val_loss=ordered["val_loss"].mask(ordered["status"] == "diverged"))
    last = ordered.dropna(subset=["val_loss"]).groupby("run_id")["val_loss"].last()
    runs = ordered.groupby("run_id", sort=True)[keys].first()
    return runs.assign(val_loss=last.reindex(runs.index)).reset_index()


def text_floors(frame: pd.DataFrame) -> dict[str, float]:
    """The reference lines of a loss of text-task runs (a `data.task` column naming one): the unigram and
    bigram floors of the shipped text's val split (normexp/corpus.py `floors`), by label; {} for others. Beside
    runs of another task, each label names the text task: those runs' losses have no such floor."""
    if "data.task" not in frame or not (text := frame["data.task"].isin(TEXT_TASKS)).any():
        return {}
    found = floors()
    task = "" if text.all() else f"{frame['data.task'][text].iloc[0]} "
    return {f"{task}unigram floor {found.unigram:.2f}": found.unigram,
            f"{task}bigram floor {found.bigram:.2f}": found.bigram}


def _at_floor(losses: pd.Series, floor: float, margin: float) -> pd.Series:
    """Per run, whether it stayed at the floor: no finite loss below floor - margin."""
    finite = losses.map(lambda v: isinstance(v, (int, float)) and math.isfinite(v))
    return ~(finite & (losses < floor - margin))


@dataclass(frozen=True)
class Escape:
    """How many of a cell's seeds got below the floor."""

    escaped: int
    seeds: int
    mean: float  # mean final val loss of the seeds with a finite one (nan if none)


@dataclass(frozen=True)
class Indifference:
    """A placement's final val loss per warmup against the seed spread, at one depth and learning rate."""

    means: dict[int, float]  # warmup -> mean final val loss (finite seeds)
    spread: float  # the largest seed range of any of its warmup cells; nan with one seed per cell
    largest_shift: float  # max over warmups of |mean - mean without warmup|

    @property
    def indifferent(self) -> bool | None:
        if math.isnan(self.spread) or math.isnan(self.largest_shift):
            return None
        return self.largest_shift <= self.spread


@dataclass(frozen=True)
class Finding:
    """The answers at one depth and learning rate."""

    depth: int
    lr: float
    post: dict[int, Escape]  # warmup -> Post-LN's escape counts
    others: dict[str, Indifference]  # Pre-LN, Peri-LN: their indifference to warmup

    @property
    def stuck_without_warmup(self) -> bool | None:
        start = self.post.get(0)
        return None if start is None or start.seeds == 0 else start.escaped == 0

    @property
    def rescue(self) -> int | None:
        """The shortest warmup > 0 at which every Post-LN seed escapes the floor; None if none does."""
        full = [w for w, e in sorted(self.post.items()) if w > 0 and e.seeds and e.escaped == e.seeds]
        return full[0] if full else None

    @property
    def article_pattern(self) -> bool:
        pre = self.others.get("pre")
        return bool(self.stuck_without_warmup and self.rescue is not None and pre is not None and pre.indifferent)


def findings(runs: pd.DataFrame, floor: float, margin: float = FLOOR_MARGIN) -> list[Finding]:
    """The answers per (depth, lr), from one row per run (`final_val_losses`) and the unigram floor."""
    out = []
    for (depth, lr), cell in runs.groupby(["model.depth", "optim.lr"], sort=True):
        by_placement = {p: group for p, group in cell.groupby("norm.placement")}
        post = {}
        if "post" in by_placement:
            for warmup, group in by_placement["post"].groupby("schedule.warmup_steps", sort=True):
                stuck = _at_floor(group["val_loss"], floor, margin)
                post[int(warmup)] = Escape(int((~stuck).sum()), len(group), _finite_mean(group["val_loss"]))
        others = {p: _indifference(by_placement[p]) for p in INDIFFERENT if p in by_placement}
        out.append(Finding(int(depth), float(lr), post, others))
    return out


def _finite_mean(values: pd.Series) -> float:
    finite = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def _indifference(runs: pd.DataFrame) -> Indifference:
    means, ranges = {}, []
    for warmup, group in runs.groupby("schedule.warmup_steps", sort=True):
        finite = [float(v) for v in group["val_loss"] if isinstance(v, (int, float)) and math.isfinite(v)]
        means[int(warmup)] = sum(finite) / len(finite) if finite else math.nan
        ranges.append(max(finite) - min(finite) if len(finite) > 1 else math.nan)
    spread = max((r for r in ranges if not math.isnan(r)), default=math.nan)
    base = means.get(0, math.nan)
    # a warmup whose every seed diverged moves it without bound
    shifts = [math.inf if math.isnan(m) else abs(m - base) for w, m in means.items() if w > 0]
    return Indifference(means, spread, max(shifts) if shifts and not math.isnan(base) else math.nan)


def _label(placement: str) -> str:
    return f"{PLACEMENT_LABELS.get(placement, placement)}-LN"


def finding_text(finding: Finding, floor: float) -> str:
    """One depth and learning rate in words; every number in it is the finding's."""
    parts = [f"Depth {finding.depth}, lr {finding.lr:g}:"]
    start = finding.post.get(0)
    if start is not None:
        at = start.seeds - start.escaped
        parts.append(f"without warmup Post-LN stays at the unigram floor ({floor:.2f}) in {at} of {start.seeds} "
                     f"seeds (mean final val loss {start.mean:.2f});")
        rescues = [f"warmup {w} in {e.escaped} of {e.seeds}" for w, e in sorted(finding.post.items()) if w > 0]
        if rescues:
            parts.append(f"it gets below the floor with {', '.join(rescues)};")
        if finding.stuck_without_warmup is False and start.escaped == start.seeds:
            parts.append("it needs no rescue here;")
        elif finding.rescue is not None:
            parts.append(f"warmup rescues every seed from {finding.rescue} steps on;")
        elif rescues:
            parts.append("no warmup of the grid rescues every seed;")
    for placement, result in finding.others.items():
        means = ", ".join(f"{m:.2f} with warmup {w}" for w, m in result.means.items())
        text = f"{_label(placement)} ends at {means}"
        if math.isnan(result.largest_shift):
            text += " (no finite loss without warmup, or no warmup, to compare)"
        elif math.isnan(result.spread):
            text += " (fewer than two finite losses a cell: no seed spread to judge warmup by)"
        elif result.indifferent:
            text += f": indifferent to warmup, every change within the seed spread ({result.spread:.2f})"
        else:
            text += (f": warmup moves it by up to {result.largest_shift:.2f}, beyond the seed spread "
                     f"({result.spread:.2f})")
        parts.append(text + ";")
    return " ".join(parts).rstrip(";") + "."


def verdict(runs: pd.DataFrame, floor: float, margin: float = FLOOR_MARGIN) -> str:
    """The study's paragraph: each depth and learning rate in words, then where the article's pattern
    (Post-LN stuck without warmup, rescued by warmup, Pre-LN indifferent) holds and where it does not."""
    found = findings(runs, floor, margin)
    if not found:
        return "No finished run to judge."
    holds = [f for f in found if f.article_pattern]
    fails = [f for f in found if not f.article_pattern]
    summary = ("The article's pattern (Post-LN at the unigram floor without warmup, rescued by warmup, Pre-LN "
               f"indifferent to it) holds at {_cells(holds) or 'no depth and learning rate'}")
    summary += f" and not at {_cells(fails)}." if fails else "."
    return " ".join([*(finding_text(f, floor) for f in found), summary])


def _cells(found: Sequence[Finding]) -> str:
    return ", ".join(f"depth {f.depth} lr {f.lr:g}" for f in found)
