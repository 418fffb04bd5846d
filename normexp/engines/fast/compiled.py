"""The fast engine's compiled step: the step traced into one graph of aten operations and compiled ahead of
time (`aot`: kept on disk), checked against the eager step before it is used, and kept for the process's life,
one per structure, optimizer family and device; a structure whose compile failed is refused for the rest
of the process."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import torch

import normexp.engines.fast.aot as aot
import normexp.engines.fast.blockwise as blockwise
from normexp.config import RunConfig
from normexp.engines.cache import user_cache_dir
from normexp.engines.fast.optim import FastOptimizer, MadeAhead, adam_hypers, adam_move, adam_update_
from normexp.engines.fast.plan import by_blocks, fuses
from normexp.engines.fast.step import Batch, GradStep, Tensors, make_grad_step

_T = TypeVar("_T")


def compile_cache_dir() -> Path | None:
    """Inductor's cache folder: $TORCHINDUCTOR_CACHE_DIR if set, else one stable folder per user
    (`user_cache_dir()`/inductor: ~/.cache/normexp/inductor), so a compile made by one sweep is found by the next;
    None (inductor's own default) for a user without a home folder."""
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not folder:
        home = user_cache_dir()
        if home is None:  # no home folder: inductor's own default, not a folder normexp makes up
            return None
        folder = os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(home / "inductor")
    return Path(folder)


class CompileFailed(Exception):  # noqa: N818 - raised from the compiler's exception, its __cause__
    """Compiling, checking or calling the compiled step raised: `train_fast` trains the batch uncompiled.
    What a run raises outside the compiled step (its initialisation, say) is not wrapped: it fails the batch
    as it does uncompiled, and the compiled step stays in use."""


def compiler_call(fn: Callable[..., _T], *args: object) -> _T:
    """`fn(*args)`, an exception it raises wrapped in CompileFailed."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - any compiler failure: the eager step still works
        raise CompileFailed(str(exc)) from exc


class CompiledStep:
    """A compiled step bound to one batch. Without the optimizer inside (`grad`: params, x, y -> grads,
    metrics) it hands the gradients to the batch's `FastOptimizer` at `update`; with it (Adam and AdamW:
    `compile_train_step`) one call computes this step's metrics and makes the update (`adam_update`) in
    place, so the parameters have moved on when it returns, and `update` has nothing left to do. A run
    that stops at this step (diverged, or train.stop_when), and every run at the last step, has that
    update made too; none of them is recorded again, so it changes nothing a run reports."""

    def __init__(self, compiled: Callable, optimizer: FastOptimizer, fused: bool,
                 schedule: Sequence[Sequence[float]] = ()) -> None:
        self.compiled, self.optimizer, self.fused = compiled, optimizer, fused
        self.grads: Tensors = {}
        # Each update's numbers while every run is live (update t: index t - 1), made a stretch ahead
        # (`MadeAhead`): `adam_hypers` between two calls of the step costs ~10x what it does in a row, the
        # step having evicted what it touches
        everyone = [True] * len(optimizer.optims)
        self.hypers = MadeAhead(lambda i: adam_hypers(optimizer.optims, optimizer.name, i + 1, schedule[i], everyone),
                                len(schedule) if fused else 0)

    def step(self, params: Tensors, x: torch.Tensor, y: torch.Tensor, lrs: Sequence[float],
             live: Sequence[bool]) -> torch.Tensor:
        if not self.fused:
            self.grads, metrics = self.compiled(params, x, y)
            return metrics
        opt = self.optimizer
        opt.t += 1
        made = opt.t <= len(self.hypers) and all(live)
        hyper = self.hypers[opt.t - 1] if made else adam_hypers(opt.optims, opt.name, opt.t, lrs, live)
        (metrics,) = self.compiled(*opt.params, *opt.state["exp_avg"], *opt.state["exp_avg_sq"], x, y,
                                   hyper.to(x.device))
        return metrics

    def update(self, lrs: Sequence[float], live: Sequence[bool]) -> None:
        """This step's update, for the runs `live` after it was recorded (made already with Adam)."""
        if not self.fused:
            self.optimizer.step(list(self.grads.values()), lrs, live)


# One compiled step per structure, optimizer family and device, kept for the process's life: later
# batches (other seeds or hyper-parameters) reuse it instead of compiling again.
_COMPILED: dict[tuple, Callable | None] = {}  # None: refused (`refuse`)


