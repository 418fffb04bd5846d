"""Where work runs: in the sweep's own process, in a local process pool, or on a Dask cluster.

The sweep process stays the coordinator: it plans work units (normexp/units.py: a batch of runs for the
batched and fast engines, one run for the reference engine), hands them to an executor, and writes every
result itself.
Workers receive configs as plain data and return metrics as plain data: they need no shared file
system, only normexp installed.

Every unit carries the torch thread count its runs use, and a worker sets it before it trains, so a
run's numbers do not depend on which executor ran it (the thread count changes the last bits of CPU
kernels; it is recorded in each run's done.json).

- `InProcessExecutor`: units in this process (the default): small reference runs and uncompiled
  fast engine batches two at a time in threads, the rest one after another.
- `PoolExecutor(workers)`: a local process pool (`--workers N`).
- `DaskExecutor(address)`: `--cluster local[:N]` starts an embedded LocalCluster, `--cluster
  tcp://HOST:PORT` uses a running scheduler (checked first: one that does not answer, or is not a
  Dask scheduler, is an ExecutorError). While the scheduler has no workers, it says so every 30 s
  (its `notify`: the sweep's "waiting" events). Needs the `dask` extra.

A worker that dies costs the unit it was training one attempt: the unit is retried once; if the retry
dies too, its runs are marked `crashed`. Units on other workers, and units not yet started, go on.
Pool workers die with their coordinator, even after `kill -9` (Dask's do so on their own).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from normexp.engines.cost import model_step_flops
from normexp.environment import set_thread_defaults, take_mkl_intel_path
from normexp.stopping import STOP_SIGNALS, stop_signals_deferred
from normexp.units import UnitResult, WorkUnit, crashed, run_unit

# ----------------------------------------------------------------------------- executors


PAIR_FLOPS = 1e9  # a run under this many FLOPs a step is bound by per-operation overhead, not arithmetic


def pairs_well(unit: WorkUnit) -> bool:
    """Whether a unit gains from training beside another in this process, on the CPU of a machine
    with more than one core: one small reference run, whose steps leave cores idle between many short
    operations (the article's runs: ~100 MFLOP a step), or a fast engine batch of such runs trained
    uncompiled, whose stacked operations keep a second core only partly busy (two 64-run batches at
    once: about 12% less time). Compiled steps are not shared between threads. Batches of bigger runs
    train one after another: a pair holds two batches' memory at once (two 64-run batches of width
    512: 22 GB of peak RSS, against 11 GB one after another) for little time saved."""
    if unit.device != "cpu" or usable_cores() < 2 or unit.compile:
        return False
    return unit.engine in ("reference", "fast") and all(model_step_flops(cfg) < PAIR_FLOPS for cfg in unit.runs)


def usable_cores() -> int:
    """The cores this process may run on (os.sched_getaffinity, Linux); elsewhere (macOS) os.cpu_count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class InProcessExecutor:
    """Run units in the sweep's own process: small reference runs and uncompiled fast batches
    (`pairs_well`) two at a time in threads, everything else one after another.

    Two threads change no bits: each run keeps its own thread count (torch's count is per thread, and
    only runs of one count are paired), seeding and drawing take turns (`INIT_LOCK`), and nothing else
    is shared. They fill the cores that one small run leaves idle: the article's four runs train in
    about 40% less time. A closing executor (Ctrl-C) stops the paired units at their next step."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._pool: Any = None
        self.unreported: list[UnitResult] = []  # paired units that finished but were not yielded: the
        # consumer stopped taking results (Ctrl-C) while they trained; the sweep records them

    def run(self, units: Sequence[WorkUnit]) -> Iterator[UnitResult]:
        paired = [unit for unit in units if pairs_well(unit)]
        if len(paired) < 2 or len({cfg.train.threads or unit.threads for unit in paired for cfg in unit.runs}) > 1:
            paired = []  # runs of several thread counts: one after another, as each count's bits were measured
        yield from self._two_at_a_time(paired)
        taken = {id(unit) for unit in paired}
        for unit in units:
            if id(unit) not in taken:
                yield run_unit(unit)

    def _two_at_a_time(self, units: Sequence[WorkUnit]) -> Iterator[UnitResult]:
        if not units:
            return
        from concurrent.futures import ThreadPoolExecutor, as_completed

        self.unreported = []
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="normexp-run")
        futures: list[Any] = []
        waiting: set[Any] = set()
        try:
            futures = [self._pool.submit(run_unit, unit, self._stop) for unit in units]
            waiting = set(futures)
            for future in as_completed(futures):
                waiting.discard(future)
                yield future.result()
        finally:
            self.close()
            self.unreported = [f.result() for f in futures
                               if f in waiting and f.done() and not f.cancelled() and f.exception() is None]

    def close(self) -> None:
        """Stop the paired runs at their next step, drop those not started, and wait for the threads."""
        if self._pool is not None:
            self._stop.set()
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
            self._stop.clear()


@dataclass(frozen=True, eq=False)
class _Worker:
    """One pool worker: its process and the coordinator's end of its pipe."""

    process: BaseProcess
    conn: Connection


