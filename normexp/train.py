"""The reference engine: one run, the plain training loop, the definition of correct.

    torch.manual_seed(seed); model = Net(...); X, y = task    # the article's order of random draws
    for step in 0..S:
        loss = cross_entropy(model(X), y)                       # recorded: step, loss, acc, lr, grad_norm
        backward; set lr = optim.lr * lr_multiplier(step + 1); optimizer.step()   (not after step S)

The loop reports each recorded step through an optional callback and returns a `RunResult`; it prints
nothing. A non-finite loss is recorded as it is and marks the run diverged; with
`train.stop_on_nonfinite` (the default) the run stops there. With `train.log_blocks` a
`BlockRecorder` (normexp/blocklog.py) also records each block's gradients, updates and activations.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from normexp.blocklog import BlockRecorder
from normexp.config import RunConfig
from normexp.data import Task, make_task
from normexp.model import Net
from normexp.optim import build_optimizer, lr_multiplier

if TYPE_CHECKING:
    from normexp.batched import StackedOptimizer

METRIC_COLUMNS = ("step", "loss", "acc", "lr", "grad_norm")


@dataclass
class RunResult:
    """What one run produced: its metric columns (one entry per recorded step) and how it ended."""

    metrics: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in METRIC_COLUMNS})
    diverged: bool = False
    wall_s: float = 0.0
    threads: int = 1
    engine: str = "reference"
    blocks: dict[str, list[float]] | None = None  # blocks.csv's columns, with train.log_blocks

    @property
    def losses(self) -> list[float]:
        return self.metrics["loss"]

    @property
    def status(self) -> str:
        return "diverged" if self.diverged else "completed"

    def check_loss(self, loss: float, stop_on_nonfinite: bool) -> bool:
        """Note a non-finite loss (the run is then diverged); True if the run stops at this step."""
        finite = math.isfinite(loss)
        self.diverged |= not finite
        return not finite and stop_on_nonfinite

    def record(self, step: int, loss: float, acc: float, lr: float, grad_norm: float) -> None:
        for column, value in zip(METRIC_COLUMNS, (step, loss, acc, lr, grad_norm)):
            self.metrics[column].append(value)


StepCallback = Callable[[int, float], None]

# Seeding and drawing use torch's global generator: runs started from several threads of one process
# (a Dask worker with several threads) take turns, so each run sees exactly its own draws.
INIT_LOCK = threading.Lock()


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[int]:
    """Run with `threads` intra-op threads (None: leave torch's setting); yields the count in force."""
    before = torch.get_num_threads()
    if threads is not None and threads != before:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def grad_norm(params: list[torch.nn.Parameter]) -> float:
    """The global L2 norm of all gradients (what clip_grad_norm_ would see): each tensor's norm (one
    `_foreach_norm` call, the per-tensor `vector_norm` kernel), then the norm of those norms."""
    grads = [p.grad for p in params if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))).item() if grads else 0.0


class ReferenceOptimizer:
    """One run's optimizer. Adam, AdamW and SGD: the batched engine's replay of torch's single-tensor
    update (`StackedOptimizer`, here a batch of one run) applied once to all parameters, which become
    views of one flat tensor. The update is element-wise, so the bits are torch.optim's, in about ten
    ops per step instead of ten per parameter tensor, and without importing torch.optim's compiler
    machinery (torch._dynamo, about a second). Other optimizers (RAdam): torch's own, per tensor."""

    def __init__(self, params: list[torch.nn.Parameter], cfg: RunConfig) -> None:
        from normexp.batched import REPLAYED_OPTIMIZERS, StackedOptimizer  # batched imports this module

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
        # torch.optim skips a tensor without a gradient; every parameter of a Net has one
        self.flat.grad = torch.cat([p.grad.reshape(-1) for p in self.params])
        self.replayed.step([lr])


def flatten_parameters(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Copy `params` into one flat tensor and make each parameter a view of its slice (values unchanged)."""
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for param in params:
        param.data = flat[offset:offset + param.numel()].view_as(param)
        offset += param.numel()
    return flat


def seeded_init(cfg: RunConfig) -> tuple[Net, Task]:
    """The run's model and task, drawn in the article's order from `cfg.seed` (on the CPU, so every
    device and engine starts from the same weights); then Admin's profiling on the task's inputs."""
    with INIT_LOCK:
        torch.manual_seed(cfg.seed)
        model = Net(cfg.model, cfg.norm)
        task = make_task(cfg.data, cfg.model)
    model.profile_at_init(task.x)  # Admin only, after both draws; draws nothing itself
    return model, task


def step_lr(cfg: RunConfig, step: int) -> float:
    """The learning rate of the update that follows recorded step `step` (update `step + 1`)."""
    return cfg.optim.lr * lr_multiplier(step + 1, cfg.schedule, cfg.train.steps)


def train_run(cfg: RunConfig, device: str = "cpu", on_step: StepCallback | None = None) -> RunResult:
    """Train one run of `cfg` on `device` and return every recorded step's metrics."""
    start = time.perf_counter()
    with torch_threads(cfg.train.threads) as threads:
        result = RunResult(threads=threads)
        model, task = seeded_init(cfg)
        model.to(device)
        x, y = task.x.to(device), task.y.to(device)
        params = list(model.parameters())
        optimizer = ReferenceOptimizer(params, cfg)
        blocks = BlockRecorder(model, cfg.train.log_every) if cfg.train.log_blocks else None
        steps = cfg.train.steps
        for step in range(steps + 1):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            loss_value = loss.item()
            acc = (logits.argmax(-1) == y).float().mean().item()
            lr = step_lr(cfg, step)
            logged = blocks is not None and blocks.due(step)
            if result.check_loss(loss_value, cfg.train.stop_on_nonfinite):
                result.record(step, loss_value, acc, lr, math.nan)
                if logged:
                    blocks.observe(step, [0], [False])  # activations only: no backward at this step
                break
            optimizer.zero_grad()
            loss.backward()
            result.record(step, loss_value, acc, lr, grad_norm(params))
            if logged:
                blocks.observe(step, [0], [True])
            if on_step is not None:
                on_step(step, loss_value)
            if step < steps:
                optimizer.step(lr)
                if logged:
                    blocks.observe_update()
        if blocks is not None:
            blocks.close()
            result.blocks = blocks.rows()
    result.wall_s = time.perf_counter() - start
    return result