def reset_cache() -> None:
    """Forget every compiled step and refusal this process keeps, as a fresh process starts (a step's package
    on disk stays: the next batch loads it)."""
    _COMPILED.clear()


def kept_steps() -> dict[tuple, Callable | None]:
    """A copy of what this process keeps: each compiled step by its key (`compiled_structure` and the device),
    and None under ("refused", *structure, device) for a step refused."""
    return dict(_COMPILED)


def compiled_structure(cfg: RunConfig) -> tuple:
    """What one compiled step serves (with the device): the model, norm, data, z-loss, and whether the Adam
    update is inside it. A step that fails to compile is refused for exactly this (`train_fast`)."""
    return (cfg.model, cfg.norm, cfg.data, cfg.train.z_loss, fuses(cfg))


def _step_key(cfg: RunConfig, batch: Batch) -> tuple:
    """The key of `_COMPILED` that the step of `cfg`'s runs on the batch's device is kept under."""
    return (*compiled_structure(cfg), str(batch.x.device))


def has_step(cfg: RunConfig, batch: Batch) -> bool:
    """Whether this process keeps the compiled step of `cfg`'s runs on the batch's device (none to trace)."""
    return _step_key(cfg, batch) in _COMPILED


def is_refused(cfg: RunConfig, device: str) -> bool:
    """Whether the compiled step of `cfg`'s runs on `device` failed in this process (`refuse`)."""
    return ("refused", *compiled_structure(cfg), device) in _COMPILED


def refuse(cfg: RunConfig, device: str) -> None:
    """The compiled step of `cfg`'s runs failed: its later batches in this process train uncompiled, not
    compiled again (the structure's other steps, another optimizer family's or z_loss's, keep theirs)."""
    structure = compiled_structure(cfg)
    for key in [k for k in _COMPILED if k[:len(structure)] == structure]:
        del _COMPILED[key]
    _COMPILED[("refused", *structure, device)] = None


def compiled_step(cfg: RunConfig, base: Callable[[], torch.nn.Module], batch: Batch,
                  optimizer: FastOptimizer, schedule: Sequence[Sequence[float]] = ()) -> CompiledStep:
    """The compiled step of runs shaped like `cfg` on the batch's device, for batches of `plan.chunk_runs` runs
    (vmap specialises the run axis, so `train_fast` pads smaller batches); with Adam or AdamW the update
    is part of it, its numbers for each update made from `schedule` (each step's learning rates, `train._train`'s),
    a stretch of updates ahead; `base` makes the batch's model, which a step not compiled yet traces. Compile errors,
    and a compiled step that does not reproduce the eager one, surface at the first call."""
    fused = fuses(cfg)
    key = _step_key(cfg, batch)
    if key not in _COMPILED:
        compile_cache_dir()
        what = {"step": "train-adam" if fused else "grad", "model": cfg.model.model_dump(mode="json"),
                "norm": cfg.norm.model_dump(mode="json"), "data": cfg.data.model_dump(mode="json"),
                "z_loss": cfg.train.z_loss, "runs": batch.runs}
        model = base()
        step = make_grad_step(model, batch.positions, cfg.train.z_loss)
        name, vouching = aot.step_key(what, str(batch.x.device)), aot.vouchable(what)
        x, y = batch.step_data(0)
        if fused:  # the check's update: each run's base learning rate (a warmup may start at 0), live
            hyper = adam_hypers(optimizer.optims, optimizer.name, 1, [o.lr for o in optimizer.optims],
                                [True] * batch.runs).to(batch.x.device)
            chain = blockwise.chain_of(model) if by_blocks(cfg) else None
            if chain is not None:  # its blocks compiled once each, not unrolled: another package
                name = aot.step_key({**what, "blockwise": True}, str(batch.x.device))
            _COMPILED[key] = compile_train_step(step, batch.params, x, y, hyper, name, vouching, chain, batch.positions)
        else:
            _COMPILED[key] = compile_grad_step(step, batch.params, x, y, key=name, vouching=vouching)
    return CompiledStep(_COMPILED[key], optimizer, fused, schedule)


