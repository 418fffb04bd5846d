"""The fast engine: runs of one structure trained together through torch.func; close, not bit-exact.

    params = each run's Net's (seeded_init's draws, replayed), stacked  # (R, ...) per parameter
    grads, (loss, acc) = vmap(grad_and_value(functional_call(Net on "meta", ...)))(params, x, y)
    one vectorised optimizer update of every run, hyper-parameters as (R, 1, ...) tensors

- The model is the model's own `Net` (its `Block.forward`, its norms), called through
  `torch.func.functional_call` on a parameter-less copy, so every placement and norm kind trains here
  without a second definition.
- Each run starts exactly as the reference starts it (`seeded_init`: same weights, same data).
- The Transformer (`model.arch: transformer`) trains here the same way: token inputs, the loss read
  at the answer positions, the held-out split evaluated every step (val_loss, val_acc), and
  minibatches (`data.batch_size`) gathered per run from the reference's seeded order. qk-norm is part
  of the model; with `train.z_loss` the gradient is that of the cross-entropy plus the reference's z
  term (`common.z_loss`), recorded apart as the reference records it.
- Adam, AdamW, RAdam and SGD (momentum) are written as a few element-wise tensor ops with per-run
  learning rate, betas, eps, weight decay and momentum; schedules vary per run. RAdam's rectification
  is decided per run per step.
- A run whose loss turns non-finite is recorded at that step and then frozen: its gradients are
  masked out and its parameters no longer change (a `live` mask, so batch shapes stay fixed); its
  batch-mates go on. With `train.stop_on_nonfinite: false` it keeps training, as in the reference.
  A run that `train.stop_when` stops (`common.EarlyStop`, on its own recorded losses) is frozen alike.
- Compiling the step (forward, backward, grad norms, the update) is optional. `compile=None` decides
  from the planned model-steps (a pure function of the sweep, so the same sweep makes the same
  choice). The step is traced into one flat graph of aten operations (make_fx: vmap and grad
  applied, forward and backward in it; with Adam and AdamW the update too, made in place, so the
  gradients never leave the compiled code), and that graph is compiled ahead of time by AOTInductor
  into a package on disk (`engines.aot`: once per machine, shape and code; later batches, workers and
  sweeps load it in a fraction of a second). vmap specialises the run axis, so compiled batches are
  COMPILED_CHUNK runs, the last one padded: one compiled step per structure serves every batch. A
  run that stops (diverged, train.stop_when) gets the update of the step it stopped at, as every run
  gets one after the last step: nothing records it. A compile that fails
  falls back to the eager step (the batch restarts from its initial state) with one warning, and
  the structure's later batches in the process train uncompiled (a compile costs minutes).

What can change a run's bits: the runs it is batched with (kernels may block differently for other
batch sizes), compiling or not, the thread count, the device and torch build. What cannot: the sweep
running twice, the executor, resuming. Tests hold it to the reference within the reference's own
1- vs 2-thread spread (see README, "Engines").
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import math
import os
import threading
import time
import warnings
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from torch.func import functional_call, grad_and_value, vmap

from normexp.config import OptimConfig, RunConfig
from normexp.engines import aot, initial
from normexp.engines.common import (
    EarlyStop,
    RunResult,
    batch_order,
    loss_and_acc,
    record_live,
    share_wall_time,
    torch_threads,
    user_cache_dir,
    z_loss,
)
from normexp.engines.cost import fast_key, should_compile
from normexp.optim import step_lr

MAX_CHUNK = 64  # runs per uncompiled batch; larger batches gain little on a CPU and hold more activations
COMPILED_CHUNK = 8  # runs per compiled batch: 8 runs' parameters, moments and activations stay nearer the cache
# than 16's, with two workers sharing it (a 2,048-run phase sweep 90.3 vs 99.0 s, metrics identical; 4 runs no faster
# than 8, 32 slower than 16: docs/performance.md)
MAX_STRETCHES = 16  # Adam: more stretches of equal learning rates than this, and a scratch pass is cheaper
AHEAD = 64  # steps whose learning rates (and compiled Adam numbers) a batch makes at once: `MadeAhead`

Tensors = dict[str, torch.Tensor]
_T = TypeVar("_T")


class MadeAhead(Sequence[_T]):
    """`make(i)` for i in range(n), made `ahead` items at a time when one of them is first read, and only the
    latest stretch kept: a loop that reads them in order makes each once, a few calls together (as
    `adam_hypers`' with warm caches, ~10x cheaper than one between two compiled steps), and a batch that
    stops early (train.stop_when, divergence) makes none past its stretch, whatever its train.steps (made all
    at the batch's start, 10^6 steps took seconds and hundreds of MB before the first step)."""

    def __init__(self, make: Callable[[int], _T], n: int, ahead: int | None = None) -> None:
        self.make, self.n, self.ahead = make, n, AHEAD if ahead is None else ahead
        self.start, self.items = 0, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> _T:  # one index: no slices
        if not 0 <= i < self.n:
            raise IndexError(i)
        if not self.start <= i < self.start + len(self.items):
            self.start = i - i % self.ahead
            self.items = [self.make(j) for j in range(self.start, min(self.start + self.ahead, self.n))]
        return self.items[i - self.start]


def plan_fast(runs: Sequence[RunConfig], compiled: Callable[[RunConfig], bool] = lambda cfg: False
              ) -> list[list[RunConfig]]:
    """Group runs by `fast_key`, in chunks of at most MAX_CHUNK runs, or COMPILED_CHUNK for a structure
    that `compiled` says compiles (a group of one is a batch too)."""
    groups: dict[tuple, list[RunConfig]] = {}
    for cfg in runs:
        groups.setdefault(fast_key(cfg), []).append(cfg)
    return [group[i:i + size] for group in groups.values()
            for size in [COMPILED_CHUNK if compiled(group[0]) else MAX_CHUNK] for i in range(0, len(group), size)]



def compile_cache_dir() -> Path | None:
    """Inductor's cache folder: $TORCHINDUCTOR_CACHE_DIR if set, else one stable folder per user
    (`user_cache_dir()`/inductor: ~/.cache/normexp/inductor), so a compile made by one sweep is found by the next;
    None (inductor's own default) for a user without a home folder."""
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not folder:
        home = user_cache_dir()
        if home is None:  # no home folder: inductor's own default, not a folder normexp makes up
            return None
        folder = os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(home / "inductor")
    return Path(folder)


# ----------------------------------------------------------------------------- the optimizer


class FastOptimizer:
    """Adam, AdamW, RAdam and SGD (momentum) stepping R runs' stacked parameters at once, each run
    with its own learning rate, betas, eps, weight decay and momentum.

    Per-run numbers are (R,) tensors viewed as (R, 1, ...), applied with `torch._foreach_*` ops over
    every parameter at once. Adam and AdamW use torch's fused kernel for their one long update. It
    takes one learning rate, beta1, beta2 and eps, so it runs once per stretch of consecutive runs
    that share them at this step (`stretches`; a sweep's seeds of one variant are such a stretch),
    updating the parameters in place. When the runs' learning rates differ so much that the stretches
    would be short (more than MAX_STRETCHES), it instead runs once per stretch of equal betas and eps
    with learning rate 1, writing the update direction -m_hat / (sqrt(v_hat) + eps) into a scratch
    tensor, and each run's learning rate multiplies that afterwards. Weight decay is applied outside
    the kernel (L2 into the gradient, or AdamW's decoupled shrink). State starts at zero, which equals
    torch's first-step initialisation. A frozen run (`live` False) gets a zero gradient and a zero
    learning rate: its parameters stay as they are."""

    def __init__(self, name: str, optims: Sequence[OptimConfig], params: list[torch.Tensor]) -> None:
        self.name, self.optims, self.params, self.t = name, list(optims), params, 0
        self.decay = any(o.weight_decay != 0 for o in optims)  # torch skips weight decay at 0
        self.kernel_hypers = [(tuple(o.betas), o.eps) for o in optims]  # what the fused kernel takes as one
        slots = ("momentum",) if name == "sgd" else ("exp_avg", "exp_avg_sq")
        self.state = {slot: [torch.zeros_like(p) for p in params] for slot in slots}
        self.direction: list[torch.Tensor] | None = None  # Adam's scratch, made when first needed
        self._step = torch.zeros((), dtype=torch.float32, device=params[0].device)  # the fused kernel's t

    def per_run(self, values: Sequence[float]) -> list[torch.Tensor]:
        """(R,) values as one (R, 1, ...) view per parameter."""
        tensor = torch.tensor(values, dtype=torch.float32, device=self._step.device)
        return [tensor.view(-1, *([1] * (p.dim() - 1))) for p in self.params]

    def step(self, grads: list[torch.Tensor], lrs: Sequence[float], live: Sequence[bool]) -> None:
        """One update: run r steps with learning rate lrs[r] if live[r]."""
        self.t += 1
        if not all(live):
            alive = self.per_run([float(a) for a in live])
            grads = [torch.where(a > 0, g, 0.0) for g, a in zip(grads, alive)]
            lrs = [lr if a else 0.0 for lr, a in zip(lrs, live)]
        with torch.no_grad():
            if self.decay and self.name != "adamw":  # L2: grad + weight_decay * param
                torch._foreach_addcmul_(grads, self.params, self.per_run([o.weight_decay for o in self.optims]))
            if self.name in ("adam", "adamw"):
                self._adam(grads, lrs)
            elif self.name == "radam":
                self._radam(grads, lrs)
            else:
                self._sgd(grads, lrs)

    def _adam(self, grads: list[torch.Tensor], lrs: Sequence[float]) -> None:
        if self.decay and self.name == "adamw":  # decoupled: param * (1 - lr * weight_decay)
            torch._foreach_mul_(self.params, self.per_run([1 - lr * o.weight_decay for lr, o in zip(lrs, self.optims)]))
        self._step.fill_(self.t)
        moments = (self.state["exp_avg"], self.state["exp_avg_sq"])
        each_lr = stretches([(*hypers, lr) for hypers, lr in zip(self.kernel_hypers, lrs)])
        if len(each_lr) <= MAX_STRETCHES:  # the kernel updates the parameters, at each stretch's lr
            for start, stop, ((beta1, beta2), eps, lr) in each_lr:
                self._fused_adam(start, stop, (self.params, grads, *moments), lr, beta1, beta2, eps)
            return
        if self.direction is None:
            self.direction = [torch.empty_like(p) for p in self.params]
        torch._foreach_zero_(self.direction)
        for start, stop, ((beta1, beta2), eps) in stretches(self.kernel_hypers):
            self._fused_adam(start, stop, (self.direction, grads, *moments), 1.0, beta1, beta2, eps)
        torch._foreach_addcmul_(self.params, self.direction, self.per_run(lrs))

    def _fused_adam(self, start: int, stop: int, tensors: tuple[list[torch.Tensor], ...], lr: float,
                    beta1: float, beta2: float, eps: float) -> None:
        """torch's fused Adam on runs [start, stop) of (params, grads, exp_avg, exp_avg_sq)."""
        whole = stop - start == len(self.optims)
        part = [ts if whole else [t[start:stop] for t in ts] for ts in tensors]
        torch._fused_adam_(*part, [], [self._step] * len(part[0]), lr=lr, beta1=beta1, beta2=beta2,
                           weight_decay=0.0, eps=eps, amsgrad=False, maximize=False)

    def _radam(self, grads: list[torch.Tensor], lrs: Sequence[float]) -> None:
        o, t = self.optims, self.t
        exp_avg, exp_avg_sq = self.state["exp_avg"], self.state["exp_avg_sq"]
        torch._foreach_mul_(exp_avg, self.per_run([x.betas[0] for x in o]))
        torch._foreach_addcmul_(exp_avg, grads, self.per_run([1 - x.betas[0] for x in o]))
        torch._foreach_mul_(exp_avg_sq, self.per_run([x.betas[1] for x in o]))
        torch._foreach_addcmul_(exp_avg_sq, torch._foreach_mul(grads, self.per_run([1 - x.betas[1] for x in o])), grads)
        rect, plain = zip(*(radam_rectification(x.betas[1], t) for x in o))
        # adaptive = rect * sqrt(1 - beta2^t) / (sqrt(v) + eps) once rectified, else 1 (plain momentum)
        adaptive = torch._foreach_sqrt(exp_avg_sq)
        torch._foreach_add_(adaptive, self.per_run([x.eps for x in o]))
        torch._foreach_reciprocal_(adaptive)
        torch._foreach_mul_(adaptive, self.per_run([r * math.sqrt(1 - x.betas[1] ** t) for r, x in zip(rect, o)]))
        torch._foreach_add_(adaptive, self.per_run(plain))
        torch._foreach_mul_(adaptive, exp_avg)
        neg_step_size = [-lr / (1 - x.betas[0] ** t) for lr, x in zip(lrs, o)]
        torch._foreach_addcmul_(self.params, adaptive, self.per_run(neg_step_size))

    def _sgd(self, grads: list[torch.Tensor], lrs: Sequence[float]) -> None:
        momentum = self.state["momentum"]  # 0 * buffer + grad = grad: torch's first-step buffer
        torch._foreach_mul_(momentum, self.per_run([o.momentum for o in self.optims]))
        torch._foreach_add_(momentum, grads)
        torch._foreach_addcmul_(self.params, momentum, self.per_run([-lr for lr in lrs]))


def stretches(keys: Sequence[Hashable]) -> list[tuple[int, int, Hashable]]:
    """Maximal stretches [start, stop) of consecutive runs with equal keys: (start, stop, key)."""
    found: list[tuple[int, int, Hashable]] = []
    for r, key in enumerate(keys):
        if found and found[-1][2] == key:
            found[-1] = (found[-1][0], r + 1, key)
        else:
            found.append((r, r + 1, key))
    return found


def radam_rectification(beta2: float, t: int) -> tuple[float, float]:
    """RAdam's (rect, plain) at update t (Liu et al. 2020, as torch computes it): the adaptive step
    weighted by `rect` once the variance is tractable (rho_t > 5), else the plain momentum step."""
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * t * beta2**t / (1 - beta2**t)
    if rho_t > 5.0:
        return math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)), 0.0
    return 0.0, 1.0


