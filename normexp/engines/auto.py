"""`--engine auto`: of the two exact engines (bit for bit the same runs), the faster one on this machine.

The batched engine stacks runs to save per-operation overhead, but it keeps the reference's bits by
computing some things run by run (LayerNorm's backward, each run's loss, on some CPUs each Linear),
and how much stacking then saves depends on the CPU's kernels: about 3x the reference on the machine
the engines were written on, about nothing end to end on an Intel Xeon with AVX-512 and AMX (issue 29).
So `auto` measures instead of assuming, once per machine and shape:

    probe: the batch's first PROBE_RUNS runs, PROBE_STEPS steps, on each engine; the time of one
           step (the median of the steps after the first), per model-step
    batched if its time per model-step is at most MARGIN x the reference's, else the reference

Where the sweep trains small reference runs two at a time (`executors.pairs_well`: two threads fill
the cores one small run leaves idle), the reference is probed so too, two runs at once, and its time
per model-step is that pair's: a batch must beat what the reference really does in the sweep.

The probe's runs are thrown away (a second or two). Its answer is cached in one JSON file
(`choice_cache_file()`: `engine-choice.json` in $NORMEXP_CACHE_DIR, else $XDG_CACHE_HOME/normexp, else
~/.cache/normexp), keyed by the CPU (model and kernel-changing features), torch's version, the thread
count and the shape (model, norm kind, data, optimizer family, runs per batch; not the placement,
which moves no kernel: the article's four structures take two probes). A cache that cannot be read,
holds another version's entries, or an entry that is not a valid measurement, is measured again and
rewritten; the cache can only make `auto` faster to decide, never change a run (both engines give the same bits).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from normexp.config import RunConfig
from normexp.engines.batched import train_batch
from normexp.engines.common import user_cache_dir
from normexp.engines.reference import train_run
from normexp.environment import cpu_info

CACHE_VERSION = 1
MARGIN = 0.85  # batched must save at least 15% per model-step: a tie (within noise) goes to the reference
PROBE_RUNS = 4  # runs the batched probe stacks (fewer than a sweep's batch: the estimate errs toward the reference)
PROBE_STEPS = 3  # steps 0..3: the median of steps 1..3 is timed (step 0 warms the kernels)


@dataclass(frozen=True)
class Choice:
    """The exact engine `auto` takes for a shape, and the measurement it took it from."""

    engine: str  # "batched" or "reference"
    reference_ms: float  # per model-step
    batched_ms: float  # per model-step, at `runs` runs a batch
    runs: int
    paired: bool = False  # the reference probed two runs at a time, as the sweep trains it
    cached: bool = False

    def why(self) -> str:
        ratio = self.reference_ms / self.batched_ms
        source = "cached measurement" if self.cached else "measured now"
        pair = " in pairs" if self.paired else ""
        return (f"batched {self.batched_ms:.2f} ms vs reference{pair} {self.reference_ms:.2f} ms per model-step: "
                f"{ratio:.2f}x, batched needs >= {1 / MARGIN:.2f}x; {self.runs}-run probe, {source}")


def choice_cache_file() -> Path:
    folder = os.environ.get("NORMEXP_CACHE_DIR") or user_cache_dir()
    if folder is None:  # no home folder: a per-user temporary one (the cache can only save a probe)
        folder = Path(tempfile.gettempdir()) / f"normexp-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    return Path(folder) / "engine-choice.json"


def machine_key() -> str:
    """What makes a measurement this machine's: CPU, its kernel-changing features, torch, threads."""
    cpu = cpu_info()
    text = "|".join([cpu.model, cpu.features_text(), platform.machine(), torch.__version__,
                     str(torch.get_num_threads())])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def shape_key(batch: Sequence[RunConfig], paired: bool = False) -> str:
    cfg = batch[0]
    shape = {"model": cfg.model.model_dump(mode="json"), "norm": cfg.norm.kind,
             "data": cfg.data.model_dump(mode="json"), "optim": cfg.optim.name, "runs": len(batch),
             "threads": cfg.train.threads, "paired": paired}
    return machine_key() + ":" + hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def choose(batch: Sequence[RunConfig], paired: bool = False) -> Choice:
    """The exact engine for runs shaped like `batch` (equal batch keys), from the cache or measured now;
    `paired`: the sweep would train these runs' reference two at a time."""
    key = shape_key(batch, paired)
    entries = _read_cache()
    cached = _valid(entries.get(key))
    if cached is not None:
        return cached
    choice = measure(batch, paired)
    entries[key] = {k: v for k, v in asdict(choice).items() if k != "cached"}
    with contextlib.suppress(OSError):  # a cache that cannot be written costs a measurement next time
        _write_cache(entries)
    return choice


