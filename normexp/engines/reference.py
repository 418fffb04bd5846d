"""The reference engine: one run, the plain training loop, the definition of correct.

    torch.manual_seed(seed); model = Net(...); X, y = task    # the article's order of random draws
    for step in 0..S:
        X, y = the step's minibatch (the whole split without data.batch_size)
        loss = cross_entropy(model(X), y)                       # recorded: step, loss, acc, lr, grad_norm
        (loss + z_loss(model(X))).backward()                    # z term: train.z_loss > 0 only, recorded apart
        clip_grad_norm_(params, optim.clip_norm)                 # optim.clip_norm set only
        adaptive_clip_(params, grads, ...)                        # optim.agc set only (NFNets' AGC)
        set lr = optim.lr * lr_multiplier(step + 1); optimizer.step()   (not after step S)

The loop reports each recorded step through an optional callback and returns a `RunResult`; it prints
nothing. A non-finite loss is recorded as it is and marks the run diverged; with
`train.stop_on_nonfinite` (the default) the run stops there. With `train.stop_when` the run stops after
the step at which its rule (`EarlyStop`) fires, before that step's update. The held-out split (sequence
tasks) is scored at train.eval_every's steps, the last, and the step at which the run stops (`evaluates`).
With `train.log_blocks` a `BlockRecorder` (normexp/blocklog.py) also records each block's gradients, updates
and activations; with `train.log_sharpness` a `SharpnessRecorder` (normexp/sharpness.py) the Hessian's top
eigenvalues, from a forward of its own after the step's backward (the run's numbers are the same bits with
it or without).
"""

from __future__ import annotations

import functools
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
    evaluates,
    grad_norm,
    held_out,
    loss_and_acc,
    minibatches,
    seeded_init,
    share_wall_time,
    torch_threads,
    validate,
    validation_rows,
    z_loss,
)
from normexp.optim import (
    REPLAYED_OPTIMIZERS,
    StackedOptimizer,
    adaptive_clip_,
    agc_units,
    build_optimizer,
    step_lr,
)
from normexp.sharpness import SecondMoment, SharpnessRecorder


class ReferenceOptimizer:
    """One run's optimizer. Adam, AdamW and SGD: the batched engine's replay of torch's single-tensor
    update (`StackedOptimizer`, here a batch of one run) applied once to all parameters, which become
    views of one flat tensor. The update is element-wise, so the bits are torch.optim's, in about ten
    ops per step instead of ten per parameter tensor, and without importing torch.optim's compiler
    machinery (torch._dynamo, about a second). Other optimizers (RAdam): torch's own, per tensor, or the
    RAdam authors' (`OfficialRAdam`). Gradient clipping (optim.clip_norm, optim.agc) comes first."""

    def __init__(self, params: list[torch.nn.Parameter], cfg: RunConfig,
                 agc: list[int | str | None] | None = None) -> None:
        self.params, self.optim = params, cfg.optim
        self.clip_norm = cfg.optim.clip_norm
        self.agc = agc  # optim.agc: each parameter's unit (`agc_units`)
        device = params[0].device
        self.agc_factors = (torch.tensor([cfg.optim.agc or 0.0], device=device),
                            torch.tensor([cfg.optim.agc_eps], device=device))
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
        if self.clip_norm is not None:  # optim.clip_norm: the definition, torch's own
            torch.nn.utils.clip_grad_norm_(self.params, self.clip_norm)
        if self.agc is not None:  # optim.agc: the batched engine's function, on a batch of one run
            adaptive_clip_([p.unsqueeze(0) for p in self.params], [p.grad.unsqueeze(0) for p in self.params],
                           self.agc, *self.agc_factors)
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

    def second_moment(self) -> SecondMoment | None:
        """Adam, AdamW, RAdam: each parameter's second moment v (zeros before the first update) and the
        updates so far, as sharpness.py's preconditioner reads them; None for SGD."""
        if self.optim.name == "sgd":
            return None
        if self.replayed is not None:
            flat = self.replayed.state[0].get("exp_avg_sq", torch.zeros_like(self.flat))
            values = list(torch.split(flat, [p.numel() for p in self.params]))
            return SecondMoment([v.view_as(p) for v, p in zip(values, self.params)], self.replayed.steps,
                                self.optim.betas, self.optim.eps)
        states = [self.torch_optimizer.state.get(p, {}) for p in self.params]
        values = [s["exp_avg_sq"] if "exp_avg_sq" in s else torch.zeros_like(p) for p, s in zip(self.params, states)]
        updates = max((int(s["step"]) for s in states if "step" in s), default=0)
        return SecondMoment(values, updates, self.optim.betas, self.optim.eps)


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
        optimizer = ReferenceOptimizer(params, cfg, agc_units(model) if cfg.optim.agc is not None else None)
        blocks = BlockRecorder(model, cfg.train.log_every, positions=task.positions) if cfg.train.log_blocks else None
        every = cfg.train.log_sharpness
        sharpness = SharpnessRecorder(every) if every is not None else None
        steps = cfg.train.steps
        coef = cfg.train.z_loss
        for step in range(steps + 1):
            x, y = next(batches)
            val = held_out(model, task, cfg, step)  # before the training forward, whose activations blocks read
            # (a step at which the run stops is scored once the stop is known: `score_stop`)
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
                score_stop(result, model, task, cfg, step)
                break
            optimizer.zero_grad()
            (loss if z is None else loss + z).backward()
            result.record(step, loss_value, acc, lr, grad_norm(params), val, z_value)
            if logged:
                blocks.observe(step, [0], [True])
            if sharpness is not None and sharpness.due(step):  # after blocks: its own forward refills their hooks
                sharpness.observe(step, functools.partial(objective, model, x, y, task.positions, coef), params,
                                  lr, optimizer.second_moment())
            if result.check_early_stop(step, loss_value):  # train.stop_when: this step recorded whole, then stop
                score_stop(result, model, task, cfg, step)
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
        if sharpness is not None:
            result.sharpness = sharpness.rows()
    return share_wall_time([result], start)[0]


def score_stop(result: RunResult, model: torch.nn.Module, task: Task, cfg: RunConfig, step: int) -> None:
    """The held-out score of `step`, at which the run stops, into its last row where the schedule had not
    scored it (`evaluates`): after the step's forwards, whose activations blocks have read, and before any
    update, so on the weights the step's loss was taken on (the same bits as a score before its forward)."""
    if task.val_x is not None and not evaluates(cfg, step):
        result.score_stop(validate(model, task, validation_rows(cfg)))


def objective(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor | None,
              coef: float) -> torch.Tensor:
    """The training objective the loop differentiates: the cross-entropy, plus the z term with train.z_loss."""
    logits = model(x)
    loss = loss_and_acc(logits, y, positions)[0]
    return loss + z_loss(logits, positions, coef) if coef else loss
