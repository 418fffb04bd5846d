"""Learning-rate sensitivity: the formula on a hand-made sweep folder, its properties, and the CLI."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pandas as pd
import pytest
from conftest import DIVERGING, write_curves
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from normexp.analysis.sensitivity import (
    CANNOT_TELL,
    Sensitivity,
    arm_change,
    build_sensitivity,
    clipped_final,
    judge,
    variant_sensitivity,
)
from normexp.cli import app
from normexp.config import RunConfig, build_sweep
from normexp.folder import SWEEP_FILE, FinishedRun, run_id, write_run

LRS = [0.001, 0.01, 0.1]


def write_sweep(folder: Path, runs: list[tuple]) -> Path:
    """A sweep folder written through the store: (placement, lr, seed, loss at init, final loss, status[,
    warmup]) per run, over the grid those values span; a 'pending' run, or a combination not listed, has
    no folder (a missing run)."""
    def axis(i: int, default: object = None) -> list:
        return list(dict.fromkeys(r[i] if len(r) > i else default for r in runs))

    sweep = build_sweep({"name": "hand", "base": {"schedule": {"kind": "linear_warmup"}, "train": {"steps": 1}},
                         "grid": {"norm.placement": axis(0), "optim.lr": axis(1),
                                  "schedule.warmup_steps": axis(6, 0)}, "seeds": axis(2)})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / SWEEP_FILE).write_text(sweep.to_yaml())
    for placement, lr, seed, initial, final, status, *warmup in runs:
        if status not in ("completed", "diverged"):
            continue
        cfg = RunConfig.model_validate({"norm": {"placement": placement}, "optim": {"lr": lr}, "seed": seed,
                                        "schedule": {"kind": "linear_warmup", "warmup_steps": (warmup or [0])[0]},
                                        "train": {"steps": 1}})
        metrics = {"step": [0, 1], "loss": [initial, final], "acc": [0.1, 0.2], "lr": [lr, lr],
                   "grad_norm": [1.0, 1.0]}
        write_run(folder / run_id(cfg), cfg, FinishedRun(metrics, status, 0.1, 1, "reference", "cpu"))
    return folder


def hand_made(tmp_path: Path) -> Path:
    pre = [("pre", lr, seed, 2.3, final, "diverged" if math.isnan(final) else "completed")
           for seed, finals in ((0, [1.0, 0.2, math.nan]), (1, [1.2, 0.4, 3.0]))
           for lr, final in zip(LRS, finals)]
    post = [("post", lr, 0, 2.0, 1.5, "completed") for lr in LRS[:2]] + [("post", LRS[2], 0, 2.0, 0.0, "pending")]
    return write_sweep(tmp_path / "sweep", pre + post)


def test_lr_sensitivity_of_a_hand_made_summary(tmp_path):
    pre, post = build_sensitivity(hand_made(tmp_path))
    # pre: clipped finals seed 0 [1.0, 0.2, 2.3 (diverged: its init)], seed 1 [1.2, 0.4, 2.3 (3.0 > init)]
    # seed means [1.1, 0.3, 2.3]; l* = 0.3; sensitivity = mean([0.8, 0.0, 2.0]) = 0.9333
    assert pre.label == "Pre" and pre.sensitivity == pytest.approx(2.8 / 3)
    assert pre.best_loss == pytest.approx(0.3) and pre.best_lr == 0.01
    # each seed's own sensitivity, against its own best lr: seed 0 [1.0, 0.2, 2.3] - 0.2 -> mean 2.9 / 3,
    # seed 1 [1.2, 0.4, 2.3] - 0.4 -> mean 2.7 / 3
    assert pre.spread == pytest.approx(pd.Series([2.9 / 3, 2.7 / 3]).std(ddof=1))
    assert (pre.seeds, pre.runs, pre.diverged, pre.missing, pre.lrs, pre.grid_lrs) == (2, 6, 1, 0, 3, 3)
    # post: lr 0.1 never finished (nor did seed 1, never run), so no number rather than a mean over the
    # lrs that happen to exist
    assert math.isnan(post.sensitivity) and post.missing == 4 and post.lrs == 2


def test_report_lr_sensitivity_through_the_cli(tmp_path):
    folder = hand_made(tmp_path)
    result = CliRunner().invoke(app, ["report", str(folder), "--lr-sensitivity", "--format", "csv"])
    assert result.exit_code == 1, result.output  # printed, but some runs of the sweep are missing
    assert "4 runs missing, failed or corrupt" in result.stderr
    rows = list(csv.DictReader(result.stdout.splitlines()))
    assert [r["variant"] for r in rows] == ["Pre", "Post"]
    assert float(rows[0]["lr_sensitivity"]) == pytest.approx(2.8 / 3) and rows[0]["diverged"] == "1"
    markdown = CliRunner().invoke(app, ["report", str(folder), "--lr-sensitivity", "--format", "markdown"]).output
    assert "0.9333 ± 0.0471" in markdown and "an lr has no finished run" in markdown


def test_the_spread_is_the_std_of_each_seeds_own_sensitivity_recomputed_from_the_run_folders(tmp_path):
    """docs/reports.md's definition, recomputed from the run folders with csv and yaml alone: per seed, the
    sensitivity of that seed's runs (its clipped final losses against its own best lr), then their std over
    seeds. The code took each seed's mean against the variant's shared l*, which moves with a seed's loss
    level, not with its sensitivity: seed 1 below is seed 0 shifted down by 0.3 at every lr, the same
    sensitivity, so Pre's spread is 0 (it was 0.21)."""
    import statistics

    import yaml

    curves = {("pre", 0): [1.0, 0.4, 0.9, 2.0], ("pre", 1): [0.7, 0.1, 0.6, 1.7], ("pre", 2): [1.1, 0.5, 1.0, 2.1],
              ("post", 0): [2.0, 0.9, 0.3, math.nan], ("post", 1): [1.4, 1.1, 0.5, 0.8],
              ("post", 2): [2.2, 0.4, 1.2, 3.5]}
    lrs = [0.001, 0.01, 0.1, 1.0]
    runs = [(p, lr, seed, 2.3, final, "diverged" if math.isnan(final) else "completed")
            for (p, seed), finals in curves.items() for lr, final in zip(lrs, finals)]
    folder = write_sweep(tmp_path / "spread", runs)
    clipped: dict[tuple[str, int], dict[float, float]] = {}
    for run in sorted(p for p in folder.iterdir() if (p / "done.json").is_file()):
        config = yaml.safe_load((run / "config.yaml").read_text())
        with open(run / "metrics.csv", newline="") as f:
            losses = [float(row["loss"]) for row in csv.DictReader(f)]
        status = yaml.safe_load((run / "done.json").read_text())["status"]
        final = losses[-1] if status != "diverged" and math.isfinite(losses[-1]) else losses[0]
        curve = clipped.setdefault((config["norm"]["placement"], config["seed"]), {})
        curve[config["optim"]["lr"]] = min(final, losses[0])
    expected = {}
    for placement in ("pre", "post"):
        own = [statistics.mean(v - min(c.values()) for v in c.values())
               for (p, _), c in clipped.items() if p == placement and len(c) == len(lrs)]
        expected[placement] = statistics.stdev(own)
    rows = {r.values["norm.placement"]: r for r in build_sensitivity(folder)}
    assert expected["pre"] == pytest.approx(0.0, abs=1e-12)  # seed 1 is seed 0 shifted: no noise in how much lr matters
    for placement, spread in expected.items():
        assert rows[placement].spread == pytest.approx(spread, abs=1e-12), placement
    assert rows["post"].spread > 0.1 and rows["post"].diverged == 1


