"""Where work runs: in the sweep's own process, in a local process pool, or on a Dask cluster.

The sweep process stays the coordinator: it plans work units (a batch of runs for the batched
engine, one run for the reference engine), hands them to an executor, and writes every result itself.
Workers receive configs as plain data and return metrics as plain data: they need no shared file
system, only normexp installed.

Every unit carries the torch thread count its runs use, and a worker sets it before it trains, so a
run's numbers do not depend on which executor ran it (the thread count changes the last bits of CPU
kernels; it is recorded in each run's done.json).

- `InProcessExecutor`: units one after another in this process (the default).
- `PoolExecutor(workers)`: a local process pool (`--workers N`).
- `DaskExecutor(address)`: `--cluster local[:N]` starts an embedded LocalCluster, `--cluster
  tcp://HOST:PORT` uses a running scheduler. Needs the `dask` extra.

A worker that dies is retried once; if the retry dies too, the unit's runs are marked `crashed`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from normexp.config import RunConfig
from normexp.store import FinishedRun

CRASHED = "crashed"


@dataclass(frozen=True)
class WorkUnit:
    """Runs that one worker trains together: one batch (batched engine) or one run (reference)."""

    configs: tuple[dict, ...]  # RunConfig.model_dump(mode="json"): plain, picklable, small
    batched: bool
    device: str
    threads: int

    @property
    def runs(self) -> list[RunConfig]:
        return [RunConfig.model_validate(c) for c in self.configs]


@dataclass(frozen=True)
class UnitResult:
    """A unit's outcome: per run, a FinishedRun, or an error message (`status` failed or crashed)."""

    unit: WorkUnit
    outcomes: tuple[FinishedRun | str, ...]
    status: str = "failed"  # the status of the runs that have an error message


def plan_units(runs: Sequence[RunConfig], engine: str, device: str, threads: int) -> list[WorkUnit]:
    """Split runs into work units: batches where the batched engine applies, single runs elsewhere."""
    def unit(configs: Sequence[RunConfig], batched: bool) -> WorkUnit:
        return WorkUnit(tuple(c.model_dump(mode="json") for c in configs), batched, device, threads)

    if engine == "reference":
        return [unit([cfg], False) for cfg in runs]
    from normexp.batched import plan_batches

    batches, alone = plan_batches(runs)
    return [unit(batch, True) for batch in batches] + [unit([cfg], False) for cfg in alone]


def run_unit(unit: WorkUnit) -> UnitResult:
    """Train one unit (in whatever process runs this) and return plain results; never raises."""
    import torch

    torch.set_num_threads(unit.threads)
    runs = unit.runs
    if unit.batched:
        from normexp.batched import train_batch

        try:
            results = train_batch(runs, unit.device)
        except Exception as exc:  # noqa: BLE001 - reported per run
            return UnitResult(unit, tuple(_error(exc) for _ in runs))
        return UnitResult(unit, tuple(_finished(r, unit.device) for r in results))
    from normexp.train import train_run

    outcomes: list[FinishedRun | str] = []
    for cfg in runs:
        try:
            outcomes.append(_finished(train_run(cfg, device=unit.device), unit.device))
        except Exception as exc:  # noqa: BLE001 - reported per run
            outcomes.append(_error(exc))
    return UnitResult(unit, tuple(outcomes))


def _finished(result: Any, device: str) -> FinishedRun:
    return FinishedRun(result.metrics, result.status, result.wall_s, result.threads, result.engine, device,
                       result.blocks)


def _error(exc: BaseException) -> str:
    import traceback

    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {last[0].filename.rsplit('/', 1)[-1]}:{last[0].lineno})" if last else ""
    return f"{type(exc).__name__}: {exc}{where}"


def crashed(unit: WorkUnit, why: str) -> UnitResult:
    return UnitResult(unit, tuple(why for _ in unit.configs), status=CRASHED)


def default_threads() -> int:
    """Torch threads for runs whose config leaves `train.threads` open: this process's default,
    whichever executor runs them, so that a run's numbers never depend on the executor."""
    import torch

    return torch.get_num_threads()


# ----------------------------------------------------------------------------- executors


def _worker_init() -> None:
    """Before torch loads in a pool worker: idle OpenMP threads sleep instead of spinning, so workers
    that together hold more threads than cores do not steal each other's time."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


class InProcessExecutor:
    """Run units one after another in the sweep's own process."""

    def run(self, units: Sequence[WorkUnit]) -> Iterator[UnitResult]:
        for unit in units:
            yield run_unit(unit)

    def close(self) -> None:
        pass


class PoolExecutor:
    """A local process pool of `workers` processes (spawned: torch is not fork-safe)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None

    def _new_pool(self) -> ProcessPoolExecutor:
        import multiprocessing

        return ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_worker_init)

    def run(self, units: Sequence[WorkUnit]) -> Iterator[UnitResult]:
        attempts = {id(unit): 0 for unit in units}
        queue = list(units)
        while queue:
            self._pool = self._new_pool()
            futures: dict[Future, WorkUnit] = {self._pool.submit(run_unit, unit): unit for unit in queue}
            queue = []
            while futures:
                done, _ = wait(futures, return_when=FIRST_COMPLETED)
                for future in done:
                    unit = futures.pop(future)
                    try:
                        yield future.result()
                    except BrokenProcessPool:
                        attempts[id(unit)] += 1
                        if attempts[id(unit)] > 1:
                            yield crashed(unit, "worker process died twice while training these runs")
                        else:
                            queue.append(unit)  # retried once, in a fresh pool
            self._pool.shutdown(wait=True)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class DaskExecutor:
    """Submit units to a Dask cluster: `local[:N]` (an embedded LocalCluster) or a scheduler address."""

    def __init__(self, address: str) -> None:
        try:
            import dask
            from distributed import Client, LocalCluster
        except ImportError:
            raise ExecutorError("--cluster needs Dask: pip install 'normexp[dask]'") from None
        self._cluster = None
        self._futures: list = []  # submitted by run(): cancelled by close()
        dask.config.set({"distributed.scheduler.allowed-failures": 1})  # a dying worker: retried once
        if address == "local" or address.startswith("local:"):
            workers = int(address.partition(":")[2] or os.cpu_count() or 1)
            self._cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                         dashboard_address=None, env={"OMP_WAIT_POLICY": "PASSIVE"})
            self.client = Client(self._cluster)
        else:
            try:
                self.client = Client(address, timeout="10s")
            except (OSError, TimeoutError) as exc:
                raise ExecutorError(f"--cluster {address}: cannot reach the scheduler ({exc})") from None

    def run(self, units: Sequence[WorkUnit]) -> Iterator[UnitResult]:
        from distributed import as_completed

        futures = {self.client.submit(run_unit, unit, pure=False): unit for unit in units}
        self._futures = list(futures)
        for future in as_completed(futures):
            unit = futures[future]
            try:
                yield future.result()
            except Exception as exc:  # noqa: BLE001 - KilledWorker and friends
                yield crashed(unit, f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        if self._futures:
            self.client.cancel(self._futures)
        self.client.close()
        if self._cluster is not None:
            self._cluster.close()


class ExecutorError(RuntimeError):
    """The executor cannot start (Dask missing, scheduler unreachable). The CLI exits 2 on it."""


Executor = InProcessExecutor | PoolExecutor | DaskExecutor


def make_executor(workers: int | None, cluster: str | None) -> Executor:
    if cluster:
        return DaskExecutor(cluster)
    if workers and workers > 1:
        return PoolExecutor(workers)
    return InProcessExecutor()
