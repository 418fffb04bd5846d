"""`normexp export --to mlflow` as its users open it: a real `mlflow server` read back over its REST API (runs,
metric histories, artifacts) and its UI's page; the sweep's files on a parent run and each run's config and
metrics as artifacts; run names from `--run-name` or the keys that vary; the success line for each kind of
URI; a database written by a newer MLflow refused."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO, batched_sweep, run_folders
from typer.testing import CliRunner

from normexp.cli import app
from normexp.config import build_sweep, parse_yaml

runner = CliRunner()

GRID = """\
name: tiny
base:
  model: {depth: 2, width: 8}
  data: {n_samples: 16}
  optim: {name: sgd}
  train: {steps: 4, threads: 1}
grid:
  norm.placement: [pre, post]
  model.depth: [2, 3]
"""


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return batched_sweep(tmp_path_factory, GRID)


@pytest.fixture
def folder(pristine, tmp_path) -> Path:
    shutil.copytree(pristine, tmp_path / "tiny")
    return tmp_path / "tiny"


def _split(client) -> tuple[object, dict[str, object]]:
    """The experiment's parent run, and its normexp runs by run id."""
    found = client.search_runs([client.get_experiment_by_name("tiny").experiment_id], max_results=1000)
    parents = [r for r in found if "normexp.run_id" not in r.data.tags]
    assert len(parents) == 1, [r.data.tags for r in parents]
    return parents[0], {r.data.tags["normexp.run_id"]: r for r in found if r is not parents[0]}


def _export(folder: Path, uri: str, *more: str):
    result = runner.invoke(app, ["export", str(folder), uri, "--to", "mlflow", *more])
    assert result.exit_code == 0, result.output
    return result


def test_the_extra_installs_the_viewer_the_docs_name():
    """`pip install 'normexp[mlflow]'` gave mlflow-skinny, whose `mlflow ui` stops at `No module named
    'flask'` (it has no server, nor the UI's pages): the extra, and the dev extra, install `mlflow`."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11's

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("mlflow", "dev"):
        names = {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in extras[extra]}
        assert "mlflow" in names and "mlflow-skinny" not in names, extra


def test_run_names_name_the_varying_keys_and_follow_a_template(folder, mlflow_store):
    """Run names were `placement-kind-s<seed>-<hash>`: depth 2 and 3 differed only in the hash that the UI
    cuts off. Now the keys that vary, or `--run-name`; a re-export under another template renames the
    same MLflow runs (none made, none deleted) and run ids stay."""
    uri, client = mlflow_store
    _export(folder, uri)
    _, by_id = _split(client)
    names = {rid: r.info.run_name for rid, r in by_id.items()}
    for run in run_folders(folder):
        text = (run / "config.yaml").read_text()
        cfg = build_sweep({"name": "x", "base": parse_yaml(text)}).runs[0]
        assert names[run.name] == f"d{cfg.model.depth}-{cfg.norm.placement}-s{cfg.seed}", names  # config order
    assert len(set(names.values())) == 4
    ids = {rid: r.info.run_id for rid, r in by_id.items()}
    result = _export(folder, uri, "--run-name", "{model.depth}x{norm.placement}")
    assert "0 runs exported" in result.output and "4 already there" in result.output, result.output
    _, renamed = _split(client)
    assert {rid: r.info.run_id for rid, r in renamed.items()} == ids  # the same runs, keyed by run id
    assert sorted(r.info.run_name for r in renamed.values()) == ["2xpost", "2xpre", "3xpost", "3xpre"]
    bad = runner.invoke(app, ["export", str(folder), uri, "--to", "mlflow", "--run-name", "{depth}"])
    assert bad.exit_code == 2 and "--run-name: {depth} is not a config key" in bad.output, bad.output


def test_the_sweeps_files_are_a_parent_runs_artifacts_replaced_only_when_they_change(folder, mlflow_store, tmp_path):
    """No artifacts were logged. Now each run holds config.yaml and metrics.csv (byte for byte), and a parent
    run the sweep's files; re-exports log nothing twice, and a changed figure replaces the parent run alone."""
    uri, client = mlflow_store
    (folder / "loss.png").write_bytes(b"\x89PNG first")
    (folder / "report.html").write_text("<html>report</html>")
    (folder / "notes.txt").write_text("not a sweep file")
    _export(folder, uri)
    parent, by_id = _split(client)
    assert [a.path for a in client.list_artifacts(parent.info.run_id)] == [
        "loss.png", "report.html", "summary.csv", "sweep.yaml"]
    for run in run_folders(folder):
        rid = by_id[run.name].info.run_id
        assert by_id[run.name].data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert [a.path for a in client.list_artifacts(rid)] == ["config.yaml", "metrics.csv"]
        for name in ("config.yaml", "metrics.csv"):
            got = client.download_artifacts(rid, name, str(tmp_path / "got" / run.name))
            assert Path(got).read_bytes() == (run / name).read_bytes()
    _export(folder, uri)
    again, same = _split(client)
    assert again.info.run_id == parent.info.run_id and same.keys() == by_id.keys()
    (folder / "loss.png").write_bytes(b"\x89PNG second")
    _export(folder, uri)
    newer, kept = _split(client)
    assert newer.info.run_id != parent.info.run_id  # the old parent deleted: _split found one
    got = client.download_artifacts(newer.info.run_id, "loss.png", str(tmp_path / "png"))
    assert Path(got).read_bytes() == b"\x89PNG second"
    assert {r.info.run_id for r in kept.values()} == {r.info.run_id for r in by_id.values()}
    assert {r.data.tags["mlflow.parentRunId"] for r in kept.values()} == {newer.info.run_id}


