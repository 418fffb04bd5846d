"""The normalization layers, and `NORM_CLASSES`: the only place a norm kind's name maps to a module.

All normalize over the last dimension. Formulas follow SPEC §3 and shared/seeds/001:

- `layernorm`      torch.nn.LayerNorm(d, eps): centre, divide by std, gain and bias (Ba et al. 2016).
- `rmsnorm`        weight * x / sqrt(mean(x^2) + eps), the article's own code, op for op, so that
                   normexp reproduces the article's losses bit for bit (Zhang & Sennrich 2019).
- `rmsnorm_torch`  torch.nn.RMSNorm(d, eps) (PyTorch >= 2.4).
- `rmsnorm_llama`  float32 x * rsqrt(mean(x^2) + eps), cast back to the input dtype, then * weight
                   (HF LlamaRMSNorm: the upcast keeps fp16 from overflowing at |x| > 256).
- `rmsnorm_gemma`  weight initialised to 0; float32 x * rsqrt(mean(x^2) + eps) * (1 + weight), then
                   cast back (HF GemmaRMSNorm: the weight multiplies before the cast).
- `prmsnorm`       partial RMSNorm: RMS from the first k = max(1, int(d * p)) features, eps added
                   outside the square root (Zhang & Sennrich 2019, section 4).
- `scalenorm`      g * x / max(||x||, eps), one scalar g = sqrt(d) at init (Nguyen & Salazar 2019).
- `dyt`            Dynamic Tanh, weight * tanh(alpha * x) + bias: no statistics at all, one learnable
                   scalar alpha (`norm.dyt_alpha0`, 0.5 by default; per site, as DyT's LLaMA runs set
                   it, `norm.dyt_alpha0_attn` / `_ffn` / `_final`), weight ones, bias zeros (none with
                   `norm.dyt_bias: false`) (Zhu et al., "Transformers without Normalization", CVPR 2025).
- `derf`           weight * erf(alpha * x + shift) + bias, learnable scalars alpha (`norm.derf_alpha0`,
                   0.5) and shift = 0 at init (Chen et al. 2025, "Stronger Normalization-Free Transformers").

None of them draws random numbers at init, so the choice of norm never shifts the model's random
initialisation (SPEC §1). `silence()` sets a norm's gain so that it outputs zeros at init (Swin V2's
res-post-norm init, `norm.output_norm_init: zeros`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from normexp.config import NormConfig
from normexp.registry import PluginError, is_plugin, load_plugin

T = TypeVar("T")


class RMSNorm(nn.Module):
    """The article's RMSNorm: weight * x / sqrt(mean(x^2) + eps)."""

    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x / x.pow(2).mean(-1, keepdim=True).add(self.eps).sqrt()


class LlamaRMSNorm(nn.Module):
    """RMSNorm computed in float32, cast back to the input dtype before the weight (LLaMA / HF)."""

    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.type_as(x)


class GemmaRMSNorm(nn.Module):
    """RMSNorm with a zero-initialised weight applied as (1 + weight), in float32 (Gemma / HF)."""

    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class PartialRMSNorm(nn.Module):
    """pRMSNorm: the RMS is estimated from the first k features; eps is added to the RMS itself."""

    def __init__(self, d: int, eps: float = 1e-5, fraction: float = 0.0625) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps
        self.k = max(1, int(d * fraction))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = x[..., : self.k].pow(2).mean(-1, keepdim=True).sqrt()
        return self.weight * x / (rms + self.eps)


class ScaleNorm(nn.Module):
    """ScaleNorm: one learned scalar g (sqrt(d) at init) times x / max(||x||_2, eps)."""

    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.tensor(math.sqrt(d)))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.g * x / x.norm(dim=-1, keepdim=True).clamp(min=self.eps)


class DyT(nn.Module):
    """Dynamic Tanh: weight * tanh(alpha * x) + bias, alpha one learnable scalar (Zhu et al. 2025)."""

    def __init__(self, d: int, alpha0: float = 0.5, bias: bool = True) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(float(alpha0)))
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.weight * torch.tanh(self.alpha * x)
        return y + self.bias if self.bias is not None else y


