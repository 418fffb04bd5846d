"""Optimizers and learning-rate schedules (SPEC §4).

`lr_multiplier(step, schedule, total_steps)` is a pure function of the optimizer step; the training
loop sets each update's learning rate to `optim.lr * lr_multiplier(...)`. Steps count updates from 1:
update 1 is the first `optimizer.step()`. With W = warmup_steps and S = total updates:

    constant        1
    linear_warmup   s / W while s < W, then 1
    inverse_sqrt    s / W while s < W, then sqrt(W / s)  (Vaswani et al. 2017, normalised to peak 1)
    cosine          s / W while s < W, then min_ratio + (1 - min_ratio) * (1 + cos(pi * (s - W) / (S - W))) / 2
    wsd             epfml/schedules-and-scaling's wsd_schedule at i = s - 1 (`wsd_multiplier`): i / W + (1 - i / W)
                    / 100 while i < W, 1 until the last int(f S) updates (f = decay_fraction), which decay
                    from 1 towards min_lr_ratio in decay_shape

W = 0 means no warmup (inverse_sqrt then decays as 1 / sqrt(s)). The multiplier is exactly 1.0
whenever no warmup or decay applies, so a constant schedule leaves `optim.lr` untouched, bit for bit.

The optimizer controls (docs/configs.md, "Optimizer and schedule controls"; their sources in
docs/sources.md) live here too, each off by default: gradient clipping before the update
(`clip_grad_norms_` for optim.clip_norm, `adaptive_clip_` for optim.agc), Adam-2k's frozen updates and
GI-Adam's first second moment (`StackedOptimizer._adam`), AdamW's independent decay (`decoupled_rate`),
the RAdam authors' own class (`OfficialRAdam`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from normexp.config import OptimConfig, RunConfig, ScheduleConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer `cfg.name` with `cfg`'s hyper-parameters: torch's own implementations, and the RAdam
    authors' under `optim.radam_variant: official`."""
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.name == "radam" and cfg.radam_variant == "official":
        return OfficialRAdam(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.name == "radam":
        return torch.optim.RAdam(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    raise ValueError(f"unknown optimizer {cfg.name!r}")


class OfficialRAdam(torch.optim.Optimizer):
    """RAdam as its authors ship it: LiyuanLucasLiu/RAdam `radam/radam.py`, class `RAdam`, with its default
    `degenerated_to_sgd=False`, op for op (the deprecated `add_(scalar, tensor)` forms as `alpha=`). Both
    moments are updated at every step; with rho_max = 2 / (1 - beta2) - 1 and rho_t = rho_max - 2 t
    beta2^t / (1 - beta2^t), an update is taken only where rho_t >= 5: decoupled weight decay p -= lr wd
    p, then p -= lr r_t m / (sqrt(v) + eps) with r_t = sqrt((1 - beta2^t) (rho_t - 4) (rho_t - 2) rho_max
    / ((rho_max - 4) (rho_max - 2) rho_t)) / (1 - beta1^t). Below it the parameter is left as it is, where
    torch's RAdam (rho_t <= 5) steps by the bias-corrected momentum. The authors' per-step buffer caches
    rho_t and r_t across tensors: the same numbers, computed here for each."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad, state = p.grad, self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                state["step"] += 1
                step = state["step"]
                beta2_t = beta2 ** step
                n_sma_max = 2 / (1 - beta2) - 1
                n_sma = n_sma_max - 2 * step * beta2_t / (1 - beta2_t)
                if n_sma < 5:  # step_size = -1: no update, no decay
                    continue
                step_size = math.sqrt((1 - beta2_t) * (n_sma - 4) / (n_sma_max - 4) * (n_sma - 2) / n_sma
                                      * n_sma_max / (n_sma_max - 2)) / (1 - beta1 ** step)
                if group["weight_decay"] != 0:
                    p.add_(p, alpha=-group["weight_decay"] * group["lr"])
                denom = exp_avg_sq.sqrt().add_(group["eps"])
                p.addcdiv_(exp_avg, denom, value=-step_size * group["lr"])


def lr_multiplier(step: int, schedule: ScheduleConfig, total_steps: int) -> float:
    """The learning-rate multiplier of update `step` (1-based), as tabulated in the module docstring."""
    warmup = schedule.warmup_steps
    if schedule.kind == "constant":
        return 1.0
    if schedule.kind == "wsd":
        return wsd_multiplier(step - 1, schedule, total_steps)
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


WSD_INIT_DIV = 100  # wsd's warmup starts at 1 / 100 (epfml/schedules-and-scaling main.py: init_div_factor=1e2)


def wsd_multiplier(i: int, schedule: ScheduleConfig, n_iterations: int) -> float:
    """Warmup-stable-decay at iteration i (0-based: update i + 1, as torch's LambdaLR steps it after each
    update), epfml/schedules-and-scaling `src/optim/utils.py` `wsd_schedule` expression for expression, with
    n_warmup = warmup_steps, init_div_factor = 100, fract_decay = decay_fraction, final_lr_factor =
    min_lr_ratio and decay_type = decay_shape: the last int(fract_decay * n_iterations) iterations decay
    from 1 towards final_lr_factor (reached at i = n_iterations, after the last update)."""
    final, n_warmup = schedule.min_lr_ratio, schedule.warmup_steps
    n_anneal_steps = int(schedule.decay_fraction * n_iterations)
    n_hold = n_iterations - n_anneal_steps
    if i < n_warmup:
        return (i / n_warmup) + (1 - i / n_warmup) / WSD_INIT_DIV
    if i < n_hold:
        return 1.0
    if i >= n_iterations:
        return final
    progress = (i - n_hold) / n_anneal_steps
    linear = final + (1 - final) * (1 - progress)
    cosine = final + (1 - final) * (1 + math.cos(math.pi * (i - n_hold) / n_anneal_steps)) * 0.5  # pi * (i - h) first
    shapes = {"linear": linear, "exp": final ** progress, "cosine": cosine, "mirror_cosine": linear * 2 - cosine,
              "square": final + (1 - final) * (1 - progress ** 2),
              "sqrt": final + (1 - final) * (1 - math.sqrt(progress))}
    return shapes[schedule.decay_shape]


def step_lr(cfg: RunConfig, step: int) -> float:
    """The learning rate of the update that follows recorded step `step` (update `step + 1`)."""
    return cfg.optim.lr * lr_multiplier(step + 1, cfg.schedule, cfg.train.steps)


# ----------------------------------------------------------------------------- gradient clipping


def clip_grad_norms_(grads: Sequence[torch.Tensor], totals: torch.Tensor, max_norms: Sequence[float]) -> None:
    """`torch.nn.utils.clip_grad_norm_` run by run on stacked gradients (R, ...): each run's gradients
    times min(max_norm / (total + 1e-6), 1), with `totals` each run's global norm as clip_grad_norm_
    computes it (`engines/batched.py` `_grad_norms`). The same float32 operations: `max_norm / tensor`
    is `tensor.reciprocal() * max_norm` (`Tensor.__rtruediv__`), and every gradient is multiplied, by
    1.0 where the norm is under max_norm."""
    limit = torch.tensor(max_norms, dtype=totals.dtype, device=totals.device)
    coef = torch.clamp((totals + 1e-6).reciprocal() * limit, max=1.0)
    for grad in grads:
        grad.mul_(coef.view(-1, *([1] * (grad.dim() - 1))))



AGC_SKIPPED = "skipped"  # `agc_units`: a parameter AGC leaves alone
AGC_EXCLUDED = ("head.weight",)  # the final layer's weight: NFNets do not clip the classifier ("linear")


def agc_units(model: torch.nn.Module) -> list[int | str | None]:
    """For each parameter of `model` (in `parameters()` order), how `optim.agc` takes its unit-wise norm,
    as deepmind-research `nfnets/agc_optax.py` `unitwise_norm` does on Haiku's layout: None for a scalar
    or a vector (squeezed to at most one dimension: one norm over all of it); for a matrix, the dim of
    torch's layout that holds a unit's fan-in (Haiku's axis 0 of an (in, out) weight): 1 for a Linear's
    (out, in) weight, 0 for an Embedding's (vocab, d) table, which Haiku lays out alike; AGC_SKIPPED for
    the final layer's weight (experiment_nfnets.py gives the `linear` classifier's weights no clipping,
    its bias clipping as every other gain and bias)."""
    modules = dict(model.named_modules())
    units: list[int | str | None] = []
    for name, param in model.named_parameters():
        module = modules[name.rpartition(".")[0]]
        if name in AGC_EXCLUDED:
            units.append(AGC_SKIPPED)
        elif sum(size != 1 for size in param.shape) <= 1:
            units.append(None)
        elif param.dim() == 2:
            units.append(0 if isinstance(module, torch.nn.Embedding) else 1)
        else:
            raise ValueError(f"optim.agc: no unit-wise norm for parameter {name} of shape {tuple(param.shape)} "
                             "(agc_optax.py knows scalars, vectors and matrices here)")
    return units


@torch.no_grad()
def adaptive_clip_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], units: Sequence[int | str | None],
                   clip: torch.Tensor, eps: torch.Tensor) -> None:
    """Adaptive gradient clipping (Brock et al. 2021) of stacked runs, in place: `params` and `grads` (R, ...)
    in the reference's layout, `units` from `agc_units`, `clip` and `eps` (R,) float32, each run's
    `optim.agc` and `optim.agc_eps`. Per unit, as agc_optax.py `adaptive_grad_clip`: max_norm = clip *
    max(||W||, eps); the gradient kept where ||G|| < max_norm, else G * (max_norm / max(||G||, 1e-6))."""
    for param, grad, unit in zip(params, grads, units):
        if unit == AGC_SKIPPED:
            continue
        runs = (len(param), *([1] * (param.dim() - 1)))
        max_norm = clip.view(runs) * torch.maximum(_unitwise_norm(param, unit), eps.view(runs))
        grad_norm = _unitwise_norm(grad, unit)
        clipped = grad * (max_norm / torch.clamp(grad_norm, min=1e-6))
        grad.copy_(torch.where(grad_norm < max_norm, grad, clipped))


def _unitwise_norm(x: torch.Tensor, unit: int | None) -> torch.Tensor:
    """agc_optax.py `compute_norm`, sum(x ** 2) ** 0.5, per run of stacked `x` (R, ...): over all of a run's
    tensor (unit None, shaped (R, 1, ...)) or over its dim `unit` (kept). Summed from a contiguous copy, so
    that a transposed view sums in the order the reference's own layout does."""
    x = x.contiguous()
    if unit is None:
        return x.reshape(len(x), -1).square().sum(1).sqrt().view(len(x), *([1] * (x.dim() - 1)))
    return x.square().sum(1 + unit, keepdim=True).sqrt()


# ----------------------------------------------------------------------------- the exact engines' optimizers


REPLAYED_OPTIMIZERS = ("adam", "adamw", "sgd")  # per-run hyper-parameters inside one batch


def stacked_structure(optim: OptimConfig) -> tuple:
    """What the runs of one batch of the batched engine share of their optimizer (`StackedOptimizer`):
    its family, which gradient clipping acts, Adam-2k's k and GI-Adam's v0; its numbers (lr, betas, eps,
    weight decay and its independence, momentum, clipping thresholds) vary per run."""
    return (optim.name, optim.clip_norm is not None, optim.agc is not None, optim.v_only_steps, optim.v0)


class RunScalars:
    """One step's per-run hyper-parameters as float32 (R,) tensors, viewed as (R, 1, ...) on demand."""

    def __init__(self, **values: Sequence[float]) -> None:
        self._values = {name: torch.tensor(v, dtype=torch.float32) for name, v in values.items()}
        self._views: dict[tuple[str, int], torch.Tensor] = {}

    def __call__(self, name: str, like: torch.Tensor) -> torch.Tensor:
        key = (name, like.dim())
        if key not in self._views:
            self._views[key] = self._values[name].to(like.device).view(-1, *([1] * (like.dim() - 1)))
        return self._views[key]



class SharedOptimizer:
    """torch's own optimizer stepping the stacked tensors of runs with equal settings (one lr per step)."""

    def __init__(self, params: list[torch.Tensor], runs: Sequence[RunConfig]) -> None:
        self.optimizer = build_optimizer(params, runs[0].optim)

    def step(self, lrs: Sequence[float]) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lrs[0]
        self.optimizer.step()



def decoupled_rate(optim: OptimConfig) -> float:
    """AdamW's weight decay per unit of learning rate: weight_decay; with optim.independent_weight_decay,
    weight_decay / optim.lr, so that an update at lr_t decays by weight_decay * lr_t / lr, the schedule's
    multiplier and not the lr (google-deepmind/nanodo optimizer.py: `weight_decay / peak_learning_rate`
    handed to optax.adamw)."""
    return optim.weight_decay / optim.lr if optim.independent_weight_decay else optim.weight_decay


class StackedOptimizer:
    """torch's single-tensor Adam, AdamW and SGD, op for op, with per-run hyper-parameters.

    Scalars that torch casts to float32 become (R, 1, ...) float32 tensors; scalars that torch fuses
    into a multiply-add (`add(alpha=)`, `addcmul(value=)`) become `addcmul` with a tensor factor, the
    same fused multiply-add. Parameters are processed one stacked tensor at a time, which keeps each
    tensor's chain of element-wise ops in cache. Adam's controls: optim.v_only_steps and optim.v0 (shared
    by a batch, `stacked_structure`), optim.independent_weight_decay (per run, `decoupled_rate`)."""

    def __init__(self, params: list[torch.Tensor], runs: Sequence[RunConfig]) -> None:
        self.params, self.name, self.steps = params, runs[0].optim.name, 0
        self.optim = [cfg.optim for cfg in runs]
        # a batch shares these (`stacked_structure`): Adam-2k's frozen updates, GI-Adam's second moment
        self.v_only_steps, self.v0 = runs[0].optim.v_only_steps, runs[0].optim.v0
        self.decay = any(o.weight_decay != 0 for o in self.optim)  # torch skips weight decay at 0
        self.state: list[dict[str, torch.Tensor]] = [{} for _ in params]

    def step(self, lrs: Sequence[float]) -> None:
        self.steps += 1
        scalars = self._scalars(lrs)
        with torch.no_grad():
            for param, state in zip(self.params, self.state):
                if self.name == "sgd":
                    self._sgd(param, state, scalars)
                else:
                    self._adam(param, state, scalars)

    def _scalars(self, lrs: Sequence[float]) -> RunScalars:
        optim, step = self.optim, self.steps
        if self.name == "sgd":
            return RunScalars(neg_lr=[-lr for lr in lrs], decay=[o.weight_decay for o in optim],
                              momentum=[o.momentum for o in optim])
        return RunScalars(
            decay=[o.weight_decay for o in optim],
            decoupled=[1 - lr * decoupled_rate(o) for lr, o in zip(lrs, optim)],
            one_minus_beta1=[1 - o.betas[0] for o in optim],
            beta2=[o.betas[1] for o in optim],
            one_minus_beta2=[1 - o.betas[1] for o in optim],
            bias_correction2_sqrt=[(1 - o.betas[1] ** step) ** 0.5 for o in optim],
            eps=[o.eps for o in optim],
            neg_step_size=[-lr / (1 - o.betas[0] ** step) for lr, o in zip(lrs, optim)],
        )

    def _adam(self, param: torch.Tensor, state: dict[str, torch.Tensor], s: RunScalars) -> None:
        """torch's Adam and AdamW; optim.v_only_steps k: updates 1..k (Adam-2k's frozen ones, RAdam repo
        nmt/my_module/adam2.py under --adam-freeze) move the second moment only, neither the first moment
        nor the weights nor their decay, while the step count, hence both bias corrections, advances;
        optim.v0 grad_sq: the second moment starts at the first update's gradient squared (GI-Adam)."""
        grad = param.grad
        frozen = self.steps <= self.v_only_steps
        if self.decay and self.name == "adamw":
            if not frozen:
                param.mul_(s("decoupled", param))  # param.mul_(1 - lr * weight_decay)
        elif self.decay:
            grad = grad.addcmul(param, s("decay", param))  # grad.add(param, alpha=weight_decay)
        if not state:
            state["exp_avg"] = torch.zeros_like(param)
            state["exp_avg_sq"] = grad * grad if self.v0 == "grad_sq" else torch.zeros_like(param)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        if frozen:
            exp_avg_sq.mul_(s("beta2", param)).addcmul_(s("one_minus_beta2", param) * grad, grad)
            return
        exp_avg.lerp_(grad, s("one_minus_beta1", param).expand_as(param))
        exp_avg_sq.mul_(s("beta2", param)).addcmul_(s("one_minus_beta2", param) * grad, grad)
        denom = (exp_avg_sq.sqrt() / s("bias_correction2_sqrt", param)).add_(s("eps", param))
        param.add_(s("neg_step_size", param) * exp_avg / denom)  # addcdiv_: (value * exp_avg) / denom

    def _sgd(self, param: torch.Tensor, state: dict[str, torch.Tensor], s: RunScalars) -> None:
        grad = param.grad
        if self.decay:
            grad = grad.addcmul(param, s("decay", param))
        if all(o.momentum == 0 for o in self.optim):  # torch keeps no buffer then: the step is the gradient
            param.addcmul_(grad, s("neg_lr", param))  # param.add_(grad, alpha=-lr)
            return
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = grad.detach().clone()
        else:
            state["momentum_buffer"].mul_(s("momentum", param)).add_(grad)
        step = state["momentum_buffer"]
        if any(o.momentum == 0 for o in self.optim):  # those runs step by the gradient (0 * inf is no 0)
            step = torch.where(s("momentum", param) != 0, step, grad)
        param.addcmul_(step, s("neg_lr", param))  # param.add_(buf, alpha=-lr)