def test_an_earlier_export_without_artifacts_gets_them(folder, mlflow_store):
    """A run that an earlier release exported (no artifacts) is kept, and its artifacts are logged."""
    uri, client = mlflow_store
    _export(folder, uri)
    _, by_id = _split(client)
    run = by_id[run_folders(folder)[0].name]
    client.delete_tag(run.info.run_id, "normexp.artifacts")
    artifacts = Path(urllib.parse.urlparse(run.info.artifact_uri).path)
    shutil.rmtree(artifacts)
    artifacts.mkdir()  # as an earlier release left it: no files
    assert client.list_artifacts(run.info.run_id) == []
    assert "4 already there" in _export(folder, uri).output
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["config.yaml", "metrics.csv"]


def test_the_success_line_fits_the_uri(folder, tmp_path, monkeypatch):
    """The line said `mlflow ui --backend-store-uri URI` for any URI, a tracking server's too. A store path is
    given as its file: URI (which MLflow 3 opens only with MLFLOW_ALLOW_FILE_STORE), a server as its page."""
    mlflow = pytest.importorskip("mlflow")
    from normexp.export.mlflow import MlflowExport

    monkeypatch.chdir(tmp_path)
    result = _export(folder, "store")
    line = " ".join(result.output.split())
    assert (f"MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri {(tmp_path / 'store').as_uri()} "
            f"(MLflow {mlflow.__version__} or newer: pip install 'mlflow>={mlflow.__version__}')") in line, line
    assert MlflowExport([], experiment_id="7").viewer("http://127.0.0.1:5000/") == \
        "open http://127.0.0.1:5000/#/experiments/7"
    spaced = f"sqlite:///{tmp_path}/my runs/mlflow.db"  # the line is a command: it runs as printed
    command = MlflowExport([]).viewer(spaced).split(" (MLflow ")[0]
    assert shlex.split(command) == ["mlflow", "ui", "--backend-store-uri", spaced], command


def test_a_database_of_a_newer_mlflow_is_refused_naming_the_version(folder, tmp_path):
    """MLflow 3.17 reading 3.18's database said to run `mlflow db upgrade`, which cannot work. Now: which
    MLflow wrote it (its normexp.mlflow_version tag) and what to install, exit 2, nothing written."""
    pytest.importorskip("mlflow")
    db = tmp_path / "mlflow.db"
    with sqlite3.connect(db) as con:  # the two tables read: a schema revision no installed migration knows
        con.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        con.execute("INSERT INTO alembic_version VALUES ('ffffffff0a0b')")
        con.execute("CREATE TABLE tags (key VARCHAR(250), value VARCHAR(8000), run_uuid VARCHAR(32))")
        con.executemany("INSERT INTO tags VALUES (?, ?, ?)", [("normexp.mlflow_version", v, "r")
                                                             for v in ("99.2.0", "99.10.1", "99.9.0")])
    con.close()
    before = db.read_bytes()
    result = runner.invoke(app, ["export", str(folder), f"sqlite:///{db}", "--to", "mlflow"])
    assert result.exit_code == 2, result.output
    line = " ".join(result.output.split())
    assert "written by MLflow 99.10.1 (schema revision ffffffff0a0b" in line, line
    assert "pip install 'mlflow>=99.10.1'" in line and "Traceback" not in result.output
    assert db.read_bytes() == before
    with sqlite3.connect(db) as con:  # exported by an older MLflow, migrated since by a newer one
        con.execute("UPDATE tags SET value = '0.1.0'")
    con.close()
    result = runner.invoke(app, ["export", str(folder), f"sqlite:///{db}", "--to", "mlflow"])
    line = " ".join(result.output.split())
    assert result.exit_code == 2 and "written by a newer MLflow" in line and "pip install --upgrade mlflow" in line


@pytest.mark.slow  # a real database: MLflow's migrations, ~10 s
def test_a_real_database_moved_past_this_mlflow_is_refused(folder, tmp_path):
    pytest.importorskip("sqlalchemy")
    db = tmp_path / "mlflow.db"
    _export(folder, f"sqlite:///{db}")
    with sqlite3.connect(db) as con:  # as a newer MLflow's migration leaves it
        con.execute("UPDATE alembic_version SET version_num = 'ffffffff0a0b'")
        con.execute("UPDATE tags SET value = '99.0.0' WHERE key = 'normexp.mlflow_version'")
    con.close()
    result = runner.invoke(app, ["export", str(folder), f"sqlite:///{db}", "--to", "mlflow"])
    assert result.exit_code == 2 and "pip install 'mlflow>=99.0.0'" in " ".join(result.output.split())
    assert "mlflow db upgrade" not in result.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(base: str, route: str, **query) -> bytes:
    url = f"{base}{route}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read()


