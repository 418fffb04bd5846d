"""`normexp export --to wandb` and `--to parquet` (normexp/export/wandb.py, parquet.py), read back by the tools
themselves: the W&B offline runs by wandb's own transaction-log reader (`wandb leet inspect --json`, the
records `wandb sync` uploads) and `wandb sync --dry-run`; the Parquet tables by DuckDB and pandas. Every value
is compared with the run folders' own files (config.yaml, done.json, metrics.csv, blocks.csv, summary.csv)."""

from __future__ import annotations

import builtins
import csv
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import batched_sweep, run_folders
from typer.testing import CliRunner

from normexp.cli import app
from normexp.config import build_sweep, flatten, parse_yaml
from normexp.folder import BLOCKS_FILE, METRICS_FILE
from normexp.folder.layout import read_json

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
TEMPLATE = "{norm.placement}-lr{optim.lr}-b{train.log_blocks}"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return batched_sweep(tmp_path_factory, TINY)


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _config(run: Path) -> dict[str, Any]:
    return flatten(build_sweep({"name": "x", "base": parse_yaml((run / "config.yaml").read_text())}).runs[0])


def _trained(folder: Path) -> dict[str, bool]:
    return {r["run_id"]: r["trained"] == "True" for r in _rows(folder / "summary.csv")}


def _name(flat: dict[str, Any]) -> str:
    """TEMPLATE by hand: numbers as %g, bools as true/false."""
    return f"{flat['norm.placement']}-lr{flat['optim.lr']:g}-b{str(flat['train.log_blocks']).lower()}"


def _same(got: Any, want: Any) -> bool:
    """Exactly equal, NaN equal to NaN, and of the same kind (a bool is not a number here)."""
    if isinstance(want, float) and math.isnan(want):
        return isinstance(got, float) and math.isnan(got)
    return got == want and (isinstance(got, bool) == isinstance(want, bool))


