"""Which MKL code path a compiled fast sweep's worker processes take: measured once per CPU, torch build and shape.

MKL asks once per process, at its first call, whether the CPU is Intel's; on any other it takes its generic
path whatever the CPU's ISA (on an AMD Zen 4 with AVX-512: AVX2 kernels that copy both operands of every small
product first, ~half of the compiled step's matrix time: docs/performance.md). The workers of a compiled fast
sweep (`sweep.fast_pool`) are processes normexp starts, so each can take MKL's Intel path from its first
instruction (`environment.take_mkl_intel_path`), and only the fast engine trains in them. Whether that path is
faster is the CPU's, so it is measured, not assumed:

    the shape: the sweep's compiled structure with the most planned model-steps, in its compiled batch size;
        measured only where the sweep's compiled training (estimated from its FLOPs) is long enough that the
        smallest gain taken (1 - MARGIN) repays the measurement's ~MEASURE_CPU_S
    the measurement: two fresh processes, one on each path, one thread each (as a worker), each records the
        matrix products of one eager step of that batch (their shapes and strides, `torch.ops.aten` mm, bmm,
        addmm, baddbmm) and times them replayed, in turns with the other (`measure`); the median pass of each
    the choice: Intel's path where its pass takes at most MARGIN of MKL's own; else MKL's own
    cached in `mkl-path.json` (beside `engine-choice.json`), keyed by the CPU, torch's version and the shape,
        so later sweeps, and a resumed one, take the same path without measuring

On an Intel CPU MKL's own path is Intel's: nothing is measured. The path changes only the last bits of the
fast runs trained in the workers (another kernel, another order of summation: within the fast engine's
contract, as the batch size or compiling do, docs/fast-contract.md); a sweep with a run the fast engine leaves
to the exact engines (`plan.fast_unserved`), which trains in the same workers, keeps MKL's own path there, and
the sweep's own process never takes it. `NORMEXP_MKL_PATH` overrides the measurement: `intel` (every normexp
process takes Intel's path, the exact engines' included: `environment.set_thread_defaults`) or `own` (the
workers too keep MKL's own choice).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from normexp.config import RunConfig
from normexp.engines.cache import cache_folder, locked, read_entries, write_entries
from normexp.engines.cost import model_step_flops
from normexp.engines.fast.plan import (
    COMPILE_SPEEDUP,
    EAGER_FLOP_RATE,
    chunk_runs,
    compile_choice,
    fast_key,
    fast_serves,
    fast_unserved,
    structures,
)
from normexp.environment import MKL_PATH_VARIABLE, cpu_info, mkl_intel_library

CACHE_VERSION = 1
MARGIN = 0.95  # Intel's path must save at least 5% of the products' time: a tie (within noise) keeps MKL's own
ROUNDS, PASSES = 4, 3  # the two processes time in turns: ROUNDS rounds of PASSES replayed passes each
RECORDED_DEPTH = 4  # the step recorded at this depth at most: deeper blocks repeat the same products, and the
# choice reads the two paths' ratio (a depth-24 step's products: 1.25x; recording it took ~1 s more a process)
MEASURE_CPU_S = 4.0  # what measuring costs: two processes, each ~2 s of a core (torch's import, one eager step)
TIMEOUT_S = 300.0  # a measurement that takes longer is killed (and MKL's own path kept)
CHOICES = ("intel", "own")


class MklPathError(ValueError):
    """NORMEXP_MKL_PATH holds something else than `intel` or `own`."""


@dataclass(frozen=True)
class PathChoice:
    """The MKL path of a compiled fast sweep's workers, and why."""

    intel: bool
    own_ms: float = 0.0  # one pass of the step's products on each path (0: not measured)
    intel_ms: float = 0.0
    source: str = "measured"  # measured, cached, NORMEXP_MKL_PATH, an Intel CPU

    def why(self) -> str:
        if not self.own_ms:
            return self.source
        ratio = self.own_ms / self.intel_ms if self.intel_ms else 0.0
        return (f"its products {self.intel_ms:.2f} vs {self.own_ms:.2f} ms on MKL's own path: {ratio:.2f}x, "
                f"needs >= {1 / MARGIN:.2f}x; {self.source}")

    def note(self) -> str:
        """What the sweep's engine line says."""
        path = "Intel's" if self.intel else "its own choice"
        return f"; MKL's path in the workers: {path} ({self.why()})"


