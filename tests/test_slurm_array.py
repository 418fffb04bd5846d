"""What `sweep --launcher slurm` submits (normexp/launch.py), through a fake submitit executor: the array is
named after the sweep, only the shards with runs left are submitted, a `--time` too short is refused or
warned with the numbers, requeues are capped, and a task whose runs failed fails. The same on a real
cluster: tests/test_slurm_cluster.py."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from normexp import launch
from normexp.cli import app
from normexp.config import build_sweep, parse_yaml
from normexp.folder import METRICS_FILE, RunState, run_id
from normexp.launch import ArrayPlan, ArraySettings, RunsFailed, ShardTask, check_time, max_requeues, plan_array
from normexp.shard import shard_runs
from normexp.sweep import SweepOptions, run_sweep

runner = CliRunner()

TINY = """\
name: tiny-grid
base: {model: {depth: 2, width: 8}, data: {n_samples: 16}, train: {steps: 4, threads: 1}}
grid: {norm.placement: [pre, post, peri]}
seeds: [0, 1]
"""
# a batch of 8 runs of 20,000 steps at depth 24: hours on the estimate's 2 CPU cores
BIG = """\
name: big
base: {model: {depth: 24, width: 64}, data: {n_samples: 256}, train: {steps: 20000}}
grid: {norm.placement: [pre]}
seeds: [0, 1, 2, 3, 4, 5, 6, 7]
"""


class FakeExecutor:
    """submitit's SlurmExecutor as `launch.submit` uses it; what it was given is kept in `submitted`."""

    submitted: list[dict] = []

    def __init__(self, folder, max_num_timeout):
        self.record = {"folder": folder, "max_num_timeout": max_num_timeout}
        FakeExecutor.submitted.append(self.record)

    def update_parameters(self, **params):
        self.record["params"] = params

    def map_array(self, fn, args):
        self.record.update(task=fn, args=list(args))
        return [SimpleNamespace(job_id=f"77_{k}") for k in range(len(self.record["args"]))]


@pytest.fixture
def fake_slurm(monkeypatch):
    FakeExecutor.submitted = []
    monkeypatch.setattr(launch, "_submitit", lambda: SimpleNamespace(SlurmExecutor=FakeExecutor))
    return FakeExecutor.submitted


def submit(config: Path, out: Path, *options: str):
    return runner.invoke(app, ["sweep", str(config), "--out", str(out), "--launcher", "slurm", "--shards", "3",
                               *options])


def test_the_array_is_named_after_the_sweep(tmp_path, write_yaml, fake_slurm):
    """Every array was named `normexp`: in squeue and sacct, one sweep's array could not be told from another."""
    result = submit(write_yaml(TINY), tmp_path / "o")
    assert result.exit_code == 0, result.output
    assert fake_slurm[0]["params"]["job_name"] == "tiny-grid"
    assert "submitted job array 77 'tiny-grid' (3 tasks)" in result.output
    assert ArraySettings(2, "warmup").slurm_parameters()["job_name"] == "warmup"


@pytest.mark.process  # the sbatch script is submitit's, imported
def test_the_sbatch_script_names_the_sweep(tmp_path, write_yaml):
    pytest.importorskip("submitit")
    result = submit(write_yaml(TINY), tmp_path / "o", "--dry-run")
    assert result.exit_code == 0 and "#SBATCH --job-name=tiny-grid" in result.output, result.output


def test_a_resubmit_submits_only_the_shards_with_runs_left(tmp_path, write_yaml, fake_slurm):
    """A resubmit queued every task again, those whose runs were all finished too."""
    config = write_yaml(TINY)
    sweep, out = build_sweep(parse_yaml(TINY)), tmp_path / "o"
    for shard in (0, 2):
        run_sweep(sweep, out, SweepOptions(shard=(shard, 3)))
    result = submit(config, out)
    assert result.exit_code == 0, result.output
    assert fake_slurm[-1]["args"] == [1] and fake_slurm[-1]["params"]["array_parallelism"] == 1
    assert "(1 task)" in result.output and "1 of the 3 shards has runs left (1;" in result.output
    assert fake_slurm[-1]["task"].command(fake_slurm[-1]["args"][0])[-2:] == ["--shard", "1/3"]
    # a finished run whose file no longer matches its checksum is not finished: its shard is submitted again
    broken = run_id(shard_runs(sweep.runs, "auto", 2, 3)[0])
    (out / broken / METRICS_FILE).write_text("step,loss\n")
    assert submit(config, out).exit_code == 0 and fake_slurm[-1]["args"] == [1, 2]
    assert submit(config, out, "--force").exit_code == 0 and fake_slurm[-1]["args"] == [0, 1, 2]
    run_sweep(sweep, out, SweepOptions())
    done = submit(config, out)
    assert done.exit_code == 0 and "no task to submit" in done.output and len(fake_slurm) == 3, done.output


