"""Turn a sweep's events into what the user sees: a Rich progress bar on a terminal, one plain line
per run otherwise (logs, CI), only the failed runs with --quiet. A "waiting" event (nothing can train
for now) is shown in every mode: on `notices` (stderr), or above the bar on a terminal. A sweep never
stops because these lines cannot be written (`> /dev/full`): the output is silenced (normexp/output.py)
and the runs go on. The core never imports this module."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from normexp.output import OutputLost
from normexp.sweep import EventCallback, SweepEvent


def _line(event: SweepEvent) -> str:
    if event.kind == "waiting":
        return event.error
    if event.kind == "corrupt":
        return f"{event.run_id} corrupt, redone: {event.error}"
    loss = f" final loss {event.final_loss:.4f}" if event.final_loss is not None else ""
    detail = f": {event.error}" if event.error else ""
    return f"[{event.done}/{event.total}] {event.run_id} {event.status or event.kind}{loss}{detail}"


@contextlib.contextmanager
def sweep_progress(console: Console, total: int, quiet: bool,
                   notices: Console | None = None) -> Iterator[EventCallback]:
    with _shown(console, total, quiet, notices or console) as show:
        yield _unfailing(show)


def _unfailing(show: EventCallback) -> EventCallback:
    """`show`, except that an output that cannot be written stops the lines, not the sweep: the callback
    runs while runs are recorded, and an exception there would lose trained runs."""
    def call(event: SweepEvent) -> None:
        with contextlib.suppress(OutputLost):
            show(event)
    return call


@contextlib.contextmanager
def _shown(console: Console, total: int, quiet: bool, notices: Console) -> Iterator[EventCallback]:
    if quiet:  # failures are errors: still one line each
        def failures(event: SweepEvent) -> None:
            if event.kind in ("failed", "waiting"):
                (notices if event.kind == "waiting" else console).print(_line(event), markup=False)
        yield failures
        return
    if not console.is_terminal:
        def plain(event: SweepEvent) -> None:
            if event.kind != "skipped":
                (notices if event.kind == "waiting" else console).print(_line(event), markup=False)
        yield plain
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("runs", total=total)

        def bar(event: SweepEvent) -> None:
            progress.update(task, completed=event.done)
            if event.kind in ("failed", "redone", "corrupt", "waiting"):  # above the bar (it would draw over stderr)
                progress.console.print(_line(event), markup=False)
        yield bar