def measure(batch: Sequence[RunConfig], paired: bool = False) -> Choice:
    """Time one step per model-step of each engine on the first PROBE_RUNS runs of `batch`."""
    probe = [_probe_config(cfg) for cfg in batch[:PROBE_RUNS]]
    reference_s = _reference_seconds(probe[:2] if paired and len(probe) > 1 else probe[:1])
    batched_s = _median_step(lambda stamp: train_batch(probe, on_step=lambda *a: stamp())) / len(probe)
    engine = "batched" if batched_s <= MARGIN * reference_s else "reference"
    return Choice(engine, reference_s * 1e3, batched_s * 1e3, len(probe), paired and len(probe) > 1)


def _reference_seconds(runs: Sequence[RunConfig]) -> float:
    """Seconds per model-step of the reference training `runs` (one, or two at once in two threads)."""
    steps = [0.0] * len(runs)

    def one(index: int) -> None:
        steps[index] = _median_step(lambda stamp: train_run(runs[index], on_step=lambda *a: stamp()))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(runs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return statistics.median(steps) / len(runs)


def _probe_config(cfg: RunConfig) -> RunConfig:
    train = cfg.train.model_copy(update={"steps": PROBE_STEPS, "log_blocks": False, "stop_on_nonfinite": False,
                                         "stop_when": None})  # every probe step runs
    return cfg.model_copy(update={"train": train})


def _median_step(train) -> float:
    """The median interval between consecutive steps of `train(stamp)` (its step 0 excluded)."""
    stamps: list[float] = []
    train(lambda: stamps.append(time.perf_counter()))
    intervals = [b - a for a, b in zip(stamps, stamps[1:])]
    return statistics.median(intervals) if intervals else math.inf


def _read_cache() -> dict:
    try:
        data = json.loads(choice_cache_file().read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # RecursionError: a file of nested brackets
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("entries"), dict):
        return {}
    return data["entries"]


def _valid(entry: object) -> Choice | None:
    """The cached Choice, or None where the entry is anything but a sound measurement."""
    try:
        choice = Choice(**entry, cached=True)  # type: ignore[arg-type]
    except TypeError:
        return None
    numbers = (choice.reference_ms, choice.batched_ms)
    if (choice.engine not in ("batched", "reference") or not isinstance(choice.runs, int)
            or not isinstance(choice.paired, bool)
            or not all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in numbers)):
        return None
    expected = "batched" if choice.batched_ms <= MARGIN * choice.reference_ms else "reference"
    return choice if choice.engine == expected else None


def _write_cache(entries: dict) -> None:
    path = choice_cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False, encoding="utf-8") as f:
        try:
            json.dump({"version": CACHE_VERSION, "entries": entries}, f, indent=1, sort_keys=True)
            f.flush()
            os.replace(f.name, path)
        except BaseException:  # a full disk, a folder where the file goes, Ctrl-C: no stray .tmp left behind
            with contextlib.suppress(OSError):
                os.unlink(f.name)
            raise


def auto_summary() -> str:
    """One line for `normexp doctor`: what `auto` measured on this machine, from the cache."""
    mine = machine_key() + ":"
    choices = [c for key, entry in _read_cache().items() if key.startswith(mine) and (c := _valid(entry))]
    if not choices:
        return (f"not measured on this machine yet (a sweep measures each shape once, about a second; "
                f"cached in {choice_cache_file()})")
    batched = sum(c.engine == "batched" for c in choices)
    ratios = [c.reference_ms / c.batched_ms for c in choices]
    return (f"batched for {batched} of {len(choices)} measured shapes, the reference for the rest (batched "
            f"{min(ratios):.2f}-{max(ratios):.2f}x the reference per model-step, needs >= {1 / MARGIN:.2f}x; "
            f"{choice_cache_file()})")
