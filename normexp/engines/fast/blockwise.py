"""The fast engine's Adam step compiled block by block: where the model is a chain (residual blocks that each
map the stream to the stream, between an input without parameters and a readout), one compiled forward and
one compiled backward serve every block of one structure, one compiled Adam update every block's parameters
of that structure, and one compiled readout step the rest (the readout's forward, the loss, its gradients and
its update). The step calls them in turn: each block's forward, first to last, keeping what its backward
needs; the readout; then each block's backward and update, last to first.

    forward   (block's params, x) -> (y, saved...)         one per block structure
    backward  (saved..., dy) -> (grads..., dx)             the same joint graph, cut by AOTAutograd's
                                                           partitioner (what to keep, what to recompute)
    update    (params, grads, m, v, hyper) -> sum of the   adam_update of each tensor in place, as the
              grads' squares per run                      whole step's graph makes it
    readout   (params, m, v, h, y, hyper) -> (dh, loss,    its forward, loss, backward and update
              acc, sum of squares)

It computes what `compiled.compile_train_step`'s single graph computes (the model's own forward vmapped over
the runs, its gradients, `adam_update`), each piece compiled on its own (`aot`, one package each), and it is
checked against the same eager function before use. Its last bits may differ from the single graph's (the
gradient norm is summed block by block, and no kernel spans two blocks), within the fast engine's contract.

Why: the single graph is the blocks unrolled, and every part of its compile grows with the depth: ~100 s of
one core for the depth-24 toy on an AMD Zen 4, where these pieces take ~30 s whatever the depth, and train
as fast (docs/performance.md, "The step compiled block by block")."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vjp, vmap

import normexp.engines.fast.aot as aot
from normexp.engines.common import loss_and_acc
from normexp.engines.fast.optim import adam_update_
from normexp.models.ffn import Net


class Readout(nn.Module):
    """`Net.readout` as a module of its own, its parameters named as the model's (`net.` before each)."""

    def __init__(self, net: Net) -> None:
        super().__init__()
        self.net = net

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.net.readout(h)


@dataclass(frozen=True)
class Chain:
    """A model as a chain: its blocks (each with its parameters' names in the model), and its readout's."""

    blocks: tuple[tuple[nn.Module, tuple[str, ...]], ...]
    readout: Readout
    readout_names: tuple[str, ...]


def chain_of(model: nn.Module) -> Chain:
    """`model`, of a structure `plan.by_blocks` serves, as a chain: each block with its parameters' names in the
    model, and the readout's."""
    if not isinstance(model, Net) or not isinstance(model.input_norm, nn.Identity) or model.dual_norm is not None:
        raise ValueError(f"not a chain of blocks: {type(model).__name__}")
    blocks = tuple((block, tuple(f"blocks.{i}.{name}" for name, _ in block.named_parameters()))
                   for i, block in enumerate(model.blocks))
    readout = Readout(model)
    names = tuple(name.removeprefix("net.") for name, _ in readout.named_parameters()
                  if not name.startswith("net.blocks."))
    return Chain(blocks, readout, names)


def structure(block: nn.Module) -> tuple:
    """What makes two blocks one compiled forward and backward: their modules as printed (types, placement,
    DeepNorm's alpha, a norm's kind and eps) and their parameters' names and shapes (without the run axis)."""
    return (repr(block), tuple((name, tuple(p.shape)) for name, p in block.named_parameters()))


Piece = Callable[..., Sequence[torch.Tensor]]


