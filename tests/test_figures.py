"""Figures and reports on multi-axis sweeps (issue 28): the trained rule in summary.csv and its option,
what `report --by` pools, CSV columns named as the sweep names its keys, titles naming the constants,
verdicts counted per group, facets, formats, the phase diagram in the metric asked for, several sweeps
compared, and the HTML page."""

from __future__ import annotations

import csv
import io
import math

import pandas as pd
import pytest
from conftest import trained_sweep
from typer.testing import CliRunner

from normexp.cli import app
from normexp.config import build_sweep, load_sweep
from normexp.figures import choose_facets, number_texts
from normexp.folder import SWEEP_FILE, FinishedRun, run_id, write_run
from normexp.report import build_report, to_csv, to_markdown
from normexp.results import ResultsError, load_metrics, load_summary

FFN = """name: grid
base:
  model: {depth: 2, width: 8}
  schedule: {kind: linear_warmup}
  train: {steps: 3}
grid:
  norm.placement: [post, pre]
  norm.kind: [layernorm, rmsnorm]
  optim.lr: [0.01, 0.03, 0.1]
  schedule.warmup_steps: [0, 2]
seeds: [0, 1]
"""
TF = """name: tfgrid
base:
  model: {arch: transformer, depth: 1, width: 8, n_heads: 2}
  data: {task: copy, seq_len: 5, vocab: 8, n_samples: 16, n_val: 8}
  schedule: {kind: linear_warmup}
  train: {steps: 2}
grid:
  norm.placement: [post, pre]
  optim.lr: [0.01, 0.1]
  schedule.warmup_steps: [0, 1]
seeds: [0]
"""


def invoke(*args: str):
    return CliRunner(env={"COLUMNS": "200"}).invoke(app, list(args))


def sweep(tmp_path_factory, name: str, text: str, *sets: str):
    return trained_sweep(tmp_path_factory, name, text, "--engine", "batched", "--quiet", *sets)


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    return sweep(tmp_path_factory, "grid", FFN)


@pytest.fixture(scope="module")
def tf(tmp_path_factory):
    return sweep(tmp_path_factory, "tfgrid", TF)


# ----------------------------------------------------------------------------- the trained rule


def test_summary_csv_judges_every_finished_run_by_the_default_rule(grid):
    rows = list(csv.DictReader((grid / "summary.csv").open()))
    assert {"threshold", "trained"} <= set(rows[0])
    for row in rows:
        assert float(row["threshold"]) == pytest.approx(math.log(10) / 10)
        trained = row["status"] == "completed" and float(row["final_loss"]) < math.log(10) / 10
        assert row["trained"] == str(trained)


def test_summary_csv_of_a_transformer_uses_ln_vocab(tf):
    summary = load_summary(tf)
    assert summary["threshold"].tolist() == pytest.approx([math.log(8) / 10] * len(summary))


def test_the_trained_rule_is_a_report_key_that_changes_no_run_id(tmp_path, grid):
    small = FFN.replace("  norm.kind: [layernorm, rmsnorm]\n  optim.lr: [0.01, 0.03, 0.1]\n", "").replace(
        "seeds: [0, 1]", "seeds: [0]")
    plain, ruled = tmp_path / "plain.yaml", tmp_path / "rule.yaml"
    plain.write_text(small)
    ruled.write_text(small + "report: {trained_below: 2.2}\n")
    assert [c.model_dump() for c in load_sweep(ruled).runs] == [c.model_dump() for c in load_sweep(plain).runs]
    folders = {}
    for config in (plain, ruled):
        out = tmp_path / config.stem
        assert invoke("sweep", str(config), "--out", str(out), "--engine", "batched", "--quiet").exit_code == 0
        folders[config.stem] = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert folders["plain"] == folders["rule"] and len(folders["rule"]) == 4  # the same run ids
    out = tmp_path / "rule"
    summary = load_summary(out)
    assert (summary["threshold"] == 2.2).all()
    assert summary["trained"].tolist() == ((summary["status"] == "completed") & (summary["final_loss"] < 2.2)).tolist()
    text = to_markdown(build_report(out))
    assert "final loss < 2.2 (report.trained_below)" in text


