"""Job arrays through submitit (`normexp sweep CONFIG --launcher slurm --shards N ...`): task I of the
array runs `normexp sweep CONFIG ... --shard I/N` (normexp/shard.py) into the sweep's folder.

Each task runs the same command line as an unsharded sweep, plus `--shard`, in this Python (an absolute
path: the venv the sweep was submitted from), so that nothing depends on the node's working directory.
A task is checkpointable: when Slurm preempts it or its time runs out, Slurm signals every process of the
job (`--signal=USR2@90`); the shard's normexp ignores SIGUSR2, and submitit's handler in the task calls
`ShardTask.checkpoint`, which stops the shard cleanly (SIGTERM: its finished runs are kept, its summary
written) before submitit requeues the task, which resumes the shard (a run is the unit of work lost).

`--launcher local` runs the array on this machine with submitit's LocalExecutor and waits for it (a test
of the whole path without Slurm; its `--time` requeues through the same checkpoint). Each shard runs in a
session of its own, and submitit's controllers and tasks ignore Ctrl-C and SIGHUP, so that a stop signal
(Ctrl-C, SIGTERM, SIGHUP, `timeout`), whether it reaches this process alone or its whole process group,
is handled here once: each shard is stopped cleanly (SIGTERM), and the controllers end with them; a
second signal kills every process of the array at once (`run_local`). Its result names the failed runs.

The submitit extra: `pip install 'normexp[slurm]'`.
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from normexp import stopping
from normexp.config import ConfigError, RunConfig
from normexp.folder import inspect_run, run_id

LAUNCHERS = ("slurm", "local")


@dataclass(frozen=True)
class ArraySettings:
    """What the job array asks Slurm for (None: the cluster's default)."""

    shards: int
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_min: int = 60  # per task; a task that runs out is requeued and resumes
    cpus: int = 1
    mem: str | None = None  # e.g. 8G
    parallelism: int | None = None  # tasks running at once (sbatch --array=0-N%K)
    setup: tuple[str, ...] = field(default_factory=tuple)  # shell lines before the task (module load ...)

    def slurm_parameters(self) -> dict:
        """SlurmExecutor's parameters (submitit's names)."""
        params = {"job_name": "normexp", "time": self.time_min, "cpus_per_task": self.cpus, "signal_delay_s": 90,
                  "array_parallelism": self.parallelism or self.shards}
        for key, value in (("partition", self.partition), ("account", self.account), ("qos", self.qos),
                           ("mem", self.mem), ("setup", list(self.setup) or None)):
            if value is not None:
                params[key] = value
        return params


STOP_GRACE_S = 60  # a shard stopped cleanly ends its run in progress and writes its summary; past this, killed


class ShardTask:
    """One array task: `python -m normexp <argv> --shard I/N`. A plain class with `checkpoint` (which
    submitit looks for), so that this module imports without submitit. `own_session`: the shard runs in
    a session of its own (--launcher local: only `run_local` stops it; under Slurm the job's own process
    tracking must see it, so it stays in the task's)."""

    def __init__(self, argv: Sequence[str], shards: int, own_session: bool = False) -> None:
        self.argv, self.shards, self.own_session = list(argv), shards, own_session
        self._child: subprocess.Popen | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_child": None}  # the running shard stays with the process that started it

    def __setstate__(self, state: dict) -> None:  # a task pickled by an earlier normexp has neither attribute
        self.__dict__.update({"own_session": False, **state, "_child": None})

    def command(self, index: int) -> list[str]:
        return [sys.executable, "-m", "normexp", *self.argv, "--shard", f"{index}/{self.shards}"]

    def __call__(self, index: int) -> int:
        with subprocess.Popen(self.command(index), preexec_fn=_shard_signals,  # noqa: PLW1509 - no threads here
                              start_new_session=self.own_session) as child:
            self._child = child
            try:
                code = child.wait()
            except BaseException:  # submitit's requeue (SystemExit from its signal handler), or a crash
                _stop(child, signal.SIGKILL)
                raise
        if code not in (0, 1):  # 1: some run failed, recorded in the folder; anything else: the task failed
            raise RuntimeError(f"shard {index}/{self.shards}: normexp exited with {code}")
        return code

    def checkpoint(self, index: int):  # noqa: ANN201 - a submitit DelayedSubmission
        """Preempted or out of time (submitit's SIGUSR2 handler): stop the shard cleanly, then resubmit the
        same task; it resumes the shard from its folder."""
        from submitit.helpers import DelayedSubmission

        if self._child is not None:
            _stop(self._child, signal.SIGTERM)
        return DelayedSubmission(self, index)


def _shard_signals() -> None:
    """In the shard's process, before normexp starts: SIGUSR2 (Slurm's warning to every process of the job)
    is the task's to act on, not a death; Ctrl-C and SIGHUP as a terminal gives them (ignored by the
    submitit processes that started it)."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _stop(child: subprocess.Popen, signum: int, grace: float = STOP_GRACE_S) -> None:
    """Signal `child` and wait until it has exited (SIGKILL past `grace`), without reaping it: the frame that
    started it may be waiting for it (a signal handler runs inside that wait)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(child.pid, signum)
    deadline = time.monotonic() + grace
    while _running(child.pid):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)
            deadline = math.inf
        time.sleep(0.05)


