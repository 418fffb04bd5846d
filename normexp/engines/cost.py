"""What a run costs, before it runs: FLOPs per model-step, from its config alone (no torch). The executors
pair small runs by it; the fast engine decides whether compiling pays by it (`should_compile`), which a sweep
asks before it imports torch, to start its worker processes first (`sweep.fast_pool`)."""

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


# FLOP/s a run reaches per engine on 2 CPU cores (an AMD EPYC Zen 4, torch CPU, docs/performance.md):
# the Post-LN depth-24 width-32 phase diagram's runs. A dry run's estimate, not a promise.
ESTIMATE_FLOP_RATES = {"reference": 5e9, "batched": 5e9, "auto": 5e9, "fast": 25e9}


def estimated_seconds(runs: Sequence[RunConfig], engine: str) -> float:
    """A rough time for `runs` on `engine`: their model-steps' FLOPs at ESTIMATE_FLOP_RATES."""
    rate = ESTIMATE_FLOP_RATES.get(engine, ESTIMATE_FLOP_RATES["reference"])
    return sum(model_step_flops(cfg) * (cfg.train.steps + 1) for cfg in runs) / rate


COMPILE_ESTIMATE_S = 100.0  # a cold compile of the phase grid's depth-24 Adam step (Intel Xeon, 2 cores: 104 s)
COMPILE_SPEEDUP = 1.8  # compiled vs eager, per run end to end (1024 phase-grid runs: 55.6 vs 98.1 ms)
EAGER_FLOP_RATE = 40e9  # FLOP/s the fast engine's eager step reaches on the article's model (CPU), for the estimate


def fast_key(cfg: RunConfig) -> tuple:
    """Runs with equal keys train in one batch of the fast engine: same model, norm, data, steps and optimizer
    family; seeds, learning rates, optimizer hyper-parameters and schedules vary per run."""
    return (cfg.model, cfg.norm, cfg.data, cfg.optim.name, cfg.train)


def compile_pays(model_steps: int, eager_s_per_model_step: float, compile_s: float = COMPILE_ESTIMATE_S,
                 speedup: float = COMPILE_SPEEDUP) -> bool:
    """True when compiling saves more time than it costs: the eager time of `model_steps`, minus the
    same work compiled, exceeds the compile time."""
    return model_steps * eager_s_per_model_step * (1 - 1 / speedup) > compile_s


def should_compile(cfg: RunConfig, model_steps: int) -> bool:
    """The fast engine's automatic choice for `model_steps` planned model-steps of runs shaped like `cfg`: an
    estimate from the model's FLOPs, not a measurement, so the same sweep always chooses the same."""
    return compile_pays(model_steps, model_step_flops(cfg) / EAGER_FLOP_RATE)
