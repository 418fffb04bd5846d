"""The fast engine: runs of one structure trained together through torch.func; close, not bit-exact.

    params = each run's Net's (seeded_init's draws, replayed), stacked  # (R, ...) per parameter
    grads, (loss, acc) = vmap(grad_and_value(functional_call(Net on "meta", ...)))(params, x, y)
    one vectorised optimizer update of every run, hyper-parameters as (R, 1, ...) tensors

- The model is the model's own `Net` (its `Block.forward`, its norms), called through
  `torch.func.functional_call` on a parameter-less copy, so every placement and norm kind trains here
  without a second definition.
- Each run starts exactly as the reference starts it (`seeded_init`: same weights, same data).
- The Transformer (`model.arch: transformer`) trains here the same way: token inputs, the loss read
  at the answer positions, the held-out split evaluated at train.eval_every's steps, the last, and each run's
  stopping step (val_loss, val_acc: `common.evaluates`),
  and minibatches (`data.batch_size`) gathered per run from the reference's seeded order; the text
  task's windows are each run's own, drawn as the reference draws them. A tied embedding
  (`model.tie_embeddings`) is one parameter, which `functional_call` puts in both places. qk-norm is part
  of the model; with `train.z_loss` the gradient is that of the cross-entropy plus the reference's z
  term (`common.z_loss`), recorded apart as the reference records it. A text run of many tokens a step
  (`plan.loops_runs`: 512 or more) goes run by run inside its batch, uncompiled: the model's forward on
  each run's slice of the stacked parameters, its gradient by plain autograd, as the reference computes
  it (vmap and torch.func's grad transform cost more than batching saves on ops that big); the update
  stays one vectorised step of the batch.
- Adam, AdamW, RAdam and SGD (momentum) are written as a few element-wise tensor ops with per-run
  learning rate, betas, eps, weight decay and momentum; schedules vary per run. RAdam's rectification
  is decided per run per step.
- A run whose loss turns non-finite is recorded at that step and then frozen: its gradients are
  masked out and its parameters no longer change (a `live` mask, so batch shapes stay fixed); its
  batch-mates go on. With `train.stop_on_nonfinite: false` it keeps training, as in the reference.
  A run that `train.stop_when` stops (`common.EarlyStop`, on its own recorded losses) is frozen alike.
- Compiling the step (forward, backward, grad norms, the update) is optional. `compile=None` decides
  from the planned model-steps (a pure function of the sweep, so the same sweep makes the same
  choice). The step is traced into one flat graph of aten operations (make_fx: vmap and grad
  applied, forward and backward in it; with Adam and AdamW the update too, made in place, so the
  gradients never leave the compiled code), and that graph is compiled ahead of time by AOTInductor
  into a package on disk (`aot`: once per machine, shape and code; later batches, workers and
  sweeps load it in a fraction of a second). The FFN toy as a chain, 4 blocks deep or more, with a fused
  Adam step (`plan.by_blocks`) is compiled block by block instead (`blockwise`: one forward, backward and
  update per block structure and one readout, each its own package, called in turn), a compile that does
  not grow with the depth. vmap specialises the run axis, so compiled batches are COMPILED_CHUNK runs
  (BLOCKWISE_CHUNK block by block), the last one padded: one compiled step per structure serves every batch. A
  run that stops (diverged, train.stop_when) gets the update of the step it stopped at, as every run
  gets one after the last step: nothing records it. A compile that fails
  falls back to the eager step (the batch restarts from its initial state) with one warning, and
  the structure's later batches in the process train uncompiled (a compile costs minutes).

What can change a run's bits: the runs it is batched with (kernels may block differently for other
batch sizes), compiling or not, the thread count, the device and torch build. What cannot: the sweep
running twice, the executor, resuming. Tests hold it to the reference within the reference's own
1- vs 2-thread spread (see README, "Engines").

The package, one file per job (this door hands on the public entry points; `plan` imports no torch, and
neither does importing this door):

    plan      which runs batch together, and whether their structure compiles
    mkl_path  the MKL code path a compiled sweep's worker processes take: measured once per CPU and shape
    starts    each run's start, replayed from its structure's recorded construction
    step      a batch's runs stacked, and their vmapped gradient step
    optim     the per-run optimizer, Adam's numbers
    compiled  the compiled step: traced, compiled (`aot`: kept on disk), checked, kept per process
    train     `train_fast` and its loop
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from normexp.engines.fast.mkl_path import MklPathError, requested, workers_path, workers_summary
from normexp.engines.fast.plan import (
    BLOCKWISE_CHUNK,
    COMPILED_CHUNK,
    MAX_CHUNK,
    by_blocks,
    compile_choice,
    fast_key,
    fast_serves,
    fast_unserved,
    plan_fast,
)

if TYPE_CHECKING:
    from normexp.engines.fast.train import train_fast

__all__ = ["BLOCKWISE_CHUNK", "COMPILED_CHUNK", "MAX_CHUNK", "MklPathError", "by_blocks", "compile_choice", "fast_key",
           "fast_serves", "fast_unserved", "plan_fast", "requested", "train_fast", "workers_path", "workers_summary"]


def __getattr__(name: str) -> Any:
    """`train_fast` imported when first asked for: it loads torch, which a sweep plans without."""
    if name == "train_fast":
        from normexp.engines.fast.train import train_fast

        return train_fast
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