FUSED_OPTIMIZERS = ("adam", "adamw")  # compiled steps carry their update: `adam_update`, one pass over the state
HYPERS = ("step_size", "decay", "l2", "1-beta1", "beta2", "1-beta2", "eps", "bias_correction2_sqrt", "live")  # its rows


def adam_hypers(optims: Sequence[OptimConfig], name: str, t: int, lrs: Sequence[float],
                live: Sequence[bool]) -> torch.Tensor:
    """`adam_update`'s per-run numbers for update `t` (1, 2, ...) at learning rates `lrs`: a (len(HYPERS), R)
    tensor. Bias corrections, step sizes and 1 - beta are computed in double, as torch computes them (1 - beta2
    in float32 is 1e-5 off at beta2 = 0.999);
    AdamW's decay is decoupled (param * (1 - lr * weight_decay)), Adam's is L2 (grad + weight_decay * param)."""
    decoupled = name == "adamw"
    rows = []
    for o, lr, alive in zip(optims, lrs, live):
        beta1, beta2 = o.betas
        rows.append((lr / (1 - beta1**t), 1 - lr * o.weight_decay if decoupled else 1.0,
                     0.0 if decoupled else o.weight_decay, 1 - beta1, beta2, 1 - beta2, o.eps, math.sqrt(1 - beta2**t),
                     float(alive)))
    return torch.tensor(rows, dtype=torch.float32).t().contiguous()


