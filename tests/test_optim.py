"""Schedules: hand-worked multipliers, one per update (steps count updates from 1)."""

from __future__ import annotations

import math

import pytest
import torch

from normexp.config import OptimConfig, ScheduleConfig
from normexp.optim import build_optimizer, lr_multiplier


def sched(kind: str, warmup: int = 0, min_lr_ratio: float = 0.0) -> ScheduleConfig:
    return ScheduleConfig(kind=kind, warmup_steps=warmup, min_lr_ratio=min_lr_ratio)


def test_constant_is_exactly_one():
    assert [lr_multiplier(s, sched("constant"), 10) for s in (1, 5, 10)] == [1.0, 1.0, 1.0]


def test_linear_warmup():
    s = sched("linear_warmup", warmup=4)
    assert lr_multiplier(1, s, 10) == 0.25  # 1/4
    assert lr_multiplier(2, s, 10) == 0.5  # 2/4
    assert lr_multiplier(3, s, 10) == 0.75  # 3/4
    assert lr_multiplier(4, s, 10) == 1.0  # warmup done
    assert lr_multiplier(9, s, 10) == 1.0  # then constant


def test_linear_warmup_of_zero_is_no_warmup():
    assert lr_multiplier(1, sched("linear_warmup", 0), 10) == 1.0


def test_inverse_sqrt():
    s = sched("inverse_sqrt", warmup=4)
    assert lr_multiplier(2, s, 100) == 0.5  # warming up: 2/4
    assert lr_multiplier(4, s, 100) == 1.0  # peak at s = W
    assert lr_multiplier(16, s, 100) == 0.5  # sqrt(4/16)
    assert lr_multiplier(64, s, 100) == 0.25  # sqrt(4/64)


def test_inverse_sqrt_without_warmup():
    s = sched("inverse_sqrt", warmup=0)
    assert lr_multiplier(1, s, 100) == 1.0
    assert lr_multiplier(4, s, 100) == 0.5  # 1/sqrt(4)


def test_cosine():
    s = sched("cosine", warmup=2, min_lr_ratio=0.1)
    assert lr_multiplier(1, s, 12) == 0.5  # warming up: 1/2
    assert lr_multiplier(2, s, 12) == 1.0  # start of decay, cos(0)
    assert lr_multiplier(7, s, 12) == pytest.approx(0.55)  # halfway: 0.1 + 0.9 * 0.5
    assert lr_multiplier(12, s, 12) == pytest.approx(0.1)  # the end: min_lr_ratio


def test_cosine_quarter():
    s = sched("cosine", warmup=0)
    assert lr_multiplier(1, s, 4) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


@pytest.mark.parametrize("name,cls", [("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW),
                                      ("sgd", torch.optim.SGD), ("radam", torch.optim.RAdam)])
def test_build_optimizer(name, cls):
    param = torch.nn.Parameter(torch.zeros(3))
    opt = build_optimizer([param], OptimConfig(name=name, lr=0.5))
    assert isinstance(opt, cls)
    assert opt.param_groups[0]["lr"] == 0.5


def test_weight_decay_defaults_follow_the_optimizer():
    assert OptimConfig(name="adamw").weight_decay == 0.01
    assert OptimConfig(name="adam").weight_decay == 0.0
    assert OptimConfig(name="adamw", weight_decay=0.1).weight_decay == 0.1
