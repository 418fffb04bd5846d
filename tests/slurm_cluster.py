"""A one-node Slurm cluster on this machine, from Debian's packages, for tests/test_slurm_cluster.py.

`start_cluster(root)` writes munge's key and slurm.conf under `root`, starts munged, slurmctld and slurmd
in the foreground of processes of their own (root, no systemd, no cgroups: `proctrack/linuxproc`,
`task/none`; every server on 127.0.0.1 and on free ports), and waits until the node is idle. Jobs are
recorded by `jobcomp/filetxt`, which `sacct --completion` reads (no slurmdbd or database to run).
`Cluster.stop` ends the three by their process ids. `why_no_cluster()` says why none can run here
(not root, no Slurm and no apt-get to install it), or None.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("munged", "slurmctld", "slurmd")


def why_no_cluster() -> str | None:
    """None where a cluster can be started here (installing Debian's packages if need be), else why not."""
    if all(shutil.which(name) for name in DAEMONS):
        return None if os.geteuid() == 0 else "Slurm's daemons run as root here, and this is not root"
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "slurmctld is not installed, and apt-get cannot install it (needs root and Debian's apt)"
    done = subprocess.run(["apt-get", "install", "-y", *PACKAGES], capture_output=True, text=True,
                          env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, timeout=900)
    if done.returncode != 0 or not all(shutil.which(name) for name in DAEMONS):
        return f"apt-get install {' '.join(PACKAGES)} failed: {(done.stderr.strip().splitlines() or [''])[-1]}"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SLURM_CONF = """\
ClusterName=normexp
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
MinJobAge=3600
SchedulerParameters=defer_batch
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class Cluster:
    """A started cluster: its slurm.conf, the environment its clients (sbatch, squeue, sacct) need, and
    its daemons' processes."""

    root: Path
    conf: Path
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *command: str, check: bool = True) -> str:
        """A Slurm client's output (`squeue`, `sacct`, `scontrol`, `scancel`) on this cluster."""
        done = subprocess.run(list(command), capture_output=True, text=True, env=self.env, timeout=60)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}\n{self.logs()}")
        return done.stdout

    def job_states(self, job: str) -> dict[str, tuple[str, str, str]]:
        """`JOBID_TASK` -> (job name, state, the task's own job id) of an array's tasks (`JOBID` of a job of one
        task: submitit submits one task as a plain job), from `scontrol show job` (which keeps them
        MinJobAge seconds after they end)."""
        states = {}
        for record in self.run("scontrol", "show", "job", "-o", job, check=False).splitlines():
            fields = dict(part.split("=", 1) for part in record.split() if "=" in part)
            if "JobId" in fields:
                key = f"{fields['ArrayJobId']}_{fields['ArrayTaskId']}" if "ArrayTaskId" in fields else fields["JobId"]
                states[key] = (fields["JobName"], fields["JobState"], fields["JobId"])
        return states

    def sacct(self) -> dict[str, tuple[str, str, str]]:
        """Each ended job's own id -> (job name, state, exit code), as `sacct --completion` reads them from
        jobcomp/filetxt's record (which knows tasks by their own job ids: see `job_states`)."""
        text = self.run("sacct", "--completion", "--noheader", "--parsable2", "--allusers",
                        "--format=JobIDRaw,JobName,State,ExitCode")
        rows = {}
        for line in text.splitlines():
            jid, name, state, code = (line.split("|") + ["", "", "", ""])[:4]
            rows[jid] = (name, state, code)
        return rows

    def wait_until_ended(self, job: str, tasks: int, timeout: float = 300) -> dict[str, tuple[str, str, str]]:
        """Wait until array `job` shows `tasks` tasks or more, none of them pending, running or requeued."""
        deadline = time.monotonic() + timeout
        while True:
            states = self.job_states(job)
            live = [s for _, s, _ in states.values() if s in ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING",
                                                           "COMPLETING", "SUSPENDED", "REQUEUE_HOLD")]
            if len(states) >= tasks and not live:
                return states
            if time.monotonic() > deadline:
                raise TimeoutError(f"array {job}: {states}\n{self.logs()}")
            time.sleep(1)

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.root / name
            if path.is_file():
                parts.append(f"--- {name} (last lines)\n" + "\n".join(path.read_text().splitlines()[-15:]))
        return "\n".join(parts)

    def stop(self) -> None:
        """End the daemons by their process ids, the newest first; and what jobs they left."""
        with contextlib.suppress(Exception):
            self.run("scancel", "--user", "root", check=False)
        for name in reversed(list(self.processes)):
            proc = self.processes.pop(name)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def start_cluster(root: Path, cpus: int = 3) -> Cluster:
    """A running one-node cluster whose files are under `root` (see the module docstring); `cpus`: the
    node's, whatever this machine has (slurmd's config_overrides), so that an array's tasks run at once."""
    root = Path(root)
    for sub in ("munge", "state", "spool"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "munge", 0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = root / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=socket.gethostname().split(".")[0], root=root, cpus=cpus,
                                      ctld_port=free_port(), slurmd_port=free_port()))
    cluster = Cluster(root, conf)
    try:
        def daemon(name: str, *command: str) -> None:
            log = open(root / f"{name}.out", "wb")  # noqa: SIM115 - the daemon's, closed when it ends
            cluster.processes[name] = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT,
                                                       env=cluster.env, start_new_session=True)
            log.close()

        munge = root / "munge"
        daemon("munged", "munged", "--foreground", "--force", f"--socket={munge}/munge.socket",
               f"--key-file={key}", f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
               f"--seed-file={munge}/munged.seed")
        _wait(lambda: (munge / "munge.socket").exists(), "munged's socket", cluster)
        daemon("slurmctld", "slurmctld", "-D", "-i", "-f", str(conf))
        daemon("slurmd", "slurmd", "-D", "-f", str(conf), "-N", socket.gethostname().split(".")[0])
        _wait(lambda: cluster.run("sinfo", "--noheader", "--format=%T", check=False).strip() == "idle",
              "the node to be idle", cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait(condition, what: str, cluster: Cluster, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for name, proc in cluster.processes.items():
            if proc.poll() is not None:
                out = (cluster.root / f"{name}.out").read_text(errors="replace")
                raise RuntimeError(f"{name} exited with {proc.returncode} while waiting for {what}:\n{out}\n"
                                   f"{cluster.logs()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}\n{cluster.logs()}")
        time.sleep(0.2)
