"""Stop signals for the commands that train (`normexp sweep`, `python -m normexp.studies`): Ctrl-C,
SIGTERM (a timeout, Slurm, docker) and SIGHUP (a closed terminal). The first one stops cleanly: it
raises KeyboardInterrupt where the main thread is, and the command keeps every finished run. A second
one exits at once. Only light standard modules here: the handlers go in before the heavy imports."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
received: int | None = None  # the stop signal that is stopping this process's command, once one came


def on_stop_signals(handler: object) -> dict[int, object]:
    """Install `handler` (or a mapping of signal -> handler) for STOP_SIGNALS; return the previous ones."""
    previous = {}
    for signum in STOP_SIGNALS:
        previous[signum] = signal.signal(signum, handler[signum] if isinstance(handler, dict) else handler)
    return previous


def stop_cleanly(signum: int, frame: object) -> None:
    """First stop signal: record it and stop the command cleanly (KeyboardInterrupt). A second: exit at once."""
    global received
    if received is not None:
        os._exit(128 + signum)
    received = signum
    raise KeyboardInterrupt


def exit_stopped(code: int) -> None:
    """End a command that a stop signal stopped with `code` (128 + signal), atexit handlers run and output
    flushed, without the interpreter's own exit: a KeyboardInterrupt that escaped code the interpreter ran
    for an import (a Ctrl-C while torch loads) leaves a flag that makes that exit a death by SIGINT
    (return code -2) whatever `sys.exit` asked for."""
    import atexit
    import sys

    atexit._run_exitfuncs()  # noqa: SLF001 - what the interpreter's exit runs first
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    os._exit(code)


def signal_name(signum: int | None) -> str:
    return {signal.SIGTERM: "terminated (SIGTERM)", signal.SIGHUP: "hung up (SIGHUP)"}.get(signum, "interrupted")


@contextlib.contextmanager
def stop_signals_deferred() -> Iterator[None]:
    """Stop signals (Ctrl-C, SIGTERM, SIGHUP) that arrive in the block are raised again when it ends,
    for the handlers in place before it. (A thread's signal mask cannot do this: the kernel may hand a
    process-wide signal to any thread, torch's own among them.) Outside the main thread, which alone
    runs Python's signal handlers, the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {signum: signal.signal(signum, lambda signum, frame: pending.append(signum))
                for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(pending):
            signal.raise_signal(signum)
