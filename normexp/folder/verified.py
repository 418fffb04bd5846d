"""The record of verified runs, .verified.json (`Verified`): what passed every check of `inspect_run`, so
that a folder of 10,000 runs is not checked from scratch by every command; and `checks_version`, whose
checks wrote it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import normexp
from normexp import __version__
from normexp.folder.atomic import atomic_write
from normexp.folder.layout import (
    BLOCKS_FILE,
    CONFIG_FILE,
    DONE_FILE,
    METRICS_FILE,
    SHARPNESS_FILE,
    VERIFIED_FILE,
    RunState,
    sha256_hex,
)


class Verified:
    """What a sweep folder's runs were when they last passed every check of `inspect_run` (thorough), so
    that a command reading 10,000 runs does not check each again from scratch: per run id, the SHA-256
    of its done.json, its fields, and the stamps of its files (`file_stamps`: size, mtime, ctime, inode).
    The folder keeps it in .verified.json (`inspect.verified_states`); `checks_version` says whose checks
    wrote it.

    Two levels, and what each can prove:

    - **Its content** (always): a run whose done.json is byte for byte one that passed is not checked
      field by field again, but its config.yaml and metrics.csv (and blocks.csv, sharpness.csv) are read and must have
      the SHA-256 and rows done.json vouches for. Any change to any byte of the run is seen (a changed
      done.json has another SHA-256 and is checked in full). What is not redone is re-deriving, from the
      same bytes, the verdict they earned; what it cannot cover is a record written on purpose to vouch
      for a done.json that fails (a damaged record names no done.json there is).
    - **Its stamps** (`trust_stamps`: `report`, `plot`, a sweep; never `verify`): where every file of the
      run still has the stamp it had when it passed, nothing is read. A stamp shows that no one asked
      the file system to change the file since: a write, a rename over it, a `touch` all change its
      ctime, which no program can set back. It cannot show that the bytes on the disk are still those:
      corruption under the file system (a failing disk, bit rot) changes no stamp. `normexp verify`
      re-reads and re-hashes every file, stamps or not. A stamp taken within `SETTLED_NS` of the
      file's last change is not recorded (a change in the same clock tick could keep it), nor one in
      the future (another machine's clock): such a run is read again next time."""

    def __init__(self, runs: dict[str, dict[str, Any]] | None = None, trust_stamps: bool = False,
                 stamping: bool = True) -> None:
        self.runs = dict(runs or {})
        self.trust_stamps = trust_stamps
        self.stamping = stamping  # whether `record` gets the files' stamps (a record that is not kept needs none)
        self.forgotten: set[str] = set()  # runs recorded before that no longer pass
        self.changed = False

    @classmethod
    def from_data(cls, data: Any, trust_stamps: bool = False, stamping: bool = True) -> Verified:
        """The record `data()` gave (read back from JSON); empty where it is of other checks, and without
        any entry that is not as `record` writes it."""
        runs = data.get("runs") if isinstance(data, dict) and data.get("checks") == checks_version() else None
        return cls({rid: entry for rid, entry in runs.items() if _valid_entry(entry)} if isinstance(runs, dict)
                   else {}, trust_stamps, stamping)

    def data(self) -> dict[str, Any]:
        return {"checks": checks_version(), "runs": self.runs}

    def unchanged(self, run_dir: Path) -> dict[str, Any] | None:
        """The done.json fields of the run in `run_dir` where its files' stamps are those it passed with
        (and stamps are trusted), else None."""
        entry = self.runs.get(run_dir.name)
        if not self.trust_stamps or entry is None or "stamps" not in entry:
            return None
        # the files it passed with (a file that was not there then, blocks.csv, is vouched for by no done.json)
        return entry["done"] if file_stamps(run_dir, entry["stamps"]) == entry["stamps"] else None

    def passed(self, rid: str, digest: str) -> bool:
        """Whether `digest` is the SHA-256 of the done.json with which run `rid` passed."""
        entry = self.runs.get(rid)
        return entry is not None and entry["sha256"] == digest

    def record(self, rid: str, state: RunState, stamps: list[list[int] | None] | None) -> None:
        """The outcome of checking run `rid`, whose files had `stamps` before they were read (None: too
        recent to be trusted, `settled`)."""
        if state.kind != "finished":
            self.changed |= self.runs.pop(rid, None) is not None
            self.forgotten.add(rid)
            return
        entry = {"sha256": state.sha256, "done": state.done, **({"stamps": stamps} if stamps is not None else {})}
        if self.runs.get(rid) != entry:
            self.runs[rid], self.changed = entry, True
        self.forgotten.discard(rid)


def _valid_entry(entry: Any) -> bool:
    if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and isinstance(entry.get("done"), dict)
            and isinstance(entry["done"].get("config_hash"), str)):
        return False
    stamps = entry.get("stamps", [])
    return isinstance(stamps, list) and all(stamp is None or (isinstance(stamp, list) and len(stamp) == 4)
                                            for stamp in stamps)


