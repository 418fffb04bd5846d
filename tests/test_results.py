"""Results, report and plots, on a hand-made sweep folder whose numbers are known exactly."""

from __future__ import annotations

import io
import math
import shutil
import subprocess
import sys

import matplotlib
import pytest
from rich.console import Console
from typer.testing import CliRunner

from normexp.analysis.finals import numeric_axes
from normexp.cli import app
from normexp.config import build_sweep, parse_yaml
from normexp.figures import curves_figure, phase_figure, save_plots
from normexp.folder import FinishedRun, atomic_write, run_id, write_run, write_summary
from normexp.report import build_pivot, build_report, pivot_to_markdown, to_markdown, to_rich
from normexp.results import load_metrics, load_summary

# final losses: post stalls near chance, pre trains; seed 1 of pre at lr 0.1 fails to train
LOSSES = {
    ("post", 0.01, 0): [2.5, 2.4, 2.2], ("post", 0.01, 1): [2.7, 2.6, 2.4],
    ("pre", 0.01, 0): [2.5, 1.0, 0.1], ("pre", 0.01, 1): [2.7, 1.2, 0.1],
    ("post", 0.1, 0): [2.5, 2.5, 2.3], ("post", 0.1, 1): [2.7, 2.7, 2.3],
    ("pre", 0.1, 0): [2.5, 0.5, 0.05], ("pre", 0.1, 1): [2.7, 2.6, 2.5],
}
SWEEP = """\
name: fake
base: {model: {depth: 2, width: 4}, schedule: {kind: linear_warmup}, train: {steps: 2}}
grid: {norm.placement: [post, pre], optim.lr: [0.01, 0.1], schedule.warmup_steps: [0, 5]}
seeds: [0, 1]
report: {steps: [0, 2]}
"""


@pytest.fixture
def fake_sweep(tmp_path):
    """A sweep folder written through the store, with the LOSSES above (warmup 5 adds 0.01)."""
    sweep = build_sweep(parse_yaml(SWEEP))
    out = tmp_path / "fake"
    out.mkdir()
    atomic_write(out / "sweep.yaml", sweep.to_yaml())
    for cfg in sweep.runs:
        extra = 0.01 if cfg.schedule.warmup_steps else 0.0
        losses = [v + extra for v in LOSSES[cfg.norm.placement, cfg.optim.lr, cfg.seed]]
        metrics = {"step": [0, 1, 2], "loss": losses, "acc": [0.1, 0.5, 1.0], "lr": [cfg.optim.lr] * 3,
                   "grad_norm": [1.0, 2.0, 3.0]}
        write_run(out / run_id(cfg), cfg, FinishedRun(metrics, "completed", 0.1, 1, "reference", "cpu"))
    write_summary(out, sweep.runs)
    return out


def render(renderable, width: int = 110) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None, legacy_windows=False)
    console.print(renderable)
    return console.file.getvalue()


def test_load_metrics_is_tidy(fake_sweep):
    tidy = load_metrics(fake_sweep)
    assert len(tidy) == 16 * 3
    assert list(tidy.columns[:6]) == ["run_id", "norm.placement", "optim.lr", "schedule.warmup_steps", "seed",
                                      "status"]
    assert {"step", "loss", "acc", "lr", "grad_norm"} <= set(tidy.columns)
    assert tidy[(tidy["norm.placement"] == "pre") & (tidy["seed"] == 1) & (tidy["optim.lr"] == 0.1)
                & (tidy["schedule.warmup_steps"] == 0)]["loss"].tolist() == [2.7, 2.6, 2.5]
    assert len(load_summary(fake_sweep)) == 16


@pytest.mark.process
def test_results_module_does_not_import_torch():
    code = "import sys, normexp.results, normexp.report, normexp.figures; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_report_table_renders_as_expected(fake_sweep):
    report = build_report(fake_sweep, by=["norm.placement", "optim.lr"])
    text = render(to_rich(report))
    title = ("loss per step · arch=ffn task=random_labels kind=layernorm depth=2 width=4 n_classes=10 optim=adam "
             "schedule=linear_warmup steps=2 · each column pools its runs over warmup steps and the seeds: mean ± std "
             "over runs, not seeds")
    assert " ".join(text.split("┏")[0].split()) == title, text  # --by leaves the warmup out: pooled, not seeds
    expected = """\
┏━━━━━━┳━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━┓
┃ step ┃    Post lr=0.01 ┃     Post lr=0.1 ┃     Pre lr=0.01 ┃      Pre lr=0.1 ┃
┡━━━━━━╇━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━┩
│    0 │ 2.6050 ± 0.1156 │ 2.6050 ± 0.1156 │ 2.6050 ± 0.1156 │ 2.6050 ± 0.1156 │
│    2 │ 2.3050 ± 0.1156 │ 2.3050 ± 0.0058 │ 0.1050 ± 0.0058 │ 1.2800 ± 1.4145 │
└──────┴─────────────────┴─────────────────┴─────────────────┴─────────────────┘
"""
    assert expected in text, text
    assert "Trained (final loss < ln(10)/10 = 0.230): Pre lr=0.01." in text
    assert "Trained in some runs: Pre lr=0.1 (2/4 runs)." in " ".join(text.split())