def compile_grad_step(step: GradStep, params: Tensors, x: torch.Tensor, y: torch.Tensor, key: str,
                      vouching: bool = False) -> GradStep:
    """`step` traced once into one flat graph of aten operations (make_fx: forward, backward and the
    norms, vmap and grad already applied), compiled ahead of time (AOTInductor) and kept on disk under
    `key` (`_compile_checked`). Returns a step that takes and returns tensors by name."""
    names = list(params)

    def flat(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        grads, metrics = step(dict(zip(names, tensors[:-2])), tensors[-2], tensors[-1])
        return (*(grads[name] for name in names), metrics)

    compiled = _compile_checked(flat, (*params.values(), x, y), key, _disagreement, vouching=vouching)

    def named_step(params: Tensors, x: torch.Tensor, y: torch.Tensor) -> tuple[Tensors, torch.Tensor]:
        *grads, metrics = compiled(*(params[name] for name in names), x, y)
        return dict(zip(names, grads)), metrics

    return named_step


def compile_train_step(step: GradStep, params: Tensors, x: torch.Tensor, y: torch.Tensor, hyper: torch.Tensor,
                       key: str, vouching: bool = False, chain: blockwise.Chain | None = None,
                       positions: torch.Tensor | None = None) -> Callable:
    """`step` and the Adam update (`adam_update`) of every parameter traced into one graph and compiled
    as `compile_grad_step`'s: (params, exp_avg, exp_avg_sq, x, y, hyper) -> (metrics,), positional, the
    parameters and moments updated in place. The gradients never leave the compiled code, and each
    tensor's update is one pass over its parameters, gradient and moments, written where they are.
    Checked against the same function run eagerly, from zero moments at `hyper`: the metrics, each
    run's update of its parameters, and the new moments. With `chain` (the model as `blockwise.chain_of` finds
    it; `positions`: the batch's answer positions), the same function compiled block by block
    (`blockwise.blockwise_step`), checked the same way."""
    names, n = list(params), len(params)

    def flat(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ps, ms, vs, (x, y, hyper) = tensors[:n], tensors[n:2 * n], tensors[2 * n:3 * n], tensors[3 * n:]
        grads, metrics = step(dict(zip(names, ps)), x, y)
        for name, p, m, v in zip(names, ps, ms, vs):  # after every gradient is taken: the weights are read there
            adam_update_(p, grads[name], m, v, hyper)
        return (metrics,)

    start = list(params.values())
    inputs = (*start, *(torch.zeros_like(p) for p in start * 2), x, y, hyper)

    def disagreement(eager: Sequence[torch.Tensor], got: Sequence[torch.Tensor]) -> str | None:
        """The moments against the eager ones (each proportional to the gradient or its square); the update
        against the one `adam_update` makes from the compiled moments. Adam scales a gradient that is zero
        in exact arithmetic (rounding noise, as attention's key bias has) to a full step, so its update
        differs between any two orders of summation by the learning rate; its moments do not."""
        if len(got) != len(eager):
            return "its outputs"
        if not metrics_close(eager[-1], got[-1]):
            return "its metrics"
        for i, what in ((1, "its first moments"), (2, "its second moments")):
            if not gradients_close(eager[i * n:(i + 1) * n], got[i * n:(i + 1) * n]):
                return what
        expected = [adam_move(p, m, v, hyper) for p, m, v in zip(start, got[n:2 * n], got[2 * n:3 * n])]
        if not gradients_close([e - p for e, p in zip(expected, start)], [g - p for g, p in zip(got[:n], start)]):
            return "its update"
        return None

    build = None
    if chain is not None:
        def build(example: Sequence[torch.Tensor], fresh: bool) -> tuple[Callable, bool]:
            return blockwise.blockwise_step(chain, names, example, positions, lambda piece: f"{key}.{piece}", fresh)

    return _compile_checked(flat, inputs, key, disagreement, mutated=3 * n, vouching=vouching, build=build)


def _compile_checked(flat: Callable[..., tuple[torch.Tensor, ...]], inputs: Sequence[torch.Tensor], key: str,
                     disagreement: Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], str | None],
                     mutated: int = 0, vouching: bool = False,
                     build: Callable[[Sequence[torch.Tensor], bool], tuple[Callable, bool]] | None = None) -> Callable:
    """`flat` traced by make_fx into one graph of aten operations (vmap and grad applied), compiled ahead
    of time (AOTInductor) and kept on disk under `key` (`aot.load_or_compile`): later batches, worker
    processes and sweeps load it instead of compiling. `flat` may update its first `mutated` inputs in
    place. The compiled function is checked against `flat` run eagerly on copies of `inputs` before it
    is used (`disagreement` of the updated inputs, then the outputs), unless the package's bytes passed
    that check before (`aot.vouched`, only with `vouching`: where `key` names all the code of the step,
    `aot.vouchable`). `build(example inputs, fresh)`, where given, makes the compiled function instead (loaded
    or compiled, and whether compiled now), as `blockwise.blockwise_step` does from its pieces. A loaded package
    that fails the check, or raises when called (another structure's inputs), is compiled again, and a step that the
    compiler got wrong is refused (ValueError), as any compile failure is. (The check runs on the values
    the graph was traced on, so it cannot see a forward that branches on its values in Python; vmap
    refuses such a forward in the eager step already.)"""
    def trace() -> torch.fx.GraphModule:  # imported here: a process that loads a package never traces
        from torch.fx.experimental.proxy_tensor import make_fx

        return make_fx(flat)(*copies())

    def copies() -> list[torch.Tensor]:
        return [t.clone() if i < mutated else t for i, t in enumerate(inputs)]

    def results(fn: Callable) -> tuple[torch.Tensor, ...]:
        args = copies()
        outputs = tuple(fn(*args))
        return (*args[:mutated], *outputs)

    with torch.no_grad():
        eager: tuple[torch.Tensor, ...] | None = None
        for fresh in (False, True):
            compiled, now = (aot.load_or_compile(key, trace, copies(), fresh=fresh) if build is None
                             else build(copies(), fresh))
            if vouching and not now and aot.vouched(key, compiled):  # loaded from bytes that passed the check before
                break
            eager = results(flat) if eager is None else eager
            try:
                problem = disagreement(eager, results(compiled))
            except Exception:  # noqa: BLE001 - a loaded package that cannot run here is stale: compiled again
                if now:
                    raise
                problem = "it failed when called"
            if problem is None:
                if vouching:
                    aot.vouch(key, compiled)
                break
            if now:  # compiled just now and still wrong: refused
                raise ValueError(f"the traced step does not reproduce the eager one ({problem})")
    return compiled


