"""The in-process executor's paired runs: two small reference runs, or two uncompiled fast engine batches,
trained at once in threads. Which pair (small ones of one thread count; `pairs_well` without
`os.sched_getaffinity` too), their bits against runs one after another in a fresh process, each batch with
a model of its own, a run that raises failing alone, a stop signal while the pairs stop or while a batch is
written, and what a sweep of many pairs leaves behind (the collector, torch's thread count, threads)."""

from __future__ import annotations

import gc
import json
import signal
import subprocess
import sys
import threading

import pytest
import torch
from test_reliability import failing_for_seed_1

from normexp import executors
from normexp.config import RunConfig, build_sweep, load_sweep
from normexp.engines import fast, reference
from normexp.engines.cost import model_step_flops
from normexp.engines.fast import starts, train, train_fast
from normexp.executors import InProcessExecutor, pairs_well
from normexp.results import load_summary
from normexp.sweep import SweepInterrupted, SweepOptions, run_sweep
from normexp.units import plan_units

pytestmark = pytest.mark.equivalence  # paired runs against runs one after another, bit for bit


# ----------------------------------------------------------------------------- reference runs


def test_a_stop_signal_while_fail_fast_stops_the_paired_runs_interrupts_the_sweep(write_yaml, tmp_path, monkeypatch):
    """--fail-fast leaves the executor's results at the first failure, and the executor then waits for
    the other paired run to stop. A Ctrl-C in that wait must interrupt the sweep (exit 130, "interrupted"),
    not vanish as an "Exception ignored" printed by the garbage collector while the sweep goes on."""
    monkeypatch.setattr(reference, "train_run", failing_for_seed_1(reference.train_run))
    real_close = InProcessExecutor.close
    signalled = []

    def close(self):
        stopping_pairs = self._pool is not None
        real_close(self)
        if stopping_pairs and not signalled:
            signalled.append(True)
            raise KeyboardInterrupt  # the Ctrl-C that came while the threads were joined

    monkeypatch.setattr(InProcessExecutor, "close", close)
    sweep = load_sweep(write_yaml("name: f\nbase: {model: {depth: 2, width: 8}, train: {steps: 2}}\n"
                                  "seeds: [0, 1, 2, 3]\n"))
    with pytest.raises(SweepInterrupted) as caught:
        run_sweep(sweep, tmp_path / "out", SweepOptions(engine="reference", fail_fast=True))
    assert signalled and caught.value.outcome.interrupted
    assert "failed" in set(load_summary(tmp_path / "out")["status"])


