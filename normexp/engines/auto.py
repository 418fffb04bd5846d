"""`--engine auto`: of the two exact engines (bit for bit the same runs), the faster one on this machine.

The batched engine stacks runs to save per-operation overhead, but it keeps the reference's bits by
computing some things run by run (LayerNorm's backward, each run's loss, on some CPUs each Linear),
and how much stacking then saves depends on the CPU's kernels: about 3x the reference on the machine
the engines were written on, about nothing end to end on an Intel Xeon with AVX-512 and AMX (issue 29).
So `auto` measures instead of assuming, once per machine and shape, and it measures on the sweep's own
runs, so that the measurement trains nothing the sweep would not train anyway:

    a shape without a cached choice: the first REFERENCE_RUNS runs of its first batch train on the
        reference (two at once where the sweep trains its reference runs in pairs: `executors.pairs_well`),
        the next runs of that batch (at most BATCHED_RUNS) as one batch on the batched engine
    each engine's time per model-step: the median interval between its consecutive steps (step 0, which
        warms the kernels, excluded), over the model-steps it advances at once (2 for a pair, R for a batch)
    the shape's other runs: batched if its time per model-step is at most MARGIN x the reference's, else
        the reference

Every run of the measurement is a result the sweep keeps: both engines give the same bits, whatever
runs a batch holds, and each run's done.json records the engine that trained it (a resumed sweep keeps
the runs of either exact engine). A shape whose batches hold fewer than MIN_RUNS runs is not measured:
it trains on the reference (a batch that small saves little, and a pair and a batch of two would
measure little). The plan of those units is `units.AutoPlan`'s.

The answer is cached in one JSON file (`choice_cache_file()`: `engine-choice.json` in $NORMEXP_CACHE_DIR,
else $XDG_CACHE_HOME/normexp, else ~/.cache/normexp), keyed by the CPU (model and kernel-changing
features), torch's version, the thread count and the shape (model, norm kind, data, optimizer family,
runs per batch, the reference paired or not; not the placement, which moves no kernel: the article's
four structures are two shapes), so that a later sweep of the shape trains every run on the chosen
engine from the start. A cache that cannot be read, holds another version's entries, or an entry that
is not a valid measurement, is measured again and rewritten; the cache can only make `auto` decide
sooner, never change a run (both engines give the same bits).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from normexp.config import RunConfig
from normexp.engines.cache import cache_folder, read_entries, write_entries
from normexp.environment import cpu_info

CACHE_VERSION = 3  # 3: keyed by the OpenMP wait policy too (2: measured on a sweep's own runs; 1: a probe)
MARGIN = 0.85  # batched must save at least 15% per model-step: a tie (within noise) goes to the reference
REFERENCE_RUNS = 2  # a shape's first runs, on the reference: a pair where the sweep pairs reference runs
BATCHED_RUNS = 14  # at most this many of the next runs, batched: the article's 16-run batch whole, and a
# bound on what a CPU where stacking does not pay loses to measuring it (smaller than the sweep's
# batches of up to 64 runs: the estimate errs toward the reference, which a bigger batch only beats by more)
MIN_RUNS = REFERENCE_RUNS + 2  # runs a batch needs for its shape to be measured; fewer: the reference


@dataclass(frozen=True)
class Choice:
    """The exact engine `auto` takes for a shape, and the measurement it took it from."""

    engine: str  # "batched" or "reference"
    reference_ms: float  # per model-step
    batched_ms: float  # per model-step, at `runs` runs a batch
    runs: int  # runs of the batched measurement
    paired: bool = False  # the reference was timed two runs at a time, as the sweep trains it
    cached: bool = False

    def why(self) -> str:
        ratio = self.reference_ms / self.batched_ms
        source = "a cached measurement" if self.cached else "measured on this sweep's first runs"
        pair = " in pairs" if self.paired else ""
        return (f"batched {self.batched_ms:.2f} ms vs reference{pair} {self.reference_ms:.2f} ms per model-step: "
                f"{ratio:.2f}x, batched needs >= {1 / MARGIN:.2f}x; {self.runs} runs batched, {source}")


def choice_cache_file() -> Path:
    return cache_folder() / "engine-choice.json"


def machine_key() -> str:
    """What makes a measurement this machine's: CPU, its kernel-changing features, torch, threads, how
    idle OpenMP threads wait (asleep at once, batched steps paid a wake-up per kernel:
    environment.set_thread_defaults), and MKL's code path where the user chose Intel's (NORMEXP_MKL_PATH)."""
    cpu = cpu_info()
    waiting = [os.environ.get(name, "") for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")]
    mkl = os.environ.get("NORMEXP_MKL_PATH", "").strip().lower()
    text = "|".join([cpu.model, cpu.features_text(), platform.machine(), torch.__version__,
                     str(torch.get_num_threads()), *waiting, *([f"mkl {mkl}"] if mkl == "intel" else [])])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def shape_key(batch: Sequence[RunConfig], paired: bool = False) -> str:
    cfg = batch[0]
    shape = {"model": cfg.model.model_dump(mode="json"), "norm": cfg.norm.kind,
             "data": cfg.data.model_dump(mode="json"), "optim": cfg.optim.name, "runs": len(batch),
             "threads": cfg.train.threads, "paired": paired}
    return machine_key() + ":" + hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def cached(batch: Sequence[RunConfig], paired: bool = False) -> Choice | None:
    """The cached choice for runs shaped like `batch` (equal batch keys), or None where there is none
    sound; `paired`: the sweep trains these runs' reference two at a time."""
    return _valid(_read_cache().get(shape_key(batch, paired)))


