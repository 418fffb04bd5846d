"""The fast engine's optimizer: Adam, AdamW, RAdam and SGD stepping R runs' stacked parameters at once, each
run with its own numbers; Adam's update as a pure function of per-run numbers (what a compiled step carries);
and `MadeAhead`, each step's numbers made a stretch of steps at a time."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

import torch

from normexp.config import OptimConfig
from normexp.optim import adaptive_clip_, clip_grad_norms_, decoupled_rate

MAX_STRETCHES = 16  # Adam: more stretches of equal learning rates than this, and a scratch pass is cheaper
AHEAD = 64  # steps whose learning rates (and compiled Adam numbers) a batch makes at once: `MadeAhead`

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
    the kernel (L2 into the gradient, or AdamW's decoupled shrink, at `decoupled_rate`: per run
    optim.independent_weight_decay). State starts at zero, which equals torch's first-step
    initialisation. A frozen run (`live` False) gets a zero gradient and a zero learning rate: its
    parameters stay as they are.

    The controls of normexp/optim.py, as the exact engines apply them: optim.clip_norm clips each run's
    gradients by its own global norm and threshold (`clip_grad_norms_`) before the update (a batch's runs
    all clip or none: `fast_key`), optim.agc each run's units by its own factor and eps (`adaptive_clip_`;
    `agc_units` are the reference model's units of each parameter, in `params`' order); Adam's
    optim.v_only_steps k (Adam-2k: updates 1..k move the second moment only, while the step count, hence
    both bias corrections, advances) and optim.v0 grad_sq (GI-Adam: the second moment starts at the first
    update's gradient squared), both shared by a batch; RAdam's optim.radam_variant official (the authors'
    radam.py, `OfficialRAdam`: no update at all while rho_t < 5, decay decoupled and only with an update)."""

    def __init__(self, name: str, optims: Sequence[OptimConfig], params: list[torch.Tensor],
                 agc_units: Sequence[int | str | None] | None = None) -> None:
        self.name, self.optims, self.params, self.t = name, list(optims), params, 0
        self.clip_norms = [o.clip_norm for o in optims] if optims[0].clip_norm is not None else None
        self.agc_units = agc_units if optims[0].agc is not None else None
        if optims[0].agc is not None and agc_units is None:
            raise ValueError("optim.agc: FastOptimizer needs each parameter's unit (agc_units)")
        self.v_only_steps, self.v0 = optims[0].v_only_steps, optims[0].v0  # a batch shares them: `fast_key`
        self.official = name == "radam" and optims[0].radam_variant == "official"  # and this
        self.decay = any(o.weight_decay != 0 for o in optims)  # torch skips weight decay at 0
        self.kernel_hypers = [(tuple(o.betas), o.eps) for o in optims]  # what the fused kernel takes as one
        slots = ("momentum",) if name == "sgd" else ("exp_avg", "exp_avg_sq")
        self.state = {slot: [torch.zeros_like(p) for p in params] for slot in slots}
        self.direction: list[torch.Tensor] | None = None  # Adam's scratch, made when first needed
        self._step = torch.zeros((), dtype=torch.float32, device=params[0].device)  # the fused kernel's t

    def values(self, values: Sequence[float]) -> torch.Tensor:
        """Per-run values as one float32 (R,) tensor on the parameters' device."""
        return torch.tensor(values, dtype=torch.float32, device=self._step.device)

    def per_run(self, values: Sequence[float]) -> list[torch.Tensor]:
        """(R,) values as one (R, 1, ...) view per parameter."""
        tensor = self.values(values)
        return [tensor.view(-1, *([1] * (p.dim() - 1))) for p in self.params]

    def step(self, grads: list[torch.Tensor], lrs: Sequence[float], live: Sequence[bool]) -> None:
        """One update: run r steps with learning rate lrs[r] if live[r]."""
        self.t += 1
        if self.clip_norms is not None:  # before the frozen runs' gradients are zeroed: each run's own norm
            with torch.no_grad():
                clip_grad_norms_(grads, run_norms(grads), self.clip_norms)
        if self.agc_units is not None:
            adaptive_clip_(self.params, grads, self.agc_units, self.values([o.agc for o in self.optims]),
                           self.values([o.agc_eps for o in self.optims]))
        if not all(live):
            alive = self.per_run([float(a) for a in live])
            grads = [torch.where(a > 0, g, 0.0) for g, a in zip(grads, alive)]
            lrs = [lr if a else 0.0 for lr, a in zip(lrs, live)]
        with torch.no_grad():
            if self.decay and self.name != "adamw" and not self.official:  # L2: grad + weight_decay * param
                torch._foreach_addcmul_(grads, self.params, self.per_run([o.weight_decay for o in self.optims]))
            if self.name in ("adam", "adamw"):
                self._adam(grads, lrs)
            elif self.name == "radam":
                self._radam(grads, lrs)
            else:
                self._sgd(grads, lrs)

    def _adam(self, grads: list[torch.Tensor], lrs: Sequence[float]) -> None:
        exp_avg_sq = self.state["exp_avg_sq"]
        if self.t == 1 and self.v0 == "grad_sq":  # GI-Adam: v0 = g0^2, so the first update's v is g0^2 too
            for v, grad in zip(exp_avg_sq, grads):
                v.copy_(grad * grad)
        if self.t <= self.v_only_steps:  # Adam-2k's frozen update: v = beta2 v + (1 - beta2) g^2, nothing else
            torch._foreach_mul_(exp_avg_sq, self.per_run([o.betas[1] for o in self.optims]))
            weighted = torch._foreach_mul(grads, self.per_run([1 - o.betas[1] for o in self.optims]))
            torch._foreach_addcmul_(exp_avg_sq, weighted, grads)
            return
        if self.decay and self.name == "adamw":  # decoupled: param * (1 - lr * weight_decay), or weight_decay / lr
            shrink = [1 - lr * decoupled_rate(o) for lr, o in zip(lrs, self.optims)]
            torch._foreach_mul_(self.params, self.per_run(shrink))
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
        rect, plain = zip(*(radam_rectification(x.betas[1], t, self.official) for x in o))
        if self.official and self.decay:  # the authors' decoupled decay, only where they update
            shrink = [1 - lr * x.weight_decay if r else 1.0 for lr, r, x in zip(lrs, rect, o)]
            torch._foreach_mul_(self.params, self.per_run(shrink))
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


