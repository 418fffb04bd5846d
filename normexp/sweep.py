"""Run a sweep: lock the output folder, skip finished runs, dispatch the rest, record each result.

The sweep process is the coordinator and the only writer of its output folder. It

1. starts the executor (this process, a process pool, or a Dask cluster: see executors.py); a compiled fast
   sweep's pool (`fast_pool`) starts its workers before this process imports torch, then imports it,
2. takes the folder's lock (a second sweep into the same folder fails at once), and refuses a folder
   that holds a sweep of another name unless `force`,
3. tidies what a killed sweep left (`folder.recover_strays`), writes `sweep.yaml` (this sweep's grid;
   the folder keeps the verified runs of earlier grids too, and `summary.csv` lists them all), then
   finds the runs that are not verified finished (`folder.inspect_run`; all of them with `force`). A corrupt run is
   redone (a "corrupt" event says why); a run of release 0.1, without checksums, is re-read and, if
   it holds, stamped with them and kept; a finished run recorded with another torch thread count
   than this sweep's, or by the fast engine when this sweep is exact, is redone (a "redone" event
   says why), so that one sweep never mixes them,
4. appends this invocation to `history.jsonl` (command line, time, commit, CPU, torch build, the
   sweep file's text as given, the grid, runs planned and to train),
5. plans work units for the engine (batches, or single runs) and writes each run's folder as its
   result arrives; under `--engine auto`, in two stages (`units.AutoPlan`): the runs that measure which
   exact engine is faster for a shape not measured before, then the rest on the faster,
6. rebuilds `summary.csv` from the run folders, also when interrupted or when a run fails.

With `shard` (I, N), the sweep trains only shard I's runs (normexp/shard.py: whole batches of the
unsharded plan), holding the folder's lock shared with the other shards: each writes its own runs'
folders, and sweep.yaml, history.jsonl and summary.csv one shard at a time (`folder.folder_writes`); a
shard leaves the tidying of what a killed writer left (step 3) to a whole sweep or `verify --fix`, as
that could be another shard's folder in the making.

Progress is reported through an optional callback of `SweepEvent`s; nothing here prints.
A run that raises is recorded as `failed` (its folder has `failed.json`, no `done.json`, so the next
sweep retries it) and the sweep goes on, unless `fail_fast`. So is a run whose folder's place holds a
file or a symbolic link normexp did not write (`folder.in_the_way`): that is left as it is, the run is
not trained (or, found only as its result is written, not recorded), and summary.csv says why. On
KeyboardInterrupt the finished runs stay finished, the summary is written, and `SweepInterrupted`
carries the outcome to the caller (the command line turns SIGTERM and SIGHUP into the same
KeyboardInterrupt).
"""

from __future__ import annotations

import contextlib
import errno
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

from normexp.config import RunConfig, Sweep
from normexp.folder import (
    SWEEP_FILE,
    FinishedRun,
    InTheWay,
    RunState,
    StoreError,
    SweepLock,
    append_history,
    atomic_write,
    folder_runs,
    folder_writes,
    in_the_way,
    inspect_run,
    other_threads,
    read_history,
    recover_strays,
    run_id,
    stamp_run,
    sweep_name,
    sweep_yaml,
    synced_together,
    verified_states,
    write_failed,
    write_run,
    write_summary,
)
from normexp.stopping import stop_signals_deferred

if TYPE_CHECKING:
    from normexp.executors import Executor
    from normexp.units import UnitResult, WorkUnit

T = TypeVar("T")
EngineName = Literal["auto", "reference", "batched", "fast"]


@dataclass(frozen=True)
class SweepOptions:
    engine: EngineName = "auto"
    device: str = "cpu"
    force: bool = False
    fail_fast: bool = False
    workers: int | None = None  # a local process pool of this many workers
    cluster: str | None = None  # a Dask scheduler address, or local[:N]
    compile: bool | None = None  # fast engine: compile its step (None: where the planned work pays for it)
    shard: tuple[int, int] | None = None  # (I, N): train shard I of N only (normexp/shard.py)


@dataclass(frozen=True)
class SweepEvent:
    """One thing that happened to one run: skipped (already done), corrupt (found so, to be redone),
    redone (done, but not as this sweep would train it: `error` says why), finished, or failed. Or,
    about no run (`run_id` empty), waiting: nothing can train for now, `error` says why (a Dask
    scheduler without workers); or engine: which engine `--engine auto` chose and why, or what it
    measures first (`error`)."""

    kind: Literal["skipped", "corrupt", "redone", "finished", "failed", "waiting", "engine"]
    run_id: str
    done: int  # runs accounted for so far, this one included
    total: int
    status: str = ""
    final_loss: float | None = None
    error: str = ""  # for "failed": the error; for "corrupt": what does not hold


