"""Work units: what one worker trains together (a batch of runs for the batched and fast engines, one run
for the reference), how a sweep's runs are split into them, and how a unit is trained, in whatever process
runs it. Units carry configs and results as plain data, so that any executor (normexp/executors.py) can
ship them: in process, to a worker process, or to a Dask worker."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from normexp.config import RunConfig
from normexp.folder import FinishedRun

if TYPE_CHECKING:
    from normexp.engines.auto import Choice

Engine = Literal["reference", "batched", "fast"]


CRASHED = "crashed"



@dataclass(frozen=True)
class WorkUnit:
    """Runs that one worker trains together, on one engine: one batch (batched or fast) or one run
    (reference)."""

    configs: tuple[dict, ...]  # RunConfig.model_dump(mode="json"): plain, picklable, small
    engine: Engine
    device: str
    threads: int
    compile: bool = False  # fast engine: compile its step (decided when the sweep is planned)
    # fast engine: which runs of the batch are to be recorded (empty: all). A resumed sweep trains a
    # batch whole, as first planned, so that its runs' bits do not depend on which of them are done
    record: tuple[bool, ...] = ()

    def recorded(self, index: int) -> bool:
        """Whether the unit's run `index` is to be written (the others are done already)."""
        return not self.record or self.record[index]

    @property
    def runs(self) -> list[RunConfig]:
        return [RunConfig.model_validate(c) for c in self.configs]



@dataclass(frozen=True)
class UnitResult:
    """A unit's outcome: per run, a FinishedRun, or an error message (`status` failed or crashed)."""

    unit: WorkUnit
    outcomes: tuple[FinishedRun | str, ...]
    status: str = "failed"  # the status of the runs that have an error message
    step_s: float | None = None  # seconds a training step of the unit took (`StepClock`); None: not timed



def plan_units(runs: Sequence[RunConfig], engine: str, device: str, threads: int,
               compile: bool | None = None, planned: Sequence[RunConfig] | None = None) -> list[WorkUnit]:
    """Split runs into work units: batches where the batched engine applies, single runs elsewhere;
    with the fast engine, batches of every structure (`compile` None: decided per structure).
    `planned`: every run of the sweep, `runs` those still to train. The fast engine's batches (and its
    compile choice) are planned over all of them, so that they do not depend on which runs are done:
    each batch with a run to train is trained whole, and only those runs are recorded. (`--engine auto`
    plans in two stages: `AutoPlan`.)"""
    if engine == "reference":
        return [_unit([cfg], "reference", device, threads) for cfg in runs]
    if engine == "fast":
        return _plan_fast_units(runs, device, threads, compile, runs if planned is None else planned)
    from normexp.engines.batched import plan_batches

    batches, alone = plan_batches(runs)
    return ([_unit(batch, "batched", device, threads) for batch in batches]
            + [_unit([cfg], "reference", device, threads) for cfg in alone])


def _unit(configs: Sequence[RunConfig], engine: Engine, device: str, threads: int) -> WorkUnit:
    return WorkUnit(tuple(c.model_dump(mode="json") for c in configs), engine, device, threads)


@dataclass(frozen=True)
class _Measurement:
    """A shape's measurement on the sweep's own runs (normexp/engines/auto.py): its first batch's first
    runs, each a reference unit, and the next ones as one batched unit."""

    batch: tuple[RunConfig, ...]  # the shape's first batch: what the choice is cached for
    paired: bool  # the sweep trains the reference units in pairs: each pair's step advances two runs
    reference: tuple[WorkUnit, ...]
    batched: WorkUnit

    @property
    def units(self) -> list[WorkUnit]:
        return [*self.reference, self.batched]

    def choose(self, results: Sequence[UnitResult]) -> Choice | str:
        """The Choice from the timed results of these units, cached; or, where a unit was not timed (its
        runs failed, or stopped before their second step), why there is none: then the reference."""
        from normexp.engines.auto import decide

        reference = [r.step_s for r in results if r.step_s and r.unit in self.reference]
        batched = [r.step_s for r in results if r.step_s and r.unit == self.batched]
        if not reference or not batched:
            return UNTIMED
        at_once = len(self.reference) if self.paired else 1
        runs = len(self.batched.configs)
        return decide(self.batch, self.paired, statistics.median(reference) / at_once, batched[0] / runs, runs)


