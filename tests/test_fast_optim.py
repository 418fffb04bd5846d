"""The fast engine's optimizer (normexp/engines/fast/optim.py). Property tests of its Adam and AdamW
(`FastOptimizer._adam`): for any per-run learning rates (zero included), betas, eps, weight decay and
frozen runs, the in-place update per stretch of equal hyper-parameters and the scratch-direction update
agree, and both are torch.optim's update of each run alone; a frozen run's parameters do not move. And
the numbers made ahead of the steps (`MadeAhead`, `adam_hypers`): a stretch at a time, equal to those
made at each step, and only those of the steps a batch runs (never of its whole budget)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from normexp.config import OptimConfig, RunConfig
from normexp.engines.fast import COMPILED_CHUNK, aot, optim, train, train_fast
from normexp.engines.fast import compiled as compiling
from normexp.engines.fast.optim import FastOptimizer

SHAPES = [(3, 4), (5,), (2, 2, 3)]
STEPS = 4

run_settings = st.fixed_dictionaries({
    "lr": st.sampled_from([0.0, 1e-3, 1e-2, 0.1]),
    "betas": st.sampled_from([(0.9, 0.999), (0.8, 0.99), (0.0, 0.5)]),
    "eps": st.sampled_from([1e-8, 1e-6, 1e-3]),
    "weight_decay": st.sampled_from([0.0, 0.01, 0.5]),
    "freeze_at": st.sampled_from([None, 1, 3]),  # the update from which the run is frozen (diverged)
    "lr_scale": st.sampled_from([(1.0,) * STEPS, (0.0, 0.5, 1.0, 1.0), (1.0, 0.3, 0.3, 2.0)]),  # schedules
})


def problem(settings_: list[dict], seed: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Stacked parameters (R, ...) and STEPS gradients for them, drawn from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    r = len(settings_)
    params = [torch.randn(r, *shape, generator=generator) for shape in SHAPES]
    grads = [[torch.randn(r, *shape, generator=generator) * 3 for shape in SHAPES] for _ in range(STEPS)]
    return params, grads


def schedule(s: dict, t: int) -> tuple[float, bool]:
    return s["lr"] * s["lr_scale"][t], s["freeze_at"] is None or t < s["freeze_at"]


def fast_steps(name: str, settings_: list[dict], params: list[torch.Tensor], grads: list[list[torch.Tensor]],
               nan_when_frozen: bool = False, steps: int = STEPS) -> list[torch.Tensor]:
    params = [p.clone() for p in params]
    optims = [OptimConfig(name=name, lr=max(s["lr"], 1e-9), betas=s["betas"], eps=s["eps"],
                          weight_decay=s["weight_decay"]) for s in settings_]
    optimizer = FastOptimizer(name, optims, params)
    for t in range(steps):
        lrs, live = zip(*(schedule(s, t) for s in settings_))
        step_grads = [g.clone() for g in grads[t]]
        if nan_when_frozen:  # a diverged run's gradient is nan
            for g in step_grads:
                g[[not a for a in live]] = float("nan")
        optimizer.step(step_grads, list(lrs), list(live))
    return params


def torch_steps(name: str, settings_: list[dict], params: list[torch.Tensor],
                grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Each run alone through torch.optim (single-tensor), stepped until it is frozen."""
    result = [p.clone() for p in params]
    for r, s in enumerate(settings_):
        own = [torch.nn.Parameter(p[r].clone()) for p in params]
        cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
        optimizer = cls(own, lr=1.0, betas=s["betas"], eps=s["eps"], weight_decay=s["weight_decay"], foreach=False)
        for t in range(STEPS):
            lr, live = schedule(s, t)
            if not live:
                break
            for p, g in zip(own, grads[t]):
                p.grad = g[r].clone()
            optimizer.param_groups[0]["lr"] = lr
            optimizer.step()
        for whole, p in zip(result, own):
            whole[r] = p.detach()
    return result


