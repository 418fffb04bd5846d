"""Every verdict sentence of the studies is computed from the numbers: the same function, given numbers
that contradict a claim, no longer makes it. Folders are written through the store with chosen losses (no
training), gradnorm summaries are built by hand."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from normexp.analysis.gradnorm import GradnormSummary
from normexp.analysis.sensitivity import CANNOT_TELL, Sensitivity
from normexp.config import build_sweep, parse_yaml
from normexp.folder import FinishedRun, atomic_write, run_id, write_run, write_summary
from normexp.studies.verdicts import (
    LOGIT_GROWTH,
    LOGIT_LIMIT,
    article_verdict,
    gradnorm_verdict,
    grown_lrs,
    lr_warmup_verdict,
    width_trend,
)


def folder(tmp_path, text: str, final_loss) -> object:
    """A sweep folder of `text`'s runs, each with losses [2.3, 1.5, final_loss(cfg)]."""
    sweep = build_sweep(parse_yaml(text))
    out = tmp_path / sweep.name
    out.mkdir(parents=True)
    atomic_write(out / "sweep.yaml", sweep.to_yaml())
    for cfg in sweep.runs:
        metrics = {"step": [0, 1, 2], "loss": [2.3, 1.5, final_loss(cfg)], "acc": [0.1] * 3, "lr": [0.01] * 3,
                   "grad_norm": [1.0] * 3}
        write_run(out / run_id(cfg), cfg, FinishedRun(metrics, "completed", 0.1, 1, "reference", "cpu"))
    write_summary(out, sweep.runs)
    return out


ARTICLE = """\
name: article
base: {model: {depth: 2, width: 4}, train: {steps: 2}}
grid: {norm.placement: [post, pre], norm.kind: [layernorm, rmsnorm]}
"""


def test_the_article_verdict_says_the_placement_decides_only_when_it_does(tmp_path):
    as_in_the_article = folder(tmp_path / "a", ARTICLE, lambda cfg: 2.2 if cfg.norm.placement == "post" else 0.02)
    assert "where the norm sits decides whether the model trains" in article_verdict(as_in_the_article)
    assert "After 2 steps" in article_verdict(as_in_the_article)  # the folder's steps, not the article's 30
    both_train = folder(tmp_path / "b", ARTICLE, lambda cfg: 0.02)
    said = article_verdict(both_train)
    assert "decides whether" not in said and "both train alike" in said


LR_WARMUP = """\
name: lrw
base: {model: {depth: 2, width: 4}, schedule: {kind: linear_warmup}, train: {steps: 2}}
grid: {norm.placement: [post, pre], optim.lr: [0.001, 0.01, 0.1], schedule.warmup_steps: [0, 5]}
"""


def test_warmup_rescuing_post_ln_at_small_learning_rates_only_is_said_only_when_so(tmp_path):
    def small(cfg):  # warmup rescues lr 0.001 and 0.01; nothing rescues 0.1
        rescued = cfg.schedule.warmup_steps and cfg.optim.lr < 0.1
        return 0.02 if cfg.norm.placement == "pre" or rescued else 2.2

    said = lr_warmup_verdict(folder(tmp_path / "a", LR_WARMUP, small))
    assert "train where it fails without warmup at lr 0.001, lr 0.01, and only below" in said

    def large(cfg):  # warmup rescues lr 0.1 only; lr 0.001 fails whatever the warmup
        rescued = cfg.schedule.warmup_steps and cfg.optim.lr == 0.1
        return 0.02 if cfg.norm.placement == "pre" or rescued or cfg.optim.lr == 0.01 else 2.2

    said = lr_warmup_verdict(folder(tmp_path / "b", LR_WARMUP, large))
    assert "only below" not in said and "no warmup of the grid helps at lr 0.001" in said