class AutoPlan:
    """`--engine auto`'s units (normexp/engines/auto.py), in two stages. `probe`, trained first: for each
    shape of batch without a cached choice, its first batch's first runs on the reference and the next
    ones batched, timed; `rest(results)`, given their results: every other unit, each shape's batches on
    the engine its measurement or cached choice took (the reference for a shape too small to measure).
    On a GPU, every batch batched, nothing measured. `note`: the sweep's first line, which engine and why,
    or what it measures first."""

    def __init__(self, runs: Sequence[RunConfig], device: str, threads: int,
                 pairs: Callable[[WorkUnit], bool] = lambda unit: False) -> None:
        from normexp.engines.auto import MIN_RUNS, cached, shape_key
        from normexp.engines.batched import plan_batches

        self.device, self.threads = device, threads
        batches, alone = plan_batches(runs)
        self._alone = [_unit([cfg], "reference", device, threads) for cfg in alone]
        self._later: list[tuple[str, list[RunConfig]]] = []  # runs on their shape's engine, by shape key
        self._choices: dict[str, Choice | str] = {}  # shape key -> Choice, or why none: the reference
        self._measuring: dict[str, _Measurement] = {}
        self.probe: list[WorkUnit] = []
        for batch in batches:
            paired = device == "cpu" and pairs(_unit(batch[:1], "reference", device, threads))
            key = shape_key(batch, paired)
            if device == "cpu" and key not in self._choices and key not in self._measuring:
                choice = cached(batch, paired)
                if choice is None and len(batch) >= MIN_RUNS:
                    self._measuring[key] = measurement = self._measure(batch, paired)
                    self.probe += measurement.units
                    batch = batch[len(measurement.reference) + len(measurement.batched.configs):]
                else:
                    self._choices[key] = choice or TOO_SMALL
            if batch:
                self._later.append((key, batch))
        self.note = self._first_note(len(alone))

    def _measure(self, batch: list[RunConfig], paired: bool) -> _Measurement:
        from normexp.engines.auto import BATCHED_RUNS, REFERENCE_RUNS

        first, then = batch[:REFERENCE_RUNS], batch[REFERENCE_RUNS:REFERENCE_RUNS + BATCHED_RUNS]
        return _Measurement(tuple(batch), paired, tuple(_unit([cfg], "reference", self.device, self.threads)
                                                        for cfg in first),
                            _unit(then, "batched", self.device, self.threads))

    def _first_note(self, alone: int) -> str:
        if self.device != "cpu":
            return "engine auto: batched (stacked runs on the GPU)" if self._later else auto_note([], alone)
        if not self._measuring:
            return auto_note(list(self._choices.values()), alone)
        shapes = len(self._measuring)
        reference = sum(len(m.reference) for m in self._measuring.values())
        batched = sum(len(m.batched.configs) for m in self._measuring.values())
        pairs = " in pairs" if all(m.paired for m in self._measuring.values()) else ""
        return (f"engine auto: measuring which exact engine is faster here on this sweep's first runs ({reference} "
                f"on the reference{pairs}, {batched} batched, for {shapes} shape{'s' * (shapes > 1)}: "
                f"{_seconds(self._measured_seconds())} of runs, each kept as a result), then the rest on the faster")

    def _measured_seconds(self) -> float:
        """A rough time for the runs being measured, each on the engine it is measured on (from FLOPs)."""
        from normexp.engines.cost import estimated_seconds

        return sum(estimated_seconds(m.batch[:len(m.reference)], "reference")
                   + estimated_seconds(m.batched.runs, "batched") for m in self._measuring.values())

    def rest(self, results: Sequence[UnitResult]) -> tuple[list[WorkUnit], str]:
        """The units after `probe`, from its `results`, and the line that says which engine and why
        ("" where nothing was measured: the first line said it)."""
        for key, measurement in self._measuring.items():
            self._choices[key] = measurement.choose(results)
        units = list(self._alone)
        for key, runs in self._later:
            choice = self._choices.get(key)
            if self.device != "cpu" or getattr(choice, "engine", "") == "batched":
                units.append(_unit(runs, "batched", self.device, self.threads))
            else:
                units += [_unit([cfg], "reference", self.device, self.threads) for cfg in runs]
        return units, auto_note(list(self._choices.values()), len(self._alone)) if self._measuring else ""


