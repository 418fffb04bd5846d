"""Measurements that are not training runs: gradients at initialisation, norm properties, norm speed.

- `gradnorm_at_init(cfg)`: Xiong et al. 2020 (Theorem 1, Fig. 3, Lemma 2) on the toy model. At
  initialisation, one full-batch forward and backward of the cross-entropy, recording per block the
  Frobenius norm of the fc1/fc2 weight gradients, ||x_l||^2 / d of the residual stream entering the
  block, and ||u_l||^2 / d of the input to the block's norm (Post-LN: u = x + F(x)). Theory:
  Post-LN's last-block gradient does not depend on the depth L, Pre-LN's shrinks like 1/sqrt(L);
  ||u||^2/d ~ 3/2 entering each Post-LN norm, ||x_l||^2/d ~ 1 + l/2 along the Pre-LN stream.
- `layer_gradnorm_at_init(cfg)`: the same on the Transformer (Xiong et al.'s Fig. 3 proper): per
  layer, the gradient norm of each sublayer's output projection (attention's `out`, the FFN's fc2)
  at init, against the layer index. Xiong: growing with the layer index for Post-LN, flat for Pre-LN.
- `norm_properties()`: the numerical facts of shared/seeds/001 measured live, each with its
  expectation and a pass/fail.
- `norm_speed()`: forward and forward+backward time of LayerNorm and each RMSNorm kind.
"""

from __future__ import annotations

import csv
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from normexp.analysis.gradnorm import (
    GradnormSummary,
    LayerGradnorm,
    gradnorm_variant,
    summarise_gradnorm,
    summarise_layer_gradnorm,
)
from normexp.config import NormConfig, NormKind, RunConfig, Sweep
from normexp.engines.common import init_batch, loss_and_acc, seeded_init, torch_threads
from normexp.models.norms import GemmaRMSNorm, LlamaRMSNorm, make_norm

# ----------------------------------------------------------------------------- gradients at init


def gradnorm_at_init(cfg: RunConfig) -> list[dict[str, float | int | str]]:
    """One row per block: gradient norms of its fc1/fc2 weights and the hidden-state norms at init."""
    with torch_threads(cfg.train.threads):
        model, task = seeded_init(cfg)
    d = cfg.model.width
    stream, norm_in = {}, {}
    hooks = []
    for i, block in enumerate(model.blocks):
        hooks.append(block.register_forward_pre_hook(  # ResiDual's block takes (x_a, x_d): x_a is the stream
            lambda m, args, i=i: stream.__setitem__(i, _first(args[0]).detach())))
        if block.norm is not None:
            hooks.append(block.norm.register_forward_pre_hook(
                lambda m, args, i=i: norm_in.__setitem__(i, args[0].detach())))
    loss = F.cross_entropy(model(task.x), task.y)
    loss.backward()
    for hook in hooks:
        hook.remove()
    rows = []
    for i, block in enumerate(model.blocks):
        rows.append({
            "placement": cfg.norm.placement, "kind": cfg.norm.kind, "depth": cfg.model.depth, "seed": cfg.seed,
            "block": i + 1, "block_placement": block.placement,
            "fc1_grad": block.branch.fc1.weight.grad.norm().item(),
            "fc2_grad": block.branch.fc2.weight.grad.norm().item(),
            "stream_sq": _mean_sq(stream[i], d),
            "norm_in_sq": _mean_sq(norm_in[i], d) if i in norm_in else math.nan,
            "loss": loss.item(),
        })
    return rows


