"""Sweeps at scale: a large sweep's log gets a progress line every few percent or seconds with an ETA (and a
line per failure), not a line per run; a small one keeps its line per run."""

from __future__ import annotations

import io

import pytest
from conftest import subprocess_output
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from normexp import progress
from normexp.progress import ProgressLines, sweep_progress
from normexp.sweep import SweepEvent


def test_progress_lines_come_every_five_percent_with_statuses_and_an_eta():
    now = [0.0]
    lines = ProgressLines(1000, clock=lambda: now[0])
    shown = []
    for done in range(1, 1001):
        now[0] += 0.02
        status = "diverged" if done % 10 == 0 else "completed"
        line = lines.update(SweepEvent("finished", f"r{done}", done, 1000, status))
        if line is not None:
            shown.append(line)
    assert len(shown) == 20
    assert shown[0] == "[50/1000] 5% · 45 completed, 5 diverged · 0m01s elapsed, ETA 0m19s"  # 0.02 s a run
    assert shown[-1] == "[1000/1000] 100% · 900 completed, 100 diverged · 0m20s elapsed, done"


def test_progress_lines_come_every_thirty_seconds_and_skipped_runs_cost_no_eta():
    now = [0.0]
    lines = ProgressLines(10_000, clock=lambda: now[0])
    assert lines.update(SweepEvent("skipped", "a", 1, 10_000)) is None
    now[0] = 31.0
    line = lines.update(SweepEvent("finished", "b", 2, 10_000, "completed"))
    assert line == "[2/10000] 0% · 1 completed, 1 skipped · 0m31s elapsed, ETA ?"  # no rate from one run
    now[0] = 62.0
    line = lines.update(SweepEvent("finished", "c", 3, 10_000, "completed"))
    assert line == "[3/10000] 0% · 2 completed, 1 skipped · 1m02s elapsed, ETA 86h05m"  # 31 s a run since "b"


def test_the_eta_leaves_out_what_came_before_the_first_batch_finished():
    """A compiled sweep's first 16-run batch finishes after a 99 s compile (what the 10,240-run phase grid
    showed: "[1/10240] ... ETA 280h38m"); then batches come every 1.4 s. The ETA counts from the first
    batch's last run, so it is the batches' pace times the runs left, not the compile's share of each run."""
    now = [0.0]
    lines = ProgressLines(10_240, clock=lambda: now[0])
    now[0] = 99.0
    shown = []
    for batch in range(64):
        for run in range(16):
            now[0] += 0.001  # one batch's runs are written one after another
            done = 16 * batch + run + 1
            line = lines.update(SweepEvent("finished", f"r{done}", done, 10_240, "completed"))
            if line is not None:
                shown.append(line)
        now[0] += 1.4
    assert shown[0] == "[1/10240] 0% · 1 completed · 1m39s elapsed, ETA ?"  # the 30 s line, within the first batch
    # 30 s later, at the first run of batch 23: 337 runs in the 31.1 s since the first batch, x the 9,887 left
    # (the batches' pace, 1.416 s / 16 runs, gives 14m35s; from the sweep's start it would read 60m42s)
    assert shown[1] == "[353/10240] 3% · 353 completed · 2m10s elapsed, ETA 15m14s", shown[1]



def test_a_progress_line_says_100_percent_only_when_every_run_is_done():
    lines = ProgressLines(1000, clock=lambda: 0.0)
    line = lines.update(SweepEvent("finished", "r", 999, 1000, "completed"))
    assert line.startswith("[999/1000] 99% ·"), line  # rounded, it read 100% with a run still training