def test_markdown_report_with_plus_minus_and_verdicts(fake_sweep):
    markdown = to_markdown(build_report(fake_sweep, by=["norm.placement"]))
    assert "| step | Post | Pre |" in markdown
    # 8 runs each; sample std (ddof=1): statistics.stdev of the eight final losses
    assert "| 2 | 2.3050 ± 0.0758 | 0.6925 ± 1.1189 |" in markdown, markdown
    assert "Trained in some runs: Pre (6/8 runs)." in markdown


def test_report_section_of_the_sweep_is_used(fake_sweep):
    report = build_report(fake_sweep)
    assert report.steps == [0, 2]
    assert [c.label for c in report.columns][:2] == ["Post lr=0.01 warmup_steps=0", "Post lr=0.01 warmup_steps=5"]
    assert report.verdict(report.columns[0]) == "trained in 0 of 2 seeds"


def test_report_other_metric(fake_sweep):
    report = build_report(fake_sweep, metric="grad_norm", by=["norm.placement"])
    assert "3.0000 ± 0.0000" in to_markdown(report)
    assert "Trained" not in to_markdown(report)  # the verdict is about the loss only


def test_pivot(fake_sweep):
    pivot = build_pivot(fake_sweep, "optim.lr", "schedule.warmup_steps")
    assert [title for title, *_ in pivot.panels] == ["Post", "Pre"]
    markdown = pivot_to_markdown(pivot)
    assert "| optim.lr \\ schedule.warmup_steps | 0 | 5 |" in markdown
    assert "| 0.1 | 1.2750 ± 1.7324 | 1.2850 ± 1.7324 |" in markdown


def test_pivot_and_report_through_the_cli(fake_sweep):
    runner = CliRunner()
    result = runner.invoke(app, ["report", str(fake_sweep), "--pivot", "optim.lr,schedule.warmup_steps",
                                 "--format", "csv"])
    assert result.exit_code == 0
    assert result.output.splitlines()[0] == ("panel,optim.lr,schedule.warmup_steps,final_loss_mean,final_loss_std,n,"
                                         "runs,missing")
    assert len(result.output.splitlines()) == 1 + 8
    bad = runner.invoke(app, ["report", str(fake_sweep), "--pivot", "optim.lr"])
    assert bad.exit_code == 2 and "--pivot: expected ROW_KEY,COL_KEY" in bad.output
    bad = runner.invoke(app, ["report", str(fake_sweep), "--pivot", "optim.lr,optim.lrr"])
    assert bad.exit_code == 2 and "optim.lrr: not a config key" in bad.output


def test_curves_figure_content(fake_sweep):
    tidy = load_metrics(fake_sweep, all_config=True)
    fig = curves_figure(tidy, ["norm.placement"])
    ax = fig.axes[0]
    labels = [line.get_label() for line in ax.lines]
    assert labels == ["Post (n=8)", "Pre (n=8)", "chance, ln 10", "trained below 0.23"]
    assert ax.lines[-1].get_ydata()[0] == pytest.approx(math.log(10) / 10)
    assert ax.get_yscale() == "log" and ax.get_xlabel() == "optimizer step"
    assert "loss" in ax.get_ylabel() and "mean over seeds" in " ".join(fig.get_suptitle().split())
    assert len(ax.collections) == 2  # one min–max band per variant
    assert list(ax.lines[1].get_ydata()) == pytest.approx([2.605, 1.33, 0.6925])


def test_many_variants_are_split_into_panels(fake_sweep):
    tidy = load_metrics(fake_sweep, all_config=True)
    fig = curves_figure(tidy, ["norm.placement", "optim.lr", "schedule.warmup_steps"])
    panels = [ax for ax in fig.axes if ax.get_visible()]  # a column per placement; warmup the colour, lr the style
    assert [ax.get_title() for ax in panels] == ["Post (n=8)", "Pre (n=8)"]
    lines = [[ln for ln in ax.lines if ln.get_label().startswith("warmup=")] for ax in panels]
    assert [len(ax_lines) for ax_lines in lines] == [4, 4]
    assert {ln.get_linestyle() for ln in lines[0]} == {"-", "--"}  # the lr's two values: solid and dashed
    assert len(fig.legends) == 1 and not any(ax.get_legend() for ax in fig.axes)  # one legend, outside