def test_report_trained_below_overrides_the_rule_and_says_so(grid):
    result = invoke("report", str(grid), "--format", "markdown", "--trained-below", "100")
    assert result.exit_code == 0, result.output
    assert "final loss < 100 (--trained-below)" in result.output  # not the sweep's report.trained_below
    assert "Post: 12/12 cells trained; Pre: 12/12" in result.output
    tiny = invoke("report", str(grid), "--format", "markdown", "--trained-below", "1e-320")  # subnormal: as given
    assert "final loss < 1e-320 (--trained-below)" in tiny.output, tiny.output
    bad = invoke("report", str(grid), "--trained-below", "-1")
    assert bad.exit_code == 2 and "--trained-below -1.0: must be a finite loss > 0" in bad.output


# ----------------------------------------------------------------------------- report


def test_report_by_names_the_axes_it_pools_and_never_calls_them_seeds(grid):
    report = build_report(grid, by=["norm.placement"])
    assert "pools its runs over norm kind, learning rate, warmup steps and the seeds" in report.title
    assert "mean ± std over runs, not seeds" in report.title and "2 seeds" not in report.title
    assert all(c.unit == "runs" for c in report.columns)
    full = build_report(grid)
    assert "2 seeds" in full.title and all(c.unit == "seeds" for c in full.columns)


def test_report_titles_name_every_constant_that_defines_the_runs(grid, tf):
    assert "arch=ffn task=random_labels depth=2 width=8 n_classes=10" in build_report(grid).title
    title = build_report(tf).title
    assert "arch=transformer task=copy kind=layernorm depth=1 width=8 vocab=8" in title and "n_classes" not in title


def test_report_csv_has_one_column_per_config_key(grid):
    rows = list(csv.DictReader(io.StringIO(to_csv(build_report(grid, by=["norm.placement", "optim.lr"])))))
    assert list(rows[0])[:3] == ["norm.placement", "optim.lr", "variant"]
    assert {r["norm.placement"] for r in rows} == {"post", "pre"} and {r["optim.lr"] for r in rows} == {
        "0.01", "0.03", "0.1"}
    assert {r["pooled_over"] for r in rows} == {"norm.kind schedule.warmup_steps"}
    assert float(rows[0]["threshold"]) == pytest.approx(math.log(10) / 10)
    frame = pd.read_csv(io.StringIO(to_csv(build_report(grid))))
    assert {"norm.placement", "norm.kind", "optim.lr", "schedule.warmup_steps"} <= set(frame.columns)


def test_many_columns_give_counts_per_group_and_the_full_list_on_request(grid):
    report = build_report(grid)
    line = report.verdict_line()
    assert line.startswith("Trained (final loss < ln(10)/10 = 0.230), per placement: Post: ")
    assert "/12 cells trained; Pre: " in line and "Did not train" not in line
    assert len(line.split()) < 60
    full = report.verdict_line(full=True)
    assert "Did not train: " in full and "Post-LN lr=0.01 warmup_steps=0" in full
    result = invoke("report", str(grid), "--format", "markdown", "--verdicts", "full")
    assert "Did not train: " in result.output


def test_gradnorm_csv_names_its_columns_as_sweeps_do(tmp_path):
    config = tmp_path / "g.yaml"
    config.write_text("name: g\nbase: {model: {width: 8}}\ngrid: {norm.placement: [post, pre], model.depth: [1, 2]}\n")
    result = invoke("gradnorm", str(config), "--out", str(tmp_path / "g"))
    assert result.exit_code == 0, result.output
    header = (tmp_path / "g" / "gradnorm.csv").read_text().splitlines()[0].split(",")
    assert header[:4] == ["norm.placement", "norm.kind", "model.depth", "seed"]


# ----------------------------------------------------------------------------- figures


