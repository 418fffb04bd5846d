"""sharpness.csv in the run folder (`train.log_sharpness`): written with the metrics, vouched for by done.json and
checked like blocks.csv, read back by `load_sharpness`, exported as `sharpness/*` scalars and drawn against its
thresholds (normexp/figures/sharpness.py). The measurement itself: tests/test_sharpness.py."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import pandas as pd
import pytest
from typer.testing import CliRunner

from normexp.cli import app
from normexp.config import build_sweep
from normexp.folder import DONE_FILE, SHARPNESS_FILE, FinishedRun, inspect_run, run_id, write_run
from normexp.folder.layout import read_json
from normexp.results import _EXACT, ResultsError, load_metrics, load_sharpness
from normexp.sharpness import SHARPNESS_COLUMNS

runner = CliRunner()

SHARP = """\
name: sharp
base:
  model: {depth: 3, width: 8}
  data: {n_samples: 16}
  optim: {name: adam, lr: 0.01}
  train: {steps: 4, threads: 1}
grid:
  norm.placement: [post, pre]
  train.log_sharpness: [null, 2]
seeds: [0]
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharp") / "out"
    path = out.parent / "sweep.yaml"
    path.write_text(SHARP)
    result = runner.invoke(app, ["sweep", str(path), "--out", str(out), "-q"])
    assert result.exit_code == 0, result.output
    return out


def _measured(out):
    return sorted(p for p in out.iterdir() if (p / SHARPNESS_FILE).is_file())


def test_only_runs_that_measure_write_it_and_done_json_vouches_for_it(folder):
    runs = sorted(p for p in folder.iterdir() if (p / DONE_FILE).is_file())
    measured = _measured(folder)
    assert len(runs) == 4 and len(measured) == 2
    for run in runs:
        files = read_json(run / DONE_FILE)["files"]
        assert (SHARPNESS_FILE in files) == (run in measured)
    text = (measured[0] / SHARPNESS_FILE).read_text()
    assert text.splitlines()[0] == ",".join(SHARPNESS_COLUMNS)
    assert [line.split(",")[0] for line in text.splitlines()[1:]] == ["0", "2", "4"]
    assert text.splitlines()[1].split(",")[2] == "nan"  # no second moment before the first update


def test_load_sharpness_returns_the_files_rows(folder):
    tidy = load_sharpness(folder)
    assert set(tidy["run_id"]) == {p.name for p in _measured(folder)}
    assert {"norm.placement", "seed", "status"} <= set(tidy.columns)
    for rid, rows in tidy.groupby("run_id"):
        written = pd.read_csv(folder / rid / SHARPNESS_FILE, **_EXACT)
        pd.testing.assert_frame_equal(rows[list(SHARPNESS_COLUMNS)].reset_index(drop=True), written)
    assert tidy["precond_lambda_max"].isna().sum() == 2 and (tidy["lambda_max"] > 0).all()


