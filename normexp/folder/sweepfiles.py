"""A sweep folder's own files: sweep.yaml (the latest invocation's resolved sweep, under its checksum),
history.jsonl (one line per invocation) and summary.csv (one row per run the folder holds, rebuilt from
the verified run folders); and which runs a folder holds (`folder_runs`).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from normexp.config import (
    ConfigError,
    ReportConfig,
    RunConfig,
    Sweep,
    build_sweep,
    chance_classes,
    flatten,
    load_sweep,
    parse_yaml,
    trained_threshold,
    validate_run,
)
from normexp.folder.atomic import atomic_write
from normexp.folder.ids import earlier_run_id, run_id, superseded_problem
from normexp.folder.inspect import inspect_run, read_text, verified_states
from normexp.folder.layout import (
    CONFIG_FILE,
    DONE_FILE,
    HISTORY_FILE,
    IN_THE_WAY_REMEDY,
    SUMMARY_FILE,
    SUMMARY_STATS,
    SWEEP_FILE,
    RunState,
    StoreError,
    format_float,
    sha256_hex,
)

# ----------------------------------------------------------------------------- summary.csv


def summary_row(out_dir: Path, cfg: RunConfig, pending_status: str = "pending",
                state: RunState | None = None, trained_below: float | None = None,
                rid: str | None = None) -> dict[str, Any]:
    """One summary.csv row for `cfg` (whose run id is `rid`, computed if not given), from its run folder
    as verified by `inspect_run` (or as `state` says, where the caller has just inspected it against
    `cfg`). A finished run is judged by the trained rule: `trained_below`, or by default ln(C)/10
    (`config.trained_threshold`)."""
    rid = rid or run_id(cfg)
    row: dict[str, Any] = {"run_id": rid, **flatten(cfg)}
    state = state if state is not None else inspect_run(out_dir / rid, cfg)
    if state.finished:
        stats = {k: state.done[k] for k in SUMMARY_STATS}
        threshold = float(trained_below) if trained_below is not None else trained_threshold(chance_classes(cfg))
        trained = stats["status"] == "completed" and float(stats["final_loss"]) < threshold
        return {**row, **stats, STOPPED_COLUMN: state.done.get("stopped_at", ""), "threshold": threshold,
                "trained": trained, "error": ""}
    earlier = superseded_folder(out_dir, cfg) if state.kind == "absent" else None
    if earlier is not None:
        return {**row, "status": "superseded", "error": f"{earlier.name}: {superseded_problem(cfg)}"}
    if state.kind == "failed":
        return {**row, "status": state.failed.get("status", "failed"), "error": state.problem}
    if state.kind == "blocked":  # the sweep records such a run as failed, and says why
        return {**row, "status": "failed", "error": f"{state.problem}; {IN_THE_WAY_REMEDY}"}
    if state.kind == "corrupt":
        return {**row, "status": "corrupt", "error": state.problem}
    return {**row, "status": pending_status, "error": ""}


def superseded_folder(out_dir: Path, cfg: RunConfig) -> Path | None:
    """The folder of `out_dir` holding `cfg` as trained under normexp's earlier definition, if there is one."""
    earlier = earlier_run_id(cfg)
    if earlier is None or not (out_dir / earlier).is_dir():
        return None
    return out_dir / earlier if inspect_run(out_dir / earlier).kind == "superseded" else None


def summary_csv(out_dir: Path, runs: Sequence[RunConfig], statuses: dict[str, str] | None = None,
                found: dict[str, RunState] | None = None) -> str:
    """summary.csv's text, rebuilt from the verified run folders (`statuses` names unfinished runs' state;
    `found`, runs just inspected), each finished run judged by the folder's trained rule (`trained_rule`)."""
    rows = summary_rows(out_dir, {run_id(cfg): cfg for cfg in runs}, statuses, trained_rule(out_dir), found)
    return rows_csv(rows, runs[0] if runs else None)


def summary_rows(out_dir: Path, runs: dict[str, RunConfig], statuses: dict[str, str] | None = None,
                 trained_below: float | None = None, found: dict[str, RunState] | None = None) -> list[dict[str, Any]]:
    """summary.csv's rows of `runs` (by run id: `summary_row`), each run verified once (`verified_states`)
    unless `found` holds its state."""
    statuses, found = statuses or {}, found or {}
    states = {**verified_states(out_dir, {rid: cfg for rid, cfg in runs.items() if rid not in found}), **found}
    return [summary_row(out_dir, cfg, statuses.get(rid, "pending"), states[rid], trained_below, rid)
            for rid, cfg in runs.items()]


def trained_rule(out_dir: Path) -> float | None:
    """The folder's trained rule: report.trained_below of its sweep.yaml (the latest invocation's), or
    None (the default ln(C)/10) where it sets none or cannot be read (the readers say why). Only the
    `report:` section is read: the grid is not expanded again."""
    try:
        data = yaml.safe_load((Path(out_dir) / SWEEP_FILE).read_text(encoding="utf-8"))
        return ReportConfig.model_validate((data or {}).get("report") or {}).trained_below
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError, ValueError):
        return None


