"""Executors: a local process pool and Dask give the single-process numbers, bit for bit."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pandas as pd
import pytest
from typer.testing import CliRunner

from normexp import executors
from normexp.cli import app
from normexp.config import RunConfig
from normexp.engines.fast import train_fast
from normexp.engines.reference import train_run
from normexp.executors import DaskExecutor, InProcessExecutor, PoolExecutor, pairs_well
from normexp.results import load_metrics, load_summary
from normexp.units import Stopped, UnitResult, WorkUnit, crashed, plan_units, run_unit

GRID = """\
name: ex
base: {model: {depth: 4, width: 16}, train: {steps: 6, threads: THREADS}}
grid: {norm.placement: [post, pre], norm.kind: [layernorm, rmsnorm], optim.name: [adam, radam]}
seeds: [0, 1, 2]
"""
runner = CliRunner()


def sweep(config, out, *extra) -> None:
    result = runner.invoke(app, ["sweep", str(config), "--out", str(out), "-q", *extra])
    assert result.exit_code == 0, result.output


def losses(out) -> dict:
    tidy = load_metrics(out)
    return {rid: [repr(v) for v in run.sort_values("step")["loss"]] for rid, run in tidy.groupby("run_id")}


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    folder = tmp_path_factory.mktemp("single")
    config = folder / "grid.yaml"
    config.write_text(GRID.replace("THREADS", "1"))
    sweep(config, folder / "out")
    return config, folder / "out"


def test_plan_units_batches_and_singles():
    runs = [RunConfig.model_validate({"seed": s, "optim": {"name": "adam"}}) for s in range(3)]
    runs += [RunConfig.model_validate({"optim": {"name": "radam", "lr": lr}}) for lr in (0.01, 0.003)]
    units = plan_units(runs, "batched", "cpu", threads=1)
    assert sorted((u.engine, len(u.configs)) for u in units) == [("batched", 3)] + [("reference", 1)] * 2
    assert all(u.engine == "reference" for u in plan_units(runs, "reference", "cpu", threads=1))


def test_run_unit_reports_errors_per_run():
    bad = WorkUnit((RunConfig().model_dump(mode="json"),), engine="reference", device="nope", threads=1)
    result = run_unit(bad)
    assert isinstance(result.outcomes[0], str) and "device" in result.outcomes[0].lower()
    assert crashed(bad, "gone").status == "crashed"


@pytest.mark.process
@pytest.mark.equivalence
def test_workers_2_equal_single_process(single_process, tmp_path):
    config, reference = single_process
    sweep(config, tmp_path / "out", "--workers", "2")
    assert losses(tmp_path / "out") == losses(reference)
    assert set(load_summary(tmp_path / "out")["threads"]) == {1}


def die(unit: WorkUnit) -> None:
    """Stands in for run_unit in a worker: the process dies at once."""
    os._exit(3)


@pytest.mark.process
def test_pool_retries_a_dead_worker_once_then_marks_crashed(monkeypatch):
    unit = WorkUnit((RunConfig(model={"depth": 1, "width": 4}, train={"steps": 1}).model_dump(mode="json"),),
                    engine="reference", device="cpu", threads=1)
    monkeypatch.setattr("normexp.executors.run_unit", die)  # the worker dies at once, every time
    results = list(PoolExecutor(1).run([unit]))
    assert len(results) == 1 and results[0].status == "crashed"


def worker_pid(unit: WorkUnit) -> UnitResult:
    """Stands in for run_unit in a worker: says which process it ran in."""
    return UnitResult(unit, (), status=str(os.getpid()))


@pytest.mark.process
def test_a_pool_keeps_its_idle_workers_for_the_next_run_until_closed(monkeypatch):
    """`--engine auto` runs its measurement, then the rest: the second run() must not start workers again
    (a second or more of imports each)."""
    unit = WorkUnit((RunConfig().model_dump(mode="json"),), engine="reference", device="cpu", threads=1)
    monkeypatch.setattr("normexp.executors.run_unit", worker_pid)
    pool = PoolExecutor(1)
    try:
        first, second = ([r.status for r in pool.run([unit, unit])] for _ in range(2))
        assert first[0] == first[1] and second == first and first[0] != str(os.getpid())
    finally:
        pool.close()
    assert pool._workers == []


@pytest.mark.process
def test_a_started_pool_trains_on_the_workers_it_started_and_starts_none_again(monkeypatch):
    """A pool sweep starts its workers before it prepares (`PoolExecutor.start`): run() then hands the units
    to those, and a second start() adds none."""
    unit = WorkUnit((RunConfig().model_dump(mode="json"),), engine="reference", device="cpu", threads=1)
    monkeypatch.setattr("normexp.executors.run_unit", worker_pid)
    pool = PoolExecutor(2)
    try:
        pool.start()
        pool.start()
        started = {w.process.pid for w in pool._workers}
        assert len(started) == 2 and all(w.process.is_alive() for w in pool._workers)
        ran = {int(r.status) for r in pool.run([unit] * 6)}
        assert ran <= started and {w.process.pid for w in pool._workers} == started
    finally:
        pool.close()
    assert pool._workers == []


def started_at(unit: WorkUnit) -> UnitResult:
    """Stands in for run_unit in a worker: says when it started."""
    return UnitResult(unit, (), status=repr(time.time()))


@pytest.mark.process
def test_a_worker_gets_its_next_unit_before_the_sweep_writes_the_last_ones_results(monkeypatch):
    """The coordinator writes a unit's run folders between two results: its one worker must train the next
    unit meanwhile, not wait for those writes (on 2 cores they left the workers idle 15% of a sweep)."""
    unit = WorkUnit((RunConfig().model_dump(mode="json"),), engine="reference", device="cpu", threads=1)
    monkeypatch.setattr("normexp.executors.run_unit", started_at)
    pool = PoolExecutor(1)
    try:
        running = pool.run([unit, unit])
        next(running)
        time.sleep(1.0)  # the first unit's results being written
        written = time.time()
        second = float(next(running).status)
        assert second < written - 0.5, "the second unit started only after the first one's results were written"
    finally:
        pool.close()


@pytest.mark.process
@pytest.mark.equivalence
@pytest.mark.slow
def test_local_dask_cluster_equals_single_process(single_process, tmp_path):
    pytest.importorskip("distributed")
    config, reference = single_process
    sweep(config, tmp_path / "out", "--cluster", "local:2")
    assert losses(tmp_path / "out") == losses(reference)


@pytest.mark.process
def test_unreachable_scheduler_is_a_clear_error(write_yaml, tmp_path, monkeypatch):
    pytest.importorskip("distributed")
    monkeypatch.setattr(executors, "CONNECT_TIMEOUT_S", 1.0)  # a refused connection is retried that long (10 s)
    result = runner.invoke(app, ["sweep", str(write_yaml(GRID.replace("THREADS", "1"))), "--out", str(tmp_path / "o"),
                                 "--cluster", "tcp://127.0.0.1:9"])
    assert result.exit_code == 2 and "cannot reach the scheduler" in result.output



@contextlib.contextmanager
def tcp_server(answer: bytes | None, hold_s: float = 8.0) -> Iterator[str]:
    """The address of a TCP server on 127.0.0.1 that accepts every connection and, to whatever it reads,
    answers `answer` and closes; with None it stays silent and closes after `hold_s`. It stops when the
    block ends (its thread, a daemon, also by itself within a minute)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop, held = threading.Event(), []

    def serve() -> None:
        deadline = time.monotonic() + 60
        while not stop.is_set() and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                conn, _ = listener.accept()
                held.append((conn, time.monotonic()))
            for conn, since in list(held):
                if answer is not None:
                    with contextlib.suppress(OSError):
                        conn.settimeout(1)
                        conn.recv(65536)
                        conn.sendall(answer)
                if answer is not None or time.monotonic() - since > hold_s:
                    conn.close()
                    held.remove((conn, since))
        for conn, _ in held:
            conn.close()
        listener.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()