@dataclass(frozen=True)
class Invocation:
    """What the folder's history records of the command that ran the sweep: its command line and the
    sweep file's text as given (its comments included; sweep.yaml holds the resolved sweep only)."""

    command: str = ""
    source: str = ""


@dataclass
class SweepOutcome:
    out_dir: Path
    total: int
    statuses: dict[str, str] = field(default_factory=dict)  # run_id -> completed|diverged|failed|skipped|...
    interrupted: bool = False
    corrupt: list[str] = field(default_factory=list)  # runs found corrupt and redone (or to be redone)
    restamped: int = 0  # runs of release 0.1 re-read, verified and given checksums
    command: str = ""  # the command line, recorded in each run's done.json
    held: int = 0  # runs the folder holds once the sweep ends: this sweep's and earlier invocations'
    invocations: int = 0  # invocations the folder's history records, this one included

    def count(self, *statuses: str) -> int:
        return sum(1 for s in self.statuses.values() if s in statuses)

    @property
    def failed(self) -> int:
        return self.count("failed", "crashed")


class SweepInterrupted(Exception):
    """Ctrl-C during a sweep: finished runs are kept, the summary is written."""

    def __init__(self, outcome: SweepOutcome) -> None:
        super().__init__("sweep interrupted")
        self.outcome = outcome


EventCallback = Callable[[SweepEvent], None]


def run_sweep(sweep: Sweep, out_dir: Path, options: SweepOptions = SweepOptions(),
              on_event: EventCallback | None = None, invocation: Invocation = Invocation(),
              pool: int | None = None) -> SweepOutcome:
    """Run every unfinished run of `sweep` into `out_dir`; see the module docstring. `pool`: `fast_pool(sweep,
    options)` where the caller has it already (a pass over every run: ~0.1 s at 10,000), else decided here."""
    from normexp.executors import PoolExecutor, make_executor
    from normexp.units import default_threads

    out_dir = Path(out_dir)
    runs = sweep.runs
    if options.shard is not None:
        from normexp.shard import shard_runs

        runs = shard_runs(sweep.runs, options.engine, *options.shard, compile=options.compile)
    outcome = SweepOutcome(out_dir, len(runs), command=invocation.command)
    emit = on_event or (lambda event: None)
    workers = options.workers
    if pool is None:  # decided without torch: a pool's workers start before this process needs it
        pool = fast_pool(sweep, options)
    notify = lambda why: emit(SweepEvent("waiting", "", len(outcome.statuses), outcome.total, error=why))  # noqa: E731
    mkl_intel = False
    if pool:
        from normexp.engines.fast import workers_path

        workers, threads = pool, 1
        note = blockwise_note(runs, options.compile, sweep.runs)
        mkl = workers_path(sweep.runs, options.compile, notify)  # the whole plan's: every shard takes the same path
        mkl_intel = mkl.intel
        emit(SweepEvent("engine", "", 0, outcome.total, error=f"engine fast: compiled{note}, {pool} worker processes "
                        "x 1 thread each (faster than one process x all threads: docs/performance.md)"
                        + mkl.note()))
    else:
        threads = default_threads()  # read before a Dask LocalCluster sets OMP_NUM_THREADS=1 in this process
    executor = make_executor(workers, options.cluster, notify, mkl_intel)  # fails before anything is written
    try:
        if pool and isinstance(executor, PoolExecutor):
            executor.start()  # its workers start while this process imports torch, checks the folder and plans
            _import_engine()
        with SweepLock(out_dir, shared=options.shard is not None):
            _run_locked(sweep, out_dir, options, executor, outcome, emit, threads, invocation, runs)
    finally:
        executor.close()
    return outcome


def fast_pool(sweep: Sweep, options: SweepOptions) -> int:
    """Worker processes for a compiled fast sweep on the CPU (0: none). Where no executor is asked for
    (no --workers at all, no --cluster), no run sets `train.threads`, and the sweep compiles (--compile,
    or by default where the planned model-steps pay for it), the batches train in one single-threaded
    worker process per core instead of one process with a thread per core: the step's many small
    kernels then never wait for each other's threads (measured on 2 cores: docs/performance.md). A
    pure function of the sweep, the options and the machine, so a resumed sweep decides the same (its
    runs record 1 thread)."""
    from normexp.executors import usable_cores

    cores = usable_cores()
    if (options.engine != "fast" or options.device != "cpu" or options.cluster or options.workers is not None
            or options.compile is False or cores < 2 or any(cfg.train.threads is not None for cfg in sweep.runs)):
        return 0
    if options.compile:
        return cores
    from normexp.engines.fast import compile_choice

    return cores if any(compile_choice(sweep.runs).values()) else 0


