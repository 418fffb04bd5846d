"""`normexp export` (normexp/export/): a sweep read back from MLflow (its client's search_runs and metric history),
every value compared with the run folders."""

from __future__ import annotations

import builtins
import csv
import json
import math
import shlex
from pathlib import Path

import pytest
from conftest import batched_sweep, run_folders
from typer.testing import CliRunner

from normexp.cli import app
from normexp.config import build_sweep, chance_classes, flatten, parse_yaml, trained_threshold
from normexp.export.tensorboard import exported_folders
from normexp.folder import BLOCKS_FILE, METRICS_FILE, FinishedRun, write_run
from normexp.folder.layout import read_json
from normexp.sweep import SweepOptions, run_sweep

runner = CliRunner()

TINY = """\
name: tiny
base:
  model: {depth: 2, width: 8}
  data: {n_samples: 16}
  optim: {name: sgd}
  train: {steps: 4, threads: 1}
grid:
  norm.placement: [pre, post]
  optim.lr: [0.1, 1.0e+8]
  train.log_blocks: [false, true]
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return batched_sweep(tmp_path_factory, TINY)


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _expected(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar the export must hold for a run folder, read from its files alone."""
    rows = _rows(run / METRICS_FILE)
    series = {c: [(int(r["step"]), float(r[c])) for r in rows] for c in rows[0] if c != "step"}
    if (run / BLOCKS_FILE).is_file():
        for r in _rows(run / BLOCKS_FILE):
            for c in r:
                if c not in ("step", "block"):
                    series.setdefault(f"blocks/{c}/{int(r['block']):02d}", []).append((int(r["step"]), float(r[c])))
    done = read_json(run / "done.json")
    cfg = build_sweep({"name": "x", "base": parse_yaml((run / "config.yaml").read_text())}).runs[0]
    trained = done["status"] == "completed" and done["final_loss"] < trained_threshold(chance_classes(cfg))
    last = int(rows[-1]["step"])
    final = {"final_loss": done["final_loss"], "min_loss": done["min_loss"], "final_acc": done["final_acc"],
             "diverged": float(done["diverged"]), "trained": float(trained)}
    return {**series, **{f"final/{k}": [(last, float(v))] for k, v in final.items()}}


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@pytest.mark.parametrize("store", ["file", pytest.param("sqlite", marks=pytest.mark.slow)])  # sqlite: ~20 s
def test_mlflow_export_reads_back_value_for_value_and_is_idempotent(folder, tmp_path, store, monkeypatch):
    pytest.importorskip("mlflow")
    import mlflow
    from mlflow.tracking import MlflowClient

    if store == "sqlite":
        pytest.importorskip("sqlalchemy")

    if store == "sqlite":
        pytest.importorskip("sqlalchemy")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}" if store == "sqlite" else (tmp_path / "mlruns").as_uri()
    result = runner.invoke(app, ["export", str(folder), uri, "--to", "mlflow"])
    assert result.exit_code == 0 and "8 runs exported" in result.output, result.output
    viewer = f"mlflow ui --backend-store-uri {uri} (MLflow {mlflow.__version__} or newer: pip install 'mlflow>="
    assert viewer in result.output, result.output  # the store's own URI, and an MLflow that can read it
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file store only so (export sets it)
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("tiny")
    found = client.search_runs([experiment.experiment_id])
    (parent,) = [r for r in found if "normexp.run_id" not in r.data.tags]
    by_id = {r.data.tags["normexp.run_id"]: r for r in found if r is not parent}
    assert sorted(by_id) == [r.name for r in run_folders(folder)]
    assert parent.info.run_name == "tiny" and parent.data.tags["normexp.folder"] == str(folder.resolve())
    assert sorted(a.path for a in client.list_artifacts(parent.info.run_id)) == ["summary.csv", "sweep.yaml"]
    for run in run_folders(folder):
        exported, done = by_id[run.name], read_json(run / "done.json")
        flat = flatten(build_sweep({"name": "x", "base": parse_yaml((run / "config.yaml").read_text())}).runs[0])
        assert exported.data.params == {k: str("None" if v is None else json.dumps(list(v))
                                                if isinstance(v, (list, tuple)) else v) for k, v in flat.items()}
        assert exported.info.run_name == (f"{flat['norm.placement']}-lr{flat['optim.lr']:g}-log_blocks="
                                          f"{str(flat['train.log_blocks']).lower()}-s{flat['seed']}")  # the axes
        tags = exported.data.tags
        assert (tags["normexp.sweep"], tags["normexp.engine"], tags["normexp.status"]) == (
            "tiny", done["engine"], done["status"])
        assert tags["normexp.provenance.command"] == done["provenance"]["command"]
        assert tags["normexp.trained"] == str(_expected(run)["final/trained"][0][1] == 1.0).lower()
        assert tags["mlflow.parentRunId"] == parent.info.run_id
        assert tags["normexp.mlflow_version"] == mlflow.__version__
        assert sorted(a.path for a in client.list_artifacts(exported.info.run_id)) == ["config.yaml", "metrics.csv"]
        for name in ("config.yaml", "metrics.csv"):
            local = client.download_artifacts(exported.info.run_id, name, str(tmp_path / "down" / run.name))
            assert Path(local).read_bytes() == (run / name).read_bytes(), name
        expected = _expected(run)
        assert sorted(exported.data.metrics) == sorted(expected)
        for key, points in expected.items():
            history = sorted(client.get_metric_history(exported.info.run_id, key), key=lambda m: m.step)
            assert [m.step for m in history] == [s for s, _ in points], key
            for m, (_, value) in zip(history, points):  # float64 as written; the SQL store clips +-inf
                clipped = store == "sqlite" and math.isinf(value)
                assert _same(m.value, math.copysign(1.7976931348623157e308, value) if clipped else value), key
    again = runner.invoke(app, ["export", str(folder), uri, "--to", "mlflow"])
    assert "0 runs exported" in again.output and "8 already there" in again.output
    after = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_id for r in after) == sorted(r.info.run_id for r in found)  # the parent kept too
    assert all(len(client.list_artifacts(r.info.run_id)) == 2 for r in found)  # none logged twice