@pytest.mark.parametrize("minutes", [1, 2])
def test_a_time_too_short_to_train_is_refused_with_the_numbers(tmp_path, write_yaml, fake_slurm, minutes):
    """--time 1 was submitted: Slurm's --signal=USR2@90 told each task to stop at once, and submitit requeued
    it, 7 times and 8 minutes for a sweep of seconds (a batch longer than the window: 100 times)."""
    result = submit(write_yaml(BIG if minutes == 2 else TINY), tmp_path / "o", "--time", str(minutes))
    if minutes == 2:  # 30 s before the stop signal: the big batch's hours are warned of, and it is submitted
        assert result.exit_code == 0 and "warning: --time 2 is too short for the largest batch left" in result.output
        assert len(fake_slurm) == 1 and fake_slurm[0]["params"]["time"] == 2
    else:
        assert result.exit_code == 2 and result.output.startswith("error: --time 1 is too short"), result.output
        assert not fake_slurm and not (tmp_path / "o").exists()
    assert "--signal=USR2@90" in result.output and f"against a limit of {minutes} " in result.output
    assert "Estimated minutes per task:" in result.output and "Give --time " in result.output


def test_the_time_check_weighs_the_largest_batch_left():
    big = build_sweep(parse_yaml(BIG))
    plan = plan_array(big.runs, "auto", 1, Path("/nonexistent"))
    hours = plan.batch_s / 3600
    assert hours > 1 and plan.shard_s == plan.batch_s and plan.todo == (0,)
    need = int((90 + 30 + plan.batch_s) // 60) + 1
    assert check_time(need, plan, "slurm") == (None, None)
    refusal, warning = check_time(need - 1, plan, "slurm")
    assert refusal is None and f"Give --time {need} or more" in warning
    assert f"Estimated minutes per task: {(30 + plan.batch_s) / 60:.1f}" in warning
    refusal, _ = check_time(1, ArrayPlan((0,), 0.0, 0.0), "local")  # the local executor warns 30 s before
    assert refusal is None
    assert check_time(1, ArrayPlan((0,), 0.0, 0.0), "slurm")[0].startswith("--time 1 is too short")
    unknown = check_time(1, ArrayPlan((0,)), "slurm")[0]  # a GPU sweep with nothing measured
    assert "unknown on this device" in unknown


def test_no_time_is_refused_where_no_task_is_left():
    """A resubmit of a finished sweep with --time 1 was refused as too short for its batches left, though
    none is left and nothing would be submitted (`no task to submit`)."""
    assert check_time(1, ArrayPlan((), 0.0, 0.0), "slurm") == (None, None)
    assert check_time(1, ArrayPlan(()), "slurm") == (None, None)
    assert check_time(1, ArrayPlan((2,), 0.0, 0.0), "slurm")[0].startswith("--time 1 is too short")


def test_the_time_is_measured_from_the_folders_finished_runs(tmp_path, monkeypatch):
    """The estimate's rates are 2 CPU cores'; runs finished in the folder tell the speed of the machine
    that trained them (their wall_s against the estimate)."""
    from normexp.engines.cost import estimated_seconds

    sweep = build_sweep(parse_yaml(TINY))
    first = sweep.runs[0]
    (tmp_path / run_id(first)).mkdir()
    (tmp_path / run_id(first) / "done.json").write_text("{}")
    slow = 1000 * estimated_seconds([first], "auto")
    monkeypatch.setattr(launch, "inspect_run", lambda path, cfg: RunState("finished", done={"wall_s": slow}))
    plan = plan_array(sweep.runs, "auto", 3, tmp_path)
    estimated = plan_array(sweep.runs, "auto", 3, tmp_path / "empty")
    assert plan.measured and not estimated.measured
    assert plan.batch_s == pytest.approx(1000 * estimated.batch_s)
    assert "this folder's finished runs" in check_time(1, plan, "slurm")[0]
    assert plan_array(sweep.runs, "auto", 3, tmp_path / "empty", device="cuda").batch_s is None


def test_requeues_are_capped_by_the_shards_time_left():
    """Every task could be requeued 100 times past its --time, whatever it had left to do."""
    assert max_requeues(10, ArrayPlan((0,), 60.0, 120.0), "slurm") == 3 + 2
    assert max_requeues(10, ArrayPlan((0,), 60.0, 100 * 3600.0), "slurm") == 100
    assert max_requeues(10, ArrayPlan((0,)), "slurm") == 100  # nothing tells the time: submitit's own cap
    assert max_requeues(10, ArrayPlan((0,), 60.0, 120.0), "local") == 3


def test_the_submission_caps_requeues_and_fails_on_failed_runs(tmp_path, write_yaml, fake_slurm):
    result = submit(write_yaml(TINY), tmp_path / "o", "--time", "10")
    assert result.exit_code == 0, result.output
    assert fake_slurm[0]["max_num_timeout"] == 3 + 2  # a sweep of seconds: one requeue of 450 s covers it
    assert "requeued and resumes, at most 5 times" in result.output
    assert fake_slurm[0]["task"].fail_on_failed_runs


@pytest.mark.process  # the task runs its shard as a process
def test_a_task_whose_runs_failed_fails(monkeypatch):
    """A shard whose runs failed exits 1, which the task returned as its result: Slurm recorded it COMPLETED."""
    task = ShardTask(["sweep", "x.yaml", "--out", "/o"], 3, fail_on_failed_runs=True)
    monkeypatch.setattr(ShardTask, "command", lambda self, index: [sys.executable, "-c", "raise SystemExit(1)"])
    with pytest.raises(RunsFailed, match=r"^shard 1/3: some of its runs failed.*normexp verify /o"):
        task(1)
    assert ShardTask(["sweep", "x.yaml"], 3)(1) == 1  # --launcher local: the result names them (exit 1)
