"""The article's toy model: N residual FFN blocks, a final norm and a linear head (SPEC §1-2).

    Net(depth N, width d):  x -> [input norm, Peri-LN only] -> N x Block -> final norm -> head -> logits
    Block:                  F(x) = fc2(relu(fc1(x))), fc1: d -> 4d, fc2: 4d -> d, wrapped in a residual

Where the norm sits is `Block.forward`, one line per placement:

    post      x = Norm(x + F(x))                     Transformer (Vaswani et al. 2017)
    pre       x = x + F(Norm(x))                     Xiong et al. 2020
    sandwich  x = x + Norm_out(F(Norm_in(x)))         CogView (Ding et al. 2021)
    peri      sandwich, plus a norm on the model input Peri-LN (Kim et al. 2025)
    deepnorm  x = Norm(alpha * x + F(x))              DeepNet (Wang et al. 2022), fc weights * beta;
                                                     alpha = M^(1/4), beta = (4M)^(-1/4) for M residual
                                                     sublayers: M = N blocks here
    mixln     post for the first floor(f * N) blocks, pre after (Li et al. 2024)
    none      x = x + F(x)
    rezero    x = x + a * F(x)                        ReZero (Bachlechner et al. 2020): a scalar a, 0 at
                                                     init, and no norm in the block
    respost   x = x + Norm(F(x))                      res-post-norm: Swin V2 (Liu et al. 2022), OLMo 2
    resdual   x_a = Norm(x_a + F(x_a)), x_d = x_d + F(x_a); output x_a + Norm_d(x_d), no final norm
                                                     ResiDual (Xie et al. 2023); x_d starts as the
                                                     first block's input, as x_a does
    admin     x = Norm(w * x + F(x)), w per channel, profiled at init (Liu et al. 2020, Admin)

Admin's w is set by `Net.profile_at_init` on the run's own training data, after the model and the data
are drawn (SPEC §1's order), with no random draw, as Transformer-Clinic profiles: one forward, block by
block, where block i runs with w_i = r (r = 1 before the first block) and then r <- sqrt(Var[w_i * x_i]
+ Var[F_i(x_i)]), x_i the block's input and Var the population variance over every entry
(`profile_admin`; `norm.admin_profile: closed_form` gives normexp's earlier sqrt(1 + sum_{j<i} Var F_j)).

Random draws happen in the article's order, so that the same seed gives the same weights bit for
bit: all norms (which draw nothing), then every fc1, then every fc2, then the final norm, then the
head; each Linear runs its default init before the xavier re-init, exactly as the article's code.
`model.init: tfixup` and `fixup` rescale those draws (normexp/models/inits.py); Fixup's block is
`FixupFFN`, its branch with scalar biases and a multiplier, and its head comes after a scalar bias.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from normexp.config import Init, ModelConfig, NormConfig, mixln_post_count
from normexp.models.inits import FIXUP, rescale_branch, xavier_uniform_, zero_head
from normexp.models.norms import drawing_nothing, make_norm, silence
from normexp.registry import is_plugin, load_plugin


def make_linear(d_in: int, d_out: int, init: Init, gain: float = 1.0, fan_out: int | None = None,
                bias: bool = True) -> nn.Linear:
    """nn.Linear with its default init, then re-initialised in place (weights xavier, biases zero). T-Fixup
    and Fixup draw xavier_uniform too, some with a `gain` or a fused `fan_out` (normexp/models/inits.py).
    `torch_default` keeps the default, and so does `gpt2`, which the Transformer draws after building every
    layer, in nanoGPT's order (models/transformer.py `gpt2_init`). `bias` False: none (`model.bias`)."""
    linear = nn.Linear(d_in, d_out, bias=bias)
    if init in ("xavier_uniform", "tfixup", "fixup"):
        xavier_uniform_(linear.weight, gain, fan_out)
    elif init == "xavier_normal":
        nn.init.xavier_normal_(linear.weight)
    else:  # torch_default, gpt2
        return linear
    if bias:
        nn.init.zeros_(linear.bias)
    return linear