def decide(batch: Sequence[RunConfig], paired: bool, reference_s: float, batched_s: float, runs: int) -> Choice:
    """The engine for runs shaped like `batch`, from each engine's measured seconds per model-step
    (`runs`: the batched measurement's); cached for later sweeps."""
    engine = "batched" if batched_s <= MARGIN * reference_s else "reference"
    choice = Choice(engine, reference_s * 1e3, batched_s * 1e3, runs, paired)
    entries = _read_cache()
    entries[shape_key(batch, paired)] = {k: v for k, v in asdict(choice).items() if k != "cached"}
    with contextlib.suppress(OSError):  # a cache that cannot be written: the next sweep measures again
        _write_cache(entries)
    return choice


def _read_cache() -> dict:
    return read_entries(choice_cache_file(), CACHE_VERSION)


def _valid(entry: object) -> Choice | None:
    """The cached Choice, or None where the entry is anything but a sound measurement."""
    try:
        choice = Choice(**entry, cached=True)  # type: ignore[arg-type]
    except TypeError:
        return None
    numbers = (choice.reference_ms, choice.batched_ms)
    if (choice.engine not in ("batched", "reference") or not isinstance(choice.runs, int)
            or not isinstance(choice.paired, bool)
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
                       for x in numbers)):
        return None
    expected = "batched" if choice.batched_ms <= MARGIN * choice.reference_ms else "reference"
    return choice if choice.engine == expected else None


def _write_cache(entries: dict) -> None:
    write_entries(choice_cache_file(), CACHE_VERSION, entries)


def auto_summary() -> str:
    """One line for `normexp doctor`: what `auto` measured on this machine, from the cache."""
    mine = machine_key() + ":"
    choices = [c for key, entry in _read_cache().items() if key.startswith(mine) and (c := _valid(entry))]
    if not choices:
        return (f"not measured on this machine yet (a sweep measures each shape on its own first runs, at no "
                f"extra cost; cached in {choice_cache_file()})")
    batched = sum(c.engine == "batched" for c in choices)
    ratios = [c.reference_ms / c.batched_ms for c in choices]
    return (f"batched for {batched} of {len(choices)} measured shapes, the reference for the rest (batched "
            f"{min(ratios):.2f}-{max(ratios):.2f}x the reference per model-step, needs >= {1 / MARGIN:.2f}x; "
            f"{choice_cache_file()})")
