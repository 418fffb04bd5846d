"""Every aggregate says what it covers: each run judged by its own n_classes, null grid values as
variants of their own, diverged runs counted (never folded silently into a mean, never shown as "no
run"), a std over fewer than two runs left empty, a folder of two engines said to be one, and gradnorm
pooling seeds only. Sweep folders are hand-made, so every number is known."""

from __future__ import annotations

import csv
import io
import math
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import DIVERGING, NAN, write_curves
from rich.console import Console
from typer.testing import CliRunner

from normexp.cli import app
from normexp.config import RunConfig, build_sweep
from normexp.figures import curves_figure, phase_figure
from normexp.folder import FinishedRun, atomic_write, run_id, write_run, write_summary
from normexp.report import build_pivot, build_report, pivot_to_csv, pivot_to_markdown, to_csv, to_markdown, to_rich
from normexp.results import load_metrics, load_summary, varying_keys

Outcome = Callable[[RunConfig], list[float]]  # a run's losses; a non-finite last loss: it diverged


def make_folder(root: Path, sweep: dict, losses: Outcome) -> Path:
    """A sweep folder written through the store, each run with the losses `losses` gives it."""
    spec = build_sweep({"base": {"model": {"depth": 2, "width": 4}, "train": {"steps": 2}}, **sweep})
    out = root / spec.name
    out.mkdir()
    atomic_write(out / "sweep.yaml", spec.to_yaml())
    for cfg in spec.runs:
        values = losses(cfg)
        n = len(values)
        metrics = {"step": list(range(n)), "loss": values, "acc": [0.5] * n, "lr": [cfg.optim.lr] * n,
                   "grad_norm": [1.0] * n}
        status = "completed" if math.isfinite(values[-1]) else "diverged"
        write_run(out / run_id(cfg), cfg, FinishedRun(metrics, status, 0.1, 1, "reference", "cpu"))
    write_summary(out, spec.runs)
    return out


def render(renderable) -> str:
    console = Console(width=160, file=io.StringIO(), color_system=None, legacy_windows=False)
    console.print(renderable)
    return console.file.getvalue()


# ----------------------------------------------------------------------------- n_classes


def test_each_run_is_judged_by_its_own_n_classes(tmp_path):
    """ln(2)/10 = 0.069 and ln(100)/10 = 0.46: runs ending at 0.085 and 0.099 trained with 100 classes."""
    final = {(2, 0): 0.05, (2, 1): 0.06, (100, 0): 0.085, (100, 1): 0.099}
    out = make_folder(tmp_path, {"name": "nc", "grid": {"model.n_classes": [2, 100]}, "seeds": [0, 1]},
                      lambda cfg: [3.0, 1.0, final[cfg.model.n_classes, cfg.seed]])
    report = build_report(out)
    assert [(c.label, c.trained, c.runs) for c in report.columns] == [("n_classes=2", 2, 2), ("n_classes=100", 2, 2)]
    line = report.verdict_line()
    assert "Did not train: none." in line
    assert "ln(2)/10 = 0.069" in line and "ln(100)/10 = 0.461" in line


# ----------------------------------------------------------------------------- null, booleans, 1 vs 1.0


NULL_SWEEP = {"name": "nulls", "base": {"model": {"depth": 2, "width": 4}, "norm": {"placement": "deepnorm"},
                                         "train": {"steps": 2}},
              "grid": {"norm.deepnorm_alpha": [None, 2.0], "optim.lr": [0.01, 0.1]}, "seeds": [0, 1]}


def _alpha_losses(cfg: RunConfig) -> list[float]:
    return [2.0, 1.0, (0.1 if cfg.norm.deepnorm_alpha is None else 0.2) + cfg.optim.lr + cfg.seed / 100]