def block_placements(depth: int, cfg: NormConfig) -> list[str]:
    """The placement of each block: Mix-LN resolves to post then pre, others are uniform."""
    if cfg.placement != "mixln":
        return [cfg.placement] * depth
    n_post = mixln_post_count(depth, cfg.mixln_fraction)
    return ["post"] * n_post + ["pre"] * (depth - n_post)


def deepnorm_constants(sublayers: int, cfg: NormConfig) -> tuple[float, float]:
    """DeepNet's (alpha, beta) for M residual sublayers (torchscale: a decoder-only layer has 2, so
    N layers give (2N)^(1/4), (8N)^(-1/4)): M^(1/4) and (4M)^(-1/4), unless overridden."""
    alpha = cfg.deepnorm_alpha if cfg.deepnorm_alpha is not None else sublayers ** 0.25
    beta = cfg.deepnorm_beta if cfg.deepnorm_beta is not None else (4 * sublayers) ** -0.25
    return alpha, beta


# model.activation: the FFN's nonlinearity (gelu: the exact, erf one, nanoGPT's nn.GELU())
ACTIVATIONS = {"relu": torch.relu, "gelu": F.gelu}


class FFN(nn.Module):
    """The block's branch F(x) = fc2(act(fc1(x))), act ReLU (the article's) or GELU (`model.activation`)."""

    def __init__(self, fc1: nn.Linear, fc2: nn.Linear, activation: str = "relu") -> None:
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(ACTIVATIONS[self.activation](self.fc1(x)))


Streams = tuple[torch.Tensor, torch.Tensor]  # ResiDual's (x_a, x_d)