class PoolExecutor:
    """A local pool of `workers` processes (spawned: torch is not fork-safe), one unit at a time each.

    The coordinator sends each worker one unit and knows which unit every worker holds, so a worker
    that dies costs only its own unit an attempt (retried once on a fresh worker, then `crashed`);
    the other workers go on. Workers leave Ctrl-C to the coordinator, which stops them on close(),
    and die with it however it ends (see `die_with_parent`). Workers idle after one run() serve the
    next (`--engine auto` trains its measurement first, then the rest), until close(). Units that busy
    workers finished, but that were not yielded when the consumer stopped (Ctrl-C), are `unreported`.
    """

    def __init__(self, workers: int, mkl_intel: bool = False) -> None:
        self.workers = workers
        self.mkl_intel = mkl_intel  # each worker takes MKL's Intel code path before torch loads (a compiled fast
        # sweep's, where measured faster: engines/fast/mkl_path.py)
        self._workers: list[_Worker] = []
        self._idle: list[_Worker] = []  # started, alive, holding no unit
        self.unreported: list[UnitResult] = []  # units that finished but were not yielded: the consumer
        # stopped taking results (Ctrl-C while it wrote the last ones, a worker being handed its next unit
        # meanwhile); the sweep records them

    def start(self) -> None:
        """Start every worker now, before the first run(): its process starts while the coordinator still
        prepares the sweep. A worker imports torch at its first unit, not here: importing it here brought a
        compiled fast sweep's first results ~0.8 s sooner but made a re-run with no run left ~1.6 s slower, the
        workers' imports then competing with the coordinator's (docs/performance.md, issue 48, 2026-12-08)."""
        self._idle += [self._start_worker() for _ in range(self.workers - len(self._workers))]

    def run(self, units: Sequence[WorkUnit]) -> Iterator[UnitResult]:
        queue, attempts = deque(units), {id(unit): 0 for unit in units}
        idle, self._idle = self._idle, []
        idle += [self._start_worker() for _ in range(min(self.workers, len(queue)) - len(idle))]
        busy: dict[_Worker, WorkUnit] = {}
        self.unreported = []

        def hand_out() -> None:
            while queue and idle:
                worker, unit = idle.pop(), queue.popleft()
                busy[worker] = unit
                _send(worker, (run_unit, unit))

        try:
            while queue or busy:
                hand_out()
                for worker in _ready(busy):
                    unit = busy.pop(worker)
                    result = _receive(worker)
                    if result is not None:
                        idle.append(worker)
                        hand_out()  # the worker trains its next unit while the consumer writes this one's results
                        yield result
                        continue
                    self._retire(worker)
                    attempts[id(unit)] += 1
                    if attempts[id(unit)] > 1:
                        yield crashed(unit, "worker process died twice while training these runs")
                    else:
                        queue.appendleft(unit)  # retried once, on a fresh worker
                    if queue:
                        idle.append(self._start_worker())
            self._idle = idle
        finally:  # stopped early: what busy workers have sent already is a finished unit, not an abandoned one
            self.unreported = [result for result in map(_receive, busy) if result is not None]  # waits for none

    def _start_worker(self) -> _Worker:
        """Start a worker that a terminal's Ctrl-C cannot reach before it ignores it: the stop signals
        are blocked from its first instruction (its mask is this thread's) until `_worker_main` has set
        its handlers, so that no worker prints a KeyboardInterrupt from its start-up imports."""
        import multiprocessing
        from multiprocessing import resource_tracker

        context = multiprocessing.get_context("spawn")
        mine, theirs = context.Pipe()
        process = context.Process(target=_worker_main, args=(theirs, os.getpid(), self.mkl_intel), daemon=True)
        worker = _Worker(process, mine)
        # Here a stop signal waits until the worker is started and known to close(): one that cut the
        # start short would leave the worker to print an EOFError reading what it was never sent.
        with stop_signals_deferred():
            resource_tracker.ensure_running()  # before the mask: starting the tracker unblocks SIGINT and SIGTERM
            with _signals_held():
                process.start()
                self._workers.append(worker)
        theirs.close()
        return worker

    def _retire(self, worker: _Worker) -> None:
        self._workers.remove(worker)
        worker.process.kill()
        worker.process.join()
        worker.conn.close()

    def close(self) -> None:
        """Stop every worker at once (a unit in progress is abandoned; its runs count as not run)."""
        for worker in list(self._workers):
            self._retire(worker)
        self._idle = []


