"""A text task's losses in the report's figures and page: its unigram and bigram floors drawn as reference
lines, and val_loss's steps without an evaluation (train.eval_every) left out of a line instead of breaking it."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from normexp import corpus
from normexp.analysis.realtext import text_floors
from normexp.figures import curves_figure
from normexp.page import data

EVAL_EVERY = 3


def tidy(task: str = "shakespeare_char", steps: int = 7) -> pd.DataFrame:
    """Two placements x 2 seeds: val_loss at 0, 3, 6 and the last step, nan between, as the engines write it."""
    rows = []
    for placement in ("post", "pre"):
        for seed in (0, 1):
            for step in range(steps + 1):
                scored = step % EVAL_EVERY == 0 or step == steps
                rows.append({"run_id": f"{placement}-{seed}", "norm.placement": placement, "seed": seed,
                             "status": "completed", "step": step, "loss": 4.0 - step / 10 - seed / 100,
                             "val_loss": 4.1 - step / 10 - seed / 100 if scored else math.nan,
                             "model.arch": "transformer", "model.n_classes": 10, "data.vocab": 84,
                             "data.task": task})
    return pd.DataFrame(rows)


def scored_steps(steps: int = 7) -> list[int]:
    return [s for s in range(steps + 1) if s % EVAL_EVERY == 0 or s == steps]


def test_the_floors_are_the_texts_own_for_text_runs_and_none_for_others():
    floors = corpus.floors()
    assert sorted(text_floors(tidy()).values()) == sorted([floors.unigram, floors.bigram])
    assert text_floors(tidy("copy")) == {} and text_floors(tidy().drop(columns="data.task")) == {}


@pytest.mark.parametrize("metric", ["val_loss", "loss"])
def test_the_curves_figure_draws_the_floors_on_a_text_tasks_losses(metric):
    fig = curves_figure(tidy(), ["norm.placement"], metric)
    drawn = {round(float(line.get_ydata()[0]), 9) for ax in fig.axes for line in ax.lines
             if line.get_linestyle() == "-."}
    assert drawn == {round(v, 9) for v in text_floors(tidy()).values()}
    labels = [text.get_text() for legend in fig.legends for text in legend.get_texts()]
    assert any(label.startswith("unigram floor") for label in labels), labels
    other = curves_figure(tidy("copy"), ["norm.placement"], metric)
    assert not [line for ax in other.axes for line in ax.lines if line.get_linestyle() == "-."]


def test_the_curves_figure_joins_val_loss_across_steps_without_an_evaluation():
    fig = curves_figure(tidy(), ["norm.placement"], "val_loss")
    curves = [line for ax in fig.axes for line in ax.lines if "n=2" in line.get_label()]
    assert len(curves) == 2
    for line in curves:
        assert list(line.get_xdata()) == scored_steps() and np.isfinite(line.get_ydata()).all()


def test_the_page_carries_the_floors_and_only_the_evaluated_steps():
    curves = data.curves_data(tidy(), ["norm.placement"], "val_loss", None)
    assert [floor["y"] for floor in curves["floors"]] == [data.rounded(v) for v in text_floors(tidy()).values()]
    for line in curves["lines"]:
        assert line["x"] == scored_steps() and None not in line["y"] and line["n"] == [2] * len(scored_steps())
    assert data.curves_data(tidy("copy"), ["norm.placement"], "val_loss", None)["floors"] == []
    training = data.curves_data(tidy(), ["norm.placement"], "loss", None)
    assert training["lines"][0]["x"] == list(range(8))  # the training loss: every step


def test_a_panel_mixing_text_and_other_runs_names_the_text_its_floors_belong_to():
    mixed = pd.concat([tidy(), tidy("copy").assign(run_id=lambda f: "copy-" + f["run_id"])])
    labels = list(text_floors(mixed))
    assert len(labels) == 2 and all(label.startswith("shakespeare_char ") for label in labels), labels
    assert not any(label.startswith("shakespeare_char") for label in text_floors(tidy()))


EVERY = """\
name: every
base:
  model: {arch: transformer, depth: 2, width: 16, n_heads: 2}
  data: {task: shakespeare_char, seq_len: 12, n_val: 6, batch_size: 3}
  train: {steps: 4, threads: 1}
grid:
  train.eval_every: [1, 4]
seeds: [0]
"""


@pytest.mark.process
def test_the_report_counts_a_step_without_an_evaluation_as_no_measurement(tmp_path):
    """val_loss at step 1 exists for the eval_every 1 run only: its own column reads '—' for eval_every 4 (not
    'nan ± nan'), and a column pooling both says its mean covers 1 of 2 runs."""
    from typer.testing import CliRunner

    from normexp.cli import app
    from normexp.report import build_report

    config = tmp_path / "every.yaml"
    config.write_text(EVERY)
    result = CliRunner().invoke(app, ["sweep", str(config), "--out", str(tmp_path / "runs"), "--engine", "batched"])
    assert result.exit_code == 0, result.output
    report = build_report(tmp_path / "runs", metric="val_loss", steps=[1, 4])
    cells = {column.label: [report.cell(column, s) for s in (1, 4)] for column in report.columns}
    assert [cell for label, (cell, _) in cells.items() if "4" in label] == ["—"], cells
    assert all("nan" not in cell and "(" not in cell for pair in cells.values() for cell in pair[1:]), cells
    pooled = build_report(tmp_path / "runs", metric="val_loss", steps=[1, 4], by=["norm.placement"])
    assert [pooled.cell(column, 1) for column in pooled.columns][0].endswith("(1 of 2)")