def cluster_sweep(write_yaml, tmp_path, address: str):
    """`normexp sweep --cluster ADDRESS` in this process: (its result, seconds it took)."""
    start = time.monotonic()
    result = runner.invoke(app, ["sweep", str(write_yaml(GRID.replace("THREADS", "1"))), "--out", str(tmp_path / "o"),
                                 "--cluster", address])
    return result, time.monotonic() - start


def non_daemon_threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if not thread.daemon}


@pytest.mark.process
def test_a_scheduler_address_that_accepts_and_stays_silent_is_an_error_in_bounded_time(write_yaml, tmp_path,
                                                                                        monkeypatch):
    """Dask's handshake waits for an answer forever: normexp bounds it (10 s; 1 s here), with one error
    line and no thread left that would keep the process alive."""
    pytest.importorskip("distributed")
    monkeypatch.setattr(executors, "CONNECT_TIMEOUT_S", 1.0, raising=False)
    threads = non_daemon_threads()
    with tcp_server(None) as address:  # silent; closes after 8 s, so that a hang is a failure, not a hung test
        result, took = cluster_sweep(write_yaml, tmp_path, address)
    assert result.exit_code == 2 and result.output.startswith(f"error: --cluster {address}: cannot reach the "
                                                              "scheduler (no answer within 1 s)"), result.output
    assert len(result.output.strip().splitlines()) == 1 and took < 6
    assert non_daemon_threads() == threads and not (tmp_path / "o").exists()


