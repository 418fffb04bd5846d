"""Each run's starting parameters and task exactly as `common.seeded_init` draws them, without building its
model: the model a structure's first run builds is recorded as the aten operations its construction makes,
and every later run of that structure replays them after its own seed.

    first run of a structure   torch.manual_seed(seed); build_model(cfg) under a recording dispatch mode
                               -> the operations (empty, uniform_, zero_, fill_, mul_, ...) and which
                               result each parameter is; replayed once for that seed and kept only if
                               the replay gives the built model's parameters bit for bit
    every later run            the CPU generator seeded (`_seed`); the operations again, in order, on fresh
                               tensors; make_task(...): the same generator, the same draws, in the same order
    a seed met before          the start replayed for it, kept (`Starts`: the structure met last, up to
                               START_BUDGET bytes): a phase diagram's cells of one seed start alike

The model's construction is the only definition of a run's weights: nothing here knows a placement, a norm
or an init; the recording is what that code did. Replaying costs a fraction of building the model (a
depth-24 FFN toy: ~125 modules built against ~540 operations replayed, ~2 ms a run, most of it drawing the
weights: the operations are called through torch's bindings, `BINDINGS`). A structure is built, never
replayed, where the recording could not be exact for another seed: its construction, or its model's
`profile_at_init`, reads a value back into Python (`.item()`, a comparison in an `if`: an operation that
returns no tensor; Admin's profiling does; or by a path that makes none: `.tolist()`, `.numpy()`, NumPy's
`__array__`, the shape of a result whose shape depends on values, as `nonzero`'s), its construction passes
tensors in a form the replay does not follow (a keyword or a list), or `profile_at_init` changes a parameter.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from normexp.config import RunConfig
from normexp.data import Task, make_task
from normexp.engines.common import INIT_LOCK, build_model, init_batch, seeded_init

Params = dict[str, torch.Tensor]
_Key = tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]


def _key(tensor: torch.Tensor) -> _Key:
    """What identifies a tensor's values while everything recorded is alive: its storage, offset and view."""
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
            tuple(tensor.stride()), tensor.dtype)


@dataclass(frozen=True)
class _Op:
    """One recorded operation: `func(*args, **kwargs)` with args[i] = the result in slot s for each (i, s) of
    `refs`; its results go to `outs` (one slot per tensor it returns)."""

    func: Any
    args: tuple
    kwargs: dict
    refs: tuple[tuple[int, int], ...]
    outs: tuple[int, ...]