def blockwise_step(chain: Chain, names: Sequence[str], inputs: Sequence[torch.Tensor], positions: torch.Tensor | None,
                  key: Callable[[str], str], fresh: bool) -> tuple[Piece, bool]:
    """The chain's Adam step, taking and returning what `compile_train_step`'s does: (params in `names`'
    order, exp_avg, exp_avg_sq, x, y, hyper) -> (metrics (3, R),), the parameters and moments updated in
    place; `inputs` are the step's own, to compile on. Each piece is loaded from its package, or compiled
    (`aot.load_or_compile`, named `key(piece)`) on example inputs made by the eager pieces before it (inductor
    keeps a graph's output strides, so the compiled pieces hand each other what the examples hold). A piece
    another process is compiling is left for last, so that two processes that start cold compile two pieces
    at once. Returns (step, whether every piece was compiled now: a step with a piece loaded is checked, and
    compiled again where it fails, as a loaded whole step is); the step carries the sha256 of its pieces'
    packages (`aot.vouch`)."""
    n = len(names)
    at = {name: i for i, name in enumerate(names)}
    params, x, y, hyper = inputs[:n], inputs[3 * n], inputs[3 * n + 1], inputs[3 * n + 2]
    specs: list[tuple[str, Callable, Callable]] = []  # (piece, trace, example), in the order they are called
    groups: dict[tuple, str] = {}
    plan: list[tuple[str, list[int]]] = []  # per block: its group, its parameters' indices
    for block, block_names in chain.blocks:
        index = [at[name] for name in block_names]
        sig = structure(block)
        if sig not in groups:
            groups[sig] = g = f"block{len(groups)}"
            specs += _block_specs(g, block, [params[i] for i in index], x, hyper)
        plan.append((groups[sig], index))
    readout_index = [at[name] for name in chain.readout_names]
    ro_params = [params[i] for i in readout_index]
    ro_example = functools.cache(lambda: _copies([*ro_params, *(torch.zeros_like(p) for p in ro_params * 2),
                                                  x, y, hyper]))
    specs.append(("readout", lambda: _traced_readout(chain, positions, ro_example()), ro_example))
    pieces, compiled_now = {}, True
    for wait in (False, True):  # first whatever no other process is compiling; then wait for the rest
        for piece, trace, example in specs:
            if piece not in pieces:
                got = aot.load_or_compile(key(piece), trace, example, fresh=fresh, wait=wait)
                if got is not None:
                    pieces[piece], now = got
                    compiled_now &= now
    digest = hashlib.sha256("".join(getattr(pieces[p], "digest", "") for p, _, _ in specs).encode()).hexdigest()
    calls = [(pieces[f"{g}-forward"], pieces[f"{g}-backward"], pieces[f"{g}-update"], index) for g, index in plan]
    readout = pieces["readout"]

    def step(*tensors: torch.Tensor) -> tuple[torch.Tensor]:
        ps, ms, vs = tensors[:n], tensors[n:2 * n], tensors[2 * n:3 * n]
        h, hyper = tensors[3 * n], tensors[3 * n + 2]
        saved = []
        for forward, _, _, index in calls:
            h, *keep = forward(*[ps[i] for i in index], h)
            saved.append(keep)
        dh, loss, acc, squares = readout(*[ps[i] for i in readout_index], *[ms[i] for i in readout_index],
                                         *[vs[i] for i in readout_index], h, tensors[3 * n + 1], hyper)
        for (_, backward, update, index), keep in zip(reversed(calls), reversed(saved)):
            *grads, dh = backward(*keep, dh)
            (block_squares,) = update(*[ps[i] for i in index], *grads, *[ms[i] for i in index],
                                      *[vs[i] for i in index], hyper)
            squares = squares + block_squares
        return (torch.stack([loss, acc, squares.sqrt()]),)

    step.digest = digest  # type: ignore[attr-defined]
    return step, compiled_now


def _block_specs(g: str, block: nn.Module, params: list[torch.Tensor], x: torch.Tensor,
                 hyper: torch.Tensor) -> list[tuple[str, Callable, Callable]]:
    """The forward, backward and update pieces of the blocks of group `g` (`block` one of them, `params` its
    stacked parameters, `x` a stream's shape): each (piece, trace, example), traced and run eagerly only
    where a piece is compiled."""
    graphs = functools.cache(lambda: _partitioned(block, params, x))
    saved = functools.cache(lambda: [*graphs()[0](*params, x)[1:], torch.zeros_like(x)])
    backward = functools.cache(lambda: _contiguous(graphs()[1], saved()))
    grads = functools.cache(lambda: _copies([*(p.clone() for p in params), *backward()(*saved())[:-1],
                                             *(torch.zeros_like(p) for p in params * 2), hyper]))
    return [(f"{g}-forward", lambda: graphs()[0], lambda: [*params, x]),
            (f"{g}-backward", backward, saved),
            (f"{g}-update", lambda: _traced_update(len(params), grads()), grads)]