def _running(pid: int) -> bool:
    """Whether the child `pid` has not exited (a zombie has), leaving it to be reaped by its waiter."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:  # reaped already
        return False


def _submitit():
    try:
        import submitit
    except ImportError:
        raise ConfigError("--launcher needs submitit, which is not installed: pip install 'normexp[slurm]'") from None
    return submitit


def task_argv(config: Path, overrides: Sequence[str], out_dir: Path, engine: str, force: bool = False,
              options: Sequence[str] = ()) -> list[str]:
    """The `normexp sweep` arguments every task runs (absolute paths); `options`: the sweep's other options
    as given (`sweep_options`: --device, --compile, --workers, --cluster, --max-runs, --fail-fast), so
    that each task runs as the command asked."""
    argv = ["sweep", str(Path(config).resolve()), "--out", str(Path(out_dir).resolve()), "--engine", engine]
    for option in overrides:
        argv += ["--set", option]
    return argv + (["--force"] if force else []) + list(options)


def sweep_options(device: str = "cpu", compile_: bool | None = None, workers: int | None = None,
                  cluster: str | None = None, max_runs: int | None = None, fail_fast: bool = False) -> list[str]:
    """The `normexp sweep` options a task passes on, those not at their defaults (None: unset)."""
    argv = [] if device == "cpu" else ["--device", device]
    argv += [] if compile_ is None else ["--compile" if compile_ else "--no-compile"]
    argv += [] if workers is None else ["--workers", str(workers)]
    argv += [] if cluster is None else ["--cluster", cluster]
    argv += [] if max_runs is None else ["--max-runs", str(max_runs)]
    return argv + (["--fail-fast"] if fail_fast else [])


def sbatch_script(argv: Sequence[str], settings: ArraySettings, logs: Path) -> str:
    """The sbatch script submitit would submit for the array (shown by --dry-run)."""
    submitit = _submitit()
    from submitit.slurm.slurm import _make_sbatch_string

    del submitit
    command = " ".join([shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(str(logs))])
    return _make_sbatch_string(command=command, folder=logs / "%j", map_count=settings.shards,
                               **settings.slurm_parameters())


def submit(argv: Sequence[str], settings: ArraySettings, logs: Path) -> list:
    """Submit the array to Slurm; returns submitit's jobs."""
    submitit = _submitit()
    executor = submitit.SlurmExecutor(folder=logs / "%j", max_num_timeout=100)
    executor.update_parameters(**settings.slurm_parameters())
    return executor.map_array(ShardTask(argv, settings.shards), range(settings.shards))


@dataclass
class LocalArray:
    """How `--launcher local`'s array ended: each shard's normexp exit code (0, or 1: some run failed), the
    tasks that failed (shard -> why, with its log), the stop signal that stopped it (None: it ran to its
    end), and the sweep's runs by state once it ended."""

    codes: dict[int, int] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    stopped: int | None = None
    finished: int = 0
    total: int = 0
    failed: dict[str, str] = field(default_factory=dict)  # run id -> its error (failed.json)

    @property
    def ok(self) -> bool:
        return self.stopped is None and not self.errors and not self.failed and all(c == 0 for c in self.codes.values())

    def problems(self) -> list[str]:
        """One line per failed run (its error's last line) and per failed task (why, and its log)."""
        lines = [f"failed: {rid}: {error}" for rid, error in self.failed.items()]
        lines += [f"shard {index}: {why}" for index, why in sorted(self.errors.items())]
        return lines


