"""With nanoGPT's keys (`model.activation: gelu`, `bias: false`, `tie_embeddings: true`, `init: gpt2`), a Pre-LN
normexp Transformer is nanoGPT's GPT (dropout 0): the same weights from the same seed, the same logits and
losses at init, and the same after 3 AdamW steps on the same minibatches, to float rounding.

The reference below is an independent transcription of karpathy/nanoGPT, model.py at commit
3adf61e154c3fe3fca428ad6bc3818b27a3b8291 (LayerNorm, CausalSelfAttention, MLP, Block, GPTConfig, GPT: its
__init__, _init_weights and forward), with the flash-attention branch taken (torch >= 2) and the parameter
count print left out. Its weights are mapped to normexp's by name (`NANOGPT_NAMES`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
from torch.nn import functional as F

from normexp.config import validate_run
from normexp.engines.common import loss_and_acc, minibatches, seeded_init
from normexp.engines.reference import ReferenceOptimizer, train_run
from normexp.optim import step_lr

pytestmark = pytest.mark.equivalence

# ----------------------------------------------------------------------------- nanoGPT model.py, transcribed


class LayerNorm(nn.Module):
    """ LayerNorm but with an optional bias. PyTorch doesn't support simply bias=False """

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        y = self.resid_dropout(self.c_proj(y))
        return y


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        x = self.c_fc(x)
        x = self.gelu(x)
        x = self.c_proj(x)
        x = self.dropout(x)
        return x


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith('c_proj.weight'):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


# ----------------------------------------------------------------------------- the correspondence

NANOGPT_KEYS = {"activation": "gelu", "bias": False, "tie_embeddings": True, "init": "gpt2"}


def config(depth: int = 3, width: int = 32, heads: int = 4, seq_len: int = 16, seed: int = 5, steps: int = 3,
           lr: float = 3e-3, **model):
    return validate_run({
        "model": {"arch": "transformer", "depth": depth, "width": width, "n_heads": heads, **NANOGPT_KEYS, **model},
        "norm": {"placement": "pre", "kind": "layernorm"},
        "data": {"task": "shakespeare_char", "seq_len": seq_len, "batch_size": 4, "n_val": 4},
        "optim": {"name": "adamw", "lr": lr, "betas": [0.9, 0.99], "weight_decay": 0.0},
        "train": {"steps": steps, "threads": 1}, "seed": seed})


def nanogpt(cfg) -> GPT:
    """nanoGPT's GPT for `cfg`, built under the run's seed as nanoGPT's train.py builds it."""
    torch.manual_seed(cfg.seed)
    return GPT(GPTConfig(block_size=cfg.data.seq_len or 64, vocab_size=cfg.data.vocab, n_layer=cfg.model.depth,
                         n_head=cfg.model.n_heads, n_embd=cfg.model.width, dropout=0.0, bias=False))


def nanogpt_names(depth: int) -> dict[str, str]:
    """nanoGPT's parameter name -> normexp's (c_attn is q, k and v stacked: mapped apart by `weights`)."""
    names = {"transformer.wte.weight": "token.weight", "transformer.wpe.weight": "position.weight",
             "transformer.ln_f.weight": "final_norm.weight"}
    for i in range(depth):
        names |= {f"transformer.h.{i}.ln_1.weight": f"layers.{i}.attn.norm.weight",
                  f"transformer.h.{i}.attn.c_proj.weight": f"layers.{i}.attn.branch.out.weight",
                  f"transformer.h.{i}.ln_2.weight": f"layers.{i}.ffn.norm.weight",
                  f"transformer.h.{i}.mlp.c_fc.weight": f"layers.{i}.ffn.branch.fc1.weight",
                  f"transformer.h.{i}.mlp.c_proj.weight": f"layers.{i}.ffn.branch.fc2.weight"}
    return names


def normexp_as_nanogpt(model: nn.Module, depth: int) -> dict[str, torch.Tensor]:
    """normexp's weights under nanoGPT's names."""
    mine = dict(model.named_parameters())
    out = {theirs: mine[ours].detach() for theirs, ours in nanogpt_names(depth).items()}
    for i in range(depth):
        out[f"transformer.h.{i}.attn.c_attn.weight"] = torch.cat(
            [mine[f"layers.{i}.attn.branch.{p}.weight"].detach() for p in "qkv"])
    return out


def test_the_parameters_are_nanogpts_one_for_one():
    cfg = config()
    model, _ = seeded_init(cfg)
    theirs = dict(nanogpt(cfg).named_parameters())
    assert sorted(normexp_as_nanogpt(model, 3)) == sorted(theirs)  # every weight of each, and no bias
    assert model.head.weight is model.token.weight
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in theirs.values())


@pytest.mark.parametrize(("depth", "width", "seed"), [(3, 32, 5), (2, 16, 0), (4, 64, 11)])
def test_a_seed_gives_nanogpts_own_weights(depth, width, seed):
    cfg = config(depth, width, seed=seed)
    model, _ = seeded_init(cfg)
    theirs = dict(nanogpt(cfg).named_parameters())
    ours = normexp_as_nanogpt(model, depth)
    assert {name: torch.equal(ours[name], theirs[name].detach()) for name in theirs} == {n: True for n in theirs}
    residual = theirs["transformer.h.0.mlp.c_proj.weight"].std().item()
    assert residual == pytest.approx(0.02 / math.sqrt(2 * depth), rel=0.25)  # the scaled residual projections


def test_logits_and_losses_at_init_and_over_3_adamw_steps_are_nanogpts():
    cfg = config()
    model, task = seeded_init(cfg)
    reference = nanogpt(cfg)
    params = list(model.parameters())
    optimizer = ReferenceOptimizer(params, cfg)
    theirs = torch.optim.AdamW(reference.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps,
                               weight_decay=0.0)
    batches = minibatches(cfg, task)
    for step in range(cfg.train.steps + 1):
        x, y = next(batches)
        logits = model(x)
        loss, _ = loss_and_acc(logits, y, task.positions)
        their_logits, their_loss = reference(x, y)
        torch.testing.assert_close(logits, their_logits, rtol=1e-4, atol=1e-5)
        assert loss.item() == pytest.approx(their_loss.item(), rel=1e-5)
        if step == cfg.train.steps:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step(step_lr(cfg, step))
        theirs.zero_grad()
        their_loss.backward()
        theirs.step()
    assert loss.item() < math.log(84) - 0.2  # three steps at lr 3e-3 moved it well off ln 84 = 4.43


def test_the_reference_engine_trains_the_run_the_loop_above_does():
    """train_run draws the same minibatches (`minibatches`) and takes the same steps."""
    cfg = config()
    model, task = seeded_init(cfg)
    reference = nanogpt(cfg)
    theirs = torch.optim.AdamW(reference.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps,
                               weight_decay=0.0)
    losses = []
    for _, (x, y) in zip(range(cfg.train.steps + 1), minibatches(cfg, task)):
        _, loss = reference(x, y)
        losses.append(loss.item())
        theirs.zero_grad()
        loss.backward()
        theirs.step()
    assert train_run(cfg).metrics["loss"] == pytest.approx(losses, rel=1e-5)