@pytest.mark.slow  # MLflow's SQL store, twice: ~10 s
def test_a_changed_run_replaces_its_mlflow_run(folder, tmp_path):
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    import shutil

    from mlflow.tracking import MlflowClient

    from normexp.export.mlflow import to_mlflow

    copy = tmp_path / "tiny"
    shutil.copytree(folder, copy)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert len(to_mlflow(copy, uri).exported) == 8
    run = next(r for r in run_folders(copy) if read_json(r / "done.json")["status"] == "completed"
               and not (r / BLOCKS_FILE).is_file())
    cfg = build_sweep({"name": "x", "base": parse_yaml((run / "config.yaml").read_text())}).runs[0]
    rows = _rows(run / METRICS_FILE)
    metrics = {c: [int(r[c]) if c == "step" else float(r[c]) + (c == "loss") for r in rows] for c in rows[0]}
    write_run(run, cfg, FinishedRun(metrics, "completed", 0.1, 1, "batched", "cpu"))  # a --force rerun, say
    done = to_mlflow(copy, uri)
    assert done.exported == [run.name] and done.kept == 7
    assert done.replaced == {run.name: "its result changed"}
    client = MlflowClient(tracking_uri=uri)
    found = client.search_runs([client.get_experiment_by_name("tiny").experiment_id],
                               f"tags.`normexp.run_id` = '{run.name}'")
    assert len(found) == 1 and found[0].data.metrics["loss"] == metrics["loss"][-1]


@pytest.mark.parametrize(("target", "package"), [("tensorboard", "tensorboard"), ("mlflow", "mlflow")])
def test_a_missing_extra_is_named(folder, tmp_path, monkeypatch, target, package):
    real = builtins.__import__

    def without(name, *args, **kwargs):
        if name.split(".")[0] == package:
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without)
    result = runner.invoke(app, ["export", str(folder), str(tmp_path / "x"), "--to", target])
    assert result.exit_code == 2 and f"pip install 'normexp[{target}]'" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "x").exists()


def test_bad_targets_are_refused(folder, tmp_path):
    result = runner.invoke(app, ["export", str(folder), str(tmp_path / "x"), "--to", "comet"])
    assert result.exit_code == 2 and "--to" in result.output
    result = runner.invoke(app, ["export", str(tmp_path / "nowhere"), str(tmp_path / "x")])
    assert result.exit_code == 2 and "no sweep.yaml" in result.output