def _per_run(hyper: torch.Tensor, p: torch.Tensor) -> list[torch.Tensor]:
    """`hyper`'s rows (HYPERS), each viewed (R, 1, ...) to broadcast against p (R, ...)."""
    return [row.view(-1, *([1] * (p.dim() - 1))) for row in hyper]


def adam_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                hyper: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Adam or AdamW update of R runs' stacked tensor p (R, ...) with gradient g and moments m, v, each
    run with its own numbers (`hyper`, rows `HYPERS`): torch's update (torch.optim.Adam, single tensor),
    written as a pure function so that the compiled step computes it in one pass over the state. A run
    that is not live keeps its tensor and moments. Returns (p, m, v) after the update."""
    _, _, l2, weight1, beta2, weight2, _, _, live = _per_run(hyper, p)
    g = g + l2 * p
    m_new = torch.lerp(m, g, weight1)  # torch's exp_avg.lerp_(grad, 1 - beta1): exact at beta1 = 0
    v_new = v * beta2 + weight2 * g * g
    keep = live > 0
    return adam_move(p, m_new, v_new, hyper), torch.where(keep, m_new, m), torch.where(keep, v_new, v)


def adam_move(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, hyper: torch.Tensor) -> torch.Tensor:
    """p after the step that the updated moments m, v make (AdamW's decay first); a run not live keeps p."""
    step_size, decay, _, _, _, _, eps, bc2_sqrt, live = _per_run(hyper, p)
    return torch.where(live > 0, p * decay - step_size * m / (v.sqrt() / bc2_sqrt + eps), p)


# ----------------------------------------------------------------------------- the stacked step


@dataclass
class Batch:
    """R runs stacked: parameters by name, (R, ...) each; data x (R, n, d) and y (R, n), or for a
    sequence task tokens x (R, n, T), answers y (R, n, A), the answer positions (A,), the held-out
    split, and with minibatches each step's indices (steps + 1, R, batch_size)."""

    params: Tensors
    x: torch.Tensor
    y: torch.Tensor
    positions: torch.Tensor | None = None
    val_x: torch.Tensor | None = None
    val_y: torch.Tensor | None = None
    order: torch.Tensor | None = None

    def step_data(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (x, y) each run trains on at `step`: everything, or its own minibatch."""
        if self.order is None:
            return self.x, self.y
        runs = torch.arange(len(self.x), device=self.x.device)[:, None]
        return self.x[runs, self.order[step]], self.y[runs, self.order[step]]


_STACKING = threading.Lock()


def stack_runs(runs: Sequence[RunConfig], device: str) -> Batch:
    """Each run's parameters and task as `seeded_init` draws them (the reference's draws; replayed, not
    built, after a structure's first run: `initial.seeded_start`), stacked on `device`."""
    with _collector_paused():  # a structure's first model is ~10^2 modules, each run ~10^3 tensors
        named, tasks = zip(*(initial.seeded_start(cfg) for cfg in runs))  # neither model has buffers
        with torch.no_grad():
            params = {name: torch.stack([run[name] for run in named]).to(device) for name in named[0]}

    def stacked(name: str) -> torch.Tensor | None:
        values = [getattr(task, name) for task in tasks]
        return None if values[0] is None else torch.stack(values).to(device)

    first = runs[0]
    order = None
    if first.data.batch_size is not None:
        per_run = [batch_order(cfg.data.n_samples, cfg.data.batch_size, cfg.seed, cfg.train.steps) for cfg in runs]
        order = torch.stack([torch.stack(steps) for steps in zip(*per_run)]).to(device)
    # a copy: the tasks may be kept starts (`initial._Starts`), and `.to` a tensor's own device is the tensor
    positions = tasks[0].positions.to(device, copy=True) if tasks[0].positions is not None else None
    return Batch(params, stacked("x"), stacked("y"), positions, stacked("val_x"), stacked("val_y"), order)


def batch_model(cfg: RunConfig) -> torch.nn.Module:
    """A batch's own copy of the parameter-less ("meta") model of `cfg`'s structure that `functional_call`
    runs: batches trained at once in threads must not share one (functional_call swaps its parameters in
    place). A compiled batch needs none once its step is compiled, unless it evaluates a held-out split (the
    Transformer's sequence tasks) with the eager model (the depth-24 toy's copy: ~8 ms a batch)."""
    with _collector_paused():
        return copy.deepcopy(initial.meta_model(cfg))


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


def make_z_loss_fn(base: torch.nn.Module, positions: torch.Tensor | None, coef: float) -> Callable:
    """`train.z_loss`: one run's (loss + z, (loss, acc, z)), the objective the reference differentiates."""

    def loss_fn(params: Tensors, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        logits = functional_call(base, params, (x,))
        loss, acc = loss_and_acc(logits, y, positions)
        z = z_loss(logits, positions, coef)
        return loss + z, (loss, acc, z)

    return loss_fn


def make_grad_step(base: torch.nn.Module, positions: torch.Tensor | None = None, z_coef: float = 0.0) -> GradStep:
    """The batch's gradient step: (params, x, y) -> (grads by name, metrics (3, R): loss, acc, grad
    norm per run; with `z_coef` a fourth row, the z-loss term). The model is `base`'s own forward(),
    vmapped over the run axis."""
    if z_coef:
        z_fn = vmap(grad_and_value(make_z_loss_fn(base, positions, z_coef), has_aux=True))

        def grad_fn(params: Tensors, x: torch.Tensor, y: torch.Tensor) -> tuple[Tensors, tuple]:
            grads, (_, (loss, acc, z)) = z_fn(params, x, y)
            return grads, (loss, acc, z)
    else:
        grad_fn = vmap(grad_and_value(make_loss_fn(base, positions), has_aux=True))

    def grad_step(params: Tensors, x: torch.Tensor, y: torch.Tensor) -> tuple[Tensors, torch.Tensor]:
        grads, (loss, acc, *z) = grad_fn(params, x, y)
        # vmap may hand back a strided gradient (the position embedding's is); the fused Adam kernel
        # reads its tensors as contiguous, so give it contiguous ones (a no-op for the others)
        grads = {name: g.contiguous() for name, g in grads.items()}
        per_tensor = [torch.linalg.vector_norm(g.reshape(len(g), -1), dim=1) for g in grads.values()]
        norms = torch.linalg.vector_norm(torch.stack(per_tensor, dim=1), dim=1)  # clip_grad_norm_'s norm
        return grads, torch.stack([loss, acc, norms, *z])

    return grad_step


def train_fast(runs: Sequence[RunConfig], device: str = "cpu", compile: bool | None = None,
               on_step: Callable[[int], None] | None = None) -> list[RunResult]:
    """Train `runs` (equal `fast_key`) together; one RunResult per run, recorded as `train_run` records.
    `compile`: compile the gradient step, or None to decide from this batch's model-steps. `on_step` is
    called after each recorded step (what it raises ends the batch)."""
    use_compile = should_compile(runs[0], len(runs) * (runs[0].train.steps + 1)) if compile is None else compile
    structure = compiled_structure(runs[0])
    refused = ("refused", *structure, device)
    if use_compile and refused not in _COMPILED:
        try:
            return _train_padded(runs, device, on_step)
        except CompileFailed as failed:  # the eager step still works (what a run raises itself is not caught)
            exc = failed.__cause__ or failed
            for key in [k for k in _COMPILED if k[:len(structure)] == structure]:
                del _COMPILED[key]
            # later batches of this step in this process: uncompiled, not compiled again (the structure's
            # other steps, another optimizer family's or z_loss's, keep theirs)
            _COMPILED[refused] = None
            first_line = (str(exc).strip().splitlines() or [""])[0][:200]
            warnings.warn(f"compiling the step failed ({type(exc).__name__}: {first_line}); training this "
                          "structure's runs uncompiled", RuntimeWarning, stacklevel=2)
    return _train(runs, device, False, on_step)


def _train_padded(runs: Sequence[RunConfig], device: str, on_step: Callable[[int], None] | None) -> list[RunResult]:
    """The compiled loop on batches of COMPILED_CHUNK runs (one compiled shape for every batch): a larger
    batch in chunks, one after another, and the last padded with copies of its first run, whose results
    are dropped."""
    if len(runs) > COMPILED_CHUNK:
        return [result for i in range(0, len(runs), COMPILED_CHUNK)
                for result in _train_padded(runs[i:i + COMPILED_CHUNK], device, on_step)]
    padded = list(runs) + [runs[0]] * (COMPILED_CHUNK - len(runs))
    results = _train(padded, device, True, on_step)[:len(runs)]
    for result in results:
        result.wall_s *= len(padded) / len(runs)
    return results


def _train(runs: Sequence[RunConfig], device: str, compiled: bool,
           on_step: Callable[[int], None] | None = None) -> list[RunResult]:
    """The loop of `train_fast`: record each step's metrics per run, stop when no run is recording."""
    start = time.perf_counter()
    first = runs[0]
    stop_on_nonfinite = first.train.stop_on_nonfinite
    with torch_threads(first.train.threads) as threads:
        batch = stack_runs(runs, device)
        base = functools.cache(functools.partial(batch_model, first))  # made where needed, once
        optimizer = FastOptimizer(first.optim.name, [cfg.optim for cfg in runs], list(batch.params.values()))
        if compiled and _step_key(first, batch) not in _COMPILED:
            base()  # the model the step is traced from, made outside the compiler's wrap: what it raises is the batch's
        steps = first.train.steps
        schedule = MadeAhead(lambda step: [step_lr(cfg, step) for cfg in runs], steps + 1)  # each step's lrs
        step_fn = _compiler_step(_compiled, first, base, batch, optimizer, schedule) if compiled else None
        grad_step = make_grad_step(base(), batch.positions, first.train.z_loss) if step_fn is None else None
        val_step = vmap(make_loss_fn(base(), batch.positions)) if batch.val_x is not None else None
        results = [RunResult(threads=threads, engine="fast", early_stop=EarlyStop.of(cfg)) for cfg in runs]
        live = [True] * len(runs)  # runs still recording (and updating)
        for step in range(steps + 1):
            lrs = schedule[step]
            vals = [None] * len(runs)
            if val_step is not None:  # before the step: a compiled Adam step updates the parameters in place
                with torch.no_grad():
                    held_out = torch.stack(val_step(batch.params, batch.val_x, batch.val_y))  # (2, R)
                vals = [tuple(v) for v in held_out.t().tolist()]
            if step_fn is not None:
                metrics = _compiler_step(step_fn.step, batch.params, *batch.step_data(step), lrs, live)
            else:
                grads, metrics = grad_step(batch.params, *batch.step_data(step))
            losses, accs, norms, *zs = metrics.tolist()  # zs: [the z-loss terms] with train.z_loss
            record_live(results, live, step, losses, accs, lrs, norms, stop_on_nonfinite, vals, *zs)
            if not any(live):
                break
            if on_step is not None:
                on_step(step)
            if step < steps:
                if step_fn is not None:
                    _compiler_step(step_fn.update, lrs, live)
                else:
                    optimizer.step(list(grads.values()), lrs, live)
    return share_wall_time(results, start)


class CompileFailed(Exception):  # noqa: N818 - raised from the compiler's exception, its __cause__
    """Compiling, checking or calling the compiled step raised: `train_fast` trains the batch uncompiled.
    What a run raises outside the compiled step (its initialisation, say) is not wrapped: it fails the batch
    as it does uncompiled, and the compiled step stays in use."""


def _compiler_step(fn: Callable[..., _T], *args: object) -> _T:
    """`fn(*args)`, an exception it raises wrapped in CompileFailed."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - any compiler failure: the eager step still works
        raise CompileFailed(str(exc)) from exc


class CompiledStep:
    """A compiled step bound to one batch. Without the optimizer inside (`grad`: params, x, y -> grads,
    metrics) it hands the gradients to the batch's `FastOptimizer` at `update`; with it (Adam and AdamW:
    `compile_train_step`) one call computes this step's metrics and makes the update (`adam_update`) in
    place, so the parameters have moved on when it returns, and `update` has nothing left to do. A run
    that stops at this step (diverged, or train.stop_when), and every run at the last step, has that
    update made too; none of them is recorded again, so it changes nothing a run reports."""

    def __init__(self, compiled: Callable, optimizer: FastOptimizer, fused: bool,
                 schedule: Sequence[Sequence[float]] = ()) -> None:
        self.compiled, self.optimizer, self.fused = compiled, optimizer, fused
        self.grads: Tensors = {}
        # Each update's numbers while every run is live (update t: index t - 1), made a stretch ahead
        # (`MadeAhead`): `adam_hypers` between two calls of the step costs ~10x what it does in a row, the
        # step having evicted what it touches
        everyone = [True] * len(optimizer.optims)
        self.hypers = MadeAhead(lambda i: adam_hypers(optimizer.optims, optimizer.name, i + 1, schedule[i], everyone),
                                len(schedule) if fused else 0)

    def step(self, params: Tensors, x: torch.Tensor, y: torch.Tensor, lrs: Sequence[float],
             live: Sequence[bool]) -> torch.Tensor:
        if not self.fused:
            self.grads, metrics = self.compiled(params, x, y)
            return metrics
        opt = self.optimizer
        opt.t += 1
        made = opt.t <= len(self.hypers) and all(live)
        hyper = self.hypers[opt.t - 1] if made else adam_hypers(opt.optims, opt.name, opt.t, lrs, live)
        (metrics,) = self.compiled(*opt.params, *opt.state["exp_avg"], *opt.state["exp_avg_sq"], x, y,
                                   hyper.to(x.device))
        return metrics

    def update(self, lrs: Sequence[float], live: Sequence[bool]) -> None:
        """This step's update, for the runs `live` after it was recorded (made already with Adam)."""
        if not self.fused:
            self.optimizer.step(list(self.grads.values()), lrs, live)


# One compiled step per structure, optimizer family and device, kept for the process's life: later
# batches (other seeds or hyper-parameters) reuse it instead of compiling again.
_COMPILED: dict[tuple, Callable | None] = {}  # None: refused (see train_fast)


def compiled_structure(cfg: RunConfig) -> tuple:
    """What one compiled step serves (with the device): the model, norm, data, z-loss, and whether the Adam
    update is inside it. A step that fails to compile is refused for exactly this (`train_fast`)."""
    return (cfg.model, cfg.norm, cfg.data, cfg.train.z_loss, cfg.optim.name in FUSED_OPTIMIZERS)


def _step_key(cfg: RunConfig, batch: Batch) -> tuple:
    """The key of `_COMPILED` that the step of `cfg`'s runs on the batch's device is kept under."""
    return (*compiled_structure(cfg), str(batch.x.device))


def _compiled(cfg: RunConfig, base: Callable[[], torch.nn.Module], batch: Batch,
              optimizer: FastOptimizer, schedule: Sequence[Sequence[float]] = ()) -> CompiledStep:
    """The compiled step of runs shaped like `cfg` on the batch's device, for batches of COMPILED_CHUNK runs
    (vmap specialises the run axis, so `train_fast` pads smaller batches); with Adam or AdamW the update
    is part of it, its numbers for each update made from `schedule` (each step's learning rates, `_train`'s),
    a stretch of updates ahead; `base` makes the batch's model, which a step not compiled yet traces. Compile errors,
    and a compiled step that does not reproduce the eager one, surface at the first call."""
    fused = cfg.optim.name in FUSED_OPTIMIZERS
    key = _step_key(cfg, batch)
    if key not in _COMPILED:
        compile_cache_dir()
        what = {"step": "train-adam" if fused else "grad", "model": cfg.model.model_dump(mode="json"),
                "norm": cfg.norm.model_dump(mode="json"), "data": cfg.data.model_dump(mode="json"),
                "z_loss": cfg.train.z_loss, "runs": len(batch.x)}
        step = make_grad_step(base(), batch.positions, cfg.train.z_loss)
        name, vouching = aot.step_key(what, str(batch.x.device)), aot.vouchable(what)
        x, y = batch.step_data(0)
        if fused:  # the check's update: each run's base learning rate (a warmup may start at 0), live
            hyper = adam_hypers(optimizer.optims, optimizer.name, 1, [o.lr for o in optimizer.optims],
                                [True] * len(batch.x)).to(batch.x.device)
            _COMPILED[key] = compile_train_step(step, batch.params, x, y, hyper, name, vouching)
        else:
            _COMPILED[key] = compile_grad_step(step, batch.params, x, y, key=name, vouching=vouching)
    return CompiledStep(_COMPILED[key], optimizer, fused, schedule)


def compile_grad_step(step: GradStep, params: Tensors, x: torch.Tensor, y: torch.Tensor, key: str,
                      vouching: bool = False) -> GradStep:
    """`step` traced once into one flat graph of aten operations (make_fx: forward, backward and the
    norms, vmap and grad already applied), compiled ahead of time (AOTInductor) and kept on disk under
    `key` (`_compile_checked`). Returns a step that takes and returns tensors by name."""
    names = list(params)

    def flat(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        grads, metrics = step(dict(zip(names, tensors[:-2])), tensors[-2], tensors[-1])
        return (*(grads[name] for name in names), metrics)

    compiled = _compile_checked(flat, (*params.values(), x, y), key, _disagreement, vouching=vouching)

    def compiled_step(params: Tensors, x: torch.Tensor, y: torch.Tensor) -> tuple[Tensors, torch.Tensor]:
        *grads, metrics = compiled(*(params[name] for name in names), x, y)
        return dict(zip(names, grads)), metrics

    return compiled_step


def compile_train_step(step: GradStep, params: Tensors, x: torch.Tensor, y: torch.Tensor, hyper: torch.Tensor,
                       key: str, vouching: bool = False) -> Callable:
    """`step` and the Adam update (`adam_update`) of every parameter traced into one graph and compiled
    as `compile_grad_step`'s: (params, exp_avg, exp_avg_sq, x, y, hyper) -> (metrics,), positional, the
    parameters and moments updated in place. The gradients never leave the compiled code, and each
    tensor's update is one pass over its parameters, gradient and moments, written where they are.
    Checked against the same function run eagerly, from zero moments at `hyper`: the metrics, each
    run's update of its parameters, and the new moments."""
    names, n = list(params), len(params)

    def flat(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ps, ms, vs, (x, y, hyper) = tensors[:n], tensors[n:2 * n], tensors[2 * n:3 * n], tensors[3 * n:]
        grads, metrics = step(dict(zip(names, ps)), x, y)
        for name, p, m, v in zip(names, ps, ms, vs):  # after every gradient is taken: the weights are read there
            for tensor, new in zip((p, m, v), adam_update(p, grads[name], m, v, hyper)):
                tensor.copy_(new)
        return (metrics,)

    start = list(params.values())
    inputs = (*start, *(torch.zeros_like(p) for p in start * 2), x, y, hyper)

    def disagreement(eager: Sequence[torch.Tensor], got: Sequence[torch.Tensor]) -> str | None:
        """The moments against the eager ones (each proportional to the gradient or its square); the update
        against the one `adam_update` makes from the compiled moments. Adam scales a gradient that is zero
        in exact arithmetic (rounding noise, as attention's key bias has) to a full step, so its update
        differs between any two orders of summation by the learning rate; its moments do not."""
        if len(got) != len(eager):
            return "its outputs"
        if not _metrics_close(eager[-1], got[-1]):
            return "its metrics"
        for i, what in ((1, "its first moments"), (2, "its second moments")):
            if not _gradients_close(eager[i * n:(i + 1) * n], got[i * n:(i + 1) * n]):
                return what
        expected = [adam_move(p, m, v, hyper) for p, m, v in zip(start, got[n:2 * n], got[2 * n:3 * n])]
        if not _gradients_close([e - p for e, p in zip(expected, start)], [g - p for g, p in zip(got[:n], start)]):
            return "its update"
        return None

    return _compile_checked(flat, inputs, key, disagreement, mutated=3 * n, vouching=vouching)


def _compile_checked(flat: Callable[..., tuple[torch.Tensor, ...]], inputs: Sequence[torch.Tensor], key: str,
                     disagreement: Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], str | None],
                     mutated: int = 0, vouching: bool = False) -> Callable:
    """`flat` traced by make_fx into one graph of aten operations (vmap and grad applied), compiled ahead
    of time (AOTInductor) and kept on disk under `key` (`aot.load_or_compile`): later batches, worker
    processes and sweeps load it instead of compiling. `flat` may update its first `mutated` inputs in
    place. The compiled function is checked against `flat` run eagerly on copies of `inputs` before it
    is used (`disagreement` of the updated inputs, then the outputs), unless the package's bytes passed
    that check before (`aot.vouched`, only with `vouching`: where `key` names all the code of the step,
    `aot.vouchable`): a loaded package that fails the
    check, or raises when called (another structure's inputs), is compiled again, and a step that the
    compiler got wrong is refused (ValueError), as any compile failure is. (The check runs on the values
    the graph was traced on, so it cannot see a forward that branches on its values in Python; vmap
    refuses such a forward in the eager step already.)"""
    def trace() -> torch.fx.GraphModule:  # imported here: a process that loads a package never traces
        from torch.fx.experimental.proxy_tensor import make_fx

        return make_fx(flat)(*copies())

    def copies() -> list[torch.Tensor]:
        return [t.clone() if i < mutated else t for i, t in enumerate(inputs)]

    def results(fn: Callable) -> tuple[torch.Tensor, ...]:
        args = copies()
        outputs = tuple(fn(*args))
        return (*args[:mutated], *outputs)

    with torch.no_grad():
        eager: tuple[torch.Tensor, ...] | None = None
        for fresh in (False, True):
            compiled, now = aot.load_or_compile(key, trace, copies(), fresh=fresh)
            if vouching and not now and aot.vouched(key, compiled):  # loaded from bytes that passed the check before
                break
            eager = results(flat) if eager is None else eager
            try:
                problem = disagreement(eager, results(compiled))
            except Exception:  # noqa: BLE001 - a loaded package that cannot run here is stale: compiled again
                if now:
                    raise
                problem = "it failed when called"
            if problem is None:
                if vouching:
                    aot.vouch(key, compiled)
                break
            if now:  # compiled just now and still wrong: refused
                raise ValueError(f"the traced step does not reproduce the eager one ({problem})")
    return compiled


def _disagreement(eager: Sequence[torch.Tensor], got: Sequence[torch.Tensor]) -> str | None:
    """What of the compiled gradient step's outputs (a gradient per parameter, then the metrics) differs
    from the eager step's (None: nothing)."""
    if len(got) != len(eager) or not _metrics_close(eager[-1], got[-1]):
        return "its metrics"
    if not _gradients_close(eager[:-1], got[:-1]):
        return "its gradients"
    return None


def _metrics_close(eager: torch.Tensor, got: torch.Tensor) -> bool:
    """The metrics rows (loss, accuracy, gradient norm[, z-loss]) within rounding of the eager ones; accuracy
    within 0.1, since a sample whose two top logits tie within rounding may flip and move it by 1/n (a
    batch refused for that would make the compile choice depend on which batch a process met first)."""
    if eager.shape != got.shape:
        return False
    rows = [r for r in range(len(eager)) if r != 1]
    return (torch.allclose(eager[rows], got[rows], rtol=1e-3, atol=1e-5, equal_nan=True)
            and torch.allclose(eager[1], got[1], rtol=0, atol=0.1, equal_nan=True))


def _gradients_close(eager: Sequence[torch.Tensor], got: Sequence[torch.Tensor]) -> bool:
    """Each compiled gradient within 1e-3 of the eager one relative to its norm, per run, give or take
    1e-6 of the run's whole gradient norm (a gradient that is zero in exact arithmetic, as attention's
    key bias, is rounding noise in both), and non-finite exactly where the eager one is. Sums taken in
    another order move single entries that cancel far more than that, never a whole tensor; a flipped
    or swapped gradient moves it by its norm."""
    if len(eager) != len(got) or any(e.shape != g.shape for e, g in zip(eager, got)):
        return False
    if not all(torch.equal(e.isfinite(), g.isfinite()) for e, g in zip(eager, got)):
        return False
    norms, errors = [], []
    for e, g in zip(eager, got):
        finite = e.isfinite()
        e, g = (torch.where(finite, t, 0).reshape(len(t), -1).double() for t in (e, g))
        norms.append(torch.linalg.vector_norm(e, dim=1))
        errors.append(torch.linalg.vector_norm(g - e, dim=1))
    whole = torch.linalg.vector_norm(torch.stack(norms), dim=0)  # (R,): each run's gradient norm
    return all(bool((error <= 1e-3 * norm + 1e-6 * whole).all()) for norm, error in zip(norms, errors))
