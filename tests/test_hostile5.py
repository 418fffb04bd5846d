"""Hostile review, round 5: a replayed start (normexp/engines/fast/starts.py) against `seeded_init`, where a
construction reads drawn values back into Python by a path that makes no aten operation returning a
non-tensor (`.tolist()`, `.numpy()`, NumPy's `__array__`, the shape of a data-dependent result)."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch
from test_initial import _equal_start, assert_built_each_time

from normexp.config import validate_run
from normexp.engines import common
from normexp.engines.fast import starts


def _largest(w: torch.Tensor) -> float:
    return max(abs(v) for v in w.flatten().tolist())


READS = {  # each reads the drawn weight back, without `.item()` or a comparison in an `if`
    "tolist": _largest,
    "numpy": lambda w: float(np.abs(w.numpy()).max()),
    "__array__": lambda w: float(np.asarray(w).std()),
    "a data-dependent shape": lambda w: float((w > 0).nonzero().shape[0]),
    "a data-dependent numel": lambda w: float(torch.unique(w > 0.1).numel() + (w > 0).nonzero().numel()),
}


@pytest.mark.parametrize("read", list(READS))
def test_a_construction_reading_values_back_without_item_is_built_not_replayed(monkeypatch, read, fresh_fast_engine):
    """A model whose construction scales a weight by a value read from the drawn weights: each seed's
    scale is its own, so a recording of the first seed's construction replays the wrong scale for the
    others. Such a structure must be built for each run, as `.item()` already makes it."""
    assert_built_each_time(monkeypatch, lambda weight: weight.mul_(READS[read](weight.detach())))


PACKAGE = '''
import torch
from torch import nn


class Measured:
    """x + g * Norm(F(x)), g = 1 / the largest |entry| of the branch's output weight, read with tolist."""

    stackable = True

    @staticmethod
    def build(block, norm):
        block.norm = norm()
        largest = max(abs(v) for v in block.branch.fc2.weight.detach().flatten().tolist())
        block.gain = nn.Parameter(torch.full((1,), 1.0 / largest))

    @staticmethod
    def forward(block, x):
        return x + block.gain * block.norm(block.branch(x))
'''


def test_a_users_placement_that_measures_its_branch_starts_as_seeded_init(tmp_path, monkeypatch, fresh_fast_engine):
    """docs/extending.md: a placement's build() may read the block it is given (its branch is drawn by
    then). One that reads the branch's weights through `.tolist()` starts each run as seeded_init does
    (the reference engine's start), not from the first seed's gain."""
    (tmp_path / "measuring.py").write_text(textwrap.dedent(PACKAGE))
    monkeypatch.syspath_prepend(str(tmp_path))
    starts.reset()
    configs = [validate_run({"model": {"depth": 2, "width": 8}, "norm": {"placement": "measuring:Measured"},
                             "seed": seed}) for seed in range(3)]
    for cfg in configs:
        assert _equal_start(cfg, starts.seeded_start(cfg)), cfg.seed


def test_after_a_structures_first_run_the_generator_is_where_seeded_init_leaves_it(fresh_fast_engine):
    """test_initial checks this of a replayed run; the first run of a structure (built, then recorded and
    replayed once for the check) must leave the global generator after the task's draws too, as
    seeded_init does, not after the model's only."""
    starts.reset()
    cfg = validate_run({"model": {"depth": 2, "width": 8}, "seed": 5})
    starts.seeded_start(cfg)
    after_first = torch.rand(4)
    common.seeded_init(cfg)
    assert torch.equal(after_first, torch.rand(4))