def _flat(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


# --- Parquet ---------------------------------------------------------------------------------------------


def _expected_run_row(folder: Path, run: Path) -> dict[str, Any]:
    """runs.parquet's row for a run folder, from its files alone (lists as JSON text)."""
    done = json.loads((run / "done.json").read_text())
    flat = _config(run)
    row = {"run_id": run.name, "name": _name(flat), "sweep": "tiny", "status": done["status"],
           "final_loss": float(done["final_loss"]), "min_loss": float(done["min_loss"]),
           "final_acc": float(done["final_acc"]), "diverged": done["diverged"], "trained": _trained(folder)[run.name]}
    row.update({k: json.dumps(v) if isinstance(v, list) else v for k, v in flat.items()})
    row.update(_flat({k: v for k, v in done.items() if k not in row and k != "files"}))
    return row


def _check_tables(folder: Path, runs_rows: list[dict[str, Any]], steps_rows: list[dict[str, Any]]) -> None:
    """Every value of both tables (as a reader gives them: rows of column -> value) against the run folders."""
    runs = run_folders(folder)
    assert sorted(r["run_id"] for r in runs_rows) == [r.name for r in runs]
    by_id = {r["run_id"]: r for r in runs_rows}
    for run in runs:
        want, got = _expected_run_row(folder, run), by_id[run.name]
        assert set(got) == set(want), set(got) ^ set(want)
        for key, value in want.items():
            if value is None:
                assert got[key] is None or (isinstance(got[key], float) and math.isnan(got[key])), (run.name, key)
            else:
                assert _same(got[key], value), (run.name, key, got[key], value)
        assert got["provenance.commit"] and got["provenance.torch_build"]  # the provenance is there
        rows = _rows(run / METRICS_FILE)
        mine = sorted((r for r in steps_rows if r["run_id"] == run.name), key=lambda r: r["step"])
        assert [r["step"] for r in mine] == [int(r["step"]) for r in rows]
        for got_row, csv_row in zip(mine, rows):
            assert set(got_row) - {"run_id", "step"} == set(csv_row) - {"step"}
            for column, text in csv_row.items():
                if column != "step":
                    assert _same(got_row[column], float(text)), (run.name, column)


def test_parquet_reads_back_exactly_in_duckdb_and_pandas(folder, tmp_path):
    duckdb = pytest.importorskip("duckdb")
    pd = pytest.importorskip("pandas")
    out = tmp_path / "tables"
    result = runner.invoke(app, ["export", str(folder), str(out), "--to", "parquet", "--run-name", TEMPLATE])
    assert result.exit_code == 0, result.output
    assert "8 runs exported" in result.output
    assert any(read_json(r / "done.json")["status"] == "diverged" for r in run_folders(folder))  # NaN in the tables

    def rows(relation) -> list[dict[str, Any]]:
        return [dict(zip(relation.columns, values)) for values in relation.fetchall()]

    runs_rows = rows(duckdb.sql(f"select * from '{out / 'runs.parquet'}'"))
    steps_rows = rows(duckdb.sql(f"select * from '{out / 'steps.parquet'}'"))
    _check_tables(folder, runs_rows, steps_rows)
    types = dict(duckdb.sql(f"select column_name, column_type from (describe select * from '{out / 'runs.parquet'}')")
                 .fetchall())
    assert (types["optim.lr"], types["model.depth"], types["trained"], types["optim.betas"]) == \
        ("DOUBLE", "BIGINT", "BOOLEAN", "VARCHAR")
    assert types["optim.clip_norm"] == "DOUBLE" and types["data.seq_len"] == "BIGINT"  # null in every row: declared
    steps_types = dict(duckdb.sql(f"select column_name, column_type from (describe select * from "
                                  f"'{out / 'steps.parquet'}')").fetchall())
    assert steps_types["step"] == "BIGINT" and steps_types["loss"] == "DOUBLE"
    assert duckdb.sql(f"select count(*) from '{out / 'runs.parquet'}' where trained").fetchall()[0][0] == \
        sum(_trained(folder).values())

    def pandas_rows(path: Path) -> list[dict[str, Any]]:
        frame = pd.read_parquet(path)
        return [{k: (None if v is None or v is pd.NA else v.item() if hasattr(v, "item") else v)
                 for k, v in record.items()} for record in frame.astype(object).to_dict("records")]

    _check_tables(folder, pandas_rows(out / "runs.parquet"), pandas_rows(out / "steps.parquet"))


def test_a_parquet_reexport_is_byte_identical_and_another_folders_tables_are_kept(folder, tmp_path):
    pytest.importorskip("pyarrow")
    out = tmp_path / "tables"
    assert runner.invoke(app, ["export", str(folder), str(out), "--to", "parquet"]).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(before) == ["runs.parquet", "steps.parquet"]  # no temporary file left
    assert runner.invoke(app, ["export", str(folder), str(out), "--to", "parquet"]).exit_code == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    result = runner.invoke(app, ["export", str(other), str(out), "--to", "parquet"])
    assert result.exit_code == 2 and f"holds the export of {folder.resolve()}" in result.output, result.output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    (out / "runs.parquet").unlink()  # steps.parquet alone is still the first folder's: kept too
    result = runner.invoke(app, ["export", str(other), str(out), "--to", "parquet"])
    assert result.exit_code == 2 and f"holds the export of {folder.resolve()}" in result.output, result.output
    assert (out / "steps.parquet").read_bytes() == before["steps.parquet"]


def test_a_run_that_no_longer_verifies_leaves_the_tables_and_is_named(folder, tmp_path):
    duckdb = pytest.importorskip("duckdb")
    copy, out = tmp_path / "tiny", tmp_path / "tables"
    shutil.copytree(folder, copy)
    assert runner.invoke(app, ["export", str(copy), str(out), "--to", "parquet"]).exit_code == 0
    gone = run_folders(copy)[0]
    (gone / METRICS_FILE).write_text("step,loss\n")  # corrupt: no longer verifies
    result = runner.invoke(app, ["export", str(copy), str(out), "--to", "parquet"])
    assert result.exit_code == 1, result.output
    assert "7 runs exported" in result.output and "1 run of the sweep not exported" in result.output
    assert f"no longer verifies: {gone.name}" in result.output
    ids = [r[0] for r in duckdb.sql(f"select run_id from '{out / 'runs.parquet'}'").fetchall()]
    assert len(ids) == 7 and gone.name not in ids
    assert gone.name not in {r[0] for r in duckdb.sql(f"select run_id from '{out / 'steps.parquet'}'").fetchall()}


@pytest.mark.parametrize(("target", "package"), [("wandb", "wandb"), ("parquet", "pyarrow")])
def test_a_missing_extra_is_named(folder, tmp_path, monkeypatch, target, package):
    real = builtins.__import__

    def without(name, *args, **kwargs):
        if name.split(".")[0] == package:
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without)
    result = runner.invoke(app, ["export", str(folder), str(tmp_path / "x"), "--to", target])
    assert result.exit_code == 2 and f"pip install 'normexp[{target}]'" in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "x").exists()


