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

Before anything is submitted, `plan_array` finds the shards with runs left (finished runs verified in the
folder: a resubmit submits only the others) and the time of their largest batch, measured where the folder's
finished runs tell this machine's speed, else estimated from FLOPs (engines/cost.py); `check_time` refuses a
`--time` that leaves a task no time to train before it is told to stop (it would be requeued over and over),
and warns where the largest batch needs more than the task has; `max_requeues` caps the requeues past
`--time` by the shard's time left. The array is named after the sweep, and under Slurm a task whose runs
failed ends in an error (`RunsFailed`), so that `sacct` says FAILED.

The submitit extra: `pip install 'normexp[slurm]'`.
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from normexp import stopping
from normexp.config import ConfigError, RunConfig
from normexp.folder import inspect_run, run_id

LAUNCHERS = ("slurm", "local")
# how long before a task's --time runs out submitit has it warned to stop and requeue: Slurm's
# --signal=USR2@90 (to every process of the job), the local executor's own 30 s
SIGNAL_DELAY_S = {"slurm": 90, "local": 30}
TASK_START_S = 30  # a task's Python, torch and the sweep's plan, before its first batch trains
MAX_REQUEUES = 100  # submitit's own cap on the requeues past --time (preemptions are not counted)
LOCAL_REQUEUES = 3  # submitit's LocalExecutor's


@dataclass(frozen=True)
class ArraySettings:
    """What the job array asks Slurm for (None: the cluster's default)."""

    shards: int
    name: str = "normexp"  # the job's name (sbatch --job-name): the sweep's
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_min: int = 60  # per task; a task that runs out is requeued and resumes
    cpus: int = 1
    mem: str | None = None  # e.g. 8G
    parallelism: int | None = None  # tasks running at once (sbatch --array=0-N%K)
    setup: tuple[str, ...] = field(default_factory=tuple)  # shell lines before the task (module load ...)
    requeues: int = MAX_REQUEUES  # past --time, a task is requeued at most this many times (`max_requeues`)
    tasks: int | None = None  # how many tasks are submitted (None: all the shards; see `ArrayPlan.todo`)

    def slurm_parameters(self) -> dict:
        """SlurmExecutor's parameters (submitit's names)."""
        params = {"job_name": self.name, "time": self.time_min, "cpus_per_task": self.cpus,
                  "signal_delay_s": SIGNAL_DELAY_S["slurm"],
                  "array_parallelism": min(self.parallelism or self.shards, self.task_count)}
        for key, value in (("partition", self.partition), ("account", self.account), ("qos", self.qos),
                           ("mem", self.mem), ("setup", list(self.setup) or None)):
            if value is not None:
                params[key] = value
        return params

    @property
    def task_count(self) -> int:
        return self.shards if self.tasks is None else self.tasks


@dataclass(frozen=True)
class ArrayPlan:
    """What the array's shards have left: `todo`, the shards with runs to train (in order); `batch_s`, the
    time of the largest batch left and `shard_s` of the largest shard's work left, in seconds (None where
    nothing tells: a GPU sweep with no finished run); `measured`: scaled by the speed the folder's finished
    runs were trained at (their wall_s against the estimate), not only estimated."""

    todo: tuple[int, ...]
    batch_s: float | None = None
    shard_s: float | None = None
    measured: bool = False

    @property
    def basis(self) -> str:
        return ("at the speed this folder's finished runs were trained at" if self.measured else
                "estimated from its FLOPs at rates measured on 2 CPU cores: docs/performance.md")


def plan_array(runs: Sequence[RunConfig], engine: str, shards: int, target: Path, compile_: bool | None = None,
               force: bool = False, device: str = "cpu") -> ArrayPlan:
    """The array's plan (`ArrayPlan`) over the sweep's `runs` dealt to `shards` shards (shard.deal_units) for
    the folder `target`; with `force` every run is left to do."""
    from normexp.engines.cost import estimated_seconds
    from normexp.shard import deal_units

    finished, speeds = set(), []
    for cfg in [] if force else runs:
        rid = run_id(cfg)
        if not os.path.isfile(os.path.join(target, rid, "done.json")):
            continue
        state = inspect_run(Path(target) / rid, cfg)
        if state.finished:
            finished.add(rid)
            wall, estimate = (state.done or {}).get("wall_s"), estimated_seconds([cfg], engine)
            if isinstance(wall, (int, float)) and wall > 0 and estimate > 0:
                speeds.append(wall / estimate)
    speed = statistics.median(speeds) if speeds else 1.0 if device == "cpu" else None
    todo, batch_s, shard_s = [], 0.0, 0.0
    for index, units in sorted(deal_units(runs, engine, shards, compile_).items()):
        left = [estimated_seconds(unit, engine) for unit in units if any(run_id(c) not in finished for c in unit)]
        if left:
            todo.append(index)
            batch_s, shard_s = max(batch_s, *left), max(shard_s, sum(left))
    if speed is None:
        return ArrayPlan(tuple(todo))
    return ArrayPlan(tuple(todo), batch_s * speed, shard_s * speed, bool(speeds))


