"""Shards of a sweep (`--shard I/N`, normexp/shard.py), `normexp merge` (normexp/merge.py) and the job-array
launcher (normexp/launch.py): shards cover the plan in whole batches, run at once into one folder or into
three folders merged, and give the unsharded sweep's bits; merge refuses conflicting runs and removes nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from normexp.cli import app
from normexp.config import ConfigError, build_sweep, load_sweep, parse_yaml
from normexp.folder import METRICS_FILE, FinishedRun, StoreError, SweepLock, lock_owner, run_id, write_run
from normexp.merge import merge_folders
from normexp.shard import parse_shard, shard_runs
from normexp.sweep import SweepOptions, run_sweep
from normexp.units import plan_units

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()

SHARDED = """\
name: sharded
base:
  model: {depth: 2, width: 8}
  data: {n_samples: 16}
  train: {steps: 4, threads: 1}
grid:
  norm.placement: [pre, post]
  norm.kind: [layernorm, rmsnorm]
  optim.lr: [0.01, 0.001]
seeds: [0, 1]
"""


def _sweep():
    return build_sweep(parse_yaml(SHARDED))


def _metrics(folder: Path) -> dict[str, bytes]:
    return {p.parent.name: p.read_bytes() for p in folder.glob(f"*/{METRICS_FILE}")
            if not p.parent.name.startswith(".")}


@pytest.mark.parametrize(("text", "message"), [("1/1", "I must be from 0 to N - 1"), ("3/3", "I must be from 0"),
                                               ("0/0", "N >= 1"), ("a/3", "expected I/N"), ("1", "expected I/N")])
def test_bad_shards_are_refused(text, message):
    with pytest.raises(ConfigError, match=f"^--shard {text}: .*{message}"):
        parse_shard(text)
    assert parse_shard(" 2 / 5 ") == (2, 5)


@pytest.mark.parametrize("engine", ["reference", "batched", "fast"])
@pytest.mark.parametrize("count", [1, 2, 3, 7, 40])
def test_shards_cover_the_plan_once_in_whole_batches(engine, count):
    sweep = build_sweep(parse_yaml(SHARDED), ["seeds=0,1,2"])
    batches = {frozenset(map(run_id, u.runs)) for u in plan_units(sweep.runs, engine, "cpu", 1, False, sweep.runs)}
    shards = [shard_runs(sweep.runs, engine, i, count) for i in range(count)]
    ids = [run_id(cfg) for shard in shards for cfg in shard]
    assert sorted(ids) == sorted(run_id(cfg) for cfg in sweep.runs)  # every run once
    for shard in shards:
        assert shard == [cfg for cfg in sweep.runs if cfg in shard]  # in the sweep's order
        mine = {run_id(cfg) for cfg in shard}
        assert all(batch <= mine or not batch & mine for batch in batches)  # whole batches only
        replanned = {frozenset(map(run_id, u.runs)) for u in plan_units(shard, engine, "cpu", 1, False, shard)}
        assert replanned <= batches  # the shard alone plans the same batches
    if count <= len(batches):
        assert all(shards)  # no shard idle while there is a batch for it


def _dealt_by_scanning(runs, engine, index, count):
    """The deal as first written: each unit, largest first, to the least loaded of all N shards (a scan)."""
    units = plan_units(runs, engine, "cpu", 1, False, runs)
    cost = [sum(c["train"]["steps"] + 1 for c in unit.configs) for unit in units]
    load, mine = [0] * count, set()
    for k in sorted(range(len(units)), key=lambda k: -cost[k]):
        shard = min(range(count), key=lambda i: (load[i], i))
        load[shard] += cost[k]
        mine |= {run_id(cfg) for cfg in units[k].runs} if shard == index else set()
    return [cfg for cfg in runs if run_id(cfg) in mine]


def test_any_count_of_shards_is_dealt_in_bounded_time_as_the_scan_deals_it():
    """--shard 0/100000000 took 22 s for a 2-run sweep (a scan of every shard per unit): a hang for a larger N."""
    import time

    sweep = build_sweep(parse_yaml(SHARDED), ["seeds=0,1,2", "train.steps=4,5"])
    for engine in ("reference", "batched"):
        for count in (1, 2, 3, 5, 7, 40, 100):
            for index in range(min(count, 8)):
                assert shard_runs(sweep.runs, engine, index, count) == _dealt_by_scanning(sweep.runs, engine, index,
                                                                                          count)
    start = time.perf_counter()
    assert len(sweep.runs) < 100  # past one shard per unit, shard 0 gets what it gets of 100, the last nothing
    assert shard_runs(sweep.runs, "reference", 0, 10**9) == _dealt_by_scanning(sweep.runs, "reference", 0, 100)
    assert shard_runs(sweep.runs, "reference", 10**9 - 1, 10**9) == []
    assert time.perf_counter() - start < 5


@pytest.mark.equivalence
@pytest.mark.parametrize("engine", ["batched", pytest.param("fast", marks=pytest.mark.slow)])  # fast: ~20 s
def test_three_shards_in_three_folders_merged_equal_the_unsharded_sweep_bit_for_bit(tmp_path, engine):
    sweep = _sweep()
    run_sweep(sweep, tmp_path / "full", SweepOptions(engine=engine))
    for i in range(3):
        outcome = run_sweep(sweep, tmp_path / f"s{i}", SweepOptions(engine=engine, shard=(i, 3)))
        assert outcome.total == len(shard_runs(sweep.runs, engine, i, 3))
    merged = merge_folders(tmp_path / "merged", [tmp_path / f"s{i}" for i in range(3)])
    assert len(merged.copied) == len(sweep.runs) and merged.unfinished == 0 and merged.verification.clean
    assert _metrics(tmp_path / "merged") == _metrics(tmp_path / "full") and len(_metrics(tmp_path / "full")) == 16
    again = merge_folders(tmp_path / "merged", [tmp_path / "s0"])  # idempotent
    assert again.copied == [] and again.kept == len(shard_runs(sweep.runs, "batched", 0, 3))


@pytest.mark.process
@pytest.mark.equivalence
@pytest.mark.slow  # three processes, each loading torch: 35 s on two busy cores
def test_three_shards_at_once_into_one_folder_equal_the_unsharded_sweep_bit_for_bit(tmp_path, write_yaml):
    config = write_yaml(SHARDED)
    run_sweep(_sweep(), tmp_path / "full", SweepOptions(engine="batched"))
    procs = [subprocess.Popen([sys.executable, "-m", "normexp", "sweep", str(config), "--out", str(tmp_path / "one"),
                               "--shard", f"{i}/3", "-q"], cwd=REPO, stderr=subprocess.PIPE, text=True)
             for i in range(3)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0], [p.stderr.read() for p in procs]
    assert _metrics(tmp_path / "one") == _metrics(tmp_path / "full")
    result = runner.invoke(app, ["verify", str(tmp_path / "one")])
    assert result.exit_code == 0, result.output  # summary.csv, history.jsonl (3 lines) and every run hold
    assert (tmp_path / "one" / "history.jsonl").read_text().count('"shard"') == 3


def test_a_shard_and_a_whole_sweep_never_share_a_folder(tmp_path):
    with SweepLock(tmp_path, shared=True), SweepLock(tmp_path, shared=True):  # shards share the folder
        assert lock_owner(tmp_path) is not None  # verify and merge see it in use
        with pytest.raises(StoreError, match="another sweep is writing here"):
            SweepLock(tmp_path).__enter__()
    with SweepLock(tmp_path), pytest.raises(StoreError, match="another sweep is writing here"):
        SweepLock(tmp_path, shared=True).__enter__()
    assert lock_owner(tmp_path) is None


def _conflicting_copy(tmp_path: Path) -> tuple[Path, Path, str]:
    """Two folders of the sweep's shard 0, one run of which holds other (verified) numbers in the second."""
    sweep = _sweep()
    first, second = tmp_path / "a", tmp_path / "b"
    for folder in (first, second):
        run_sweep(sweep, folder, SweepOptions(engine="batched", shard=(0, 3)))
    cfg = shard_runs(sweep.runs, "batched", 0, 3)[0]
    rows = (first / run_id(cfg) / METRICS_FILE).read_text().splitlines()
    columns = rows[0].split(",")
    metrics = {c: [float(r.split(",")[k]) if c != "step" else int(r.split(",")[k]) for r in rows[1:]]
               for k, c in enumerate(columns)}
    metrics["loss"][-1] += 1e-6
    write_run(second / run_id(cfg), cfg, FinishedRun(metrics, "completed", 0.1, 1, "batched", "cpu"))
    return first, second, run_id(cfg)