def test_default_facets_put_placements_across_and_the_fastest_key_in_the_hue():
    keys = ["norm.placement", "norm.kind", "optim.lr", "schedule.warmup_steps"]
    facets = choose_facets(keys)
    assert (facets.col, facets.row, facets.hue) == (["norm.placement"], ["norm.kind"],
                                                    ["optim.lr", "schedule.warmup_steps"])
    counts = {"norm.placement": 3, "norm.kind": 2, "optim.lr": 4, "schedule.warmup_steps": 2}
    facets = choose_facets(keys, counts=counts)  # the most values colour the lines, a key of 2 their style
    assert (facets.col, facets.row, facets.hue, facets.style) == (["norm.placement"], ["norm.kind"], ["optim.lr"],
                                                                  ["schedule.warmup_steps"])
    assert choose_facets(["norm.placement"]).hue == ["norm.placement"]
    assert choose_facets(keys, hue=["norm.placement"]).col == ["norm.kind"]
    with pytest.raises(ResultsError, match="--row model.depth: not a varying config key"):
        choose_facets(keys, row=["model.depth"])


def test_ticks_of_one_axis_share_one_style():
    assert number_texts([0.001, 0.003, 0.01, 0.1]) == ["1e-3", "3e-3", "1e-2", "1e-1"]
    assert number_texts([0.05, 0.5, 2.0]) == ["0.05", "0.5", "2"]
    assert number_texts([0, 2, 5]) == ["0", "2", "5"]


def test_plot_writes_the_format_asked_for(tf, tmp_path):
    result = invoke("plot", str(tf), "-o", str(tmp_path / "f.pdf"))
    assert result.exit_code == 0, result.output
    for name in ("f", "f-phase"):
        assert (tmp_path / f"{name}.pdf").read_bytes()[:4] == b"%PDF", name
    result = invoke("plot", str(tf), "--format", "svg", "-o", str(tmp_path / "g.svg"))
    assert result.exit_code == 0 and (tmp_path / "g.svg").read_bytes()[:5] == b"<?xml", result.output


def test_plot_options_facets_and_dpi(tf, tmp_path):
    result = invoke("plot", str(tf), "-o", str(tmp_path / "f.png"), "--col", "optim.lr", "--row",
                    "norm.placement", "--hue", "schedule.warmup_steps", "--dpi", "60")
    assert result.exit_code == 0, result.output
    from PIL import Image

    with Image.open(tmp_path / "f.png") as image:
        width, height = image.size
    assert width < 800 and 0.5 < width / height < 4  # never a 5:1 strip
    bad = invoke("plot", str(tf), "--hue", "model.depth", "-o", str(tmp_path / "g.png"))
    assert bad.exit_code == 2 and "--hue model.depth: not a varying config key" in bad.output
    mismatch = invoke("plot", str(tf), "-o", str(tmp_path / "g.png"), "--format", "pdf")
    assert mismatch.exit_code == 2 and "must end in .pdf" in mismatch.output


def test_the_phase_diagram_follows_the_metric(tf, tmp_path):
    from normexp.figures import phase_figure

    tidy = load_metrics(tf, all_config=True)
    fig = phase_figure(tidy, "optim.lr", "schedule.warmup_steps", "val_acc")
    assert "held-out accuracy" in " ".join(fig.get_suptitle().split())
    bar = [ax for ax in fig.axes if "held-out accuracy" in ax.get_ylabel()]
    assert bar, [ax.get_ylabel() for ax in fig.axes]
    finals = tidy.sort_values("step").groupby("run_id").tail(1)
    pre = finals[(finals["norm.placement"] == "pre") & (finals["optim.lr"] == 0.01)
                 & (finals["schedule.warmup_steps"] == 0)]["val_acc"].mean()
    panel = next(ax for ax in fig.axes if ax.get_title().startswith("Pre"))
    assert panel.get_images()[0].get_array()[0, 0] == pytest.approx(pre)
    result = invoke("plot", str(tf), "--metric", "val_loss", "-o", str(tmp_path / "v.png"))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "v-phase.png").exists()


