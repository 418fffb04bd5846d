"""The fast engine's compiled step, kept on disk: compiled ahead of time once per machine, shape and code,
then loaded by every later batch, worker process and sweep in a fraction of a second.

    key      sha256 of what the step computes (the structure's config sections, runs per batch), where
             it runs (device, CPU model and kernel-changing features, torch, threads) and the code that
             defines it (the normexp modules the step's code can run, below, and the module of a plugin
             the structure names)
    package  <cache>/steps/<key>.pt2: the step traced into one graph of aten operations (make_fx) and
             compiled by AOTInductor, as traced, into a shared library
    lock     <cache>/steps/<key>.lock: the first process compiles; others wanting the same step wait
             for it (their core helps the compiler's C++ jobs meanwhile) and load its package
    checked  <cache>/steps/<key>.checked: the sha256 of a package that passed the check below

A package is a cache, never a source of truth: `compiled.compile_grad_step` checks the step it gets
against the eager step on the batch before using it, and a loaded package that fails the check is compiled
again (`load_or_compile(fresh=True)`). A package that cannot be read is compiled again too. A package
that passed the check once is vouched for (<key>.checked: the sha256 of its bytes), and a process that
loads those same bytes later uses it unchecked (the check's eager step costs a worker ~1.3 s), unless its
structure names a plugin (`vouchable`). Packages are
written atomically (a temporary file renamed into place), so a killed compile leaves none half-written.

The code in the key (`source_digest`) is not the whole package but the modules the step's code can run:
those that build and run it (`sources.STEP_ROOTS`: engines/fast/compiled, step, optim, starts, aot, train
and plan) and every normexp module they import, in turn, read statically from the files, lazy imports
included, with every package's `__init__` above them: the fast engine, engines/common and cost, the
models, the config, data, corpus, optim, registry and environment (`sources` lists them, and what is left
out). An upgrade that changes only what calls the engine or reads its results (the CLI, the sweep, the
run folder, report, figures, exporters) keeps every package. Since a vouched package skips the check
against the eager step, a module that the walk missed could let a stale step through: the walk errs
towards more modules.

Why on disk: the in-process compile (torch.compile of the same graph) costs 20-40 s per process even
with inductor's caches warm (its tracer walks the 2,400-node graph again), once per worker process and
sweep; loading a package takes well under a second (docs/performance.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import os
import re
import shutil
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import torch

import normexp
from normexp.engines.cache import cache_folder, locked
from normexp.engines.fast.sources import step_sources
from normexp.environment import cpu_info
from normexp.registry import is_plugin

PACKAGE_VERSION = 1  # bump when what a package holds changes meaning
# The wrapper (the ~700 KB of C++ that calls the step's kernels in order) compiled at -O0, not -O1: 10 s less
# of a cold compile of the depth-24 step (36 -> 26 s of gcc); the kernels themselves stay at -O3.
INDUCTOR_CONFIGS = {"aot_inductor.compile_wrapper_opt_level": "O0"}
TRUSTED_GCC = 12  # from this GCC on, every vector ISA inductor takes from the CPU's flags builds (AMX, AVX-512 FP16)


def inductor_options() -> dict:
    """INDUCTOR_CONFIGS, and, where inductor's compiler is GCC TRUSTED_GCC or later, the CPU's vector ISA taken
    from its flags without inductor's test builds (`cpp.vec_isa_ok`): it otherwise compiles a probe per candidate
    ISA (six here) into each new cache folder, ~7.5 s of gcc in a cold process, and both workers of a cold sweep
    pay it at once (docs/performance.md). The ISA taken is the one the probes pick where the compiler builds them
    all, so the package is the same; an older or other compiler keeps the probes."""
    try:
        from torch._inductor import cpp_builder

        compiler = cpp_builder.get_cpp_compiler()
        older = functools.partial(cpp_builder._is_gcc_version_less_than, compiler)
        # older() answers False where it cannot run the compiler or read its version; a version it reads is
        # older than any GCC to come: a GCC whose version is unknown keeps the probes
        trusted = cpp_builder._is_gcc(compiler) and older(10**6) and not older(TRUSTED_GCC)
    except Exception:  # noqa: BLE001 - torch's private helpers moved, or no compiler: inductor probes as it does
        trusted = False
    return {**INDUCTOR_CONFIGS, **({"cpp.vec_isa_ok": True} if trusted else {})}

Step = Callable[..., Sequence[torch.Tensor]]


def steps_dir() -> Path:
    """Where packages live: the cache folder's `steps` (`cache.cache_folder`: $NORMEXP_CACHE_DIR, else the user's
    cache folder, else a per-user temporary one: a user without a home folder still compiles once per boot)."""
    return cache_folder() / "steps"


def step_key(what: dict, device: str) -> str:
    """The package's name: `what` (JSON-able: the structure and batch size) plus device, machine, torch,
    threads and the source of the code that builds the step."""
    cpu = cpu_info()
    text = json.dumps({"what": what, "device": device, "cpu": [cpu.model, cpu.features_text()],
                       "torch": torch.__version__, "threads": torch.get_num_threads(), "python": sys.version,
                       "code": source_digest(), "plugins": _plugin_digests(what), "version": PACKAGE_VERSION},
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def source_digest() -> str:
    """sha256 of the normexp modules the step's code can run (`sources.step_sources`: their paths and
    bytes), in the installed package wherever this module sits in it: a change to the code that builds a
    step, or to anything it calls, names another package; a change elsewhere (a report, an exporter)
    keeps it."""
    return _tree_digest(Path(normexp.__file__).resolve().parent)


@functools.cache
def _tree_digest(root: Path) -> str:
    """sha256 of the step's modules in the package in `root`, by path relative to it and bytes; once per
    process."""
    digest = hashlib.sha256()
    modules = sorted((str(path.relative_to(root)), source) for path, source in step_sources(root).values())
    for name, source in modules:
        digest.update(name.encode() + b"\0" + source + b"\0")
    return digest.hexdigest()


def reset() -> None:
    """Forget the source digests this process computed, as a fresh process starts: the next
    `source_digest` reads the package's files again."""
    _tree_digest.cache_clear()


