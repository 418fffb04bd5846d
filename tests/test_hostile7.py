"""Hostile review of 5540833 (a batch's learning rates and compiled Adam numbers made ahead; a replay calls
torch's bindings)."""

from __future__ import annotations

import pytest
import torch

from normexp.config import OptimConfig, RunConfig
from normexp.engines.fast import COMPILED_CHUNK, aot, train, train_fast
from normexp.engines.fast import compiled as compiling
from normexp.engines.fast import optim as fast_optim
from normexp.engines.fast.optim import FastOptimizer

BUDGET = 100_000  # train.steps: a budget that train.stop_when is meant to cut short


def stopped_at_once(optim: str, n: int = 3) -> list[RunConfig]:
    """n runs with a step budget of BUDGET that train.stop_when stops at step 0 (every loss is below 100)."""
    return [RunConfig.model_validate({
        "model": {"depth": 2, "width": 8}, "optim": {"name": optim, "lr": 0.01 * (i + 1)},
        "schedule": {"kind": "cosine", "warmup_steps": 10},
        "train": {"steps": BUDGET, "stop_when": "trained", "stop_below": 100.0, "stop_patience": 1, "threads": 1},
        "seed": i}) for i in range(n)]


@pytest.mark.parametrize("compiled", [False, True])
def test_a_batch_stopped_early_makes_the_numbers_of_the_steps_it_runs_not_of_its_whole_budget(compiled, monkeypatch,
                                                                                            fresh_fast_engine):
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
        monkeypatch.setattr(aot, "load_or_compile", lambda key, trace, inputs, fresh=False: (trace(), True))
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
    monkeypatch.setattr(fast_optim, "AHEAD", 3)
    optims = [OptimConfig(name=name, lr=0.01 * (1 + r), betas=(0.9, 0.99 - 0.01 * r), weight_decay=0.1 * r)
              for r in range(4)]
    steps = 10
    schedule = fast_optim.MadeAhead(lambda s: [o.lr * (s + 1) / 7 for o in optims], steps + 1)
    stops = [steps + 1, 2, 3, 7]  # run r is live through step stops[r]
    seen: list[torch.Tensor] = []

    def compiled(*tensors: torch.Tensor) -> tuple[torch.Tensor]:
        seen.append(tensors[-1].clone())
        return (torch.zeros(3, len(optims)),)

    step = compiling.CompiledStep(compiled, FastOptimizer(name, optims, [torch.zeros(len(optims), 2)]), True, schedule)
    for s in range(steps + 1):
        live = [s <= stop for stop in stops]
        step.step({}, torch.zeros(1), torch.zeros(1), schedule[s], live)
        expected = fast_optim.adam_hypers(optims, name, s + 1, [o.lr * (s + 1) / 7 for o in optims], live)
        assert seen[-1].dtype == expected.dtype and torch.equal(seen[-1], expected), s


def test_made_ahead_makes_each_item_once_in_order_and_keeps_one_stretch():
    made: list[int] = []
    items = fast_optim.MadeAhead(lambda i: (made.append(i), i * i)[1], 10, ahead=4)
    assert len(items) == 10 and [items[i] for i in range(10)] == [i * i for i in range(10)]
    assert made == list(range(10))
    assert items[9] == 81 and made == list(range(10))  # the stretch read last is kept
    assert items[0] == 0 and made == [*range(10), 0, 1, 2, 3]  # an earlier one is made again
    with pytest.raises(IndexError):
        items[10]