def test_the_phase_diagram_borders_the_trained_region(grid):
    from normexp.figures import TRAINED_EDGE, phase_figure

    fig = phase_figure(load_metrics(grid, all_config=True), "optim.lr", "schedule.warmup_steps",
                       trained_below=100)  # every run trained: each panel's whole grid is bordered
    panel = next(ax for ax in fig.axes if ax.get_title().startswith("Post-LN"))
    edges = [line for line in panel.get_lines() if line.get_color() == TRAINED_EDGE]
    assert len(edges) == 2 * 3 + 2 * 2  # the 3 x 2 grid's perimeter


def test_the_trained_fraction_figure_counts_each_placement_and_kind(grid):
    from normexp.figures import trained_fraction_figure

    summary = load_summary(grid)
    fig = trained_fraction_figure(summary, trained_below=100)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts == ["12/12"] * 4  # 2 placements x 2 kinds, each 3 lrs x 2 warmups x 2 seeds, all under 100


# ----------------------------------------------------------------------------- several sweeps


def test_report_and_plot_compare_two_sweeps_side_by_side(tf, tmp_path):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tf, other)  # the same configs: the sweep key keeps them two runs each, never one mean
    result = invoke("report", str(tf), str(other), "--by", "sweep,norm.placement", "--format", "csv")
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.output)))
    assert {(r["sweep"], r["norm.placement"]) for r in rows} == {("out", "post"), ("out", "pre"), ("other", "post"),
                                                                  ("other", "pre")}
    assert {r["runs"] for r in rows} == {"4"}  # each sweep's 4 runs of a placement, not 8
    plot = invoke("plot", str(tf), str(other), "-o", str(tmp_path / "c.png"), "--dpi", "50")
    assert plot.exit_code == 0, plot.output
    assert (tmp_path / "c.png").exists() and (tmp_path / "c-phase.png").exists()
    twice = invoke("report", str(tf), str(tf))
    assert twice.exit_code == 2 and "given twice" in twice.output


def test_two_sweeps_with_different_trained_rules_are_never_judged_by_the_first_ones(tmp_path):
    small = FFN.replace("  norm.kind: [layernorm, rmsnorm]\n  optim.lr: [0.01, 0.03, 0.1]\n", "").replace(
        "seeds: [0, 1]", "seeds: [0]")
    folders = []
    for name, text in (("loose", small + "report: {trained_below: 100}\n"), ("plain", small)):
        config, out = tmp_path / f"{name}.yaml", tmp_path / name
        config.write_text(text)
        assert invoke("sweep", str(config), "--out", str(out), "--engine", "batched", "--quiet").exit_code == 0
        folders.append(str(out))
    for command in ("report", "plot"):  # plain's runs (loss ~2.3) would read "trained" under loose's rule
        result = invoke(command, *folders)
        assert result.exit_code == 2, result.output
        assert "different rules" in result.output and "loose: 100.0, plain: ln(C)/10" in result.output
    result = invoke("report", *folders, "--format", "csv", "--trained-below", "0.5")
    assert result.exit_code == 0, result.output
    assert {r["threshold"] for r in csv.DictReader(io.StringIO(result.output))} == {"0.5"}


def test_a_panel_of_a_sweep_alone_is_titled_by_its_name_without_a_dangling_colon():
    from normexp.figures.facets import panel_title

    assert panel_title(["sweep"], ("t1",)) == "t1"  # was "t1:", then " (n=18)" after it
    assert panel_title(["sweep", "norm.placement"], ("t1", "pre")) == "t1: Pre"
    assert panel_title(["norm.placement"], ("pre",)) == "Pre"


def test_missing_runs_of_two_sweeps_name_the_folder_to_verify(tf, tmp_path):
    """It read '(normexp verify out + other)': the stacked label, no folder."""
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tf, other)
    shutil.rmtree(next(p for p in other.iterdir() if (p / "done.json").is_file()))
    result = invoke("report", str(tf), str(other), "--format", "markdown")
    assert result.exit_code == 1, result.output
    assert f"(normexp verify {other})" in result.output and " + " not in result.output