def _plugin_digests(what: dict) -> dict[str, str]:
    """sha256 of the module file of each plugin (`module:attribute`) the structure names; the check
    against the eager step covers what a plugin imports in turn."""
    found: dict[str, str] = {}
    for value in _strings(what):
        module, sep, _ = value.partition(":")
        if not sep or module in found:
            continue
        spec = sys.modules.get(module)
        origin = getattr(spec, "__file__", None)
        with contextlib.suppress(OSError, TypeError):
            found[module] = hashlib.sha256(Path(origin).read_bytes()).hexdigest()  # type: ignore[arg-type]
    return found


def _strings(value: object) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def load_or_compile(key: str, trace: Callable[[], torch.fx.GraphModule],
                    inputs: Sequence[torch.Tensor] | Callable[[], Sequence[torch.Tensor]],
                    fresh: bool = False, wait: bool = True) -> tuple[Step, bool] | None:
    """The compiled step named `key`: loaded from its package, or (missing, unreadable, or `fresh`)
    traced by `trace()`, compiled for `inputs`' shapes (or those of what `inputs()` returns) and written.
    Returns (step, compiled now); None, without `wait`, where another process holds its lock (compiling it)."""
    folder = steps_dir()
    folder.mkdir(parents=True, exist_ok=True)
    package = folder / f"{key}.pt2"
    with locked(folder / f"{key}.lock", wait) as held:
        if not held:
            return None
        if not fresh and package.is_file():
            with contextlib.suppress(Exception):  # noqa: BLE001 - any unreadable package is compiled again
                return load_package(package), False
        compile_package(trace(), inputs() if callable(inputs) else inputs, package)
        return load_package(package), True


def compile_package(graph: torch.fx.GraphModule, inputs: Sequence[torch.Tensor], package: Path) -> None:
    """`graph`, make_fx's graph of a step that takes a flat tuple of tensors and returns one (what every step
    normexp compiles is), compiled by AOTInductor for `inputs`' shapes into `package`, atomically. The graph
    goes to the compiler as traced, without torch.export's trace of it again (12 s of the depth-24 step's
    108 s cold compile, 16 s with what export adds to the compile: docs/performance.md); the call's
    specification export would record, a flat tuple in and out, is given with it."""
    from torch._inductor import aot_compile
    from torch._inductor.package import package_aoti
    from torch.utils import _pytree as pytree

    for node in graph.graph.nodes:  # make_fx's example values, each of its own fake mode: the compiler makes its own
        node.meta.pop("val", None)
        node.meta.pop("tensor_meta", None)
    graph._in_spec = pytree.tree_flatten((tuple(inputs), {}))[1]  # type: ignore[assignment]
    graph._out_spec = pytree.tree_flatten(tuple(graph.graph.output_node().args[0]))[1]  # type: ignore[assignment]
    tmp = package.with_name(f"{package.stem}.{os.getpid()}.tmp.pt2")
    # torch's own deprecation (treespec) inside the compile, nothing a user can act on
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*treespec", category=FutureWarning)
        try:
            with _headers_in_parallel():
                files = aot_compile(graph, tuple(inputs), options={**inductor_options(), "aot_inductor.package": True})
            package_aoti(str(tmp), files)
            os.replace(tmp, package)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()