def test_a_null_grid_value_is_a_variant_of_its_own(tmp_path):
    out = make_folder(tmp_path, NULL_SWEEP, _alpha_losses)
    summary = load_summary(out)
    assert "norm.deepnorm_alpha" in varying_keys(summary)
    report = build_report(out)
    assert [(c.label, c.runs) for c in report.columns] == [
        ("deepnorm_alpha=null lr=0.01", 2), ("deepnorm_alpha=null lr=0.1", 2),
        ("deepnorm_alpha=2.0 lr=0.01", 2), ("deepnorm_alpha=2.0 lr=0.1", 2)]
    assert report.columns[0].cells[2][0] == pytest.approx(0.115)
    assert "norm.deepnorm_alpha" in load_metrics(out).columns


def test_the_pivot_keeps_null_rows(tmp_path):
    out = make_folder(tmp_path, NULL_SWEEP, _alpha_losses)
    pivot = build_pivot(out, "norm.deepnorm_alpha", "optim.lr")
    (_, mean, _, n, runs), = pivot.panels
    assert len(mean.index) == 2 and int(n.to_numpy().sum()) == 8 and int(runs.to_numpy().sum()) == 8
    rows = pivot_to_csv(pivot).splitlines()[1:]
    assert len(rows) == 4
    assert sorted(float(r.split(",")[3]) for r in rows) == pytest.approx([0.115, 0.205, 0.215, 0.305])


def test_curves_have_a_line_per_null_variant(tmp_path):
    out = make_folder(tmp_path, NULL_SWEEP, _alpha_losses)
    tidy = load_metrics(out, all_config=True)
    fig = curves_figure(tidy, ["norm.deepnorm_alpha", "optim.lr"])  # a panel per alpha, a line per lr
    panels = [ax for ax in fig.axes if ax.get_visible()]
    lines = [line for ax in panels for line in ax.get_lines() if line.get_label().startswith("lr=")]
    assert len(lines) == 4 and sum(ax.get_title().startswith("deepnorm_alpha=null") for ax in panels) == 1


@pytest.mark.parametrize(("key", "values", "varying"), [
    ("norm.deepnorm_alpha", [None, 2.0], True),
    ("model.final_norm", [True, False], True),
    ("optim.lr", [1, 1.0], False),  # one value, written twice
    ("train.threads", [None, 1], True),
])
def test_sweep_varying_keys_count_distinct_values(key: str, values: list, varying: bool):
    spec = build_sweep({"name": "v", "base": {"norm": {"placement": "deepnorm"}}, "grid": {key: values}})
    assert (key in spec.varying_keys) is varying
    assert len(spec.runs) == (2 if varying else 1)


# ----------------------------------------------------------------------------- diverged runs


DIVERGED = {"name": "div", "base": {"model": {"depth": 2, "width": 4}, "optim": {"name": "sgd"}, "train": {"steps": 2}},
            "grid": {"optim.lr": [0.01, 10.0, 100.0]}, "seeds": [0, 1, 2, 3]}


def _diverging(cfg: RunConfig) -> list[float]:
    """lr 0.01 trains; lr 10: seeds 0 and 1 diverge at step 1, seeds 2 and 3 end at 0.5 and 0.7; lr 100:
    all diverge."""
    if cfg.optim.lr == 0.01:
        return [2.3, 1.0, 0.1]
    if cfg.optim.lr == 10.0 and cfg.seed >= 2:
        return [2.3, 1.5, 0.5 if cfg.seed == 2 else 0.7]
    return [2.3, math.nan]


@pytest.fixture
def diverged(tmp_path) -> Path:
    return make_folder(tmp_path, DIVERGED, _diverging)


def test_the_table_says_how_many_seeds_each_mean_covers(diverged):
    report = build_report(diverged, steps=[0, 1, 2])
    low, mid, high = report.columns
    assert (low.diverged, mid.diverged, high.diverged) == (0, 2, 4)
    assert report.cell(low, 2) == "0.1000 ± 0.0000"
    assert report.cell(mid, 2) == "0.6000 ± 0.1414 (2 of 4)"
    assert report.cell(high, 2) == "all 4 diverged"  # not "—", the mark for "no run"
    assert report.cell(high, 0) == "2.3000 ± 0.0000"
    text = to_markdown(report)
    assert "(k of n): the mean covers the k runs" in text
    assert "Diverged: lr=10.0 (2 of 4 seeds), lr=100.0 (4 of 4 seeds)." in text
    assert "all 4 diverged" in render(to_rich(report))
    rows = list(csv.DictReader(io.StringIO(to_csv(report))))
    last = next(r for r in rows if r["variant"] == "lr=10.0" and r["step"] == "2")
    assert (last["n"], last["runs"], last["diverged"]) == ("2", "4", "2")
    assert last["verdict"] == "trained in 0 of 4 seeds, 2 diverged"


