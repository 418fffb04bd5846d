"""`normexp export DIR --to parquet OUT`: a sweep folder's verified runs (read by export/runs.py) as two
Parquet tables, for notebooks and SQL (pandas, polars, DuckDB read them as they are).

`OUT/runs.parquet`, one row per run: `run_id`, `name` (its display name, `--run-name`), `sweep`, `status`,
the final metrics (`final_loss`, `min_loss`, `final_acc`, `diverged`, `trained`: completed with a final loss
under the folder's trained rule, as summary.csv's `trained`), every flattened config key as a column of its
own (`model.depth`, `optim.lr`, ..., `seed`), then what done.json says of the run (`steps_done`, `wall_s`,
`threads`, `engine`, `device`, `host`, `config_hash`, `checksum`, `versions.*`, `provenance.*`: commit, CPU,
torch build, command). `OUT/steps.parquet`, one row per recorded step of each run: `run_id`, `step` and every
column of metrics.csv (a column a run does not record, such as `val_loss` outside sequence tasks, is null).

Types (`column`): bools are `bool`, integers `int64`, floats (and integers mixed with floats) `float64`,
strings `string`; a list (`optim.betas`) or a key whose values mix kinds is its JSON text (`[0.9, 0.999]`);
null is null, and a column null in every row takes its config key's declared type. Numbers are the run
folder's exactly (a float64 is the CSV's or done.json's value; NaN stays NaN). Each file is written aside and
renamed into place; the same folder exported again gives the same bytes. The tables' metadata names the
folder they come from (`normexp.folder`): an OUT that holds another folder's tables is refused, not
overwritten.
"""

from __future__ import annotations

import json
import os
import types
import typing
from pathlib import Path
from typing import Any

from normexp.config import ConfigError, RunConfig, flatten
from normexp.export.runs import ExportedRun, ExportResult, display_names, missing_extra, read_folder

RUNS_FILE, STEPS_FILE = "runs.parquet", "steps.parquet"
FOLDER_KEY = b"normexp.folder"  # in each table's key-value metadata: the sweep folder's absolute path
LEFT_OUT = {"run_id", "status", "final_loss", "min_loss", "final_acc", "diverged", "files"}  # done.json's keys
# that have a column of their own above, or none (`files`: each file's checksum and rows)


def to_parquet(run_dir: Path, out_dir: Path, template: str | None = None) -> ExportResult:
    """Write `OUT/runs.parquet` and `OUT/steps.parquet` for `run_dir` (see the module docstring); runs named
    by `template` (`--run-name`, names.py). ConfigError, before anything is written, where `out_dir` holds
    the tables of another folder."""
    sweep, runs, left = read_folder(Path(run_dir))
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise missing_extra("parquet", "pyarrow") from None
    out_dir, folder = Path(out_dir), str(Path(run_dir).resolve())
    names = display_names(runs, template)
    earlier = _earlier_ids(pq, out_dir / RUNS_FILE, folder)
    _earlier_ids(pq, out_dir / STEPS_FILE, folder)  # refused as well where it is another folder's
    metadata = {FOLDER_KEY: folder.encode(), b"normexp.sweep": sweep.encode()}
    out_dir.mkdir(parents=True, exist_ok=True)
    _write(pq, steps_table(pa, runs).replace_schema_metadata(metadata), out_dir / STEPS_FILE)
    _write(pq, runs_table(pa, runs, names, sweep).replace_schema_metadata(metadata), out_dir / RUNS_FILE)
    return ExportResult([r.run_id for r in runs], dropped=[rid for rid in left if rid in earlier], left=left)


def _earlier_ids(pq, path: Path, folder: str) -> set[str]:
    """The run ids of this folder's earlier table at `path` (runs.parquet or steps.parquet; none if there is
    none). ConfigError where it is another folder's, or not a table normexp wrote."""
    if not path.exists():
        return set()
    try:
        table = pq.read_table(path, columns=["run_id"])
    except Exception as exc:  # pyarrow's errors for a file that is not Parquet, or lacks the column
        raise ConfigError(f"{path}: not a table normexp wrote ({' '.join(str(exc).split())[:200]}); "
                          "export into another folder, or remove it") from None
    owner = (table.schema.metadata or {}).get(FOLDER_KEY, b"").decode()
    if owner != folder:
        raise ConfigError(f"{path}: holds the export of {owner or 'another folder'}, not {folder}; export into "
                          "another folder, or remove it")
    return {str(rid) for rid in table.column("run_id").to_pylist()}