@pytest.mark.process
def test_a_server_at_the_cluster_address_that_is_not_dask_is_named_so(write_yaml, tmp_path):
    """An HTTP server's answer, read as Dask's frame sizes, asked for 3 EiB: a MemoryError traceback."""
    pytest.importorskip("distributed")
    with tcp_server(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n") as address:
        result, took = cluster_sweep(write_yaml, tmp_path, address)
    assert result.exit_code == 2 and result.output.startswith(f"error: --cluster {address}: not a Dask scheduler"), \
        result.output
    assert len(result.output.strip().splitlines()) == 1 and took < 10 and not (tmp_path / "o").exists()



TINY = {"name": "w", "base": {"model": {"depth": 2, "width": 8}, "train": {"steps": 3}}, "seeds": [0, 1]}


@contextlib.contextmanager
def scheduler_without_workers(join_after_s: float = 10.0) -> Iterator[Any]:
    """An in-process Dask cluster with no worker yet: one joins after `join_after_s` anyway (were the
    sweep to wait silently, the test fails instead of hanging), or when the test scales it."""
    from distributed import LocalCluster

    with LocalCluster(n_workers=0, processes=False, protocol="tcp", host="127.0.0.1",
                      dashboard_address=None) as cluster:
        anyway = threading.Timer(join_after_s, cluster.scale, (1,))
        anyway.start()
        try:
            yield cluster
        finally:
            anyway.cancel()


@pytest.mark.process
def test_a_scheduler_without_workers_is_said_until_one_joins(tmp_path, monkeypatch):
    """The sweep says that the scheduler has no workers (every 30 s; 1 s here) until one joins, then
    trains as usual."""
    pytest.importorskip("distributed")
    from normexp.config import build_sweep
    from normexp.sweep import SweepOptions, run_sweep

    monkeypatch.setattr(executors, "IDLE_NOTICE_S", 1.0, raising=False)
    said = []
    with scheduler_without_workers() as cluster:
        def on_event(event) -> None:
            if event.kind == "waiting":
                said.append((time.monotonic() - start, event.error))
                if len(said) == 2:
                    cluster.scale(1)  # a worker joins after the second notice

        start = time.monotonic()
        outcome = run_sweep(build_sweep(TINY), tmp_path / "out", SweepOptions(cluster=cluster.scheduler_address),
                            on_event)
    assert outcome.count("completed") == 2
    assert len(said) in (2, 3) and said[0][0] < 5, said  # a third, at most, while the worker starts
    assert f"{cluster.scheduler_address} has no workers" in said[0][1], said


@pytest.mark.process
def test_a_stop_signal_while_waiting_for_workers_interrupts_the_sweep(tmp_path, monkeypatch):
    pytest.importorskip("distributed")
    import signal

    from normexp.config import build_sweep
    from normexp.sweep import SweepInterrupted, SweepOptions, run_sweep

    monkeypatch.setattr(executors, "IDLE_NOTICE_S", 1.0, raising=False)

    def stop(signum, frame):
        raise KeyboardInterrupt

    def ctrl_c_when_told(event) -> None:
        if event.kind == "waiting":
            os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, stop)
    try:
        with scheduler_without_workers() as cluster, pytest.raises(SweepInterrupted) as stopped:
            run_sweep(build_sweep(TINY), tmp_path / "out", SweepOptions(cluster=cluster.scheduler_address),
                      ctrl_c_when_told)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert set(stopped.value.outcome.statuses.values()) == {"interrupted"}


