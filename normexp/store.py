"""Writing the run-directory contract (SPEC §6): atomic writes, done markers, the summary, the sweep lock.

    <out>/
      sweep.yaml              the latest invocation's resolved sweep (after --set), loadable again
      history.jsonl           one JSON line per invocation: command line, time, commit, CPU, torch,
                              the sweep file's text as given, the resolved grid, runs planned and new
      summary.csv             one row per run the folder holds (`folder_runs`), rebuilt from the run
                              folders every time; `threshold` and `trained` judge each finished run by
                              the trained rule (sweep.yaml's report.trained_below, else ln(C)/10)
      .lock                   held (flock) while a sweep writes here; holds the owner's PID and host
      .lock.writes            shards only (`--shard`, `SweepLock(shared=True)`): see `folder_writes`
      <run_id>/config.yaml    the resolved run config: `normexp sweep <run_id>/config.yaml` reruns it
                              alone (a sweep of one run, into runs/<run_id> unless --out)
      <run_id>/metrics.csv    step, loss, acc, lr, grad_norm: one row per recorded step, floats as repr()
      <run_id>/blocks.csv     with train.log_blocks only: one row per logged step and block (blocklog.py)
      <run_id>/failed.json    only for a run that raised: the error (the run is retried next time)
      <run_id>/done.json      written last: the run is complete (+ summary numbers, timings, versions)

Every file is written to a temporary name, fsynced and renamed, so a reader (or a rerun after `kill -9`)
never sees half a file (a sweep syncs a batch's run folders together: `synced_together`). A run folder
is built whole under a temporary name (`.<run_id>.tmp-<pid>`) and swapped in at once, so a reader sees
the old result or the new one, never neither, and a crash at any moment loses no finished result
(`recover_strays` tidies up). Only normexp's own files go with a replaced folder: whatever else a user
put in it moves into the new one.

What a run folder holds and whether it can be trusted (its names, its run id, `inspect_run`) is
normexp/runfolder.py's: this module writes, that one reads and checks.
"""

from __future__ import annotations

import contextlib
import csv
import ctypes
import errno
import fcntl
import io
import json
import os
import platform
import shutil
import socket
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from normexp.config import (
    SYMLINK_LOOP,
    ConfigError,
    ReportConfig,
    RunConfig,
    Sweep,
    build_sweep,
    chance_classes,
    flatten,
    is_symlink_loop,
    load_sweep,
    parse_yaml,
    trained_threshold,
    validate_run,
)
from normexp.environment import provenance
from normexp.runfolder import (
    _STRAY,
    BLOCKS_FILE,
    CONFIG_FILE,
    DONE_FILE,
    FAILED_FILE,
    HISTORY_FILE,
    IN_THE_WAY_REMEDY,
    LOCK_FILE,
    METRICS_FILE,
    RUN_DIR_FILES,
    SUMMARY_FILE,
    SUMMARY_STATS,
    SWEEP_FILE,
    TOP_FILES,
    VERIFIED_FILE,
    VOUCHED_FILES,
    InTheWay,
    RunState,
    StoreError,
    Verified,
    _read_text,
    _real_dir,
    _sha256,
    _what,
    config_hash,
    config_yaml,
    earlier_run_id,
    encode_done,
    file_record,
    foreign_entries,
    in_the_way,
    inspect_run,
    is_run_id,
    run_id,
    run_stats,
    superseded_problem,
)


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to `path` so that `path` holds either the old content or all of the new."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            if not _deferring():
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    if _deferring():
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_DEFERRED = threading.local()  # .folder: the folder whose file system `synced_together` syncs at its end


def _deferring() -> bool:
    return getattr(_DEFERRED, "folder", None) is not None


@contextlib.contextmanager
def synced_together(folder: Path) -> Iterator[None]:
    """Writes made inside (by this thread) reach the disk together when the block ends, however it ends:
    one sync of `folder`'s file system (Linux syncfs; elsewhere os.sync) instead of an fsync per file and
    folder written (a run folder's seven cost ~6 ms of CPU on an ext4 VM, as much as a fast engine run's
    training; one sync per batch: ~8 ms, ~0.5 ms a run of a 16-run batch). Until then a power cut may lose
    those writes (never a kill: the kernel holds them), and what it leaves half-written is caught as every
    damaged run folder is (done.json's checksums), never read as a result: the run trains again. The sync
    also waits for what other programs left unwritten on that file system (a 600 MB download not yet on
    disk: ~0.5 s, once), and an error it reports (which may be another program's) is not raised: the
    checksums catch what it lost."""
    if _deferring():
        yield
        return
    _DEFERRED.folder = folder
    try:
        yield
    finally:
        _DEFERRED.folder = None
        _sync_file_system(folder)