def blockwise_note(runs: Sequence[RunConfig], compile: bool | None = None,
                   planned: Sequence[RunConfig] | None = None) -> str:
    """What the engine line adds where a structure's step is compiled block by block (`plan.by_blocks`): how, and
    its batches' size. Only where one of `runs` that the fast engine trains is of such a structure and that
    structure compiles (`compile_choice` over the `planned` runs, default `runs`, as the sweep's plan decides)."""
    from normexp.engines.fast import BLOCKWISE_CHUNK, by_blocks, compile_choice, fast_key, fast_serves

    chains = [cfg for cfg in runs if by_blocks(cfg) and fast_serves(cfg)]
    choice = compile_choice([cfg for cfg in (runs if planned is None else planned) if fast_serves(cfg)], compile)
    if not any(choice.get(fast_key(cfg), compile is True) for cfg in chains):
        return ""
    return f" block by block ({BLOCKWISE_CHUNK} runs a batch: its compile does not grow with the depth)"


def _import_engine() -> None:
    """Load torch and the fast engine for a sweep whose pool started before this process imported them, with
    stop signals held until they are loaded (then raised here, before the folder is touched). A Ctrl-C or
    SIGTERM raised as KeyboardInterrupt inside torch's import can vanish (torch._C imports numpy from C++,
    which drops the error: the sweep trained on) or leave numpy half-loaded (the next import fails)."""
    with stop_signals_deferred():
        import torch  # noqa: F401

        from normexp.engines.fast import train_fast  # noqa: F401 - the engine, loaded (it imports torch)


def _run_locked(sweep: Sweep, out_dir: Path, options: SweepOptions, executor: Executor, outcome: SweepOutcome,
                emit: EventCallback, threads: int, invocation: Invocation, runs: list[RunConfig]) -> None:
    """Steps 3-6 of the module docstring, under the folder's lock; `runs`: the sweep's, or its shard's."""
    shared = options.shard is not None
    if not options.force:
        refuse_another_sweep(out_dir, sweep)
    if not shared:
        _write_or_explain(recover_strays, out_dir)
    try:
        with folder_writes(out_dir, shared):
            _write_or_explain(atomic_write, out_dir / SWEEP_FILE, sweep_yaml(sweep))
        ids = {run_id(cfg): cfg for cfg in runs}
        states = {} if options.force else verified_states(out_dir, ids, record=not shared)  # shards: at the end
        pending = [cfg for rid, cfg in ids.items()
                   if options.force or not _finished(cfg, rid, states[rid], out_dir, options, threads, outcome, emit)]
        pending = [cfg for cfg in pending if not _blocked(cfg, out_dir, outcome, emit)]
        with folder_writes(out_dir, shared):
            _write_or_explain(append_history, out_dir, _history_record(sweep, invocation, options, len(pending),
                                                                       len(runs), executor))
        if not (options.fail_fast and outcome.failed):
            _execute(pending, out_dir, options, executor, outcome, emit, threads, sweep.runs)
    except KeyboardInterrupt:
        outcome.interrupted = True
        for result in getattr(executor, "unreported", ()):  # finished while the executor was stopped
            _record_unit(result, out_dir, outcome, emit)
        for cfg in runs:  # a run whose done.json was written as the signal came is finished
            rid = run_id(cfg)
            if rid not in outcome.statuses:  # only runs not yet accounted for are inspected again
                outcome.statuses[rid] = _finished_status(out_dir / rid, cfg) or "interrupted"
        _write_summary(out_dir, sweep, outcome, shared)
        raise SweepInterrupted(outcome) from None
    _write_summary(out_dir, sweep, outcome, shared)


def _write_summary(out_dir: Path, sweep: Sweep, outcome: SweepOutcome, shared: bool = False) -> None:
    """summary.csv of every run the folder holds, and what it holds in `outcome`."""
    with folder_writes(out_dir, shared):
        runs = folder_runs(out_dir, sweep)
        _write_or_explain(write_summary, out_dir, runs, outcome.statuses)
        outcome.held, outcome.invocations = len(runs), len(read_history(out_dir))


