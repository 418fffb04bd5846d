"""Tables that fit (issue 49): on a terminal, the default table chooses the steps it shows to fit the width,
or says which narrower view would; off one, nothing is cut. A sweep prints its own grid's table, whatever
else its folder holds (`make reproduce`). A sampled pivot lists its rows by value."""

from __future__ import annotations

import pytest
from conftest import trained_sweep
from typer.testing import CliRunner

from normexp.cli import app
from normexp.report import build_report, fit_report, spread_steps, sweep_report, table_width, to_markdown

GRID = """name: fit
base:
  model: {depth: 2, width: 8}
  schedule: {kind: linear_warmup}
  train: {steps: 8}
grid:
  norm.placement: [post, pre]
  optim.lr: [0.01, 0.03, 0.1]
  schedule.warmup_steps: [0, 2]
seeds: [0, 1]
report: {steps: [0, 1, 2, 3, 4, 5, 6, 7, 8]}
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return trained_sweep(tmp_path_factory, "fit", GRID, "--engine", "batched", "--quiet")


def test_the_table_fits_the_terminal_by_choosing_its_steps(folder):
    """12 variants x 9 steps of 'mean ± std': 187 columns; at 120 the cells wrapped onto 3 lines each."""
    report = build_report(folder)
    assert table_width(report) > 120  # the premise
    fitted = fit_report(report, 120)
    assert table_width(fitted) <= 120 and fitted.is_transposed
    assert fitted.steps[0] == 0 and fitted.steps[-1] == 8 and len(fitted.steps) >= 3  # first and last kept
    left = [s for s in report.steps if s not in fitted.steps]
    assert fitted.fit.startswith(f"steps {', '.join(map(str, left))} left out to fit 120 columns")
    assert "--steps 0,1,2,3,4,5,6,7,8 shows them" in fitted.fit
    assert "--pivot optim.lr,schedule.warmup_steps" in fitted.fit  # the final loss by the two numeric axes
    wider = fit_report(report, 400)
    assert wider is report and not report.fit  # fits: nothing chosen, nothing said
    assert "left out" not in to_markdown(report)  # off a terminal the commands print the whole table


def test_a_table_no_steps_can_fit_says_what_would(folder):
    fitted = fit_report(build_report(folder), 40)
    assert fitted.steps == build_report(folder).steps  # nothing cut for nothing
    assert "wider than this terminal" in fitted.fit and "--pivot" in fitted.fit and "--format markdown" in fitted.fit


@pytest.mark.parametrize(("steps", "count", "chosen"), [([0, 1, 2, 3, 5, 10, 20, 30], 4, [0, 2, 10, 30]),
                                                        ([0, 10], 5, [0, 10]), ([0, 5, 9], 1, [9])])
def test_spread_steps_keeps_the_first_and_the_last(steps, count, chosen):
    assert spread_steps(steps, count) == chosen


def test_a_sweep_reports_its_own_grid_whatever_else_the_folder_holds(tmp_path):
    """`make reproduce` stopped printing the article's table once the README's "change an axis" example
    (`--set model.depth=8`) had run into the default folder: the report gained a depth column."""
    config = tmp_path / "a.yaml"
    config.write_text(GRID.replace("  optim.lr: [0.01, 0.03, 0.1]\n  schedule.warmup_steps: [0, 2]\n", "")
                      .replace("seeds: [0, 1]", "seeds: [0]"))
    out = tmp_path / "out"
    runner = CliRunner()
    for extra in ([], ["--set", "model.depth=3"], ["--force"]):
        assert runner.invoke(app, ["sweep", str(config), "--out", str(out), "-q", *extra]).exit_code == 0
    everything, own = build_report(out), sweep_report(out)
    assert len(everything.columns) == 4 and "model.depth" in everything.keys  # the folder: both depths
    assert [c.label for c in own.columns] == ["Post", "Pre"] and own.keys == ("norm.placement",)


def test_a_sampled_pivot_lists_its_rows_by_value(tmp_path):
    """Its rows came in the order the points were drawn (issue 46, item 24)."""
    from normexp.report import build_pivot

    config = tmp_path / "s.yaml"
    config.write_text("name: s\nbase: {model: {depth: 2, width: 4}, train: {steps: 2}}\n"
                      "grid: {norm.placement: [post, pre]}\n"
                      "sample: {n: 6, seed: 3, optim.lr: {loguniform: [0.001, 0.1]}}\n")
    assert CliRunner().invoke(app, ["sweep", str(config), "--out", str(tmp_path / "s"), "-q"]).exit_code == 0
    pivot = build_pivot(tmp_path / "s", "optim.lr", "norm.placement")
    rows = list(pivot.panels[0][1].index)
    assert len(rows) == 6 and rows == sorted(rows)


def test_plot_help_lists_every_block_metric():
    """`plot --help` names every per-block metric a figure can draw (attn_logit_max was missing)."""
    from typer.testing import CliRunner

    from normexp.cli import app
    from normexp.figures import BLOCK_METRIC_LABELS

    text = " ".join(CliRunner().invoke(app, ["plot", "--help"], env={"COLUMNS": "200"}).output.split())
    assert [name for name in BLOCK_METRIC_LABELS if name not in text] == []