TOO_SMALL = "its batches hold too few runs to measure"  # why a shape has no Choice: the reference trains it
UNTIMED = "the runs that measure it failed"


def auto_note(choices: Sequence[Choice | str], alone: int) -> str:
    """The line that says which exact engine `--engine auto` trains what with, and why: `choices`, each
    shape's Choice, or why it has none (TOO_SMALL, UNTIMED: the reference trains it)."""
    from normexp.engines.auto import MARGIN, MIN_RUNS

    measured = [c for c in choices if not isinstance(c, str)]
    unmeasured = [c for c in choices if isinstance(c, str)]
    if not choices:
        return "engine auto: reference (no runs share a batch)" if alone else "engine auto: nothing to train"
    if not measured:
        why = f"batches of fewer than {MIN_RUNS} runs" if set(unmeasured) == {TOO_SMALL} else "; ".join(
            sorted(set(unmeasured)))
        return f"engine auto: reference (not measured: {why})"
    if len(choices) == 1:
        return f"engine auto: {measured[0].engine} ({measured[0].why()})"
    engines = [getattr(c, "engine", "reference") for c in choices]
    parts = [f"{engines.count(e)} shape{'s' * (engines.count(e) > 1)} {e}" for e in sorted(set(engines))]
    ratios = [c.reference_ms / c.batched_ms for c in measured]
    where = "this CPU" if all(c.cached for c in measured) else "this sweep's first runs"
    others = f"; {len(unmeasured)} not measured: {', '.join(sorted(set(unmeasured)))}" if unmeasured else ""
    return (f"engine auto: {', '.join(parts)} (batched measured {min(ratios):.2f}-{max(ratios):.2f}x the reference "
            f"per model-step on {where}; it needs >= {1 / MARGIN:.2f}x{others})")



def _plan_fast_units(runs: Sequence[RunConfig], device: str, threads: int, compile: bool | None,
                     planned: Sequence[RunConfig]) -> list[WorkUnit]:
    """The fast engine's batches of `planned` that hold a run of `runs`; each structure compiles when
    its planned model-steps pay for it. Runs the fast engine does not serve (`fast_serves`: with
    `train.log_blocks`, whose blocks.csv is the reference's bits or nothing, `train.log_sharpness`, which the
    reference measures, or an optimizer control it does not replay yet) go to the exact engines instead."""
    from normexp.engines.fast import compile_choice, fast_key, fast_serves, plan_fast
    from normexp.folder import run_id

    declined = [cfg for cfg in runs if not fast_serves(cfg)]
    exact = plan_units(declined, "batched", device, threads) if declined else []
    wanted = {run_id(cfg) for cfg in runs if fast_serves(cfg)}
    planned = list({run_id(cfg): cfg for cfg in [*planned, *runs] if fast_serves(cfg)}.values())
    choice = compile_choice(planned, compile)

    def compiled(cfg: RunConfig) -> bool:
        return choice[fast_key(cfg)]

    units = []
    for batch in plan_fast(planned, compiled):
        record = tuple(run_id(cfg) in wanted for cfg in batch)
        if any(record):
            units.append(WorkUnit(tuple(c.model_dump(mode="json") for c in batch), "fast", device, threads,
                                  compile=compiled(batch[0]), record=() if all(record) else record))
    return units + exact



