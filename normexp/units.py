"""Work units: what one worker trains together (a batch of runs for the batched and fast engines, one run
for the reference), how a sweep's runs are split into them, and how a unit is trained, in whatever process
runs it. Units carry configs and results as plain data, so that any executor (normexp/executors.py) can
ship them: in process, to a worker process, or to a Dask worker."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from normexp.config import RunConfig
from normexp.store import FinishedRun

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



def plan_units(runs: Sequence[RunConfig], engine: str, device: str, threads: int,
               compile: bool | None = None, planned: Sequence[RunConfig] | None = None) -> list[WorkUnit]:
    """Split runs into work units: batches where the batched engine applies, single runs elsewhere;
    with the fast engine, batches of every structure (`compile` None: decided per structure).
    `planned`: every run of the sweep, `runs` those still to train. The fast engine's batches (and its
    compile choice) are planned over all of them, so that they do not depend on which runs are done:
    each batch with a run to train is trained whole, and only those runs are recorded."""
    def unit(configs: Sequence[RunConfig], engine: Engine) -> WorkUnit:
        return WorkUnit(tuple(c.model_dump(mode="json") for c in configs), engine, device, threads)

    if engine == "reference":
        return [unit([cfg], "reference") for cfg in runs]
    if engine == "fast":
        return _plan_fast_units(runs, device, threads, compile, runs if planned is None else planned)
    if engine == "auto":
        return plan_auto_units(runs, device, threads)[0]  # the sweep passes its executor's pairing
    from normexp.engines.batched import plan_batches

    batches, alone = plan_batches(runs)
    return [unit(batch, "batched") for batch in batches] + [unit([cfg], "reference") for cfg in alone]


def plan_auto_units(runs: Sequence[RunConfig], device: str, threads: int,
                    pairs: Callable[[WorkUnit], bool] = lambda unit: False) -> tuple[list[WorkUnit], str]:
    """`--engine auto`: each batch the batched engine could train goes to the faster exact engine for its
    shape on this machine (normexp/engines/auto.py: measured once, cached); on a GPU, batched. `pairs`:
    whether the executor trains a reference unit beside another (then the reference is probed so).
    Returns the units and a line saying which engine and why."""
    from normexp.engines.batched import plan_batches

    def unit(configs: Sequence[RunConfig], engine: Engine) -> WorkUnit:
        return WorkUnit(tuple(c.model_dump(mode="json") for c in configs), engine, device, threads)

    batches, alone = plan_batches(runs)
    units = [unit([cfg], "reference") for cfg in alone]
    if device != "cpu":
        return [unit(b, "batched") for b in batches] + units, "engine auto: batched (stacked runs on the GPU)"
    from normexp.engines.auto import choose

    choices: dict[tuple, Any] = {}
    for batch in batches:
        shape = (batch[0].model, batch[0].norm.kind, batch[0].data, batch[0].optim.name, len(batch))
        if shape not in choices:
            choices[shape] = choose(batch, pairs(unit(batch[:1], "reference")))
        choice = choices[shape]
        units += [unit(batch, "batched")] if choice.engine == "batched" else [unit([c], "reference") for c in batch]
    return units, auto_note(list(choices.values()), len(alone))


def auto_note(choices: list, alone: int) -> str:
    """The sweep's first line under `--engine auto`: which exact engine trains what, and why."""
    from normexp.engines.auto import MARGIN

    if not choices:
        return "engine auto: reference (no runs share a batch)" if alone else "engine auto: nothing to train"
    engines = sorted({c.engine for c in choices})
    if len(choices) == 1:
        return f"engine auto: {choices[0].engine} ({choices[0].why()})"
    parts = [f"{sum(c.engine == e for c in choices)} shapes {e}" for e in engines]
    ratios = [c.reference_ms / c.batched_ms for c in choices]
    return (f"engine auto: {', '.join(parts)} (batched measured {min(ratios):.2f}-{max(ratios):.2f}x the reference "
            f"per model-step on this CPU; it needs >= {1 / MARGIN:.2f}x)")