def test_lr_sensitivity_without_an_lr_axis_of_three_exits_2(tmp_path):
    two = write_sweep(tmp_path / "two", [("pre", lr, 0, 2.3, 1.0, "completed") for lr in LRS[:2]])
    result = CliRunner().invoke(app, ["report", str(two), "--lr-sensitivity"])
    assert result.exit_code == 2 and "optim.lr axis of at least 3 values" in result.output
    assert "has 2 (0.001, 0.01)" in result.output and "Traceback" not in result.output
    both = CliRunner().invoke(app, ["report", str(two), "--lr-sensitivity", "--pivot", "optim.lr,seed"])
    assert both.exit_code == 2 and "--pivot and --lr-sensitivity" in both.output


@settings(max_examples=50, deadline=None)
@given(finals=st.lists(st.lists(st.floats(0.0, 5.0), min_size=3, max_size=3), min_size=1, max_size=4),
       shift=st.floats(-1.0, 1.0))
def test_sensitivity_is_non_negative_shift_invariant_and_zero_for_a_flat_curve(finals, shift):
    def frame(offset: float, rows: list[list[float]]) -> pd.DataFrame:
        return pd.DataFrame([{"seed": s, "optim.lr": lr, "clipped": v + offset}
                             for s, row in enumerate(rows) for lr, v in zip(LRS, row)])

    sensitivity, spread, _, best = variant_sensitivity(frame(0.0, finals), LRS)
    shifted, shifted_spread, _, shifted_best = variant_sensitivity(frame(shift, finals), LRS)
    assert sensitivity >= -1e-12
    assert shifted == pytest.approx(sensitivity, abs=1e-9) and shifted_best == pytest.approx(best + shift)
    assert (math.isnan(spread) and len(finals) == 1) or shifted_spread == pytest.approx(spread, abs=1e-9)
    flat, *_ = variant_sensitivity(frame(0.0, [[row[0]] * 3 for row in finals]), LRS)
    assert flat == pytest.approx(0.0, abs=1e-12)