def run_local(argv: Sequence[str], settings: ArraySettings, logs: Path, target: Path, runs: Sequence[RunConfig],
              say: Callable[[str], None]) -> LocalArray:
    """Run the array here with submitit's LocalExecutor and wait for it (see the module docstring); `say`
    tells, as it happens, that a stop signal is stopping the array."""
    submitit = _submitit()
    executor = submitit.LocalExecutor(folder=logs)  # not logs/%j: its controller would make a folder named %j
    executor.update_parameters(timeout_min=settings.time_min)
    result = LocalArray(total=len(runs))
    with _ignored_by_what_starts(signal.SIGINT, signal.SIGHUP):  # SIG_IGN is inherited: submitit's processes
        jobs = executor.map_array(ShardTask(argv, settings.shards, own_session=True), range(settings.shards))
    controllers = [job._process.pid for job in jobs if job._process is not None]  # noqa: SLF001 - LocalJob's
    with _stop_signals(controllers, settings.shards, say) as received:
        deadline = None  # once a stop signal came: SIGTERM sent to each shard, which must end by then
        while not all(job.done() for job in jobs):
            if received and deadline is None:
                _signal_shards(controllers, signal.SIGTERM)
                deadline = time.monotonic() + STOP_GRACE_S + 10
            elif deadline is not None and time.monotonic() > deadline:
                _kill(controllers)
            time.sleep(0.1)
        result.stopped = received[0] if received else None
    if result.stopped is None:
        for index, job in enumerate(jobs):
            try:
                result.codes[index] = int(job.result())
            except Exception as exc:  # noqa: BLE001 - submitit's FailedJobError (the task's traceback) and kin
                last = (str(exc).strip().splitlines() or [type(exc).__name__])[-1].strip()
                result.errors[index] = f"{last} (log: {job.paths.stderr})"
    result.finished, result.failed = folder_state(target, runs)
    return result


def folder_state(target: Path, runs: Sequence[RunConfig]) -> tuple[int, dict[str, str]]:
    """How many of `runs` are finished in `target`, and the failed ones with their error's last line."""
    finished, failed = 0, {}
    for cfg in runs:
        state = inspect_run(Path(target) / run_id(cfg), cfg)
        if state.finished:
            finished += 1
        elif state.kind == "failed":
            error = str((state.failed or {}).get("error") or "no error recorded")
            failed[run_id(cfg)] = (error.strip().splitlines() or [""])[-1]
    return finished, failed


@contextlib.contextmanager
def _ignored_by_what_starts(*signums: int) -> Iterator[None]:
    """Ignore `signums` while processes are started in the block, so that they start ignoring them."""
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def _stop_signals(controllers: list[int], shards: int, say: Callable[[str], None]) -> Iterator[list[int]]:
    """Stop signals during the block: the first is recorded (the caller stops the shards), said at once; a
    second kills every process of the array and exits."""
    received: list[int] = []

    def handler(signum: int, frame: object) -> None:
        received.append(signum)
        if len(received) == 1:
            say(f"{stopping.signal_name(signum)}: stopping the array's {shards} tasks cleanly; their finished runs "
                "are kept (a second signal kills them at once)")
            return
        _kill(controllers)
        os.write(2, f"{stopping.signal_name(signum)} again: killed the array's tasks\n".encode())
        os._exit(128 + received[0])

    previous = stopping.on_stop_signals(handler)
    try:
        yield received
    finally:
        stopping.on_stop_signals(previous)


def _processes() -> dict[int, tuple[int, int]]:
    """Every process this user can see: pid -> (parent pid, session), from /proc (Linux; {} elsewhere)."""
    table = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    with open(f"/proc/{entry.name}/stat", "rb") as f:
                        fields = f.read().rsplit(b")", 1)[1].split()
                except OSError:  # ended meanwhile
                    continue
                if fields[0] != b"Z":
                    table[int(entry.name)] = (int(fields[1]), int(fields[3]))
    return table


def _descendants(roots: Sequence[int]) -> list[int]:
    """The live descendants of `roots`, parents before their children."""
    table = _processes()
    found, frontier = [], list(roots)
    while frontier:
        children = [pid for pid, (ppid, _) in table.items() if ppid in frontier and pid not in found]
        found += children
        frontier = children
    return found


def _signal_shards(controllers: Sequence[int], signum: int) -> None:
    """Signal each shard's normexp (a session leader below the controllers) once."""
    table = _processes()
    for pid in _descendants(controllers):
        if table.get(pid, (0, 0))[1] == pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)


def _kill(controllers: Sequence[int]) -> None:
    """SIGKILL every process of the array: the controllers and all below them."""
    for pid in [*_descendants(controllers), *controllers]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