def _sync_file_system(folder: Path) -> None:
    syncfs = getattr(ctypes.CDLL(None, use_errno=True), "syncfs", None) if sys.platform.startswith("linux") else None
    if syncfs is None:
        os.sync()
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        if syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


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


def other_threads(done: dict[str, Any], threads: int) -> str | None:
    """Why a finished run must be redone to sit in a sweep that trains with `threads` torch threads:
    the thread count changes the last bits of CPU kernels, and one sweep never mixes thread counts.
    None when its done.json records the same count."""
    recorded = done.get("threads")
    if recorded == threads:
        return None
    return f"trained with {recorded} torch threads, this sweep uses {threads}: redone"


def versions() -> dict[str, str]:
    import torch

    from normexp import __version__

    return {"normexp": __version__, "torch": torch.__version__, "python": platform.python_version()}


@dataclass(frozen=True)
class FinishedRun:
    """A finished run's outcome, as a worker or engine hands it to the store."""

    metrics: dict[str, list[float]]
    status: str  # completed | diverged
    wall_s: float
    threads: int
    engine: str
    device: str
    blocks: dict[str, list[float]] | None = None  # blocks.csv's columns, for a run with train.log_blocks
    stopped_at: int | None = None  # train.stop_when stopped the run after this step (None: it ran every step)
    stop_reason: str | None = None  # train.stop_when's reason, with stopped_at


# ----------------------------------------------------------------------------- checksums


# ----------------------------------------------------------------------------- writing a run folder


def remove_run_folder(run_dir: Path) -> bool:
    """Remove a broken run folder that holds normexp's own files alone (config.yaml, metrics.csv, ...,
    their temporary names). False, touching nothing, where anything in it is the user's, or it is a
    link: normexp removes only what it wrote."""
    if not _real_dir(run_dir) or foreign_entries(run_dir):
        return False
    shutil.rmtree(run_dir)
    return True


def _refuse_in_the_way(run_dir: Path) -> None:
    what = in_the_way(run_dir)
    if what is not None:
        raise InTheWay(run_dir, what)


def _carry_over(src: Path, dst: Path) -> None:
    """Move every entry of `src` that normexp did not write into `dst`, as it is: a rename, so the same
    bytes, links still links, nothing followed. An entry whose name `dst` already holds stays."""
    moved = False
    for entry in foreign_entries(src):
        if not os.path.lexists(dst / entry.name):
            os.rename(entry, dst / entry.name)
            moved = True
    if moved:
        _fsync_dir(src)
        _fsync_dir(dst)


def _carriable(folder: Path, run_dir: Path) -> bool:
    """Whether everything in `folder` that normexp did not write can go into `run_dir` (`_carry_over`)."""
    foreign = foreign_entries(folder)
    return not foreign or (_real_dir(run_dir) and not any(os.path.lexists(run_dir / e.name) for e in foreign))


def _discard(folder: Path, run_dir: Path) -> bool:
    """Remove `folder` (a run folder being built, or the old one swapped out) once what normexp did not
    write in it has gone into `run_dir`, where that is a real folder. False, and `folder` stays, where
    some of it could not go: normexp removes its own files only."""
    if _real_dir(run_dir):
        _carry_over(folder, run_dir)
    if foreign_entries(folder):
        return False
    shutil.rmtree(folder)
    return True


def _staging_dir(run_dir: Path) -> Path:
    """Where a run folder is built before it is swapped in: a hidden sibling, unique to this process.
    One left by a killed process of the same id is discarded first (`_discard`), if it can be."""
    staging = run_dir.with_name(f".{run_dir.name}.tmp-{os.getpid()}")
    if _real_dir(staging):
        _discard(staging, run_dir)
    if os.path.lexists(staging):
        raise InTheWay(staging, f"a {_what(staging)} normexp did not write is in the way")
    staging.mkdir(parents=True)
    return staging


