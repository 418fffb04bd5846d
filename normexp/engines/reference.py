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
from normexp.models.ffn import Net
from normexp.models.transformer import Transformer
from normexp.optim import build_optimizer, lr_multiplier

if TYPE_CHECKING:
    from normexp.engines.batched import StackedOptimizer

METRIC_COLUMNS = ("step", "loss", "acc", "lr", "grad_norm")
VAL_COLUMNS = ("val_loss", "val_acc")  # sequence tasks: the held-out split, after METRIC_COLUMNS


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

    def record(self, step: int, loss: float, acc: float, lr: float, grad_norm: float,
               val: tuple[float, float] | None = None) -> None:
        """One recorded step; `val` (val_loss, val_acc) for a sequence task, whose columns then follow."""
        for column, value in zip(METRIC_COLUMNS, (step, loss, acc, lr, grad_norm)):
            self.metrics[column].append(value)
        if val is not None:
            for column, value in zip(VAL_COLUMNS, val):
                self.metrics.setdefault(column, []).append(value)


StepCallback = Callable[[int, float], None]

# Seeding and drawing use torch's global generator: runs started from several threads of one process
# (a Dask worker with several threads, the sweep's paired runs) take turns, so each run sees exactly
# its own draws.
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
        from normexp.engines.batched import REPLAYED_OPTIMIZERS, StackedOptimizer  # batched imports this module

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


def build_model(cfg: RunConfig) -> Net | Transformer:
    """The run's model (`model.arch`): the article's FFN toy, or the causal Transformer."""
    if cfg.model.arch == "transformer":
        return Transformer(cfg.model, cfg.norm, cfg.data)
    return Net(cfg.model, cfg.norm)


def seeded_init(cfg: RunConfig) -> tuple[Net | Transformer, Task]:
    """The run's model and task, drawn in the article's order from `cfg.seed` (on the CPU, so every
    device and engine starts from the same weights); then Admin's profiling on the task's inputs."""
    with INIT_LOCK:
        torch.manual_seed(cfg.seed)
        model = build_model(cfg)
        task = make_task(cfg.data, cfg.model)
    model.profile_at_init(task.x)  # Admin only, after both draws; draws nothing itself
    return model, task


def loss_and_acc(logits: torch.Tensor, y: torch.Tensor,
                 positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy and accuracy. Sequence tasks: logits (n, T, vocab) are read at the answer
    `positions` only, against the answers y (n, A), every answer token counting once."""
    if positions is not None:
        logits, y = logits[:, positions].flatten(0, 1), y.flatten()
    return F.cross_entropy(logits, y), (logits.argmax(-1) == y).float().mean()


def batch_order(n_samples: int, batch_size: int, seed: int, steps: int) -> list[torch.Tensor]:
    """The training indices of steps 0..steps with minibatches (`data.batch_size`): epochs of a fresh
    permutation each, drawn from a generator seeded with the run's seed (not the global one, so the
    model and task keep their draws); an epoch's incomplete last batch is dropped."""
    generator = torch.Generator().manual_seed(seed)
    per_epoch = n_samples // batch_size
    order: list[torch.Tensor] = []
    while len(order) < steps + 1:
        perm = torch.randperm(n_samples, generator=generator)
        order += [perm[i * batch_size:(i + 1) * batch_size] for i in range(per_epoch)]
    return order[:steps + 1]


@torch.no_grad()
def validate(model: torch.nn.Module, task: Task) -> tuple[float, float] | None:
    """(val_loss, val_acc) on the held-out split, or None for a task without one."""
    if task.val_x is None:
        return None
    loss, acc = loss_and_acc(model(task.val_x), task.val_y, task.positions)
    return loss.item(), acc.item()


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
        task = Task(*(t.to(device) if t is not None else None for t in vars(task).values()))
        batches = (batch_order(cfg.data.n_samples, cfg.data.batch_size, cfg.seed, cfg.train.steps)
                   if cfg.data.batch_size is not None else None)
        params = list(model.parameters())
        optimizer = ReferenceOptimizer(params, cfg)
        blocks = BlockRecorder(model, cfg.train.log_every) if cfg.train.log_blocks else None
        steps = cfg.train.steps
        for step in range(steps + 1):
            x, y = (task.x, task.y) if batches is None else (task.x[batches[step]], task.y[batches[step]])
            logits = model(x)
            loss, acc_tensor = loss_and_acc(logits, y, task.positions)
            loss_value, acc = loss.item(), acc_tensor.item()
            val = validate(model, task)
            lr = step_lr(cfg, step)
            logged = blocks is not None and blocks.due(step)
            if result.check_loss(loss_value, cfg.train.stop_on_nonfinite):
                result.record(step, loss_value, acc, lr, math.nan, val)
                if logged:
                    blocks.observe(step, [0], [False])  # activations only: no backward at this step
                break
            optimizer.zero_grad()
            loss.backward()
            result.record(step, loss_value, acc, lr, grad_norm(params), val)
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