def _send(worker: _Worker, message: object) -> None:
    try:
        worker.conn.send(message)
    except OSError:
        pass  # the worker is dead: its sentinel says so to _ready()


def _ready(busy: dict[_Worker, WorkUnit]) -> list[_Worker]:
    """Block until some busy worker has a result or has died; return those workers."""
    from multiprocessing.connection import wait as wait_any

    handles = {worker.conn: worker for worker in busy} | {worker.process.sentinel: worker for worker in busy}
    return list(dict.fromkeys(handles[handle] for handle in wait_any(list(handles))))


def _receive(worker: _Worker) -> UnitResult | None:
    """The worker's result, or None if it died without sending one."""
    try:
        return worker.conn.recv() if worker.conn.poll() else None
    except (EOFError, OSError):
        return None


def _worker_main(conn: Connection, coordinator: int, mkl_intel: bool = False) -> None:
    """A pool worker's life: die with the coordinator, leave Ctrl-C to it, take MKL's Intel code path where
    `mkl_intel`, train each unit it is sent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the whole process group
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # SIGTERM, SIGHUP: end the worker, as by default
    die_with_parent(coordinator)
    # Before torch loads: idle OpenMP threads sleep after a short spin instead of spinning long, so workers
    # that together hold more threads than cores do not steal each other's time.
    set_thread_defaults()
    if mkl_intel:
        take_mkl_intel_path()  # where it cannot be taken, MKL's own path (the measurement saw no gain there either)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        task, unit = message
        conn.send(task(unit))


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int) -> None:
    """End this process when `parent` ends, even by kill -9: the kernel's parent-death signal on Linux,
    and everywhere a thread that watches the parent (which also covers a parent gone before the
    signal was armed)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    threading.Thread(target=_watch_parent, args=(parent,), name="watch-parent", daemon=True).start()


def _watch_parent(parent: int, every_s: float = 0.2) -> None:
    while os.getppid() == parent:
        time.sleep(every_s)
    os._exit(1)


Notify = Callable[[str], None]  # what an executor says to the user while it waits (not about one run)
IDLE_NOTICE_S = 30.0  # while a cluster has no workers, the sweep says so this often
POLL_S = 0.1  # how often a waiting sweep looks for finished units (as distributed.as_completed does)