def requested() -> str | None:
    """The user's NORMEXP_MKL_PATH (`intel`, `own`), None where it is unset or empty; anything else raises."""
    value = os.environ.get(MKL_PATH_VARIABLE, "").strip().lower()
    if not value:
        return None
    if value not in CHOICES:
        raise MklPathError(f"{MKL_PATH_VARIABLE}={os.environ[MKL_PATH_VARIABLE]!r}: expected one of "
                           f"{', '.join(CHOICES)} (or unset: measured for a compiled fast sweep's workers)")
    return value


def workers_path(runs: Sequence[RunConfig], compile: bool | None = None,
                 notify: Callable[[str], None] | None = None) -> PathChoice:
    """The MKL path for the workers that train `runs` (the sweep's planned runs, the fast engine's, compiled as
    `compile_choice` decides); measured where neither the user nor the cache decides (a few seconds, once:
    `notify` is told first). A measurement that fails leaves MKL's own path, uncached, and says why."""
    asked = requested()
    if asked is not None:
        return PathChoice(asked == "intel", source=f"{MKL_PATH_VARIABLE}={asked}")
    if cpu_info().ident.startswith("GenuineIntel"):
        return PathChoice(False, source="an Intel CPU: MKL's own path is Intel's")
    choice = _decide(runs, compile, notify)
    if choice.intel and isinstance(why := mkl_intel_library(), str):  # a cached choice, the compiler gone since
        return PathChoice(False, choice.own_ms, choice.intel_ms, f"MKL's own: Intel's cannot be taken here ({why})")
    return choice


def _decide(runs: Sequence[RunConfig], compile: bool | None, notify: Callable[[str], None] | None) -> PathChoice:
    """`workers_path` past the user's choice and an Intel CPU: the runs' exact engines, the cache, the measurement."""
    declined = sorted({key for cfg in runs for key in fast_unserved(cfg)})
    if declined:  # the exact engines train these in the same workers: their bits must not move
        return PathChoice(False, source=f"MKL's own: runs with {', '.join(declined)} train on the exact engines "
                                        "in the workers")
    compiled = compiled_runs(runs, compile)
    cfg = dominant_structure(compiled)
    if cfg is None:
        return PathChoice(False, source="no compiled structure to measure")
    size = chunk_runs(cfg, True)
    key = cache_key(cfg, size)
    if (cached := _cached(key)) is not None:
        return cached
    work = compiled_seconds(compiled)
    if work * (1 - MARGIN) < MEASURE_CPU_S:
        return PathChoice(False, source=f"MKL's own: not measured, ~{work:.0f} s of compiled training (estimated) "
                                        f"would not repay measuring (~{MEASURE_CPU_S:.0f} s of CPU)")
    with contextlib.ExitStack() as lock:
        with contextlib.suppress(OSError):  # a cache folder that cannot hold the lock: measured unlocked
            lock.enter_context(locked(cache_file().with_suffix(".lock")))  # a sweep beside this one waits, reads
        if (cached := _cached(key)) is not None:
            return cached
        if notify is not None:
            notify("measuring MKL's two code paths on the step's matrix products, for the workers (once per CPU, "
                   "torch build and shape)")
        try:
            own, intel = measure(cfg, size)
        except (OSError, RuntimeError, ValueError, KeyError, subprocess.SubprocessError) as exc:
            return PathChoice(False, source=f"MKL's own: measuring failed ({type(exc).__name__}: {str(exc)[:200]})")
        entries = _read_cache()
        entries[key] = {"own_ms": own, "intel_ms": intel}
        try:
            write_entries(cache_file(), CACHE_VERSION, entries)
            source = "measured now, cached"
        except OSError as exc:  # a cache that cannot be written: the next sweep measures again
            source = f"measured now, not cached ({type(exc).__name__}: {str(exc)[:200]})"
    return PathChoice(intel <= MARGIN * own, own, intel, source)


