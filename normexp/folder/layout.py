"""What a sweep folder and its run folders hold (SPEC §6): the files' names and texts, which entries are
not normexp's, and `RunState`, what a run folder is found to be.

    <out>/
      sweep.yaml              the latest invocation's resolved sweep (after --set), loadable again
      history.jsonl           one JSON line per invocation: command line, time, commit, CPU, torch,
                              the sweep file's text as given, the resolved grid, runs planned and new
      summary.csv             one row per run the folder holds (`folder_runs`), rebuilt from the run
                              folders every time; `threshold` and `trained` judge each finished run by
                              the trained rule (sweep.yaml's report.trained_below, else ln(C)/10)
      .verified.json          which done.json texts passed every check (`verified.Verified`): a cache
      .lock                   held (flock) while a sweep writes here; holds the owner's PID and host
      .lock.writes            shards only (`--shard`, `SweepLock(shared=True)`): see `lock.folder_writes`
      <run_id>/config.yaml    the resolved run config: `normexp sweep <run_id>/config.yaml` reruns it
                              alone (a sweep of one run, into runs/<run_id> unless --out)
      <run_id>/metrics.csv    step, loss, acc, lr, grad_norm: one row per recorded step, floats as repr()
      <run_id>/blocks.csv     with train.log_blocks only: one row per logged step and block (blocklog.py)
      <run_id>/sharpness.csv  with train.log_sharpness only: one row per measured step (sharpness.py)
      <run_id>/failed.json    only for a run that raised: the error (the run is retried next time)
      <run_id>/done.json      written last: the run is complete (+ summary numbers, timings, versions)

Only normexp's own files go with a replaced run folder: whatever else a user put in it (`foreign_entries`)
moves into the new one, and nothing normexp did not write is replaced or removed (`in_the_way`).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from normexp.config import METRIC_COLUMNS, SYMLINK_LOOP, RunConfig, is_symlink_loop, section_cache

SWEEP_FILE = "sweep.yaml"
HISTORY_FILE = "history.jsonl"
SUMMARY_FILE = "summary.csv"
VERIFIED_FILE = ".verified.json"  # which done.json texts passed every check (`Verified`): a cache
LOCK_FILE = ".lock"
WRITES_LOCK_FILE = ".lock.writes"
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.csv"
BLOCKS_FILE = "blocks.csv"
SHARPNESS_FILE = "sharpness.csv"
FAILED_FILE = "failed.json"
DONE_FILE = "done.json"


TOP_FILES = (SWEEP_FILE, HISTORY_FILE, SUMMARY_FILE, VERIFIED_FILE)  # the files `atomic_write` writes in a sweep folder
RUN_DIR_FILES = (CONFIG_FILE, METRICS_FILE, BLOCKS_FILE, SHARPNESS_FILE, FAILED_FILE,
                 DONE_FILE)  # ... and in a run folder


METRIC_HEADER = METRIC_COLUMNS  # metrics.csv's first columns
VOUCHED_FILES = (CONFIG_FILE, METRICS_FILE)  # the files a done.json records checksums of
FINISHED_STATUSES = ("completed", "diverged")


SUMMARY_STATS = ("status", "final_loss", "min_loss", "final_acc", "diverged", "steps_done", "wall_s",
                 "threads", "engine")


class StoreError(RuntimeError):
    """A problem with the output folder (in use, unwritable, disk full). The CLI exits 2 on it."""


IN_THE_WAY_REMEDY = "move it and rerun"


class InTheWay(StoreError):
    """Something normexp did not write (a file, a symbolic link) stands where a run folder must go: it is
    left as it is, and the sweep records that run as failed. `problem`: what it is, and what to do."""

    def __init__(self, run_dir: Path, what: str) -> None:
        self.problem = f"{what}; {IN_THE_WAY_REMEDY}"
        super().__init__(f"{run_dir}: {self.problem}")


RunStateKind = Literal["finished", "unstamped", "absent", "failed", "unfinished", "corrupt", "superseded",
                       "blocked"]


@dataclass(frozen=True)
class RunState:
    """What a run folder holds, once checked.

    finished: done.json's checksums and numbers hold. unstamped: a done.json of release 0.1 (no
    checksums) whose files re-read consistently. absent: no folder. failed: failed.json (retried by
    the next sweep). unfinished: a folder without a done marker. corrupt: `problem` says what does not
    hold. superseded: intact, but trained under normexp's earlier definition of its placement (its
    folder has the id that definition gave; `problem` says which). blocked: a file or symbolic link
    normexp did not write stands at the run folder's path (`in_the_way`; a link to a folder holding a
    finished run is read as that run). Only finished and unstamped runs have results."""

    kind: RunStateKind
    problem: str = ""
    done: dict[str, Any] | None = None
    failed: dict[str, Any] | None = None
    sha256: str = ""  # of the done.json read, where it was checked for a `Verified` record

    @property
    def finished(self) -> bool:
        return self.kind in ("finished", "unstamped")


# ----------------------------------------------------------------------------- the files' texts


def read_json(path: Path) -> dict | None:
    """A JSON file's content, or None if it is missing or unreadable (e.g. written by a crashed run)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_record(name: str, text: str) -> dict[str, Any]:
    """What done.json vouches for about one file: its SHA-256 and its rows (metrics.csv: the lines
    after the header, one per recorded step; config.yaml: its lines)."""
    data = text.encode("utf-8")
    lines = data.count(b"\n")
    return {"sha256": sha256_hex(data), "rows": lines - 1 if name == METRICS_FILE else lines}