@contextlib.contextmanager
def _staged(run_dir: Path) -> Iterator[Path]:
    """A staging folder for `run_dir` (`_staging_dir`) that is removed if the block raises: a write that
    fails (a full disk) leaves no `.<run_id>.tmp-<pid>` of its own behind. Nothing else is touched; a
    finished result already in `run_dir` stays (`swap_in` puts it back if the swap itself fails), and so
    do the user's files in it (`swap_in` may have moved them into the staging folder: they go back).
    InTheWay, before anything is written, where a file or link stands at `run_dir`."""
    _refuse_in_the_way(run_dir)
    staging = _staging_dir(run_dir)
    try:
        yield staging
    except BaseException:
        if _real_dir(staging):
            with contextlib.suppress(OSError):  # the error that got us here is the one to report
                _discard(staging, run_dir)
        raise


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def swap_in(staging: Path, run_dir: Path) -> None:
    """Make the complete folder `staging` the run folder `run_dir`. A reader sees the old folder or the
    new one, never neither; where the file system cannot swap in one step, the old folder waits as
    `.<run_id>.old-<pid>` for the instant between two renames, and `recover_strays` puts it back if a
    crash falls in that instant. What the old folder holds that normexp did not write (a user's notes)
    is moved into the new one first, so that it is in place with it (a crash puts it back: `recover_strays`);
    only normexp's own files go with the old folder. InTheWay, touching nothing, where a file or link
    stands at `run_dir` (`in_the_way`)."""
    _refuse_in_the_way(run_dir)  # again: one may have appeared while the run's files were written
    if not run_dir.exists():
        os.replace(staging, run_dir)
        _fsync_dir(run_dir.parent)
        return
    _carry_over(run_dir, staging)
    if _exchange(staging, run_dir):
        _discard(staging, run_dir)  # it now holds the old folder
    else:
        old = run_dir.with_name(f".{run_dir.name}.old-{os.getpid()}")
        os.replace(run_dir, old)
        try:
            os.replace(staging, run_dir)
        except OSError:  # a full disk, say: the finished result goes back at once, not at the next sweep
            os.replace(old, run_dir)
            raise
        _discard(old, run_dir)
    _fsync_dir(run_dir.parent)


def write_run(run_dir: Path, cfg: RunConfig, run: FinishedRun, command: str = "") -> dict[str, Any]:
    """Write one finished run's folder: config, metrics (and blocks.csv with train.log_blocks), then the
    done marker that vouches for them. done.json also records what made the run (`provenance`: the
    commit, CPU, torch build) and the sweep's `command` line; neither enters the run id, and a
    done.json without them (written before they were recorded) is as valid as ever.
    The folder is built aside and swapped in whole (nothing is left aside if that fails). Returns
    done.json's fields."""
    with _staged(run_dir) as staging:
        done = _write_staged(staging, run_dir.name, cfg, run, command)
        swap_in(staging, run_dir)
    return done


def _write_staged(staging: Path, rid: str, cfg: RunConfig, run: FinishedRun, command: str) -> dict[str, Any]:
    """Write a finished run's files into its staging folder, done.json last; returns done.json's fields."""
    config_text = config_yaml(cfg)
    metrics_text = metrics_csv(run.metrics)
    atomic_write(staging / CONFIG_FILE, config_text)
    atomic_write(staging / METRICS_FILE, metrics_text)
    blocks_text = metrics_csv(run.blocks) if run.blocks is not None else None
    if blocks_text is not None:
        atomic_write(staging / BLOCKS_FILE, blocks_text)
    done = {
        "run_id": rid,
        "config_hash": config_hash(cfg),
        **run_stats(run.metrics, run.status),
        **({"stopped_at": run.stopped_at, "stop_reason": run.stop_reason} if run.stopped_at is not None else {}),
        "wall_s": run.wall_s,
        "threads": run.threads,
        "engine": run.engine,
        "device": run.device,
        "host": socket.gethostname(),
        "versions": versions(),
        "provenance": {**provenance(), "command": command},
        "files": {CONFIG_FILE: file_record(CONFIG_FILE, config_text),
                  METRICS_FILE: file_record(METRICS_FILE, metrics_text),
                  **({BLOCKS_FILE: file_record(BLOCKS_FILE, blocks_text)} if blocks_text is not None else {})},
    }
    atomic_write(staging / DONE_FILE, encode_done(done))
    return done