def summary(post_slope: float, pre_slope: float, post_last: float, pre_last: float, c: float) -> GradnormSummary:
    """Two placements over depths 2 and 8; Pre-LN's stream grows by c per block, Post-LN's norm sees 1 + c."""
    return GradnormSummary(
        depths=[2, 8], last_grad={"post": [(1.0, 0.1), (post_last, 0.1)], "pre": [(1.0, 0.1), (pre_last, 0.1)]},
        slopes={"post": post_slope, "pre": pre_slope},
        stream_sq={"post": [1.0] * 8, "pre": [1 + c * b for b in range(8)]},
        norm_in_sq={"post": [1 + c] * 8, "pre": [float("nan")] * 8}, branch_gain=0.32)


def test_the_gradnorm_verdict_says_the_direction_rates_and_lemma_hold_only_when_they_do():
    xiong = gradnorm_verdict(summary(0.02, -0.48, 1.0, 0.5, 0.32))
    assert "direction matches Xiong" in xiong and "so do the rates" in xiong and "norms hold in form" in xiong
    reversed_ = gradnorm_verdict(summary(-0.6, 0.3, 0.3, 1.5, 0.9))
    assert "does not match Xiong" in reversed_ and "rates differ" in reversed_ and "do not hold in form" in reversed_


# ----------------------------------------------------------------------------- the instabilities study's rules

@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.floats(-5, 500, allow_nan=False), st.floats(0.01, 300, allow_nan=False)),
                min_size=1, max_size=6))
def test_attention_logits_grow_only_where_the_measured_peak_grows(cells):
    """An lr counts as growth only where the peak reaches LOGIT_LIMIT and is LOGIT_GROWTH x its step-0 value:
    a logit large from init (growth under 2x) or one under the limit never counts."""
    lrs = [10.0 ** -i for i in range(len(cells))]
    frame = pd.DataFrame({"logit_peak": [p for p, _ in cells], "growth": [g for _, g in cells]}, index=lrs)
    grown = grown_lrs(frame)
    assert grown == [lr for lr, (p, g) in zip(lrs, cells) if p >= LOGIT_LIMIT and g >= LOGIT_GROWTH]


def _sens(value: float, spread: float, seeds: int) -> Sensitivity:
    return Sensitivity("w", {}, value, spread, 0.01, 0.1, 3, 3, seeds, 3 * seeds, 0, 0)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(0, 2, allow_nan=False), min_size=1, max_size=4), st.floats(0, 0.2),
       st.integers(1, 3))
def test_a_width_trend_needs_two_widths_and_two_seeds(values, spread, seeds):
    by_width = {32 * 2 ** i: _sens(v, spread if seeds > 1 else math.nan, seeds) for i, v in enumerate(values)}
    trend = width_trend(by_width)
    if len(values) < 2 or seeds < 2:
        assert trend == CANNOT_TELL
    else:
        delta = values[-1] - values[0]
        assert trend == ("grows" if delta > spread else "shrinks" if delta < -spread else "stays flat")


# ----------------------------------------------------------------------------- the LR-sensitivity and blocks verdicts


def _sweep_of(folder: Path, grid: dict, final: dict, skip: set = frozenset()) -> Path:
    """A sweep folder over `grid` (seeds 0, 1) written through the store: each run's loss goes 2.3 ->
    final[(kind, lr, warmup)] + 0.01 * seed; a run whose (kind, lr, warmup, seed) is in `skip` is missing."""
    from normexp.config import build_sweep
    from normexp.folder import SWEEP_FILE, FinishedRun, run_id, write_run

    base = {"schedule": {"kind": "linear_warmup"}, "train": {"steps": 1}}
    sweep = build_sweep({"name": "v", "base": base, "grid": grid, "seeds": [0, 1]})
    folder.mkdir(parents=True)
    (folder / SWEEP_FILE).write_text(sweep.to_yaml())
    for cfg in sweep.runs:
        key = (cfg.norm.kind, cfg.optim.lr, cfg.schedule.warmup_steps)
        if (*key, cfg.seed) in skip:
            continue
        metrics = {"step": [0, 1], "loss": [2.3, final[key] + 0.01 * cfg.seed], "acc": [0.1] * 2,
                   "lr": [cfg.optim.lr] * 2, "grad_norm": [1.0] * 2}
        write_run(folder / run_id(cfg), cfg, FinishedRun(metrics, "completed", 0.1, 1, "reference", "cpu"))
    return folder