def rows_csv(rows: Sequence[dict[str, Any]], first: RunConfig | None, header: bool = True) -> str:
    """summary.csv's text from its rows (`summary_row`), its columns those of the `first` run's config
    (`header` False: the rows' lines alone, which follow another text's)."""
    columns = list(dict.fromkeys(["run_id", *flatten(first), *SUMMARY_STATS, STOPPED_COLUMN, *JUDGED, "error"])) \
        if first else []
    known = set(columns)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    if header:
        writer.writerow(columns)
    for row in rows:
        if not row.keys() <= known:
            raise ValueError(f"summary row has fields not in its columns: {sorted(row.keys() - known)}")
        cells = list(map(row.get, columns))  # a missing field: None, written empty like a null value
        for i, value in enumerate(cells):
            if type(value) not in _WRITTEN_AS_IS:
                cells[i] = format_float(value) if isinstance(value, float) else _cell(value)
        writer.writerow(cells)
    return buffer.getvalue()


# the cells the csv module writes as `format_float` and `_cell` would (a float as its repr(), None empty),
# left to it: 700,000 cells at 10,000 runs (a float's subclass, numpy's, is converted: its repr differs)
_WRITTEN_AS_IS = frozenset({str, int, bool, float, type(None)})


STOPPED_COLUMN = "stopped_at"  # the step at which train.stop_when stopped a run (empty: it ran every step)
JUDGED = ("threshold", "trained")  # summary.csv's judgment of a finished run by the trained rule (empty otherwise)


CACHED_STATUSES = ("interrupted", "pending")  # states of unfinished runs only summary.csv knows


def cached_statuses(out_dir: Path) -> dict[str, str]:
    """The states of unfinished runs that only summary.csv records (interrupted, pending); whatever
    else it says is ignored, and a damaged summary.csv gives none."""
    try:
        with open(out_dir / SUMMARY_FILE, encoding="utf-8", newline="") as f:
            rows = csv.reader(f)
            header = next(rows, [])
            if "run_id" not in header or "status" not in header:
                return {}
            rid, status = (max(i for i, name in enumerate(header) if name == key) for key in ("run_id", "status"))
            return {row[rid]: row[status] for row in rows if len(row) > max(rid, status)
                    and row[status] in CACHED_STATUSES}
    except (OSError, UnicodeDecodeError, csv.Error):
        return {}


def write_summary(out_dir: Path, runs: Sequence[RunConfig], statuses: dict[str, str] | None = None) -> Path:
    """Rebuild summary.csv from the run folders (`statuses` names unfinished runs' state), and record the
    runs that pass in .verified.json (`verified_states`)."""
    path = out_dir / SUMMARY_FILE
    found = verified_states(out_dir, {run_id(cfg): cfg for cfg in runs}, record=True)
    atomic_write(path, summary_csv(out_dir, runs, statuses, found))
    return path