def write_failed(run_dir: Path, cfg: RunConfig, status: str, error: str) -> bool:
    """Record a run that raised or crashed; it has no done.json, so the next sweep retries it. A
    verified finished result already there (a --force rerun that failed) is kept: returns False."""
    if inspect_run(run_dir, cfg).finished:
        return False
    with _staged(run_dir) as staging:
        atomic_write(staging / CONFIG_FILE, yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        record = {"run_id": run_dir.name, "config_hash": config_hash(cfg), "status": status, "error": error}
        atomic_write(staging / FAILED_FILE, json.dumps(record, indent=2) + "\n")
        swap_in(staging, run_dir)
    return True


def _is_stray(path: Path, files: tuple[str, ...], run_folders: bool) -> bool:
    """Whether `path` bears a temporary name that normexp gives: `.FILE.tmp-PID`, a regular file, for one
    of `files`; or (`run_folders`: in the sweep folder) `.RUN_ID.tmp-PID` or `.RUN_ID.old-PID`, a real
    folder, that can be put back as RUN_ID or whose entries normexp did not write can go into RUN_ID
    (`swap_in` moves a user's files into the folder it swaps in). Never a symbolic link: normexp makes
    none, so one is a user's."""
    match = _STRAY.fullmatch(path.name)
    if match is None or path.is_symlink():
        return False
    if path.is_dir():
        target = path.with_name(match["name"])
        put_back = match["what"] == "old" and not os.path.lexists(target)
        return run_folders and is_run_id(match["name"]) and (put_back or _carriable(path, target))
    return match["what"] == "tmp" and match["name"] in files and path.is_file()


def stray_paths(out_dir: Path) -> list[Path]:
    """Temporary files and folders that only a killed writer leaves behind, in `out_dir` and in its
    run folders: `.NAME.tmp-PID` (a file or run folder being written), `.RUN_ID.old-PID` (a run folder
    being replaced). Only names normexp gives count, and only in folders it writes (the sweep folder,
    folders named by a run id): a user's `my_analysis/.draft.tmp-12` is not normexp's to remove."""
    top = sorted(out_dir.iterdir()) if out_dir.is_dir() else []
    found = [p for p in top if _is_stray(p, TOP_FILES, run_folders=True)]
    for folder in top:
        if is_run_id(folder.name) and folder.is_dir() and not folder.is_symlink():
            hidden = sorted(entry.name for entry in os.scandir(folder) if entry.name.startswith("."))  # as all strays
            found += [p for p in (folder / name for name in hidden) if _is_stray(p, RUN_DIR_FILES, run_folders=False)]
    return found


def recover_strays(out_dir: Path) -> list[str]:
    """Tidy what a killed writer left in `out_dir` (call it holding the lock): put back a run folder
    caught between the two renames of `swap_in`, then remove everything else `stray_paths` finds, a
    folder once the user's files in it have gone back into its run folder. Returns what it did, one
    line each."""
    actions = []
    for path in stray_paths(out_dir):
        match = _STRAY.fullmatch(path.name)
        target = path.with_name(match["name"])
        if match["what"] == "old" and path.parent == out_dir and not os.path.lexists(target):
            os.replace(path, target)
            actions.append(f"{path.name}: put back as {target.name}")
    for path in stray_paths(out_dir):  # again: a folder put back may be where a user's files go
        if path.is_dir():  # a real folder: `stray_paths` lists no symbolic link
            theirs = len(foreign_entries(path))
            if not _discard(path, path.with_name(_STRAY.fullmatch(path.name)["name"])):
                actions.append(f"{path.relative_to(out_dir)}: left in place (it holds files normexp did not write)")
                continue
            actions.append(f"{path.relative_to(out_dir)}: removed" + (
                f", once the {theirs} entries normexp did not write in it went back into its run folder"
                if theirs else ""))
            continue
        path.unlink(missing_ok=True)
        actions.append(f"{path.relative_to(out_dir)}: removed")
    return actions


# ----------------------------------------------------------------------------- verifying a run folder


def stamp_run(run_dir: Path, state: RunState) -> dict[str, Any]:
    """Give an unstamped run (release 0.1, just re-read and verified by `inspect_run`) its checksums."""
    assert state.kind == "unstamped" and state.done is not None
    records = {name: file_record(name, _read_text(run_dir / name)) for name in VOUCHED_FILES}
    done = {**state.done, "restamped": True, "files": records}
    atomic_write(run_dir / DONE_FILE, encode_done(done))
    return done


def verified_states(out_dir: Path, runs: dict[str, RunConfig], record: bool = False,
                    trust_stamps: bool = True) -> dict[str, RunState]:
    """Each run of `runs` (by run id), as `inspect_run` finds it in `out_dir`, thoroughly, where the
    folder's .verified.json does not say it passed before unchanged (`runfolder.Verified`: by the SHA-256
    of its files, or, with `trust_stamps`, their stamps). With `record` (a command that writes the folder:
    a sweep, `verify --fix`), what passes now is recorded there for the next command (`save_verified`);
    readers leave the folder as it is."""
    if not runs:
        return {}
    verified = read_verified(out_dir, trust_stamps, stamping=record)
    states = {rid: inspect_run(out_dir / rid, cfg, thorough=True, verified=verified) for rid, cfg in runs.items()}
    if record and verified.changed:
        save_verified(out_dir, verified)
    return states


VERIFIED_CHECKSUM = "# normexp's record of verified runs; sha256 of the lines below: "


def read_verified(out_dir: Path, trust_stamps: bool = False, stamping: bool = True) -> Verified:
    """The folder's .verified.json (an empty record if there is none, or it is damaged, or of other checks,
    or not normexp's): `runfolder.Verified`."""
    body = _verified_body(out_dir / VERIFIED_FILE)
    try:
        data = json.loads(body) if body is not None else None
    except ValueError:
        data = None
    return Verified.from_data(data, trust_stamps, stamping)


def _verified_body(path: Path) -> str | None:
    """The JSON under .verified.json's checksum line, where the checksum holds."""
    text = _own_verified(path)
    if text is None:
        return None
    first, _, body = text.partition("\n")
    return body if first == VERIFIED_CHECKSUM + _sha256(body.encode()) else None


def _own_verified(path: Path) -> str | None:
    """The text of .verified.json if it is normexp's (a file that starts with its checksum line), else None."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read() if not path.is_symlink() else ""
    except (OSError, UnicodeDecodeError):
        return None
    return text if text.startswith(VERIFIED_CHECKSUM) else None


def save_verified(out_dir: Path, verified: Verified) -> None:
    """Write `verified` as the folder's .verified.json, keeping what another command recorded there
    meanwhile for runs this one did not check. A cache: where it cannot be written (a read-only folder),
    or something normexp did not write stands there, nothing is, and the next command checks again."""
    path = out_dir / VERIFIED_FILE
    if os.path.lexists(path) and _own_verified(path) is None:
        return  # not normexp's: left alone
    runs = {**read_verified(out_dir).runs, **verified.runs}
    for rid in verified.forgotten:
        runs.pop(rid, None)
    body = json.dumps(Verified(runs).data(), separators=(",", ":")) + "\n"
    with contextlib.suppress(OSError):
        atomic_write(path, f"{VERIFIED_CHECKSUM}{_sha256(body.encode())}\n{body}")


# ----------------------------------------------------------------------------- the summary


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


SWEEP_CHECKSUM = "# sha256 of the lines below: "


def sweep_yaml(sweep: Sweep) -> str:
    """sweep.yaml's text: the resolved sweep under a first line holding the checksum of the rest, so a
    file cut at a line boundary (a sweep with fewer axes, still valid YAML) is caught, not obeyed."""
    body = sweep.to_yaml()
    return f"{SWEEP_CHECKSUM}{_sha256(body.encode())}\n{body}"


def _check_sweep_yaml(path: Path) -> None:
    """StoreError if sweep.yaml's checksum line does not match what follows it (a file without the line,
    written by release 0.1, is read as it is)."""
    try:
        first, _, body = path.read_text(encoding="utf-8").partition("\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise StoreError(f"{path}: cannot be read: {exc}") from None
    if first.startswith(SWEEP_CHECKSUM) and first[len(SWEEP_CHECKSUM):] != _sha256(body.encode()):
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
            runs[name] = validate_run(parse_yaml(_read_text(folder / CONFIG_FILE), CONFIG_FILE))
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


def append_history(out_dir: Path, record: dict[str, Any]) -> None:
    """Add one invocation's line to history.jsonl (the file is rewritten whole, atomically)."""
    path = out_dir / HISTORY_FILE
    try:
        before = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        before = ""
    if before and not before.endswith("\n"):
        before += "\n"  # a line cut by a crash stays apart from the next one
    atomic_write(path, before + json.dumps(record, sort_keys=False) + "\n")