def test_the_pivot_says_how_many_seeds_each_cell_covers(diverged):
    text = pivot_to_markdown(build_pivot(diverged, "optim.lr", "optim.name"))
    assert "0.6000 ± 0.1414 (2 of 4)" in text
    assert "all 4 diverged" in text and "—" not in text
    assert "the other n - k diverged" in text
    rows = pivot_to_csv(build_pivot(diverged, "optim.lr", "optim.name")).splitlines()
    assert rows[0].endswith(",n,runs,missing") and rows[-1].split(",")[-3:] == ["0", "4", "0"]


def test_plots_say_how_many_diverged(diverged):
    tidy = load_metrics(diverged, all_config=True)
    fig = curves_figure(tidy, ["optim.lr"])
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert {"lr=0.01 (n=4)", "lr=10 (n=4, 2 diverged)", "lr=100 (n=4, 4 diverged)"} <= set(labels)


def test_the_phase_diagram_marks_partial_cells(tmp_path):
    sweep = {**DIVERGED, "grid": {"optim.lr": [0.01, 10.0], "optim.momentum": [0.0, 0.9]}}
    out = make_folder(tmp_path, sweep, _diverging)
    fig = phase_figure(load_summary(out), "optim.lr", "optim.momentum")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts.count("0.6\n2/4") == 2 and texts.count("0.1") == 2


def test_study_verdicts_count_diverged_runs(diverged):
    from normexp.studies.verdicts import coverage

    text = coverage(load_summary(diverged), ["optim.lr"])
    assert "12 finished runs (4 seeds per cell)" in text
    assert "lr=10.0: 2 of 4" in text and "lr=100.0: 4 of 4" in text


# ----------------------------------------------------------------------------- gradnorm


def test_gradnorm_pools_seeds_only(tmp_path):
    from normexp.diagnostics import gradnorm_at_init, gradnorm_study

    spec = build_sweep({"name": "g", "base": {"model": {"width": 8}, "norm": {"placement": "post"}},
                        "grid": {"norm.kind": ["layernorm", "rmsnorm"], "model.depth": [2, 4]}, "seeds": [0]})
    summary = gradnorm_study(spec, tmp_path / "g")
    assert len(summary.last_grad) == 2  # one line per kind, never their mean
    for (variant, stats), kind in zip(summary.last_grad.items(), ["layernorm", "rmsnorm"]):
        assert kind in variant
        for (mean, std), depth in zip(stats, [2, 4]):
            cfg = next(c for c in spec.runs if c.norm.kind == kind and c.model.depth == depth)
            assert math.isnan(std) and mean == gradnorm_at_init(cfg)[-1]["fc2_grad"]  # one seed: no spread, not 0


# ----------------------------------------------------------------------------- missing runs


LOST = {"name": "lost", "base": {"model": {"depth": 2, "width": 4}, "train": {"steps": 4}},
        "grid": {"optim.lr": [0.01, 0.02]}, "seeds": [0, 1, 2, 3]}


@pytest.fixture
def lost(tmp_path) -> Path:
    """Every run ends at 0.1 after 4 steps; lr 0.02's seed 3 lost its metrics.csv (corrupt)."""
    out = make_folder(tmp_path, LOST, lambda cfg: [2.3, 1.0, 0.5, 0.2, 0.1])
    victim = next(cfg for cfg in build_sweep(LOST).runs if cfg.optim.lr == 0.02 and cfg.seed == 3)
    (out / run_id(victim) / "metrics.csv").unlink()
    return out


