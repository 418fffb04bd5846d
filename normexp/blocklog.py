"""Per-block training dynamics (`train.log_blocks`): what each block of a run sees, step by step.

At every `train.log_every`-th recorded step, one row per block (numbered 1..N from the input):

    fc1_grad, fc2_grad      ||dLoss/dW|| (Frobenius) of the block's fc1 and fc2 weight matrices
    fc1_update, fc2_update  ||W_after - W_before|| / ||W_before|| of the optimizer step that follows
                            (nan where none follows: the last step, or a run that stops there)
    stream_rms              sqrt(mean(x^2)) of the residual stream at the block's output, over samples
                            and features; ResiDual's block carries two streams (x_a, x_d): this is
                            x_a's, the normed stream that the next block's branch reads (x_d, the sum
                            of raw branch outputs, enters the output only through Norm_d at the end)
    norm_rms, norm_out_rms  the same RMS of the output of the block's norm (`Block.norm`) and of its
                            branch-output norm (`Block.norm_out`, Sandwich and Peri-LN); nan where absent

A Transformer (`model.arch: transformer`) has one row per layer (attention sublayer, then FFN sublayer):
fc1/fc2 are its FFN's, stream_rms is the layer's output, norm_rms and norm_out_rms its FFN sublayer's
norms; and three more columns (Wortsman et al. 2023's two instabilities):

    attn_logit_max          the largest attention logit q.k / sqrt(d_head) of the layer, over its heads, the
                            samples and every (query, key) pair the causal mask keeps ("attention logit growth")
    attn_entropy            the entropy of the layer's attention weights, -sum_j p_ij ln p_ij, averaged over
                            heads, samples and query positions (Zhai et al. 2023's "entropy collapse")
    log_z                   ln Z = logsumexp of the output logits, averaged over the tokens the loss reads
                            (the model's, not a layer's: the same in every row of a step; "output logit
                            divergence", the quantity the z-loss penalises)

Activations are read with forward hooks on the model's own modules (no block is defined twice), so
one `BlockRecorder` serves the reference engine (one `Net`) and the batched engine (one `Net` whose
leaf layers hold R runs along a leading axis; its Linear weights (R, in, out) as `weight_t`, or (R, out, in)).
Every quantity is computed run by run from a contiguous tensor in the reference's memory order, with
the same ops, so both engines write the same bits. Recording only reads the training's tensors (and
copies the weights before a logged update): a run's metrics are the same bits with logging on or off.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

BLOCK_COLUMNS = ("step", "block", "fc1_grad", "fc2_grad", "fc1_update", "fc2_update", "stream_rms", "norm_rms",
                 "norm_out_rms")
MATRICES = ("fc1", "fc2")
WATCHED = {"stream_rms": None, "norm_rms": "norm", "norm_out_rms": "norm_out"}  # column -> Block attribute
ATTENTION_COLUMNS = ("attn_logit_max", "attn_entropy", "log_z")
TRANSFORMER_BLOCK_COLUMNS = (*BLOCK_COLUMNS, *ATTENTION_COLUMNS)  # a Transformer's blocks.csv


def rms(x: torch.Tensor) -> float:
    """sqrt(mean(x^2)) over every element of one run's activation."""
    return x.pow(2).mean().sqrt().item()


def frobenius(x: torch.Tensor) -> float:
    """The Frobenius norm of one run's matrix, taken from the reference's memory order."""
    return torch.linalg.vector_norm(x.contiguous()).item()