def _partitioned(block: nn.Module, params: Sequence[torch.Tensor], x: torch.Tensor) -> tuple[torch.fx.GraphModule,
                                                                                                torch.fx.GraphModule]:
    """The block's forward and backward, vmapped over the runs: its joint graph (make_fx of the forward and
    its vjp, the placeholders named as AOTAutograd names them) cut by the partitioner inductor uses."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch.fx.experimental.proxy_tensor import make_fx

    names = [name for name, _ in block.named_parameters()]
    batched = vmap(lambda ps, x: functional_call(block, dict(zip(names, ps)), (x,)))

    def joint(primals: list[torch.Tensor], tangents: list[torch.Tensor]) -> list[torch.Tensor]:
        *ps, x = primals
        y, pull = vjp(lambda *a: batched(a[:-1], a[-1]), *ps, x)
        return [y, *pull(tangents[0])]

    primals, tangents = [*params, x], [torch.zeros_like(x)]
    graph = make_fx(joint)(primals, tangents)
    return min_cut_rematerialization_partition(graph, [primals, tangents], num_fwd_outputs=1, compiler="inductor")


def _contiguous(graph: torch.fx.GraphModule, example: Sequence[torch.Tensor]) -> torch.fx.GraphModule:
    """`graph` with each output contiguous, traced again: a gradient the partitioner hands back as a transposed
    view would be read entry by entry by the update's kernel (141-170 against 108-136 ms a run). A weight's
    gradient, a product transposed ((A @ B)^T), is computed as B^T @ A^T (`_untransposed`), the same sums written
    in the order the update reads them; any other output is copied."""
    from torch.fx.experimental.proxy_tensor import make_fx

    _untransposed(graph)
    return make_fx(lambda *t: [out.contiguous() for out in graph(*t)])(*example)


def _untransposed(graph: torch.fx.GraphModule) -> None:
    """Each output of `graph` that is a batched product transposed, transpose(bmm(A, B)) (through a view to
    the product's own shape), replaced by bmm(transpose(B), transpose(A)), in place."""
    aten = torch.ops.aten
    output = graph.graph.output_node()
    outs = list(output.args[0])
    for i, node in enumerate(outs):
        if not (isinstance(node, torch.fx.Node) and node.target == aten.transpose.int and node.args[1:] == (1, 2)):
            continue
        product = node.args[0]
        if product.target in (aten.view.default, aten._unsafe_view.default):
            inner = product.args[0]
            shape = getattr(inner.meta.get("val"), "shape", None)
            if inner.target != aten.bmm.default or shape is None or list(product.args[1]) != list(shape):
                continue
            product = inner
        if product.target != aten.bmm.default:
            continue
        a, b = product.args
        with graph.graph.inserting_before(output):
            outs[i] = graph.graph.call_function(aten.bmm.default, (
                graph.graph.call_function(aten.transpose.int, (b, 1, 2)),
                graph.graph.call_function(aten.transpose.int, (a, 1, 2))))
    output.args = (type(output.args[0])(outs),)
    graph.graph.eliminate_dead_code()
    graph.recompile()


def _traced_update(k: int, example: Sequence[torch.Tensor]) -> torch.fx.GraphModule:
    """`adam_update` of a block's k tensors in place, traced: (params, grads, m, v, hyper) -> (the runs' sums of
    the grads' squares,)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def update(*t: torch.Tensor) -> tuple[torch.Tensor]:
        ps, gs, ms, vs, hyper = t[:k], t[k:2 * k], t[2 * k:3 * k], t[3 * k:4 * k], t[-1]
        return (_apply(ps, gs, ms, vs, hyper),)

    return make_fx(update)(*_copies(example))


def _traced_readout(chain: Chain, positions: torch.Tensor | None,
                    example: Sequence[torch.Tensor]) -> torch.fx.GraphModule:
    """The readout's step traced: (params, m, v, h, y, hyper) -> (dh, loss, acc, sums of squares), its
    parameters and moments updated in place."""
    from torch.fx.experimental.proxy_tensor import make_fx

    names = [f"net.{name}" for name in chain.readout_names]
    k = len(names)

    def objective(ps: tuple, h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        loss, acc = loss_and_acc(functional_call(chain.readout, dict(zip(names, ps)), (h,)), y, positions)
        return loss, (loss, acc)

    batched = vmap(grad_and_value(objective, argnums=(0, 1), has_aux=True))

    def readout(*t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ps, ms, vs, (h, y, hyper) = t[:k], t[k:2 * k], t[2 * k:3 * k], t[3 * k:]
        (grads, dh), (_, (loss, acc)) = batched(tuple(ps), h, y)
        return dh, loss, acc, _apply(ps, [g.contiguous() for g in grads], ms, vs, hyper)

    return make_fx(readout)(*_copies(example))


def _apply(ps: Sequence[torch.Tensor], gs: Sequence[torch.Tensor], ms: Sequence[torch.Tensor],
           vs: Sequence[torch.Tensor], hyper: torch.Tensor) -> torch.Tensor:
    """Each tensor's `adam_update_`; returns each run's sum of the gradients' squares."""
    squares = None
    for p, g, m, v in zip(ps, gs, ms, vs):
        own = g.reshape(len(g), -1).pow(2).sum(1)
        squares = own if squares is None else squares + own
        adam_update_(p, g, m, v, hyper)
    return squares


def _copies(example: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Fresh tensors to trace on (each input a tensor of its own: the tracer refuses one mutated twice)."""
    return [t.clone() for t in example]
