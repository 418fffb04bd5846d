"""Which runs the fast engine trains together, and whether their step compiles (no torch: a sweep plans its
batches, and decides on its worker pool, before it imports torch).

Compiling is decided once per structure (`fast_key`) from the model-steps the sweep plans for it, an estimate
from the model's FLOPs (`compile_choice`): a pure function of the planned runs, so the same sweep always
makes the same choice, whatever the compile cache holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from normexp.config import TEXT_TASKS, OptimConfig, RunConfig, sequence_shape
from normexp.engines.cost import activation_bytes, model_step_flops
from normexp.registry import is_plugin

MAX_CHUNK = 64  # runs per uncompiled batch; larger batches gain little on a CPU and hold more activations
COMPILED_CHUNK = 8  # runs per compiled batch: 8 runs' parameters, moments and activations stay nearer the cache
# than 16's, with two workers sharing it (a 2,048-run phase sweep 90.3 vs 99.0 s, metrics identical; 4 runs no faster
# than 8, 32 slower than 16: docs/performance.md)
# runs per batch of a step compiled block by block (`by_blocks`): its ~70 calls a step over twice the runs (on an
# AMD Zen 4, 8 runs trained 11% slower a run than the whole graph's 8, 16 as fast: docs/performance.md)
BLOCKWISE_CHUNK = 16
BLOCKWISE_DEPTH = 4  # a shallower chain compiles whole in seconds, and its step makes fewer calls
FUSED_OPTIMIZERS = ("adam", "adamw")  # compiled steps carry their update: `adam_update`, one pass over the state

TEXT_CHUNK_BYTES = 2**30  # an uncompiled text batch's activations: a step reads thousands of tokens a run (a
# 12-layer, 64-wide run's 32 windows of 64 characters: ~180 MB), so its runs are chunked by memory, not MAX_CHUNK

LOOPED_TOKENS = 512  # a text run's tokens a step (data.batch_size x data.seq_len) from which the uncompiled step
# goes run by run (`loops_runs`): at depth 12, width 64 (ms a run-step, vmapped / run by run / the reference), 256
# tokens 28 / 31 / 28, 512 tokens 54 / 47 / 43, 2,048 tokens 225 / 171 / 168 (docs/performance.md)

COMPILE_ESTIMATE_S = 100.0  # a cold compile of the phase grid's depth-24 Adam step (Intel Xeon, 2 cores: 104 s)
BLOCKWISE_COMPILE_ESTIMATE_S = 35.0  # the same step compiled block by block (`by_blocks`; AMD Zen 4: 32-36 s)
COMPILE_SPEEDUP = 1.8  # compiled vs eager, per run end to end (1024 phase-grid runs: 55.6 vs 98.1 ms)
EAGER_FLOP_RATE = 40e9  # FLOP/s the fast engine's eager step reaches on the article's model (CPU), for the estimate


# Optimizer keys the fast engine does not replay yet: a run that sets one away from its default trains on the
# exact engines instead (`fast_serves`), as a run with train.log_blocks does.
FAST_UNSERVED_OPTIM: tuple[str, ...] = ()


def fast_serves(cfg: RunConfig) -> bool:
    """Whether the fast engine trains `cfg` as the exact engines define it: not with train.log_blocks
    (blocks.csv is the reference's bits or nothing), nor train.log_sharpness (the reference measures it), nor
    with an optimizer key of FAST_UNSERVED_OPTIM set."""
    return not fast_unserved(cfg)


def fast_unserved(cfg: RunConfig) -> list[str]:
    """The keys set in `cfg` that the fast engine does not serve (see `fast_serves`), e.g. ['train.log_blocks']."""
    defaults = OptimConfig.model_fields
    return ([*(["train.log_blocks"] if cfg.train.log_blocks else []),
             *(["train.log_sharpness"] if cfg.train.log_sharpness is not None else []),
             *(f"optim.{key}" for key in FAST_UNSERVED_OPTIM if getattr(cfg.optim, key) != defaults[key].default)])


def fast_key(cfg: RunConfig) -> tuple:
    """Runs with equal keys train in one batch of the fast engine: same model, norm, data, steps and optimizer
    family and the optimizer's controls that shape its step (`optim_structure`); seeds, learning rates,
    optimizer hyper-parameters (clipping thresholds, independent weight decay among them) and schedules vary
    per run."""
    return (cfg.model, cfg.norm, cfg.data, optim_structure(cfg.optim), cfg.train)


def optim_structure(optim: OptimConfig) -> tuple:
    """What a fast batch's runs share of their optimizer: its family, whether clipping by the global norm
    acts (its threshold is per run), whether AGC acts (its factor and eps are per run), Adam-2k's k and
    GI-Adam's v0, RAdam's variant."""
    return (optim.name, optim.clip_norm is not None, optim.agc is not None, optim.v_only_steps, optim.v0,
            optim.radam_variant)


def compile_pays(model_steps: int, eager_s_per_model_step: float, compile_s: float = COMPILE_ESTIMATE_S,
                 speedup: float = COMPILE_SPEEDUP) -> bool:
    """True when compiling saves more time than it costs: the eager time of `model_steps`, minus the
    same work compiled, exceeds the compile time."""
    return model_steps * eager_s_per_model_step * (1 - 1 / speedup) > compile_s


def should_compile(cfg: RunConfig, model_steps: int) -> bool:
    """The fast engine's automatic choice for `model_steps` planned model-steps of runs shaped like `cfg`: an
    estimate from the model's FLOPs, not a measurement, so the same sweep always chooses the same; a step
    compiled block by block costs less to compile (BLOCKWISE_COMPILE_ESTIMATE_S)."""
    compile_s = BLOCKWISE_COMPILE_ESTIMATE_S if by_blocks(cfg) else COMPILE_ESTIMATE_S
    return compile_pays(model_steps, model_step_flops(cfg) / EAGER_FLOP_RATE, compile_s)


def structures(planned: Iterable[RunConfig]) -> dict[tuple, tuple[RunConfig, int]]:
    """Each structure (`fast_key`) of the `planned` runs: its first run and the model-steps planned for it."""
    found: dict[tuple, tuple[RunConfig, int]] = {}
    for cfg in planned:
        key = fast_key(cfg)
        first, model_steps = found.get(key, (cfg, 0))
        found[key] = (first, model_steps + cfg.train.steps + 1)
    return found


def compile_choice(planned: Iterable[RunConfig], compile: bool | None = None) -> dict[tuple, bool]:
    """Whether each structure (`fast_key`) of the `planned` runs compiles: `compile` where it is given (--compile,
    --no-compile), else whether the model-steps planned for it pay for the compile (`should_compile`)."""
    return {key: should_compile(cfg, model_steps) if compile is None else compile
            for key, (cfg, model_steps) in structures(planned).items()}


def plan_fast(runs: Sequence[RunConfig], compiled: Callable[[RunConfig], bool] = lambda cfg: False
              ) -> list[list[RunConfig]]:
    """Group runs by `fast_key`, in chunks of at most `chunk_runs` runs (a group of one is a batch too)."""
    groups: dict[tuple, list[RunConfig]] = {}
    for cfg in runs:
        groups.setdefault(fast_key(cfg), []).append(cfg)
    return [group[i:i + size] for group in groups.values()
            for size in [chunk_runs(group[0], compiled(group[0]))] for i in range(0, len(group), size)]


def loops_runs(cfg: RunConfig) -> bool:
    """Whether the uncompiled step of `cfg`'s structure computes its runs one after another, each by plain
    autograd through the model's own forward (`step.run_by_run`), rather than vmapped: a text task with
    LOOPED_TOKENS tokens a step or more, where each op is big enough that batching runs saves nothing and
    torch.func's transforms cost a quarter of the step."""
    return cfg.data.task in TEXT_TASKS and cfg.data.batch_size * (sequence_shape(cfg.data).seq_len - 1) >= LOOPED_TOKENS


def fuses(cfg: RunConfig) -> bool:
    """Whether the compiled step of `cfg`'s runs carries their update (`adam_update`): Adam and AdamW
    (optim.independent_weight_decay is a number of `adam_hypers`), not with a control that acts between the
    gradient and the update or changes the update's form (optim.clip_norm, optim.agc, optim.v_only_steps,
    optim.v0: the compiled gradient step, then `FastOptimizer`)."""
    optim = cfg.optim
    return (optim.name in FUSED_OPTIMIZERS and optim.clip_norm is None and optim.agc is None
            and optim.v_only_steps == 0 and optim.v0 == "zero")


def by_blocks(cfg: RunConfig) -> bool:
    """Whether the compiled step of `cfg`'s structure is compiled block by block (engines/fast/blockwise.py):
    the FFN toy as a chain (its input to the first block as it is: no Peri-LN input norm; one stream: not
    ResiDual's two; a placement of normexp's own, not a user's), BLOCKWISE_DEPTH blocks or more, trained by a
    fused Adam step (`fuses`; its loss is the reference's: train.z_loss is the Transformer's alone). Anything
    else is compiled whole."""
    norm = cfg.norm
    return (cfg.model.arch == "ffn" and cfg.model.depth >= BLOCKWISE_DEPTH and fuses(cfg)
            and norm.placement != "resdual" and not (norm.placement == "peri" and norm.peri_input_norm)
            and not is_plugin(norm.placement))


def chunk_runs(cfg: RunConfig, compiled: bool) -> int:
    """Runs per batch of `cfg`'s structure where its step compiles: BLOCKWISE_CHUNK compiled block by block,
    else COMPILED_CHUNK; uncompiled MAX_CHUNK, or for the text task as many as TEXT_CHUNK_BYTES of activations
    hold (`activation_bytes`), at least one."""
    if compiled:
        return BLOCKWISE_CHUNK if by_blocks(cfg) else COMPILED_CHUNK
    if cfg.data.task in TEXT_TASKS:
        return max(1, min(MAX_CHUNK, TEXT_CHUNK_BYTES // activation_bytes(cfg)))
    return MAX_CHUNK
