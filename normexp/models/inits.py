"""T-Fixup's and Fixup's init (`model.init: tfixup`, `fixup`): each weight drawn xavier_uniform in the
article's order (normexp/models/ffn.py `make_linear`), then multiplied by its authors' factor, in place.

T-Fixup (Huang et al. 2020; layer6ai-labs/T-Fixup, `fairseq/modules/transformer_layer.py`
`TransformerDecoderLayer.fixup_initialization` and `fairseq/models/transformer.py` `TransformerDecoder`):

    f = (9 N)^(-1/4), N = model.depth        the decoder's factor: `(9 * de_layers) ** (- 1. / 4.)`
    fc1, fc2, out  *= f                      `temp_state_dic[name] = f * param`
    v              = f * (v * 2 ** 0.5)      v drawn, as fairseq's MultiheadAttention draws q, k and v,
                                             xavier_uniform with gain 1/sqrt(2) (`reset_parameters`);
                                             the sqrt(2) undoes that gain: v ends as xavier times f
    q, k           untouched (gain 1/sqrt(2), fairseq's)
    token embedding N(0, d^(-1/2)) (fairseq's `Embedding`), then * f (`embed_tokens`' state dict)

  normexp's Transformer is a decoder without cross-attention: the decoder's (9N)^(-1/4) is kept as the
  repository writes it, N its layer count (the encoder's 0.67 N^(-1/4) is for the encoder's layers).
  The FFN toy counts each of its N blocks as one decoder layer: f = (9N)^(-1/4) on fc1 and fc2 (the
  decoder's MLP weights); its head stays xavier (the paper's "Xavier for all parameters but the input
  embeddings"). Biases stay zero. Not carried over: fairseq's sqrt(d) scale of the token embeddings in
  the forward (normexp's Transformer has none) and its sinusoidal positions (normexp's learned
  positions keep their N(0, 0.02) init).

Fixup (Zhang et al. 2019; hongyi-zhang/Fixup, `fairseq/fairseq/models/transformer_zero.py` and
`fairseq/fairseq/modules/multihead_attention_zero.py`, the authors' Transformer, whose FFN sublayer is the
FFN toy's block; `cifar/models/fixup_resnet_cifar.py` for the ResNet), L the residual branches (FFN toy: N,
Transformer: 2N, one per sublayer; the authors' encoder-decoder counts 2 per encoder and 3 per decoder layer):

    fc1            *= 1 / sqrt(L)            `Linear(..., scale=1./math.sqrt(L))`: L^(-1/(2m-2)), m = 2
    fc2            *= 0                      `Linear(..., scale=0)`: the branch's last layer
    q, k, v        drawn xavier_uniform as one (3d, d) `in_proj_weight`, then *= L^(-1/6)
    out            *= 0                      `self.out_proj.weight.data *= 0.`
    head           zero weight and bias      the ResNet's `fc`: `constant_(m.weight, 0)`, `constant_(m.bias, 0)`;
                                             the Transformer's `embed_out.data.fill_(0)`, no bias
    token embedding N(0, d^(-1/2))           the authors' `Embedding`
    no bias on q, k, v, out, fc1, fc2        `bias=False`; the scalar biases (models/ffn.py `Shift`) and
                                             the multiplier (`Scale`, 1) take their place

The linears are drawn with a bias and then lose it, so that a run draws as many numbers as its
xavier_uniform twin: the task that follows the model's draws (random_labels) is the same for every init
of a seed.
"""

from __future__ import annotations

import math

import torch
from torch import nn

TFIXUP, FIXUP = "tfixup", "fixup"


def tfixup_factor(layers: int) -> float:
    """T-Fixup's decoder factor (9N)^(-1/4), as the repository writes it."""
    return (9 * layers) ** (- 1. / 4.)


def qkv_draw(init: str, d: int) -> dict[str, float]:
    """How `make_linear` draws q, k and v: T-Fixup's fairseq gain 1/sqrt(2); Fixup's fused (3d, d) matrix's
    fan-out; otherwise as every linear."""
    if init == TFIXUP:
        return {"gain": 1 / math.sqrt(2)}
    if init == FIXUP:
        return {"fan_out": 3 * d}
    return {}


def xavier_uniform_(weight: torch.Tensor, gain: float = 1.0, fan_out: int | None = None) -> None:
    """torch's xavier_uniform_, with the bound of a matrix `fan_out` rows tall where that is given
    (torch.nn.init's own arithmetic: std = gain sqrt(2 / (fan_in + fan_out)), bound sqrt(3) std)."""
    if fan_out is None:
        nn.init.xavier_uniform_(weight, gain=gain)
        return
    std = gain * math.sqrt(2.0 / float(weight.shape[1] + fan_out))
    bound = math.sqrt(3.0) * std
    with torch.no_grad():
        weight.uniform_(-bound, bound)


def token_std(init: str, d: int, default: float) -> float:
    """The token embedding's init std: fairseq's d^(-1/2) under T-Fixup and Fixup, else `default`."""
    return d ** -0.5 if init in (TFIXUP, FIXUP) else default


@torch.no_grad()
def rescale_embedding(init: str, layers: int, token: nn.Embedding) -> None:
    if init == TFIXUP:
        token.weight.mul_(tfixup_factor(layers))


@torch.no_grad()
def rescale_branch(init: str, branches: int, fc1: nn.Linear, fc2: nn.Linear, layers: int | None = None) -> None:
    """An FFN branch's fc1 and fc2: T-Fixup's factor of `layers` (default: `branches`), or Fixup's for
    `branches` residual branches (then without biases)."""
    if init == TFIXUP:
        factor = tfixup_factor(layers if layers is not None else branches)
        fc1.weight.mul_(factor)
        fc2.weight.mul_(factor)
    elif init == FIXUP:
        fc1.weight.mul_(1. / math.sqrt(branches))
        fc2.weight.mul_(0)
        drop_biases(fc1, fc2)


@torch.no_grad()
def rescale_attention(init: str, layers: int, q: nn.Linear, k: nn.Linear, v: nn.Linear, out: nn.Linear) -> None:
    """The attention's projections of a Transformer of `layers` layers (2 * layers residual branches)."""
    if init == TFIXUP:
        factor = tfixup_factor(layers)
        out.weight.mul_(factor)
        v.weight.mul_(2 ** 0.5).mul_(factor)
    elif init == FIXUP:
        for projection in (q, k, v):
            projection.weight.mul_(math.pow(2 * layers, -1. / 6.))
        out.weight.mul_(0.)
        drop_biases(q, k, v, out)


@torch.no_grad()
def zero_head(head: nn.Linear, bias: bool = True) -> None:
    """Fixup's classification layer: weight 0, and its bias 0 (`bias`) or none."""
    head.weight.fill_(0)
    if head.bias is not None:  # model.bias false: built without one
        head.bias.fill_(0)
    if not bias:
        drop_biases(head)


def drop_biases(*linears: nn.Linear) -> None:
    for linear in linears:
        linear.bias = None
