"""`normexp sweep --launcher slurm` on a real one-node Slurm cluster, started from Debian's packages on this
machine (tests/slurm_cluster.py: root, no systemd, no cgroups). Skipped with the reason where slurmctld cannot
be installed or started. Run it with `pytest -m slow tests/test_slurm_cluster.py` (about 3 minutes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from slurm_cluster import start_cluster, why_no_cluster

pytest.importorskip("submitit")
pytestmark = [pytest.mark.slow, pytest.mark.process]

TINY = """\
name: tiny
base: {model: {depth: 2, width: 8}, data: {n_samples: 16}, train: {steps: 30}}
grid: {norm.placement: [pre, post, peri]}
seeds: [0, 1]
"""
FAILING = '''
class Boom:
    stackable = True

    @staticmethod
    def build(block, norm):
        block.norm = norm()

    @staticmethod
    def forward(block, x):
        raise RuntimeError("boom: this placement always fails")
'''
BOOM = """\
name: boom
base: {model: {depth: 2, width: 8}, data: {n_samples: 16}, train: {steps: 4}}
grid: {norm.placement: [pre, 'boomnorms:Boom']}
seeds: [0]
"""
# done.json's fields that differ between two trainings of the same run: the time, the command, and the
# checksum over them
OWN_FIELDS = ("wall_s", "provenance", "checksum")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = why_no_cluster()
    if why:
        pytest.skip(why)
    try:
        started = start_cluster(tmp_path_factory.mktemp("slurm"))
    except (OSError, RuntimeError, TimeoutError) as exc:
        pytest.skip(f"a one-node Slurm cluster does not start here: {str(exc).splitlines()[0]}")
    yield started
    started.stop()


def normexp(cluster, *args: str, pythonpath: str = str(REPO)) -> subprocess.CompletedProcess:
    """`normexp ...` as a user types it, with the cluster's Slurm clients (SLURM_CONF) and this checkout."""
    return subprocess.run([sys.executable, "-m", "normexp", *args], capture_output=True, text=True, timeout=300,
                          env={**cluster.env, "PYTHONPATH": pythonpath})


def array_id(submitted: subprocess.CompletedProcess) -> str:
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    return submitted.stdout.split("submitted job array ")[1].split()[0]


def run_files(folder: Path) -> dict[str, bytes]:
    """Each run's files (RUN/NAME -> bytes), done.json without the fields of its own training."""
    files = {}
    for path in sorted(folder.glob("*/*")):
        if path.parent.name.startswith("."):
            continue
        data = path.read_bytes()
        if path.name == "done.json":
            data = json.dumps({k: v for k, v in json.loads(data).items() if k not in OWN_FIELDS}).encode()
        files[f"{path.parent.name}/{path.name}"] = data
    return files


def test_the_array_bears_the_sweeps_name_and_a_resubmit_finishes_a_cancelled_task(cluster, tmp_path):
    """Every array was named `normexp`, and a resubmit queued every task again, those with nothing left too."""
    config, out = tmp_path / "tiny.yaml", tmp_path / "out"
    config.write_text(TINY)
    job = array_id(normexp(cluster, "sweep", str(config), "--out", str(out), "--launcher", "slurm", "--shards", "3",
                           "--time", "10", "--array-parallelism", "2"))
    cluster.run("scancel", f"{job}_2")  # pending: two tasks run at once
    states = cluster.wait_until_ended(job, 2)
    assert {name for name, _, _ in states.values()} == {"tiny"}
    assert [states[f"{job}_{k}"][1] for k in range(2)] == ["COMPLETED", "COMPLETED"], states
    assert states.get(f"{job}_2", ("", "CANCELLED"))[1] == "CANCELLED"  # a task cancelled unsplit leaves no record
    assert "tiny" in cluster.run("squeue", "--states=all", "--noheader", "--format=%j")
    again = normexp(cluster, "sweep", str(config), "--out", str(out), "--launcher", "slurm", "--shards", "3",
                    "--time", "10")
    assert "(1 task)" in again.stdout and "1 of the 3 shards has runs left (2;" in again.stdout, again.stdout
    second = array_id(again)
    ended = cluster.wait_until_ended(second, 1)
    assert list(ended.values())[0][:2] == ("tiny", "COMPLETED") and len(ended) == 1
    sacct = cluster.sacct()
    assert {sacct[own][:2] for _, _, own in [*states.values(), *ended.values()]} <= \
        {("tiny", "COMPLETED"), ("tiny", "CANCELLED")}
    local = normexp(cluster, "sweep", str(config), "--out", str(tmp_path / "local"), "-q")
    assert local.returncode == 0, local.stderr
    mine, theirs = run_files(out), run_files(tmp_path / "local")
    assert len(mine) == 6 * 3 and mine == theirs  # config.yaml, metrics.csv, done.json of 6 runs
    nothing = normexp(cluster, "sweep", str(config), "--out", str(out), "--launcher", "slurm", "--shards", "3")
    assert nothing.returncode == 0 and "no task to submit" in nothing.stdout, nothing.stdout + nothing.stderr


def test_a_shard_with_a_failing_run_is_failed(cluster, tmp_path):
    """A task whose runs failed ended COMPLETED in sacct: the shard's exit code 1 was its result."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "boomnorms.py").write_text(FAILING)
    config = tmp_path / "boom.yaml"
    config.write_text(BOOM)
    pythonpath = os.pathsep.join([str(REPO), str(tmp_path / "pkg")])
    job = array_id(normexp(cluster, "sweep", str(config), "--out", str(tmp_path / "out"), "--launcher", "slurm",
                           "--shards", "2", "--time", "10", pythonpath=pythonpath))
    states = cluster.wait_until_ended(job, 2)
    failed = [p.parent.name for p in (tmp_path / "out").glob("*/failed.json")]
    assert len(failed) == 1
    listed = [normexp(cluster, "sweep", str(config), "--shard", f"{k}/2", "--dry-run", pythonpath=pythonpath).stdout
              for k in range(2)]  # the grid, then `shard K/2 trains 1 run of the 2: RUN_ID`
    failing = next(k for k in range(2) if listed[k].strip().splitlines()[-1].endswith(failed[0]))
    assert states[f"{job}_{failing}"][:2] == ("boom", "FAILED"), states
    assert states[f"{job}_{1 - failing}"][:2] == ("boom", "COMPLETED"), states
    sacct = cluster.sacct()
    assert sacct[states[f"{job}_{failing}"][2]][1:] == ("FAILED", "1:0")
    assert sacct[states[f"{job}_{1 - failing}"][2]][1:] == ("COMPLETED", "0:0")
    log = "".join(p.read_text() for p in (tmp_path / "out" / ".submitit").rglob("*_log.err"))
    assert "RunsFailed" in log and "some of its runs failed" in log


def test_a_time_limit_too_short_is_refused_before_anything_is_submitted(cluster, tmp_path):
    """--time 1 was submitted, and each task was told to stop at once (--signal=USR2@90), requeued over and over."""
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    before = cluster.run("squeue", "--states=all", "--noheader", "--format=%i")
    refused = normexp(cluster, "sweep", str(config), "--out", str(tmp_path / "out"), "--launcher", "slurm",
                      "--shards", "3", "--time", "1")
    assert refused.returncode == 2 and refused.stderr.startswith("error: --time 1 is too short"), refused.stderr
    assert "Estimated minutes per task" in refused.stderr and "Give --time 3 or more" in refused.stderr
    assert cluster.run("squeue", "--states=all", "--noheader", "--format=%i") == before
    assert not (tmp_path / "out").exists()
