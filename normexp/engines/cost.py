"""What a run costs, before it runs: FLOPs per model-step, from its config alone (no torch). The executors
pair small runs by it; the fast engine decides whether compiling pays by it (`engines.fast.plan`), and a dry
run estimates a sweep's time from it."""

from __future__ import annotations

from collections.abc import Sequence

from normexp.config import TEXT_TASKS, RunConfig, sequence_shape


def model_step_flops(cfg: RunConfig) -> float:
    """FLOPs of one training step of one run: the forward matmuls, times 3 (forward and backward)."""
    n, d, depth = cfg.data.n_samples, cfg.model.width, cfg.model.depth
    if cfg.data.task in TEXT_TASKS:  # its windows a step
        n = cfg.data.batch_size
    hidden = d * cfg.model.hidden_mult
    if cfg.model.arch == "transformer":  # per token: FFN, q k v out, scores and mixing; the head
        t = sequence_shape(cfg.data).seq_len - 1
        return 3 * 2 * n * t * (depth * (2 * d * hidden + 4 * d * d + 2 * t * d) + d * cfg.data.vocab)
    return 3 * 2 * n * (2 * d * hidden * depth + d * cfg.model.n_classes)


def activation_bytes(cfg: RunConfig) -> int:
    """A Transformer run's float32 activations a training step keeps for its backward, roughly: per token and
    layer the norms, q k v, the attention's output, the residual stream (~8 d), the FFN's hidden layer twice
    and the attention's scores and weights (3 heads x T); then the logits. (An FFN run: its samples' layers.)"""
    n, d, depth = cfg.data.n_samples, cfg.model.width, cfg.model.depth
    if cfg.data.task in TEXT_TASKS:
        n = cfg.data.batch_size
    hidden = d * cfg.model.hidden_mult
    if cfg.model.arch == "transformer":
        t = sequence_shape(cfg.data).seq_len - 1
        return 4 * n * t * (depth * (8 * d + 2 * hidden + 3 * cfg.model.n_heads * t) + 2 * cfg.data.vocab)
    return 4 * n * depth * (2 * hidden + 6 * d)


# FLOP/s a run reaches per engine on 2 CPU cores (an AMD EPYC Zen 4, torch CPU, docs/performance.md):
# the Post-LN depth-24 width-32 phase diagram's runs. A dry run's estimate, not a promise.
ESTIMATE_FLOP_RATES = {"reference": 5e9, "batched": 5e9, "auto": 5e9, "fast": 25e9}


def estimated_seconds(runs: Sequence[RunConfig], engine: str) -> float:
    """A rough time for `runs` on `engine`: their model-steps' FLOPs at ESTIMATE_FLOP_RATES."""
    rate = ESTIMATE_FLOP_RATES.get(engine, ESTIMATE_FLOP_RATES["reference"])
    return sum(model_step_flops(cfg) * (cfg.train.steps + 1) for cfg in runs) / rate

