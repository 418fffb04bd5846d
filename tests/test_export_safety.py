"""`normexp export` where things go wrong: two folders of one sweep exported into one MLflow experiment,
an export stopped half-way, a tracking server that is down, a deleted experiment, a plug-in that is not
installed, a run that no longer verifies. What another folder exported is never touched, what is replaced
or removed is named, and every refusal is one line, exit 2, before anything is written."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import REPO, batched_sweep, run_folders
from typer.testing import CliRunner

from normexp.cli import app
from normexp.config import build_sweep, parse_yaml
from normexp.export.tensorboard import exported_folders
from normexp.folder import METRICS_FILE, FinishedRun, write_run
from normexp.folder.layout import read_json
from normexp.registry import load_plugin
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
  optim.lr: [0.1, 0.01]
"""


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return batched_sweep(tmp_path_factory, TINY)


@pytest.fixture
def folder(pristine, tmp_path) -> Path:
    shutil.copytree(pristine, tmp_path / "tiny")
    return tmp_path / "tiny"


def _rerun(run: Path, shift: float) -> None:
    """Rewrite a run folder as a --force rerun with another result would (its loss shifted)."""
    cfg = build_sweep({"name": "x", "base": parse_yaml((run / "config.yaml").read_text())}).runs[0]
    with open(run / METRICS_FILE) as f:
        header, *lines = f.read().split()
    columns = header.split(",")
    rows = [dict(zip(columns, line.split(","))) for line in lines]
    metrics = {c: [int(r[c]) if c == "step" else float(r[c]) + (shift if c == "loss" else 0) for r in rows]
               for c in columns}
    write_run(run, cfg, FinishedRun(metrics, "completed", 0.1, 1, "batched", "cpu"))


def _exported(client) -> list:
    """The experiment's MLflow runs of normexp runs (not the folders' parent runs)."""
    experiment = client.get_experiment_by_name("tiny")
    return [r for r in client.search_runs([experiment.experiment_id], max_results=1000)
            if "normexp.run_id" in r.data.tags]


def test_an_export_never_deletes_another_folders_mlflow_runs(folder, tmp_path, mlflow_store):
    """The README's runs/warmup, then runs/seeds, of one sweep name and overlapping run ids: the second
    export deleted every run of the first whose result differed. Idempotence is per folder and run."""
    uri, client = mlflow_store
    other = tmp_path / "seeds"
    shutil.copytree(folder, other)
    changed = run_folders(other)[0]
    _rerun(changed, 1.0)
    assert runner.invoke(app, ["export", str(folder), uri, "--to", "mlflow"]).exit_code == 0
    first = {r.info.run_id: r.data.tags["normexp.done_checksum"] for r in _exported(client)}
    result = runner.invoke(app, ["export", str(other), uri, "--to", "mlflow"])
    assert result.exit_code == 0 and "4 runs exported" in result.output and "replaced" not in result.output
    found = _exported(client)
    assert first.items() <= {r.info.run_id: r.data.tags["normexp.done_checksum"] for r in found}.items()
    assert sorted(r.data.tags["normexp.folder"] for r in found) == sorted([str(folder.resolve())] * 4
                                                                          + [str(other.resolve())] * 4)
    again = runner.invoke(app, ["export", str(folder), uri, "--to", "mlflow"])  # each folder: its own runs
    assert "0 runs exported" in again.output and "4 already there" in again.output, again.output
    _rerun(changed, 2.0)
    result = runner.invoke(app, ["export", str(other), uri, "--to", "mlflow"])
    assert "1 run exported" in result.output and "3 already there" in result.output, result.output
    assert f"replaced this folder's earlier export of 1 run: {changed.name} (its result changed)" in result.output
    found = _exported(client)
    assert len(found) == 8 and first.keys() <= {r.info.run_id for r in found}