def _history_record(sweep: Sweep, invocation: Invocation, options: SweepOptions, new: int,
                    planned: int | None = None, executor: object = None) -> dict:
    """history.jsonl's line for this invocation; with a pool of worker processes, the MKL code path they took
    (`engines/fast/mkl_path.py`: it moves the fast runs' last bits)."""
    from normexp.engines.fast import requested
    from normexp.environment import provenance
    from normexp.executors import PoolExecutor

    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": invocation.command,
        **provenance(),
        "sweep": sweep.name,
        "grid": sweep.grid,
        "seeds": sweep.seeds,
        "engine": options.engine,
        "force": options.force,
        "runs_planned": len(sweep.runs) if planned is None else planned,
        "runs_to_train": new,
        **({"shard": f"{options.shard[0]}/{options.shard[1]}"} if options.shard is not None else {}),
        **({"workers_mkl_path": "intel" if executor.mkl_intel or requested() == "intel" else "own"}
           if isinstance(executor, PoolExecutor) else {}),  # NORMEXP_MKL_PATH=intel: every worker takes it
        "notes": sweep.notes,
        "tags": list(sweep.tags),
        "sweep_file": invocation.source,
        "resolved": sweep.to_yaml(),
    }


def _finished(cfg: RunConfig, rid: str, state: RunState, out_dir: Path, options: SweepOptions, threads: int,
              outcome: SweepOutcome, emit: EventCallback) -> bool:
    """Whether `cfg`'s run folder (`rid`, found in `state`: `folder.verified_states`) holds a verified result
    this sweep can keep (reported as skipped). A corrupt one is reported and left to be redone, an
    unstamped one (release 0.1) is stamped and kept; one trained with another thread count, or by the
    fast engine for an exact sweep, is redone."""
    if state.kind == "corrupt":
        outcome.corrupt.append(rid)
        emit(SweepEvent("corrupt", rid, len(outcome.statuses), outcome.total, "corrupt", error=state.problem))
        return False
    if not state.finished:
        return False
    why = _redo_reason(state.done or {}, options.engine, cfg.train.threads or threads)
    if why is not None:
        emit(SweepEvent("redone", rid, len(outcome.statuses), outcome.total, error=why))
        return False
    if state.kind == "unstamped":
        _write_or_explain(stamp_run, out_dir / rid, state)
        outcome.restamped += 1
    outcome.statuses[rid] = "skipped"
    emit(SweepEvent("skipped", rid, len(outcome.statuses), outcome.total))
    return True


def _blocked(cfg: RunConfig, out_dir: Path, outcome: SweepOutcome, emit: EventCallback) -> bool:
    """Whether a file or link normexp did not write stands where `cfg`'s run folder must go: then the
    run is recorded as failed (it could not be written; training it would be wasted) and not planned."""
    rid = run_id(cfg)
    what = in_the_way(out_dir / rid)
    if what is not None:
        _record_in_the_way(rid, InTheWay(out_dir / rid, what), outcome, emit)
    return what is not None


def _record_in_the_way(rid: str, blocked: InTheWay, outcome: SweepOutcome, emit: EventCallback) -> None:
    outcome.statuses[rid] = "failed"
    emit(SweepEvent("failed", rid, len(outcome.statuses), outcome.total, "failed", error=blocked.problem))


def _redo_reason(done: dict, engine: str, threads: int) -> str | None:
    """Why a verified run cannot stay in this sweep: an exact sweep redoes the runs the fast engine
    trained (their numbers are close to the reference's, not equal; a fast sweep keeps exact ones),
    and no sweep mixes thread counts. None when it can stay."""
    if engine != "fast" and done.get("engine") == "fast":
        return "trained by the fast engine, this sweep is exact: redone"
    return other_threads(done, threads)


def _finished_status(run_dir: Path, cfg: RunConfig) -> str | None:
    """The status in a finished run's done.json (completed, diverged), or None if it is not finished."""
    state = inspect_run(run_dir, cfg)
    return (state.done or {}).get("status", "completed") if state.finished else None


def refuse_another_sweep(out_dir: Path, sweep: Sweep,
                         remedy: str = "choose another --out, or add --force to add this sweep's runs to "
                                       "its own (every run is retrained)") -> None:
    """A folder that holds a sweep of another name holds another study: mixing a second one in is
    refused unless asked for. (The same sweep with changed values may run here: its new runs join the
    folder's, which keeps every verified run and reports them all.)"""
    other = sweep_name(out_dir)
    if other is not None and other != sweep.name:
        raise StoreError(f"{out_dir}: holds sweep '{other}', not '{sweep.name}'; {remedy}")


