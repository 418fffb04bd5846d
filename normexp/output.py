"""Standard output and error that may not be writable: `normexp report DIR > /dev/full`, a file on a full
disk or a quota, a pipe whose reader has gone.

`guard_streams` (the `normexp` command calls it before any command runs) puts a thin wrapper on
`sys.stdout` and `sys.stderr`. The first write or flush that fails points the stream's descriptor at
/dev/null: what was buffered, and everything printed after, goes nowhere, so neither a later print nor the
interpreter's flush at exit fails again (no "Exception ignored" after the command's own message). On
stdout that first failure raises `OutputLost`: a command lets it through, or catches it where printing
is not the work (a sweep trains on), and whoever says that the output was lost takes the loss
(`take_loss`): the CLI, at the end of every command whose loss nobody took (it may have been raised
inside a library that swallows every exception), with one `error:` line. On stderr, where errors go, a
failure is only recorded: there is nowhere left to say it.
The core never imports this module.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO


class OutputLost(Exception):
    """Standard output could not be written; `error` is why. Not an OSError, so that no handler meant
    for the files a command reads or writes takes it for one of theirs."""

    def __init__(self, error: OSError) -> None:
        super().__init__(f"cannot write the output: {error.strerror or error}")
        self.error = error


class GuardedStream:
    """`stream` (sys.stdout or sys.stderr), silenced at its first failure (see the module docstring).
    Everything else is the stream's own: `isatty`, `fileno`, `encoding`, `buffer`."""

    def __init__(self, stream: TextIO, raises: bool) -> None:
        self._stream = stream
        self._raises = raises
        self.lost: OSError | None = None  # the failure that silenced it
        self.taken = False  # whether the loss was said (`take_loss`)

    def write(self, text: str) -> int:
        if self.lost is None:
            try:
                return self._stream.write(text)
            except OSError as exc:
                self._lose(exc)
        return len(text)

    def flush(self) -> None:
        if self.lost is None:
            try:
                self._stream.flush()
            except OSError as exc:
                self._lose(exc)

    def _lose(self, exc: OSError) -> None:
        self.lost = exc
        _to_devnull(self._stream)
        if self._raises:
            raise OutputLost(exc) from None

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


def _to_devnull(stream: TextIO) -> None:
    """Point `stream`'s descriptor at /dev/null (the recipe of Python's documentation for a closed pipe):
    its buffered bytes then flush without error, to nowhere."""
    try:
        fd = stream.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError):  # no descriptor (a test's capture): nothing to flush at exit either
        return
    os.dup2(devnull, fd)
    os.close(devnull)


def guard_streams() -> None:
    """Wrap sys.stdout (its first failure raises `OutputLost`) and sys.stderr (silenced quietly); a stream
    that is None (closed when the process started, `>&-`) stays None."""
    if sys.stdout is not None and not isinstance(sys.stdout, GuardedStream):
        sys.stdout = GuardedStream(sys.stdout, raises=True)
    if sys.stderr is not None and not isinstance(sys.stderr, GuardedStream):
        sys.stderr = GuardedStream(sys.stderr, raises=False)


def take_loss(stream: object) -> OSError | None:
    """Why `stream` (sys.stdout, say) was silenced, for the caller to say: None if it was not (or is not
    guarded), or if the loss was taken before."""
    if not isinstance(stream, GuardedStream) or stream.lost is None or stream.taken:
        return None
    stream.taken = True
    return stream.lost