@pytest.mark.slow  # two sweeps and three merges: ~6 s
def test_merge_refuses_conflicting_runs_and_writes_nothing(tmp_path):
    first, second, rid = _conflicting_copy(tmp_path)
    with pytest.raises(StoreError, match=f"(?s)conflicting runs, nothing merged.*{rid}: .* hold different results "
                                         r"\(metrics.csv differ\)"):
        merge_folders(tmp_path / "out", [first, second])
    assert not [p for p in (tmp_path / "out").iterdir() if p.name != ".lock"]
    merge_folders(tmp_path / "out", [first])
    result = runner.invoke(app, ["merge", str(tmp_path / "out"), str(second)])  # against OUT's own run
    assert result.exit_code == 2 and f"{rid}: " in result.output and "different results" in result.output


def test_merge_removes_nothing_it_did_not_write(tmp_path):
    sweep = _sweep()
    run_sweep(sweep, tmp_path / "s0", SweepOptions(engine="batched", shard=(0, 2)))
    rid = run_id(shard_runs(sweep.runs, "batched", 0, 2)[0])
    (tmp_path / "out" / rid).mkdir(parents=True)
    (tmp_path / "out" / rid / "notes.txt").write_text("mine")
    (tmp_path / "out" / "analysis.txt").write_text("mine too")
    outcome = merge_folders(tmp_path / "out", [tmp_path / "s0"])
    assert rid in outcome.copied
    assert (tmp_path / "out" / rid / "notes.txt").read_text() == "mine"
    assert (tmp_path / "out" / "analysis.txt").read_text() == "mine too"
    assert (tmp_path / "s0" / rid / METRICS_FILE).read_bytes() == (tmp_path / "out" / rid / METRICS_FILE).read_bytes()


