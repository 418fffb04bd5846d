"""`normexp export --to parquet` (normexp/export/parquet.py), read back by the tools themselves: the Parquet
tables by DuckDB and pandas. Every value is compared with the run folders' own files (config.yaml, done.json,
metrics.csv, summary.csv)."""

from __future__ import annotations

import builtins
import csv
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from normexp.cli import app
from normexp.config import build_sweep, flatten, parse_yaml
from normexp.folder import METRICS_FILE
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
TEMPLATE = "{norm.placement}-lr{optim.lr}-b{train.log_blocks}"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "tiny"
    run_sweep(build_sweep(parse_yaml(TINY)), out, SweepOptions(engine="batched"))
    return out


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _runs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if (p / "done.json").is_file())


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
    runs = _runs(folder)
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
    assert any(read_json(r / "done.json")["status"] == "diverged" for r in _runs(folder))  # NaN in the tables

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


def test_a_run_that_no_longer_verifies_leaves_the_tables_and_is_named(folder, tmp_path):
    duckdb = pytest.importorskip("duckdb")
    copy, out = tmp_path / "tiny", tmp_path / "tables"
    shutil.copytree(folder, copy)
    assert runner.invoke(app, ["export", str(copy), str(out), "--to", "parquet"]).exit_code == 0
    gone = _runs(copy)[0]
    (gone / METRICS_FILE).write_text("step,loss\n")  # corrupt: no longer verifies
    result = runner.invoke(app, ["export", str(copy), str(out), "--to", "parquet"])
    assert result.exit_code == 1, result.output
    assert "7 runs exported" in result.output and "1 run of the sweep not exported" in result.output
    assert f"no longer verifies: {gone.name}" in result.output
    ids = [r[0] for r in duckdb.sql(f"select run_id from '{out / 'runs.parquet'}'").fetchall()]
    assert len(ids) == 7 and gone.name not in ids
    assert gone.name not in {r[0] for r in duckdb.sql(f"select run_id from '{out / 'steps.parquet'}'").fetchall()}


@pytest.mark.parametrize(("target", "package"), [("parquet", "pyarrow")])
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
