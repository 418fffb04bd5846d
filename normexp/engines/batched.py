"""The batched engine: many runs of one shape trained together as one stacked computation.

A sweep is many small runs, and one run of the toy model spends most of its time in per-op overhead.
Runs that share everything but their seed, learning rate, optimizer hyper-parameters and schedule
(see `batch_key`) are stacked along a leading run axis R and trained with the same number of ops:

- Each run's model is built exactly as the reference builds it (`Net` under its own seed), then its
  parameters are stacked: a Linear's weight becomes (R, in, out) (stored transposed) and runs as
  `torch.baddbmm`; a norm's weight becomes (R, 1, d) and broadcasts through the norm's own
  forward(). `Block.forward` and
  `Net.forward` are reused unchanged, so a placement is defined in one place only.
- The optimizer replays torch's single-tensor Adam / AdamW / SGD op by op, with each run's
  hyper-parameters as (R, 1, ...) float32 tensors. Where torch fuses a scalar into a multiply-add
  (`add(alpha=)`, `addcmul(value=)`), the batched step uses `addcmul` with a tensor factor, which is the
  same fused multiply-add, so every update is bit-identical to the reference's. Gradient clipping
  (`optim.clip_norm`) scales each run's gradients by its own global norm, with clip_grad_norm_'s float32
  operations; adaptive clipping (`optim.agc`) runs the reference's own function on the stacked tensors,
  in the reference's layout. Other optimizers
  (RAdam) batch only runs with equal optimizer and schedule settings, and step torch's own optimizer
  on the stacked tensors: its update is element-wise, so stacking changes no bit either.
- Two things are computed run by run, because their CPU kernels do not give the same bits on a
  stacked tensor: LayerNorm's backward (its per-thread reductions) and each run's loss
  (cross-entropy's mean). Everything else, LayerNorm's forward included, is stacked.

On the CPU this makes every recorded loss equal, bit for bit, to the reference engine's (tests check
this for every placement, norm kind and optimizer family), and a run's numbers do not depend on which
runs share its batch or how a grid is chunked. A run that no other run can share a batch with
trains on the reference engine (a batch of one gains nothing).

With `train.log_blocks` the same `BlockRecorder` as the reference's watches the stacked model and
writes each run's blocks.csv, bit for bit the reference's (every quantity is taken run by run).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from normexp.blocklog import BlockRecorder
from normexp.config import RunConfig
from normexp.engines.common import EarlyStop, RunResult, record_live, seeded_init, share_wall_time, torch_threads
from normexp.models.ffn import Net
from normexp.optim import (
    REPLAYED_OPTIMIZERS,
    SharedOptimizer,
    StackedOptimizer,
    adaptive_clip_,
    agc_units,
    clip_grad_norms_,
    stacked_structure,
    step_lr,
)
from normexp.registry import stackable

CHUNK_BYTES = 2**30  # memory budget of one chunk of runs: parameters, optimizer state, activations
MAX_CHUNK = 64  # larger batches gain little here and hold more activations


def batch_key(cfg: RunConfig) -> tuple:
    """Runs with equal keys train in one batch: same model, norm, data and steps, and the same
    optimizer structure (Adam, AdamW, SGD: `StackedOptimizer`, `stacked_structure`) or else the same
    optimizer and schedule settings (torch's own optimizer on the stacked tensors)."""
    optim = stacked_structure(cfg.optim) if cfg.optim.name in REPLAYED_OPTIMIZERS else (cfg.optim, cfg.schedule)
    return (cfg.model, cfg.norm, cfg.data, optim, cfg.train)


def bytes_per_run(cfg: RunConfig) -> int:
    """A generous estimate of one run's memory in a batch (float32)."""
    d, h, depth = cfg.model.width, cfg.model.width * cfg.model.hidden_mult, cfg.model.depth
    params = depth * (2 * d * h + h + 3 * d) + d * cfg.model.n_classes
    activations = cfg.data.n_samples * depth * (2 * h + 6 * d)
    return 4 * (5 * params + 2 * activations)


def chunk_size(cfg: RunConfig) -> int:
    return max(1, min(MAX_CHUNK, CHUNK_BYTES // bytes_per_run(cfg)))


# ----------------------------------------------------------------------------- the stacked model


class StackedLinear(nn.Module):
    """R Linear layers as one, x (R, n, in) -> (R, n, out), with F.linear's bits run by run.

    Where this machine's BLAS gives F.linear's bits for the shape (`stacks_exactly`: `bmm`), one
    baddbmm(bias, x, W^T), the weights stored transposed as `weight_t` (R, in, out) so that neither
    pass copies a transposed view. Elsewhere (MKL on an AVX2 CPU takes another kernel for outputs
    narrower than 16 in its batched product: the head of a 10-class model) F.linear run by run on
    `weight` (R, out, in), the reference's own call on the reference's own layout. A Linear without a bias
    (Fixup's) runs F.linear run by run too (the probe checks baddbmm with a bias)."""

    def __init__(self, layers: Sequence[nn.Linear], rows: int) -> None:
        super().__init__()
        out_features, in_features = layers[0].weight.shape
        biased = layers[0].bias is not None
        self.bmm = biased and stacks_exactly(rows, in_features, out_features)
        weights = torch.stack([layer.weight.detach().t() if self.bmm else layer.weight.detach() for layer in layers])
        if self.bmm:
            self.weight_t = nn.Parameter(weights.contiguous())
        else:
            self.weight = nn.Parameter(weights.contiguous())
        self.bias = nn.Parameter(torch.stack([layer.bias.detach() for layer in layers])) if biased else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bmm:
            return torch.baddbmm(self.bias.unsqueeze(1), x, self.weight_t)
        return torch.stack([F.linear(x[r], self.weight[r], None if self.bias is None else self.bias[r])
                            for r in range(len(x))])


_STACKS_EXACTLY: dict[tuple[int, int, int, int], bool] = {}
PROBE_RUNS = (2, 3)  # stack sizes probed: a pair and an odd count
PROBE_ELEMENTS = 4096  # each compared tensor is drawn until it has at least this many elements
PROBE_DRAWS = (1, 64)  # the fewest and the most draws per stack size


def stacks_exactly(rows: int, in_features: int, out_features: int) -> bool:
    """Whether baddbmm over runs gives F.linear's bits at this shape and thread count, forward and
    backward, on this machine. BLAS libraries pick kernels by shape and CPU, and a batched product may
    take another kernel than a single one. Another kernel sums in another order, which changes a
    result only for some values: at a small shape (3 inputs, 1 output) most draws agree. So the
    probe errs toward "not exact": it draws values whose magnitudes spread over 2^-12..2^12 (any
    change of summation order then shows in nearly every element), for two stack sizes, until each
    compared tensor has had PROBE_ELEMENTS elements, and one differing bit in any of them says "not
    exact" (the engine then calls F.linear run by run: exact, only slower). Measured once per
    process and shape."""
    key = (rows, in_features, out_features, torch.get_num_threads())
    if key not in _STACKS_EXACTLY:
        generator = torch.Generator().manual_seed(0)
        _STACKS_EXACTLY[key] = all(
            _stacked_equals_single(runs, rows, in_features, out_features, generator)
            for runs in PROBE_RUNS for _ in range(_draws(runs, rows, in_features, out_features)))
    return _STACKS_EXACTLY[key]


def _draws(runs: int, rows: int, in_features: int, out_features: int) -> int:
    """Draws enough for PROBE_ELEMENTS elements of the smallest product compared (output, d x, d w)."""
    smallest = runs * min(rows * out_features, rows * in_features, out_features * in_features)
    low, high = PROBE_DRAWS
    return max(low, min(high, math.ceil(PROBE_ELEMENTS / smallest)))


def _spread(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Normal values scaled by powers of two from 2^-12 to 2^12: sums of them depend on their order."""
    scale = torch.exp2(torch.randint(-12, 13, shape, generator=generator).float())
    return torch.randn(*shape, generator=generator) * scale


def _stacked_equals_single(runs: int, rows: int, in_features: int, out_features: int,
                           generator: torch.Generator) -> bool:
    """One draw: baddbmm's output and gradients equal F.linear's, run by run, bit for bit."""
    x, w, b, g = (_spread(shape, generator) for shape in
                  ((runs, rows, in_features), (runs, out_features, in_features), (runs, out_features),
                   (runs, rows, out_features)))
    single = [_linear_and_grads(lambda x, w, b: F.linear(x, w, b), x[r], w[r], b[r], g[r]) for r in range(runs)]
    stacked = _linear_and_grads(lambda x, w_t, b: torch.baddbmm(b.unsqueeze(1), x, w_t),
                                x, w.transpose(1, 2).contiguous(), b, g)
    stacked[2] = stacked[2].transpose(1, 2)  # d weight_t -> d weight
    return all(torch.equal(torch.stack([one[i] for one in single]), stacked[i]) for i in range(4))


def _linear_and_grads(linear, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    """[output, d x, d w, d b] of `linear(x, w, b)` under the output gradient g."""
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    with torch.enable_grad():
        out = linear(x, w, b)
        return [out.detach(), *torch.autograd.grad(out, (x, w, b), g)]


class StackedLayerNorm(nn.Module):
    """R LayerNorms over (R, n, d), bit-identical to R calls of F.layer_norm (see `_StackedLayerNormFn`)."""

    def __init__(self, layers: Sequence[nn.LayerNorm]) -> None:
        super().__init__()
        self.eps = layers[0].eps
        self.weight = nn.Parameter(torch.stack([layer.weight.detach() for layer in layers]))
        self.bias = nn.Parameter(torch.stack([layer.bias.detach() for layer in layers]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _StackedLayerNormFn.apply(x, self.weight, self.bias, self.eps)


class _StackedLayerNormFn(torch.autograd.Function):
    """LayerNorm with per-run weight and bias, matching the native CPU kernel bit for bit.

    Forward, stacked: the native kernel without affine gives y0 = fma(x, rstd, -rstd * mean) row by
    row (rows are independent, so stacking changes nothing), and its affine step is one more fused
    multiply-add, fma(y0, weight, bias): exactly `addcmul`. Backward, run by run: the native kernel
    sums dweight and dbias in per-thread buffers over each run's rows, an order no stacked op repeats."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        y0, mean, rstd = torch.native_layer_norm(x, [x.shape[-1]], None, None, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return torch.addcmul(bias.unsqueeze(1), y0, weight.unsqueeze(1))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        x, weight, bias, mean, rstd = ctx.saved_tensors
        grad = grad.contiguous()
        # the functional op run by run, then one stack per gradient: its `.out` form is a wrapper that
        # computes the same and copies each output in place, three more operations a run (about 7% of a
        # depth-32 LayerNorm batch's step, measured at 14 runs)
        per_run = [torch.ops.aten.native_layer_norm_backward(grad[r], x[r], [x.shape[-1]], mean[r], rstd[r],
                                                             weight[r], bias[r], [True, True, True])
                   for r in range(x.shape[0])]
        grad_x, grad_weight, grad_bias = (torch.stack(parts) for parts in zip(*per_run))
        return grad_x, grad_weight, grad_bias, None


class StackedTorchRMSNorm(nn.Module):
    """R torch.nn.RMSNorm: F.rms_norm without weight, then each run's weight (bit-equal to the fused op)."""

    def __init__(self, layers: Sequence[nn.RMSNorm]) -> None:
        super().__init__()
        self.shape, self.eps = layers[0].normalized_shape, layers[0].eps
        self.weight = nn.Parameter(torch.stack([layer.weight.detach() for layer in layers]).unsqueeze(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.shape, None, self.eps) * self.weight


def stack_broadcasting(layers: Sequence[nn.Module]) -> nn.Module:
    """A norm whose forward() broadcasts its parameters (normexp's own RMSNorm family, ScaleNorm):
    the same module with each parameter stacked to (R, 1, ...), so one forward() serves R runs."""
    stacked = copy.deepcopy(layers[0])
    for name, param in layers[0].named_parameters():
        values = torch.stack([dict(layer.named_parameters())[name].detach() for layer in layers])
        # (d,) -> (R, 1, d) and () -> (R, 1, 1): broadcasts against activations (R, n, d)
        setattr(stacked, name, nn.Parameter(values.view(len(layers), *([1] * (2 - param.dim())), *param.shape)))
    return stacked


def stack_module(layers: Sequence[nn.Module], rows: int) -> nn.Module:
    """Stack R copies of one layer (same class, same shape) into a module that takes (R, rows, ...)."""
    first = layers[0]
    if isinstance(first, nn.Linear):
        return StackedLinear(layers, rows)
    if isinstance(first, nn.LayerNorm):
        return StackedLayerNorm(layers)
    if isinstance(first, nn.RMSNorm):
        return StackedTorchRMSNorm(layers)
    return stack_broadcasting(layers)


def stack_nets(nets: Sequence[Net], rows: int) -> Net:
    """One Net whose leaf layers hold the parameters of all `nets`, stacked along a run axis, for
    inputs of `rows` samples per run."""
    stacked = copy.deepcopy(nets[0])
    for name, module in nets[0].named_modules():
        if name and not list(module.children()) and list(module.parameters()):
            parent, _, leaf = name.rpartition(".")
            owner = stacked.get_submodule(parent) if parent else stacked
            setattr(owner, leaf, stack_module([net.get_submodule(name) for net in nets], rows))
    return stacked


# ----------------------------------------------------------------------------- the stacked optimizer


# ----------------------------------------------------------------------------- the loop


def train_batch(runs: Sequence[RunConfig], device: str = "cpu",
                on_step: Callable[[int], None] | None = None) -> list[RunResult]:
    """Train `runs` (equal `batch_key`) together; one RunResult per run, as `train_run` would return.
    `on_step` is called after each recorded step that goes on (`--engine auto` times the steps)."""
    start = time.perf_counter()
    first = runs[0]
    if first.train.log_sharpness is not None:  # plan_batches leaves these to the reference engine
        raise ValueError("train.log_sharpness: the batched engine does not measure sharpness; use the reference")
    with torch_threads(first.train.threads) as threads:
        nets, xs, ys = [], [], []
        for cfg in runs:  # each run's draws exactly as the reference makes them
            net, task = seeded_init(cfg)
            nets.append(net)
            xs.append(task.x)
            ys.append(task.y)
        model = stack_nets(nets, len(xs[0])).to(device)
        x, y = torch.stack(xs).to(device), torch.stack(ys).to(device)
        params = list(model.parameters())
        agc = _Agc(nets[0], model, runs) if first.optim.agc is not None else None
        replayed = first.optim.name in REPLAYED_OPTIMIZERS
        optimizer = StackedOptimizer(params, runs) if replayed else SharedOptimizer(params, runs)
        results = [RunResult(threads=threads, engine="batched", early_stop=EarlyStop.of(cfg)) for cfg in runs]
        blocks = (BlockRecorder(model, first.train.log_every, len(runs), stacked=True)
                  if first.train.log_blocks else None)
        live = [True] * len(runs)  # runs still recording
        steps = first.train.steps
        for step in range(steps + 1):
            logits = model(x)
            losses = torch.stack([F.cross_entropy(logits[r], y[r]) for r in range(len(runs))])
            loss_values = losses.tolist()
            accs = (logits.argmax(-1) == y).float().mean(-1).tolist()
            lrs = [step_lr(cfg, step) for cfg in runs]
            for param in params:
                param.grad = None
            losses.sum().backward()
            totals = _grad_norms(model)
            recording = [r for r in range(len(runs)) if live[r]]
            record_live(results, live, step, loss_values, accs, lrs, totals.tolist(), first.train.stop_on_nonfinite)
            logged = blocks is not None and blocks.due(step)
            if logged:  # a run that stops here has no gradients in the reference: it skips backward
                blocks.observe(step, recording, [live[r] or results[r].stopped_at == step for r in recording],
                               [live[r] for r in recording])  # a run stopped early here takes no update
            if not any(live):
                break
            if on_step is not None:
                on_step(step)
            if step < steps:
                if first.optim.clip_norm is not None:  # each run's global norm, as clip_grad_norm_
                    clip_grad_norms_([p.grad for p in params], totals, [cfg.optim.clip_norm for cfg in runs])
                if agc is not None:
                    agc.clip_()
                optimizer.step(lrs)
                if logged:
                    blocks.observe_update()
        if blocks is not None:
            blocks.close()
            for r, result in enumerate(results):
                result.blocks = blocks.rows(r)
    return share_wall_time(results, start)


class _Agc:
    """optim.agc on the stacked model: each parameter in the reference's layout (a `weight_t` transposed
    back, a view), its unit from the reference's own model (`agc_units`), each run's factor and eps."""

    def __init__(self, net: Net, model: nn.Module, runs: Sequence[RunConfig]) -> None:
        self.units = agc_units(net)
        self.params = [(param, name.endswith("weight_t")) for name, param in model.named_parameters()]
        assert len(self.params) == len(self.units)
        self.clip = torch.tensor([cfg.optim.agc for cfg in runs], device=self.params[0][0].device)
        self.eps = torch.tensor([cfg.optim.agc_eps for cfg in runs], device=self.params[0][0].device)

    def clip_(self) -> None:
        layout = [(p.transpose(1, 2), p.grad.transpose(1, 2)) if t else (p, p.grad) for p, t in self.params]
        adaptive_clip_([p for p, _ in layout], [g for _, g in layout], self.units, self.clip, self.eps)


def _grad_norms(model: nn.Module) -> torch.Tensor:
    """Each run's global gradient L2 norm (R,), as the reference (and clip_grad_norm_) computes it: per
    tensor (in the reference's memory order, hence the transpose back), then over the tensors."""
    per_tensor = []
    for name, param in model.named_parameters():
        grad = param.grad.transpose(1, 2) if name.endswith("weight_t") else param.grad
        per_tensor.append(torch.linalg.vector_norm(grad.flatten(1), dim=1))
    return torch.linalg.vector_norm(torch.stack(per_tensor, dim=1), dim=1)


def plan_batches(runs: Sequence[RunConfig]) -> tuple[list[list[RunConfig]], list[RunConfig]]:
    """Group runs into batches, chunked to bound memory, and list the runs left to the reference
    engine: groups of one (a batch of one gains nothing), every Transformer run (this engine stacks
    the FFN toy only; the reference gives a Transformer run its exact bits), every run of a user's
    placement or kind that does not say `stackable = True`, and every run with `train.log_sharpness`
    (measured by the reference engine only, normexp/sharpness.py)."""
    groups: dict[tuple, list[RunConfig]] = {}
    def stacks(cfg: RunConfig) -> bool:  # a user's placement or kind stacks only if it says it may
        return (cfg.model.arch == "ffn" and stackable(cfg.norm.placement) and stackable(cfg.norm.kind)
                and cfg.train.log_sharpness is None)

    alone = [cfg for cfg in runs if not stacks(cfg)]
    for cfg in runs:
        if stacks(cfg):
            groups.setdefault(batch_key(cfg), []).append(cfg)
    batches = []
    for group in groups.values():
        if len(group) == 1:
            alone += group
            continue
        size = chunk_size(group[0])
        batches += [group[i:i + size] for i in range(0, len(group), size)]
    return batches, alone