class DaskExecutor:
    """Submit units to a Dask cluster: `local[:N]` (an embedded LocalCluster) or a scheduler address.
    While the scheduler has no workers, `notify` is told so every `idle_notice_s` (IDLE_NOTICE_S when
    the executor is made): a sweep on a cluster whose workers have not joined yet, or are gone, would
    otherwise wait in silence."""

    def __init__(self, address: str, notify: Notify | None = None) -> None:
        import logging

        workers = check_cluster_address(address)
        self.address = address
        self.notify = notify or (lambda text: None)
        self.idle_notice_s = IDLE_NOTICE_S
        try:
            import dask
            from distributed import Client, LocalCluster
        except ImportError:
            raise ExecutorError("--cluster needs Dask: pip install 'normexp[dask]'") from None
        self._cluster = self.client = None
        self._futures: list = []  # submitted by run(): cancelled by close()
        dask.config.set({"distributed.scheduler.allowed-failures": 1})  # a dying worker: retried once
        if workers is None:
            check_scheduler(address, CONNECT_TIMEOUT_S)  # Ctrl-C is not held meanwhile: nothing is started yet
        try:
            with _signals_held({signal.SIGINT}):  # the cluster's processes leave Ctrl-C to the coordinator
                if workers is not None:
                    self._cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                                 dashboard_address=None, env={"OMP_WAIT_POLICY": "PASSIVE"},
                                                 preload=[__name__],  # see dask_setup
                                                 silence_logs=logging.ERROR)  # not "task cancelled" on a stop
                    self.client = Client(self._cluster)
                    self.address = self._cluster.scheduler_address
                else:
                    self.client = Client(address, timeout=f"{CONNECT_TIMEOUT_S}s")
        except (OSError, TimeoutError) as exc:
            raise ExecutorError(f"--cluster {address}: cannot reach the scheduler ({exc})") from None
        except BaseException:  # a signal held during start-up arrives here: stop what started
            self.close()
            raise

    def run(self, units: Sequence[WorkUnit]) -> Iterator[UnitResult]:
        from distributed import as_completed

        futures = {self.client.submit(run_unit, unit, pure=False): unit for unit in units}
        self._futures = list(futures)
        for future in self._as_they_finish(as_completed(futures)):
            unit = futures[future]
            try:
                yield future.result()
            except Exception as exc:  # noqa: BLE001 - KilledWorker and friends
                yield crashed(unit, f"{type(exc).__name__}: {exc}")

    def _as_they_finish(self, pending: Any) -> Iterator[Any]:
        """The futures of `pending` (a distributed.as_completed) as they finish; every `idle_notice_s`
        without one, the scheduler is asked whether it has workers, and `notify` told if it has none.
        A stop signal interrupts the wait (in time.sleep) as it did Dask's."""
        waiting_since = checked_at = time.monotonic()
        while not pending.is_empty():
            if pending.has_ready():
                yield next(pending)
                waiting_since = checked_at = time.monotonic()
            elif time.monotonic() - checked_at >= self.idle_notice_s:
                checked_at = time.monotonic()
                self._say_if_no_workers(checked_at - waiting_since)
            else:
                time.sleep(POLL_S)

    def _say_if_no_workers(self, waited_s: float) -> None:
        import asyncio

        try:
            workers = self.client.nthreads(callback_timeout=CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError, TimeoutError):  # the scheduler is gone: its futures will say so
            return
        if not workers:
            self.notify(f"the Dask scheduler at {self.address} has no workers: nothing trains until one joins "
                        f"(waiting {waited_s:.0f} s so far); start some with: dask worker {self.address}")

    def close(self) -> None:
        """Cancel what is outstanding and stop the cluster, without Dask's warnings about work lost
        on the way (the sweep has recorded what finished)."""
        import logging

        logging.getLogger("distributed").setLevel(logging.CRITICAL + 1)
        if self._futures:
            self.client.cancel(self._futures)
        if self.client is not None:
            self.client.close()
        if self._cluster is not None:
            self._cluster.close()


CONNECT_TIMEOUT_S = 10.0  # for a scheduler to answer (a connection refused is retried that long)


