"""The fast engine's compiled steps when something fails (normexp/engines/fast/compiled.py): a refused Adam
step leaves the structure's other compiled steps alone; a run that raises, or a batch model that cannot be
made, fails its batch and refuses nothing; a compiled step that fails mid-batch falls back to an eager batch
with a model of its own; and a step package vouched for by its bytes is checked again when a module that
its plugin imports changed."""

from __future__ import annotations

import sys
import textwrap
import warnings

import pytest
from test_fast import packaged_graphs, runs
from test_starts import TRANSFORMER

from normexp import registry
from normexp.config import RunConfig, validate_run
from normexp.engines.fast import aot, starts, train, train_fast
from normexp.engines.fast import compiled as compiling

# ----------------------------------------------------------------------------- the fused Adam step refused


def traced_eagerly(calls: list[str], used: list[int] | None = None):
    """`aot.load_or_compile` without the compiler: the traced graph run eagerly, each compile's key kept in
    `calls` (and each call of a compiled step counted, in `used`)."""
    def load_or_compile(key, trace, inputs, fresh=False, wait=True):
        calls.append(key)
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
def test_a_refused_adam_step_leaves_the_structures_other_compiled_steps_alone(monkeypatch, other):
    """A compile that fails for the Adam step (its update inside) refuses that step, not the gradient step
    SGD and RAdam runs of the same model compile: those were compiled once and stay compiled, so their
    bits do not depend on whether an Adam batch of the structure trained earlier in the process (a resumed
    sweep, or another worker, would otherwise give them other bits)."""
    calls: list[str] = []
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
    fresh_calls: list[str] = []
    monkeypatch.setattr(aot, "load_or_compile", traced_eagerly(fresh_calls))
    compiling.reset_cache()
    train_fast(runs(optim="adam", n=2, steps=3), compile=True)  # the Adam step fails first this time
    assert [repr(r.metrics) for r in train_fast(plain, compile=True)] == [repr(r.metrics) for r in alone]
    assert len(fresh_calls) == 1, "the gradient step was refused with the Adam step"


def test_a_run_that_raises_in_a_compiled_batch_is_not_blamed_on_the_compiler(monkeypatch):
    """A run whose own training raises (here its initialisation) fails its batch as it does uncompiled
    (`run_unit` retries the batch run by run): no 'compiling the step failed' warning, and the structure's
    later batches in the process still train compiled (before, one bad run refused the compiled step for
    the rest of the process: 1.8x slower, and other bits than a resumed sweep gives those batches)."""
    calls: list[str] = []
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


# ----------------------------------------------------------------------------- the batch's model, made where needed


def packaged(monkeypatch, tmp_path):
    """The compiler stood in for by the traced graph itself (test_fast.packaged_graphs)."""
    monkeypatch.setenv("NORMEXP_CACHE_DIR", str(tmp_path))
    packaged_graphs(monkeypatch)
    compiling.reset_cache()


@pytest.mark.parametrize("structure", [{"model": {"depth": 2, "width": 8}}, TRANSFORMER], ids=["ffn", "transformer"])
@pytest.mark.parametrize("optim", ["adam", "sgd"])
def test_a_compiled_step_that_fails_in_a_batch_that_made_no_model_falls_back_to_one(monkeypatch, tmp_path,
                                                                                       structure, optim):
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


def test_what_making_the_batchs_model_raises_fails_the_batch_and_is_no_compile_failure(monkeypatch, tmp_path):
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


# ----------------------------------------------------------------------------- a plugin's step package


PLUGIN = '''
import torch
from torch import nn

import scalehelper


class ScaledNorm(nn.Module):
    """x / rms(x) times a gain and a constant from another module of the user's (scalehelper.SCALE)."""

    stackable = True

    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        rms = (x * x).mean(-1, keepdim=True).add(self.eps).sqrt()
        return self.weight * x / rms * scalehelper.SCALE
'''


def _fresh_process(*modules: str) -> None:
    """What a later process starts from: nothing compiled or imported of the user's."""
    compiling.reset_cache()
    registry.reset()
    for name in modules:
        sys.modules.pop(name, None)


def test_a_vouched_package_is_checked_again_when_a_module_its_plugin_imports_changed(monkeypatch, tmp_path):
    """A package's name covers a plugin's own module file, not what that module imports: the check against
    the eager step covered the rest (aot._plugin_digests). A package vouched for by its bytes alone skipped
    that check in a later process, which then trained the old helper's step: losses of another model,
    looking normal."""
    (tmp_path / "scalednorm.py").write_text(textwrap.dedent(PLUGIN))
    (tmp_path / "scalehelper.py").write_text("SCALE = 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("NORMEXP_CACHE_DIR", str(tmp_path / "cache"))
    packaged_graphs(monkeypatch)
    compiling.reset_cache()

    def configs():
        return [validate_run({"model": {"depth": 2, "width": 8}, "data": {"n_samples": 16},
                              "norm": {"placement": "pre", "kind": "scalednorm:ScaledNorm"},
                              "optim": {"lr": 0.01}, "train": {"steps": 4}, "seed": s}) for s in range(2)]

    try:
        _fresh_process("scalednorm", "scalehelper")
        train_fast(configs(), compile=True)  # compiled and checked
        assert not list((tmp_path / "cache" / "steps").glob("*.checked"))  # a plugin's step: never vouched for
        (tmp_path / "scalehelper.py").write_text("SCALE = 3.0\n")  # the user changes the helper
        _fresh_process("scalednorm", "scalehelper")
        got = train_fast(configs(), compile=True)
        want = train_fast(configs(), compile=False)
        assert [r.metrics["loss"][-1] for r in got] == pytest.approx([r.metrics["loss"][-1] for r in want],
                                                                     rel=1e-4)
    finally:
        _fresh_process("scalednorm", "scalehelper")