def test_load_sharpness_says_when_no_run_measured(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(SHARP.replace("  train.log_sharpness: [null, 2]\n", ""))
    assert runner.invoke(app, ["sweep", str(path), "--out", str(tmp_path / "o"), "-q"]).exit_code == 0
    with pytest.raises(ResultsError, match="train.log_sharpness"):
        load_sharpness(tmp_path / "o")
    result = runner.invoke(app, ["plot", str(tmp_path / "o"), "--sharpness"])
    assert result.exit_code == 2 and "train.log_sharpness" in result.output
    assert not (tmp_path / "o" / "sharpness.png").exists()


@pytest.mark.parametrize("damage", ["edit", "truncate", "remove"])
def test_a_damaged_sharpness_csv_makes_the_run_corrupt(folder, tmp_path, damage):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    victim = _measured(copy)[0] / SHARPNESS_FILE
    text = victim.read_text()
    if damage == "edit":
        victim.write_text(text.replace(",", ";", 1))
    elif damage == "truncate":
        victim.write_text(text.rsplit("\n", 2)[0] + "\n")
    else:
        victim.unlink()
    state = inspect_run(victim.parent)
    assert state.kind == "corrupt" and SHARPNESS_FILE in state.problem
    metrics = load_metrics(copy)
    assert metrics.attrs["unfinished"] == {victim.parent.name: "corrupt"}
    assert victim.parent.name not in set(load_sharpness(copy)["run_id"])
    assert runner.invoke(app, ["verify", str(copy)]).exit_code != 0


def test_nan_and_inf_round_trip_through_the_folder(tmp_path):
    cfg = build_sweep({"name": "x", "base": {"model": {"depth": 2, "width": 8},
                                             "train": {"steps": 1, "log_sharpness": 1}}}).runs[0]
    sharpness = {"step": [0, 1], "lambda_max": [3.5, math.nan], "precond_lambda_max": [math.nan, 1e300],
                 "lr": [0.0, 0.1], "threshold_gd": [math.inf, 20.0], "threshold_adam": [math.inf, 380.0]}
    metrics = {"step": [0, 1], "loss": [1.0, 0.5], "acc": [0.0, 1.0], "lr": [0.0, 0.1], "grad_norm": [1.0, 1.0]}
    run = tmp_path / run_id(cfg)
    write_run(run, cfg, FinishedRun(metrics, "completed", 0.1, 1, "reference", "cpu", sharpness=sharpness))
    assert inspect_run(run, cfg).kind == "finished"
    back = pd.read_csv(run / SHARPNESS_FILE, **_EXACT)
    assert back["threshold_gd"].tolist()[0] == math.inf and math.isnan(back["lambda_max"][1])
    assert back["precond_lambda_max"][1] == 1e300 and back["step"].tolist() == [0, 1]


def test_exported_scalars_carry_the_finite_sharpness_values(folder):
    from normexp.export import read_runs

    _, runs = read_runs(folder)
    for run in runs:
        scalars = run.scalars()
        sharp = {name: points for name, points in scalars.items() if name.startswith("sharpness/")}
        if not (folder / run.run_id / SHARPNESS_FILE).is_file():
            assert not sharp
            continue
        rows = pd.read_csv(folder / run.run_id / SHARPNESS_FILE, **_EXACT)
        assert set(sharp) == {f"sharpness/{c}" for c in SHARPNESS_COLUMNS if c != "step"}
        assert sharp["sharpness/lambda_max"] == list(zip(rows["step"], rows["lambda_max"]))
        assert sharp["sharpness/precond_lambda_max"] == [(2, rows["precond_lambda_max"][1]),
                                                         (4, rows["precond_lambda_max"][2])]  # step 0's nan left out


def test_tensorboard_export_has_the_sharpness_tags(folder, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = runner.invoke(app, ["export", str(folder), str(tmp_path / "tb"), "--to", "tensorboard"])
    assert result.exit_code == 0, result.output
    run = _measured(folder)[0]
    from normexp.export.tensorboard import exported_folders

    acc = EventAccumulator(str(tmp_path / "tb" / exported_folders(tmp_path / "tb")[run.name]),
                           size_guidance={"scalars": 0})
    acc.Reload()
    assert "sharpness/lambda_max" in acc.Tags()["scalars"]
    assert [e.step for e in acc.Scalars("sharpness/threshold_gd")] == [0, 2, 4]


def test_the_figure_draws_one_panel_per_variant_with_its_thresholds(folder):
    from normexp.figures import sharpness_figure

    tidy = load_sharpness(folder, all_config=True)
    fig = sharpness_figure(tidy, ["norm.placement"])
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == 2
    for ax in panels:
        assert ax.get_yscale() == "log"
        labels = [line.get_label() for line in ax.get_lines()]
        assert {"λ_max", "2/lr", "preconditioned λ_max"} <= set(labels)
        gd = next(line for line in ax.get_lines() if line.get_label() == "2/lr")
        assert list(gd.get_ydata()) == pytest.approx([2 / 0.01] * 3)
    plt.close(fig)


def test_plot_draws_sharpness_with_the_others_and_alone(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(SHARP.replace("  train.log_sharpness: [null, 2]\n", "").replace("threads: 1", "threads: 1, "
                                                                                      "log_sharpness: 2"))
    folder = tmp_path / "o"
    assert runner.invoke(app, ["sweep", str(path), "--out", str(folder), "-q"]).exit_code == 0
    result = runner.invoke(app, ["plot", str(folder)])
    assert result.exit_code == 0, result.output
    assert (folder / "sharpness.png").stat().st_size > 10_000
    result = runner.invoke(app, ["plot", str(folder), "--sharpness", "-o", str(tmp_path / "s.svg")])
    assert result.exit_code == 0 and (tmp_path / "s.svg").is_file(), result.output
    result = runner.invoke(app, ["plot", str(folder), "--sharpness", "--blocks"])
    assert result.exit_code == 2