def test_pairs_well_where_os_has_no_sched_getaffinity(monkeypatch):
    """macOS has no os.sched_getaffinity: the default executor must not fail on it."""
    unit = plan_units([RunConfig.model_validate({"model": {"depth": 2, "width": 8}})], "reference", "cpu", 1)[0]
    monkeypatch.delattr(executors.os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(executors.os, "cpu_count", lambda: 4)
    assert pairs_well(unit)
    monkeypatch.setattr(executors.os, "cpu_count", lambda: None)
    assert not pairs_well(unit)


MIXED = [{"model": {"depth": 4, "width": 32}, "optim": {"name": opt}, "train": {"steps": 6, "threads": threads},
          "seed": seed}
         for seed in (0, 1) for opt in ("adam", "radam") for threads in (1, 2)]  # thread counts interleaved


ALONE = """
import json, sys
from normexp.config import RunConfig
from normexp.engines.reference import train_run
print(json.dumps([train_run(RunConfig.model_validate(c)).metrics for c in json.loads(sys.argv[1])]))
"""


@pytest.mark.process
def test_paired_runs_of_mixed_thread_counts_and_optimizers_give_the_bits_of_a_fresh_process_one_by_one():
    """Each thread count's runs, and RAdam's lazy torch.optim import in two threads at once: bits equal
    those of the runs one after another, in a fresh process. Runs whose `train.threads` differ are not
    paired (they train one after another); runs of one count are."""
    configs = [RunConfig.model_validate(c) for c in MIXED]
    for threads in (1, 2, None):
        chosen = [c for c in configs if threads in (None, c.train.threads)]
        units = plan_units(chosen, "reference", "cpu", 2)
        assert all(pairs_well(u) for u in units) or pytest.skip("one core: nothing is paired")
        where = []
        real = executors.run_unit

        def recording(unit, stop=None, real=real, where=where):
            where.append(threading.current_thread() is threading.main_thread())
            return real(unit, stop)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(executors, "run_unit", recording)
            paired = {id(r.unit): r.outcomes[0] for r in InProcessExecutor().run(units)}
        assert all(where) == (threads is None) and any(where) == (threads is None)  # mixed: in the main thread
        check_alone(chosen, units, paired)


def check_alone(configs, units, paired) -> None:
    alone = json.loads(subprocess.run([sys.executable, "-c", ALONE, json.dumps([c.model_dump(mode="json")
                                                                               for c in configs])],
                                      capture_output=True, text=True, check=True).stdout)
    for cfg, unit, metrics in zip(configs, units, alone):
        assert paired[id(unit)].threads == cfg.train.threads
        assert paired[id(unit)].metrics == metrics, (cfg.optim.name, cfg.train.threads, cfg.seed)


def test_a_paired_run_that_finishes_while_the_sweep_is_interrupted_is_kept(write_yaml, tmp_path, monkeypatch):
    """Ctrl-C while one paired run is recorded and the other finishes: the other run's training is
    done, so the interrupted sweep records it instead of throwing it away (one after another, the
    sweep never held a finished run it had not written)."""
    import threading
    import time

    real = reference.train_run
    first_recorded, zero_trained = threading.Event(), threading.Event()

    def train_run(cfg, **kwargs):
        result = real(cfg, **kwargs)
        if cfg.seed == 0:  # trained; returns while the sweep is being interrupted
            zero_trained.set()
            first_recorded.wait(10)
            time.sleep(0.05)
        else:  # seed 1 is recorded (and the sweep interrupted) only once seed 0 has trained: had seed 0 still
            zero_trained.wait(10)  # been training then, the Ctrl-C would stop it, rightly, as interrupted
        return result

    monkeypatch.setattr(reference, "train_run", train_run)

    def on_event(event):
        if event.kind == "finished" and not first_recorded.is_set():
            first_recorded.set()
            raise KeyboardInterrupt  # the Ctrl-C, right after seed 1's folder is written

    sweep = load_sweep(write_yaml("name: f\nbase: {model: {depth: 2, width: 8}, train: {steps: 2}}\n"
                                  "seeds: [0, 1]\n"))
    with pytest.raises(SweepInterrupted):
        run_sweep(sweep, tmp_path / "out", SweepOptions(engine="reference"), on_event)
    assert list(load_summary(tmp_path / "out")["status"]) == ["completed", "completed"]


# ----------------------------------------------------------------------------- fast engine batches


def runs(width: int, placements=("post", "pre"), seeds=(0, 1, 2), steps: int = 5) -> list[RunConfig]:
    return [RunConfig.model_validate({"model": {"depth": 3, "width": width}, "norm": {"placement": p},
                                      "train": {"steps": steps}, "seed": s})
            for p in placements for s in seeds]


def test_fast_batches_of_big_runs_are_not_paired():
    """Two batches in threads hold both batches' parameters, optimizer state and activations at once:
    two 64-run batches of width 512 (3.2 GFLOP a run-step) peaked at 22 GB of RSS paired, against
    11 GB one after another, on a 23 GB machine, for 8% less time. Only batches of small runs pair,
    as only small reference runs do."""
    small = plan_units(runs(16), "fast", "cpu", 1, compile=False)
    big = plan_units(runs(512), "fast", "cpu", 1, compile=False)
    assert all(pairs_well(unit) for unit in small) or pytest.skip("one core: nothing is paired")
    assert model_step_flops(big[0].runs[0]) >= 1e9
    assert not any(pairs_well(unit) for unit in big)


def test_a_run_that_raises_in_a_paired_fast_batch_fails_alone(monkeypatch):
    """The batch that raised is retried run by run on the reference engine: its other runs get the
    reference's bits, the culprit is failed, and the batch trained beside it keeps its own bits."""
    configs = runs(16)
    batch = configs[3:]  # pre: the batch that does not raise
    alone_fast = {("pre", c.seed): r.metrics for c, r in zip(batch, fast.train_fast(batch, compile=False))}
    alone_reference = {c.seed: reference.train_run(c).metrics for c in configs[:3]}
    real_fast, real_run = fast.train_fast, reference.train_run
    culprit = configs[1]  # post, seed 1

    def train_fast(batch, *args, **kwargs):
        if culprit in batch:
            raise RuntimeError("boom in the batch")
        return real_fast(batch, *args, **kwargs)

    def train_run(cfg, **kwargs):
        if cfg == culprit:
            raise RuntimeError("boom alone")
        return real_run(cfg, **kwargs)

    monkeypatch.setattr(fast, "train_fast", train_fast)
    monkeypatch.setattr(reference, "train_run", train_run)
    units = plan_units(configs, "fast", "cpu", torch.get_num_threads(), compile=False)
    assert len(units) == 2 and all(pairs_well(unit) for unit in units) or pytest.skip("one core: nothing is paired")
    outcomes = {(c.norm.placement, c.seed): o
                for result in InProcessExecutor().run(units) for c, o in zip(result.unit.runs, result.outcomes)}
    assert "boom alone" in outcomes["post", 1]
    for seed in (0, 2):
        assert (outcomes["post", seed].engine, outcomes["post", seed].metrics) == ("reference", alone_reference[seed])
    for key, metrics in alone_fast.items():
        assert (outcomes[key].engine, outcomes[key].metrics) == ("fast", metrics)


def test_a_sweep_of_many_paired_fast_batches_leaves_the_process_as_it_found_it(tmp_path):
    """Each batch pauses the process-wide collector while it stacks its runs; with two threads
    stacking, a pause must never outlive the sweep. Thread counts and threads are left as found."""
    before = (gc.isenabled(), torch.get_num_threads(), threading.active_count())
    spec = build_sweep({"name": "g", "base": {"model": {"depth": 2, "width": 8}, "train": {"steps": 2, "threads": 1}},
                        "grid": {"norm.placement": ["post", "pre"], "norm.kind": ["layernorm", "rmsnorm"],
                                 "model.depth": [1, 2, 3, 4, 5]}, "seeds": [0, 1]})
    run_sweep(spec, tmp_path / "out", SweepOptions(engine="fast", compile=False))
    assert set(load_summary(tmp_path / "out")["status"]) == {"completed"}
    assert (gc.isenabled(), torch.get_num_threads(), threading.active_count()) == before
    fresh = []
    thread = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert fresh == [before[1]]  # torch's count for threads started later


def test_a_stop_while_a_batch_is_written_keeps_the_whole_batch(tmp_path):
    """A batch's runs are trained together and written one by one: a Ctrl-C right after its first
    run's folder is in place must not throw the rest of the trained batch away (they would be
    retrained on resume). The stop takes effect once the whole batch is written."""
    from normexp.sweep import SweepInterrupted

    spec = build_sweep({"name": "w", "base": {"model": {"depth": 2, "width": 8}, "train": {"steps": 2}},
                        "grid": {"norm.placement": ["post", "pre"]}, "seeds": [0, 1, 2]})
    interrupted = []

    def on_event(event):
        if event.kind == "finished" and not interrupted:
            interrupted.append(event.run_id)
            signal.raise_signal(signal.SIGINT)  # a Ctrl-C as the first run's folder is written

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as the command line has it
    try:
        with pytest.raises(SweepInterrupted):
            run_sweep(spec, tmp_path / "out", SweepOptions(engine="fast", compile=False), on_event)
    finally:
        signal.signal(signal.SIGINT, previous)
    statuses = list(load_summary(tmp_path / "out")["status"])
    assert statuses.count("completed") in (3, 6), statuses  # whole batches: seeds 0-2 of a placement


def test_paired_fast_batches_of_one_structure_each_run_their_own_model(monkeypatch):
    """Two uncompiled batches of one structure (here: the same model, two optimizers, so two batches) are
    trained at once in threads by the in-process executor; functional_call swaps parameters into the
    module it runs, so each batch must run its own module (`batch_model`), and give the bits it gives alone."""
    configs = [RunConfig.model_validate({"model": {"depth": 4, "width": 16}, "optim": {"name": name, "lr": 0.01},
                                         "train": {"steps": 30, "threads": 1}, "seed": seed})
               for name in ("adam", "sgd") for seed in (0, 1)]
    units = plan_units(configs, "fast", "cpu", 1, compile=False)
    assert len(units) == 2 and all(pairs_well(unit) for unit in units)
    assert len({starts.structure(unit.runs[0]) for unit in units}) == 1  # one structure, two batches
    models: dict[str, list] = {}
    real = train.make_grad_step

    def recording(base, *args, **kwargs):
        models.setdefault(threading.current_thread().name, []).append(base)
        return real(base, *args, **kwargs)

    monkeypatch.setattr(train, "make_grad_step", recording)
    paired = {id(r.unit): r.outcomes for r in InProcessExecutor().run(units)}
    assert len(paired) == 2 and len(models) == 2 and threading.main_thread().name not in models
    (a,), (b,) = models.values()
    assert a is not b  # each thread its own module
    monkeypatch.setattr(train, "make_grad_step", real)
    for unit in units:
        alone = train_fast(unit.runs, "cpu", compile=False)
        assert [o.metrics for o in paired[id(unit)]] == [r.metrics for r in alone]  # bit for bit