def _plan_fast_units(runs: Sequence[RunConfig], device: str, threads: int, compile: bool | None,
                     planned: Sequence[RunConfig]) -> list[WorkUnit]:
    """The fast engine's batches of `planned` that hold a run of `runs`; each structure compiles when
    its planned model-steps pay for it. Runs with `train.log_blocks` go to the exact engines instead:
    blocks.csv is the reference's bits or nothing."""
    from normexp.engines.fast import fast_key, plan_fast, should_compile
    from normexp.runfolder import run_id

    logging = [cfg for cfg in runs if cfg.train.log_blocks]
    exact = plan_units(logging, "batched", device, threads) if logging else []
    wanted = {run_id(cfg) for cfg in runs if not cfg.train.log_blocks}
    planned = list({run_id(cfg): cfg for cfg in [*planned, *runs] if not cfg.train.log_blocks}.values())
    model_steps: dict[tuple, int] = {}
    for cfg in planned:
        model_steps[fast_key(cfg)] = model_steps.get(fast_key(cfg), 0) + cfg.train.steps + 1
    units = []
    for batch in plan_fast(planned):
        record = tuple(run_id(cfg) in wanted for cfg in batch)
        if any(record):
            units.append(WorkUnit(tuple(c.model_dump(mode="json") for c in batch), "fast", device, threads,
                                  compile=should_compile(batch[0], model_steps[fast_key(batch[0])])
                                  if compile is None else compile, record=() if all(record) else record))
    return units + exact



class Stopped(BaseException):  # noqa: N818 - not an error: the executor asked a run to stop
    """Raised inside a run that a closing executor stopped (a BaseException: no run records it)."""



def run_unit(unit: WorkUnit, stop: threading.Event | None = None) -> UnitResult:
    """Train one unit (in whatever process runs this) and return plain results; never raises, except
    `Stopped` at the first step after `stop` is set (reference and fast units)."""
    import torch

    torch.set_num_threads(unit.threads)
    runs = unit.runs
    if unit.engine != "reference":
        from normexp.engines.batched import train_batch
        from normexp.engines.fast import train_fast

        try:
            results = (train_fast(runs, unit.device, unit.compile, on_step=_stop_check(stop)) if unit.engine == "fast"
                       else train_batch(runs, unit.device))
        except Exception:  # noqa: BLE001 - one run's error must not fail its batch-mates: see _run_alone
            return UnitResult(unit, _run_alone(runs, unit.device, stop))
        return UnitResult(unit, tuple(_finished(r, unit.device) for r in results))
    return UnitResult(unit, _run_alone(runs, unit.device, stop))



def _stop_check(stop: threading.Event | None) -> Callable[..., None] | None:
    """A step callback that raises `Stopped` once `stop` is set; None where nothing can stop the run."""
    if stop is None:
        return None

    def check(*step: object) -> None:
        if stop.is_set():
            raise Stopped

    return check



def _run_alone(runs: Sequence[RunConfig], device: str,
               stop: threading.Event | None = None) -> tuple[FinishedRun | str, ...]:
    """Each run on the reference engine, one at a time; a run that raises gets its error message.
    A batch that raised is retried this way: the reference engine gives the batched engine's bits,
    so the batch-mates of a bad run finish with the numbers they would have had, and only the
    culprit is recorded as failed."""
    from normexp.engines.reference import train_run

    outcomes: list[FinishedRun | str] = []
    for cfg in runs:
        try:
            outcomes.append(_finished(train_run(cfg, device=device, on_step=_stop_check(stop)), device))
        except Exception as exc:  # noqa: BLE001 - reported per run
            outcomes.append(_error(exc))
    return tuple(outcomes)



def _finished(result: Any, device: str) -> FinishedRun:
    return FinishedRun(result.metrics, result.status, result.wall_s, result.threads, result.engine, device,
                       result.blocks, result.stopped_at, result.stop_reason)



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