def _first(x: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    return x[0] if isinstance(x, tuple) else x


def _mean_sq(x: torch.Tensor, d: int) -> float:
    """E ||x||^2 / d over the batch."""
    return (x.pow(2).sum(-1) / d).mean().item()


def layer_gradnorm_at_init(cfg: RunConfig) -> list[dict[str, float | int | str]]:
    """Transformer: one row per layer, the gradient norms of its attention's output projection and its
    FFN's fc2 weight after one full-batch forward and backward of the answer loss at init (a text task:
    of its first minibatch)."""
    with torch_threads(cfg.train.threads):
        model, task = seeded_init(cfg)
        x, y = init_batch(cfg, task)  # a text task: its first minibatch
        loss, _ = loss_and_acc(model(x), y, task.positions)
        loss.backward()
    return [{"placement": cfg.norm.placement, "kind": cfg.norm.kind, "depth": cfg.model.depth, "seed": cfg.seed,
             "layer": i + 1, "attn_out_grad": layer.attn.branch.out.weight.grad.norm().item(),
             "ffn_out_grad": layer.ffn.branch.fc2.weight.grad.norm().item(), "loss": loss.item()}
            for i, layer in enumerate(model.layers)]


# ----------------------------------------------------------------------------- norm properties


@dataclass(frozen=True)
class Property:
    name: str
    measured: float | str
    expectation: str
    passed: bool
    article: str  # what shared/seeds/001 reports (PyTorch 2.2.2 / 2.14.1 on its machine)


def norm_properties(d: int = 4096, seed: int = 0) -> list[Property]:
    """The measurements of shared/seeds/001, made live on this machine."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, d, generator=gen)
    llama = LlamaRMSNorm(d, eps=1e-6)
    bias_free_ln = nn.LayerNorm(d, eps=1e-6, bias=False)
    out = []

    def add(name: str, measured: float | str, expectation: str, passed: bool, article: str = "") -> None:
        out.append(Property(name, measured, expectation, bool(passed), article))

    with torch.no_grad():
        scaled = (llama(5 * x) - llama(x)).abs().max().item()
        add("RMSNorm(5x) vs RMSNorm(x): max |diff|", scaled, "< 1e-5 (scale invariant)", scaled < 1e-5, "2.4e-06")
        shifted = (llama(x + 3) - llama(x)).abs().max().item()
        add("RMSNorm(x + 3) vs RMSNorm(x): max |diff|", shifted, "> 1 (not shift invariant)", shifted > 1, "3.89")
        centred = x - x.mean(-1, keepdim=True)
        zero_mean = (llama(centred) - bias_free_ln(centred)).abs().max().item()
        add("mean-0 input: RMSNorm vs bias-free LayerNorm", zero_mean, "< 1e-5 (equal)", zero_mean < 1e-5, "4.8e-07")
        mean3 = (llama(centred + 3) - bias_free_ln(centred + 3)).abs().max().item()
        add("mean-3 input: RMSNorm vs bias-free LayerNorm", mean3, "> 1 (different)", mean3 > 1, "3.87")
        ln_params = sum(p.numel() for p in nn.LayerNorm(d).parameters())
        rms_params = sum(p.numel() for p in nn.RMSNorm(d).parameters())
        add(f"parameters at d={d}: LayerNorm", ln_params, f"{2 * d} (weight + bias)", ln_params == 2 * d, "8192")
        add(f"parameters at d={d}: RMSNorm", rms_params, f"{d} (weight only)", rms_params == d, "4096")
        big = torch.full((1, d), 300.0, dtype=torch.float16)
        naive = RMSNormNoUpcast(d, eps=1e-6).half()(big)
        add("fp16 input of 300s, no float32 upcast: output", naive.float().abs().max().item(),
            "0.0 (300^2 overflows fp16)", torch.all(naive == 0).item(), "0.0")
        upcast = llama.half()(big)
        add("fp16 input of 300s, float32 upcast (LLaMA): output", upcast.float().min().item(), "1.0",
            torch.all(upcast == 1).item(), "1.0")
        default_eps = nn.RMSNorm(d).eps
        effective = _effective_eps(d)
        add("nn.RMSNorm(d).eps (default)", str(default_eps), "None", default_eps is None, "None")
        add("nn.RMSNorm default eps in effect (float32 input)", effective,
            f"torch.finfo(float32).eps = {torch.finfo(torch.float32).eps:.3g}",
            effective == torch.finfo(torch.float32).eps, "1.19e-07")
        small = 0.001 * torch.randn(8, d, generator=gen)
        eps_gap = (F.rms_norm(small, (d,)) - F.rms_norm(small, (d,), eps=1e-5)).abs().max().item()
        add("inputs ~0.001: eps=None vs eps=1e-5, max |diff|", eps_gap, "> 1 (eps matters)", eps_gap > 1, "2.51")
        weight = 0.1 * torch.randn(d, generator=gen)
        gemma, as_llama = GemmaRMSNorm(d, eps=1e-6), LlamaRMSNorm(d, eps=1e-6)
        gemma.weight.copy_(weight)
        as_llama.weight.copy_(weight)
        misread = (gemma(x) - as_llama(x)).abs().max().item()
        add("Gemma weights (std 0.1) read as LLaMA weights: max |diff|", misread, "> 1 (1 + weight differs)",
            misread > 1, "4.32")
        as_llama.weight.copy_(1 + weight)
        fixed = (gemma(x) - as_llama(x)).abs().max().item()
        add("... with 1 added to the stored weights: max |diff|", fixed, "< 1e-5 (equal)", fixed < 1e-5)
    return out


class RMSNormNoUpcast(LlamaRMSNorm):
    """LlamaRMSNorm without its float32 upcast: computed in the input dtype (what the upcast avoids)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _effective_eps(d: int) -> float:
    """Find the eps nn.RMSNorm uses by default: the candidate that reproduces its output exactly."""
    x = 1e-4 * torch.randn(4, d, generator=torch.Generator().manual_seed(1))  # small, so eps shows
    reference = nn.RMSNorm(d)(x)
    for candidate in (torch.finfo(torch.float32).eps, torch.finfo(torch.float16).eps, 1e-5, 1e-6, 1e-8):
        if torch.equal(F.rms_norm(x, (d,), reference.new_ones(d), eps=candidate), reference):
            return candidate
    return math.nan


# ----------------------------------------------------------------------------- norm speed


@dataclass(frozen=True)
class Timing:
    kind: str
    shape: tuple[int, ...]
    forward_ms: float
    backward_ms: float  # forward + backward


SPEED_KINDS: tuple[NormKind, ...] = ("layernorm", "rmsnorm", "rmsnorm_torch", "rmsnorm_llama", "rmsnorm_gemma",
                                     "prmsnorm", "scalenorm")


def _median_ms(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def time_norm(module: nn.Module, shape: tuple[int, ...], repeats: int) -> tuple[float, float]:
    x = torch.randn(*shape)
    with torch.no_grad():
        forward = _median_ms(lambda: module(x), repeats)
    xg = x.clone().requires_grad_()
    grad = torch.randn(*shape)

    def step() -> None:
        module.zero_grad(set_to_none=True)
        xg.grad = None
        module(xg).backward(grad)

    return forward, _median_ms(step, repeats)


def norm_speed(shapes: list[tuple[int, ...]], repeats: int = 5, compile_rmsnorm: bool = True) -> list[Timing]:
    """Median forward and forward+backward times of each norm kind at each shape."""
    out = []
    for shape in shapes:
        d = shape[-1]
        for kind in SPEED_KINDS:
            module = make_norm(d, NormConfig(kind=kind, eps=1e-6))
            out.append(Timing(kind, shape, *time_norm(module, shape, repeats)))
        if compile_rmsnorm:
            compiled = _compiled_rmsnorm(d)
            if compiled is not None:
                out.append(Timing("rmsnorm_llama (torch.compile)", shape, *time_norm(compiled, shape, repeats)))
    return out


def _compiled_rmsnorm(d: int) -> nn.Module | None:
    """torch.compile'd LLaMA RMSNorm, or None where compile does not work here (no compiler...)."""
    try:
        module = torch.compile(LlamaRMSNorm(d, eps=1e-6))
        module(torch.randn(2, d, requires_grad=True)).sum().backward()
        return module
    except Exception:  # noqa: BLE001 - compile needs a C++ toolchain; report its absence instead
        return None


# ----------------------------------------------------------------------------- the gradnorm study


CSV_NAMES = {"placement": "norm.placement", "kind": "norm.kind", "depth": "model.depth"}  # gradnorm.csv's columns


def gradnorm_study(spec: Sweep, target: Path) -> GradnormSummary | LayerGradnorm:
    """Measure every run of `spec` at init; write target/gradnorm.csv (one row per block, or per
    Transformer layer) and return the summary (`normexp.figures.save_gradnorm_plot` draws it)."""
    keys = spec.varying_keys
    transformer = spec.runs[0].model.arch == "transformer"  # a sweep cannot mix the two: data.task differs
    measure = layer_gradnorm_at_init if transformer else gradnorm_at_init
    rows = [{**row, "variant": gradnorm_variant(cfg, keys)} for cfg in spec.runs for row in measure(cfg)]
    target.mkdir(parents=True, exist_ok=True)
    with open(target / "gradnorm.csv", "w", newline="") as f:  # its columns named as the sweep names them
        writer = csv.DictWriter(f, fieldnames=[CSV_NAMES.get(k, k) for k in rows[0]], lineterminator="\n")
        writer.writeheader()
        writer.writerows({CSV_NAMES.get(k, k): v for k, v in row.items()} for row in rows)
    if transformer:
        return summarise_layer_gradnorm(rows)
    models = {(cfg.model.init, cfg.model.hidden_mult): cfg.model for cfg in spec.runs}
    return summarise_gradnorm(rows, next(iter(models.values())) if len(models) == 1 else None)  # one init, or none
