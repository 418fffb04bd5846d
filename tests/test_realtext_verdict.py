"""The real-text warmup study's verdict (normexp/analysis/realtext.py) on synthetic frames: every sentence
follows from the numbers, each recomputed here from the frame by the rules the module states."""

from __future__ import annotations

import math

import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from normexp.analysis.realtext import FLOOR_MARGIN, final_val_losses, verdict

FLOOR = 3.33
LOSSES = st.one_of(st.floats(2.0, 3.6), st.just(math.nan), st.just(FLOOR - FLOOR_MARGIN))  # the edge: at the floor


@st.composite
def study(draw: st.DrawFn) -> pd.DataFrame:
    depths = draw(st.lists(st.sampled_from([6, 12]), min_size=1, max_size=2, unique=True))
    lrs = draw(st.lists(st.sampled_from([1e-3, 3e-3]), min_size=1, max_size=2, unique=True))
    warmups = [0, *draw(st.lists(st.sampled_from([30, 100]), min_size=0, max_size=2, unique=True))]
    placements = draw(st.lists(st.sampled_from(["post", "pre", "peri"]), min_size=1, max_size=3, unique=True))
    seeds = draw(st.integers(1, 3))
    rows = [{"norm.placement": p, "model.depth": d, "optim.lr": lr, "schedule.warmup_steps": w, "seed": s,
             "val_loss": draw(LOSSES)}
            for p in placements for d in depths for lr in lrs for w in warmups for s in range(seeds)]
    return pd.DataFrame(rows)


def escaped(losses: list[float]) -> int:
    return sum(1 for v in losses if math.isfinite(v) and v < FLOOR - FLOOR_MARGIN)