def test_the_sensitivity_verdict_keeps_each_variant_and_names_the_undefined(tmp_path):
    """Two kinds of one placement were one key (placement, warmup): the second overwrote the first in
    the ranking and the warmup comparison. A variant with an lr that has no finished run was dropped
    from the verdict without a word."""
    from normexp.studies.verdicts import lr_sensitivity_verdict

    lrs = [0.001, 0.01, 0.1]
    finals = {("layernorm", 0): [2.0, 1.0, 2.2], ("layernorm", 12): [0.6, 0.5, 0.7],  # 0.7333 -> 0.1
              ("rmsnorm", 0): [0.6, 0.5, 0.9], ("rmsnorm", 12): [0.6, 0.5, 0.9]}    # 0.1667 both
    final = {(k, lr, w): v for (k, w), vs in finals.items() for lr, v in zip(lrs, vs)}
    grid = {"norm.placement": ["pre"], "norm.kind": ["layernorm", "rmsnorm"], "optim.lr": lrs,
            "schedule.warmup_steps": [0, 12]}
    text = lr_sensitivity_verdict(_sweep_of(tmp_path / "k", grid, final))
    assert "without warmup (least sensitive first): RMS 0.167, LN 0.733" in text, text
    assert "lowers the sensitivity of LN 0.733 -> 0.100" in text and "spread of the two for RMS 0.167" in text
    # every seed of (rmsnorm, lr 0.1, warmup 12) missing: that variant's sensitivity is undefined, and said so
    gone = {("rmsnorm", 0.1, 12, s) for s in (0, 1)}
    text = lr_sensitivity_verdict(_sweep_of(tmp_path / "m", grid, final, gone))
    assert "No LR sensitivity (an lr of the grid has no finished run) for RMS" in text, text


def test_the_blocks_verdict_means_over_every_seed_or_leaves_the_step_out(tmp_path):
    """groupby().mean() skipped a diverged seed's nan: Post-LN's 'peak, mean over 2 seeds' was one seed's."""
    from normexp.config import build_sweep
    from normexp.folder import SWEEP_FILE, FinishedRun, run_id, write_run
    from normexp.studies.verdicts import blocks_verdict

    nan = float("nan")
    last_update = {("post", 0): [0.1, 0.3, 0.8, nan], ("post", 1): [0.1, 0.3, nan, nan],  # seed 1 diverged
                   ("pre", 0): [0.05, 0.1, 0.1, nan], ("pre", 1): [0.05, 0.1, 0.1, nan]}
    sweep = build_sweep({"name": "b", "base": {"model": {"depth": 2, "width": 4}, "schedule": {"kind": "linear_warmup"},
                                               "train": {"steps": 3, "log_blocks": True}},
                         "grid": {"norm.placement": ["post", "pre"]}, "seeds": [0, 1]})
    folder = tmp_path / "b"
    folder.mkdir()
    (folder / SWEEP_FILE).write_text(sweep.to_yaml())
    for cfg in sweep.runs:
        updates = last_update[(cfg.norm.placement, cfg.seed)]
        blocks = {"step": [s for s in range(4) for _ in (1, 2)], "block": [1, 2] * 4}
        blocks["fc2_update"] = [v for u in updates for v in (0.01, u)]
        blocks["fc2_grad"] = [1.0] * 8
        for column in ("fc1_grad", "fc1_update", "stream_rms", "norm_rms", "norm_out_rms"):
            blocks[column] = [1.0] * 8
        metrics = {"step": [0, 1, 2, 3], "loss": [2.3, 2.0, 1.5, 1.0], "acc": [0.1] * 4, "lr": [0.01] * 4,
                   "grad_norm": [1.0] * 4}
        write_run(folder / run_id(cfg), cfg, FinishedRun(metrics, "completed", 0.1, 1, "reference", "cpu", blocks))
    text = blocks_verdict(folder)
    # by hand: the steps where both seeds of both placements are finite are 0 and 1; Post's peak is step 1
    assert "peaks after step 1 at 0.3 (mean over 2 seeds), 3.0x Pre-LN's at that step (0.1" in text, text
    assert "by step 1 Post-LN's is 0.3" in text, text
