"""The article's toy model: N residual FFN blocks, a final norm and a linear head (SPEC §1-2).

    Net(depth N, width d):  x -> [input norm, Peri-LN only] -> N x Block -> final norm -> head -> logits
    Block:                  F(x) = fc2(relu(fc1(x))), fc1: d -> 4d, fc2: 4d -> d, wrapped in a residual

Where the norm sits is `Block.forward`, one line per placement:

    post      x = Norm(x + F(x))                     Transformer (Vaswani et al. 2017)
    pre       x = x + F(Norm(x))                     Xiong et al. 2020
    sandwich  x = x + Norm_out(F(Norm_in(x)))         CogView (Ding et al. 2021)
    peri      sandwich, plus a norm on the model input Peri-LN (Kim et al. 2025)
    deepnorm  x = Norm(alpha * x + F(x))              DeepNet (Wang et al. 2022), fc weights * beta
    mixln     post for the first round(f * N) blocks, pre after (Li et al. 2024)
    none      x = x + F(x)

Random draws happen in the article's order, so that the same seed gives the same weights bit for
bit: all norms (which draw nothing), then every fc1, then every fc2, then the final norm, then the
head; each Linear runs its default init before the xavier re-init, exactly as the article's code.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from normexp.config import Init, ModelConfig, NormConfig
from normexp.norms import make_norm


def make_linear(d_in: int, d_out: int, init: Init) -> nn.Linear:
    """nn.Linear with its default init, then re-initialised in place (weights xavier, biases zero)."""
    linear = nn.Linear(d_in, d_out)
    if init == "xavier_uniform":
        nn.init.xavier_uniform_(linear.weight)
        nn.init.zeros_(linear.bias)
    elif init == "xavier_normal":
        nn.init.xavier_normal_(linear.weight)
        nn.init.zeros_(linear.bias)
    return linear


def block_placements(depth: int, cfg: NormConfig) -> list[str]:
    """The placement of each block: Mix-LN resolves to post then pre, others are uniform."""
    if cfg.placement != "mixln":
        return [cfg.placement] * depth
    n_post = round(cfg.mixln_fraction * depth)
    return ["post"] * n_post + ["pre"] * (depth - n_post)


def deepnorm_constants(depth: int, cfg: NormConfig) -> tuple[float, float]:
    """DeepNet's (alpha, beta) for an N-block encoder: (2N)^(1/4), (8N)^(-1/4), unless overridden."""
    alpha = cfg.deepnorm_alpha if cfg.deepnorm_alpha is not None else (2 * depth) ** 0.25
    beta = cfg.deepnorm_beta if cfg.deepnorm_beta is not None else (8 * depth) ** -0.25
    return alpha, beta


class FFN(nn.Module):
    """The block's branch F(x) = fc2(relu(fc1(x)))."""

    def __init__(self, fc1: nn.Linear, fc2: nn.Linear) -> None:
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Block(nn.Module):
    """One residual block; `placement` says where its norm goes (see the module docstring)."""

    def __init__(self, placement: str, ffn: FFN, d: int, cfg: NormConfig, alpha: float = 1.0) -> None:
        super().__init__()
        self.placement = placement
        self.ffn = ffn
        self.norm = make_norm(d, cfg) if placement != "none" else None
        self.norm_out = make_norm(d, cfg) if placement in ("sandwich", "peri") else None
        self.alpha = alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.placement == "post":
            return self.norm(x + self.ffn(x))
        if self.placement == "pre":
            return x + self.ffn(self.norm(x))
        if self.placement in ("sandwich", "peri"):
            return x + self.norm_out(self.ffn(self.norm(x)))
        if self.placement == "deepnorm":
            return self.norm(self.alpha * x + self.ffn(x))
        return x + self.ffn(x)  # none

    def extra_repr(self) -> str:
        return f"placement={self.placement!r}" + (f", alpha={self.alpha:.4g}" if self.alpha != 1.0 else "")


class Net(nn.Module):
    """The toy residual network of SPEC §1, built from its model and norm config sections."""

    def __init__(self, model: ModelConfig, norm: NormConfig) -> None:
        super().__init__()
        d, hidden, depth = model.width, model.hidden_mult * model.width, model.depth
        placements = block_placements(depth, norm)
        alpha, beta = deepnorm_constants(depth, norm) if norm.placement == "deepnorm" else (1.0, 1.0)
        fc1 = [make_linear(d, hidden, model.init) for _ in range(depth)]
        fc2 = [make_linear(hidden, d, model.init) for _ in range(depth)]
        if beta != 1.0:
            with torch.no_grad():
                for linear in fc1 + fc2:
                    linear.weight.mul_(beta)
        peri_input = norm.placement == "peri" and norm.peri_input_norm
        self.input_norm = make_norm(d, norm) if peri_input else nn.Identity()
        self.blocks = nn.ModuleList(
            Block(p, FFN(a, b), d, norm, alpha) for p, a, b in zip(placements, fc1, fc2)
        )
        self.final_norm = make_norm(d, norm) if model.final_norm else nn.Identity()
        self.head = make_linear(d, model.n_classes, model.init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.input_norm(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))


def chance_loss(n_classes: int) -> float:
    """Cross-entropy of a uniform guess, ln(n_classes): 2.303 for the article's 10 classes."""
    return math.log(n_classes)