def test_trained_follows_the_folders_rule_as_summary_csv_does(tmp_path):
    """A sweep with report.trained_below: the exports' `final/trained` and `normexp.trained` say what
    summary.csv's `trained` says (they judged by ln(C)/10 whatever the sweep's rule)."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "ruled"
    run_sweep(build_sweep(parse_yaml(TINY.replace("  train.log_blocks: [false, true]\n", "")
                                     + "report: {trained_below: 100}\n")), out, SweepOptions(engine="batched"))
    summary = {r["run_id"]: r["trained"] for r in _rows(out / "summary.csv")}
    assert set(summary.values()) == {"True", "False"}  # lr 0.1 trains under 100, lr 1e8 diverges
    assert runner.invoke(app, ["export", str(out), str(tmp_path / "tb"), "--to", "tensorboard"]).exit_code == 0
    uri = (tmp_path / "mlruns").as_uri()
    assert runner.invoke(app, ["export", str(out), uri, "--to", "mlflow"]).exit_code == 0
    client = MlflowClient(tracking_uri=uri)
    tags = {r.data.tags["normexp.run_id"]: r.data.tags["normexp.trained"]
            for r in client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
            if "normexp.run_id" in r.data.tags}
    for rid, trained in summary.items():
        acc = EventAccumulator(str(tmp_path / "tb" / exported_folders(tmp_path / "tb")[rid]),
                               size_guidance={"scalars": 0})
        acc.Reload()
        assert acc.Scalars("result/trained")[0].value == (trained == "True"), rid
        assert tags[rid] == trained.lower(), rid


def test_a_new_trained_rule_is_exported_again_to_mlflow(tmp_path):
    """The same done.json under another report.trained_below: the re-export updates normexp.trained (it
    kept the old verdict: the checksum alone said 'already there')."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    text = TINY.replace("  train.log_blocks: [false, true]\n", "").replace("  optim.lr: [0.1, 1.0e+8]\n", "")
    out, uri = tmp_path / "rule", (tmp_path / "mlruns").as_uri()
    run_sweep(build_sweep(parse_yaml(text)), out, SweepOptions(engine="batched"))
    assert runner.invoke(app, ["export", str(out), uri, "--to", "mlflow"]).exit_code == 0
    run_sweep(build_sweep(parse_yaml(text + "report: {trained_below: 100}\n")), out, SweepOptions(engine="batched"))
    assert {r["trained"] for r in _rows(out / "summary.csv")} == {"True"}
    result = runner.invoke(app, ["export", str(out), uri, "--to", "mlflow"])
    assert result.exit_code == 0 and "2 runs exported" in result.output, result.output
    client = MlflowClient(tracking_uri=uri)
    found = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert sorted(r.data.tags["normexp.trained"] for r in found if "normexp.run_id" in r.data.tags) == ["true"] * 2


@pytest.mark.parametrize("command", [["export", "{folder}", "", "--to", "tensorboard"],
                                     ["export", "{folder}", " ", "--to", "mlflow"], ["merge", "", "{folder}"]])
def test_an_empty_destination_is_refused_not_the_current_folder(folder, tmp_path, monkeypatch, command):
    """`export DIR ""` wrote 18 run folders and an event file into the current folder; `merge "" DIR` merged
    into it (sweep --out "" is refused so)."""
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, [a.replace("{folder}", str(folder)) for a in command])
    assert result.exit_code == 2 and "empty" in result.output, result.output
    assert list(tmp_path.iterdir()) == []


def test_runs_left_out_of_an_export_are_counted_and_exit_1(folder, tmp_path):
    """A folder with a deleted run: '7 runs exported', exit 0, no word of the eighth."""
    import shutil

    copy = tmp_path / "tiny"
    shutil.copytree(folder, copy)
    shutil.rmtree(run_folders(copy)[0])
    result = runner.invoke(app, ["export", str(copy), str(tmp_path / "tb"), "--to", "tensorboard"])
    assert result.exit_code == 1, result.output
    assert "7 runs exported" in result.output and "1 run of the sweep not exported" in result.output
    assert f"normexp verify {copy}" in result.output
    assert len([p for p in (tmp_path / "tb").iterdir() if p.is_dir()]) == 7


def test_the_tensorboard_command_printed_runs_as_printed(folder, tmp_path):
    """`tensorboard --logdir my runs/tb` was printed unquoted: pasted, it names two folders."""
    pytest.importorskip("tensorboard")
    dest = tmp_path / "my runs" / "tb"
    result = runner.invoke(app, ["export", str(folder), str(dest)])
    assert result.exit_code == 0, result.output
    command = " ".join(result.output.split()).split(" · ", 1)[1]
    assert shlex.split(command) == ["tensorboard", "--logdir", str(dest)], command