def test_a_large_sweep_log_has_progress_lines_and_each_failure_a_small_one_a_line_per_run(monkeypatch):
    for total, per_run in ((4, True), (progress.PER_RUN_LINES + 1, False)):
        file = io.StringIO()
        console = Console(file=file, force_terminal=False, width=200)
        with sweep_progress(console, total, quiet=False) as show:
            for done in range(1, total + 1):
                failed = done == 3
                show(SweepEvent("failed" if failed else "finished", f"r{done}", done, total,
                                "failed" if failed else "completed", None if failed else 0.5,
                                error="boom" if failed else ""))
        out = file.getvalue().splitlines()
        assert f"[3/{total}] r3 failed: boom" in out
        if per_run:
            assert len(out) == total
        else:
            assert len(out) == 1 + 21 and out[-1].startswith(f"[{total}/{total}] 100% · 200 completed, 1 failed")


def test_a_large_grids_dry_run_summarises_each_axis_counts_done_runs_and_estimates_the_time(write_yaml, tmp_path):
    from typer.testing import CliRunner

    from normexp.cli import app
    from normexp.config import load_sweep
    from normexp.folder import run_id

    lrs = [round(0.001 * (i + 1), 4) for i in range(30)]
    config = write_yaml(f"name: big\nbase: {{model: {{depth: 2, width: 8}}, train: {{steps: 3}}}}\n"
                        f"grid: {{optim.lr: {lrs}}}\nseeds: {list(range(10))}\n")
    out = tmp_path / "out"
    first = run_id(load_sweep(config).runs[0])
    (out / first).mkdir(parents=True)
    (out / first / "done.json").write_text("{}")
    result = CliRunner().invoke(app, ["sweep", str(config), "--out", str(out), "--dry-run"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[:3] == ["big: 300 runs", "  optim.lr: 30 values (0.001, 0.002, 0.003, ..., 0.029, 0.03)",
                         "  seed: 10 values (0, 1, 2, ..., 8, 9)"]
    assert lines[3].startswith(f"1 already done, 299 to run in {out}; estimated ~") and "--engine fast" in lines[3]
    assert len(lines) == 4 and {p.name for p in out.iterdir()} == {first}


@pytest.mark.process
def test_a_compiled_fast_sweep_on_several_cores_trains_in_one_single_threaded_worker_per_core(monkeypatch):
    from types import SimpleNamespace

    from normexp import executors
    from normexp.config import RunConfig
    from normexp.sweep import SweepOptions, fast_pool

    monkeypatch.setattr(executors, "usable_cores", lambda: 2)
    run = RunConfig.model_validate({"train": {"steps": 60}})
    small = SimpleNamespace(runs=[RunConfig.model_validate({"train": {"steps": 2}})] * 2)
    big = SimpleNamespace(runs=[run] * 4096)  # the article's model: compiling pays (`should_compile`)
    own = SimpleNamespace(runs=[RunConfig.model_validate({"train": {"steps": 60, "threads": 2}})] * 4096)
    fast = SweepOptions(engine="fast")
    assert fast_pool(big, fast) == 2 and fast_pool(small, SweepOptions(engine="fast", compile=True)) == 2
    assert fast_pool(small, fast) == 0  # too small to compile by default: one process, as before
    for options in (SweepOptions(engine="auto"), SweepOptions(engine="fast", compile=False),
                    SweepOptions(engine="fast", workers=3), SweepOptions(engine="fast", workers=1),
                    SweepOptions(engine="fast", cluster="local"),
                    SweepOptions(engine="fast", device="cuda")):
        assert fast_pool(big, options) == 0, options
    assert fast_pool(own, fast) == 0  # the config chose its threads
    monkeypatch.setattr(executors, "usable_cores", lambda: 1)
    assert fast_pool(big, fast) == 0


@pytest.mark.process
def test_a_pool_sweep_is_decided_without_torch_and_leaves_its_import_for_after_its_workers_start():
    """The coordinator of a compiled fast sweep decides on its pool (`fast_pool`) and loads what it needs
    (`commands/sweep._import_engines`) without importing torch, so its workers start first and import theirs meanwhile;
    a sweep on another engine imports torch there, as before. In a fresh process (2 cores assumed)."""
    code = ("import sys\nfrom normexp import executors\nexecutors.usable_cores = lambda: 2\n"
            "from types import SimpleNamespace\nfrom normexp.commands.sweep import _import_engines\n"
            "from normexp.config import RunConfig\nfrom normexp.sweep import SweepOptions, fast_pool\n"
            "big = SimpleNamespace(runs=[RunConfig.model_validate({'train': {'steps': 60}})] * 4096)\n"
            "pool = fast_pool(big, SweepOptions(engine='fast'))\nassert pool == 2\n"
            "_import_engines(SweepOptions(engine='fast'), pool)\nprint('torch' in sys.modules)\n"
            "reference = SweepOptions(engine='reference')\n"
            "_import_engines(reference, fast_pool(big, reference))\nprint('torch' in sys.modules)\n")
    assert subprocess_output(code).split() == ["False", "True"]


@pytest.mark.slow
def test_a_compiled_fast_sweep_says_so_first_and_its_runs_record_one_thread(write_yaml, tmp_path):
    import json

    from typer.testing import CliRunner

    from normexp.cli import app
    from normexp.executors import usable_cores

    if usable_cores() < 2:
        pytest.skip("one core: no worker pool")
    config = write_yaml("name: c\nbase: {model: {depth: 2, width: 8}, data: {n_samples: 16}, train: {steps: 3}}\n"
                        "seeds: [0, 1, 2]\n")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["sweep", str(config), "--out", str(out), "--engine", "fast", "--compile"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0].startswith("engine fast: compiled, ")
    assert "MKL's path in the workers: its own choice (NORMEXP_MKL_PATH=own)" in result.output.splitlines()[0]
    assert {json.loads(p.read_text())["threads"] for p in out.glob("*/done.json")} == {1}
    assert json.loads((out / "history.jsonl").read_text().splitlines()[0])["workers_mkl_path"] == "own"
    again = CliRunner().invoke(app, ["sweep", str(config), "--out", str(out), "--engine", "fast", "--compile"])
    assert "0 ran, 3 already done" in again.output  # resumed alike: nothing redone for its thread count


def test_config_yaml_written_a_section_at_a_time_is_safe_dump_byte_for_byte():
    import yaml

    from normexp.config import RunConfig
    from normexp.folder.layout import config_yaml

    configs = [RunConfig(), RunConfig.model_validate({"optim": {"betas": [0.8, 0.95], "lr": 0.003}, "seed": 7}),
               RunConfig.model_validate({"model": {"arch": "transformer"}, "data": {"task": "copy"},
                                         "norm": {"placement": "mixln", "kind": "rmsnorm"}}),
               RunConfig.model_validate({"schedule": {"kind": "linear_warmup", "warmup_steps": 5},
                                         "train": {"steps": 60, "threads": 1}})]
    for cfg in configs + configs:  # the second time from the sections' cache
        assert config_yaml(cfg) == yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


@pytest.mark.slow
def test_the_traced_compiled_step_gives_the_eager_steps_numbers_and_is_reused_across_batches(tmp_path, monkeypatch):
    """The real compiler (AOTInductor): the compiled step within rounding of the eager one; later batches
    reuse it in memory, and a later process loads its package from disk, bit for bit the same runs."""
    from normexp.config import RunConfig
    from normexp.engines import fast
    from normexp.engines.fast import aot
    from normexp.engines.fast import compiled as compiling

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("NORMEXP_CACHE_DIR", str(tmp_path))
    compiling.reset_cache()
    runs = [RunConfig.model_validate({"model": {"depth": 2, "width": 8}, "data": {"n_samples": 16},
                                      "norm": {"placement": "post"}, "train": {"steps": 3}, "seed": s})
            for s in range(3)]
    compiled = fast.train_fast(runs, compile=True)
    eager = fast.train_fast(runs, compile=False)
    for a, b in zip(compiled, eager):
        assert max(abs(x - y) for x, y in zip(a.losses, b.losses)) < 1e-4
    assert len(compiling.kept_steps()) == 1 and len(list((tmp_path / "steps").glob("*.pt2"))) == 1
    fast.train_fast(runs[:2], compile=True)  # another batch of the structure: the same compiled step
    assert len(compiling.kept_steps()) == 1

    def no_compile(*args):
        raise AssertionError("compiled again instead of loading the package")

    compiling.reset_cache()  # as a later process: nothing in memory
    monkeypatch.setattr(aot, "compile_package", no_compile)
    loaded = fast.train_fast(runs, compile=True)
    assert [repr(r.metrics) for r in loaded] == [repr(r.metrics) for r in compiled]


def test_make_bench_times_auto_on_the_64_run_article_grid_it_names(tmp_path):
    """bench_scale's 'the article's 64-run grid' ran configs/warmup.yaml as written: one seed, 4 runs, no
    batch to share, so auto probed nothing ('engine auto: reference (no runs share a batch)') and its
    figure said nothing about auto's choice."""
    import importlib
    import sys
    from pathlib import Path

    from typer.testing import CliRunner

    from normexp.cli import app

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    bench = importlib.import_module("bench_scale")
    result = CliRunner().invoke(app, ["sweep", str(bench.REPO / "configs" / "warmup.yaml"), bench.ARTICLE_SEEDS,
                                      "--dry-run", "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "0 already done, 64 to run" in result.output


# ----------------------------------------------------------------------------- reading 10,000 runs: same results


def _configs():
    from normexp.config import RunConfig

    return [RunConfig(), RunConfig.model_validate({"optim": {"betas": [0.8, 0.95], "lr": 0.003}, "seed": 7}),
            RunConfig.model_validate({"model": {"arch": "transformer"}, "data": {"task": "copy"},
                                      "norm": {"placement": "mixln", "kind": "rmsnorm"}}),
            RunConfig.model_validate({"norm": {"placement": "deepnorm"}, "train": {"steps": 60, "threads": 1}})]


def test_flatten_and_the_config_hash_by_sections_are_the_whole_configs_own():
    """flatten and config_hash are written a section at a time from caches (by object, then by value): the
    same mapping and the same hash as from the whole config, the first time and from the caches."""
    import hashlib
    import json

    from normexp.config import flatten
    from normexp.folder.ids import config_hash, hashed_config

    for cfg in _configs() + _configs() + _configs()[:1] * 2:
        whole = {f"{s}.{k}" if isinstance(v, dict) else s: x for s, v in cfg.model_dump(mode="json").items()
                 for k, x in (v.items() if isinstance(v, dict) else [(None, v)])}
        assert flatten(cfg) == whole and list(flatten(cfg)) == list(whole)
        for revised in (True, False):
            text = json.dumps(hashed_config(cfg, revised), sort_keys=True, separators=(",", ":"))
            assert config_hash(cfg, revised) == hashlib.sha256(text.encode()).hexdigest()
    cfg = _configs()[1]
    flatten(cfg)["optim.betas"].append(0.5)  # a caller's list is its own, not the cache's
    assert flatten(cfg)["optim.betas"] == [0.8, 0.95]


@given(st.lists(st.one_of(st.text(max_size=6), st.integers(), st.booleans(), st.none(),
                          st.floats(allow_nan=True, allow_infinity=True), st.lists(st.floats(allow_nan=False))),
                min_size=3, max_size=3), st.booleans())
def test_summary_rows_are_written_as_the_csv_module_writes_their_converted_cells(values, drop):
    """rows_csv leaves the cells the csv module writes alike to it: the text is csv.DictWriter's of the
    cells converted one by one (floats as repr, nulls empty, lists as JSON), a missing field empty."""
    import csv
    import io

    import numpy as np

    from normexp.config import RunConfig, flatten
    from normexp.folder import rows_csv
    from normexp.folder.layout import format_float
    from normexp.folder.sweepfiles import _cell

    cfg = RunConfig()
    row = {"run_id": "r", **flatten(cfg), "final_loss": values[0], "error": values[1], "wall_s": values[2],
           "min_loss": np.float64(0.1)}
    if drop:  # a field the row lacks: written empty
        del row["seed"]
    columns = next(csv.reader(io.StringIO(rows_csv([], cfg))))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n", restval="")
    writer.writeheader()
    writer.writerow({k: format_float(v) if isinstance(v, float) else _cell(v) for k, v in row.items()})
    assert rows_csv([row], cfg) == buffer.getvalue()


def test_the_runs_columns_in_front_of_their_rows_are_typed_as_the_values_themselves():
    """load_metrics puts each run's config columns in front of its rows once for all rows (`_repeated`): the
    table pandas builds from the repeated values themselves, dtypes and all, a run without rows left out."""
    import pandas as pd

    from normexp.results import _repeated

    runs = pd.DataFrame({"run_id": ["a", "b", "c"], "i": [1, 2, 3], "f": [0.5, float("nan"), 2.0],
                         "b": [True, False, True], "o": [None, "x", None], "m": [1, "two", 3.0]})
    repeats = [2, 0, 3]
    naive = pd.DataFrame({c: [v for v, n in zip(runs[c].tolist(), repeats) for _ in range(n)] for c in runs})
    pd.testing.assert_frame_equal(_repeated(runs, repeats), naive, check_exact=True)


@pytest.mark.parametrize("text", ["run_id,a,status\nx,1,pending\ny,2,completed\n\nz,3\nw,4,interrupted,extra\n",
                                  "run_id,status,status\nx,pending,completed\ny,completed,interrupted\n",
                                  "a,b\n1,2\n", "", 'run_id,status\n"q\nr",pending\n'])
def test_the_statuses_only_summary_csv_knows_are_read_as_csv_dictreader_reads_them(tmp_path, text):
    import csv
    import io

    from normexp.folder import cached_statuses
    from normexp.folder.sweepfiles import CACHED_STATUSES

    (tmp_path / "summary.csv").write_text(text)
    rows = list(csv.DictReader(io.StringIO(text)))
    assert cached_statuses(tmp_path) == {row["run_id"]: row["status"] for row in rows
                                         if isinstance(row.get("run_id"), str) and row.get("status") in CACHED_STATUSES}


def _eta_seconds(line: str) -> float:
    eta = line.rsplit("ETA ", 1)[1]
    big, small = (int(x) for x in eta.replace("h", " ").replace("m", " ").replace("s", "").split())
    return big * 3600 + small * 60 if "h" in eta else big * 60 + small


@settings(max_examples=60, deadline=None)
@given(wait=st.floats(5, 300), period=st.floats(0.2, 3), size=st.sampled_from([1, 4, 16]),
       early=st.integers(0, 3), batches=st.integers(8, 40))
def test_after_any_first_wait_the_eta_is_the_batches_pace(wait, period, size, early, batches):
    """Runs that fail at once, then a long wait (a compile), then batches at a steady pace: after 8 batches the
    ETA is the batches' pace times the runs left (within what reading it at a batch's first run can add:
    one batch in eight), whatever the wait, the pace, the batch size and the early failures."""
    total = early + size * (batches + 200)
    now = [0.0]
    lines = ProgressLines(total, clock=lambda: now[0])
    done = 0
    for _ in range(early):
        now[0] += 0.01
        done += 1
        lines.update(SweepEvent("failed", f"f{done}", done, total, "failed"))
    now[0] += wait
    for batch in range(batches):
        for _ in range(size):
            now[0] += 0.001
            done += 1
            lines.update(SweepEvent("finished", f"r{done}", done, total, "completed"))
            true_left = (total - done) / size * (period + 0.001 * size)
            if batch >= 8:
                eta = _eta_seconds(lines.line(now[0], done))
                assert 0.85 * true_left - 1 <= eta <= 1.15 * true_left + 1, (eta, true_left)
        now[0] += period