@pytest.mark.parametrize("quiet", [False, True])
def test_waiting_for_workers_is_said_on_stderr(monkeypatch, quiet):
    """The command prints the notice to stderr, --quiet or not: it is all there is to see meanwhile."""
    import io

    from rich.console import Console

    from normexp.commands import sweep as command
    from normexp.sweep import SweepEvent

    out, err = (Console(file=io.StringIO(), width=200) for _ in range(2))
    monkeypatch.setattr(command, "out", out)
    monkeypatch.setattr(command, "err", err)
    with command._progress(3, quiet) as on_event:
        on_event(SweepEvent("waiting", "", 0, 3, error="the scheduler has no workers"))
    assert err.file.getvalue() == "the scheduler has no workers\n" and out.file.getvalue() == ""



@pytest.mark.process
def test_the_scheduler_check_tells_a_worker_from_a_scheduler():
    """A Dask worker's address answers Dask's protocol, but is not where a sweep can submit its runs."""
    pytest.importorskip("distributed")
    from distributed import LocalCluster

    with LocalCluster(n_workers=1, processes=False, protocol="tcp", host="127.0.0.1",
                      dashboard_address=None) as cluster:
        executors.check_scheduler(cluster.scheduler_address, 10)
        worker = next(iter(cluster.scheduler_info["workers"]))
        with pytest.raises(executors.ExecutorError, match="not a Dask scheduler .a Dask Worker answers there"):
            executors.check_scheduler(worker, 10)


def test_dask_executor_class_is_importable():
    assert DaskExecutor.__doc__