SETTLED_NS = 2_000_000_000  # a stamp is recorded once its file is this old (file systems' clock ticks: 1 ns to 2 s)


def file_stamps(run_dir: Path, like: list[list[int] | None] | None = None) -> list[list[int] | None]:
    """The stamp of each file a run folder's result is read from (None: not there): size, mtime, ctime
    and inode, in nanoseconds. `like`: only of the files these stamps have (the others: None, unread)."""
    stamps = []
    for i, name in enumerate(STAMPED_FILES):
        if like is not None and (i >= len(like) or like[i] is None):
            stamps.append(None)
            continue
        try:
            stat = os.stat(os.path.join(run_dir, name))
        except OSError:
            stamps.append(None)
            continue
        stamps.append([stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino])
    return stamps


STAMPED_FILES = (DONE_FILE, CONFIG_FILE, METRICS_FILE, BLOCKS_FILE, SHARPNESS_FILE)


def settled(stamps: list[list[int] | None], taken: int) -> bool:
    """Whether every file was last changed (mtime, ctime) at least SETTLED_NS before `taken` (the time
    its stamp was taken, in the same nanoseconds), and so not in the future either."""
    return all(stamp is None or max(stamp[1], stamp[2]) <= taken - SETTLED_NS for stamp in stamps)


def trusted_sources(package: Path) -> list[Path]:
    """The source files, in `package` (normexp's folder), of the code that decides whether a run folder is
    trusted: every file of folder/ (the files' names and texts, run ids, the checks, this record), the
    config's validation (config/) and the names of users' placements (registry.py)."""
    return [*sorted((package / "folder").glob("*.py")), *sorted((package / "config").glob("*.py")),
            package / "registry.py"]


def checks_digest(package: Path) -> str:
    """normexp's version and the files of `trusted_sources(package)`, hashed (`checks_version`)."""
    digest = hashlib.sha256(__version__.encode())
    for path in trusted_sources(package):
        try:
            digest.update(path.read_bytes())
        except OSError:  # installed without its sources: the version alone
            continue
    return digest.hexdigest()


@functools.cache
def checks_version() -> str:
    """What a .verified.json holds for: normexp's version and the source of the code that decides a
    verdict (`trusted_sources`), hashed. A change to any of those files sets every folder's record aside:
    each run is checked in full once more."""
    return checks_digest(Path(normexp.__file__).parent)


def reset() -> None:
    """Forget `checks_version`, as a fresh process starts: the next call hashes the files again."""
    checks_version.cache_clear()


VERIFIED_CHECKSUM = "# normexp's record of verified runs; sha256 of the lines below: "


def read_verified(out_dir: Path, trust_stamps: bool = False, stamping: bool = True) -> Verified:
    """The folder's .verified.json (an empty record if there is none, or it is damaged, or of other checks,
    or not normexp's): `Verified`."""
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
    return body if first == VERIFIED_CHECKSUM + sha256_hex(body.encode()) else None


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
        atomic_write(path, f"{VERIFIED_CHECKSUM}{sha256_hex(body.encode())}\n{body}")