def _api(base: str, route: str, **query) -> dict:
    return json.loads(_get(base, f"/api/2.0/mlflow/{route}", **query))


@pytest.fixture
def server(tmp_path):
    """A real `mlflow server` on 127.0.0.1 (a free port, a sqlite database and an artifacts folder in tmp),
    stopped by its PID; skipped, with the reason, where it cannot start (mlflow-skinny has no server)."""
    pytest.importorskip("mlflow")
    try:
        import flask  # noqa: F401  (the server's; mlflow-skinny lacks it)
    except ImportError:
        pytest.skip("mlflow server needs the full mlflow package (flask): pip install 'normexp[mlflow]'")
    port = _free_port()
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
           "--artifacts-destination", str(tmp_path / "artifacts")]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True,
                                env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})  # no job workers
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300  # ~20 s on a quiet machine; its imports are slow on a busy one
        while True:
            try:
                if _get(base, "/health") == b"OK":
                    break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if proc.poll() is not None:
                pytest.skip(f"mlflow server did not start: {log.read_text(errors='replace')[-500:]}")
            if time.monotonic() > deadline:
                pytest.skip(f"mlflow server did not answer on {base}/health within 300 s")
            time.sleep(0.5)
        yield base
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)  # its own session: the server and its workers
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()


@pytest.mark.process
@pytest.mark.slow  # a real tracking server: ~20 s to start, then the export over HTTP
def test_a_real_tracking_server_serves_the_export(folder, server):
    """Exported over HTTP to a real `mlflow server`, read back through its REST API: every run, its metric
    histories value for value, its params and artifacts (config.yaml and metrics.csv byte for byte, the
    sweep's files on the parent run); the UI's page is served at `/`; a second export changes nothing."""
    (folder / "loss.png").write_bytes(b"\x89PNG figure")
    result = _export(folder, server)
    exp_id = _api(server, "experiments/get-by-name", experiment_name="tiny")["experiment"]["experiment_id"]
    assert f"open {server}/#/experiments/{exp_id}" in " ".join(result.output.split())
    assert "mlflow ui" not in result.output

    def search() -> list[dict]:
        body = json.dumps({"experiment_ids": [exp_id], "max_results": 1000}).encode()
        request = urllib.request.Request(f"{server}/api/2.0/mlflow/runs/search", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())["runs"]

    def tags(run: dict) -> dict[str, str]:
        return {t["key"]: t["value"] for t in run["data"].get("tags", [])}

    def artifacts(run_uuid: str) -> list[str]:
        return sorted(f["path"] for f in _api(server, "artifacts/list", run_id=run_uuid).get("files", []))

    found = search()
    (parent,) = [r for r in found if "normexp.run_id" not in tags(r)]
    runs = {tags(r)["normexp.run_id"]: r for r in found if r is not parent}
    assert sorted(runs) == [r.name for r in run_folders(folder)]
    assert artifacts(parent["info"]["run_id"]) == ["loss.png", "summary.csv", "sweep.yaml"]
    for run in run_folders(folder):
        got = runs[run.name]
        uuid = got["info"]["run_id"]
        assert tags(got)["mlflow.parentRunId"] == parent["info"]["run_id"]
        assert artifacts(uuid) == ["config.yaml", "metrics.csv"]
        for name in ("config.yaml", "metrics.csv"):
            assert _get(server, "/get-artifact", path=name, run_uuid=uuid) == (run / name).read_bytes(), name
        params = {p["key"]: p["value"] for p in got["data"]["params"]}
        assert params["norm.placement"] in ("pre", "post") and params["model.depth"] in ("2", "3")
        lines = (run / "metrics.csv").read_text().splitlines()
        header = lines[0].split(",")
        for column in ("loss", "acc", "lr", "grad_norm"):
            history = _api(server, "metrics/get-history", run_id=uuid, metric_key=column, max_results=1000)
            points = sorted((int(m["step"]), m["value"]) for m in history["metrics"])
            want = [(int(row.split(",")[0]), float(row.split(",")[header.index(column)])) for row in lines[1:]]
            assert [s for s, _ in points] == [s for s, _ in want], column
            for (_, value), (_, exact) in zip(points, want):
                assert float(value) == exact or (math.isnan(exact) and math.isnan(float(value))), column
    page = _get(server, "/").decode()
    assert "<html" in page.lower() and "mlflow" in page.lower()
    again = _export(folder, server)
    assert "0 runs exported" in again.output and "4 already there" in again.output
    assert sorted(r["info"]["run_id"] for r in search()) == sorted(r["info"]["run_id"] for r in found)
    assert artifacts(parent["info"]["run_id"]) == ["loss.png", "summary.csv", "sweep.yaml"]