# --- W&B -------------------------------------------------------------------------------------------------


def _wandb(*args: str, cwd: Path | None = None) -> subprocess.Popen:
    """wandb's CLI, offline and quiet, in a process of its own."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    return subprocess.Popen([sys.executable, "-m", "wandb", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=cwd)


def _value(value: Any) -> Any:
    """A number as wandb's record reader prints it (NaN and infinities as strings)."""
    return float(value) if value in ("NaN", "Infinity", "-Infinity") else value


def _read_offline_runs(wandb_dir: Path) -> dict[str, dict[str, Any]]:
    """W&B id -> the run's records as wandb's own reader of the .wandb transaction log gives them: the run
    record, config (its updates merged), history per step, summary (its updates applied in order), exit."""
    folders = sorted(wandb_dir.glob("offline-run-*"))
    procs = [_wandb("leet", "inspect", "--json", str(f)) for f in folders]
    runs = {}
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr
        run: dict[str, Any] = {"config": {}, "history": {}, "summary": {}, "exit": None}
        for line in stdout.splitlines():
            record = json.loads(line)
            kind = record["type"]
            if kind == "run":
                run["run"] = record["run"]
                run["config"].update(record["run"].get("config", {}).get("update", {}))
            elif kind == "config":
                run["config"].update(record["config"].get("update", {}))
            elif kind == "history":
                item = {k: _value(v) for k, v in record["history"]["item"].items()}
                run["history"][int(record["history"]["step"]["num"])] = item
            elif kind == "summary":
                run["summary"].update({k: _value(v) for k, v in record["summary"].get("update", {}).items()})
            elif kind == "exit":
                run["exit"] = record["exit"].get("exit_code", 0)
        runs[run["run"]["run_id"]] = run
    return runs


def _marked(wandb_dir: Path) -> list[str]:
    return sorted(p.name for p in wandb_dir.glob("offline-run-*") if (p / "normexp-export.json").is_file())