def _disagreement(eager: Sequence[torch.Tensor], got: Sequence[torch.Tensor]) -> str | None:
    """What of the compiled gradient step's outputs (a gradient per parameter, then the metrics) differs
    from the eager step's (None: nothing)."""
    if len(got) != len(eager) or not metrics_close(eager[-1], got[-1]):
        return "its metrics"
    if not gradients_close(eager[:-1], got[:-1]):
        return "its gradients"
    return None


def metrics_close(eager: torch.Tensor, got: torch.Tensor) -> bool:
    """The metrics rows (loss, accuracy, gradient norm[, z-loss]) within rounding of the eager ones; accuracy
    within 0.1, since a sample whose two top logits tie within rounding may flip and move it by 1/n (a
    batch refused for that would make the compile choice depend on which batch a process met first)."""
    if eager.shape != got.shape:
        return False
    rows = [r for r in range(len(eager)) if r != 1]
    return (torch.allclose(eager[rows], got[rows], rtol=1e-3, atol=1e-5, equal_nan=True)
            and torch.allclose(eager[1], got[1], rtol=0, atol=0.1, equal_nan=True))


def gradients_close(eager: Sequence[torch.Tensor], got: Sequence[torch.Tensor]) -> bool:
    """Each compiled gradient within 1e-3 of the eager one relative to its norm, per run, give or take
    1e-6 of the run's whole gradient norm (a gradient that is zero in exact arithmetic, as attention's
    key bias, is rounding noise in both), and non-finite exactly where the eager one is. Sums taken in
    another order move single entries that cancel far more than that, never a whole tensor; a flipped
    or swapped gradient moves it by its norm."""
    if len(eager) != len(got) or any(e.shape != g.shape for e, g in zip(eager, got)):
        return False
    if not all(torch.equal(e.isfinite(), g.isfinite()) for e, g in zip(eager, got)):
        return False
    norms, errors = [], []
    for e, g in zip(eager, got):
        finite = e.isfinite()
        e, g = (torch.where(finite, t, 0).reshape(len(t), -1).double() for t in (e, g))
        norms.append(torch.linalg.vector_norm(e, dim=1))
        errors.append(torch.linalg.vector_norm(g - e, dim=1))
    whole = torch.linalg.vector_norm(torch.stack(norms), dim=0)  # (R,): each run's gradient norm
    return all(bool((error <= 1e-3 * norm + 1e-6 * whole).all()) for norm, error in zip(norms, errors))