def test_merge_refuses_folders_of_two_sweeps(tmp_path):
    run_sweep(_sweep(), tmp_path / "a", SweepOptions(engine="batched", shard=(0, 8)))
    other = build_sweep({**parse_yaml(SHARDED), "name": "other"})
    run_sweep(other, tmp_path / "b", SweepOptions(engine="batched", shard=(0, 8)))
    result = runner.invoke(app, ["merge", str(tmp_path / "out"), str(tmp_path / "a"), str(tmp_path / "b")])
    assert result.exit_code == 2 and "merge joins the shards of one sweep" in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.process
def test_dry_run_shows_the_sbatch_script(tmp_path, write_yaml):
    pytest.importorskip("submitit")
    config = write_yaml(SHARDED)
    result = runner.invoke(app, ["sweep", str(config), "--out", str(tmp_path / "o"), "--launcher", "slurm",
                                 "--shards", "3", "--partition", "cpu", "--account", "lab", "--qos", "low",
                                 "--time", "90", "--cpus", "4", "--mem", "8G", "--array-parallelism", "2",
                                 "--setup", "module load python", "--dry-run"])
    assert result.exit_code == 0, result.output
    text = result.output
    for line in ("#SBATCH --array=0-2%2", "#SBATCH --partition=cpu", "#SBATCH --account=lab", "#SBATCH --qos=low",
                 "#SBATCH --time=90", "#SBATCH --cpus-per-task=4", "#SBATCH --mem=8G", "#SBATCH --signal=USR2@90",
                 "module load python", sys.executable):
        assert line in text
    assert "--exclusive" not in text
    assert f"--out {(tmp_path / 'o').resolve()}" in text and "--shard I/N" in text
    assert not (tmp_path / "o").exists()  # nothing written, nothing submitted


@pytest.mark.process
@pytest.mark.parametrize(("option", "value", "message"), [
    ("--partition", "", "one word"), ("--account", "lab\n#SBATCH --exclusive", "one word"),
    ("--qos", "low prio", "one word"), ("--mem", "", "one word"), ("--mem", "lots", "a size as sbatch reads it")])
def test_slurm_words_are_one_word_each(tmp_path, write_yaml, option, value, message):
    """An empty or multi-line --partition/--account/--qos/--mem wrote `#SBATCH --partition=''` or a broken
    script into the array's submission."""
    config = write_yaml(SHARDED)
    result = runner.invoke(app, ["sweep", str(config), "--out", str(tmp_path / "o"), "--launcher", "slurm",
                                 "--shards", "2", option, value, "--dry-run"])
    assert result.exit_code == 2 and f"{option} " in result.output and message in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "o").exists()
    ok = runner.invoke(app, ["sweep", str(config), "--out", str(tmp_path / "o"), "--launcher", "slurm", "--shards",
                             "2", "--partition", "gpu,cpu", "--mem", "16000", "--account", "my-lab_1", "--dry-run"])
    assert ok.exit_code == 0 or "submitit" in ok.output, ok.output