@contextlib.contextmanager
def _headers_in_parallel() -> Iterator[None]:
    """Inductor's precompiled headers built by two processes at once. A compile builds two (the wrapper's and
    the kernels', ~6 s of gcc each) into one folder for the machine, in turn, each under its own lock; a second
    process compiling meanwhile waited on the first's lock with its core idle (two workers of a cold sweep on
    a fresh machine: ~12 s, one core idle). Here a header whose lock another process holds is not waited for
    but left for later, so this process builds the other header meanwhile; before it compiles anything that
    reads a header (a non-header build), it waits for the headers it left, and builds any the other process
    left unbuilt (it died). gcc reads the same headers either way: what the package holds is unchanged. Inductor
    keeps a header's path for the process once looked for (`_precompile_header` is functools.cache'd) and later
    compiles include it without its lock: a header left for later that no build waited for (the compile raised
    first, or building it did) is forgotten with the others, so the next compile takes its lock again instead of
    reading a .gch the other process may be writing (gcc: "while reading precompiled header"). The helpers are
    patched for the whole process, but only the compiling thread leaves headers for later: another thread's
    compile meanwhile (a torch.compile, a second package, whose patch is then left out) waits for its headers as
    inductor does, and any thread's build waits for those left (inductor's pool builds a kernel). Where
    torch's private helpers are not as expected, the compile runs as it does (nothing patched)."""
    try:
        from filelock import Timeout
        from torch._inductor import codecache
        from torch._inductor.cpp_builder import CppBuilder
        from torch.utils._filelock import FileLock

        header_locks = Path(codecache._HEADER_LOCK_DIR)
        compile_under_lock, build = codecache._worker_compile_cpp, CppBuilder.build
        forget_headers = codecache._precompile_header.cache_clear
    except (ImportError, AttributeError):
        yield
        return
    if not _PATCHING.acquire(blocking=False):  # another thread's compile patches them: its own passes this one's
        yield
        return
    left: list[tuple[str, Any]] = []
    compiling, draining = threading.get_ident(), threading.Lock()

    def headers_first(lock_path: str, builders: Any) -> None:
        if Path(lock_path).parent != header_locks or threading.get_ident() != compiling:
            return compile_under_lock(lock_path, builders)
        try:
            with FileLock(lock_path, timeout=0):
                for builder in builders if isinstance(builders, (list, tuple)) else (builders,):  # one: older torch
                    if not os.path.exists(builder.get_target_file_path()):
                        builder.build()
        except Timeout:  # another process builds it: build the next one meanwhile
            left.append((lock_path, builders))
        return None

    def build_after_headers(self: Any) -> None:
        if not (getattr(self, "_precompiling", False) or getattr(self, "_preprocessing", False)):
            with draining:  # in any thread: inductor's compile pool builds what the compiling thread looked for
                while left:
                    compile_under_lock(*left[0])  # waits for its lock; builds it if it is still missing
                    left.pop(0)
        return build(self)

    try:
        with mock.patch.object(codecache, "_worker_compile_cpp", headers_first), \
                mock.patch.object(CppBuilder, "build", build_after_headers):
            yield
    finally:
        if left:  # no build waited for it: inductor must look for it again, under its lock
            left.clear()
            forget_headers()
        _PATCHING.release()


_PATCHING = threading.Lock()  # one compile at a time patches inductor's helpers in a process; others run unpatched


def load_package(package: Path) -> Step:
    """The step in `package`; what cannot be read raises. The package's runner is made directly
    (torch._C._aoti.AOTIModelPackageLoader, what torch's aoti_load_package makes too), without importing
    torch's compiler (dynamo, inductor, sympy: 0.8 s a worker process) or running its load-time device
    comparison, which probes the CPU's vector ISA by building and loading a library per ISA, each in a fresh
    Python that imports torch (1.3 s a worker process), only to log a mismatch (and, on a package it cannot
    read, to ask for it to be regenerated, which normexp does itself).

    The runner extracts the package's library into a fresh temporary folder (/tmp/aotinductor_XXXXXX) and
    removes it only when it is freed, which a sweep's worker, ended by its coordinator, never gets to: every
    sweep left its workers' copies behind (~2 MB a package, 156 folders, 1.2 GB after a day of sweeps). Once
    the library is loaded, its folder is removed here (`_extracted`): the mapped library stays readable."""
    digest = _digest(package)
    _keep_freed_memory()
    with _LOADING:
        before = _extracted()
        runner = torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, -1)
        for folder in _extracted() - before:
            shutil.rmtree(folder, ignore_errors=True)
    return _flat_call(runner, digest)