@pytest.mark.process
def test_the_wandb_export_reads_back_with_wandbs_own_reader(folder, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    out = tmp_path / "wb"
    monkeypatch.setenv("WANDB_MODE", "online")  # the user's: the export stays offline, and leaves it as it was
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_SILENT", raising=False)
    result = runner.invoke(app, ["export", str(folder), str(out), "--to", "wandb", "--run-name", TEMPLATE])
    assert result.exit_code == 0, result.output
    assert os.environ["WANDB_MODE"] == "online" and "WANDB_SILENT" not in os.environ
    assert "8 runs exported" in result.output and f"wandb sync {out / 'wandb'}" in result.output
    found = _read_offline_runs(out / "wandb")
    runs = run_folders(folder)
    assert sorted(found) == [r.name for r in runs]  # the W&B id is the run id
    trained = _trained(folder)
    for run in runs:
        got, done, flat = found[run.name], json.loads((run / "done.json").read_text()), _config(run)
        assert got["run"]["display_name"] == _name(flat) and got["run"]["project"] == "tiny"
        assert got["exit"] == 0
        config = _flat({k: v for k, v in got["config"].items() if k not in ("_wandb", "normexp")})
        assert config == flat, run.name
        assert got["config"]["normexp"]["run_id"] == run.name
        assert got["config"]["normexp"]["provenance"] == done["provenance"]
        rows = _rows(run / METRICS_FILE)
        assert sorted(got["history"]) == [int(r["step"]) for r in rows]  # `_step` is normexp's step
        for row in rows:
            item = got["history"][int(row["step"])]
            assert item["_step"] == int(row["step"])
            for column, text in row.items():
                if column != "step":
                    assert _same(float(item[column]), float(text)), (run.name, row["step"], column)
        if (run / BLOCKS_FILE).is_file():
            for row in _rows(run / BLOCKS_FILE):
                item = got["history"][int(row["step"])]
                for column, text in row.items():
                    if column not in ("step", "block"):
                        key = f"blocks/{column}/{int(row['block']):02d}"
                        assert _same(float(item[key]), float(text)), (run.name, key)
        summary = got["summary"]
        for key in ("final_loss", "min_loss", "final_acc"):
            assert _same(float(summary[f"final/{key}"]), float(done[key])), (run.name, key)
        assert summary["final/diverged"] == float(done["diverged"])
        assert summary["final/trained"] == float(trained[run.name])
        assert _same(float(summary["loss"]), float(rows[-1]["loss"]))  # the last step's value
    sync = _wandb("sync", "--dry-run", str(out / "wandb"))
    stdout, stderr = sync.communicate(timeout=120)
    assert sync.returncode == 0 and "Would sync 8 run(s)" in stdout + stderr, stdout + stderr


@pytest.mark.process
def test_a_wandb_reexport_keeps_what_is_there_and_replaces_what_changed(folder, tmp_path):
    pytest.importorskip("wandb")
    copy, out = tmp_path / "tiny", tmp_path / "wb"
    shutil.copytree(folder, copy)
    assert runner.invoke(app, ["export", str(copy), str(out), "--to", "wandb"]).exit_code == 0
    wandb_dir = out / "wandb"
    first = _marked(wandb_dir)
    assert len(first) == 8
    theirs = wandb_dir / "offline-run-20200101_000000-theirs"  # not normexp's: never touched
    theirs.mkdir()
    result = runner.invoke(app, ["export", str(copy), str(out), "--to", "wandb"])
    assert result.exit_code == 0 and "0 runs exported to" in result.output and "8 already there" in result.output
    assert _marked(wandb_dir) == first
    result = runner.invoke(app, ["export", str(copy), str(out), "--to", "wandb", "--run-name", TEMPLATE])
    assert result.exit_code == 0 and "8 runs exported" in result.output, result.output
    assert "its name changed" in result.output
    assert len(_marked(wandb_dir)) == 8 and theirs.is_dir()  # each run's earlier folder replaced, not added to
    gone = run_folders(copy)[0]
    shutil.rmtree(gone)
    result = runner.invoke(app, ["export", str(copy), str(out), "--to", "wandb", "--run-name", TEMPLATE])
    assert result.exit_code == 1, result.output
    assert f"no longer verifies: {gone.name}" in result.output and "1 run of the sweep not exported" in result.output
    assert len(_marked(wandb_dir)) == 7 and not any(p.name.endswith(gone.name) for p in wandb_dir.iterdir())
    assert theirs.is_dir()


INTERRUPTED = """\
import os, sys
from pathlib import Path
from normexp.export import wandb as export_wandb
real, calls = export_wandb._mark, []
def interrupted(path, mark):  # Ctrl-C in the CLI ends the process at once (normexp/__main__.py)
    calls.append(mark)
    if len(calls) == 3:  # the second run's folder is made, and not marked yet
        os._exit(130)
    real(path, mark)
export_wandb._mark = interrupted
export_wandb.to_wandb(Path(sys.argv[1]), Path(sys.argv[2]))
"""


@pytest.mark.process
def test_a_wandb_export_interrupted_as_a_run_starts_leaves_no_unmarked_run(folder, tmp_path):
    """A Ctrl-C between wandb.init (which makes the offline folder) and normexp's mark left an offline run that
    no export ever removed (not marked: not normexp's), which `wandb sync` would upload beside the run's
    complete one, under the same id."""
    pytest.importorskip("wandb")
    out = tmp_path / "wb"
    mine = out / "wandb" / "offline-run-20200101_000000-mine"  # the user's own, never touched
    mine.mkdir(parents=True)
    stopped = subprocess.run([sys.executable, "-c", INTERRUPTED, str(folder), str(out)], timeout=600,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert stopped.returncode == 130
    assert len(list((out / "wandb").glob("offline-run-*"))) == 3 and len(_marked(out / "wandb")) == 1
    result = runner.invoke(app, ["export", str(folder), str(out), "--to", "wandb"])
    assert result.exit_code == 0, result.output
    assert len(_marked(out / "wandb")) == 8 and mine.is_dir()
    assert len(list((out / "wandb").glob("offline-run-*"))) == 9
    assert not list((out / "wandb").glob(".normexp-*"))


def test_a_run_id_wandb_would_refuse_gets_a_stable_id_it_takes():
    from normexp.export.wandb import wandb_id

    assert wandb_id("post-layernorm-s0-28ac1dd0a1") == "post-layernorm-s0-28ac1dd0a1"
    odd = ["mypkg.norms:Mine-layernorm-s0-28ac1dd0a1", "mypkg.norms/Mine-layernorm-s0-28ac1dd0a1", "x" * 70]
    ids = [wandb_id(rid) for rid in odd]
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", i) for i in ids) and len(set(ids)) == 3
    assert ids == [wandb_id(rid) for rid in odd]