def mean(losses: list[float]) -> float:
    finite = [v for v in losses if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def sentence(text: str, depth: int, lr: float) -> str:
    """The part of the verdict about one depth and learning rate."""
    start = text.index(f"Depth {depth}, lr {lr:g}:")
    end = min([i for i in (text.find("Depth ", start + 1), text.find("The article's", start)) if i > 0])
    return text[start:end]


@settings(max_examples=200, deadline=None)
@given(frame=study())
def test_every_sentence_follows_from_the_numbers(frame):
    text = verdict(frame, FLOOR)
    holds = []
    for (depth, lr), cell in frame.groupby(["model.depth", "optim.lr"]):
        part = sentence(text, depth, lr)
        post = cell[cell["norm.placement"] == "post"]
        pattern = False
        if len(post):
            by_warmup = {w: list(g["val_loss"]) for w, g in post.groupby("schedule.warmup_steps")}
            start = by_warmup[0]
            k, n = escaped(start), len(start)
            assert f"stays at the unigram floor ({FLOOR:.2f}) in {n - k} of {n} seeds" in part
            assert f"(mean final val loss {mean(start):.2f})" in part
            full = [w for w, losses in sorted(by_warmup.items()) if w > 0 and escaped(losses) == len(losses)]
            for w, losses in by_warmup.items():
                if w > 0:
                    assert f"warmup {w} in {escaped(losses)} of {len(losses)}" in part
            if k == n:
                assert "needs no rescue" in part and "rescues every seed from" not in part
            elif full:
                assert f"warmup rescues every seed from {full[0]} steps on" in part
            elif len(by_warmup) > 1:
                assert "no warmup of the grid rescues every seed" in part
            pattern = k == 0 and bool(full)
        for placement, label in (("pre", "Pre-LN"), ("peri", "Peri-LN")):
            mine = cell[cell["norm.placement"] == placement]
            if not len(mine):
                assert label not in part
                continue
            groups = {w: list(g["val_loss"]) for w, g in mine.groupby("schedule.warmup_steps")}
            means = {w: mean(v) for w, v in groups.items()}
            assert f"{label} ends at " + ", ".join(f"{m:.2f} with warmup {w}" for w, m in means.items()) in part
            ranges = [max(f) - min(f) for f in ([x for x in v if math.isfinite(x)] for v in groups.values())
                      if len(f) > 1]
            shifts = [math.inf if math.isnan(m) else abs(m - means[0]) for w, m in means.items() if w > 0]
            judged = part.split(label)[1].split(";")[0]
            if not shifts or math.isnan(means[0]):
                assert "no finite loss without warmup, or no warmup, to compare" in judged
                indifferent = False
            elif not ranges:
                assert "no seed spread to judge warmup by" in judged
                indifferent = False
            else:
                indifferent = max(shifts) <= max(ranges)
                assert ("indifferent to warmup" in judged) == indifferent
                assert f"({max(ranges):.2f})" in judged
            if placement == "pre":
                pattern = pattern and indifferent
        if "pre" not in set(cell["norm.placement"]):
            pattern = False
        if pattern:
            holds.append(f"depth {depth} lr {lr:g}")
    summary = text[text.index("The article's pattern"):]
    said = summary.split(" holds at ")[1].split(" and not at ")[0].rstrip(".")
    assert said == (", ".join(holds) or "no depth and learning rate")


def test_the_article_pattern_in_words():
    rows = []
    for seed in range(3):
        rows += [("post", 0, 3.34 + 0.01 * seed), ("post", 30, 3.30), ("post", 100, 2.4 + 0.01 * seed),
                 ("pre", 0, 2.45 + 0.02 * seed), ("pre", 30, 2.46 + 0.01 * seed), ("pre", 100, 2.47)]
    frame = pd.DataFrame([{"norm.placement": p, "model.depth": 12, "optim.lr": 3e-3, "schedule.warmup_steps": w,
                           "seed": i % 3, "val_loss": v} for i, (p, w, v) in enumerate(rows)])
    text = verdict(frame, 3.329)
    assert "without warmup Post-LN stays at the unigram floor (3.33) in 3 of 3 seeds" in text
    assert "warmup 30 in 0 of 3, warmup 100 in 3 of 3" in text
    assert "warmup rescues every seed from 100 steps on" in text
    assert "Pre-LN ends at 2.47 with warmup 0, 2.47 with warmup 30, 2.47 with warmup 100: indifferent" in text
    assert text.endswith("holds at depth 12 lr 0.003.")


def test_final_val_losses_keeps_each_runs_last_evaluated_loss():
    metrics = pd.DataFrame({
        "run_id": ["a"] * 4 + ["b"] * 3, "norm.placement": ["post"] * 4 + ["pre"] * 3,
        "model.depth": 12, "optim.lr": 3e-3, "schedule.warmup_steps": 0, "seed": 0,
        "step": [0, 1, 2, 3, 0, 1, 2], "val_loss": [4.4, math.nan, 3.3, math.nan, 4.4, 2.9, math.nan]})
    runs = final_val_losses(metrics.sample(frac=1, random_state=0)).set_index("run_id")
    assert runs.loc["a", "val_loss"] == 3.3 and runs.loc["b", "val_loss"] == 2.9
    assert runs.loc["b", "norm.placement"] == "pre"


def test_a_diverged_run_counts_as_at_the_floor_not_by_its_loss_before_it_diverged():
    # a Post-LN run that learnt to 2.5 by step 25, then diverged at step 31 (stopped there, its val nan):
    # the study counts it at the floor, not escaped on the loss it had before diverging
    metrics = pd.DataFrame({
        "run_id": ["a"] * 3 + ["b"] * 3, "status": ["diverged"] * 3 + ["completed"] * 3,
        "norm.placement": "post", "model.depth": 12, "optim.lr": 3e-3, "schedule.warmup_steps": 0,
        "seed": [0] * 3 + [1] * 3, "step": [0, 25, 31, 0, 25, 50], "val_loss": [4.4, 2.5, math.nan, 4.4, 2.6, 2.5]})
    runs = final_val_losses(metrics).set_index("run_id")
    assert math.isnan(runs.loc["a", "val_loss"]) and runs.loc["b", "val_loss"] == 2.5
    assert "stays at the unigram floor (3.33) in 1 of 2 seeds" in verdict(runs.reset_index(), FLOOR)