@pytest.mark.process
def test_launcher_options_are_checked(tmp_path, write_yaml):
    config = write_yaml(SHARDED)
    result = runner.invoke(app, ["sweep", str(config), "--launcher", "local", "--shards", "2", "--shard", "0/2"])
    assert result.exit_code == 2 and "give one or the other" in result.output
    result = runner.invoke(app, ["sweep", str(config), "--shard", "1/3", "--dry-run"])
    listed = [run_id(cfg) for cfg in shard_runs(_sweep().runs, "auto", 1, 3)]
    assert result.exit_code == 0
    assert f"shard 1/3 trains {len(listed)} runs of the 16: {' '.join(listed)}" in result.output
    result = runner.invoke(app, ["sweep", str(config), "--launcher", "slurm"])
    assert result.exit_code == 2 and "--launcher and --shards go together" in result.output
    result = runner.invoke(app, ["sweep", str(config), "--launcher", "pbs", "--shards", "2"])
    assert result.exit_code == 2 and "--launcher" in result.output


@pytest.mark.process
def test_submitting_without_slurm_is_one_error_line(tmp_path, write_yaml):
    pytest.importorskip("submitit")
    import shutil

    if shutil.which("srun"):
        pytest.skip("a Slurm cluster: this would submit")
    result = runner.invoke(app, ["sweep", str(write_yaml(SHARDED)), "--out", str(tmp_path / "o"), "--launcher", "slurm",
                                 "--shards", "2"])
    assert result.exit_code == 2 and result.output.startswith("error: --launcher slurm: ") and "srun" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "o").exists()


@pytest.mark.process
def test_a_shard_task_is_requeued_as_itself():
    pytest.importorskip("submitit")
    from normexp.launch import ShardTask

    task = ShardTask(["sweep", "x.yaml"], 4)
    again = task.checkpoint(2)
    assert again.function is task and again.args == (2,)
    import pickle

    old = pickle.loads(pickle.dumps(task))
    del old.__dict__["own_session"], old.__dict__["_child"]  # as a task an earlier normexp pickled
    revived = pickle.loads(pickle.dumps(old))
    assert (revived.own_session, revived._child, revived.argv) == (False, None, task.argv)
    assert task.command(2)[-2:] == ["--shard", "2/4"] and task.command(2)[0] == sys.executable


@pytest.mark.process
@pytest.mark.slow  # submitit starts a process per task, each loading torch
def test_the_local_launcher_runs_the_array_with_submitit(tmp_path, write_yaml):
    pytest.importorskip("submitit")
    config = write_yaml(SHARDED)
    result = runner.invoke(app, ["sweep", str(config), "--out", str(tmp_path / "o"), "--launcher", "local",
                                 "--shards", "2", "--engine", "batched"])
    assert result.exit_code == 0, result.output
    run_sweep(load_sweep(config), tmp_path / "full", SweepOptions(engine="batched"))
    assert _metrics(tmp_path / "o") == _metrics(tmp_path / "full")
    assert len(list((tmp_path / "o" / ".submitit").rglob("*_result.pkl"))) == 2
    assert not [p for p in (tmp_path / "o" / ".submitit").rglob("*") if "%" in p.name]  # a literal %j folder was left


def test_merge_refuses_a_folder_of_the_users_that_holds_a_summary_csv(tmp_path):
    """OUT without sweep.yaml but with a summary.csv (the user's): merge rewrote it with the sweep's."""
    run_sweep(_sweep(), tmp_path / "a", SweepOptions(engine="batched", shard=(0, 8)))
    out = tmp_path / "analysis"
    out.mkdir()
    (out / "summary.csv").write_text("mine,1\n")
    result = runner.invoke(app, ["merge", str(out), str(tmp_path / "a")])
    assert result.exit_code == 2 and "not a sweep folder normexp wrote" in result.output, result.output
    assert [p.name for p in out.iterdir()] == ["summary.csv"] and (out / "summary.csv").read_text() == "mine,1\n"