@pytest.mark.process
def test_an_export_stopped_half_way_is_finished_by_the_next(folder, tmp_path, mlflow_store):
    """A stop signal while an MLflow run is written left it orphaned (no normexp tag, never removed). Now
    the export stops in one line, and the next one replaces the half-made run and names it."""
    uri, client = mlflow_store
    script = textwrap.dedent(f"""
        import os, signal, sys
        from mlflow.tracking import MlflowClient
        calls = []
        real = MlflowClient.log_batch
        def log_batch(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 5:  # the second run's params are in, its metrics are not
                os.kill(os.getpid(), signal.SIGINT)
            return real(self, *args, **kwargs)
        MlflowClient.log_batch = log_batch
        sys.argv = ["normexp", "export", {str(folder)!r}, {uri!r}, "--to", "mlflow"]
        from normexp.__main__ import main
        main()
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 128 + signal.SIGINT, done.stderr
    assert done.stderr.strip().splitlines() == [
        "interrupted: export stopped after 1 of 4 runs; the same command finishes it (a run left half-written "
        "is replaced)"], done.stderr
    assert len(_exported(client)) == 2  # the first run, and the half-made second
    result = runner.invoke(app, ["export", str(folder), uri, "--to", "mlflow"])
    assert "3 runs exported" in result.output and "1 already there" in result.output, result.output
    assert "(left unfinished by an interrupted export)" in result.output
    found = _exported(client)
    assert len(found) == 4 and {r.info.status for r in found} == {"FINISHED"}
    assert sorted(r.data.tags["normexp.run_id"] for r in found) == [r.name for r in run_folders(folder)]


def test_an_unreachable_tracking_server_is_one_line_in_bounded_time(folder, monkeypatch):
    """A closed port: 4 minutes of MLflow's retries, then a 452-line traceback. Now 3 tries (about 3 s for
    a refused connection) and one line, exit 2."""
    pytest.importorskip("mlflow")
    for name in ("MAX_RETRIES", "BACKOFF_FACTOR", "TIMEOUT"):
        monkeypatch.delenv(f"MLFLOW_HTTP_REQUEST_{name}", raising=False)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    result = runner.invoke(app, ["export", str(folder), f"http://127.0.0.1:{port}", "--to", "mlflow"])
    assert time.monotonic() - start < 60  # MLflow's own retries: ~4 minutes
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        f"error: MLflow at http://127.0.0.1:{port}: cannot reach the tracking server (connection refused; 3 tries "
        "of at most 20 s each: MLFLOW_HTTP_REQUEST_MAX_RETRIES and MLFLOW_HTTP_REQUEST_TIMEOUT to change)"]
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ  # set for the export only


def test_a_database_mlflow_cannot_open_is_one_line_at_once(folder, tmp_path):
    """A `sqlite:///` path that is a folder, a file that is not a database, or a database in a folder that
    cannot be written: MLflow retried opening it for about 100 s, then printed a traceback (exit 1)."""
    pytest.importorskip("mlflow")
    (tmp_path / "folder.db").mkdir()
    (tmp_path / "notes.db").write_text("not a database\n")
    cases = {"folder.db": "is a folder, not a database file", "notes.db": "is not an SQLite database"}
    if os.geteuid() != 0:  # root writes whatever the permissions say
        (tmp_path / "locked").mkdir(mode=0o555)
        cases["locked/mlflow.db"] = "cannot write"
    for path, says in cases.items():
        uri = f"sqlite:///{tmp_path / path}"
        start = time.monotonic()
        result = runner.invoke(app, ["export", str(folder), uri, "--to", "mlflow"])
        assert time.monotonic() - start < 30
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: MLflow at {uri}: ") and says in lines[0], lines
    assert (tmp_path / "notes.db").read_text() == "not a database\n"


def test_a_deleted_experiment_is_one_line_and_not_restored(folder, mlflow_store):
    uri, client = mlflow_store
    assert runner.invoke(app, ["export", str(folder), uri, "--to", "mlflow"]).exit_code == 0
    experiment = client.get_experiment_by_name("tiny")
    client.delete_experiment(experiment.experiment_id)
    result = runner.invoke(app, ["export", str(folder), uri, "--to", "mlflow"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1
    assert f"experiment 'tiny' (id {experiment.experiment_id}) is deleted" in result.output
    assert f"mlflow experiments restore --experiment-id {experiment.experiment_id}" in result.output
    assert client.get_experiment(experiment.experiment_id).lifecycle_stage == "deleted"
    other = runner.invoke(app, ["export", str(folder), uri, "--to", "mlflow", "--experiment", "tiny2"])
    assert other.exit_code == 0 and "4 runs exported" in other.output


PLUGIN = '''
class Halfway:
    stackable = True

    @staticmethod
    def build(block, norm):
        block.norm = norm()

    @staticmethod
    def forward(block, x):
        return x + block.norm(x + block.branch(x)) / 2
'''


@pytest.mark.parametrize("target", ["tensorboard", "mlflow"])
def test_runs_of_a_plugin_not_installed_are_named_before_anything_is_written(tmp_path, monkeypatch, target):
    """It exported everything, then failed with exit 2 and a sweep.yaml that 'cannot be read back'."""
    pytest.importorskip(target)
    package = tmp_path / "package"
    package.mkdir()
    (package / "exportnorms.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(package))
    out = tmp_path / "plug"
    run_sweep(build_sweep(parse_yaml(TINY.replace("[pre, post]", "[pre, 'exportnorms:Halfway']"))), out,
              SweepOptions(engine="batched"))
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(package)])
    monkeypatch.delitem(sys.modules, "exportnorms")
    load_plugin.cache_clear()
    dest = tmp_path / "dest"
    result = runner.invoke(app, ["export", str(out), str(dest) if target == "tensorboard" else dest.as_uri(),
                                 "--to", target])
    load_plugin.cache_clear()
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    plugged = sorted(r.name for r in run_folders(out) if r.name.startswith("ext_"))
    assert len(plugged) == 2 and all(rid in result.output for rid in plugged)
    assert not any(r.name in result.output for r in run_folders(out) if r.name not in plugged)
    assert "exportnorms:Halfway, which is not installed" in result.output and "nothing written" in result.output
    assert not dest.exists()


def test_experiment_is_refused_where_it_means_nothing_or_is_empty(folder, tmp_path):
    """--experiment was ignored for TensorBoard, and '' silently meant the sweep's name for MLflow."""
    result = runner.invoke(app, ["export", str(folder), str(tmp_path / "tb"), "--experiment", "x"])
    assert result.exit_code == 2 and "--experiment: only --to mlflow" in result.output
    assert not (tmp_path / "tb").exists()
    for empty in ("", " "):
        result = runner.invoke(app, ["export", str(folder), (tmp_path / "ml").as_uri(), "--to", "mlflow",
                                     "--experiment", empty])
        assert result.exit_code == 2 and "--experiment: empty" in result.output, result.output
        assert not (tmp_path / "ml").exists()