def check_time(time_min: int, plan: ArrayPlan, launcher: str) -> tuple[str | None, str | None]:
    """(why `--time` is refused, or None; a warning about it, or None). A task is told to stop and requeue
    SIGNAL_DELAY_S before its time runs out: a --time that leaves it less than TASK_START_S would be
    requeued over and over without training anything (refused); one shorter than its largest batch left
    would be requeued without finishing it, up to its requeue cap (warned)."""
    if not plan.todo:  # no task is left to submit: its time is nobody's
        return None, None
    delay = SIGNAL_DELAY_S[launcher]
    window = time_min * 60 - delay  # seconds a task trains before it is told to stop
    batch = plan.batch_s or 0.0
    need = math.ceil((delay + TASK_START_S + batch) / 60)
    who = ("Slurm tells", f"--signal=USR2@{delay}") if launcher == "slurm" else \
        ("submitit's local executor tells", f"SIGUSR2, its signal_delay_s={delay}")
    told = (f"{who[0]} a task to stop and requeue {delay} s before its time runs out ({who[1]}), so a "
            f"{time_min}-minute task trains for {max(window, 0)} s")
    per_task = (f"Estimated minutes per task: {(TASK_START_S + batch) / 60:.1f} ({TASK_START_S} s to start, "
                f"{batch / 60:.1f} min for its largest batch left, {plan.basis}), against a limit of {time_min} "
                f"({max(window, 0) / 60:.1f} before the stop signal)" if plan.batch_s is not None else
                "Its batches' time is unknown on this device until some of its runs have finished")
    if window < TASK_START_S:
        return (f"--time {time_min} is too short: {told} and would be requeued over and over without finishing "
                f"a batch. {per_task}. Give --time {need} or more"), None
    if plan.batch_s is not None and TASK_START_S + batch > window:
        return None, (f"warning: --time {time_min} is too short for the largest batch left: {told}, and a task "
                      f"that cannot finish a batch is requeued without progress (at most "
                      f"{max_requeues(time_min, plan, launcher)} times). {per_task}. Give --time {need} or more")
    return None, None


def max_requeues(time_min: int, plan: ArrayPlan, launcher: str) -> int:
    """How many times a task past its --time is requeued (submitit's max_num_timeout): its shard's time
    left over what a task trains, twice, and 3 more; at most MAX_REQUEUES (also where nothing tells the
    time). A task past them ends; a resubmit goes on with the shards with runs left. The local executor keeps
    its own cap, LOCAL_REQUEUES."""
    if launcher == "local":
        return LOCAL_REQUEUES
    if plan.shard_s is None:
        return MAX_REQUEUES
    window = max(time_min * 60 - SIGNAL_DELAY_S[launcher] - TASK_START_S, 60)
    return min(MAX_REQUEUES, 3 + 2 * math.ceil(plan.shard_s / window))


def settle(settings: ArraySettings, plan: ArrayPlan) -> ArraySettings:
    """Slurm's `settings` for the tasks `plan` leaves (only the shards with runs left), with their requeue cap."""
    return replace(settings, tasks=len(plan.todo), requeues=max_requeues(settings.time_min, plan, "slurm"))


class RunsFailed(RuntimeError):
    """A shard's runs failed (under Slurm: the task ends in this error, so that `sacct` says FAILED)."""


STOP_GRACE_S = 60  # a shard stopped cleanly ends its run in progress and writes its summary; past this, killed


class ShardTask:
    """One array task: `python -m normexp <argv> --shard I/N`. A plain class with `checkpoint` (which
    submitit looks for), so that this module imports without submitit. `own_session`: the shard runs in
    a session of its own (--launcher local: only `run_local` stops it; under Slurm the job's own process
    tracking must see it, so it stays in the task's). `fail_on_failed_runs`: a shard whose runs failed
    (normexp's exit code 1) ends the task in `RunsFailed` (Slurm: FAILED), not a result of 1."""

    def __init__(self, argv: Sequence[str], shards: int, own_session: bool = False,
                 fail_on_failed_runs: bool = False) -> None:
        self.argv, self.shards, self.own_session = list(argv), shards, own_session
        self.fail_on_failed_runs = fail_on_failed_runs
        self._child: subprocess.Popen | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_child": None}  # the running shard stays with the process that started it

    def __setstate__(self, state: dict) -> None:  # a task pickled by an earlier normexp has neither attribute
        self.__dict__.update({"own_session": False, "fail_on_failed_runs": False, **state, "_child": None})

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
        if code == 1 and self.fail_on_failed_runs:
            out = self.argv[self.argv.index("--out") + 1] if "--out" in self.argv else "the sweep's folder"
            raise RunsFailed(f"shard {index}/{self.shards}: some of its runs failed, each with its error in its "
                             f"folder's failed.json (normexp verify {out}); a resubmit retries them")
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
    return _make_sbatch_string(command=command, folder=logs / "%j", map_count=settings.task_count,
                               **settings.slurm_parameters())


def submit(argv: Sequence[str], settings: ArraySettings, logs: Path, shards: Sequence[int] | None = None) -> list:
    """Submit the array to Slurm, one task for each of `shards` (None: all; task K runs the K-th of them);
    returns submitit's jobs."""
    submitit = _submitit()
    shards = list(range(settings.shards) if shards is None else shards)
    executor = submitit.SlurmExecutor(folder=logs / "%j", max_num_timeout=settings.requeues)
    executor.update_parameters(**replace(settings, tasks=len(shards)).slurm_parameters())
    return executor.map_array(ShardTask(argv, settings.shards, fail_on_failed_runs=True), shards)


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
