"""Hostile review of the fused (Adam update inside the compiled step) fast path and its refusal logic."""

from __future__ import annotations

import warnings

import pytest
from test_fast import runs

from normexp.engines.fast import aot, starts, train_fast
from normexp.engines.fast import compiled as compiling


def traced_eagerly(calls: list[int], used: list[int] | None = None):
    """`aot.load_or_compile` without the compiler: the traced graph run eagerly, each compile counted (and
    each call of a compiled step, in `used`)."""
    def load_or_compile(key, trace, inputs, fresh=False):
        calls.append(len(inputs))
        graph = trace()

        def step(*args):
            if used is not None:
                used.append(1)
            return graph(*args)
        return step, True
    return load_or_compile


def no_fused_compile(*args, **kwargs):
    raise RuntimeError("the fused step cannot be exported")


@pytest.mark.parametrize("other", [{"optim": "sgd"}, {"optim": "radam"}])
def test_a_refused_adam_step_leaves_the_structures_other_compiled_steps_alone(monkeypatch, other, fresh_fast_engine):
    """A compile that fails for the Adam step (its update inside) refuses that step, not the gradient step
    SGD and RAdam runs of the same model compile: those were compiled once and stay compiled, so their
    bits do not depend on whether an Adam batch of the structure trained earlier in the process (a resumed
    sweep, or another worker, would otherwise give them other bits)."""
    calls: list[int] = []
    used: list[int] = []
    monkeypatch.setattr(aot, "load_or_compile", traced_eagerly(calls, used))
    monkeypatch.setattr(compiling, "compile_train_step", no_fused_compile)
    compiling.reset_cache()
    plain = runs(n=2, steps=3, **other)
    alone = train_fast(plain, compile=True)  # as a process that never saw an Adam batch
    assert len(calls) == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_fast(runs(optim="adam", n=2, steps=3), compile=True)
    assert len(caught) == 1 and "compiling the step failed" in str(caught[0].message)
    before = len(used)
    after = train_fast(plain, compile=True)
    assert len(used) > before, "the structure's gradient step was refused with the Adam step"
    assert len(calls) == 1, "the gradient step was thrown away and compiled again"
    assert [repr(r.metrics) for r in after] == [repr(r.metrics) for r in alone]
    fresh_calls: list[int] = []
    monkeypatch.setattr(aot, "load_or_compile", traced_eagerly(fresh_calls))
    compiling.reset_cache()
    train_fast(runs(optim="adam", n=2, steps=3), compile=True)  # the Adam step fails first this time
    assert [repr(r.metrics) for r in train_fast(plain, compile=True)] == [repr(r.metrics) for r in alone]
    assert len(fresh_calls) == 1, "the gradient step was refused with the Adam step"


def test_a_run_that_raises_in_a_compiled_batch_is_not_blamed_on_the_compiler(monkeypatch, fresh_fast_engine):
    """A run whose own training raises (here its initialisation) fails its batch as it does uncompiled
    (`run_unit` retries the batch run by run): no 'compiling the step failed' warning, and the structure's
    later batches in the process still train compiled (before, one bad run refused the compiled step for
    the rest of the process: 1.8x slower, and other bits than a resumed sweep gives those batches)."""
    calls: list[int] = []
    used: list[int] = []
    monkeypatch.setattr(aot, "load_or_compile", traced_eagerly(calls, used))
    compiling.reset_cache()
    real_start = starts.seeded_start
    bad = runs(n=2, steps=3)
    culprit = bad[1].model_copy(update={"seed": 999})

    def seeded_start(cfg):
        if cfg.seed == 999:
            raise RuntimeError("boom in this run")
        return real_start(cfg)

    monkeypatch.setattr(starts, "seeded_start", seeded_start)
    train_fast(bad, compile=True)  # compiles
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="boom in this run"):
            train_fast([bad[0], culprit], compile=True)
    assert not [w for w in caught if "compiling the step failed" in str(w.message)]
    before = len(used)
    train_fast(bad, compile=True)
    assert len(used) > before and len(calls) == 1
