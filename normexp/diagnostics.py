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
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from normexp.config import ModelConfig, NormConfig, NormKind, RunConfig, Sweep, flatten, key_label
from normexp.engines.common import loss_and_acc, seeded_init, torch_threads
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


def fit_slope(depths: list[float], values: list[float]) -> float:
    """Least-squares slope of log(value) against log(depth)."""
    xs, ys = [math.log(v) for v in depths], [math.log(v) for v in values]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else math.nan


def layer_gradnorm_at_init(cfg: RunConfig) -> list[dict[str, float | int | str]]:
    """Transformer: one row per layer, the gradient norms of its attention's output projection and its
    FFN's fc2 weight after one full-batch forward and backward of the answer loss at init."""
    with torch_threads(cfg.train.threads):
        model, task = seeded_init(cfg)
        loss, _ = loss_and_acc(model(task.x), task.y, task.positions)
        loss.backward()
    return [{"placement": cfg.norm.placement, "kind": cfg.norm.kind, "depth": cfg.model.depth, "seed": cfg.seed,
             "layer": i + 1, "attn_out_grad": layer.attn.branch.out.weight.grad.norm().item(),
             "ffn_out_grad": layer.ffn.branch.fc2.weight.grad.norm().item(), "loss": loss.item()}
            for i, layer in enumerate(model.layers)]


GROWTH_FACTOR = 1.5  # last layer / first layer: above it "grows", below its inverse "shrinks", else "flat"
SUBLAYERS = {"attn_out_grad": "attention out", "ffn_out_grad": "FFN fc2"}


@dataclass(frozen=True)
class LayerGradnorm:
    """Per variant and sublayer: the gradient norm at each layer (mean, std over seeds), and the ratio
    of the variant's last layer's mean to its first's with its verdict (grows / flat / shrinks). With
    several depths each depth is a variant of its own (`post L=4`, `post L=8`); `layers` runs to the
    deepest, and a shallower variant's entries past its own depth are (nan, nan): it has no such layer."""

    layers: list[int]
    grads: dict[str, dict[str, list[tuple[float, float]]]]  # variant -> sublayer column -> [(mean, std)]
    seeds: int = 1  # the seeds each mean pools
    depths: tuple[int, ...] = ()  # the depths of the sweep, shallowest first (each its own variants if several)

    def _own(self, variant: str, column: str) -> list[tuple[float, float]]:
        """The variant's entries for the layers its model has."""
        return [entry for entry in self.grads[variant][column] if not math.isnan(entry[0])]

    def ratio(self, variant: str, column: str) -> float:
        stats = self._own(variant, column)
        return stats[-1][0] / stats[0][0] if stats and stats[0][0] > 0 else math.nan

    def verdict(self, variant: str, column: str) -> str:
        if len(self._own(variant, column)) < 2:  # last/first is 1 by construction
            return "no verdict: needs 2 layers or more"
        return growth_verdict(self.ratio(variant, column))


def growth_verdict(ratio: float) -> str:
    """'grows', 'shrinks' or 'flat' for a last-to-first layer ratio (GROWTH_FACTOR either way)."""
    if math.isnan(ratio):
        return "undefined"
    return "grows" if ratio > GROWTH_FACTOR else "shrinks" if ratio < 1 / GROWTH_FACTOR else "flat"


def summarise_layer_gradnorm(rows: list[dict]) -> LayerGradnorm:
    """Pool seeds per variant (rows' `variant`) and layer; with several depths, per variant and depth
    (`<variant> L=<depth>`), each over its own layers: no depth is left out."""
    depths = sorted({int(r["depth"]) for r in rows})
    layers = list(range(1, depths[-1] + 1))
    grads: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for variant in dict.fromkeys(r.get("variant", r["placement"]) for r in rows):
        for depth in depths:
            mine = [r for r in rows if r.get("variant", r["placement"]) == variant and int(r["depth"]) == depth]
            if not mine:
                continue
            name = f"{variant} L={depth}" if len(depths) > 1 else variant
            grads[name] = {}
            for column in SUBLAYERS:
                stats = []
                for layer in layers:
                    values = [r[column] for r in mine if r["layer"] == layer]
                    stats.append((statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan)
                                 if values else (math.nan, math.nan))
                grads[name][column] = stats
    return LayerGradnorm(layers, grads, len({r["seed"] for r in rows}), tuple(depths))


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


