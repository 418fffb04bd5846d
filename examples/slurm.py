"""Run a normexp sweep on a Slurm cluster through dask-jobqueue.

    python examples/slurm.py --jobs 4 --cores 16 --memory 32GB --partition cpu
    # prints the scheduler address, then keeps the cluster up; in another shell:
    normexp sweep configs/studies/placements.yaml --cluster tcp://HOST:8786

    python examples/slurm.py --dry-run     # print the sbatch script each job would run; submits nothing

The sweep process stays on the login node (or wherever you run `normexp sweep`): it writes every
result itself, so the compute nodes need normexp installed but no shared file system.
Each Slurm job starts `processes` Dask workers of one thread each; torch threads per run are set by
normexp (the run's `train.threads`, else the sweep process's default).
"""

from __future__ import annotations

import argparse
import time

from dask_jobqueue import SLURMCluster


def make_cluster(cores: int, memory: str, walltime: str, partition: str | None, port: int,
                 host: str | None = None) -> SLURMCluster:
    return SLURMCluster(
        cores=cores,  # CPU cores per job
        processes=cores,  # one single-threaded Dask worker per core
        memory=memory,  # per job
        walltime=walltime,
        queue=partition,
        job_extra_directives=["--exclusive"],
        job_script_prologue=["source .venv/bin/activate"],  # the environment normexp is installed in
        scheduler_options={"port": port, **({"host": host} if host else {})},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--cores", type=int, default=16)
    parser.add_argument("--memory", default="32GB")
    parser.add_argument("--walltime", default="04:00:00")
    parser.add_argument("--partition", default=None)
    parser.add_argument("--port", type=int, default=8786)
    parser.add_argument("--host", default=None, help="address the scheduler listens on [default: Dask's choice]")
    parser.add_argument("--dry-run", action="store_true", help="print the job script and exit")
    args = parser.parse_args()
    cluster = make_cluster(args.cores, args.memory, args.walltime, args.partition, args.port, args.host)
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