def test_phase_figure_content(fake_sweep):
    summary = load_summary(fake_sweep)
    assert numeric_axes(summary) == ["optim.lr", "schedule.warmup_steps"]
    fig = phase_figure(summary, "optim.lr", "schedule.warmup_steps")
    panels = [ax for ax in fig.axes if ax.get_title() in ("Post (n=8)", "Pre (n=8)")]
    assert len(panels) == 2
    image = panels[1].get_images()[0].get_array()
    assert image.shape == (2, 2) and image[0, 0] == pytest.approx(0.1)  # pre, warmup 0, lr 0.01: both seeds 0.1
    assert any("final training loss" in ax.get_ylabel() for ax in fig.axes)  # the colour bar


def test_plot_command_writes_pngs(fake_sweep, tmp_path):
    result = CliRunner().invoke(app, ["plot", str(fake_sweep), "-o", str(tmp_path / "f.png")])
    assert result.exit_code == 0, result.output
    for name in ("f.png", "f-phase.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert save_plots(fake_sweep, metric="acc")[0].name == "acc.png"
    assert matplotlib.get_backend().lower() == "agg"


def test_wide_reports_are_transposed(fake_sweep):
    """Past six variants, variants go down and steps across, with a trained k/n column."""
    report = build_report(fake_sweep, by=["norm.placement", "optim.lr", "schedule.warmup_steps"])
    assert len(report.columns) == 8
    lines = to_markdown(report).splitlines()
    assert lines[2] == "| variant | step 0 | step 2 | trained |"
    assert "| Pre lr=0.1 warmup_steps=0 | 2.6000 ± 0.1414 | 1.2750 ± 1.7324 | 1/2 |" in lines


def _folder_with_an_earlier_run(out) -> int:
    """A run of another invocation (depth 3), verified, beside the sweep's 16: the folder holds 17."""
    other = build_sweep(parse_yaml(SWEEP.replace("depth: 2", "depth: 3"))).runs[0]
    metrics = {"step": [0, 1, 2], "loss": [2.5, 2.4, 2.3], "acc": [0.1] * 3, "lr": [0.01] * 3, "grad_norm": [1.0] * 3}
    write_run(out / run_id(other), other, FinishedRun(metrics, "completed", 0.1, 1, "reference", "cpu"))
    return 17


@pytest.mark.parametrize("command", [["report"], ["report", "--format", "csv"], ["report", "--only-last"],
                                     ["report", "--pivot", "optim.lr,schedule.warmup_steps"],
                                     ["report", "--lr-sensitivity"], ["plot"]])
def test_a_command_reads_and_verifies_each_run_of_a_folder_once(fake_sweep, monkeypatch, command):
    """One load per command: each run the folder holds is inspected once, whatever the command draws
    or tabulates from it (the report, its notes, the pivot, the sensitivity, every figure)."""
    from normexp.folder import inspect, sweepfiles

    runs = _folder_with_an_earlier_run(fake_sweep)
    if "--lr-sensitivity" in command:  # it needs an lr axis of 3 values: a third lr's runs, written alike
        sweep = build_sweep(parse_yaml(SWEEP.replace("[0.01, 0.1]", "[0.01, 0.1, 1.0]")))
        atomic_write(fake_sweep / "sweep.yaml", sweep.to_yaml())
        for cfg in (c for c in sweep.runs if c.optim.lr == 1.0):
            metrics = {"step": [0, 1, 2], "loss": [2.5, 2.5, 2.5], "acc": [0.1] * 3, "lr": [1.0] * 3,
                       "grad_norm": [1.0] * 3}
            write_run(fake_sweep / run_id(cfg), cfg, FinishedRun(metrics, "completed", 0.1, 1, "reference", "cpu"))
            runs += 1
    seen: list[str] = []
    real = inspect.inspect_run
    for module in (inspect, sweepfiles):  # each module that looks it up
        monkeypatch.setattr(module, "inspect_run",
                            lambda run_dir, *a, **k: seen.append(run_dir.name) or real(run_dir, *a, **k))
    result = CliRunner().invoke(app, [command[0], str(fake_sweep), *command[1:]])
    assert result.exit_code == 0, result.output
    assert len(seen) == len(set(seen)) == runs


def test_the_title_counts_seeds_per_configuration(fake_sweep):
    """A folder where one invocation ran more seeds than another says so, not the largest count alone."""
    assert "· 2 seeds" in build_report(fake_sweep).title
    _folder_with_an_earlier_run(fake_sweep)  # one configuration of one seed beside 8 of two
    assert "1 to 2 seeds per configuration" in build_report(fake_sweep).title


def test_a_run_deleted_after_it_was_verified_is_one_error_not_a_traceback(fake_sweep, monkeypatch):
    """Between verifying a folder and reading its metrics a run can go (another process): say so."""
    from normexp.results import ResultsError, load_folder

    folder = load_folder(fake_sweep)
    shutil.rmtree(fake_sweep / folder.summary["run_id"].iloc[3])
    with pytest.raises(ResultsError, match="changed while it was read"):
        folder.metrics()