def run_norms(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each run's global gradient L2 norm (R,) over its stacked gradients (R, ...), as clip_grad_norm_ takes
    it: each tensor's norm, then the norm of those."""
    per_tensor = [torch.linalg.vector_norm(g.reshape(len(g), -1), dim=1) for g in grads]
    return torch.linalg.vector_norm(torch.stack(per_tensor, dim=1), dim=1)


def stretches(keys: Sequence[Hashable]) -> list[tuple[int, int, Hashable]]:
    """Maximal stretches [start, stop) of consecutive runs with equal keys: (start, stop, key)."""
    found: list[tuple[int, int, Hashable]] = []
    for r, key in enumerate(keys):
        if found and found[-1][2] == key:
            found[-1] = (found[-1][0], r + 1, key)
        else:
            found.append((r, r + 1, key))
    return found


def radam_rectification(beta2: float, t: int, official: bool = False) -> tuple[float, float]:
    """RAdam's (rect, plain) at update t (Liu et al. 2020, as torch computes it): the adaptive step
    weighted by `rect` once the variance is tractable (rho_t > 5), else the plain momentum step; with
    `official` (optim.radam_variant, `OfficialRAdam`: the authors' radam.py) rectified where rho_t >= 5 and
    else no step at all, (0, 0)."""
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * t * beta2**t / (1 - beta2**t)
    if rho_t > 5.0 or (official and rho_t >= 5.0):
        return math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)), 0.0
    return 0.0, 0.0 if official else 1.0

HYPERS = ("step_size", "decay", "l2", "1-beta1", "beta2", "1-beta2", "eps", "bias_correction2_sqrt", "live")  # its rows


def adam_hypers(optims: Sequence[OptimConfig], name: str, t: int, lrs: Sequence[float],
                live: Sequence[bool]) -> torch.Tensor:
    """`adam_update`'s per-run numbers for update `t` (1, 2, ...) at learning rates `lrs`: a (len(HYPERS), R)
    tensor. Bias corrections, step sizes and 1 - beta are computed in double, as torch computes them (1 - beta2
    in float32 is 1e-5 off at beta2 = 0.999);
    AdamW's decay is decoupled (param * (1 - lr * decoupled_rate)), Adam's is L2 (grad + weight_decay * param)."""
    decoupled = name == "adamw"
    rows = []
    for o, lr, alive in zip(optims, lrs, live):
        beta1, beta2 = o.betas
        rows.append((lr / (1 - beta1**t), 1 - lr * decoupled_rate(o) if decoupled else 1.0,
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


def adam_update_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, hyper: torch.Tensor) -> None:
    """`adam_update` written into p, m and v in place (what a compiled step traces: each tensor's update one
    pass over it, its gradient and moments)."""
    for tensor, new in zip((p, m, v), adam_update(p, g, m, v, hyper)):
        tensor.copy_(new)


def adam_move(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, hyper: torch.Tensor) -> torch.Tensor:
    """p after the step that the updated moments m, v make (AdamW's decay first); a run not live keeps p."""
    step_size, decay, _, _, _, _, eps, bc2_sqrt, live = _per_run(hyper, p)
    return torch.where(live > 0, p * decay - step_size * m / (v.sqrt() / bc2_sqrt + eps), p)