class Scale(nn.Module):
    """A learnable element-wise scale, weight * x: ReZero's scalar (shape ()) or Admin's per-channel
    vector (shape (d,)). Filled with a constant, so it draws no random numbers."""

    def __init__(self, shape: tuple[int, ...], value: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full(shape, float(value)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x


class Shift(nn.Module):
    """Fixup's learnable scalar bias, x + b, b = 0 at init (the authors' ResNet adds it; transformer_zero.py's
    LayerShift subtracts it: the same model, b's sign aside, bit for bit)."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias


class FixupFFN(FFN):
    """Fixup's branch (Zhang et al. 2019), as the authors' transformer_zero.py FFN sublayer: a scalar bias
    before fc1, before the ReLU and before fc2 (`shift2`, `shift3`, `shift4`), a scalar multiplier after
    fc2 (`scale2`); fc1 and fc2 have no bias (normexp/models/inits.py)."""

    def __init__(self, fc1: nn.Linear, fc2: nn.Linear, activation: str = "relu") -> None:
        super().__init__(fc1, fc2, activation)
        self.shift_in, self.shift_act, self.shift_out = Shift(), Shift(), Shift()
        self.scale = Scale((), 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = ACTIVATIONS[self.activation]
        return self.scale(self.fc2(self.shift_out(act(self.shift_act(self.fc1(self.shift_in(x)))))))


def make_ffn(fc1: nn.Linear, fc2: nn.Linear, init: Init, activation: str = "relu") -> FFN:
    return FixupFFN(fc1, fc2, activation) if init == FIXUP else FFN(fc1, fc2, activation)


def make_head(head: nn.Linear, init: Init, bias: bool = True) -> nn.Module:
    """The output layer. Under Fixup zeroed, after a scalar bias: the ResNet's `fc(x + bias2)`, with its
    bias; the Transformer's `shift0` then `F.linear(x, embed_out)`, without (`bias` False)."""
    if init != FIXUP:
        return head
    zero_head(head, bias)
    return nn.Sequential(Shift(), head)


def _block_norm(placement: str, d: int, cfg: NormConfig, site: str) -> nn.Module | None:
    """The block's main norm: none for `none` and `rezero`; respost's may start silenced (Swin V2)."""
    if placement in ("none", "rezero"):
        return None
    norm = make_norm(d, cfg, site)
    return silence(norm) if placement == "respost" and cfg.output_norm_init == "zeros" else norm


class Block(nn.Module):
    """One residual block; `placement` says where its norm goes (see the module docstring)."""

    def __init__(self, placement: str, branch: nn.Module, d: int, cfg: NormConfig, alpha: float = 1.0,
                 site: str = "ffn") -> None:
        super().__init__()
        self.placement = placement
        self.branch = branch  # F: the FFN here; the Transformer's sublayers are Blocks of attention or FFN
        self.norm = _block_norm(placement, d, cfg, site)
        self.norm_out = make_norm(d, cfg, site) if placement in ("sandwich", "peri") else None
        self.alpha = alpha
        if placement == "rezero":
            self.gate = Scale((), 0.0)  # the official code's `resweight`: one scalar per block
        if placement == "admin":
            self.omega = Scale((d,), 1.0)  # set by Net.profile_at_init
        self.own = load_plugin(placement) if is_plugin(placement) else None  # a user's placement
        if self.own is not None:
            self.norm = None  # it builds the modules it uses, and only those (each needs its gradient)
            build_own(self, lambda: make_norm(d, cfg, site))

    def forward(self, x: torch.Tensor | Streams) -> torch.Tensor | Streams:
        """x -> x; for `resdual`, the pair of streams (x_a, x_d) -> (x_a, x_d)."""
        if self.own is not None:  # a user's placement: its own one line (docs/extending.md)
            return self.own.forward(self, x)
        if self.placement == "rezero":  # Bachlechner et al. 2020, "ReZero is All You Need"
            return x + self.gate(self.branch(x))
        if self.placement == "respost":  # Liu et al. 2022, Swin Transformer V2; OLMo 2 (2024)
            return x + self.norm(self.branch(x))
        if self.placement == "admin":  # Liu et al. 2020, "Understanding the Difficulty of Training Transformers"
            return self.norm(self.omega(x) + self.branch(x))
        if self.placement == "resdual":  # Xie et al. 2023, ResiDual: Post-LN stream and raw-branch stream
            branch = self.branch(x[0])
            return self.norm(x[0] + branch), x[1] + branch
        if self.placement == "post":
            return self.norm(x + self.branch(x))
        if self.placement == "pre":
            return x + self.branch(self.norm(x))
        if self.placement in ("sandwich", "peri"):
            return x + self.norm_out(self.branch(self.norm(x)))
        if self.placement == "deepnorm":
            return self.norm(self.alpha * x + self.branch(x))
        return x + self.branch(x)  # none

    def extra_repr(self) -> str:
        return f"placement={self.placement!r}" + (f", alpha={self.alpha:.4g}" if self.alpha != 1.0 else "")


def build_own(block: Block, norm: Callable[[], nn.Module]) -> None:
    """A user's placement's `build(block, norm)`, if it has one: it adds the modules its forward uses
    (`norm()` builds one of the run's kind at this site). Like every init here it may draw no random
    number, or each later weight of the seed would move (SPEC §1)."""
    if hasattr(block.own, "build"):
        drawing_nothing(lambda: block.own.build(block, norm), f"{block.placement}: a placement's build()")


def residual_stack(blocks: Iterable[nn.Module], x: torch.Tensor, dual_norm: nn.Module | None,
                   dual_start: str = "input") -> torch.Tensor:
    """x through `blocks` in order. With ResiDual's `dual_norm` the blocks carry the pair of streams
    (x_a, x_d), x_d starting as x (`dual_start` input, the authors' `res = x`) or at 0 (zeros) and
    summing the raw branch outputs, and the result is x_a + Norm_d(x_d)."""
    if dual_norm is not None:
        x = (x, x if dual_start == "input" else torch.zeros_like(x))
    for block in blocks:
        x = block(x)
    return x if dual_norm is None else x[0] + dual_norm(x[1])


class Net(nn.Module):
    """The toy residual network of SPEC §1, built from its model and norm config sections."""

    def __init__(self, model: ModelConfig, norm: NormConfig) -> None:
        super().__init__()
        d, hidden, depth = model.width, model.hidden_mult * model.width, model.depth
        placements = block_placements(depth, norm)
        sublayers = depth if norm.deepnorm_count == "sublayers" else 2 * depth  # a block is one sublayer
        alpha, beta = deepnorm_constants(sublayers, norm) if norm.placement == "deepnorm" else (1.0, 1.0)
        fc1 = [make_linear(d, hidden, model.init) for _ in range(depth)]
        fc2 = [make_linear(hidden, d, model.init) for _ in range(depth)]
        if beta != 1.0:
            with torch.no_grad():
                for linear in fc1 + fc2:
                    linear.weight.mul_(beta)
        for a, b in zip(fc1, fc2):  # T-Fixup: each block a decoder layer; Fixup: each a branch (models/inits.py)
            rescale_branch(model.init, depth, a, b)
        peri_input = norm.placement == "peri" and norm.peri_input_norm
        self.input_norm = make_norm(d, norm) if peri_input else nn.Identity()
        self.blocks = nn.ModuleList(
            Block(p, make_ffn(a, b, model.init), d, norm, alpha, site="ffn") for p, a, b in zip(placements, fc1, fc2)
        )
        self.final_norm = make_norm(d, norm, "final") if has_final_norm(model, norm) else nn.Identity()
        self.head = make_head(make_linear(d, model.n_classes, model.init), model.init)
        self.dual_norm = make_norm(d, norm) if norm.placement == "resdual" else None  # ResiDual's Norm_d
        self.dual_start = norm.resdual_stream
        self.admin_profile = norm.admin_profile

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.readout(residual_stack(self.blocks, self.input_norm(x), self.dual_norm, self.dual_start))

    def readout(self, stream: torch.Tensor) -> torch.Tensor:
        """The model after its blocks: the final norm, then the head (the fast engine compiles it apart from
        the blocks: engines/fast/blockwise.py)."""
        return self.head(self.final_norm(stream))

    @torch.no_grad()
    def profile_at_init(self, x: torch.Tensor) -> None:
        """Admin's profiling on the training inputs `x` (see `profile_admin`)."""
        profile_admin(list(self.blocks), self.input_norm(x), self.admin_profile)


def has_final_norm(model: ModelConfig, norm: NormConfig) -> bool:
    """Whether the model ends with `model.final_norm`: ResiDual's output x_a + Norm_d(x_d) has no norm
    after it (Xie et al.), unless `norm.resdual_final_norm` (normexp's earlier reading)."""
    return model.final_norm and (norm.placement != "resdual" or norm.resdual_final_norm)


@torch.no_grad()
def profile_admin(blocks: list[Block], h: torch.Tensor, how: str = "measured") -> None:
    """Admin's profiling (Liu et al. 2020) on `h`, the first block's input. `measured`, as
    Transformer-Clinic's `adaptive-profiling` does it: one forward, block by block; block i runs with
    w_i = r (r = 1 before the first block), after which r <- sqrt(Var[w_i * x_i] + Var[F_i(x_i)]),
    x_i the block's input, Var the population variance over every entry (numpy's `var`).
    `closed_form`: one forward with every w = 1 records Var[F_j] per block, then
    w_i = sqrt(1 + sum_{j<i} Var[F_j]) (unit-variance inputs assumed). Blocks of other placements: nothing."""
    if not all(block.placement == "admin" for block in blocks):
        return
    if how == "measured":
        ratio = 1.0
        for block in blocks:
            block.omega.weight.fill_(ratio)
            branch = block.branch(h)
            ratio = math.sqrt(block.omega(h).var(unbiased=False).item() + branch.var(unbiased=False).item())
            h = block.norm(block.omega(h) + branch)
        return
    variances = []
    for block in blocks:
        variances.append(block.branch(h).var().item())
        h = block(h)
    total = 0.0
    for block, variance in zip(blocks, variances):
        block.omega.weight.fill_(math.sqrt(1.0 + total))
        total += variance


def chance_loss(n_classes: int) -> float:
    """Cross-entropy of a uniform guess, ln(n_classes): 2.303 for the article's 10 classes."""
    return math.log(n_classes)
