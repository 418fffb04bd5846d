"""The fast engine's contract itself (benchmarks/bench_fast.py, docs/fast-contract.md): its flip bound is not
broken by an engine that rounds as validly as the reference, and still breaks for one that flips more."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_fast import (  # noqa: E402
    Comparison,
    contract_holds,
    deep_grid,
    per_kind,
    run_fast,
    with_threads,
    yardstick,
)


def flips(runs: int, count: float) -> Comparison:
    """A comparison with `count` verdict flips over `runs` runs and no cell off."""
    return Comparison(runs=runs, flips=count, cells=100, cells_off=0, max_dloss=0.0)


def test_the_flip_count_that_broke_the_contract_on_seeds_0_to_7_is_within_it():
    """issue 46's grid (RMSNorm, 48 runs): F 3 flips against S 1 was out of 2 S + 1%, a count that small is not."""
    assert contract_holds(flips(48, 3), flips(48, 1))
    assert contract_holds(flips(48, 2), flips(48, 0))


@pytest.mark.parametrize("f, s", [(5, 1), (8, 2.5), (3, 0)])
def test_the_contract_still_breaks_for_flips_beyond_its_allowance(f, s):
    assert not contract_holds(flips(48, f), flips(48, s))


@pytest.mark.parametrize("fragile, p", [(4, 0.1), (4, 0.25), (8, 0.1), (8, 0.25), (8, 0.4), (16, 0.1), (16, 0.25)])
def test_an_engine_as_valid_as_the_reference_holds_the_flip_bound(fragile, p):
    """A grid with `fragile` runs whose final loss straddles the trained threshold under rounding alone: each
    flips with probability p under any valid rounding, the fast engine's (F, one draw) as the reference's
    other row orders' (S, the mean of two). Such an engine must hold the bound almost always; without the
    allowance (2 S + 1%) it broke it in 6-18% of draws."""
    generator = np.random.default_rng(46)
    draws = 4000
    f = generator.binomial(fragile, p, draws)
    s = (generator.binomial(fragile, p, draws) + generator.binomial(fragile, p, draws)) / 2
    held = np.mean([contract_holds(flips(48, int(a)), flips(48, float(b))) for a, b in zip(f, s)])
    assert held >= 0.97, held


@pytest.mark.slow
@pytest.mark.equivalence
@pytest.mark.parametrize("first_seed", [0, 8])
def test_the_deep_grid_holds_the_contract_for_rmsnorm_on_each_seed_range(first_seed):
    """The grid where the contract broke: Post-LN depth 8, lr {0.003, 0.01, 0.03} x warmup {0, 10} x 8 seeds,
    40 steps, RMSNorm (48 runs), fast eager as a sweep batches it; seeds 0-7 (there, 3 flips against a bound
    of 2.48 before the allowance) and 8-15."""
    configs = [with_threads(c, 2) for c in deep_grid(first_seed + 8, kinds=("rmsnorm",)) if c.seed >= first_seed]
    from normexp.engines.reference import train_run

    reference = [train_run(c) for c in configs]
    f = per_kind(configs, run_fast(configs), reference)["rmsnorm"]
    s = yardstick(configs, reference)
    assert contract_holds(f, s), (f, s)
