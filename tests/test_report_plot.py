"""Report and plot on small Transformer and FFN sweeps: chance levels, partial cells, missing runs,
options that do not apply, and the gradnorm verdict's preconditions."""

from __future__ import annotations

import math
import shutil

import pytest
from conftest import trained_sweep
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from normexp.analysis.sensitivity import lr_table
from normexp.cli import app
from normexp.figures import curves_figure, final_loss_figure, lr_figure
from normexp.report import Column, Report, build_pivot, build_report, pivot_to_csv, pivot_to_markdown, to_markdown
from normexp.results import load_metrics, load_summary

T = """name: t
base:
  model: {arch: transformer, depth: 2, width: 8, n_heads: 2}
  data: {task: copy, seq_len: 5, vocab: 8, n_samples: 16, n_val: 8}
  train: {steps: 4}
grid:
  norm.placement: [post, pre]
seeds: [0]
"""
FFN = ("name: ffn\nbase:\n  model: {depth: 2, width: 8}\n  train: {steps: 2}\n"
       "grid:\n  norm.placement: [post, pre]\n  optim.lr: [0.01, 0.02, 0.05]\n")


def invoke(*args: str):
    return CliRunner(env={"COLUMNS": "200"}).invoke(app, list(args))


def sweep(tmp_path_factory, name: str, text: str, *sets: str):
    return trained_sweep(tmp_path_factory, name, text, "--engine", "reference", *sets)


@pytest.fixture(scope="module")
def tf(tmp_path_factory):
    return sweep(tmp_path_factory, "tf", T)


@pytest.fixture(scope="module")
def tf_steps(tmp_path_factory):
    return sweep(tmp_path_factory, "tfsteps", T, "--set", "train.steps=4,7", "--set", "seeds=0,1")


@pytest.fixture(scope="module")
def ffn(tmp_path_factory):
    return sweep(tmp_path_factory, "ffn", FFN)


def chance_lines(ax) -> dict[str, float]:
    return {line.get_label(): line.get_ydata()[0] for line in ax.get_lines() if line.get_label().startswith("chance")}


def test_plot_draws_a_transformers_chance_at_ln_vocab(tf):
    curves = curves_figure(load_metrics(tf, all_config=True), ["norm.placement"])
    assert chance_lines(curves.axes[0]) == {"chance, ln 8": math.log(8)}
    final = final_loss_figure(load_summary(tf), "model.depth")
    assert chance_lines(final.axes[0]) == {"chance, ln 8": math.log(8)}


@pytest.fixture
def tf_lost(tf, tmp_path):
    """The Transformer sweep with Pre's run folder gone."""
    out = tmp_path / "out"
    shutil.copytree(tf, out)
    summary = load_summary(out)
    shutil.rmtree(out / summary.loc[summary["norm.placement"] == "pre", "run_id"].iloc[0])
    return out


def test_the_pivot_reads_a_missing_run_as_missing_never_diverged(tf_lost):
    pivot = build_pivot(tf_lost, "norm.placement", "model.depth")
    text = pivot_to_markdown(pivot)
    assert "| pre | missing |" in text.replace("  ", " ") and "diverged |" not in text
    rows = {r.split(",")[1]: r.split(",")[-3:] for r in pivot_to_csv(pivot).splitlines()[1:]}
    assert rows["pre"] == ["0", "1", "1"] and rows["post"] == ["1", "1", "0"]


def test_a_cell_over_part_of_its_columns_runs_says_k_of_n(tf_steps):
    report = build_report(tf_steps, by=["norm.placement"])
    assert {4, 7} <= set(report.steps)
    for column in report.columns:
        assert column.runs == 4
        for step in report.steps:
            cell = report.cell(column, step)
            assert cell.endswith("(2 of 4)") if step > 4 else "of" not in cell, (step, cell)
    text = to_markdown(report)
    assert "(2 of 4)" in text and "ended before a step" in text


@given(trained=st.integers(0, 4), failed=st.integers(0, 4), missing=st.integers(0, 4))
def test_a_verdict_names_missing_runs_and_judges_only_finished_ones(trained, failed, missing):
    runs = trained + failed
    if runs == 0:
        return  # a column exists only for a finished run
    column = Column("Pre", {}, {}, trained, runs, "seeds", 0, missing)
    line = Report("t", "loss", [], [column], (8,)).verdict_line()
    sections = dict(part.split(": ", 1) for part in line.split(".  "))
    said = {k.split(" (")[0]: v for k, v in sections.items()}
    assert ("Pre" in said["Trained"]) == (failed == 0)
    assert ("Pre" in said.get("Trained in some seeds", "")) == (trained > 0 < failed)
    assert ("Pre" in said["Did not train"]) == (trained == 0)
    assert (f"{missing} missing" in line) == (missing > 0)


def test_one_missing_seed_beside_a_trained_one_reads_trained():
    line = Report("t", "loss", [], [Column("Pre", {}, {}, 1, 1, "seeds", 0, 1)], (8,)).verdict_line()
    assert "): Pre (1 of 2 seeds; 1 missing)." in line and "Did not train: none." in line and "some" not in line


def test_plot_refuses_a_metric_the_runs_did_not_record(ffn, tmp_path):
    result = invoke("plot", str(ffn), "-o", str(tmp_path / "v.png"), "--metric", "val_acc")
    assert result.exit_code == 2, result.output  # an uncaught KeyError exits 1
    assert "--metric val_acc: not recorded by these runs" in result.output
    assert not (tmp_path / "v.png").exists()


@pytest.mark.parametrize(("args", "named"), [
    (["--pivot", "norm.placement,optim.lr", "--metric", "acc"], "--metric and --pivot"),
    (["--pivot", "norm.placement,optim.lr", "--steps", "1"], "--steps and --pivot"),
    (["--pivot", "norm.placement,optim.lr", "--by", "optim.lr"], "--by and --pivot"),
    (["--lr-sensitivity", "--metric", "acc"], "--metric and --lr-sensitivity"),
])
def test_report_refuses_an_option_its_mode_would_ignore(ffn, args, named):
    result = invoke("report", str(ffn), *args)
    assert result.exit_code == 2 and named in result.output, result.output


def test_the_lr_figure_names_its_question_and_its_constants_below_in_a_title_that_fits(ffn):
    fig = lr_figure(*lr_table(ffn))
    fig.canvas.draw()
    title = fig._suptitle
    assert " ".join(title.get_text().split()) == "Which learning rates train? Final training loss vs learning rate"
    detail = next(a for a in fig.artists if "mean over seeds" in a.get_text())
    assert "arch=ffn" in detail.get_text() and detail.get_fontsize() < title.get_fontsize()
    head, below = title.get_window_extent(), detail.get_window_extent()
    for box in (head, below):
        assert 0 <= box.x0 and box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height
    assert below.y1 <= head.y1 - title.get_fontsize()  # under the question's line, not over it
    panels = [ax.get_window_extent() for ax in fig.axes if ax.get_visible()]
    assert below.y0 >= max(p.y1 for p in panels)  # the constants stay above every panel


def test_gradnorm_gives_no_verdict_on_one_layer_and_says_how_many_seeds(tmp_path):
    config = tmp_path / "gn.yaml"
    config.write_text(T.replace("depth: 2", "depth: 1").replace("seeds: [0]", "seeds: [0, 1, 2]"))
    result = invoke("gradnorm", str(config), "--out", str(tmp_path / "gn"), "--format", "markdown")
    assert result.exit_code == 0, result.output
    assert "no verdict: needs 2 layers or more" in result.output and "(flat)" not in result.output
    assert "each cell: mean ± std over 3 seeds" in result.output
