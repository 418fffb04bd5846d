"""Hostile review of 788d925 (the fast engine's lazily made batch model; a replay seeds the CPU generator
alone)."""

from __future__ import annotations

import threading

from normexp import executors
from normexp.config import RunConfig
from normexp.engines import fast, initial
from normexp.engines.fast import train_fast
from normexp.executors import InProcessExecutor, pairs_well
from normexp.units import plan_units, run_unit


def test_paired_fast_batches_of_one_structure_each_run_their_own_model(monkeypatch):
    """Two uncompiled batches of one structure (here: the same model, two optimizers, so two batches) are
    trained at once in threads by the in-process executor; functional_call swaps parameters into the
    module it runs, so each batch must run its own module (`batch_model`), and give the bits it gives alone."""
    configs = [RunConfig.model_validate({"model": {"depth": 4, "width": 16}, "optim": {"name": name, "lr": 0.01},
                                         "train": {"steps": 30, "threads": 1}, "seed": seed})
               for name in ("adam", "sgd") for seed in (0, 1)]
    units = plan_units(configs, "fast", "cpu", 1, compile=False)
    assert len(units) == 2 and all(pairs_well(unit) for unit in units)
    assert len({initial.structure(unit.runs[0]) for unit in units}) == 1  # one structure, two batches
    models: dict[str, list] = {}
    real = fast.make_grad_step

    def recording(base, *args, **kwargs):
        models.setdefault(threading.current_thread().name, []).append(base)
        return real(base, *args, **kwargs)

    monkeypatch.setattr(fast, "make_grad_step", recording)
    paired = {id(r.unit): r.outcomes for r in InProcessExecutor().run(units)}
    assert len(paired) == 2 and len(models) == 2 and threading.main_thread().name not in models
    (a,), (b,) = models.values()
    assert a is not b  # each thread its own module
    monkeypatch.setattr(fast, "make_grad_step", real)
    for unit in units:
        alone = train_fast(unit.runs, "cpu", compile=False)
        assert [o.metrics for o in paired[id(unit)]] == [r.metrics for r in alone]  # bit for bit
