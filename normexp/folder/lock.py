"""The sweep folder's lock (`SweepLock`): exclusive for a whole sweep, `verify --fix` or `merge`, shared by
the shards of one sweep (`--shard`), which take `folder_writes` around what they all write.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from normexp.folder.layout import LOCK_FILE, WRITES_LOCK_FILE, StoreError


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