def test_a_non_finite_or_worse_final_counts_as_the_loss_at_init():
    final = pd.Series([0.5, math.nan, math.inf, 4.0, -math.inf])
    initial = pd.Series([2.0, 2.0, 2.0, 2.0, 2.0])
    assert clipped_final(final, initial).tolist() == [0.5, 2.0, 2.0, 2.0, 2.0]


def test_sweep_report_and_plot_end_to_end(write_yaml, tmp_path):
    config = write_yaml("name: lrs\nbase: {model: {depth: 2, width: 8}, train: {steps: 3}}\n"
                        "grid: {norm.placement: [rezero, admin], optim.lr: [0.001, 0.01, 0.1]}\nseeds: [0, 1]\n")
    out = tmp_path / "out"
    runner = CliRunner()
    assert runner.invoke(app, ["sweep", str(config), "--out", str(out), "--quiet"]).exit_code == 0
    result = runner.invoke(app, ["report", str(out), "--lr-sensitivity", "--format", "csv"])
    rows = list(csv.DictReader(result.output.splitlines()))
    assert [r["variant"] for r in rows] == ["ReZero", "Admin"]
    assert all(r["runs"] == "6" and r["seeds"] == "2" and float(r["lr_sensitivity"]) >= 0 for r in rows)
    plotted = runner.invoke(app, ["plot", str(out)])
    assert plotted.exit_code == 0 and (out / "loss-lr.png").stat().st_size > 0


def test_the_study_verdict_ranks_and_compares_warmups(tmp_path):
    from normexp.studies.verdicts import lr_sensitivity_verdict

    finals = {("post", 0): [2.0, 1.0, 2.2], ("post", 12): [0.6, 0.5, 0.7],  # 0.733 -> 0.1
              ("pre", 0): [0.6, 0.5, 0.9], ("pre", 12): [0.6, 0.5, 0.9]}   # 0.167 both
    runs = [(p, lr, seed, 2.3, final + 0.01 * seed, "completed", w)
            for (p, w), values in finals.items() for seed in (0, 1) for lr, final in zip(LRS, values)]
    text = lr_sensitivity_verdict(write_sweep(tmp_path / "s", runs))
    assert "without warmup (least sensitive first): Pre 0.167, Post 0.733" in text
    assert "with 12 warmup steps (least sensitive first): Post 0.100, Pre 0.167" in text
    assert "lowers the sensitivity of Post 0.733 -> 0.100" in text and "spread of the two for Pre" in text
    assert "(24 runs, 2+ seeds per variant" in text