class _Recorder(TorchDispatchMode):
    """Records every aten operation made under it as an `_Op`; `exact` turns False at one it cannot replay.
    Keeps each result alive until it is done, so that no storage is reused and taken for another's."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: torch leaves `__torch_dispatch__` as it is, instead of wrapping it to keep torch.compile out,
        which imports the compiler (~1 s, each process's first recording); nothing compiles under a recording."""
        return False

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[_Op] = []
        self.slots: dict[_Key, int] = {}
        self.constants: dict[int, torch.Tensor] = {}  # slots of tensors made outside the recording
        self.alive: list[torch.Tensor] = []
        self.exact = True

    def slot(self, tensor: torch.Tensor) -> int:
        found = self.slots.get(_key(tensor))
        if found is None:  # made before the recording, or without an operation: kept as it is now
            found = self.slots[_key(tensor)] = len(self.alive)
            self.constants[found] = tensor.detach().clone()
            self.alive.append(tensor)
        return found

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if any(isinstance(v, torch.Tensor) for v in kwargs.values()) or any(
                isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a) for a in args):
            self.exact = False
        refs = tuple((i, self.slot(a)) for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        out = func(*args, **kwargs)
        results = out if isinstance(out, (tuple, list)) else (out,)
        if not all(isinstance(r, torch.Tensor) for r in results):
            self.exact = False  # a value read back into Python: what follows may depend on it
        if torch.Tag.dynamic_output_shape in func.tags:
            self.exact = False  # its shape is read from values (nonzero, unique): what reads it reads them
        outs = []
        for result in results:
            if isinstance(result, torch.Tensor):
                self.slots[_key(result)] = len(self.alive)
                outs.append(len(self.alive))
                self.alive.append(result)
        plain = tuple(None if isinstance(a, torch.Tensor) else a for a in args)
        self.ops.append(_Op(func, plain, dict(kwargs), refs, tuple(outs)))
        return out


# Tensor methods that hand a tensor's values to Python without an aten operation (no dispatch mode sees them)
_READ_BACK = frozenset({torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__, torch.Tensor.__dlpack__,
                        torch.Tensor.data_ptr})


class _Reads(TorchFunctionMode):
    """Watches the Python calls made under it: `read` turns True at one of `_READ_BACK`."""

    def __init__(self) -> None:
        super().__init__()
        self.read = False

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.read = self.read or func in _READ_BACK
        return func(*args, **(kwargs or {}))


_aten = torch.ops.aten
# Operations a construction makes, called through torch's Python bindings: the same kernel as the
# operator's overload, without its Python wrapper (0.1-2 us a call, most for empty and detach; a depth-24
# toy's replay makes ~540: ~2.4 -> ~1.8 ms, 2-core Xeon)
BINDINGS = {_aten.empty.memory_format: torch.empty, _aten.detach.default: torch.Tensor.detach,
             _aten.uniform_.default: torch.Tensor.uniform_, _aten.normal_.default: torch.Tensor.normal_,
             _aten.zero_.default: torch.Tensor.zero_, _aten.fill_.Scalar: torch.Tensor.fill_}


@dataclass(frozen=True)
class Recording:
    """A structure's model construction as operations, and the slot of each parameter (by name, in
    `named_parameters` order)."""

    ops: tuple[_Op, ...]
    constants: dict[int, torch.Tensor]
    size: int
    params: dict[str, int]
    _calls: tuple = field(init=False, repr=False, compare=False)  # what `replay` calls, looked up once

    def __post_init__(self) -> None:
        calls = tuple((BINDINGS.get(op.func, op.func), op.args, op.kwargs, op.refs, op.outs) for op in self.ops)
        object.__setattr__(self, "_calls", calls)

    def replay(self) -> Params:
        """The parameters the construction makes from the global generator's current state."""
        values: list[Any] = [None] * self.size
        for slot, tensor in self.constants.items():
            values[slot] = tensor.clone()
        for call, args, kwargs, refs, outs in self._calls:
            if refs:
                args = list(args)
                for i, slot in refs:
                    args[i] = values[slot]
            out = call(*args, **kwargs)
            if len(outs) == 1:
                values[outs[0]] = out
            else:
                for slot, result in zip(outs, out):
                    values[slot] = result
        return {name: values[slot] for name, slot in self.params.items()}


@dataclass(frozen=True)
class _Known:
    """What a process keeps of a structure it has met: its recording (None: built each time) and its model
    without values (the "meta" device), whose forward the fast engine calls with each run's parameters."""

    recording: Recording | None
    meta: torch.nn.Module


_KNOWN: dict[tuple, _Known] = {}  # per structure, for the process's life
_RECORDING = threading.Lock()


def structure(cfg: RunConfig) -> tuple:
    """What a run's model construction may depend on besides its seed."""
    return (cfg.model, cfg.norm, cfg.data)


def seeded_start(cfg: RunConfig) -> tuple[Params, Task]:
    """`cfg`'s initial parameters by name and its task, bit for bit those of `seeded_init(cfg)` (same draws
    from the global generator, in the same order), replayed where its structure was recorded before."""
    with _RECORDING:
        if structure(cfg) not in _KNOWN:
            net, task = seeded_init(cfg)
            built = dict(net.named_parameters())
            _KNOWN[structure(cfg)] = _Known(_record(cfg, built), on_meta(net))
            return built, task
        recording = _KNOWN[structure(cfg)].recording
    if recording is None:
        net, task = seeded_init(cfg)
        return dict(net.named_parameters()), task
    return _STARTS.get(cfg, recording)


START_BUDGET = 128 << 20  # bytes of replayed starts a process keeps (`Starts`): ~150 seeds of the depth-24 toy


class Starts:
    """The replayed starts (parameters, task) of the structure a process met last, by seed, while they fit in
    `budget` bytes (of the storages they hold, `_held`). A start depends on the structure and the seed alone,
    so the runs of a grid that differ only in what it does not depend on (learning rate, warmup, optimizer,
    steps: a phase diagram's cells) share their seed's start, replayed once (a depth-24 toy's: ~2.3 ms a
    run). A replay is a function of the recording and the seed, so a kept start is bit for bit the one
    replaying it again would give. The tensors are shared: whoever gets them reads them (`step.stack_runs`
    batches copies of them all), never writes them; the global generator is left where the replay left it
    (its state kept with the start), as seeded_init leaves it.
    A new structure empties the store (a sweep trains one structure's batches after another); a full store
    keeps what it has (a grid's seeds come round again in the same order, where evicting the oldest would
    keep none that is asked for next)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.lock = threading.Lock()
        self.structure: tuple | None = None
        self.by_seed: dict[int, tuple[Params, Task, torch.Tensor]] = {}
        self.size = 0

    def get(self, cfg: RunConfig, recording: Recording) -> tuple[Params, Task]:
        """`cfg`'s start, kept, or replayed from its structure's `recording` (and kept if it fits)."""
        key = structure(cfg)
        with self.lock:
            if key != self.structure:
                self.structure, self.by_seed, self.size = key, {}, 0
            kept = self.by_seed.get(cfg.seed)
        if kept is not None:
            params, task, after = kept
            with INIT_LOCK:
                torch.default_generator.set_state(after)
            return params, task
        params, task, after = replay_start(recording, cfg)
        size = _held(params, task, after)
        with self.lock:  # another thread may have kept this seed meanwhile: its replay, bit for bit this one
            if key == self.structure and cfg.seed not in self.by_seed and self.size + size <= self.budget:
                self.by_seed[cfg.seed] = (params, task, after)
                self.size += size
        return params, task


_STARTS = Starts(START_BUDGET)


def reset(budget: int = START_BUDGET) -> Starts:
    """Forget every structure this process met (its recording and model) and every kept start, as a fresh
    process starts; later starts are kept in a new store of `budget` bytes, which is returned."""
    global _STARTS
    with _RECORDING:
        _KNOWN.clear()
        _STARTS = Starts(budget)
    return _STARTS


def is_replayed(cfg: RunConfig) -> bool:
    """Whether the runs of `cfg`'s structure, met before in this process, start from its recording (False:
    each is built, the recording could not be exact). A structure not met yet raises KeyError."""
    return _KNOWN[structure(cfg)].recording is not None


def _held(params: Params, task: Task, after: torch.Tensor) -> int:
    """The bytes a kept start holds alive: the storages of its tensors, each once (a sequence task's inputs
    are views of its drawn sequences, a view's `nbytes` its own elements only)."""
    tensors = [t for t in (*params.values(), *vars(task).values(), after) if isinstance(t, torch.Tensor)]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def meta_model(cfg: RunConfig) -> torch.nn.Module:
    """The model of `cfg`'s structure on the "meta" device (shapes, no values), shared by its runs: one that
    `seeded_start` met (it builds the structure's first run)."""
    if structure(cfg) not in _KNOWN:
        seeded_start(cfg)
    return _KNOWN[structure(cfg)].meta


def on_meta(net: torch.nn.Module) -> torch.nn.Module:
    """A copy of `net` on the "meta" device, a parameter that several modules share (tied embeddings: the
    token embedding's weight is the head's) still one parameter, so that `functional_call` given it once
    puts it in both places. (`Module.to` alone makes a new parameter in each module that holds it.)"""
    memo = {id(p): torch.nn.Parameter(p.detach().to("meta"), p.requires_grad) for p in net.parameters()}
    return copy.deepcopy(net, memo).to("meta")


def _record(cfg: RunConfig, built: Params) -> Recording | None:
    """The recording of `cfg`'s model construction, or None where replaying it could differ from building it:
    checked on `cfg`'s own seed against the parameters `built` by `seeded_init`."""
    with INIT_LOCK:
        torch.manual_seed(cfg.seed)
        with _Reads() as reads, _Recorder() as recorder:
            net = build_model(cfg)
        task = make_task(cfg.data, cfg.model)
    names = dict(net.named_parameters())
    before = {name: p.detach().clone() for name, p in names.items()}
    inputs = init_batch(cfg, task)[0]  # a text task's first windows: drawn from the run's own generator
    with _Reads() as profile_reads, _Recorder() as profiling:
        net.profile_at_init(inputs)
    if (not recorder.exact or not profiling.exact or reads.read or profile_reads.read or not _same(names, before)
            or any(_key(p) not in recorder.slots for p in names.values())):
        return None
    recording = Recording(tuple(recorder.ops), recorder.constants, len(recorder.alive),
                          {name: recorder.slots[_key(p)] for name, p in names.items()})
    again, _, _ = replay_start(recording, cfg)  # and the generator left where seeded_init leaves it
    return recording if _same(again, built) else None


def replay_start(recording: Recording, cfg: RunConfig) -> tuple[Params, Task, torch.Tensor]:
    """`cfg`'s parameters from `recording` and its task, drawn after its seed (`_seed`) in seeded_init's order,
    and the global generator's state after them: a replayed run's start, and `_record`'s check of it, seeded
    the same way."""
    with INIT_LOCK:
        _seed(cfg.seed)
        return recording.replay(), make_task(cfg.data, cfg.model), torch.default_generator.get_state()


def _seed(seed: int) -> None:
    """`torch.manual_seed(seed)` for a replay: the CPU generator, which the draws of a construction and a
    task are made from (a replay builds no plugin's model, and the fast engine draws nothing while it
    trains). A construction that draws from another generator (another device's, its own) is built, never
    replayed: `_record` checks its replay after this same seeding (`replay_start`), from which that
    generator's draws differ. torch.manual_seed also queues the seeding of every other device's
    generator, formatting the Python stack for each: 0.15-0.25 ms a call, against ~3 ms for the rest of a
    replayed run's start."""
    torch.default_generator.manual_seed(seed)


def _same(a: Params, b: Params) -> bool:
    """Equal names in equal order, each tensor of equal dtype, shape and bits."""
    return list(a) == list(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for x, y in zip(a.values(), b.values()))
