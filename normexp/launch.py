"""Job arrays through submitit (`normexp sweep CONFIG --launcher slurm --shards N ...`): task I of the
array runs `normexp sweep CONFIG ... --shard I/N` (normexp/shard.py) into the sweep's folder.

Each task runs the same command line as an unsharded sweep, plus `--shard`, in this Python (an absolute
path: the venv the sweep was submitted from), so that nothing depends on the node's working directory.
A task is checkpointable: when Slurm preempts it or its time runs out, submitit (signalled
`--signal=USR2@90`) requeues it, and the requeued task resumes the shard (its finished runs are
kept and skipped: a run is the unit of work lost). `--launcher local` runs the array on this machine
with submitit's LocalExecutor and waits for it (a test of the whole path without Slurm).

The submitit extra: `pip install 'normexp[slurm]'`.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from normexp.config import ConfigError

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


class ShardTask:
    """One array task: `python -m normexp <argv> --shard I/N`. A plain class with `checkpoint` (which
    submitit looks for), so that this module imports without submitit."""

    def __init__(self, argv: Sequence[str], shards: int) -> None:
        self.argv, self.shards = list(argv), shards

    def command(self, index: int) -> list[str]:
        return [sys.executable, "-m", "normexp", *self.argv, "--shard", f"{index}/{self.shards}"]

    def __call__(self, index: int) -> int:
        code = subprocess.call(self.command(index))
        if code not in (0, 1):  # 1: some run failed, recorded in the folder; anything else: the task failed
            raise RuntimeError(f"shard {index}/{self.shards}: normexp exited with {code}")
        return code

    def checkpoint(self, index: int):  # noqa: ANN201 - a submitit DelayedSubmission
        """Preempted or out of time: resubmit the same task; it resumes the shard from its folder."""
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, index)


def _submitit():
    try:
        import submitit
    except ImportError:
        raise ConfigError("--launcher needs submitit, which is not installed: pip install 'normexp[slurm]'") from None
    return submitit


def task_argv(config: Path, overrides: Sequence[str], out_dir: Path, engine: str, force: bool = False) -> list[str]:
    """The `normexp sweep` arguments every task runs (absolute paths)."""
    argv = ["sweep", str(Path(config).resolve()), "--out", str(Path(out_dir).resolve()), "--engine", engine]
    for option in overrides:
        argv += ["--set", option]
    return argv + (["--force"] if force else [])


def sbatch_script(argv: Sequence[str], settings: ArraySettings, logs: Path) -> str:
    """The sbatch script submitit would submit for the array (shown by --dry-run)."""
    submitit = _submitit()
    from submitit.slurm.slurm import _make_sbatch_string

    del submitit
    command = " ".join([shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(str(logs))])
    return _make_sbatch_string(command=command, folder=logs / "%j", map_count=settings.shards,
                               **settings.slurm_parameters())


def submit(argv: Sequence[str], settings: ArraySettings, logs: Path, launcher: str) -> list:
    """Submit the array (slurm) or run it here (local, waiting for every task); returns submitit's jobs."""
    submitit = _submitit()
    task = ShardTask(argv, settings.shards)
    if launcher == "local":  # its controller makes the folder as given: a "%j" in it would stay a literal folder
        executor = submitit.LocalExecutor(folder=logs)
        executor.update_parameters(timeout_min=settings.time_min)
    else:
        executor = submitit.SlurmExecutor(folder=logs / "%j", max_num_timeout=100)
        executor.update_parameters(**settings.slurm_parameters())
    jobs = executor.map_array(task, range(settings.shards))
    if launcher == "local":
        for job in jobs:
            job.result()
    return jobs
