"""Hostile checks of the in-process executor's paired runs (two small reference runs at a time, in
threads): a stop signal while the executor stops them, platforms without `os.sched_getaffinity`,
and the bits of mixed thread counts and optimizers paired against runs one after another."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
from test_reliability import failing_for_seed_1

from normexp import executors
from normexp.config import RunConfig, load_sweep
from normexp.engines import reference
from normexp.executors import InProcessExecutor, pairs_well
from normexp.results import load_summary
from normexp.sweep import SweepInterrupted, SweepOptions, run_sweep
from normexp.units import plan_units


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