class BlockRecorder:
    """Records the per-block rows of R runs trained as one model (R = 1: the reference engine).

    Call `observe(step, runs, grads)` after a recorded step's backward (and before its update): it
    reads the gradients (of the runs flagged in `grads`) and the activations of the last forward, and
    keeps a copy of the weights. Call `observe_update()` after the optimizer step: it fills in the
    update ratios. `rows(r)` gives run r's columns; `close()` removes the hooks."""

    def __init__(self, model: nn.Module, every: int, n_runs: int = 1, stacked: bool = False,
                 positions: torch.Tensor | None = None) -> None:
        self.transformer = hasattr(model, "layers")  # rows per layer: its FFN sublayer's block, its attention
        units = list(model.layers) if self.transformer else list(model.blocks)
        self.blocks = [layer.ffn for layer in units] if self.transformer else units
        self.every, self.stacked, self.positions = every, stacked, positions
        names = TRANSFORMER_BLOCK_COLUMNS if self.transformer else BLOCK_COLUMNS
        self.columns: list[dict[str, list[float]]] = [{c: [] for c in names} for _ in range(n_runs)]
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}
        self.hooks = [self._watch(module, column, i) for i, (unit, block) in enumerate(zip(units, self.blocks))
                      for column, attr in WATCHED.items()
                      if (module := unit if attr is None else getattr(block, attr)) is not None]
        if self.transformer:
            self.hooks += [self._watch(unit.attn.branch.logits, "logits", i) for i, unit in enumerate(units)]
            self.hooks.append(self._watch(model.head, "head", 0))
        self.before: list[torch.Tensor] = []  # the weights before the update being logged
        self.pending: list[tuple[int, int]] = []  # (run, first row) of the rows waiting for their update

    def _watch(self, module: nn.Module, column: str, i: int) -> torch.utils.hooks.RemovableHandle:
        def hook(_module: nn.Module, _args: object, output: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
            stream = output[0] if isinstance(output, tuple) else output  # ResiDual's block: (x_a, x_d)
            self.outputs[column, i] = stream.detach()
        return module.register_forward_hook(hook)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def _weights(self) -> list[torch.Tensor]:
        """Each fc weight in block order (fc1, fc2 of block 1, ...), as the model holds it."""
        return [linear.weight_t if self._transposed(linear) else linear.weight for linear in self._linears()]

    def _linears(self) -> list[nn.Module]:
        return [getattr(block.branch, name) for block in self.blocks for name in MATRICES]

    def _transposed(self, linear: nn.Module) -> bool:
        return self.stacked and linear.bmm  # a StackedLinear holding (R, in, out)

    def _per_run(self, tensor: torch.Tensor, k: int, r: int) -> torch.Tensor:
        """Run r's slice of the k-th weight-shaped tensor, as the reference holds it: (out, in)."""
        if not self.stacked:
            return tensor
        return tensor[r].t() if self._transposed(self._linears()[k]) else tensor[r]

    def _activation(self, key: tuple[str, int], r: int) -> float:
        output = self.outputs.get(key)
        if output is None:
            return math.nan
        return rms(output[r] if self.stacked else output)

    def _attention(self, i: int) -> tuple[float, float, float]:
        """(attn_logit_max, attn_entropy, log_z) of layer i in the last forward (one run: the reference's)."""
        logits = self.outputs["logits", i]  # (n, heads, T, T), before the causal mask
        future = torch.ones(logits.shape[-2:], dtype=torch.bool, device=logits.device).triu(1)
        masked = logits.masked_fill(future, float("-inf"))
        entropy = torch.special.entr(torch.softmax(masked, dim=-1)).sum(-1).mean()
        head = self.outputs["head", 0]  # (n, T, vocab)
        read = head[:, self.positions].flatten(0, 1) if self.positions is not None else head
        return masked.max().item(), entropy.item(), read.logsumexp(-1).mean().item()

    @torch.no_grad()
    def observe(self, step: int, runs: Sequence[int], grads: Sequence[bool],
                updates: Sequence[bool] | None = None) -> None:
        """Record step `step` for `runs`; `grads[k]`: whether runs[k] has this step's gradients, `updates[k]`
        whether it takes this step's update (default: where it has gradients; not a run that train.stop_when
        stops here)."""
        weights = self._weights()
        self.before = [w.detach().clone() for w in weights]
        self.pending = []
        for r, has_grads, updated in zip(runs, grads, grads if updates is None else updates):
            columns = self.columns[r]
            if has_grads and updated:
                self.pending.append((r, len(columns["step"])))
            for i in range(len(self.blocks)):
                columns["step"].append(step)
                columns["block"].append(i + 1)
                for j, name in enumerate(MATRICES):
                    k = 2 * i + j
                    grad = frobenius(self._per_run(weights[k].grad, k, r)) if has_grads else math.nan
                    columns[f"{name}_grad"].append(grad)
                    columns[f"{name}_update"].append(math.nan)
                for column in WATCHED:
                    columns[column].append(self._activation((column, i), r))
                if self.transformer:
                    for column, value in zip(ATTENTION_COLUMNS, self._attention(i)):
                        columns[column].append(value)

    @torch.no_grad()
    def observe_update(self) -> None:
        """Fill in the update ratios of the rows `observe` just wrote, from the weights now."""
        for k, after in enumerate(self._weights()):
            i, name = divmod(k, 2)
            before = self.before[k]
            delta = after.detach() - before
            for r, first in self.pending:
                ratio = frobenius(self._per_run(delta, k, r)) / frobenius(self._per_run(before, k, r))
                self.columns[r][f"{MATRICES[name]}_update"][first + i] = ratio
        self.before, self.pending = [], []

    def rows(self, r: int = 0) -> dict[str, list[float]]:
        return self.columns[r]

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.outputs.clear()