def _cell(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return json.dumps(value)
    return "" if value is None else value


# ----------------------------------------------------------------------------- sweep.yaml


SWEEP_CHECKSUM = "# sha256 of the lines below: "


def sweep_yaml(sweep: Sweep) -> str:
    """sweep.yaml's text: the resolved sweep under a first line holding the checksum of the rest, so a
    file cut at a line boundary (a sweep with fewer axes, still valid YAML) is caught, not obeyed."""
    body = sweep.to_yaml()
    return f"{SWEEP_CHECKSUM}{sha256_hex(body.encode())}\n{body}"


def _check_sweep_yaml(path: Path) -> None:
    """StoreError if sweep.yaml's checksum line does not match what follows it (a file without the line,
    written by release 0.1, is read as it is)."""
    try:
        first, _, body = path.read_text(encoding="utf-8").partition("\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise StoreError(f"{path}: cannot be read: {exc}") from None
    if first.startswith(SWEEP_CHECKSUM) and first[len(SWEEP_CHECKSUM):] != sha256_hex(body.encode()):
        raise StoreError(f"{path}: damaged (its checksum does not match its content); rerun the sweep from its "
                         "config to rewrite it (finished runs are kept)")


def read_sweep(out_dir: Path) -> Sweep:
    """The sweep whose output `out_dir` is, from its sweep.yaml. StoreError if it is not one, or damaged."""
    path = Path(out_dir) / SWEEP_FILE
    if not path.is_file():
        raise StoreError(f"{out_dir}: no {SWEEP_FILE} here; is this a sweep's output folder?")
    _check_sweep_yaml(path)
    try:
        return load_sweep(path, max_runs=sys.maxsize)
    except ConfigError as exc:
        raise StoreError(f"{path}: cannot be read back: {str(exc).splitlines()[0]}") from None


def sweep_name(out_dir: Path) -> str | None:
    """The name in `out_dir`'s sweep.yaml (None if there is none or it is unreadable)."""
    try:
        data = yaml.safe_load((out_dir / SWEEP_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    name = data.get("name") if isinstance(data, dict) else None
    return name if isinstance(name, str) else None


# ----------------------------------------------------------------------------- history.jsonl


HISTORY_CHECKSUM = "checksum"  # a history line's sha256 of its other fields (sorted-key JSON); older lines have none


def _record_checksum(record: dict[str, Any]) -> str:
    body = {k: v for k, v in record.items() if k != HISTORY_CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode("utf-8")).hexdigest()


def append_history(out_dir: Path, record: dict[str, Any]) -> None:
    """Add one invocation's line to history.jsonl (the file is rewritten whole, atomically), with its
    checksum (a line copied from another folder keeps its own)."""
    path = out_dir / HISTORY_FILE
    try:
        before = path.read_bytes()  # as bytes: a damaged line is kept as it is, for `history_damage` to name
    except FileNotFoundError:
        before = b""
    if before and not before.endswith(b"\n"):
        before += b"\n"  # a line cut by a crash stays apart from the next one
    if HISTORY_CHECKSUM not in record:
        record = {**record, HISTORY_CHECKSUM: _record_checksum(record)}
    atomic_write(path, before + (json.dumps(record, sort_keys=False) + "\n").encode("utf-8"))


def _history(out_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """history.jsonl's intact records, oldest first, and its damaged lines ("line 3: not JSON", ...): a
    line that is not UTF-8, not a JSON object, or whose checksum disagrees with its fields."""
    try:
        data = (Path(out_dir) / HISTORY_FILE).read_bytes()
    except OSError:
        return [], []  # a folder of an earlier release has none
    records, damaged = [], []
    for number, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            damaged.append(f"line {number}: not UTF-8")
            continue
        except ValueError:
            damaged.append(f"line {number}: not JSON")
            continue
        if not isinstance(record, dict):
            damaged.append(f"line {number}: not a record")
        elif HISTORY_CHECKSUM in record and record[HISTORY_CHECKSUM] != _record_checksum(record):
            damaged.append(f"line {number}: its checksum disagrees with its fields")
        else:
            records.append(record)
    return records, damaged


def read_history(out_dir: Path) -> list[dict[str, Any]]:
    """history.jsonl's intact invocations, oldest first (a damaged line is left out: `history_damage`
    names it; a folder of an earlier release has none)."""
    return _history(out_dir)[0]


def history_damage(out_dir: Path) -> list[str]:
    """history.jsonl's damaged lines ("line 3: not JSON", ...), [] where it is intact (or absent)."""
    return _history(out_dir)[1]


HISTORY_DAMAGE_EFFECT = ("the invocations on those lines are not read, so their runs that did not finish cannot be "
                         "counted as missing (their verified runs still count); restore the file from a copy, or "
                         "rerun those sweeps into the folder")


# ----------------------------------------------------------------------------- the runs a folder holds


def folder_runs(out_dir: Path, sweep: Sweep, verified: dict[str, RunState] | None = None) -> list[RunConfig]:
    """Every run the folder holds: the latest sweep's runs (finished or not), then every run of an
    earlier invocation that history.jsonl records (finished or not: one deleted or damaged since is
    missing, never silently gone), then each verified run of an invocation no history records (an
    earlier release's), in folder order. A folder accumulates runs: a sweep of another grid adds its
    runs and hides none. `verified`, if given, receives the state of each run found by listing the
    folder, by run id, so that a caller need not inspect it again."""
    return list(folder_run_ids(out_dir, sweep, verified).values())


def folder_run_ids(out_dir: Path, sweep: Sweep, verified: dict[str, RunState] | None = None) -> dict[str, RunConfig]:
    """`folder_runs`, by run id."""
    runs = {run_id(cfg): cfg for cfg in sweep.runs}
    for cfg in _history_runs(out_dir, sweep.to_yaml()):
        runs.setdefault(run_id(cfg), cfg)
    names = sorted(entry.name for entry in os.scandir(out_dir) if entry.name not in runs) if out_dir.is_dir() else ()
    for name in names:
        folder = out_dir / name
        if name.startswith(".") or not folder.is_dir() or not (folder / DONE_FILE).is_file():
            continue
        state = inspect_run(folder)
        if state.finished:  # config.yaml parsed and checked against the folder's run id
            runs[name] = validate_run(parse_yaml(read_text(folder / CONFIG_FILE), CONFIG_FILE))
            if verified is not None:
                verified[name] = state
    return runs


def _history_runs(out_dir: Path, latest: str = "") -> list[RunConfig]:
    """The runs of every invocation history.jsonl records, oldest first (from each one's resolved sweep;
    one that no longer validates, say a placement of a user's package not installed here, is skipped).
    Each resolved sweep is expanded once, and none whose text is `latest` (the latest sweep's, whose
    runs the caller has: a resumed sweep records the same one again)."""
    runs = []
    texts = dict.fromkeys(text for text in (record.get("resolved") for record in read_history(out_dir))
                          if isinstance(text, str) and text != latest)
    for resolved in texts:
        try:
            runs += build_sweep(parse_yaml(resolved, HISTORY_FILE), max_runs=sys.maxsize).runs
        except ConfigError:
            continue
    return runs