def test_a_missing_run_counts_in_every_aggregate(lost):
    report = build_report(lost, steps=[0, 4])
    whole, part = report.columns
    assert report.cell(whole, 4) == "0.1000 ± 0.0000" and report.cell(part, 4) == "0.1000 ± 0.0000 (3 of 4)"
    assert report.verdict(part) == "trained in 3 of 4 seeds, 1 missing"
    assert report.title.endswith("4 seeds · 7 of 8 runs finished")
    text = to_markdown(report)
    assert "lr=0.02 (3 of 4 seeds; 1 missing)" in text and "Trained in some seeds" not in text
    assert "1 run missing, failed or corrupt" in text
    pivot = pivot_to_markdown(build_pivot(lost, "optim.lr", "optim.name"))
    assert "0.1000 ± 0.0000 (3 of 4)" in pivot and "or are missing" in pivot


def test_the_default_steps_end_at_the_last_step_trained(lost):
    assert build_report(lost).steps == [0, 1, 2, 3, 4]  # the default steps (0, 1, 2, 3, 5, ...) lack 4
    assert build_report(lost, steps=[1]).steps == [1]  # steps asked for are shown as asked


@pytest.mark.parametrize("args", [["report"], ["report", "--format", "csv"], ["report", "--pivot", "optim.lr,seed"],
                                  ["plot"]])
def test_report_and_plot_exit_1_when_runs_are_missing(lost, args):
    from typer.testing import CliRunner

    from normexp.cli import app

    result = CliRunner().invoke(app, [args[0], str(lost), *args[1:]])
    assert result.exit_code == 1, result.output
    assert "1 run missing, failed or corrupt" in " ".join(result.output.split())
    assert result.output.count("missing, failed or corrupt") == 1


# ----------------------------------------------------------------------------- a std over fewer than two runs


ONE_SEED = [  # one run per cell, and a cell (none, 0.1) whose only run diverged: no std is defined anywhere
    ("pre", 0.001, 0, [2.3, 1.0, 0.5, 0.4], "completed"),
    ("pre", 0.01, 0, [2.3, 0.6, 0.2, 0.1], "completed"),
    ("pre", 0.1, 0, [2.3, 1.1, 0.9, 0.8], "completed"),
    ("none", 0.001, 0, [2.0, 1.9, 1.8, 1.7], "completed"),
    ("none", 0.01, 0, [2.0, 0.3, 0.2, 0.2], "completed"),
    ("none", 0.1, 0, [2.0, 0.5, NAN, NAN], "diverged"),
]


TWO_SEEDS = [*ONE_SEED, ("pre", 0.01, 1, [2.3, 0.6, 0.2, 0.3], "completed")]


def _csv(args: list[str]) -> list[dict]:
    result = CliRunner().invoke(app, args)
    assert result.exit_code in (0, 1), result.output  # 1: the sweep has missing runs (seed 1 of most cells)
    return list(csv.DictReader(result.stdout.splitlines()))


def test_a_std_over_fewer_than_two_runs_is_empty_in_every_csv(tmp_path):
    folder = write_curves(tmp_path / "s", TWO_SEEDS)
    rows = _csv(["report", str(folder), "--format", "csv"])
    assert {int(r["n"]) for r in rows} >= {0, 1, 2}
    for r in rows:  # a cell with n < 2 finite runs has no std: empty, never 0.0
        if int(r["n"]) < 2:
            assert r["loss_std"] == "", r
        else:
            assert float(r["loss_std"]) >= 0, r  # a true spread (0 at step 0, where both seeds start at 2.3)
    # the one cell with two runs at its final step: std of (0.1, 0.3), by hand
    pivot = _csv(["report", str(folder), "--pivot", "optim.lr,norm.placement", "--format", "csv"])
    by_cell = {(r["optim.lr"], r["norm.placement"]): r for r in pivot}
    assert float(by_cell[("0.01", "pre")]["final_loss_std"]) == pytest.approx(statistics.stdev([0.1, 0.3]))
    for r in pivot:
        if int(r["n"]) < 2:
            assert r["final_loss_std"] == "", r
            if int(r["n"]) == 0:
                assert r["final_loss_mean"] == "", r
    assert by_cell[("0.1", "none")]["n"] == "0"