def _cached(key: str) -> PathChoice | None:
    """The choice the cache's sound entry `key` makes, or None."""
    entry = _read_cache().get(key)
    if not (isinstance(entry, dict) and _sound(entry)):
        return None
    own, intel = float(entry["own_ms"]), float(entry["intel_ms"])
    return PathChoice(intel <= MARGIN * own, own, intel, "a cached measurement")


def compiled_runs(runs: Sequence[RunConfig], compile: bool | None = None) -> list[RunConfig]:
    """The runs of `runs` the fast engine trains with a compiled step (`compile_choice`, as the sweep's plan
    decides)."""
    served = [cfg for cfg in runs if fast_serves(cfg)]
    choice = compile_choice(served, compile)
    return [cfg for cfg in served if choice[fast_key(cfg)]]


def compiled_seconds(compiled: Sequence[RunConfig]) -> float:
    """CPU seconds the `compiled` runs (`compiled_runs`) train for, estimated from their FLOPs as the plan
    estimates (`plan.should_compile`; on the Zen 4 of docs/performance.md the phase grid's ~131 s estimated took
    ~200)."""
    return sum((cfg.train.steps + 1) * model_step_flops(cfg) / EAGER_FLOP_RATE / COMPILE_SPEEDUP for cfg in compiled)


def dominant_structure(compiled: Sequence[RunConfig]) -> RunConfig | None:
    """The first of the `compiled` runs (`compiled_runs`) of the structure (`fast_key`) with the most planned
    model-steps; None where there is none."""
    found = structures(compiled).values()
    return max(found, key=lambda structure: structure[1])[0] if found else None


def machine_key() -> str:
    """The CPU (model, kernel-changing features) and torch's version (read from its metadata: torch stays
    unloaded in a sweep's process until its workers have started)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "?"
    cpu = cpu_info()
    text = json.dumps([cpu.model, cpu.ident, cpu.features_text(), torch_version])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_key(cfg: RunConfig, size: int) -> str:
    """This machine's key and the shape's: what the step's products are."""
    shape = {"model": cfg.model.model_dump(mode="json"), "norm": cfg.norm.model_dump(mode="json"),
             "data": cfg.data.model_dump(mode="json"), "optim": cfg.optim.name, "runs": size}
    return machine_key() + ":" + hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def measure(cfg: RunConfig, size: int) -> tuple[float, float]:
    """Milliseconds of one pass of the step's products on MKL's own path and on Intel's, each in a fresh process
    (the path is fixed at a process's first product). The two start together (importing torch, recording the
    products: ~3 s), then time in turns, ROUNDS rounds of PASSES passes each, the other one idle meanwhile, so
    that neither slows the other and a machine's drift falls on both alike; the median pass of each. Raises
    where a process fails or takes over TIMEOUT_S."""
    shallow = cfg.model_copy(update={"model": cfg.model.model_copy(update={"depth": min(cfg.model.depth,
                                                                                       RECORDED_DEPTH)})})
    spec = json.dumps({"cfg": shallow.model_dump(mode="json"), "runs": size})
    children = {path: subprocess.Popen([sys.executable, "-c",
                                        "from normexp.engines.fast.mkl_path import _child; _child()"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, env={**os.environ, MKL_PATH_VARIABLE: path})
                for path in ("own", "intel")}
    watchdog = threading.Timer(TIMEOUT_S, lambda: [child.kill() for child in children.values()])
    watchdog.start()
    try:
        for child in children.values():
            child.stdin.write(spec + "\n")  # type: ignore[union-attr]
            child.stdin.flush()  # type: ignore[union-attr]
        for path, child in children.items():
            _answer(path, child)  # "ready": recorded
        passes: dict[str, list[float]] = {path: [] for path in children}
        for _ in range(ROUNDS):
            for path, child in children.items():
                child.stdin.write("go\n")  # type: ignore[union-attr]
                child.stdin.flush()  # type: ignore[union-attr]
                times = json.loads(_answer(path, child))
                if not (isinstance(times, list) and times and all(type(t) in (int, float) for t in times)):
                    raise ValueError(f"measuring MKL's {path} path: {times!r:.200} is no list of seconds")
                passes[path] += times
        for child in children.values():
            child.stdin.close()  # type: ignore[union-attr]
            child.wait()
    finally:
        watchdog.cancel()
        for child in children.values():
            if child.poll() is None:
                child.kill()
            child.wait()
    return statistics.median(passes["own"]) * 1e3, statistics.median(passes["intel"]) * 1e3


def _answer(path: str, child: subprocess.Popen) -> str:
    line = child.stdout.readline()  # type: ignore[union-attr]
    if not line:
        child.kill()
        raise RuntimeError(f"measuring MKL's {path} path failed: "
                           f"{(child.stderr.read() or 'no output').strip()[-500:]}")  # type: ignore[union-attr]
    return line


def _child() -> None:
    """A measuring process: records the matrix products of one eager step of the batch it is sent (one line of
    JSON), says "ready", then at each "go" times PASSES passes of them replayed and prints their seconds."""
    from normexp.environment import set_thread_defaults, take_mkl_intel_path

    set_thread_defaults()  # NORMEXP_MKL_PATH=intel: Intel's path, before torch loads
    if requested() == "intel" and (why := take_mkl_intel_path()):  # else it would time MKL's own path as Intel's
        sys.exit(f"MKL's Intel path cannot be taken here: {why}")
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from normexp.engines.fast.train import train_fast

    torch.set_num_threads(1)  # as a worker
    spec = json.loads(sys.stdin.readline())
    cfg = RunConfig.model_validate(spec["cfg"])
    one = cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 1})})
    products = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
                torch.ops.aten.baddbmm.default}
    calls: list = []

    def copy(value: object) -> object:
        if isinstance(value, torch.Tensor):
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype).copy_(value)
        return value

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = kwargs or {}
            if func in products and not kwargs.get("out"):
                calls.append((func, [copy(a) for a in args], dict(kwargs)))
            return func(*args, **kwargs)

    from normexp.engines.fast import starts

    drawn = starts.seeded_start(one)  # the batch is one run's copies: drawn once (each draw: ~0.1 s at depth 24)
    with Record(), mock.patch.object(starts, "seeded_start", lambda cfg: drawn):
        train_fast([one] * spec["runs"], "cpu", compile=False)
    for func, args, kwargs in calls:  # warm: MKL's first call picks its path and kernels
        func(*args, **kwargs)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        passes = []
        for _ in range(PASSES):
            start = time.perf_counter()
            for func, args, kwargs in calls:
                func(*args, **kwargs)
            passes.append(time.perf_counter() - start)
        print(json.dumps(passes), flush=True)