def runs_table(pa, runs: list[ExportedRun], names: dict[str, str], sweep: str):
    """runs.parquet's table: a row per run (see the module docstring)."""
    rows = []
    for run in runs:
        done = run.done
        row: dict[str, Any] = {
            "run_id": run.run_id, "name": names[run.run_id], "sweep": sweep, "status": done.get("status"),
            **{key: _number(done.get(key)) for key in ("final_loss", "min_loss", "final_acc")},
            "diverged": bool(done.get("diverged")), "trained": run.trained}
        row.update(flatten(run.cfg))
        for key, value in _flat_done(done).items():
            row[key if key not in row else f"done.{key}"] = value
        rows.append(row)
    keys = list(dict.fromkeys(key for row in rows for key in row)) or ["run_id", "name", "sweep", "status"]
    declared = type(runs[0].cfg) if runs else RunConfig
    return pa.table({key: column(pa, [row.get(key) for row in rows], declared_type(declared, key))
                     for key in keys})


def steps_table(pa, runs: list[ExportedRun]):
    """steps.parquet's table: a row per recorded step of each run, metrics.csv's columns as float64."""
    names = list(dict.fromkeys(name for run in runs for name in run.metrics if name != "step"))
    ids, steps, values = [], [], {name: [] for name in names}
    for run in runs:
        count = len(run.metrics.get("step", ()))
        ids += [run.run_id] * count
        steps += [int(step) for step in run.metrics.get("step", ())]
        for name in names:
            values[name] += run.metrics.get(name, [None] * count)
    return pa.table({"run_id": pa.array(ids, pa.string()), "step": pa.array(steps, pa.int64()),
                     **{name: pa.array(values[name], pa.float64()) for name in names}})


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _flat_done(done: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """done.json's keys other than LEFT_OUT, a mapping's keys under `key.`."""
    flat: dict[str, Any] = {}
    for key, value in done.items():
        if not prefix and key in LEFT_OUT:
            continue
        if isinstance(value, dict):
            flat.update(_flat_done(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def column(pa, values: list[Any], declared: type | None = None):
    """A column of `values` as the module docstring says: bool, int64, float64 or string by the values'
    kinds (a list, or kinds mixed, as JSON text), null as null; `declared` where every value is null."""
    present = [v for v in values if v is not None]
    kind = declared if not present else None
    if present and all(isinstance(v, bool) for v in present):
        kind = bool
    elif present and all(isinstance(v, int) and not isinstance(v, bool) for v in present):
        kind = int
    elif present and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
        return pa.array([None if v is None else float(v) for v in values], pa.float64())
    elif present and all(isinstance(v, str) for v in present):
        kind = str
    if kind is bool:
        return pa.array(values, pa.bool_())
    if kind is int:
        return pa.array(values, pa.int64())
    if kind is float:
        return pa.array(values, pa.float64())
    return pa.array([v if v is None or isinstance(v, str) else json.dumps(v) for v in values], pa.string())


def declared_type(model: type, key: str) -> type | None:
    """The Python type a flattened config key is declared as (`optim.clip_norm`: float, `train.stop_when`:
    str), where it is bool, int, float or str, or one of them or None; else None."""
    annotation: Any = model
    for part in key.split("."):
        fields = getattr(annotation, "model_fields", None)
        if not fields or part not in fields:
            return None
        annotation = fields[part].annotation
    plain = _plain(annotation)
    return plain if plain in (bool, int, float, str) else None


def _plain(annotation: Any) -> Any:
    """An annotation less its constraints (Annotated), its None (Optional) and its values (Literal)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _plain(args[0])
    if origin in (typing.Union, types.UnionType):
        kinds = {_plain(a) for a in args if a is not type(None)}
        return kinds.pop() if len(kinds) == 1 else None
    if origin is typing.Literal:
        kinds = {type(a) for a in args}
        return kinds.pop() if len(kinds) == 1 else None
    return annotation


def _write(pq, table, path: Path) -> None:
    """`table` as Parquet at `path`, written aside and renamed into place."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
