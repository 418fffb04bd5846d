"""Run a normexp sweep on a Slurm cluster through dask-jobqueue (docs/executors.md).

    python examples/slurm.py --jobs 4 --cores 16 --memory 32GB --partition cpu --account lab --qos normal
    # prints the scheduler address, then keeps the cluster up; in another shell:
    normexp sweep configs/studies/placements.yaml --cluster tcp://HOST:8786

    python examples/slurm.py --dry-run     # print the sbatch script each job would run; submits nothing

The sweep process stays on the login node (or wherever you run `normexp sweep`): it writes every
result itself, so the compute nodes need normexp installed but no shared file system; they must reach
the scheduler's port. Where a cluster forbids a long-lived process on its login node, or that port,
submit the sweep as a job array instead: `normexp sweep CONFIG --launcher slurm --shards N ...`
(docs/cluster.md).

Each Slurm job starts `processes` Dask workers of one thread each; torch threads per run are set by
normexp (the run's `train.threads`, else the sweep process's default). The workers run this Python
(an absolute path: the environment you start this script from), so no venv is activated on the node.
"""

from __future__ import annotations

import argparse
import sys
import time

from dask_jobqueue import SLURMCluster


def make_cluster(cores: int, memory: str, walltime: str, partition: str | None, port: int,
                 host: str | None = None, account: str | None = None, qos: str | None = None,
                 exclusive: bool = False, prologue: list[str] | None = None) -> SLURMCluster:
    return SLURMCluster(
        cores=cores,  # CPU cores per job
        processes=cores,  # one single-threaded Dask worker per core
        memory=memory,  # per job
        walltime=walltime,
        queue=partition,
        account=account,
        python=sys.executable,  # this environment's Python, by its absolute path
        job_extra_directives=[*(["--exclusive"] if exclusive else []), *([f"--qos={qos}"] if qos else [])],
        job_script_prologue=prologue or [],  # e.g. module load ...
        scheduler_options={"port": port, **({"host": host} if host else {})},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--cores", type=int, default=16)
    parser.add_argument("--memory", default="32GB")
    parser.add_argument("--walltime", default="01:00:00", help="per job [default: 01:00:00]")
    parser.add_argument("--partition", default=None)
    parser.add_argument("--account", default=None, help="the account to charge")
    parser.add_argument("--qos", default=None, help="the quality of service")
    parser.add_argument("--exclusive", action="store_true", help="ask for whole nodes (sbatch --exclusive)")
    parser.add_argument("--prologue", action="append", default=[], help="a shell line before the workers start "
                        "(module load ...); repeatable")
    parser.add_argument("--port", type=int, default=8786)
    parser.add_argument("--host", default=None, help="address the scheduler listens on [default: Dask's choice]")
    parser.add_argument("--dry-run", action="store_true", help="print the job script and exit")
    args = parser.parse_args()
    cluster = make_cluster(args.cores, args.memory, args.walltime, args.partition, args.port, args.host,
                           args.account, args.qos, args.exclusive, args.prologue)
    if args.dry_run:
        print(cluster.job_script())
        cluster.close()
        return
    cluster.scale(jobs=args.jobs)
    print(f"scheduler: {cluster.scheduler_address}  (normexp sweep CONFIG --cluster {cluster.scheduler_address})")
    try:
        while True:
            time.sleep(60)
    except KeyboardInterrupt:
        cluster.close()


if __name__ == "__main__":
    main()
