"""normexp's per-user cache: where it lives, and its measurement files read, written and locked (no torch: a
sweep reads it before its workers start).

    user_cache_dir()   $XDG_CACHE_HOME/normexp, else ~/.cache/normexp; None without a home folder
    cache_folder()     $NORMEXP_CACHE_DIR, else user_cache_dir(), else a per-user temporary folder
    read_entries / write_entries   a versioned JSON file of entries (auto's engine choices, the fast workers'
                       MKL path), rewritten whole and renamed into place
    locked(path)       an exclusive lock across processes (the compiled steps, a measurement in progress)

What the cache holds can only save a measurement or a compile: a file that cannot be read, or of another
version, counts as empty.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path


def user_cache_dir() -> Path | None:
    """normexp's per-user cache folder (auto's measurements, the compiled steps): $XDG_CACHE_HOME/normexp
    where XDG_CACHE_HOME is an absolute path (the XDG rule: a relative one is ignored), else
    ~/.cache/normexp; None where the user has no home folder (no HOME, no passwd entry: a container
    run under a bare uid). Never the working directory: a run folder holds only what a sweep writes."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "normexp"
    try:
        return Path.home() / ".cache" / "normexp"
    except RuntimeError:  # "Could not determine home directory."
        return None


def cache_folder() -> Path:
    """$NORMEXP_CACHE_DIR, else `user_cache_dir()`, else (no home folder) a per-user temporary folder: the cache
    then lasts until the machine reboots."""
    folder = os.environ.get("NORMEXP_CACHE_DIR") or user_cache_dir()
    if folder is None:
        folder = Path(tempfile.gettempdir()) / f"normexp-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    return Path(folder)


def read_entries(path: Path, version: int) -> dict:
    """The entries of the cache file `path` if it is one of `version`, else {} (missing, unreadable, another
    version's)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # RecursionError: a file of nested brackets
        return {}
    if (not isinstance(data, dict) or type(data.get("version")) is not int or data["version"] != version
            or not isinstance(data.get("entries"), dict)):  # `is not int`: true == 1 in JSON read by Python
        return {}
    return data["entries"]


def write_entries(path: Path, version: int, entries: dict) -> None:
    """Write the cache file aside and rename it into place. The file is made with the user's umask, as any file
    they write (0644 under the usual 022; readable by a group sharing the cache folder under 002), not
    NamedTemporaryFile's 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "w", encoding="utf-8") as f:
            json.dump({"version": version, "entries": entries}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:  # a full disk, a folder where the file goes, Ctrl-C: no stray .tmp left behind
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def locked(path: Path, wait: bool = True) -> Iterator[bool]:
    """An exclusive lock on `path` across processes (released when the process dies), where the
    platform has one (fcntl); elsewhere none: two processes may then both do the work, and the last
    rename wins. Yields whether it is held: without `wait`, False where another process holds it."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield True
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