def test_a_blown_up_run_clips_the_shared_loss_axis_and_says_so(tmp_path_factory):
    """A run whose loss reaches ~1e7 would squash every other curve into one line on the shared log axis:
    the axis ends at BLOWUP_FACTOR x the larger of chance and the first step's loss, the legend says so."""
    from normexp.figures import BLOWUP_FACTOR, curves_figure
    from normexp.results import as_folder

    out = sweep(tmp_path_factory, "blowup", FFN.replace("train: {steps: 3}", "train: {steps: 4}"),
                "--set", "optim.lr=0.01,1000", "--set", "norm.kind=layernorm", "--set", "schedule.warmup_steps=0")
    tidy = as_folder(out).metrics(all_config=True)
    assert tidy["loss"].max() > 1e3  # the premise: lr 1000 blows the loss up
    fig = curves_figure(tidy, ["norm.placement", "optim.lr"])
    top = BLOWUP_FACTOR * max(tidy.loc[tidy["step"] == 0, "loss"].max(), math.log(10))
    assert all(ax.get_ylim()[1] == pytest.approx(top) for ax in fig.axes if ax.get_visible() and ax.lines)
    labels = [text.get_text() for legend in fig.legends for text in legend.get_texts()]
    assert any(label.startswith(f"axis clipped at {top:.3g}") for label in labels), labels
    calm = curves_figure(tidy[tidy["optim.lr"] == 0.01], ["norm.placement"])
    assert not any("clipped" in text.get_text() for legend in calm.legends for text in legend.get_texts())



def test_a_grid_key_that_takes_null_gets_its_own_line(tmp_path_factory):
    """A null in the grid (train.log_sharpness: [null, 2]) is NaN in the frame, and NaN is not equal to
    itself: the line's style, keyed by it, was never found again (KeyError: (nan,))."""
    from normexp.figures import curves_figure
    from normexp.results import as_folder

    out = sweep(tmp_path_factory, "nullkey", FFN, "--set", "norm.kind=layernorm", "--set", "norm.placement=pre",
                "--set", "train.log_sharpness=null,2")
    tidy = as_folder(out).metrics(all_config=True)
    assert tidy["train.log_sharpness"].isna().any()  # the premise: the null arm reads as NaN
    fig = curves_figure(tidy, ["train.log_sharpness"])
    labels = [text.get_text() for legend in fig.legends for text in legend.get_texts()]
    assert any(label.startswith("null") for label in labels) and any(label.startswith("2") for label in labels)
    assert sum(len(ax.lines) for ax in fig.axes) >= 2

# ----------------------------------------------------------------------------- labels of the keys


def test_every_run_key_has_its_own_label_that_names_what_varies():
    from normexp.config import GENERIC_LEAVES, key_label, run_keys

    labels = {key: key_label(key) for key in run_keys()}
    # no two keys share a label, and no label is a bare generic leaf (`name`, `kind`) that names no section
    assert len(set(labels.values())) == len(labels), labels
    assert not set(labels.values()) & set(GENERIC_LEAVES)
    assert labels["optim.name"] == "optim" and labels["schedule.kind"] == "schedule"
    assert labels["optim.eps"] == "optim.eps" and labels["norm.eps"] == "norm.eps"  # two sections share `eps`


def test_a_grid_over_the_optimizer_reads_optim_equals_in_the_report(tmp_path):
    from normexp.analysis.variants import variant_label
    from normexp.report import build_report, to_markdown

    assert variant_label({"optim.name": "adam", "schedule.kind": "cosine"}) == "optim=adam schedule=cosine"
    folder = tmp_path / "o"
    sweep = build_sweep({"name": "o", "base": {"model": {"depth": 2, "width": 4}, "train": {"steps": 2}},
                         "grid": {"optim.name": ["adam", "sgd"]}})
    folder.mkdir()
    (folder / SWEEP_FILE).write_text(sweep.to_yaml())
    for cfg in sweep.runs:
        metrics = {"step": [0, 1, 2], "loss": [2.0, 1.0, 0.5], "acc": [0.1] * 3, "lr": [0.01] * 3,
                   "grad_norm": [1.0] * 3}
        write_run(folder / run_id(cfg), cfg, FinishedRun(metrics, "completed", 0.1, 1, "reference", "cpu"))
    text = to_markdown(build_report(folder))
    assert "optim=adam" in text and "optim=sgd" in text and "name=" not in text