def encode_done(done: dict[str, Any]) -> str:
    """done.json's one canonical text: its fields, then a checksum of them (any other text is corrupt)."""
    body = {k: v for k, v in done.items() if k != "checksum"}
    checksum = sha256_hex(json.dumps(body, indent=2, allow_nan=True).encode())
    return json.dumps({**body, "checksum": checksum}, indent=2, allow_nan=True) + "\n"


def run_stats(metrics: dict[str, list[float]], status: str) -> dict[str, Any]:
    losses = metrics["loss"]
    finite = [v for v in losses if math.isfinite(v)]
    return {
        "status": status,
        "final_loss": losses[-1] if losses else math.nan,
        "min_loss": min(finite) if finite else math.nan,
        "final_acc": metrics["acc"][-1] if metrics["acc"] else math.nan,
        "diverged": status == "diverged",
        "steps_done": metrics["step"][-1] if metrics["step"] else 0,
    }


def format_float(value: float) -> str:
    """repr() round-trips a float exactly; nan/inf stay readable for pandas and csv."""
    return repr(float(value))


def metrics_csv(metrics: dict[str, list[float]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    columns = list(metrics)
    writer.writerow(columns)
    for row in zip(*(metrics[c] for c in columns)):
        writer.writerow([str(v) if isinstance(v, int) else format_float(v) for v in row])
    return buffer.getvalue()


def config_yaml(cfg: RunConfig) -> str:
    """config.yaml's text: `yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)`, byte for byte.
    Written one section at a time, each distinct section dumped once (`_section_yaml`): a block-style
    mapping's entries are dumped independently, and the runs of a grid share most of their sections,
    so a 10,000-run sweep spends milliseconds here instead of a minute of YAML emitting."""
    parts = []
    for section in type(cfg).model_fields:
        value = getattr(cfg, section)
        try:
            parts.append(_section_yaml(section, value))
        except TypeError:  # an unhashable value: dumped here
            parts.append(_section_yaml.__wrapped__(section, value))
    return "".join(parts)


@section_cache
def _section_yaml(section: str, value: Any) -> str:
    dumped = value.model_dump(mode="json") if hasattr(value, "model_dump") else value
    return yaml.safe_dump({section: dumped}, sort_keys=False)


# ----------------------------------------------------------------------------- what is not normexp's


STRAY = re.compile(r"\.(?P<name>.+)\.(?P<what>tmp|old)-\d+")


def real_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def what_is(path: Path) -> str:
    return "symbolic link" if path.is_symlink() else "folder" if path.is_dir() else "file"


def in_the_way(run_dir: Path) -> str | None:
    """What stands at `run_dir` that normexp did not write and so never replaces, removes or follows to
    delete: a symbolic link (normexp makes none: the link and its target are the user's), anything that
    is not a folder, or, in a folder, something not a file under one of the names normexp writes there
    (it could not be carried into the new run folder beside normexp's file). Or a folder that is not
    normexp's (`not_normexp_s`) holding a file under one of those names: the user's, which a new run
    folder would replace. None where a run folder may go."""
    if run_dir.is_symlink() or (os.path.lexists(run_dir) and not run_dir.is_dir()):
        return f"a {what_is(run_dir)} normexp did not write is in the way"
    for name in RUN_DIR_FILES:
        entry = run_dir / name
        if os.path.lexists(entry) and (entry.is_symlink() or not entry.is_file()):
            return f"{name} in it: a {what_is(entry)} normexp did not write is in the way"
    named = [name for name in RUN_DIR_FILES if (run_dir / name).is_file()]
    if named and not_normexp_s(run_dir):
        return (f"a folder normexp did not write (files of yours with {', '.join(named)}, but no {DONE_FILE} "
                f"or {FAILED_FILE}) is in the way")
    return None


def not_normexp_s(folder: Path) -> bool:
    """Whether a real folder named by a run id is not one normexp wrote: it holds files normexp does
    not write, and neither done marker. normexp builds a run folder aside and swaps it in whole (with
    done.json or failed.json), so no run it left unfinished looks so; a folder of normexp's own files
    alone is what a killed older release could leave."""
    if not real_dir(folder) or any(os.path.lexists(folder / name) for name in (DONE_FILE, FAILED_FILE)):
        return False
    return bool(foreign_entries(folder))


def _own_entry(entry: Path) -> bool:
    """Whether `entry`, in a run folder (or one being built or replaced), is a file normexp writes there:
    one of RUN_DIR_FILES, or its temporary name (`.done.json.tmp-PID`). Anything else is the user's."""
    match = STRAY.fullmatch(entry.name)
    named = entry.name in RUN_DIR_FILES or (match is not None and match["what"] == "tmp"
                                            and match["name"] in RUN_DIR_FILES)
    return named and entry.is_file() and not entry.is_symlink()


def foreign_entries(folder: Path) -> list[Path]:
    """The entries of a run folder that normexp did not write (a user's notes, folders, links)."""
    return [entry for entry in sorted(folder.iterdir()) if not _own_entry(entry)]


def out_folder_problem(out_dir: Path) -> str | None:
    """Why `out_dir` cannot be an output folder (a symbolic link loop or a dangling link, a file, a name
    the file system refuses), else None: it is a folder, or a path where one can be made."""
    try:
        if is_symlink_loop(out_dir):  # checked first: to exists() a loop is simply missing
            return SYMLINK_LOOP
        if out_dir.is_symlink() and not out_dir.exists():
            return f"a symbolic link to {os.readlink(out_dir)}, which does not exist"
        if out_dir.exists() and not out_dir.is_dir():
            return "is a file, not a folder"
    except OSError as exc:  # a name too long for the file system, a folder on the way that cannot be searched
        return f"cannot use as the output folder: {exc.strerror}"
    return None