@pytest.mark.process
def test_slurm_example_renders_a_job_script_without_slurm():
    pytest.importorskip("dask_jobqueue")
    import subprocess
    import sys

    from conftest import REPO

    result = subprocess.run([sys.executable, str(REPO / "examples" / "slurm.py"), "--dry-run", "--partition", "cpu",
                             "--cores", "8", "--host", "127.0.0.1", "--port", "0", "--account", "lab", "--qos", "low",
                             "--prologue", "module load gcc"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    script = result.stdout
    for line in ("#SBATCH -p cpu", "#SBATCH --cpus-per-task=8", "#SBATCH -A lab", "#SBATCH --qos=low",
                 "#SBATCH -t 01:00:00", "module load gcc", f"{sys.executable} -m distributed.cli.dask_worker"):
        assert line in script
    assert "--exclusive" not in script and ".venv/bin/activate" not in script  # nothing a cluster may refuse
    assert "dask_worker tcp://127.0.0.1:" in script and "--nworkers 8" in script and "--nthreads 1" in script


def _seeds_unit(threads: int = 1) -> WorkUnit:
    runs = [RunConfig.model_validate({"model": {"depth": 2, "width": 8}, "train": {"steps": 4}, "seed": s})
            for s in range(3)]
    return WorkUnit(tuple(r.model_dump(mode="json") for r in runs), engine="batched", device="cpu", threads=threads)


def test_a_failing_run_does_not_fail_its_batch_mates(monkeypatch):
    import normexp.engines.batched
    import normexp.engines.reference

    unit = _seeds_unit()
    batched = run_unit(unit)  # the batch's own numbers, before anything fails
    real_train_run = normexp.engines.reference.train_run

    def fail_batch(runs, device="cpu", on_step=None):
        raise ZeroDivisionError("float division by zero")

    def fail_seed_1(cfg, **kwargs):
        if cfg.seed == 1:
            raise ZeroDivisionError("float division by zero")
        return real_train_run(cfg, **kwargs)

    monkeypatch.setattr(normexp.engines.batched, "train_batch", fail_batch)
    monkeypatch.setattr(normexp.engines.reference, "train_run", fail_seed_1)
    result = run_unit(unit)
    assert isinstance(result.outcomes[1], str) and "ZeroDivisionError" in result.outcomes[1]
    for i in (0, 2):
        assert not isinstance(result.outcomes[i], str), result.outcomes[i]
        assert result.outcomes[i].metrics == batched.outcomes[i].metrics  # the same bits, run alone
        assert result.outcomes[i].engine == "reference"


@pytest.mark.process
@pytest.mark.slow
def test_local_dask_cluster_trains_with_the_sweeps_thread_count(tmp_path, write_yaml):
    """With `train.threads` left open, `normexp sweep --cluster local:N` trains with the thread count
    of an in-process sweep. Both run as fresh processes, as a user starts them: the cluster must not
    change the count before torch loads (pytest's own process has loaded torch already)."""
    pytest.importorskip("distributed")
    import subprocess
    import sys

    config = write_yaml("name: c\nbase: {model: {depth: 4, width: 16}, train: {steps: 6}}\n"
                        "grid: {norm.placement: [post, pre]}\nseeds: [0, 1]\n")
    for out, extra in (("single", []), ("cluster", ["--cluster", "local:2"])):
        subprocess.run([sys.executable, "-m", "normexp", "sweep", str(config), "--out", str(tmp_path / out), "-q",
                        *extra], check=True, timeout=600)
    threads = set(load_summary(tmp_path / "single")["threads"])
    assert set(load_summary(tmp_path / "cluster")["threads"]) == threads
    assert losses(tmp_path / "cluster") == losses(tmp_path / "single")


def test_resume_redoes_a_run_trained_with_other_threads(tmp_path):
    """One sweep never mixes thread counts: a finished run recorded with another count is redone, saying why."""
    import json

    import torch

    from normexp.config import build_sweep
    from normexp.folder import FinishedRun, run_id, write_run
    from normexp.sweep import run_sweep

    spec = build_sweep({"name": "t", "base": {"model": {"depth": 2, "width": 8}, "train": {"steps": 3}},
                        "seeds": [0, 1]})
    out = tmp_path / "out"
    run_sweep(spec, out)
    run_dir = out / run_id(spec.runs[0])
    done = json.loads((run_dir / "done.json").read_text())
    metrics = pd.read_csv(run_dir / "metrics.csv").to_dict("list")
    # as if an earlier sweep had trained it with another count: a verified run, stamped as such
    write_run(run_dir, spec.runs[0], FinishedRun(metrics, done["status"], done["wall_s"],
                                                 torch.get_num_threads() + 1, done["engine"], done["device"]))
    events = []
    outcome = run_sweep(spec, out, on_event=events.append)
    redone = [e for e in events if e.kind == "redone"]
    assert [e.run_id for e in redone] == [run_id(spec.runs[0])]
    assert f"{torch.get_num_threads() + 1} torch threads" in redone[0].error
    assert outcome.count("skipped") == 1 and outcome.count("completed") == 1
    assert set(load_summary(out)["threads"]) == {torch.get_num_threads()}


def small_runs(threads: int, steps: int = 5) -> list[RunConfig]:
    return [RunConfig.model_validate({"model": {"depth": 6, "width": 16}, "norm": {"placement": p, "kind": k},
                                      "train": {"steps": steps, "threads": threads}, "seed": s})
            for p in ("post", "pre") for k in ("layernorm", "rmsnorm") for s in (0, 1)]


@pytest.mark.equivalence
@pytest.mark.parametrize("threads", [1, 2])
def test_paired_runs_give_the_bits_of_runs_one_after_another(threads, monkeypatch):
    """The in-process executor trains small reference runs two at a time, in threads: same bits."""
    configs = small_runs(threads)
    units = plan_units(configs, "reference", "cpu", threads)
    assert all(pairs_well(unit) for unit in units)
    where = []

    def recording(unit, stop=None):
        where.append(threading.current_thread().name)
        return run_unit(unit, stop)

    monkeypatch.setattr(executors, "run_unit", recording)
    paired_outcome = {id(r.unit): r.outcomes[0] for r in InProcessExecutor().run(units)}
    assert len(paired_outcome) == len(units) and len(set(where)) == 2 and threading.main_thread().name not in where
    for cfg, unit in zip(configs, units):
        alone = train_run(cfg)
        paired = paired_outcome[id(unit)]
        assert paired.threads == alone.threads == threads
        assert paired.metrics == alone.metrics  # every step's loss, acc, lr and grad norm, bit for bit


@pytest.mark.equivalence
@pytest.mark.parametrize("threads", [1, 2])
def test_paired_fast_batches_give_the_bits_of_batches_one_after_another(threads, monkeypatch):
    configs = small_runs(threads)
    units = plan_units(configs, "fast", "cpu", threads, compile=False)
    assert len(units) == 4 and all(len(unit.configs) == 2 and pairs_well(unit) for unit in units)
    where = []

    def recording(unit, stop=None):
        where.append(threading.current_thread().name)
        return run_unit(unit, stop)

    monkeypatch.setattr(executors, "run_unit", recording)
    paired = {id(r.unit): r.outcomes for r in InProcessExecutor().run(units)}
    assert len(paired) == len(units) and len(set(where)) == 2 and threading.main_thread().name not in where
    for unit in units:
        alone = train_fast(unit.runs, "cpu", compile=False)
        assert [o.threads for o in paired[id(unit)]] == [r.threads for r in alone] == [threads] * 2
        assert [o.metrics for o in paired[id(unit)]] == [r.metrics for r in alone]  # bit for bit


def test_only_small_reference_runs_and_eager_fast_batches_of_one_thread_count_are_paired(monkeypatch):
    small = plan_units(small_runs(1), "reference", "cpu", 1)
    big = plan_units([RunConfig.model_validate({"model": {"width": 512}})], "reference", "cpu", 1)
    batched = plan_units(small_runs(1), "batched", "cpu", 1)
    compiled = plan_units(small_runs(1), "fast", "cpu", 1, compile=True)
    assert all(pairs_well(u) for u in small) and not pairs_well(big[0]) and not any(pairs_well(u) for u in batched)
    assert not any(pairs_well(u) for u in compiled)  # a compiled step is not shared between threads
    where = []
    monkeypatch.setattr(executors, "run_unit", lambda unit, stop=None: where.append(threading.current_thread())
                        or crashed(unit, "not trained"))
    mixed = plan_units(small_runs(1)[:2], "reference", "cpu", 1) + plan_units(small_runs(2)[:2], "reference", "cpu", 2)
    assert len(list(InProcessExecutor().run(mixed))) == 4
    assert where == [threading.main_thread()] * 4  # two thread counts: one after another


@pytest.mark.parametrize("engine", ["reference", "fast"])
def test_closing_the_executor_stops_paired_runs_at_their_next_step(engine):
    units = plan_units(small_runs(1, steps=100_000)[:4:2], engine, "cpu", 1, compile=False)  # minutes each
    assert len(units) == 2 and all(pairs_well(unit) for unit in units)
    executor = InProcessExecutor()
    outcome = []

    def consume():
        try:
            outcome.extend(executor.run(units))
        except Stopped:
            outcome.append("stopped")

    consumer = threading.Thread(target=consume)
    consumer.start()
    time.sleep(1.0)
    start = time.perf_counter()
    executor.close()
    consumer.join(timeout=30)
    assert not consumer.is_alive() and outcome == ["stopped"] and time.perf_counter() - start < 10


# ----------------------------------------------------------------------------- a worker that dies holding its next unit


def seed_or_die(unit):
    """Stands in for run_unit in a pool worker: says its unit's seed; dies on seed 1 while $SEED_OR_DIE
    names a file that it may still create (once: `die once`), or always (`die always`)."""
    import os
    from pathlib import Path

    from normexp.units import UnitResult

    seed, flag = unit.runs[0].seed, os.environ.get("SEED_OR_DIE", "")
    mode, _, path = flag.partition(":")
    if seed == 1 and mode == "always":
        os._exit(3)
    if seed == 1 and mode == "once" and not Path(path).exists():
        Path(path).write_text("died")
        os._exit(3)
    return UnitResult(unit, (), status=str(seed))


@pytest.mark.process
@pytest.mark.parametrize("mode", ["once", "always"])
def test_a_worker_that_dies_holding_the_unit_it_got_before_the_last_results_were_written(monkeypatch, tmp_path,
                                                                                        mode):
    """One worker: it is handed seed 1 while the consumer still holds seed 0's results, and dies on it. Seed 1
    costs one attempt per death (retried once, then crashed); no unit is lost or reported twice."""
    from normexp.config import RunConfig
    from normexp.executors import PoolExecutor
    from normexp.units import WorkUnit

    units = [WorkUnit((RunConfig(seed=s).model_dump(mode="json"),), engine="reference", device="cpu", threads=1)
             for s in range(3)]
    monkeypatch.setenv("SEED_OR_DIE", f"{mode}:{tmp_path / 'died'}")
    monkeypatch.setattr("normexp.executors.run_unit", seed_or_die)
    pool = PoolExecutor(1)
    try:
        got = sorted((r.unit.runs[0].seed, r.status) for r in pool.run(units))
    finally:
        pool.close()
    assert got == [(0, "0"), (1, "1" if mode == "once" else "crashed"), (2, "2")]
