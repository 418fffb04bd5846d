"""Turn a sweep's events into what the user sees: a Rich progress bar on a terminal, plain lines
otherwise (logs, CI): one per run for a sweep of up to PER_RUN_LINES runs, else a progress line every
LINE_EVERY_RUNS runs or LINE_EVERY_S seconds (done, statuses, elapsed, ETA) and one line for each run
that fails or needs a word (corrupt, redone); only the failed runs with --quiet. A "waiting" event (nothing can train
for now) is shown in every mode: on `notices` (stderr), or above the bar on a terminal. A sweep never
stops because these lines cannot be written (`> /dev/full`): the output is silenced (normexp/output.py)
and the runs go on. The core never imports this module."""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from normexp.output import OutputLost
from normexp.sweep import EventCallback, SweepEvent

PER_RUN_LINES = 200  # a larger sweep's log gets progress lines, not a line per run
LINE_EVERY_S = 30.0
LINE_EVERY_RUNS = 0.05  # a share of the sweep's runs
FIRST_BURST_S = 0.25  # runs finishing this soon after a wait ends came with its first (one batch, one unit)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


class ProgressLines:
    """The plain progress line of a large sweep: `[done/total] pct · statuses · elapsed, ETA`, due every
    LINE_EVERY_RUNS of the runs or LINE_EVERY_S seconds, and at the end. The ETA is the runs left times the
    time per run trained since the longest wait so far for a finished run (the first one's included): what
    came before it (starting the workers, compiling a step: 1.5 minutes before a compiled sweep's first
    batch, even where a run failed at once before it) is paid once, not per run. The runs of the batch that
    ends the wait, finishing within FIRST_BURST_S of its first, mark the start together; until a run
    finishes after them, the ETA is "?". Skipped runs take no time and do not count."""

    def __init__(self, total: int, clock=time.monotonic) -> None:
        self.total, self.clock = total, clock
        self.start = self.last_time = self.last_trained = clock()
        self.last_done, self.trained = 0, 0
        self.longest = -1.0  # the longest wait for a finished run so far
        self.waited = 0.0  # when that wait ended
        self.mark: tuple[float, int] = (0.0, 0)  # when the batch that ended it was in, and the runs trained then
        self.statuses: Counter[str] = Counter()

    def update(self, event: SweepEvent) -> str | None:
        """Account for `event`; the progress line if one is due now, else None."""
        now = self.clock()
        if event.kind in ("finished", "failed"):
            self.trained += 1
            if now - self.last_trained > self.longest:
                self.longest, self.waited = now - self.last_trained, now
            if now - self.waited <= FIRST_BURST_S:
                self.mark = (now, self.trained)
            self.last_trained = now
        if event.kind in ("finished", "failed", "skipped"):
            self.statuses[event.status or event.kind] += 1
        due = (event.done - self.last_done >= max(1, int(self.total * LINE_EVERY_RUNS))
               or now - self.last_time >= LINE_EVERY_S or event.done >= self.total)
        if not due or event.done == self.last_done:
            return None
        self.last_done, self.last_time = event.done, now
        return self.line(now, event.done)

    def line(self, now: float, done: int) -> str:
        elapsed = now - self.start
        left = self.total - done
        since, then = self.mark
        per_run = (now - since) / (self.trained - then) if self.trained > then else None
        eta = "done" if not left else f"ETA {_duration(per_run * left)}" if per_run is not None else "ETA ?"
        counts = ", ".join(f"{n} {status}" for status, n in sorted(self.statuses.items()))
        return f"[{done}/{self.total}] {100 * done // self.total}% · {counts} · {_duration(elapsed)} elapsed, {eta}"


def _line(event: SweepEvent) -> str:
    if event.kind in ("waiting", "engine"):
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
    if not console.is_terminal and total <= PER_RUN_LINES:
        def plain(event: SweepEvent) -> None:
            if event.kind != "skipped":
                (notices if event.kind == "waiting" else console).print(_line(event), markup=False)
        yield plain
        return
    if not console.is_terminal:
        lines = ProgressLines(total)

        def periodic(event: SweepEvent) -> None:
            if event.kind not in ("skipped", "finished"):  # failed, corrupt, redone, waiting, engine
                (notices if event.kind == "waiting" else console).print(_line(event), markup=False)
            line = lines.update(event)
            if line is not None:
                console.print(line, markup=False)
        yield periodic
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("runs", total=total)

        def bar(event: SweepEvent) -> None:
            progress.update(task, completed=event.done)
            if event.kind in ("failed", "redone", "corrupt", "waiting", "engine"):  # above the bar, not over stderr
                progress.console.print(_line(event), markup=False)
        yield bar