def _execute(pending: list[RunConfig], out_dir: Path, options: SweepOptions, executor: Executor,
             outcome: SweepOutcome, emit: EventCallback, threads: int, planned: list[RunConfig]) -> None:
    from normexp.units import AutoPlan, plan_units

    if options.engine != "auto":
        units = plan_units(pending, options.engine, options.device, threads, options.compile, planned)
        _train(units, out_dir, options, executor, outcome, emit)
        return
    plan = AutoPlan(pending, options.device, threads, _pairing(executor, pending))
    emit(SweepEvent("engine", "", len(outcome.statuses), outcome.total, error=plan.note))
    measured = _train(plan.probe, out_dir, options, executor, outcome, emit)  # the measurement's runs, kept
    if options.fail_fast and outcome.failed:
        return
    units, note = plan.rest(measured)
    if note:
        emit(SweepEvent("engine", "", len(outcome.statuses), outcome.total, error=note))
    _train(units, out_dir, options, executor, outcome, emit)


def _pairing(executor: Executor, runs: list[RunConfig]) -> Callable[[WorkUnit], bool]:
    """Whether `executor` trains a reference unit of `runs` beside another (as InProcessExecutor pairs
    them: small runs, of one thread count), for `--engine auto` to time the reference as it trains."""
    from normexp.executors import InProcessExecutor, pairs_well

    if not isinstance(executor, InProcessExecutor) or len({cfg.train.threads for cfg in runs}) > 1:
        return lambda unit: False
    return pairs_well


def _train(units: list[WorkUnit], out_dir: Path, options: SweepOptions, executor: Executor,
           outcome: SweepOutcome, emit: EventCallback) -> list[UnitResult]:
    """Train `units` on `executor`, writing each run as its unit finishes. Returns their results (up to
    the first failure with `fail_fast`) without the runs' metrics, which are written: a unit and how
    long its steps took."""
    results = []
    # closed here, not by the garbage collector when --fail-fast leaves the loop: the executor then
    # stops the runs still training, and a Ctrl-C while it waits for them must interrupt the sweep,
    # not be printed as an "Exception ignored" and lost
    with contextlib.closing(executor.run(units)) as running:
        for result in running:
            _record_unit(result, out_dir, outcome, emit)
            results.append(replace(result, outcomes=()))
            if options.fail_fast and outcome.failed:
                break
    return results


def _record_unit(result: UnitResult, out_dir: Path, outcome: SweepOutcome, emit: EventCallback) -> None:
    """Write each run of a unit into its folder and report it. A stop signal that arrives meanwhile
    takes effect once the unit's folders are in place (milliseconds a run: about a second for a
    64-run batch), so an interrupted sweep leaves no half-built folder behind, nor a trained
    batch-mate unwritten."""
    with stop_signals_deferred(), synced_together(out_dir):
        for index, (cfg, run) in enumerate(zip(result.unit.runs, result.outcomes)):
            if result.unit.recorded(index):  # a fast batch's runs that were done are left as they are
                _record_now(cfg, run, result.status, out_dir, outcome, emit)


def _record_now(cfg: RunConfig, run: FinishedRun | str, error_status: str, out_dir: Path, outcome: SweepOutcome,
                emit: EventCallback) -> None:
    rid = run_id(cfg)
    try:
        _write_now(cfg, run, error_status, out_dir, outcome, emit)
    except InTheWay as exc:  # appeared while the run trained: the run fails, the sweep goes on
        _record_in_the_way(rid, exc, outcome, emit)


def _write_now(cfg: RunConfig, run: FinishedRun | str, error_status: str, out_dir: Path, outcome: SweepOutcome,
               emit: EventCallback) -> None:
    rid = run_id(cfg)
    if isinstance(run, str):
        kept = not _write_or_explain(write_failed, out_dir / rid, cfg, error_status, run)
        outcome.statuses[rid] = error_status
        run = f"{run} (the earlier finished result is kept)" if kept else run
        emit(SweepEvent("failed", rid, len(outcome.statuses), outcome.total, error_status, error=run))
        return
    done = _write_or_explain(write_run, out_dir / rid, cfg, run, outcome.command)
    outcome.statuses[rid] = done["status"]
    emit(SweepEvent("finished", rid, len(outcome.statuses), outcome.total, done["status"], done["final_loss"]))


def _write_or_explain(write: Callable[..., T], *args: object) -> T:
    """Call `write(*args)`; turn a full disk or a read-only folder into a StoreError saying what to do."""
    try:
        return write(*args)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise StoreError(f"disk full while writing {exc.filename or 'results'}: free some space and "
                             "rerun the same command; finished runs are kept") from None
        if exc.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
            raise StoreError(f"cannot write {exc.filename}: {exc.strerror}") from None
        raise