def test_a_variant_whose_key_is_unset_counts_no_run_missing(tmp_path):
    """A null (unset) grid value reads back as nan, which equals nothing: the variant's runs in the sweep
    were counted as none, and its `missing` came out negative (-6 for 6 runs)."""
    from normexp.config import build_sweep, parse_yaml
    from normexp.folder import FinishedRun, atomic_write, run_id, write_run, write_summary
    from normexp.report import build_pivot, pivot_to_markdown

    sweep = build_sweep(parse_yaml(
        "name: n\nbase: {model: {depth: 2, width: 4}, norm: {placement: deepnorm}, train: {steps: 1}}\n"
        "grid: {norm.deepnorm_alpha: [null, 2.0], optim.lr: [0.01, 1.0, 10.0]}\nseeds: [0, 1]\n"))
    out = tmp_path / "n"
    out.mkdir()
    atomic_write(out / "sweep.yaml", sweep.to_yaml())
    for cfg in sweep.runs:
        metrics = {"step": [0, 1], "loss": [2.3, cfg.optim.lr], "acc": [0.1] * 2, "lr": [cfg.optim.lr] * 2,
                   "grad_norm": [1.0] * 2}
        write_run(out / run_id(cfg), cfg, FinishedRun(metrics, "completed", 0.1, 1, "reference", "cpu"))
    write_summary(out, sweep.runs)
    rows = build_sensitivity(out)
    assert [(r.runs, r.missing) for r in rows] == [(6, 0), (6, 0)]
    assert "| null |" in pivot_to_markdown(build_pivot(out, "norm.deepnorm_alpha", "optim.lr"))


# ----------------------------------------------------------------------------- two arms: both readings

def _arm(losses: dict[tuple[int, float], float]) -> pd.DataFrame:
    """An arm's rows of `lr_table`: (seed, lr) -> clipped final loss."""
    return pd.DataFrame([{"seed": s, "optim.lr": lr, "clipped": c} for (s, lr), c in losses.items()])


def _row(frame: pd.DataFrame) -> Sensitivity:
    sens, spread, best_lr, best = variant_sensitivity(frame, LRS)
    return Sensitivity("arm", {}, sens, spread, best_lr, best, len(LRS), len(LRS), frame["seed"].nunique(),
                       len(frame), 0, 0)


LOSSES = st.floats(0.01, 3.0, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.data())
def test_both_readings_are_the_recomputed_formulas_and_one_seed_cannot_tell(n_seeds, data):
    """shared: mean over lrs of each arm's seed-mean loss minus the best seed-mean loss of BOTH arms,
    recomputed here from the frame; own: the paper's per-arm formula. One seed: no judgement."""
    arms = [{(s, lr): data.draw(LOSSES) for s in range(n_seeds) for lr in LRS} for _ in range(2)]
    frames = [_arm(a) for a in arms]
    change = arm_change(*(_row(f) for f in frames))
    means = [[sum(a[(s, lr)] for s in range(n_seeds)) / n_seeds for lr in LRS] for a in arms]
    shared_best = min(min(m) for m in means)
    for i, m in enumerate(means):
        assert change.shared[i] == pytest.approx(sum(x - shared_best for x in m) / len(LRS), abs=1e-9)
        assert change.own[i] == pytest.approx(sum(x - min(m) for x in m) / len(LRS), abs=1e-9)
    assert (change.effect == CANNOT_TELL) == (n_seeds < 2) == (change.own_effect == CANNOT_TELL)