@dataclass(frozen=True)
class GradnormSummary:
    """Per placement: the last block's fc2 gradient at each depth (mean, std over seeds), the
    fitted log-log slope, and the hidden-state norms at the largest depth."""

    depths: list[int]
    last_grad: dict[str, list[tuple[float, float]]]  # placement -> [(mean, std)] per depth
    slopes: dict[str, float]
    stream_sq: dict[str, list[float]]  # placement -> ||x_l||^2/d per block, deepest model, mean over seeds
    norm_in_sq: dict[str, list[float]]  # placement -> ||u_l||^2/d entering each block's norm
    branch_gain: float | None  # c = E||F(x)||^2/d for unit-variance input, from the init; None if unknown
    seeds: int = 1  # the seeds each mean pools

    def measured_gain(self, placement: str) -> float:
        """c as the data show it: Post-LN, mean ||u||^2/d - 1; otherwise the per-block growth of ||x_l||^2/d."""
        if placement.split()[0] == "post":
            return statistics.fmean(v for v in self.norm_in_sq[placement] if not math.isnan(v)) - 1
        stream = self.stream_sq[placement]
        if len(stream) < 2:  # a growth per block needs two blocks
            return math.nan
        blocks = list(range(1, len(stream) + 1))
        mx, my = statistics.fmean(blocks), statistics.fmean(stream)
        return sum((b - mx) * (v - my) for b, v in zip(blocks, stream)) / sum((b - mx) ** 2 for b in blocks)


def branch_gain(model: ModelConfig) -> float | None:
    """E||F(x)||^2 / d of one FFN branch at init for E x_i^2 = 1: xavier weights (variance 2/(fan_in +
    fan_out)), zero biases, ReLU halving the second moment, hidden = m d: 2m / (1 + m)^2. Xiong et
    al.'s setting (weights N(0, 1/d), equal widths) gives 1/2, hence their 3/2 and 1 + l/2."""
    if model.init not in ("xavier_uniform", "xavier_normal"):
        return None
    m = model.hidden_mult
    return 2 * m / (1 + m) ** 2


def gradnorm_variant(cfg: RunConfig, keys: Sequence[str]) -> str:
    """The variant a gradnorm row belongs to: its placement, then `leaf=value` for each other grid axis
    in `keys` (depth and seed excepted), so that only seeds are ever pooled into one mean ± std."""
    flat = flatten(cfg)
    others = [k for k in keys if k not in ("norm.placement", "model.depth", "seed")]
    return " ".join([cfg.norm.placement, *(f"{key_label(k)}={json.dumps(flat[k])}" for k in others)])


def summarise_gradnorm(rows: list[dict], model: ModelConfig | None = None) -> GradnormSummary:
    """Per variant (rows' `variant`, or their placement where rows carry none) and depth: the mean and
    std over seeds of the last block's gradient; the fitted slope; the deepest model's hidden norms."""
    variant = [r.get("variant", r["placement"]) for r in rows]
    placements = list(dict.fromkeys(variant))
    depths = sorted({int(r["depth"]) for r in rows})
    last_grad, slopes, stream, norm_in = {}, {}, {}, {}
    for placement in placements:
        mine = [r for r, v in zip(rows, variant) if v == placement]
        stats = []
        for depth in depths:
            values = [r["fc2_grad"] for r in mine if r["depth"] == depth and r["block"] == depth]
            stats.append((statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan))
        last_grad[placement] = stats
        slopes[placement] = fit_slope([float(d) for d in depths], [m for m, _ in stats])
        deepest = [r for r in mine if r["depth"] == depths[-1]]
        blocks = sorted({r["block"] for r in deepest})
        stream[placement] = [statistics.fmean(r["stream_sq"] for r in deepest if r["block"] == b) for b in blocks]
        norm_in[placement] = [statistics.fmean(r["norm_in_sq"] for r in deepest if r["block"] == b) for b in blocks]
    return GradnormSummary(depths, last_grad, slopes, stream, norm_in, branch_gain(model) if model else None,
                           len({r["seed"] for r in rows}))


def gradnorm_study(spec: Sweep, target: Path) -> GradnormSummary | LayerGradnorm:
    """Measure every run of `spec` at init; write target/gradnorm.csv (one row per block, or per
    Transformer layer) and target/gradnorm.png, and return the summary."""
    from normexp.plot import gradnorm_figure, layer_gradnorm_figure

    keys = spec.varying_keys
    transformer = spec.runs[0].model.arch == "transformer"  # a sweep cannot mix the two: data.task differs
    measure = layer_gradnorm_at_init if transformer else gradnorm_at_init
    rows = [{**row, "variant": gradnorm_variant(cfg, keys)} for cfg in spec.runs for row in measure(cfg)]
    target.mkdir(parents=True, exist_ok=True)
    with open(target / "gradnorm.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    if transformer:
        layers = summarise_layer_gradnorm(rows)
        layer_gradnorm_figure(layers).savefig(target / "gradnorm.png", dpi=120)
        return layers
    models = {(cfg.model.init, cfg.model.hidden_mult): cfg.model for cfg in spec.runs}
    summary = summarise_gradnorm(rows, next(iter(models.values())) if len(models) == 1 else None)  # one init, or none
    gradnorm_figure(summary).savefig(target / "gradnorm.png", dpi=120)
    return summary