def _damage(run: Path) -> None:
    data = bytearray((run / METRICS_FILE).read_bytes())
    data[-3] = ord("7") if data[-3] != ord("7") else ord("3")
    (run / METRICS_FILE).write_bytes(bytes(data))


def test_a_run_that_no_longer_verifies_loses_its_tensorboard_copy(folder, tmp_path):
    pytest.importorskip("tensorboard")
    tb = tmp_path / "tb"
    assert runner.invoke(app, ["export", str(folder), str(tb)]).exit_code == 0
    damaged = run_folders(folder)[1]
    _damage(damaged)
    (tb / "notes.txt").write_text("the user's")
    folders = exported_folders(tb)
    result = runner.invoke(app, ["export", str(folder), str(tb)])
    assert result.exit_code == 1 and "3 runs exported" in result.output
    assert (f"removed this folder's earlier export of 1 run that no longer verifies: {damaged.name}"
            in result.output), result.output
    assert not (tb / folders[damaged.name]).exists() and (tb / "notes.txt").is_file()
    assert sorted(p.name for p in tb.iterdir() if p.is_dir()) == sorted(folders[r.name] for r in run_folders(folder)
                                                                       if r != damaged)


def test_a_run_that_no_longer_verifies_elsewhere_keeps_another_folders_tensorboard_copy(folder, tmp_path):
    """Two folders share run ids (`runs/warmup` and `runs/seeds`): exporting the one whose copy of a run is
    corrupt removed the other's event file of it, though that run still verifies in its own folder."""
    pytest.importorskip("tensorboard")
    tb = tmp_path / "tb"
    assert runner.invoke(app, ["export", str(folder), str(tb)]).exit_code == 0
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    damaged = run_folders(other)[1]
    _damage(damaged)
    folders = exported_folders(tb)
    result = runner.invoke(app, ["export", str(other), str(tb)])
    assert result.exit_code == 1 and "removed" not in result.output, result.output
    assert (tb / folders[damaged.name] / "events.out.tfevents.normexp").is_file()
    assert exported_folders(tb) == folders
    _damage(run_folders(folder)[1])  # now corrupt in the folder that exported it too: its copy goes
    result = runner.invoke(app, ["export", str(folder), str(tb)])
    assert f"no longer verifies: {damaged.name}" in result.output, result.output
    assert not (tb / folders[damaged.name]).exists()
    shutil.copytree(folder, tmp_path / "again")
    assert runner.invoke(app, ["export", str(tmp_path / "again"), str(tb)]).exit_code == 1  # the others' exports
    shutil.rmtree(folder)  # a folder moved away: its copies are the moved folder's to drop
    shutil.move(tmp_path / "other", folder)
    result = runner.invoke(app, ["export", str(folder), str(tb)])
    assert f"no longer verifies: {damaged.name}" not in result.output  # not exported since: nothing to drop
    moved = run_folders(folder)[2]
    _damage(moved)
    shutil.rmtree(tmp_path / "again")
    result = runner.invoke(app, ["export", str(folder), str(tb)])
    assert f"no longer verifies: {moved.name}" in result.output, result.output


def test_a_run_that_no_longer_verifies_loses_its_mlflow_copy_of_this_folder_only(folder, tmp_path, mlflow_store):
    uri, client = mlflow_store
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    for source in (folder, other):
        assert runner.invoke(app, ["export", str(source), uri, "--to", "mlflow"]).exit_code == 0
    damaged = run_folders(folder)[2]
    _damage(damaged)
    assert read_json(damaged / "done.json")  # the marker is there; the files it vouches for are not
    result = runner.invoke(app, ["export", str(folder), uri, "--to", "mlflow"])
    assert result.exit_code == 1 and "0 runs exported" in result.output and "3 already there" in result.output
    assert f"no longer verifies: {damaged.name}" in result.output, result.output
    left = [(r.data.tags["normexp.folder"], r.data.tags["normexp.run_id"]) for r in _exported(client)]
    assert (str(folder.resolve()), damaged.name) not in left and (str(other.resolve()), damaged.name) in left
    assert len(left) == 7
