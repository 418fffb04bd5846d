"""The fast engine's stacked step: a batch's runs stacked (their parameters and tasks, as `seeded_init` draws
them), and the gradient step of all of them at once, the model's own forward vmapped over the run axis."""

from __future__ import annotations

import contextlib
import copy
import gc
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.func import functional_call, grad_and_value, vmap
from torch.utils._pytree import tree_map

import normexp.engines.fast.starts as starts
from normexp.config import TEXT_TASKS, RunConfig
from normexp.data import read_windows
from normexp.engines.common import batch_order, loss_and_acc, text_starts, z_loss
from normexp.engines.fast.optim import run_norms

Tensors = dict[str, torch.Tensor]


@dataclass
class Batch:
    """R runs stacked: parameters by name, (R, ...) each; data x (R, n, d) and y (R, n), or for a
    sequence task tokens x (R, n, T), answers y (R, n, A), the answer positions (A,), the held-out
    split, and with minibatches each step's indices (steps + 1, R, batch_size). The text task's x and y
    are its train split, one for every run (N,), and `starts` each step's windows of each run (steps + 1,
    R, batch_size), drawn as the reference draws them (`common.text_starts`)."""

    params: Tensors
    x: torch.Tensor
    y: torch.Tensor
    positions: torch.Tensor | None = None
    val_x: torch.Tensor | None = None
    val_y: torch.Tensor | None = None
    order: torch.Tensor | None = None
    starts: torch.Tensor | None = None

    @property
    def runs(self) -> int:
        return len(next(iter(self.params.values())))

    def step_data(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (x, y) each run trains on at `step`: everything, its own minibatch, or its own windows."""
        if self.starts is not None:
            return read_windows(self.x, self.y, self.starts[step], len(self.positions))
        if self.order is None:
            return self.x, self.y
        runs = torch.arange(len(self.x), device=self.x.device)[:, None]
        return self.x[runs, self.order[step]], self.y[runs, self.order[step]]


_STACKING = threading.Lock()


def stack_runs(runs: Sequence[RunConfig], device: str) -> Batch:
    """Each run's parameters and task as `seeded_init` draws them (the reference's draws; replayed, not
    built, after a structure's first run: `starts.seeded_start`), stacked on `device`."""
    with _collector_paused():  # a structure's first model is ~10^2 modules, each run ~10^3 tensors
        named, tasks = zip(*(starts.seeded_start(cfg) for cfg in runs))  # neither model has buffers
        with torch.no_grad():
            params = {name: torch.stack([run[name] for run in named]).to(device) for name in named[0]}

    def stacked(name: str) -> torch.Tensor | None:
        values = [getattr(task, name) for task in tasks]
        return None if values[0] is None else torch.stack(values).to(device)

    first = runs[0]
    # a copy: the tasks may be kept starts (`starts.Starts`), and `.to` a tensor's own device is the tensor
    positions = tasks[0].positions.to(device, copy=True) if tasks[0].positions is not None else None
    held = (stacked("val_x"), stacked("val_y"))
    if first.data.task in TEXT_TASKS:  # one train split for all; each run's windows, every step's ahead
        windows = [list(itertools.islice(text_starts(cfg, task), cfg.train.steps + 1))
                   for cfg, task in zip(runs, tasks)]
        drawn = torch.stack([torch.stack(steps) for steps in zip(*windows)]).to(device)
        return Batch(params, tasks[0].x.to(device), tasks[0].y.to(device), positions, *held, starts=drawn)
    order = None
    if first.data.batch_size is not None:
        per_run = [batch_order(cfg.data.n_samples, cfg.data.batch_size, cfg.seed, cfg.train.steps) for cfg in runs]
        order = torch.stack([torch.stack(steps) for steps in zip(*per_run)]).to(device)
    return Batch(params, stacked("x"), stacked("y"), positions, *held, order)


def batch_model(cfg: RunConfig) -> torch.nn.Module:
    """A batch's own copy of the parameter-less ("meta") model of `cfg`'s structure that `functional_call`
    runs: batches trained at once in threads must not share one (functional_call swaps its parameters in
    place). A compiled batch needs none once its step is compiled, unless it evaluates a held-out split (the
    Transformer's sequence tasks) with the eager model (the depth-24 toy's copy: ~8 ms a batch)."""
    with _collector_paused():
        return copy.deepcopy(starts.meta_model(cfg))


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic collector off inside, one batch at a time (paired batches): the pause is process-wide,
    and the collector would rescan the models' objects (and, once torch.compile has loaded, dynamo's
    registry) over and over."""
    with _STACKING:
        collecting = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            if collecting:
                gc.enable()


GradStep = Callable[[Tensors, torch.Tensor, torch.Tensor], tuple[Tensors, torch.Tensor]]
ValStep = Callable[[Tensors, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def make_loss_fn(base: torch.nn.Module, positions: torch.Tensor | None) -> ValStep:
    """One run's (loss, acc) from its parameters and data: `base`'s own forward(), the reference's loss."""

    def loss_fn(params: Tensors, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return loss_and_acc(functional_call(base, params, (x,)), y, positions)

    return loss_fn


def held_out(val_step: ValStep, batch: Batch, rows: int | None,
             params: Tensors | None = None) -> list[tuple[float, float]]:
    """Each run's (val_loss, val_acc) on the held-out split, `val_step` a vmapped `make_loss_fn`: the split
    whole, or `rows` sequences at a time as the reference's `validate` reads a text task's (each part's
    mean weighted by its tokens, then divided once). `params`: the runs' parameters (default the batch's)."""
    params = batch.params if params is None else params
    with torch.no_grad():
        if rows is None:  # the split in one forward: its mean, as it is
            total = torch.stack(val_step(params, batch.val_x, batch.val_y))  # (2, R)
        else:
            parts = [(torch.stack(val_step(params, batch.val_x[:, i:i + rows], batch.val_y[:, i:i + rows])),
                      batch.val_y[0, i:i + rows].numel()) for i in range(0, batch.val_x.shape[1], rows)]
            total = sum(part * tokens for part, tokens in parts) / sum(tokens for _, tokens in parts)
    return [tuple(v) for v in total.t().tolist()]


def make_z_loss_fn(base: torch.nn.Module, positions: torch.Tensor | None, coef: float) -> Callable:
    """`train.z_loss`: one run's (loss + z, (loss, acc, z)), the objective the reference differentiates."""

    def loss_fn(params: Tensors, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        logits = functional_call(base, params, (x,))
        loss, acc = loss_and_acc(logits, y, positions)
        z = z_loss(logits, positions, coef)
        return loss + z, (loss, acc, z)

    return loss_fn


def make_grad_step(base: torch.nn.Module, positions: torch.Tensor | None = None, z_coef: float = 0.0,
                   looped: bool = False) -> GradStep:
    """The batch's gradient step: (params, x, y) -> (grads by name, metrics (3, R): loss, acc, grad
    norm per run; with `z_coef` a fourth row, the z-loss term). The model is `base`'s own forward(),
    vmapped over the run axis, or with `looped` (`plan.loops_runs`) run by run (`run_by_run`), each run's
    gradient by plain autograd (`autograd_grad_and_value`)."""
    loss_fn = make_z_loss_fn(base, positions, z_coef) if z_coef else make_loss_fn(base, positions)
    batched = run_by_run(autograd_grad_and_value(loss_fn)) if looped else vmap(grad_and_value(loss_fn, has_aux=True))
    if z_coef:
        def grad_fn(params: Tensors, x: torch.Tensor, y: torch.Tensor) -> tuple[Tensors, tuple]:
            grads, (_, (loss, acc, z)) = batched(params, x, y)
            return grads, (loss, acc, z)
    else:
        grad_fn = batched

    def grad_step(params: Tensors, x: torch.Tensor, y: torch.Tensor) -> tuple[Tensors, torch.Tensor]:
        grads, (loss, acc, *z) = grad_fn(params, x, y)
        # vmap may hand back a strided gradient (the position embedding's is); the fused Adam kernel
        # reads its tensors as contiguous, so give it contiguous ones (a no-op for the others)
        grads = {name: g.contiguous() for name, g in grads.items()}
        return grads, torch.stack([loss, acc, run_norms(list(grads.values())), *z])  # clip_grad_norm_'s norm

    return grad_step


def autograd_grad_and_value(loss_fn: Callable) -> Callable:
    """`torch.func.grad_and_value(loss_fn, has_aux=True)` for one run, by plain autograd (as the reference
    differentiates): (params, x, y) -> (grads by name, (loss, aux)), nothing of it requiring grad. torch.func's
    grad transform wraps every op of the forward and backward; at the real-text study's shape (2,048 tokens a
    run-step) that cost ~45 of ~220 ms a run-step (docs/performance.md, "Real text on the fast engine")."""

    def grad_and_value_fn(params: Tensors, x: torch.Tensor, y: torch.Tensor) -> tuple[Tensors, tuple]:
        own = {name: p.detach().requires_grad_() for name, p in params.items()}
        with torch.enable_grad():
            value, aux = loss_fn(own, x, y)
        grads = torch.autograd.grad(value, list(own.values()))
        return dict(zip(own, grads)), tree_map(torch.Tensor.detach, (value, aux))

    return grad_and_value_fn


def run_by_run(fn: Callable) -> Callable:
    """`vmap(fn)` computed one run after another: `fn` on each run's slice of every argument (tensors, or dicts
    of tensors, with the run axis first), its outputs stacked on a new first axis. Each run's ops are `fn`'s
    own on one run's tensors (the model's forward: the reference's ops), so its numbers do not depend on its
    batch-mates."""

    def batched(*args: object) -> object:
        runs = len(next(iter(args[0].values())) if isinstance(args[0], dict) else args[0])
        outs = [fn(*tree_map(lambda t, r=r: t[r], args)) for r in range(runs)]
        return tree_map(lambda *parts: torch.stack(parts), *outs)

    return batched