_LOADING = threading.Lock()  # one load at a time in a process: each removes only the folder its own load made


def _extracted(maps: str | None = None) -> set[str]:
    """The folders this process has mapped libraries from that torch's package loader extracted
    (`aotinductor_` and six characters: its mkdtemp pattern), read from /proc/self/maps (or `maps`); none where
    there is no such file (not Linux: there the folders stay until their runner is freed). A line's path is all
    that follows its fifth field, spaces included."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return set()
    paths = (fields[5] for fields in (line.split(maxsplit=5) for line in maps.splitlines()) if len(fields) == 6)
    return {found.group(1) for path in paths if (found := re.match(r"(/.*/aotinductor_[A-Za-z0-9]{6})/", path))}


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


@functools.cache
def _keep_freed_memory() -> None:
    """glibc's allocator told to keep what a compiled step frees for its next call (a fixed mmap threshold of
    32 MB, the most it takes, and no trimming below 256 MB free), in this process, once. By default both move
    with the sizes freed before (a package read, the check's copies), and a process could end up returning the
    step's buffers to the kernel after every call and faulting them back in the next: 0.4 s of kernel time per
    16-run batch of the depth-24 step (1.8 vs 1.4 s a batch, measured side by side), or none, depending on what
    it happened to free before. Elsewhere (another C library) nothing is done."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None) if sys.platform.startswith("linux") else None
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, 32 << 20)
        mallopt(M_TRIM_THRESHOLD, 256 << 20)


def _flat_call(loader: Any, digest: str) -> Step:
    """The package's runner called with its tensors as a list, where its graph takes tensors and returns a
    flat tuple of them, as every step normexp compiles does (torch's own wrapper parses the call's
    specification again and walks both trees on every call: ~0.5 ms a step for the depth-24 step's 300
    tensors, 3% of its time). Anything else is called through torch's wrapper. The runner's `run` leaves
    the list it is given alone (its `boxed_run` takes the list's tensors over). The step carries the
    sha256 of the package's bytes (`digest`: what `vouch` records)."""
    from torch.utils import _pytree as pytree

    in_spec, out_spec = (pytree.treespec_loads(spec) for spec in loader.get_call_spec())
    args, kwargs = in_spec.children()
    if not (kwargs.num_leaves == 0 and args.num_leaves == args.num_children
            and out_spec.type is tuple and out_spec.num_leaves == out_spec.num_children):
        from torch.export.pt2_archive._package import AOTICompiledModel

        model = AOTICompiledModel(loader)

        def call(*tensors: torch.Tensor) -> Sequence[torch.Tensor]:
            return model(*tensors)
    else:
        arity, run = args.num_children, loader.run

        def call(*tensors: torch.Tensor) -> Sequence[torch.Tensor]:
            if len(tensors) != arity:
                raise TypeError(f"the compiled step takes {arity} tensors, got {len(tensors)}")
            return tuple(run(list(tensors)))

    call.digest = digest  # type: ignore[attr-defined]
    return call


def vouchable(what: dict) -> bool:
    """Whether a package of `what` may be vouched for (`vouch`): its name covers all the code its step runs.
    Not where the structure names a plugin: the name covers the plugin's own module file, but not what that
    module imports or reads, which only the check against the eager step sees (a user's helper module
    changed, the same package's bytes would go on training the old step)."""
    return not any(is_plugin(value) for value in _strings(what))


def vouch(key: str, step: Step) -> None:
    """Record that `step`, loaded from the package `key`, passed the check against the eager step
    (`compiled.compile_grad_step`'s): the sha256 of the bytes it was loaded from, in <key>.checked, so that
    later processes that load those same bytes need not check them again. A step not loaded from a package
    (no digest) vouches for nothing."""
    digest = getattr(step, "digest", None)
    if digest is None:
        return
    with contextlib.suppress(OSError):
        tmp = steps_dir() / f"{key}.{os.getpid()}.tmp.checked"
        tmp.write_text(digest)
        os.replace(tmp, steps_dir() / f"{key}.checked")


def vouched(key: str, step: Step) -> bool:
    """Whether `step` was loaded from the very bytes that `vouch` recorded for `key`."""
    digest = getattr(step, "digest", None)
    try:
        return digest is not None and (steps_dir() / f"{key}.checked").read_text() == digest
    except OSError:
        return False


def _digest(path: Path) -> str:
    """sha256 of the file, read in 64 KB pieces (not the 8 MB package in one piece)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 16), b""):
            digest.update(piece)
    return digest.hexdigest()
