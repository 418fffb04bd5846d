"""A tiny causal Transformer decoder (`model.arch: transformer`), built from the FFN toy's own `Block`.

    tokens (n, T) -> token + learned position embedding -> [input norm, Peri-LN only]
                  -> N x Layer -> final norm -> head -> logits (n, T, vocab)
    Layer:  x -> Block(placement, attention) -> Block(placement, FFN)

- Each sublayer is a `Block` of normexp/models/ffn.py with the run's placement, so every placement is
  applied per sublayer exactly as `Block.forward` defines it (Post-LN: x = Norm(x + Attn(x));
  x = Norm(x + FFN(x)); Pre-LN: x = x + Attn(Norm(x)); ...), with no second definition. Mix-LN picks
  the placement per layer (both sublayers alike); ResiDual's (x_a, x_d) streams pass through every
  sublayer, both starting at the embedding, Norm_d at the end; Admin profiles every sublayer in order.
- ReZero (Bachlechner et al. 2020, the authors' RZTXEncoderLayer): one gate per layer, shared by its
  attention and FFN sublayers (`norm.rezero_gate: sublayer` gives each sublayer its own).
- B2T (Takase et al. 2023, "B2T Connection") is the one layer-level placement: Post-LN sublayers plus
  a skip from the layer's input to its last norm, `h = Norm(x + Attn(x)); out = Norm(x + h + FFN(h))`;
  as the authors' layer does (`rescaling_init`), every weight of the layer but the norms' (q, k, v,
  out, fc1, fc2) is multiplied by N^(-1/2) at init (`norm.b2t_rescale: false`: not).
- DeepNorm for a decoder of N layers (Wang et al. 2022): alpha = (2N)^(1/4), and beta = (8N)^(-1/4)
  scales the FFN's weights and the attention's value and output projections (not queries and keys).
- Attention is written out (scores, causal mask, softmax) so that torch.func's vmap (the fast
  engine) sees plain tensor ops. Its logits q.k / sqrt(d_head), before the mask, pass through an
  identity module (`CausalSelfAttention.logits`) that block logging hooks (normexp/blocklog.py).
- qk-norm (`model.qk_norm`, Wortsman et al. 2023's qk-layernorm, after Dehghani et al. 2023's ViT-22B):
  queries and keys are normalised with the run's norm kind (LayerNorm as in the paper, RMSNorm as in
  OLMo 2 and Gemma 3) before their dot product, with a gain and no bias for LayerNorm (ViT-22B's flax
  LayerNorm has `use_bias=False`) and DyT (it likewise drops its bias); any other kind with a bias (Derf)
  keeps it. `model.qk_norm_eps` (None: `norm.eps`) is their epsilon (flax's LayerNorm: 1e-6).
  `model.qk_norm_scope: head` (the default): per head,
  over its d / n_heads features, one norm for queries and one for keys shared by every head (ViT-22B,
  Wortsman, Gemma); `full`: over all d features of the projection before it splits into heads (OLMo 2,
  allenai/OLMo olmo/model.py `q_norm` / `k_norm`). The norms draw nothing: every weight is the same as
  without qk-norm.

- nanoGPT's choices (karpathy/nanoGPT model.py; docs/realtext.md): `model.activation: gelu` (the FFN's
  nonlinearity), `model.bias: false` (no bias in any Linear nor LayerNorm), `model.tie_embeddings` (the
  head's weight is the token embedding's), `model.init: gpt2` (`gpt2_init`). Positions are learned and
  the final norm is `model.final_norm`, as before. With them a Pre-LN model is nanoGPT's GPT (dropout 0).

Random draws, in order: token and position embeddings (N(0, 0.02^2), GPT-2's), then per layer the
attention's q, k, v, out and the FFN's fc1, fc2 (`make_linear`: default init, then xavier), then the
head. Norms draw nothing. `model.init: tfixup` and `fixup` rescale those draws (normexp/models/inits.py);
Fixup's attention adds a scalar bias before it and a multiplier after it (`FixupAttention`).
`model.init: gpt2` draws the embeddings at construction and keeps the Linears' default init there, then
draws every weight again in nanoGPT's order (`gpt2_init`). DeepNorm's and B2T's scaling of a layer's
weights (`rescale_at_init`) comes after every draw.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from normexp.config import DataConfig, ModelConfig, NormConfig, sequence_shape
from normexp.models.ffn import (
    Block,
    Scale,
    Shift,
    block_placements,
    deepnorm_constants,
    has_final_norm,
    make_ffn,
    make_head,
    make_linear,
    profile_admin,
    residual_stack,
)
from normexp.models.inits import FIXUP, qkv_draw, rescale_attention, rescale_branch, rescale_embedding, token_std
from normexp.models.norms import make_norm

EMBEDDING_STD = 0.02  # GPT-2's embedding init
GPT2_STD = 0.02  # model.init gpt2: nanoGPT's `_init_weights`, every Linear and embedding


def qk_norm(features: int, norm: NormConfig, eps: float | None = None) -> nn.Module:
    """One of qk-norm's two norms: the run's norm kind over `features` with epsilon `eps` (None: norm.eps),
    but without a bias for LayerNorm and DyT: ViT-22B's and Wortsman et al.'s qk-layernorm is flax's
    LayerNorm with `use_bias=False` (flax linen MultiHeadDotProductAttention, `normalize_qk`:
    `LayerNorm(name='query_ln', use_bias=False)`, flax's epsilon 1e-6), and OLMo 2's and Gemma's qk RMSNorms
    have a gain only. Every other kind is the run's own norm, bias included where it has one (Derf's)."""
    if eps is not None:
        norm = norm.model_copy(update={"eps": eps})
    if norm.kind == "layernorm":
        return nn.LayerNorm(features, eps=norm.eps, bias=False)
    if norm.kind == "dyt":
        return make_norm(features, norm.model_copy(update={"dyt_bias": False}))
    return make_norm(features, norm)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees positions <= t: (n, T, d) -> (n, T, d)."""

    def __init__(self, d: int, n_heads: int, model: ModelConfig, norm: NormConfig | None = None) -> None:
        super().__init__()
        self.n_heads = n_heads
        qkv = qkv_draw(model.init, d)  # T-Fixup's and Fixup's q, k, v (normexp/models/inits.py)
        self.q, self.k, self.v = (make_linear(d, d, model.init, **qkv, bias=model.bias) for _ in range(3))
        self.out = make_linear(d, d, model.init, bias=model.bias)
        self.qk_scope = model.qk_norm_scope if model.qk_norm else None
        if self.qk_scope is not None:  # Wortsman et al. 2023's qk-layernorm, in the run's norm kind
            features = d // n_heads if self.qk_scope == "head" else d
            self.q_norm, self.k_norm = (qk_norm(features, norm, model.qk_norm_eps) for _ in range(2))
        self.logits = nn.Identity()  # the attention logits, (n, heads, T, T) before the mask: hooked by blocklog

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = (proj(x) for proj in (self.q, self.k, self.v))
        if self.qk_scope == "full":  # OLMo 2: over the whole projection, before the heads split
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (self._heads(y) for y in (q, k, v))  # (n, heads, T, d / heads)
        if self.qk_scope == "head":  # ViT-22B, Wortsman et al., Gemma: per head, one norm shared by the heads
            q, k = self.q_norm(q), self.k_norm(k)
        scores = self.logits(q @ k.transpose(-2, -1) / math.sqrt(d // self.n_heads))  # (n, heads, T, T)
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        return self.out((weights @ v).transpose(1, 2).reshape(n, t, d))

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        return x.view(n, t, self.n_heads, d // self.n_heads).transpose(1, 2)


class FixupAttention(CausalSelfAttention):
    """Fixup's attention branch (the authors' transformer_zero.py decoder layer): a scalar bias before the
    attention (`shift0`), a scalar multiplier after it (`scale0`); q, k, v, out have no bias."""

    def __init__(self, d: int, n_heads: int, model: ModelConfig, norm: NormConfig | None = None) -> None:
        super().__init__(d, n_heads, model, norm)
        self.shift, self.scale = Shift(), Scale((), 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(super().forward(self.shift(x)))


class Layer(nn.Module):
    """One decoder layer: an attention sublayer, then an FFN sublayer, each a `Block`."""

    def __init__(self, attn: Block, ffn: Block, b2t: bool) -> None:
        super().__init__()
        self.attn, self.ffn, self.b2t = attn, ffn, b2t

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor | tuple:
        if self.b2t:  # Takase et al. 2023: Post-LN, plus the layer input skipped to the last norm
            h = self.attn.norm(x + self.attn.branch(x))
            return self.ffn.norm(x + h + self.ffn.branch(h))
        return self.ffn(self.attn(x))


def gpt2_init(model: Transformer) -> None:
    """`model.init: gpt2`, nanoGPT's init (karpathy/nanoGPT model.py, `GPT.__init__`: `self.apply(
    self._init_weights)`, then "special scaled init to the residual projections, per GPT-2 paper"), draw for
    draw in its order, so that with `model.bias: false` and a width whose square is a multiple of 16 (torch
    draws a normal tensor 16 numbers at a time) a seed gives nanoGPT's own weights: every embedding and
    Linear weight N(0, 0.02) in module order (token, position; per layer q, k, v (its c_attn), out
    (attn.c_proj), fc1 (mlp.c_fc), fc2 (mlp.c_proj); the head (lm_head), which a tied token embedding
    shares, so the head's draw is kept), every bias zero; then per layer out and fc2 again, N(0, 0.02 /
    sqrt(2 N)). Norms keep ones and zeros."""
    residual_std = GPT2_STD / math.sqrt(2 * len(model.layers))
    linears = [linear for layer in model.layers for linear in _layer_linears(layer)]
    with torch.no_grad():
        for module in (model.token, model.position, *linears, model.head):
            nn.init.normal_(module.weight, mean=0.0, std=GPT2_STD)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        for layer in model.layers:
            for projection in (layer.attn.branch.out, layer.ffn.branch.fc2):
                nn.init.normal_(projection.weight, mean=0.0, std=residual_std)


def _layer_linears(layer: Layer) -> tuple[nn.Linear, ...]:
    """q, k, v, out, fc1, fc2: the layer's Linears in the order they are built."""
    attention, ffn = layer.attn.branch, layer.ffn.branch
    return attention.q, attention.k, attention.v, attention.out, ffn.fc1, ffn.fc2


def rescale_at_init(layers: nn.ModuleList, norm: NormConfig, depth: int) -> None:
    """The placements that scale a layer's weights at init, after every draw: DeepNet's beta = (8N)^(-1/4)
    on v, out and the FFN (not q and k); B2T's N^(-1/2) on every weight of the layer (`rescaling_init`)."""
    beta = deepnorm_constants(2 * depth, norm)[1] if norm.placement == "deepnorm" else 1.0
    rescale = depth ** -0.5 if norm.placement == "b2t" and norm.b2t_rescale else 1.0
    with torch.no_grad():
        for layer in layers:
            attention, ffn = layer.attn.branch, layer.ffn.branch
            if beta != 1.0:
                for linear in (attention.v, attention.out, ffn.fc1, ffn.fc2):
                    linear.weight.mul_(beta)
            if rescale != 1.0:  # biases and norms aside
                for linear in _layer_linears(layer):
                    linear.weight.mul_(rescale)


class Transformer(nn.Module):
    """The causal decoder, from its model and norm config sections and the task's vocabulary and
    sequence length (`data.vocab`, `sequence_shape(data)`)."""

    def __init__(self, model: ModelConfig, norm: NormConfig, data: DataConfig) -> None:
        super().__init__()
        d, depth, vocab = model.width, model.depth, data.vocab
        b2t = norm.placement == "b2t"
        placements = ["post"] * depth if b2t else block_placements(depth, norm)
        alpha, _ = deepnorm_constants(2 * depth, norm) if norm.placement == "deepnorm" else (1.0, 1.0)
        self.token = nn.Embedding(vocab, d)
        self.position = nn.Embedding(sequence_shape(data).seq_len - 1, d)
        if model.init != "gpt2":  # gpt2: drawn with every other weight at the end, in nanoGPT's order
            for embedding, std in ((self.token, token_std(model.init, d, EMBEDDING_STD)),
                                   (self.position, EMBEDDING_STD)):
                nn.init.normal_(embedding.weight, std=std)
        rescale_embedding(model.init, depth, self.token)
        layers = []
        for placement in placements:
            attention = (FixupAttention if model.init == FIXUP else CausalSelfAttention)(d, model.n_heads, model, norm)
            hidden = model.hidden_mult * d
            ffn = make_ffn(make_linear(d, hidden, model.init, bias=model.bias),
                           make_linear(hidden, d, model.init, bias=model.bias), model.init, model.activation)
            rescale_attention(model.init, depth, attention.q, attention.k, attention.v, attention.out)
            rescale_branch(model.init, 2 * depth, ffn.fc1, ffn.fc2, layers=depth)  # Fixup: 2N branches
            attn_block = Block(placement, attention, d, norm, alpha, site="attn")
            ffn_block = Block(placement, ffn, d, norm, alpha, site="ffn")
            if placement == "rezero" and norm.rezero_gate == "layer":
                ffn_block.gate = attn_block.gate  # the authors' one `resweight` per layer
            layers.append(Layer(attn_block, ffn_block, b2t))
        self.layers = nn.ModuleList(layers)
        peri_input = norm.placement == "peri" and norm.peri_input_norm
        self.input_norm = make_norm(d, norm) if peri_input else nn.Identity()
        self.final_norm = make_norm(d, norm, "final") if has_final_norm(model, norm) else nn.Identity()
        # Fixup's decoder output has no bias (`F.linear(x, embed_out)`); every other init keeps the head's
        self.head = make_head(make_linear(d, vocab, model.init, bias=model.bias), model.init, bias=False)
        self.dual_norm = make_norm(d, norm) if norm.placement == "resdual" else None  # ResiDual's Norm_d
        self.dual_start = norm.resdual_stream
        self.admin_profile = norm.admin_profile
        if model.tie_embeddings:  # nanoGPT's `wte.weight = lm_head.weight`: one parameter, the head's
            self.token.weight = self.head.weight
        if not model.bias:  # nanoGPT's bias=False reaches its LayerNorms too
            for module in self.modules():
                if isinstance(module, nn.LayerNorm):
                    module.bias = None
        if model.init == "gpt2":
            gpt2_init(self)
        rescale_at_init(self.layers, norm, depth)

    @property
    def sublayers(self) -> list[Block]:
        """Every sublayer in order: layer 1's attention, layer 1's FFN, layer 2's attention, ..."""
        return [block for layer in self.layers for block in (layer.attn, layer.ffn)]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """(n, T) token ids -> (n, T, d): token plus position embedding, then Peri-LN's input norm."""
        positions = torch.arange(tokens.shape[-1], device=tokens.device)
        return self.input_norm(self.token(tokens) + self.position(positions))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        stream = residual_stack(self.layers, self.embed(tokens), self.dual_norm, self.dual_start)
        return self.head(self.final_norm(stream))

    @torch.no_grad()
    def profile_at_init(self, tokens: torch.Tensor) -> None:
        """Admin's profiling over every sublayer in order, on the training tokens (normexp/models/ffn.py)."""
        profile_admin(self.sublayers, self.embed(tokens), self.admin_profile)
