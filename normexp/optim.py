"""Optimizers and learning-rate schedules (SPEC §4).

`lr_multiplier(step, schedule, total_steps)` is a pure function of the optimizer step; the training
loop sets each update's learning rate to `optim.lr * lr_multiplier(...)`. Steps count updates from 1:
update 1 is the first `optimizer.step()`. With W = warmup_steps and S = total updates:

    constant        1
    linear_warmup   s / W while s < W, then 1
    inverse_sqrt    s / W while s < W, then sqrt(W / s)  (Vaswani et al. 2017, normalised to peak 1)
    cosine          s / W while s < W, then min_ratio + (1 - min_ratio) * (1 + cos(pi * (s - W) / (S - W))) / 2

W = 0 means no warmup (inverse_sqrt then decays as 1 / sqrt(s)). The multiplier is exactly 1.0
whenever no warmup or decay applies, so a constant schedule leaves `optim.lr` untouched, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from normexp.config import OptimConfig, ScheduleConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer `cfg.name` with `cfg`'s hyper-parameters (torch's own implementations)."""
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.name == "radam":
        return torch.optim.RAdam(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    raise ValueError(f"unknown optimizer {cfg.name!r}")


def lr_multiplier(step: int, schedule: ScheduleConfig, total_steps: int) -> float:
    """The learning-rate multiplier of update `step` (1-based), as tabulated in the module docstring."""
    warmup = schedule.warmup_steps
    if schedule.kind == "constant":
        return 1.0
    if step < warmup:
        return step / warmup
    if schedule.kind == "linear_warmup":
        return 1.0
    if schedule.kind == "inverse_sqrt":
        return math.sqrt(max(warmup, 1) / step) if step > max(warmup, 1) else 1.0
    # cosine: from 1 at the end of warmup down to min_lr_ratio at the last update
    span = total_steps - warmup
    progress = min(1.0, (step - warmup) / span) if span > 0 else 1.0
    ratio = schedule.min_lr_ratio
    return ratio + (1.0 - ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
