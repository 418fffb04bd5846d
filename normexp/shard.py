"""Shards of a sweep (`normexp sweep CONFIG --shard I/N`): a deterministic slice of its plan, for a job
array's task I of N (Slurm's `--array=0-{N-1}`; normexp/launch.py submits one).

The sweep's work units are planned over ALL of its runs, as an unsharded sweep plans them (whole batches
for the batched and fast engines, single runs for the reference), then dealt out: largest first (model-
steps), each to the least loaded shard (ties: the lowest index). So a shard trains whole batches of the
unsharded plan, its runs' bits equal the unsharded sweep's, and the N shards together train every run
once, whatever the others have finished. Shards run at once into one folder on a shared file system
(each holds the folder's lock shared and writes only its own runs: store.SweepLock), or each into its
own folder, joined afterwards by `normexp merge`.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Sequence

from normexp.config import ConfigError, RunConfig
from normexp.folder import run_id

SHARD = re.compile(r"\s*(?P<index>\d+)\s*/\s*(?P<count>\d+)\s*")


def parse_shard(text: str) -> tuple[int, int]:
    """`I/N` -> (I, N), I counted from 0 (Slurm's $SLURM_ARRAY_TASK_ID); ConfigError if malformed."""
    match = SHARD.fullmatch(text)
    if match is None:
        raise ConfigError(f"--shard {text}: expected I/N, the shard I (from 0) of N, e.g. --shard 0/4")
    index, count = int(match["index"]), int(match["count"])
    if count < 1 or index >= count:
        raise ConfigError(f"--shard {text}: I must be from 0 to N - 1 (shards are counted from 0), N >= 1")
    return index, count


def shard_runs(runs: Sequence[RunConfig], engine: str, index: int, count: int,
               compile: bool | None = None) -> list[RunConfig]:
    """The runs of shard `index` of `count`, in the sweep's order (see the module docstring). `engine`:
    the sweep's (auto plans as batched); `compile`: its --compile/--no-compile (None: decided per structure,
    as the sweep decides it), so that a compiled fast sweep is dealt out by the compiled batches it trains
    (COMPILED_CHUNK runs), not by the larger uncompiled ones."""
    mine = {run_id(cfg) for unit in deal_units(runs, engine, count, compile).get(index, []) for cfg in unit}
    return [cfg for cfg in runs if run_id(cfg) in mine]


def deal_units(runs: Sequence[RunConfig], engine: str, count: int,
               compile: bool | None = None) -> dict[int, list[list[RunConfig]]]:
    """Shard index -> its work units (each the runs trained together), as `shard_runs` deals them; a shard
    dealt nothing (N past the number of units) is absent."""
    from normexp.units import plan_units

    engine = engine if engine in ("reference", "fast") else "batched"
    units = plan_units(runs, engine, "cpu", 1, compile=compile, planned=runs)
    cost = [sum(c["train"]["steps"] + 1 for c in unit.configs) for unit in units]
    # the least loaded shard, ties to the lowest index, from a heap: bounded time whatever N (past one shard
    # per unit the others get nothing: every cost is > 0, so a unit always goes to an empty shard first)
    heap, dealt = [(0, i) for i in range(min(count, len(units)))], {}
    for k in sorted(range(len(units)), key=lambda k: -cost[k]):  # stable: plan order among equals
        load, shard = heapq.heappop(heap)
        heapq.heappush(heap, (load + cost[k], shard))
        dealt.setdefault(shard, []).append(units[k].runs)
    return dealt
