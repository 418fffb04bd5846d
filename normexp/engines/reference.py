"""The reference engine: one run, the plain training loop, the definition of correct.

    torch.manual_seed(seed); model = Net(...); X, y = task    # the article's order of random draws
    for step in 0..S:
        X, y = the step's minibatch (the whole split without data.batch_size)
        loss = cross_entropy(model(X), y)                       # recorded: step, loss, acc, lr, grad_norm
        (loss + z_loss(model(X))).backward()                    # z term: train.z_loss > 0 only, recorded apart
        set lr = optim.lr * lr_multiplier(step + 1); optimizer.step()   (not after step S)

The loop reports each recorded step through an optional callback and returns a `RunResult`; it prints
nothing. A non-finite loss is recorded as it is and marks the run diverged; with
`train.stop_on_nonfinite` (the default) the run stops there. With `train.stop_when` the run stops after
the step at which its rule (`EarlyStop`) fires, before that step's update. With `train.log_blocks` a
`BlockRecorder` (normexp/blocklog.py) also records each block's gradients, updates and activations.
"""

from __future__ import annotations

import math
import time

import torch

from normexp.blocklog import BlockRecorder
from normexp.config import RunConfig
from normexp.data import Task
from normexp.engines.common import (
    EarlyStop,
    RunResult,
    StepCallback,
    grad_norm,
    held_out,
    loss_and_acc,
    minibatches,
    seeded_init,
    share_wall_time,
    torch_threads,
    z_loss,
)
from normexp.optim import REPLAYED_OPTIMIZERS, StackedOptimizer, build_optimizer, step_lr


class ReferenceOptimizer:
    """One run's optimizer. Adam, AdamW and SGD: the batched engine's replay of torch's single-tensor
    update (`StackedOptimizer`, here a batch of one run) applied once to all parameters, which become
    views of one flat tensor. The update is element-wise, so the bits are torch.optim's, in about ten
    ops per step instead of ten per parameter tensor, and without importing torch.optim's compiler
    machinery (torch._dynamo, about a second). Other optimizers (RAdam): torch's own, per tensor."""

    def __init__(self, params: list[torch.nn.Parameter], cfg: RunConfig) -> None:
        self.params = params
        self.torch_optimizer: torch.optim.Optimizer | None = None
        self.replayed: StackedOptimizer | None = None
        if cfg.optim.name in REPLAYED_OPTIMIZERS:
            self.flat = flatten_parameters(params)
            self.replayed = StackedOptimizer([self.flat], [cfg])
        else:
            self.torch_optimizer = build_optimizer(params, cfg.optim)

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None

    def step(self, lr: float) -> None:
        if self.replayed is None:
            for group in self.torch_optimizer.param_groups:
                group["lr"] = lr
            self.torch_optimizer.step()
            return
        # torch.optim skips a tensor without a gradient; every parameter of a Net has one, and a user's
        # placement or kind whose forward leaves one unused is named here (docs/extending.md)
        try:
            self.flat.grad = torch.cat([p.grad.reshape(-1) for p in self.params])
        except AttributeError:
            unused = next(i for i, p in enumerate(self.params) if p.grad is None)
            raise ValueError(f"parameter {unused} (shape {tuple(self.params[unused].shape)}) received no gradient: "
                             "every module a placement or kind builds must be used by its forward") from None
        self.replayed.step([lr])


def flatten_parameters(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Copy `params` into one flat tensor and make each parameter a view of its slice (values unchanged)."""
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for param in params:
        param.data = flat[offset:offset + param.numel()].view_as(param)
        offset += param.numel()
    return flat


def train_run(cfg: RunConfig, device: str = "cpu", on_step: StepCallback | None = None) -> RunResult:
    """Train one run of `cfg` on `device` and return every recorded step's metrics."""
    start = time.perf_counter()
    with torch_threads(cfg.train.threads) as threads:
        result = RunResult(threads=threads, early_stop=EarlyStop.of(cfg))
        model, task = seeded_init(cfg)
        model.to(device)
        task = Task(*(t.to(device) if t is not None else None for t in vars(task).values()))
        batches = minibatches(cfg, task)
        params = list(model.parameters())
        optimizer = ReferenceOptimizer(params, cfg)
        blocks = BlockRecorder(model, cfg.train.log_every, positions=task.positions) if cfg.train.log_blocks else None
        steps = cfg.train.steps
        coef = cfg.train.z_loss
        for step in range(steps + 1):
            x, y = next(batches)
            val = held_out(model, task, cfg, step)  # before the training forward, whose activations blocks read
            logits = model(x)
            loss, acc_tensor = loss_and_acc(logits, y, task.positions)
            z = z_loss(logits, task.positions, coef) if coef else None
            loss_value, acc = loss.item(), acc_tensor.item()
            z_value = z.item() if z is not None else None
            lr = step_lr(cfg, step)
            logged = blocks is not None and blocks.due(step)
            if result.check_loss(loss_value, cfg.train.stop_on_nonfinite):
                result.record(step, loss_value, acc, lr, math.nan, val, z_value)
                if logged:
                    blocks.observe(step, [0], [False])  # activations only: no backward at this step
                break
            optimizer.zero_grad()
            (loss if z is None else loss + z).backward()
            result.record(step, loss_value, acc, lr, grad_norm(params), val, z_value)
            if logged:
                blocks.observe(step, [0], [True])
            if result.check_early_stop(step, loss_value):  # train.stop_when: this step recorded whole, then stop
                break
            if on_step is not None:
                on_step(step, loss_value)
            if step < steps:
                optimizer.step(lr)
                if logged:
                    blocks.observe_update()
        if blocks is not None:
            blocks.close()
            result.blocks = blocks.rows()
    return share_wall_time([result], start)[0]
