"""Hostile review of 788d925 (the fast engine's lazily made batch model; a replay seeds the CPU generator
alone)."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_initial import same_params

from normexp.config import RunConfig
from normexp.engines.common import seeded_init
from normexp.engines.fast import compiled as compiling
from normexp.engines.fast import starts, train, train_fast
from normexp.executors import InProcessExecutor, pairs_well
from normexp.units import plan_units


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


def packaged(monkeypatch, tmp_path):
    """The compiler stood in for by the traced graph itself (test_fast.packaged_graphs)."""
    from test_fast import packaged_graphs

    monkeypatch.setenv("NORMEXP_CACHE_DIR", str(tmp_path))
    packaged_graphs(monkeypatch)
    compiling.reset_cache()


TRANSFORMER = {"model": {"arch": "transformer", "depth": 1, "width": 16}, "data": {"task": "assoc_recall"}}


@pytest.mark.parametrize("structure", [{"model": {"depth": 2, "width": 8}}, TRANSFORMER], ids=["ffn", "transformer"])
@pytest.mark.parametrize("optim", ["adam", "sgd"])
def test_a_compiled_step_that_fails_in_a_batch_that_made_no_model_falls_back_to_one(monkeypatch, tmp_path,
                                                                                       structure, optim,
                                                                                       fresh_fast_engine):
    """A later batch of a compiled structure makes no model (its step is compiled already) unless it has a
    held-out split; when the compiled step raises in the middle of it, `train_fast` trains the batch again
    uncompiled, which needs the model: it gets its own, and the numbers are the eager ones."""
    packaged(monkeypatch, tmp_path)
    configs = [RunConfig.model_validate({**structure, "optim": {"name": optim, "lr": 0.01},
                                         "train": {"steps": 5}, "seed": s}) for s in range(2)]
    train_fast(configs, compile=True)  # compiles the structure's step
    assert len(compiling.kept_steps()) == 1
    step, calls = compiling.CompiledStep.step, []

    def failing(*args):  # the compiled step, failing at its third call
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the compiled kernel failed")
        return step(*args)

    monkeypatch.setattr(compiling.CompiledStep, "step", failing)
    made: list[object] = []
    real = train.batch_model
    monkeypatch.setattr(train, "batch_model", lambda cfg: made.append(real(cfg)) or made[-1])
    later = [cfg.model_copy(update={"seed": cfg.seed + 2}) for cfg in configs]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = train_fast(later, compile=True)
    assert [str(w.message).split(";")[0] for w in caught] == [
        "compiling the step failed (RuntimeError: the compiled kernel failed)"]
    held_out = structure is TRANSFORMER
    assert len(made) == 1 + held_out  # the eager retry's, and the compiled try's for its held-out split
    assert [repr(r.metrics) for r in results] == [repr(r.metrics) for r in train_fast(later, compile=False)]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), before=st.integers(0, 2**64 - 1), draws=st.integers(0, 3),
       arch=st.sampled_from(["ffn", "transformer"]))
def test_a_replayed_start_and_the_generator_after_it_do_not_depend_on_the_generator_before(seed, before, draws, arch):
    """A replay seeds the CPU generator alone (`starts._seed`): over the whole range of seeds the schema allows,
    whatever the generator's state before (another seed, draws of normal samples, whose cached second value
    torch.manual_seed clears), the replayed start is seeded_init's and the generator's whole state after it
    (get_rng_state: the Mersenne state and the normal caches) is where seeded_init leaves it."""
    structure = TRANSFORMER if arch == "transformer" else {"model": {"depth": 2, "width": 8}}
    starts.seeded_start(RunConfig.model_validate({**structure, "seed": seed ^ 1}))  # the structure recorded
    cfg = RunConfig.model_validate({**structure, "seed": seed})
    assert starts.is_replayed(cfg)  # replayed, not built
    torch.manual_seed(before)
    torch.randn(draws)  # an odd count leaves a normal sample cached
    params, task = starts.seeded_start(cfg)
    after = torch.get_rng_state()
    net, want = seeded_init(cfg)
    assert torch.equal(after, torch.get_rng_state())
    assert same_params(params, dict(net.named_parameters()))
    assert torch.equal(task.x, want.x) and torch.equal(task.y, want.y)


def test_a_construction_drawing_from_its_own_generator_is_built_each_time(monkeypatch, fresh_fast_engine):
    """`starts._seed` seeds the CPU generator alone; a construction that draws from another generator (here
    its own, seeded alike for every run) fails `_record`'s check, whose replay is seeded the same way, so its
    structure is built, never replayed from a generator left where the check left it."""
    from test_initial import assert_built_each_time

    def own_draws(weight: torch.Tensor) -> None:
        weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(7)))

    assert len(assert_built_each_time(monkeypatch, own_draws)) >= 6


def test_what_making_the_batchs_model_raises_fails_the_batch_and_is_no_compile_failure(monkeypatch, tmp_path,
                                                                                       fresh_fast_engine):
    """`CompileFailed`: what a run raises outside the compiled step is not wrapped. The batch's model, made
    lazily since 788d925 and first needed inside the compile, is part of the batch's start: an error there
    (a MemoryError) fails the batch as it does uncompiled, with no "compiling the step failed" and without
    refusing the structure's compiled step for the rest of the process."""
    packaged(monkeypatch, tmp_path)
    real, calls = train.batch_model, []

    def flaky(cfg):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("no memory for the copy")
        return real(cfg)

    monkeypatch.setattr(train, "batch_model", flaky)
    configs = [RunConfig.model_validate({"model": {"depth": 2, "width": 8}, "train": {"steps": 2}, "seed": s})
               for s in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(MemoryError, match="no memory for the copy"):
            train_fast(configs, compile=True)
        train_fast(configs, compile=True)  # the next batch compiles: nothing was refused
    kept = compiling.kept_steps()
    assert not [key for key in kept if key[0] == "refused"] and len(kept) == 1