class Stopped(BaseException):  # noqa: N818 - not an error: the executor asked a run to stop
    """Raised inside a run that a closing executor stopped (a BaseException: no run records it)."""



def run_unit(unit: WorkUnit, stop: threading.Event | None = None) -> UnitResult:
    """Train one unit (in whatever process runs this) and return plain results, its steps timed; never
    raises, except `Stopped` at the first step after `stop` is set (reference and fast units)."""
    import torch

    torch.set_num_threads(unit.threads)
    runs = unit.runs
    clock = StepClock(_stop_check(stop))
    if unit.engine != "reference":
        from normexp.engines.batched import train_batch
        from normexp.engines.fast import train_fast

        try:
            results = (train_fast(runs, unit.device, unit.compile, on_step=clock) if unit.engine == "fast"
                       else train_batch(runs, unit.device, on_step=clock))
        except Exception:  # noqa: BLE001 - one run's error must not fail its batch-mates: see _run_alone
            return UnitResult(unit, _run_alone(runs, unit.device, stop))
        return UnitResult(unit, tuple(_finished(r, unit.device) for r in results), step_s=clock.step_s())
    outcomes = _run_alone(runs, unit.device, stop, clock)
    return UnitResult(unit, outcomes, step_s=clock.step_s() if len(runs) == 1 else None)


class StepClock:
    """A step callback that stamps the time of each step that goes on (then calls `then`, if any), so
    that a unit knows how long its steps took: what `--engine auto` compares the engines by."""

    def __init__(self, then: Callable[..., None] | None = None) -> None:
        self.then = then
        self.stamps: list[float] = []

    def __call__(self, *step: object) -> None:
        self.stamps.append(time.perf_counter())
        if self.then is not None:
            self.then(*step)

    def step_s(self) -> float | None:
        """The median interval between consecutive stamps: one whole step (update, forward, backward),
        step 0 excluded (it warms the kernels); None with fewer than two stamps."""
        intervals = [b - a for a, b in zip(self.stamps, self.stamps[1:])]
        return statistics.median(intervals) if intervals else None



def _stop_check(stop: threading.Event | None) -> Callable[..., None] | None:
    """A step callback that raises `Stopped` once `stop` is set; None where nothing can stop the run."""
    if stop is None:
        return None

    def check(*step: object) -> None:
        if stop.is_set():
            raise Stopped

    return check



def _run_alone(runs: Sequence[RunConfig], device: str, stop: threading.Event | None = None,
               on_step: Callable[..., None] | None = None) -> tuple[FinishedRun | str, ...]:
    """Each run on the reference engine, one at a time; a run that raises gets its error message.
    A batch that raised is retried this way: the reference engine gives the batched engine's bits,
    so the batch-mates of a bad run finish with the numbers they would have had, and only the
    culprit is recorded as failed. `on_step`: the step callback (else: the stop check)."""
    from normexp.engines.reference import train_run

    outcomes: list[FinishedRun | str] = []
    for cfg in runs:
        try:
            outcomes.append(_finished(train_run(cfg, device=device, on_step=on_step or _stop_check(stop)), device))
        except Exception as exc:  # noqa: BLE001 - reported per run
            outcomes.append(_error(exc))
    return tuple(outcomes)



def _finished(result: Any, device: str) -> FinishedRun:
    return FinishedRun(result.metrics, result.status, result.wall_s, result.threads, result.engine, device,
                       result.blocks, result.stopped_at, result.stop_reason, result.sharpness)



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



def _seconds(seconds: float) -> str:
    return "under 1 s" if seconds < 1 else f"~{seconds:.0f} s" if seconds < 120 else f"~{seconds / 60:.0f} min"