def cache_file() -> Path:
    return cache_folder() / "mkl-path.json"


def workers_summary() -> str:
    """One line for `normexp doctor`: the path a compiled fast sweep's workers take here, from the cache."""
    asked = requested()
    if asked is not None:
        path = "Intel's" if asked == "intel" else "MKL's own"
        return f"{path} ({MKL_PATH_VARIABLE}={asked}: not measured)"
    if cpu_info().ident.startswith("GenuineIntel"):
        return "MKL's own, Intel's on this Intel CPU (nothing to measure)"
    mine = machine_key() + ":"
    pairs = [(float(e["own_ms"]), float(e["intel_ms"])) for key, e in _read_cache().items()
             if key.startswith(mine) and isinstance(e, dict) and _sound(e)]
    if not pairs:
        return (f"not measured on this machine yet (a compiled fast sweep measures its shape first, ~3 s once; "
                f"cached in {cache_file()})")
    intel = sum(i <= MARGIN * o for o, i in pairs)
    low, high = (f"{r:.2f}" for r in (min(o / i for o, i in pairs), max(o / i for o, i in pairs)))
    rest = ", MKL's own for the rest" if intel < len(pairs) else ""
    return (f"Intel's for {intel} of {len(pairs)} measured shapes{rest} (Intel's "
            f"{low if low == high else f'{low}-{high}'}x on the step's products, needs >= {1 / MARGIN:.2f}x; "
            f"{cache_file()})")


def _sound(entry: dict) -> bool:
    """Two measured times: finite positive numbers (a hand-edited file may hold strings, booleans, Infinity)."""
    times = (entry.get("own_ms"), entry.get("intel_ms"))
    return all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0 for t in times)


def _read_cache() -> dict:
    return read_entries(cache_file(), CACHE_VERSION)