def read_history(out_dir: Path) -> list[dict[str, Any]]:
    """history.jsonl's invocations, oldest first; unreadable lines are skipped (a folder of an earlier
    release has none)."""
    try:
        lines = (Path(out_dir) / HISTORY_FILE).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def write_summary(out_dir: Path, runs: Sequence[RunConfig], statuses: dict[str, str] | None = None) -> Path:
    """Rebuild summary.csv from the run folders (`statuses` names unfinished runs' state), and record the
    runs that pass in .verified.json (`verified_states`)."""
    path = out_dir / SUMMARY_FILE
    found = verified_states(out_dir, {run_id(cfg): cfg for cfg in runs}, record=True)
    atomic_write(path, summary_csv(out_dir, runs, statuses, found))
    return path


def sweep_name(out_dir: Path) -> str | None:
    """The name in `out_dir`'s sweep.yaml (None if there is none or it is unreadable)."""
    try:
        data = yaml.safe_load((out_dir / SWEEP_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    name = data.get("name") if isinstance(data, dict) else None
    return name if isinstance(name, str) else None


def _cell(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return json.dumps(value)
    return "" if value is None else value


def lock_owner(out_dir: Path) -> str | None:
    """Who holds `out_dir`'s sweep lock (its PID and host), or None if no sweep is writing there.
    Only reads: works on a read-only folder (where no shard, holding the lock shared, can be writing)."""
    try:
        fd, probe = os.open(Path(out_dir) / LOCK_FILE, os.O_RDWR), fcntl.LOCK_EX  # a shard's shared lock too
    except OSError:
        try:
            fd, probe = os.open(Path(out_dir) / LOCK_FILE, os.O_RDONLY), fcntl.LOCK_SH
        except OSError:
            return None
    try:
        fcntl.flock(fd, probe | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return SweepLock(Path(out_dir)).owner()
        raise
    finally:
        os.close(fd)
    return None


class SweepLock:
    """An exclusive, advisory lock on an output folder (flock on `<out>/.lock`).

    The kernel drops a flock when its process dies, so a lock left by a killed sweep is simply taken
    over; the file's content (PID, host) only serves the message shown to a second sweep.

    `shared`: the lock of one shard of a sweep (`normexp sweep --shard I/N`). Shards hold it together,
    each writing only its own runs' folders, and take `folder_writes` around what they all write
    (sweep.yaml, history.jsonl, summary.csv); a whole sweep, `verify --fix` or `merge` waits for none of
    them: it is refused while any shard writes, and a shard while one of those does. flock works across
    the hosts of a cluster's NFS (v4) file system; Lustre and GPFS need their `flock` mount option.
    """

    def __init__(self, out_dir: Path, shared: bool = False) -> None:
        self.path = out_dir / LOCK_FILE
        self.shared = shared
        self._fd: int | None = None

    def __enter__(self) -> SweepLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StoreError(f"{self.path.parent}: cannot use as the output folder: {exc.strerror}") from None
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise StoreError(f"{self.path.parent}: another sweep is writing here ({self.owner()}); "
                                 "wait for it to finish or choose another --out") from None
            raise
        if not self.shared:  # shards leave the owner line alone: `owner` says shards hold it
            os.ftruncate(fd, 0)
            os.write(fd, f"pid={os.getpid()} host={socket.gethostname()}\n".encode())
        self._fd = fd
        return self

    def owner(self) -> str:
        try:
            return self.path.read_text().strip() or "shards of a sweep (--shard), or owner unknown"
        except OSError:
            return "owner unknown"

    def __exit__(self, *exc_info: object) -> None:
        if self._fd is not None:
            if not self.shared:
                os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


WRITES_LOCK_FILE = ".lock.writes"


@contextlib.contextmanager
def folder_writes(out_dir: Path, shared: bool) -> Iterator[None]:
    """Around a write to a sweep folder's own files (sweep.yaml, history.jsonl, summary.csv) by one of
    the shards that hold its lock together (`SweepLock(shared=True)`): waits for the other shards' such
    writes (flock on `<out>/.lock.writes`), so that none is lost. A whole sweep, alone in its folder,
    writes without it (`shared` False)."""
    if not shared:
        yield
        return
    fd = os.open(Path(out_dir) / WRITES_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock
