"""Sweeps never lose work: SIGKILL and resume, Ctrl-C, two sweeps into one folder, divergence,
failing runs, a full disk. Real processes where signals matter."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import done_markers
from typer.testing import CliRunner

from normexp import folder
from normexp.cli import app
from normexp.engines import reference
from normexp.results import load_metrics, load_summary

SLOW_SWEEP = """\
name: slow
base:
  model: {depth: 16, width: 32}
  train: {steps: 30}
grid:
  norm.placement: [post, pre]
  optim.lr: [0.01, 0.003]
seeds: [0, 1, 2, 3]
"""

runner = CliRunner()


def start_sweep(config: Path, out: Path, *extra: str, engine: str = "reference") -> subprocess.Popen:
    """A sweep in its own process; the reference engine by default, so that it runs long enough to be
    interrupted part-way (the batched engine finishes this grid in two batches)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "normexp", "sweep", str(config), "--out", str(out),
                             "--engine", engine, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def wait_for_done(out: Path, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len(done_markers(out)) < count:
        assert time.monotonic() < deadline, "the sweep made no progress"
        time.sleep(0.02)


def losses_by_run(out: Path) -> dict[str, list[float]]:
    tidy = load_metrics(out)
    return {rid: list(run.sort_values("step")["loss"]) for rid, run in tidy.groupby("run_id")}


def threads_by_run(out: Path) -> dict[str, int]:
    return {run.name: json.loads((run / "done.json").read_text())["threads"] for run in out.glob("*-s*")}


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory) -> tuple[Path, Path]:
    """The same sweep, run once without interruption."""
    folder = tmp_path_factory.mktemp("clean")
    config = folder / "slow.yaml"
    config.write_text(SLOW_SWEEP)
    proc = start_sweep(config, folder / "out", "-q")
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    return config, folder / "out"


@pytest.mark.process
@pytest.mark.equivalence
@pytest.mark.parametrize("engine", ["reference", "batched"])
def test_sigkill_then_resume_equals_a_clean_run(clean_run, tmp_path, engine):
    config, clean_out = clean_run
    out = tmp_path / "out"
    proc = start_sweep(config, out, "-q", engine=engine)
    wait_for_done(out, 5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished = {p.parent.name: p.stat().st_mtime_ns for p in done_markers(out)}
    assert 5 <= len(finished) < 16
    resumed = start_sweep(config, out, engine=engine)  # the dead sweep's lock is taken over
    stdout, stderr = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, stderr
    assert f"{16 - len(finished)} ran, {len(finished)} already done" in stdout
    assert {rid: (out / rid / "done.json").stat().st_mtime_ns for rid in finished} == finished  # not redone
    assert losses_by_run(out) == losses_by_run(clean_run[1])
    assert set(load_summary(out)["status"]) == {"completed"}
    assert not list(out.glob("**/.*.tmp-*"))  # no temporary file left behind


@pytest.mark.process
def test_sigint_keeps_finished_runs_and_says_how_to_resume(clean_run, tmp_path):
    config, clean_out = clean_run
    out = tmp_path / "out"
    proc = start_sweep(config, out, "-q")
    wait_for_done(out, 3)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "Resume with: normexp sweep" in stderr and "Traceback" not in stderr
    summary = load_summary(out)
    finished = int((summary["status"] == "completed").sum())
    assert finished >= 3 and set(summary["status"]) <= {"completed", "interrupted"}
    assert (summary["status"] == "interrupted").sum() == 16 - finished
    resumed = start_sweep(config, out, "-q")
    assert resumed.wait(timeout=120) == 0
    assert losses_by_run(out) == losses_by_run(clean_out)


@pytest.mark.process
def test_second_sweep_into_a_busy_folder_fails_at_once(clean_run, tmp_path):
    config, clean_out = clean_run
    out = tmp_path / "out"
    first = start_sweep(config, out, "-q")
    wait_for_done(out, 1)
    # The first sweep is paused (SIGSTOP) while the second starts, so it still holds the folder however
    # slowly the second one loads on a busy machine; a paused process's bits are its own.
    first.send_signal(signal.SIGSTOP)
    try:
        second = start_sweep(config, out)
        _, stderr = second.communicate(timeout=60)
        assert first.poll() is None  # the second sweep gave up while the first still held the folder
    finally:
        first.send_signal(signal.SIGCONT)
    assert second.returncode == 2
    assert "another sweep is writing here" in stderr and f"pid={first.pid}" in stderr
    assert first.wait(timeout=120) == 0  # the first sweep is untouched
    assert threads_by_run(out) == threads_by_run(clean_out)  # equal bits are promised for equal thread counts
    assert losses_by_run(out) == losses_by_run(clean_out)


def test_divergence_is_recorded_and_the_sweep_goes_on(write_yaml, tmp_path):
    config = write_yaml("name: d\nbase: {model: {depth: 4, width: 8}, norm: {placement: none}, "
                        "optim: {name: sgd}, train: {steps: 10}}\ngrid: {optim.lr: [10000.0, 0.01]}\n")
    result = runner.invoke(app, ["sweep", str(config), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    summary = load_summary(tmp_path / "out").set_index("optim.lr")
    assert summary.loc[10000.0, "status"] == "diverged" and bool(summary.loc[10000.0, "diverged"])
    assert summary.loc[10000.0, "steps_done"] == 1  # stopped at the first non-finite loss
    assert summary.loc[0.01, "status"] == "completed"
    metrics = (tmp_path / "out" / summary.loc[10000.0, "run_id"] / "metrics.csv").read_text().splitlines()
    assert metrics[-1].startswith("1,nan,")


def test_divergence_without_stopping(write_yaml, tmp_path):
    config = write_yaml("name: d\nbase: {model: {depth: 4, width: 8}, norm: {placement: none}, "
                        "optim: {name: sgd, lr: 10000.0}, train: {steps: 6, stop_on_nonfinite: false}}\n")
    assert runner.invoke(app, ["sweep", str(config), "--out", str(tmp_path / "out"), "-q"]).exit_code == 0
    tidy = load_metrics(tmp_path / "out")
    assert len(tidy) == 7 and tidy["status"].iloc[0] == "diverged"


def failing_for_seed_1(real):
    def train_run(cfg, **kwargs):
        if cfg.seed == 1:
            raise RuntimeError("boom")
        return real(cfg, **kwargs)
    return train_run


def test_a_failing_run_is_recorded_and_the_sweep_goes_on(write_yaml, tmp_path, monkeypatch):
    monkeypatch.setattr(reference, "train_run", failing_for_seed_1(reference.train_run))
    config = write_yaml("name: f\nbase: {model: {depth: 2, width: 8}, train: {steps: 2}}\nseeds: [0, 1, 2]\n")
    out = tmp_path / "out"
    result = runner.invoke(app, ["sweep", str(config), "--out", str(out), "--engine", "reference"])
    assert result.exit_code == 1
    summary = load_summary(out)
    assert list(summary["status"]) == ["completed", "failed", "completed"]
    assert "RuntimeError: boom" in summary["error"][1]
    failed = json.loads((out / summary["run_id"][1] / "failed.json").read_text())
    assert failed["status"] == "failed" and "boom" in failed["error"]
    monkeypatch.undo()  # the next sweep retries the failed run only
    result = runner.invoke(app, ["sweep", str(config), "--out", str(out)])
    assert result.exit_code == 0 and "1 ran, 2 already done" in result.output


def test_a_failing_batch_is_retried_run_by_run(write_yaml, tmp_path, monkeypatch):
    """A batch that raises is retried one run at a time on the reference engine: its runs finish."""
    from normexp.engines import batched

    real = batched.train_batch

    def train_batch(runs, device="cpu", on_step=None):
        if runs[0].norm.kind == "rmsnorm":
            raise RuntimeError("batch boom")
        return real(runs, device, on_step)

    monkeypatch.setattr(batched, "train_batch", train_batch)
    config = write_yaml("name: f\nbase: {model: {depth: 2, width: 8}, train: {steps: 2}}\n"
                        "grid: {norm.kind: [layernorm, rmsnorm]}\nseeds: [0, 1]\n")
    result = runner.invoke(app, ["sweep", str(config), "--out", str(tmp_path / "out"), "--engine", "batched"])
    assert result.exit_code == 0, result.output
    summary = load_summary(tmp_path / "out")
    assert list(summary["status"]) == ["completed"] * 4
    assert list(summary["engine"]) == ["batched", "batched", "reference", "reference"]


def test_fail_fast_stops_at_the_first_failure(write_yaml, tmp_path, monkeypatch):
    monkeypatch.setattr(reference, "train_run", failing_for_seed_1(reference.train_run))
    config = write_yaml("name: f\nbase: {model: {depth: 2, width: 8}, train: {steps: 2}}\nseeds: [0, 1, 2]\n")
    result = runner.invoke(app, ["sweep", str(config), "--out", str(tmp_path / "out"), "--fail-fast",
                                 "--engine", "reference"])
    assert result.exit_code == 1
    # these small runs train two at a time: seed 0 beside seed 1 finishes or is stopped with the sweep
    first, failed, last = load_summary(tmp_path / "out")["status"]
    assert first in ("completed", "pending") and failed == "failed" and last == "pending"


def test_full_disk_is_explained_and_resumable(write_yaml, tmp_path, monkeypatch):
    config = write_yaml("name: f\nbase: {model: {depth: 2, width: 8}, train: {steps: 2}}\nseeds: [0, 1, 2]\n")
    out = tmp_path / "out"
    real_write, calls = folder.write.atomic_write, []

    def fill_up(path, text):
        calls.append(path)
        if path.name == "metrics.csv" and len([c for c in calls if c.name == "metrics.csv"]) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_write(path, text)

    monkeypatch.setattr(folder.write, "atomic_write", fill_up)
    result = runner.invoke(app, ["sweep", str(config), "--out", str(out)])
    assert result.exit_code == 2 and "disk full" in result.output and "Traceback" not in result.output
    assert len(list(out.glob("*/done.json"))) == 1
    monkeypatch.undo()
    result = runner.invoke(app, ["sweep", str(config), "--out", str(out)])
    assert result.exit_code == 0 and "2 ran, 1 already done" in result.output


@pytest.mark.parametrize("where", ["metrics.csv", "done.json", "rename"])
def test_a_full_disk_leaves_no_staging_folder_behind(write_yaml, tmp_path, monkeypatch, where):
    """ENOSPC while the second run's folder is written (a file of it, or the rename that puts it in
    place): its staging folder `.RUN.tmp-PID/` is removed on the way out, not left to the next sweep,
    and the finished run is intact."""
    config = write_yaml("name: f\nbase: {model: {depth: 2, width: 8}, train: {steps: 2}}\nseeds: [0, 1, 2]\n")
    out = tmp_path / "out"
    real_write, real_replace, written = folder.write.atomic_write, folder.write.os.replace, []

    def full(path):
        return OSError(errno.ENOSPC, "No space left on device", str(path))

    def write(path, text):
        written.append(path.name)
        if where != "rename" and written.count(where) == 2:
            raise full(path)
        real_write(path, text)

    def replace(src, dst):
        if where == "rename" and Path(src).is_dir() and written.count("done.json") == 2:
            raise full(dst)
        real_replace(src, dst)

    monkeypatch.setattr(folder.write, "atomic_write", write)
    monkeypatch.setattr(folder.write.os, "replace", replace)
    result = runner.invoke(app, ["sweep", str(config), "--out", str(out)])
    assert result.exit_code == 2 and "disk full" in result.output, result.output
    assert not list(out.glob("**/.*.tmp-*")) and not list(out.glob("**/.*.old-*"))
    finished = [p.parent for p in out.glob("*/done.json")]
    assert len(finished) == 1 and folder.inspect_run(finished[0]).finished
    monkeypatch.undo()
    result = runner.invoke(app, ["sweep", str(config), "--out", str(out)])
    assert result.exit_code == 0 and "2 ran, 1 already done" in result.output


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_a_full_disk_while_a_run_folder_is_replaced_keeps_the_finished_one(tmp_path, monkeypatch, exchange):
    """A --force rerun whose swap fails with ENOSPC: the finished folder stays in place, whole (put back at
    once where two renames were under way), and the new one's staging folder is gone."""
    from normexp.config import RunConfig

    cfg = RunConfig.model_validate({"model": {"depth": 2, "width": 4}, "train": {"steps": 2}})
    run_dir = tmp_path / folder.run_id(cfg)

    def finished(loss: float) -> folder.FinishedRun:
        metrics = {"step": [0, 1, 2], "loss": [loss] * 3, "acc": [0.5] * 3, "lr": [0.01] * 3, "grad_norm": [1.0] * 3}
        return folder.FinishedRun(metrics, "completed", 0.1, 1, "reference", "cpu")

    folder.write_run(run_dir, cfg, finished(1.0))
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    real_replace = folder.write.os.replace

    def no_space(*args):
        raise OSError(errno.ENOSPC, "No space left on device", str(run_dir))

    def replace(src, dst):
        if Path(src).name.startswith(f".{run_dir.name}.tmp-"):
            no_space()
        real_replace(src, dst)

    monkeypatch.setattr(folder.write, "_exchange", no_space if exchange else lambda a, b: False)
    monkeypatch.setattr(folder.write.os, "replace", replace)
    with pytest.raises(OSError, match="No space left"):
        folder.write_run(run_dir, cfg, finished(2.0))
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before
    assert folder.inspect_run(run_dir, cfg).finished and sorted(tmp_path.iterdir()) == [run_dir]


def test_truncated_done_marker_does_not_count(write_yaml, tmp_path):
    config = write_yaml("name: f\nbase: {model: {depth: 2, width: 8}, train: {steps: 2}}\nseeds: [0, 1]\n")
    out = tmp_path / "out"
    runner.invoke(app, ["sweep", str(config), "--out", str(out), "-q"])
    victim = next(out.glob("*/done.json"))
    victim.write_text(victim.read_text()[:20])  # what a torn write would leave, were writes not atomic
    result = runner.invoke(app, ["sweep", str(config), "--out", str(out)])
    assert "1 ran, 1 already done" in result.output


def test_lock_holds_pid_and_host_and_is_released(tmp_path):
    with folder.SweepLock(tmp_path) as lock:
        assert f"pid={os.getpid()}" in lock.owner()
        with pytest.raises(folder.StoreError, match="another sweep is writing here"):
            folder.SweepLock(tmp_path).__enter__()
    with folder.SweepLock(tmp_path):  # released: can be taken again
        pass


def test_a_units_run_folders_reach_the_disk_in_one_sync(tmp_path, monkeypatch):
    """Inside `synced_together` no write fsyncs (a run folder's seven fsyncs cost as much CPU as a fast run's
    training); the block's end syncs the file system once, however the block ends. Outside it every write is
    fsynced as before."""
    fsyncs: list[int] = []
    syncs: list[Path] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(fd), real_fsync(fd)))
    monkeypatch.setattr(folder.atomic, "_sync_file_system", syncs.append)
    with folder.synced_together(tmp_path):
        with folder.synced_together(tmp_path):  # nested: the outer block syncs
            folder.atomic_write(tmp_path / "a.txt", "a")
        folder.atomic_write(tmp_path / "b.txt", "b")
        assert fsyncs == [] and syncs == []
    assert syncs == [tmp_path] and fsyncs == []
    with pytest.raises(RuntimeError), folder.synced_together(tmp_path):
        folder.atomic_write(tmp_path / "c.txt", "c")
        raise RuntimeError("a failing write further on")
    assert syncs == [tmp_path] * 2 and fsyncs == []
    folder.atomic_write(tmp_path / "d.txt", "d")
    assert len(fsyncs) == 2  # the file, then its folder
    assert [(tmp_path / f"{n}.txt").read_text() for n in "abcd"] == list("abcd")



# ----------------------------------------------------------------------------- a stop while workers finish units


def seed_after(unit):
    """Stands in for run_unit in a pool worker: says its unit's seed after `train.steps` hundredths of a second."""
    import time

    from normexp.units import UnitResult

    time.sleep(unit.runs[0].train.steps / 100)
    return UnitResult(unit, (), status=str(unit.runs[0].seed))


@pytest.mark.process
def test_units_a_pool_finished_but_never_yielded_when_the_sweep_stopped_are_unreported_not_lost(monkeypatch):
    """The consumer stops (Ctrl-C while it writes seed 0's results) after the pool handed that worker its next
    unit: seed 2 finishes meanwhile, as does seed 1 on the other worker. Both are trained runs the sweep never
    saw: the pool keeps them in `unreported` (as InProcessExecutor does) for the sweep to record, not thrown
    away with the workers. Seed 3 was never handed out."""
    from normexp.config import RunConfig
    from normexp.executors import PoolExecutor
    from normexp.units import WorkUnit

    steps = {0: 1, 1: 100, 2: 1, 3: 1}  # seed 0 first (or 1: then 0 and 2 end while it is written)
    units = [WorkUnit((RunConfig(seed=s, train={"steps": steps[s]}).model_dump(mode="json"),), engine="reference",
                      device="cpu", threads=1) for s in range(4)]
    monkeypatch.setattr("normexp.executors.run_unit", seed_after)
    pool = PoolExecutor(2)
    try:
        running = pool.run(units)
        first = next(running)
        time.sleep(2.5)  # its results being written: the Ctrl-C is raised when they are in place
        running.close()
        assert sorted([first.status] + [r.status for r in pool.unreported]) == ["0", "1", "2"]
    finally:
        pool.close()


@pytest.mark.process
def test_a_ctrl_c_while_a_pool_sweep_writes_records_the_units_its_workers_finished_meanwhile(monkeypatch, tmp_path):
    """The sweep end to end (--workers 2, the reference engine): Ctrl-C while the first unit's run is written;
    the worker handed its next unit meanwhile, and the other worker, finish theirs. Every run that trained is
    in its folder and reported as such in the summary; no run is reported that was not written."""
    from normexp import sweep as sweep_module
    from normexp.config import build_sweep
    from normexp.results import load_summary
    from normexp.sweep import SweepInterrupted, SweepOptions, run_sweep

    spec = build_sweep({"name": "c", "base": {"model": {"depth": 1, "width": 4}, "train": {"steps": 2}},
                        "seeds": [0, 1, 2, 3, 4, 5]})
    real, calls = sweep_module._record_unit, []

    def record_then_ctrl_c(result, *args):
        real(result, *args)
        calls.append(result)
        if len(calls) == 1:
            time.sleep(4.0)  # the other units finish meanwhile
            raise KeyboardInterrupt

    monkeypatch.setattr(sweep_module, "_record_unit", record_then_ctrl_c)
    with pytest.raises(SweepInterrupted) as stopped:
        run_sweep(spec, tmp_path, SweepOptions(engine="reference", workers=2))
    statuses = stopped.value.outcome.statuses
    written = {p.parent.name for p in tmp_path.glob("*/done.json")}
    assert len(calls) == 3  # the first unit, then the two finished while it was written
    assert {rid for rid, status in statuses.items() if status == "completed"} == written and len(written) == 3
    summary = load_summary(tmp_path)
    assert sorted(summary["status"]) == ["completed"] * 3 + ["interrupted"] * 3
