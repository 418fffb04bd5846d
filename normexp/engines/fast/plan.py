"""Which runs the fast engine trains together, and in what batch sizes (no torch: a sweep plans its batches,
and decides on its worker pool, before it imports torch)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from normexp.config import RunConfig
from normexp.engines.cost import fast_key

MAX_CHUNK = 64  # runs per uncompiled batch; larger batches gain little on a CPU and hold more activations
COMPILED_CHUNK = 8  # runs per compiled batch: 8 runs' parameters, moments and activations stay nearer the cache
# than 16's, with two workers sharing it (a 2,048-run phase sweep 90.3 vs 99.0 s, metrics identical; 4 runs no faster
# than 8, 32 slower than 16: docs/performance.md)


def plan_fast(runs: Sequence[RunConfig], compiled: Callable[[RunConfig], bool] = lambda cfg: False
              ) -> list[list[RunConfig]]:
    """Group runs by `fast_key`, in chunks of at most MAX_CHUNK runs, or COMPILED_CHUNK for a structure
    that `compiled` says compiles (a group of one is a batch too)."""
    groups: dict[tuple, list[RunConfig]] = {}
    for cfg in runs:
        groups.setdefault(fast_key(cfg), []).append(cfg)
    return [group[i:i + size] for group in groups.values()
            for size in [COMPILED_CHUNK if compiled(group[0]) else MAX_CHUNK] for i in range(0, len(group), size)]