@settings(max_examples=60, deadline=None)
@given(st.lists(LOSSES, min_size=3, max_size=3), st.lists(st.floats(0.0, 2.0), min_size=3, max_size=3),
       st.floats(0.0, 0.05))
def test_a_rescue_at_every_lr_never_reads_as_a_rise_on_the_shared_reading(before, gains, jitter):
    """An intervention that lowers the loss at every lr (qk-norm rescuing Peri-DyT) can raise the
    own-best sensitivity, never the shared one."""
    arms = []
    for shift in (0.0, 1.0):
        losses = {}
        for seed, noise in ((0, 0.0), (1, jitter)):
            for lr, b, g in zip(LRS, before, gains):
                losses[(seed, lr)] = max(b - shift * (g + 0.01), 0.001) + noise
        arms.append(_row(_arm(losses)))
    change = arm_change(*arms)
    assert change.shared[1] <= change.shared[0] + 1e-12
    assert change.effect != "raises"


def test_a_rescue_that_raises_the_own_best_reading_is_said_both_ways():
    """Peri-DyT's case in miniature: qk-norm lowers the loss everywhere, most at one lr."""
    before = _arm({(s, lr): 0.55 + 0.001 * s for s in (0, 1) for lr in LRS})
    after = _arm({(s, lr): (0.06 if lr == 0.01 else 0.5) + 0.001 * s for s in (0, 1) for lr in LRS})
    change = arm_change(_row(before), _row(after))
    assert change.own_effect == "raises" and change.effect == "lowers"
    assert judge(1.0, 0.5, 0.1, seeds=1) == CANNOT_TELL and judge(1.0, 0.5, math.nan, seeds=3) == CANNOT_TELL


# ----------------------------------------------------------------------------- a diverged run, by the definition


def _by_the_definition(runs: list[tuple]) -> dict[str, float]:
    """README: c_r = min(final, loss at init), a diverged run counting as its loss at init; m(lr) the
    seed mean; l* = min m; sensitivity = mean over the lr grid of m(lr) - l*. Plain python."""
    out = {}
    for placement in dict.fromkeys(r[0] for r in runs):
        m = {}
        for lr in LRS:
            cs = []
            for p, rlr, _, losses, status, *_ in runs:
                if p == placement and rlr == lr:
                    diverged = status == "diverged"
                    cs.append(losses[0] if diverged else min(losses[-1], losses[0]))
            m[lr] = sum(cs) / len(cs)
        best = min(m.values())
        out[placement] = sum(v - best for v in m.values()) / len(m)
    return out


def test_a_diverged_run_counts_as_its_loss_at_init_not_its_last_finite_loss(tmp_path):
    from normexp.analysis.sensitivity import build_sensitivity

    expected = _by_the_definition(DIVERGING)
    # pre: m = [0.45, 0.15, (2.3 + 2.2) / 2], l* = 0.15; none: m = [1.7, 2.0, 2.0] (both diverged), l* = 1.7
    assert expected == pytest.approx({"pre": (0.3 + 0.0 + 2.1) / 3, "none": (0.0 + 0.3 + 0.3) / 3})
    rows = build_sensitivity(write_curves(tmp_path / "s", DIVERGING))
    assert {r.values["norm.placement"]: r.sensitivity for r in rows} == pytest.approx(expected)
    assert [r.diverged for r in rows] == [2, 2]


def test_the_lr_figure_draws_the_same_numbers(tmp_path):
    from normexp.analysis.sensitivity import lr_table
    from normexp.figures import lr_figure

    fig = lr_figure(*lr_table(write_curves(tmp_path / "s", DIVERGING)))
    lines = {line.get_label().split(" ")[0]: list(line.get_ydata()) for line in fig.axes[0].lines}
    assert lines["Pre"] == pytest.approx([(0.4 + 0.5) / 2, (0.1 + 0.2) / 2, (2.3 + 2.2) / 2])
    assert lines["NoNorm"] == pytest.approx([1.7, 2.0, 2.0])