# ----------------------------------------------------------------------------- runs of two engines


def _mixed_folder(tmp_path: Path) -> Path:
    """DIVERGING's sweep trained by the batched engine, but seed 1 of pre at lr 0.01 by the fast engine
    (as a fast sweep resumed over exact runs keeps them): the cell (pre, 0.01) averages both."""
    folder = write_curves(tmp_path / "mixed", DIVERGING, engine="batched")
    for placement, lr, seed, losses, status, *_ in DIVERGING:
        if (placement, lr, seed) == ("pre", 0.01, 1):
            cfg = RunConfig.model_validate({"norm": {"placement": placement}, "optim": {"lr": lr}, "seed": seed,
                                            "schedule": {"kind": "linear_warmup", "warmup_steps": 0},
                                            "train": {"steps": 3, "stop_on_nonfinite": False}})
            n = len(losses)
            metrics = {"step": list(range(n)), "loss": list(losses), "acc": [0.1] * n, "lr": [lr] * n,
                       "grad_norm": [1.0] * n}
            import shutil

            shutil.rmtree(folder / run_id(cfg))
            write_run(folder / run_id(cfg), cfg, FinishedRun(metrics, status, 0.1, 1, "fast", "cpu"))
    return folder


def test_a_folder_of_two_engines_says_so_wherever_its_numbers_are_shown(tmp_path):
    folder = _mixed_folder(tmp_path)
    runner = CliRunner()
    for args in ([], ["--format", "markdown"], ["--pivot", "optim.lr,norm.placement"],
                 ["--pivot", "optim.lr,norm.placement", "--format", "markdown"], ["--lr-sensitivity"],
                 ["--lr-sensitivity", "--format", "markdown"], ["--by", "norm.placement"]):
        result = runner.invoke(app, ["report", str(folder), *args])
        assert result.exit_code == 1, result.output  # printed; 1: DIVERGING leaves NoNorm's seed 1 missing
        text = " ".join(result.stdout.split())
        assert "Engines mixed: 1 of 9 runs by the fast engine" in text, (args, text)
        assert "--engine batched" in text
    table = " ".join(runner.invoke(app, ["report", str(folder)]).stdout.split())
    assert "cells that average both: Pre lr=0.01 (1 fast, 1 batched)" in table
    by = " ".join(runner.invoke(app, ["report", str(folder), "--by", "norm.placement"]).stdout.split())
    assert "Pre (1 fast, 5 batched)" in by
    for args in (["--format", "csv"], ["--pivot", "optim.lr,norm.placement", "--format", "csv"],
                 ["--lr-sensitivity", "--format", "csv"]):
        result = runner.invoke(app, ["report", str(folder), *args])
        assert result.exit_code == 1 and "Engines mixed" in result.stderr and "Engines" not in result.stdout
    checked = runner.invoke(app, ["verify", str(folder)])
    assert checked.exit_code == 1, checked.output  # the missing runs; the engines are a note
    assert "note: runs of two engines" in " ".join(checked.stdout.split())
    assert "runs of two engines: 1 of 9 by the fast engine" in " ".join(checked.stdout.split())
    assert runner.invoke(app, ["plot", str(folder)]).exit_code == 1 and (folder / "loss-lr.png").is_file()


def test_one_engine_says_nothing(tmp_path):
    from normexp.analysis.variants import engine_note
    from normexp.report import build_report
    from normexp.results import load_summary

    folder = write_curves(tmp_path / "one", DIVERGING, engine="fast")
    assert engine_note(load_summary(folder), ["norm.placement"]) == "" and build_report(folder).engines == ""
    assert "engines" not in CliRunner().invoke(app, ["verify", str(folder)]).stdout
