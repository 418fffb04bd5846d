"""The fast engine's loop: `train_fast` trains a batch of runs of one structure together, compiled or not, and
records each run as the reference records it."""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Sequence

import torch
from torch.func import vmap

from normexp.config import RunConfig
from normexp.engines.common import (
    NOT_EVALUATED,
    EarlyStop,
    RunResult,
    evaluates,
    record_live,
    share_wall_time,
    torch_threads,
    validation_rows,
)
from normexp.engines.fast.compiled import (
    CompileFailed,
    compiled_step,
    compiler_call,
    has_step,
    is_refused,
    refuse,
)
from normexp.engines.fast.optim import FastOptimizer, MadeAhead
from normexp.engines.fast.plan import chunk_runs, compile_choice, fast_key, loops_runs
from normexp.engines.fast.step import batch_model, held_out, make_grad_step, make_loss_fn, run_by_run, stack_runs
from normexp.optim import agc_units, step_lr


def train_fast(runs: Sequence[RunConfig], device: str = "cpu", compile: bool | None = None,
               on_step: Callable[[int], None] | None = None) -> list[RunResult]:
    """Train `runs` (equal `fast_key`) together; one RunResult per run, recorded as `train_run` records.
    `compile`: compile the gradient step, or None to decide from this batch's model-steps (`compile_choice`).
    `on_step` is called after each recorded step (what it raises ends the batch)."""
    use_compile = compile_choice(runs, compile)[fast_key(runs[0])]
    if use_compile and not is_refused(runs[0], device):
        try:
            return _train_padded(runs, device, on_step)
        except CompileFailed as failed:  # the eager step still works (what a run raises itself is not caught)
            exc = failed.__cause__ or failed
            refuse(runs[0], device)  # later batches of this step in this process: uncompiled
            first_line = (str(exc).strip().splitlines() or [""])[0][:200]
            warnings.warn(f"compiling the step failed ({type(exc).__name__}: {first_line}); training this "
                          "structure's runs uncompiled", RuntimeWarning, stacklevel=2)
    return _train(runs, device, False, on_step)


def _train_padded(runs: Sequence[RunConfig], device: str, on_step: Callable[[int], None] | None) -> list[RunResult]:
    """The compiled loop on batches of `chunk_runs` runs (one compiled shape for every batch): a larger
    batch in chunks, one after another, and the last padded with copies of its first run, whose results
    are dropped."""
    size = chunk_runs(runs[0], True)
    if len(runs) > size:
        return [result for i in range(0, len(runs), size)
                for result in _train_padded(runs[i:i + size], device, on_step)]
    padded = list(runs) + [runs[0]] * (size - len(runs))
    results = _train(padded, device, True, on_step)[:len(runs)]
    for result in results:
        result.wall_s *= len(padded) / len(runs)
    return results


def _train(runs: Sequence[RunConfig], device: str, compiled: bool,
           on_step: Callable[[int], None] | None = None) -> list[RunResult]:
    """The loop of `train_fast`: record each step's metrics per run, stop when no run is recording."""
    start = time.perf_counter()
    first = runs[0]
    stop_on_nonfinite = first.train.stop_on_nonfinite
    with torch_threads(first.train.threads) as threads:
        batch = stack_runs(runs, device)
        base = functools.cache(functools.partial(batch_model, first))  # made where needed, once
        units = None
        if first.optim.agc is not None:  # each parameter's unit, by name, from the reference's own model
            by_name = dict(zip([name for name, _ in base().named_parameters()], agc_units(base())))
            units = [by_name[name] for name in batch.params]
        optimizer = FastOptimizer(first.optim.name, [cfg.optim for cfg in runs], list(batch.params.values()), units)
        if compiled and not has_step(first, batch):
            base()  # the model the step is traced from, made outside the compiler's wrap: what it raises is the batch's
        steps = first.train.steps
        schedule = MadeAhead(lambda step: [step_lr(cfg, step) for cfg in runs], steps + 1)  # each step's lrs
        step_fn = compiler_call(compiled_step, first, base, batch, optimizer, schedule) if compiled else None
        looped = step_fn is None and loops_runs(first)  # a text run's big step: run by run, not vmapped
        grad_step = make_grad_step(base(), batch.positions, first.train.z_loss, looped) if step_fn is None else None
        per_run = run_by_run if looped else vmap
        val_step = per_run(make_loss_fn(base(), batch.positions)) if batch.val_x is not None else None
        rows = validation_rows(first)
        results = [RunResult(threads=threads, engine="fast", early_stop=EarlyStop.of(cfg)) for cfg in runs]
        live = [True] * len(runs)  # runs still recording (and updating)
        # a step at which runs stop is scored for them once their losses say so (`evaluates`), on the weights
        # of that step: a compiled Adam step has moved the batch's on by then, so they are kept before it,
        # where a run can stop (made at the first step the schedule does not score: none with eval_every 1)
        keeps = (val_step is not None and step_fn is not None and step_fn.fused
                 and (first.train.stop_when is not None or stop_on_nonfinite))
        kept = None
        for step in range(steps + 1):
            lrs = schedule[step]
            vals = [None] * len(runs)
            scheduled = evaluates(first, step)
            if val_step is not None:  # before the step: a compiled Adam step updates the parameters in place
                vals = held_out(val_step, batch, rows) if scheduled else [NOT_EVALUATED] * len(runs)
                if keeps and not scheduled:
                    kept = kept or {name: torch.empty_like(p) for name, p in batch.params.items()}
                    torch._foreach_copy_(list(kept.values()), list(batch.params.values()))
            if step_fn is not None:
                metrics = compiler_call(step_fn.step, batch.params, *batch.step_data(step), lrs, live)
            else:
                grads, metrics = grad_step(batch.params, *batch.step_data(step))
            losses, accs, norms, *zs = metrics.tolist()  # zs: [the z-loss terms] with train.z_loss
            stopped = record_live(results, live, step, losses, accs, lrs, norms, stop_on_nonfinite, vals, *zs)
            if val_step is not None and stopped and not scheduled:  # the whole batch scored, kept for these
                scores = held_out(val_step, batch, rows, kept)
                for r in stopped:
                    results[r].score_stop(scores[r])
            if not any(live):
                break
            if on_step is not None:
                on_step(step)
            if step < steps:
                if step_fn is not None:
                    compiler_call(step_fn.update, lrs, live)
                else:
                    optimizer.step(list(grads.values()), lrs, live)
    return share_wall_time(results, start)