@pytest.mark.process
@pytest.mark.parametrize("launcher", ["slurm", "local"])
def test_the_arrays_tasks_run_with_the_options_the_command_gave(tmp_path, write_yaml, launcher):
    """--launcher dropped --device, --compile/--no-compile, --workers, --cluster and --max-runs from the
    tasks it started: each task ran on the defaults. The task's command line carries them."""
    pytest.importorskip("submitit")
    config = write_yaml(SHARDED)
    given = ["--engine", "fast", "--device", "cuda", "--no-compile", "--workers", "3", "--cluster", "local:2",
             "--max-runs", "500", "--fail-fast"]
    result = runner.invoke(app, ["sweep", str(config), "--out", str(tmp_path / "o"), "--launcher", launcher,
                                 "--shards", "2", *given, "--dry-run"])
    assert result.exit_code == 0, result.output
    task = " ".join(result.output.split()).split("task I running: ")[1]
    for option in (" ".join(given[i:i + 2]) for i in (0, 2, 5, 7, 9)):
        assert option in task, (option, task)
    assert "--no-compile" in task and "--fail-fast" in task
    plain = runner.invoke(app, ["sweep", str(config), "--out", str(tmp_path / "o"), "--launcher", launcher,
                                "--shards", "2", "--dry-run"])
    task = " ".join(plain.output.split()).split("task I running: ")[1]
    assert not any(o in task for o in ("--device", "compile", "--workers", "--cluster", "--max-runs", "--fail"))
    bad = runner.invoke(app, ["sweep", str(config), "--launcher", launcher, "--shards", "2", "--compile",
                              "--engine", "batched", "--dry-run"])
    assert bad.exit_code == 2 and "--compile" in bad.output, bad.output


WIDE = """\
name: wide
base: {model: {depth: 2, width: 8}, train: {steps: 3}}
grid: {optim.lr: [0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008]}
seeds: [0, 1, 2, 3, 4, 5, 6, 7]
"""


@pytest.mark.parametrize("compile_", [True, None])
def test_a_compiled_fast_sweep_is_dealt_out_by_its_compiled_batches(tmp_path, write_yaml, monkeypatch, compile_):
    """--shard dealt a compiled fast sweep out by 64-run uncompiled batches, though it trains 8-run compiled
    ones: 64 runs of one structure went to shard 0 and nothing to the other 7. Dealt by the batches it
    trains, each of 8 shards gets one compiled batch (with --compile, and where the sweep chooses to compile)."""
    from normexp.engines.fast import plan
    from normexp.engines.fast.plan import COMPILED_CHUNK

    monkeypatch.setattr(plan, "should_compile", lambda cfg, steps: True)  # the automatic choice: compile
    runs = build_sweep(parse_yaml(WIDE)).runs
    shards = [shard_runs(runs, "fast", i, 8, compile=compile_) for i in range(8)]
    assert [len(s) for s in shards] == [COMPILED_CHUNK] * 8
    assert sorted(run_id(c) for s in shards for c in s) == sorted(run_id(c) for c in runs)
    assert [len(shard_runs(runs, "fast", i, 8, compile=False)) for i in range(8)] == [64] + [0] * 7  # 64-run batch
    config = write_yaml(WIDE)
    flags = ["--compile"] if compile_ else []
    shown = runner.invoke(app, ["sweep", str(config), "--engine", "fast", *flags, "--shard", "3/8", "--dry-run"])
    assert shown.exit_code == 0 and "shard 3/8 trains 8 runs of the 64" in shown.output, shown.output


@pytest.mark.equivalence
def test_a_resumed_or_sharded_fast_sweep_keeps_the_unsharded_bits(tmp_path):
    """The fast engine's bits depend on the order of the runs in a batch (docs/fast-contract.md). What that
    implies: a resumed sweep trains each batch with a run to redo whole, in the planned order, and records
    only those runs; shards (one folder, or merged) train whole batches of the unsharded plan. Either way
    metrics.csv is the unsharded sweep's, byte for byte."""
    import shutil

    sweep = _sweep()
    options = {"engine": "fast", "compile": False}
    run_sweep(sweep, tmp_path / "full", SweepOptions(**options))
    full = _metrics(tmp_path / "full")
    assert len(full) == len(sweep.runs)
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    batches = plan_units(sweep.runs, "fast", "cpu", 1, False, sweep.runs)
    assert len(batches) > 1
    for unit in batches[:2]:  # the last run of two batches lost: each batch retrained whole, in its order
        shutil.rmtree(tmp_path / "resumed" / run_id(unit.runs[-1]))
    outcome = run_sweep(sweep, tmp_path / "resumed", SweepOptions(**options))
    assert outcome.total == len(sweep.runs) and _metrics(tmp_path / "resumed") == full
    for i in range(3):
        run_sweep(sweep, tmp_path / "one", SweepOptions(**options, shard=(i, 3)))
        run_sweep(sweep, tmp_path / f"s{i}", SweepOptions(**options, shard=(i, 3)))
    assert _metrics(tmp_path / "one") == full
    merge_folders(tmp_path / "merged", [tmp_path / f"s{i}" for i in range(3)])
    assert _metrics(tmp_path / "merged") == full