@pytest.mark.equivalence
@pytest.mark.parametrize("name", ["adam", "adamw"])
@settings(max_examples=40, deadline=None)
@given(settings_=st.lists(run_settings, min_size=1, max_size=9), seed=st.integers(0, 2**16))
def test_stretch_and_scratch_adam_agree_and_equal_torch_per_run(name, settings_, seed):
    params, grads = problem(settings_, seed)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(optim, "MAX_STRETCHES", 10**6)
        in_place = fast_steps(name, settings_, params, grads)
        patch.setattr(optim, "MAX_STRETCHES", 0)
        scratch = fast_steps(name, settings_, params, grads)
    expected = torch_steps(name, settings_, params, grads)
    for a, b, want in zip(in_place, scratch, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(a, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b, want, rtol=1e-5, atol=1e-6)


@pytest.mark.equivalence
@pytest.mark.parametrize("max_stretches", [0, 10**6])
@pytest.mark.parametrize("name", ["adam", "adamw"])
@settings(max_examples=25, deadline=None)
@given(settings_=st.lists(run_settings, min_size=1, max_size=9), seed=st.integers(0, 2**16))
def test_frozen_runs_keep_their_parameters_bit_for_bit_and_the_rest_is_deterministic(
        name, max_stretches, settings_, seed):
    """A run frozen from update f keeps, bit for bit, its parameters after update f - 1, even when
    its gradient is nan; the same steps twice give the same bits."""
    params, grads = problem(settings_, seed)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(optim, "MAX_STRETCHES", max_stretches)
        got = fast_steps(name, settings_, params, grads, nan_when_frozen=True)
        again = fast_steps(name, settings_, params, grads, nan_when_frozen=True)
        assert all(torch.equal(a, b) for a, b in zip(got, again))
        for r, s in enumerate(settings_):
            if s["freeze_at"] is None:
                continue
            before = fast_steps(name, settings_, params, grads, steps=s["freeze_at"])  # its last live update
            for a, b in zip(got, before):
                assert torch.equal(a[r], b[r]), (r, s)
                assert torch.isfinite(a[r]).all()


def functional_steps(name: str, settings_: list[dict], params: list[torch.Tensor],
                     grads: list[list[torch.Tensor]], nan_when_frozen: bool = False) -> list[torch.Tensor]:
    """The compiled step's update (`adam_update` at `adam_hypers`), run eagerly, STEPS times."""
    params = [p.clone() for p in params]
    moments = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    optims = [OptimConfig(name=name, lr=max(s["lr"], 1e-9), betas=s["betas"], eps=s["eps"],
                          weight_decay=s["weight_decay"]) for s in settings_]
    for t in range(STEPS):
        lrs, live = zip(*(schedule(s, t) for s in settings_))
        hyper = optim.adam_hypers(optims, name, t + 1, lrs, live)
        for i, p in enumerate(params):
            g = grads[t][i].clone()
            if nan_when_frozen:
                g[[not a for a in live]] = float("nan")
            params[i], moments[0][i], moments[1][i] = optim.adam_update(p, g, moments[0][i], moments[1][i], hyper)
    return params


@pytest.mark.parametrize("name", ["adam", "adamw"])
@settings(max_examples=40, deadline=None)
@given(settings_=st.lists(run_settings, min_size=1, max_size=9), seed=st.integers(0, 2**16))
def test_the_compiled_steps_update_is_torchs_adam_per_run_and_keeps_frozen_runs(name, settings_, seed):
    """`adam_update`, the update compiled into the fast step with Adam and AdamW, is torch.optim's update
    of each run alone for any per-run learning rates (schedules, zero), betas, eps and weight decay; a run
    frozen from update f keeps its parameters after update f - 1 bit for bit, even with a nan gradient."""
    params, grads = problem(settings_, seed)
    got = functional_steps(name, settings_, params, grads, nan_when_frozen=True)
    for a, want in zip(got, torch_steps(name, settings_, params, grads)):
        torch.testing.assert_close(a, want, rtol=1e-5, atol=1e-6)
    assert all(torch.isfinite(a).all() for a in got)


# ----------------------------------------------------------------------------- numbers made ahead


BUDGET = 100_000  # train.steps: a budget that train.stop_when is meant to cut short


def stopped_at_once(optim: str, n: int = 3) -> list[RunConfig]:
    """n runs with a step budget of BUDGET that train.stop_when stops at step 0 (every loss is below 100)."""
    return [RunConfig.model_validate({
        "model": {"depth": 2, "width": 8}, "optim": {"name": optim, "lr": 0.01 * (i + 1)},
        "schedule": {"kind": "cosine", "warmup_steps": 10},
        "train": {"steps": BUDGET, "stop_when": "trained", "stop_below": 100.0, "stop_patience": 1, "threads": 1},
        "seed": i}) for i in range(n)]


@pytest.mark.parametrize("compiled", [False, True])
def test_a_batch_stopped_early_makes_the_numbers_of_the_steps_it_runs_not_of_its_whole_budget(compiled, monkeypatch):
    """train.stop_when is for a large step budget cut short. A batch stopped at step 0 made every step's
    learning rates (`step_lr`, steps x runs calls) and, compiled with Adam, every update's numbers
    (`adam_hypers`, one (9, 16) tensor a step) at its start: with 10^6 steps seconds and hundreds of MB
    before its first step (10^7, the bound of train.steps, 64 runs: minutes and tens of GB). It makes those
    of the stretch of steps it reaches."""
    calls = {"step_lr": 0, "adam_hypers": 0}
    for name, module in (("step_lr", train), ("adam_hypers", compiling)):  # where each is looked up
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name: (
            calls.__setitem__(_name, calls[_name] + 1), _real(*a))[1])
    if compiled:  # the compiler stood in for by the traced graph (tests/test_fast.py)
        monkeypatch.setattr(aot, "load_or_compile", lambda key, trace, inputs, **_: (trace(), True))
        compiling.reset_cache()
    results = train_fast(stopped_at_once("adam"), compile=compiled)
    assert all(r.metrics["step"] == [0] and r.stopped_at == 0 for r in results)
    runs = COMPILED_CHUNK if compiled else 3
    assert calls["step_lr"] <= runs * BUDGET // 100, calls
    assert calls["adam_hypers"] <= BUDGET // 100, calls


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_the_compiled_steps_numbers_stay_adam_hypers_across_stretches_made_ahead(name, monkeypatch):
    """Made a few updates ahead (AHEAD, here 3), the fused step's numbers are `adam_hypers`' at each update,
    across the stretches' edges, and with runs frozen at, inside and after an edge; at the last update
    (steps + 1) too."""
    monkeypatch.setattr(optim, "AHEAD", 3)
    optims = [OptimConfig(name=name, lr=0.01 * (1 + r), betas=(0.9, 0.99 - 0.01 * r), weight_decay=0.1 * r)
              for r in range(4)]
    steps = 10
    schedule = optim.MadeAhead(lambda s: [o.lr * (s + 1) / 7 for o in optims], steps + 1)
    stops = [steps + 1, 2, 3, 7]  # run r is live through step stops[r]
    seen: list[torch.Tensor] = []

    def compiled(*tensors: torch.Tensor) -> tuple[torch.Tensor]:
        seen.append(tensors[-1].clone())
        return (torch.zeros(3, len(optims)),)

    step = compiling.CompiledStep(compiled, FastOptimizer(name, optims, [torch.zeros(len(optims), 2)]), True, schedule)
    for s in range(steps + 1):
        live = [s <= stop for stop in stops]
        step.step({}, torch.zeros(1), torch.zeros(1), schedule[s], live)
        expected = optim.adam_hypers(optims, name, s + 1, [o.lr * (s + 1) / 7 for o in optims], live)
        assert seen[-1].dtype == expected.dtype and torch.equal(seen[-1], expected), s


def test_made_ahead_makes_each_item_once_in_order_and_keeps_one_stretch():
    made: list[int] = []
    items = optim.MadeAhead(lambda i: (made.append(i), i * i)[1], 10, ahead=4)
    assert len(items) == 10 and [items[i] for i in range(10)] == [i * i for i in range(10)]
    assert made == list(range(10))
    assert items[9] == 81 and made == list(range(10))  # the stretch read last is kept
    assert items[0] == 0 and made == [*range(10), 0, 1, 2, 3]  # an earlier one is made again
    with pytest.raises(IndexError):
        items[10]
