"""Stop signals for the commands that train (`normexp sweep`, `python -m normexp.studies`): Ctrl-C,
SIGTERM (a timeout, Slurm, docker) and SIGHUP (a closed terminal). The first one stops cleanly: it
raises KeyboardInterrupt where the main thread is, and the command keeps every finished run. A second
one exits at once. Only `os` and `signal` here: the handlers go in before the heavy imports."""

from __future__ import annotations

import os
import signal

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


def signal_name(signum: int | None) -> str:
    return {signal.SIGTERM: "terminated (SIGTERM)", signal.SIGHUP: "hung up (SIGHUP)"}.get(signum, "interrupted")
