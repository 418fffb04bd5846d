"""Writing a run folder: built whole under a temporary name (`.<run_id>.tmp-<pid>`) and swapped in at once
(`swap_in`), so a reader sees the old result or the new one, never neither, and a crash at any moment loses
no finished result (`recover_strays` tidies up what a killed writer left). Only normexp's own files go with
a replaced folder: whatever else a user put in it moves into the new one. A run of release 0.1 that passes
is given its checksums once (`stamp_run`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import platform
import shutil
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from normexp.config import RunConfig
from normexp.environment import provenance
from normexp.folder.atomic import atomic_write, fsync_dir
from normexp.folder.ids import config_hash, is_run_id
from normexp.folder.inspect import inspect_run, read_text
from normexp.folder.layout import (
    BLOCKS_FILE,
    CONFIG_FILE,
    DONE_FILE,
    FAILED_FILE,
    METRICS_FILE,
    RUN_DIR_FILES,
    SHARPNESS_FILE,
    STRAY,
    TOP_FILES,
    VOUCHED_FILES,
    InTheWay,
    RunState,
    config_yaml,
    encode_done,
    file_record,
    foreign_entries,
    in_the_way,
    metrics_csv,
    real_dir,
    run_stats,
    what_is,
)


def versions() -> dict[str, str]:
    import torch

    from normexp import __version__

    return {"normexp": __version__, "torch": torch.__version__, "python": platform.python_version()}


@dataclass(frozen=True)
class FinishedRun:
    """A finished run's outcome, as a worker or engine hands it to be written (`write_run`)."""

    metrics: dict[str, list[float]]
    status: str  # completed | diverged
    wall_s: float
    threads: int
    engine: str
    device: str
    blocks: dict[str, list[float]] | None = None  # blocks.csv's columns, for a run with train.log_blocks
    stopped_at: int | None = None  # train.stop_when stopped the run after this step (None: it ran every step)
    stop_reason: str | None = None  # train.stop_when's reason, with stopped_at
    sharpness: dict[str, list[float]] | None = None  # sharpness.csv's columns, for a run with train.log_sharpness


def remove_run_folder(run_dir: Path) -> bool:
    """Remove a broken run folder that holds normexp's own files alone (config.yaml, metrics.csv, ...,
    their temporary names). False, touching nothing, where anything in it is the user's, or it is a
    link: normexp removes only what it wrote."""
    if not real_dir(run_dir) or foreign_entries(run_dir):
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
        fsync_dir(src)
        fsync_dir(dst)


def _carriable(folder: Path, run_dir: Path) -> bool:
    """Whether everything in `folder` that normexp did not write can go into `run_dir` (`_carry_over`)."""
    foreign = foreign_entries(folder)
    return not foreign or (real_dir(run_dir) and not any(os.path.lexists(run_dir / e.name) for e in foreign))


def _discard(folder: Path, run_dir: Path) -> bool:
    """Remove `folder` (a run folder being built, or the old one swapped out) once what normexp did not
    write in it has gone into `run_dir`, where that is a real folder. False, and `folder` stays, where
    some of it could not go: normexp removes its own files only."""
    if real_dir(run_dir):
        _carry_over(folder, run_dir)
    if foreign_entries(folder):
        return False
    shutil.rmtree(folder)
    return True


def _staging_dir(run_dir: Path) -> Path:
    """Where a run folder is built before it is swapped in: a hidden sibling, unique to this process.
    One left by a killed process of the same id is discarded first (`_discard`), if it can be."""
    staging = run_dir.with_name(f".{run_dir.name}.tmp-{os.getpid()}")
    if real_dir(staging):
        _discard(staging, run_dir)
    if os.path.lexists(staging):
        raise InTheWay(staging, f"a {what_is(staging)} normexp did not write is in the way")
    staging.mkdir(parents=True)
    return staging


@contextlib.contextmanager
def staged(run_dir: Path) -> Iterator[Path]:
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
        if real_dir(staging):
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
        fsync_dir(run_dir.parent)
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
    fsync_dir(run_dir.parent)


def write_run(run_dir: Path, cfg: RunConfig, run: FinishedRun, command: str = "") -> dict[str, Any]:
    """Write one finished run's folder: config, metrics (blocks.csv with train.log_blocks, sharpness.csv
    with train.log_sharpness: nan and inf as repr() writes them), then the
    done marker that vouches for them. done.json also records what made the run (`provenance`: the
    commit, CPU, torch build) and the sweep's `command` line; neither enters the run id, and a
    done.json without them (written before they were recorded) is as valid as ever.
    The folder is built aside and swapped in whole (nothing is left aside if that fails). Returns
    done.json's fields."""
    with staged(run_dir) as staging:
        done = _write_staged(staging, run_dir.name, cfg, run, command)
        swap_in(staging, run_dir)
    return done


def _write_staged(staging: Path, rid: str, cfg: RunConfig, run: FinishedRun, command: str) -> dict[str, Any]:
    """Write a finished run's files into its staging folder, done.json last; returns done.json's fields."""
    config_text = config_yaml(cfg)
    metrics_text = metrics_csv(run.metrics)
    atomic_write(staging / CONFIG_FILE, config_text)
    atomic_write(staging / METRICS_FILE, metrics_text)
    extra = {name: metrics_csv(columns) for name, columns in ((BLOCKS_FILE, run.blocks),
                                                               (SHARPNESS_FILE, run.sharpness)) if columns is not None}
    for name, text in extra.items():
        atomic_write(staging / name, text)
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
                  **{name: file_record(name, text) for name, text in extra.items()}},
    }
    atomic_write(staging / DONE_FILE, encode_done(done))
    return done


def write_failed(run_dir: Path, cfg: RunConfig, status: str, error: str) -> bool:
    """Record a run that raised or crashed; it has no done.json, so the next sweep retries it. A
    verified finished result already there (a --force rerun that failed) is kept: returns False."""
    if inspect_run(run_dir, cfg).finished:
        return False
    with staged(run_dir) as staging:
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
    match = STRAY.fullmatch(path.name)
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
        match = STRAY.fullmatch(path.name)
        target = path.with_name(match["name"])
        if match["what"] == "old" and path.parent == out_dir and not os.path.lexists(target):
            os.replace(path, target)
            actions.append(f"{path.name}: put back as {target.name}")
    for path in stray_paths(out_dir):  # again: a folder put back may be where a user's files go
        if path.is_dir():  # a real folder: `stray_paths` lists no symbolic link
            theirs = len(foreign_entries(path))
            if not _discard(path, path.with_name(STRAY.fullmatch(path.name)["name"])):
                actions.append(f"{path.relative_to(out_dir)}: left in place (it holds files normexp did not write)")
                continue
            actions.append(f"{path.relative_to(out_dir)}: removed" + (
                f", once the {theirs} entries normexp did not write in it went back into its run folder"
                if theirs else ""))
            continue
        path.unlink(missing_ok=True)
        actions.append(f"{path.relative_to(out_dir)}: removed")
    return actions


def stamp_run(run_dir: Path, state: RunState) -> dict[str, Any]:
    """Give an unstamped run (release 0.1, just re-read and verified by `inspect_run`) its checksums."""
    assert state.kind == "unstamped" and state.done is not None
    records = {name: file_record(name, read_text(run_dir / name)) for name in VOUCHED_FILES}
    done = {**state.done, "restamped": True, "files": records}
    atomic_write(run_dir / DONE_FILE, encode_done(done))
    return done