class Derf(nn.Module):
    """weight * erf(alpha * x + shift) + bias, alpha and shift learnable scalars (Chen et al. 2025)."""

    def __init__(self, d: int, alpha0: float = 0.5, shift0: float = 0.0) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(float(alpha0)))
        self.shift = nn.Parameter(torch.tensor(float(shift0)))
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * torch.erf(self.alpha * x + self.shift) + self.bias


def silence(norm: nn.Module) -> nn.Module:
    """Set `norm`'s gain so that it outputs zeros at init, whatever its input (every bias here starts
    at zero): Gemma's weight acts as (1 + weight), so -1; ScaleNorm's scalar g, 0; any other weight, 0."""
    with torch.no_grad():
        if isinstance(norm, GemmaRMSNorm):
            norm.weight.fill_(-1.0)
        elif isinstance(norm, ScaleNorm):
            norm.g.zero_()
        else:
            norm.weight.zero_()
    return norm


def dyt_alpha0(cfg: NormConfig, site: str | None) -> float:
    """DyT's initial alpha at `site` (attn, ffn, final; None: any other norm): the site's own key, else
    `norm.dyt_alpha0`."""
    own = getattr(cfg, f"dyt_alpha0_{site}") if site is not None else None
    return own if own is not None else cfg.dyt_alpha0


# The one mapping from a kind's name (normexp/registry.py's KINDS) to its module: (d, cfg, site) -> module.
NORM_CLASSES: dict[str, Callable[[int, NormConfig, str | None], nn.Module]] = {
    "layernorm": lambda d, cfg, site: nn.LayerNorm(d, eps=cfg.eps),
    "rmsnorm": lambda d, cfg, site: RMSNorm(d, cfg.eps),
    "rmsnorm_torch": lambda d, cfg, site: nn.RMSNorm(d, eps=cfg.eps),
    "rmsnorm_llama": lambda d, cfg, site: LlamaRMSNorm(d, cfg.eps),
    "rmsnorm_gemma": lambda d, cfg, site: GemmaRMSNorm(d, cfg.eps),
    "prmsnorm": lambda d, cfg, site: PartialRMSNorm(d, cfg.eps, cfg.prms_fraction),
    "scalenorm": lambda d, cfg, site: ScaleNorm(d, cfg.eps),
    "dyt": lambda d, cfg, site: DyT(d, dyt_alpha0(cfg, site), cfg.dyt_bias),
    "derf": lambda d, cfg, site: Derf(d, cfg.derf_alpha0),
}


def make_norm(d: int, cfg: NormConfig, site: str | None = None) -> nn.Module:
    """Build the norm `cfg.kind` over `d` features with `cfg.eps`; `site` (attn, ffn, final) picks
    DyT's per-site alpha0. A user's kind (`package.module:Kind`) is built as `Kind(d, eps)`."""
    if is_plugin(cfg.kind):
        return own_norm(cfg.kind, d, cfg.eps)
    if cfg.kind not in NORM_CLASSES:
        raise ValueError(f"unknown norm kind {cfg.kind!r}")
    return NORM_CLASSES[cfg.kind](d, cfg, site)


def drawing_nothing(make: Callable[[], T], what: str) -> T:
    """`make()`, a user's code building modules, refused (PluginError) if it drew from torch's generator:
    nothing normexp builds at init draws, or every later weight of the seed would move (SPEC §1)."""
    before = torch.random.get_rng_state()
    made = make()
    if not torch.equal(before, torch.random.get_rng_state()):
        raise PluginError(f"{what} drew random numbers at init, which it must not (give its parameters "
                          "constant values, e.g. ones and zeros)")
    return made


def own_norm(ref: str, d: int, eps: float) -> nn.Module:
    """A user's norm kind, `Kind(d, eps)`; it may draw no random number (every later weight of the seed
    would move, SPEC §1), and must be a module: either is a clear error, not a silent change."""
    module = drawing_nothing(lambda: load_plugin(ref)(d, eps), f"{ref}: a norm kind")
    if not isinstance(module, nn.Module):
        raise PluginError(f"{ref}({d}, {eps}) returned a {type(module).__name__}, not a torch.nn.Module")
    return module