def check_scheduler(address: str, timeout: float) -> None:
    """Make sure that a Dask scheduler answers at `address` within `timeout` seconds, before a Client
    connects to it: Dask's handshake waits for an answer forever (an endpoint that accepts and stays
    silent hung the sweep), and reads whatever another server answers as its frame sizes (an HTTP
    server's "HTTP/1.1" asked for 3 EiB: a MemoryError traceback). An ExecutorError says which."""
    import asyncio

    answer = _identity(address, timeout)
    if isinstance(answer, asyncio.TimeoutError | TimeoutError):
        raise ExecutorError(f"--cluster {address}: cannot reach the scheduler (no answer within {timeout:g} s)")
    if isinstance(answer, OSError):  # refused, reset, closed: Dask's comm errors are OSErrors
        raise ExecutorError(f"--cluster {address}: cannot reach the scheduler ({answer})")
    if isinstance(answer, BaseException):
        raise ExecutorError(f"--cluster {address}: not a Dask scheduler (what answers there does not speak "
                            "Dask's protocol)")
    kind = answer.get("type") if isinstance(answer, dict) else None
    if kind != "Scheduler":
        what = f"a Dask {kind} answers there" if isinstance(kind, str) else "its answer is not Dask's"
        raise ExecutorError(f"--cluster {address}: not a Dask scheduler ({what}; give the scheduler's address)")


def _identity(address: str, timeout: float) -> object:
    """What a Dask server at `address` says it is (its `identity` answer), or the exception met asking,
    within `timeout` seconds. Asked from a thread with its own event loop: the caller may be running
    one (a notebook); the main thread only waits, so that Ctrl-C ends the wait at once."""
    import asyncio

    from distributed.comm import connect

    async def ask() -> object:
        comm = await connect(address, timeout=timeout)
        try:
            await comm.write({"op": "identity", "reply": True})
            return await comm.read()
        finally:
            await comm.close()

    answers: list[object] = []

    def probe() -> None:
        try:
            answers.append(asyncio.run(asyncio.wait_for(ask(), timeout)))
        except BaseException as exc:  # noqa: BLE001 - check_scheduler says what it means
            answers.append(exc)

    thread = threading.Thread(target=probe, name="normexp-check-scheduler", daemon=True)  # never keeps us alive
    thread.start()
    thread.join()
    return answers[0]


def dask_setup(worker: object) -> None:
    """Run by Dask in each worker process of `--cluster local[:N]` as it starts (this module is its
    preload): a terminal's Ctrl-C reaches the whole process group, and the coordinator alone handles
    it (it stops the cluster); a worker that took it would die printing tracebacks. The threading defaults
    are set there too, before the worker's first unit loads torch."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_thread_defaults()


@contextlib.contextmanager
def _signals_held(signals: Iterable[int] = STOP_SIGNALS) -> Iterator[None]:
    """Hold `signals` (Ctrl-C, SIGTERM, SIGHUP) in this thread for the block; they arrive when it ends.
    Threads and processes started in the block inherit the mask, so a terminal's Ctrl-C to the whole
    group reaches the coordinator only."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


MAX_WORKERS = 1024
CLUSTER_FORMS = "local, local:N (N workers, N >= 1) or tcp://HOST:PORT (a running scheduler)"


def check_cluster_address(address: str) -> int | None:
    """Check a --cluster value before anything starts: the number of local workers for `local[:N]`,
    None for a scheduler address. Anything else is an ExecutorError naming the accepted forms."""
    if address == "local":
        return os.cpu_count() or 1
    count = address.removeprefix("local:")
    if count != address:
        if re.fullmatch(r"[0-9]{1,4}", count) and 1 <= int(count) <= MAX_WORKERS:
            return int(count)
        raise ExecutorError(f"--cluster {address}: N must be a whole number from 1 to {MAX_WORKERS}; "
                            f"expected {CLUSTER_FORMS}")
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if address.startswith("tcp://") and host and re.fullmatch(r"[0-9]{1,5}", port) and 0 < int(port) < 65536:
        return None
    raise ExecutorError(f"--cluster {address}: expected {CLUSTER_FORMS}")


class ExecutorError(RuntimeError):
    """The executor cannot start (Dask missing, scheduler unreachable). The CLI exits 2 on it."""


Executor = InProcessExecutor | PoolExecutor | DaskExecutor


def make_executor(workers: int | None, cluster: str | None, notify: Notify | None = None,
                  mkl_intel: bool = False) -> Executor:
    if cluster:
        return DaskExecutor(cluster, notify)
    if workers and workers > 1:
        return PoolExecutor(workers, mkl_intel)
    return InProcessExecutor()
