"""The MKL code path of a compiled fast sweep's workers (engines/fast/mkl_path.py): measured once per CPU, torch
build and shape, cached, overridden by NORMEXP_MKL_PATH, taken by the workers, said on the engine line."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

from normexp.config import RunConfig
from normexp.engines.fast import mkl_path
from normexp.environment import CpuInfo, torch_blas

PHASE = {"model": {"depth": 4, "width": 16}, "norm": {"placement": "post"}, "train": {"steps": 60}}


def phase(**changes) -> RunConfig:
    return RunConfig.model_validate({**PHASE, **changes})


@pytest.fixture
def measuring(monkeypatch, tmp_path):
    """No NORMEXP_MKL_PATH, an empty cache, an AMD CPU, and `measure` recorded: returns its calls."""
    monkeypatch.delenv("NORMEXP_MKL_PATH", raising=False)
    monkeypatch.setenv("NORMEXP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(mkl_path, "MEASURE_CPU_S", 0.0)  # these toy sweeps repay any measurement
    monkeypatch.setattr(mkl_path, "mkl_intel_library", lambda: tmp_path / "library.so")  # Intel's path can be taken
    monkeypatch.setattr(mkl_path, "cpu_info", lambda: CpuInfo("AMD EPYC", ("avx2", "avx512f"), "/proc/cpuinfo",
                                                              "AuthenticAMD family 25 model 17"))
    class Calls(list):
        times = {"value": (10.0, 8.0)}

    calls = Calls()
    calls.real = mkl_path.measure
    times = calls.times

    def measure(cfg, size):
        calls.append((cfg, size))
        return times["value"]

    monkeypatch.setattr(mkl_path, "measure", measure)
    return calls


def test_the_user_s_choice_is_taken_without_measuring(measuring, monkeypatch):
    for value, intel in (("intel", True), (" Own ", False)):
        monkeypatch.setenv("NORMEXP_MKL_PATH", value)
        choice = mkl_path.workers_path([phase()] * 64, compile=True)
        assert choice.intel is intel and "NORMEXP_MKL_PATH=" in choice.note()
    assert measuring == []


def test_a_value_it_cannot_mean_names_the_variable(monkeypatch):
    monkeypatch.setenv("NORMEXP_MKL_PATH", "fastest")
    with pytest.raises(mkl_path.MklPathError, match="NORMEXP_MKL_PATH='fastest'.*intel, own"):
        mkl_path.requested()


def test_the_sweep_command_refuses_it_before_anything_is_written(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from normexp.cli import app

    monkeypatch.setenv("NORMEXP_MKL_PATH", "fastest")
    config = tmp_path / "s.yaml"
    config.write_text("name: s\nbase: {model: {depth: 2, width: 8}, train: {steps: 2}}\n")
    result = CliRunner().invoke(app, ["sweep", str(config), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "NORMEXP_MKL_PATH" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_an_intel_cpu_keeps_mkl_s_own_path_unmeasured(measuring, monkeypatch):
    monkeypatch.setattr(mkl_path, "cpu_info", lambda: CpuInfo("Xeon", ("avx512f",), "/proc/cpuinfo",
                                                              "GenuineIntel family 6 model 143"))
    choice = mkl_path.workers_path([phase()] * 64, compile=True)
    assert not choice.intel and "Intel CPU" in choice.note() and measuring == []


def test_measured_once_then_read_from_the_cache(measuring):
    runs = [phase(seed=s) for s in range(40)]
    first = mkl_path.workers_path(runs, compile=True)
    assert first.intel and first.source == "measured now, cached" and "1.25x" in first.note()
    assert [size for _, size in measuring] == [16]  # the structure's compiled batch: block by block, 16 runs
    again = mkl_path.workers_path(runs, compile=True)
    assert again.intel and again.source == "a cached measurement" and len(measuring) == 1
    assert "Intel's for 1 of 1 measured shapes (Intel's 1.25x on" in mkl_path.workers_summary()


def test_a_gain_within_the_margin_keeps_mkl_s_own_path(measuring):
    measuring.times["value"] = (10.0, 9.8)  # 2% faster: noise
    assert not mkl_path.workers_path([phase()] * 8, compile=True).intel
    measuring.times["value"] = (10.0, 9.4)
    assert mkl_path.workers_path([phase(model={"depth": 5, "width": 16})] * 8, compile=True).intel


def test_a_sweep_too_short_to_repay_the_measurement_is_not_measured(measuring, monkeypatch):
    """The phase grid's 2,048 runs (depth 24, width 32, 60 steps: ~131 s of compiled training estimated) repay
    ~4 s of measuring with a 5% gain; 16 of its runs do not, and keep MKL's own path, unmeasured and uncached."""
    monkeypatch.setattr(mkl_path, "MEASURE_CPU_S", 4.0)
    grid = [phase(model={"depth": 24, "width": 32}, seed=s) for s in range(2048)]
    assert mkl_path.compiled_seconds(mkl_path.compiled_runs(grid, compile=True)) == pytest.approx(131, abs=1)
    short = mkl_path.workers_path(grid[:16], compile=True)
    assert not short.intel and "not measured" in short.note() and measuring == []
    assert mkl_path.workers_path(grid, compile=True).intel and len(measuring) == 1
    assert mkl_path.workers_path(grid[:16], compile=True).source == "a cached measurement"  # the same shape


def test_a_failed_measurement_keeps_mkl_s_own_path_uncached(measuring, monkeypatch):
    def broken(cfg, size):
        raise RuntimeError("measuring MKL's intel path failed: boom")

    monkeypatch.setattr(mkl_path, "measure", broken)
    choice = mkl_path.workers_path([phase()] * 8, compile=True)
    assert not choice.intel and "measuring failed (RuntimeError" in choice.note()
    assert not mkl_path.cache_file().exists()


def test_an_unsound_cache_entry_is_measured_again(measuring):
    runs = [phase()] * 8
    mkl_path.cache_file().write_text(json.dumps({"version": mkl_path.CACHE_VERSION, "entries": {
        mkl_path.cache_key(runs[0], 16): {"own_ms": "x", "intel_ms": -1}}}))
    assert mkl_path.workers_path(runs, compile=True).source == "measured now, cached" and len(measuring) == 1


def test_the_structure_measured_is_the_one_with_most_model_steps():
    small = [phase(seed=s) for s in range(3)]
    big = [phase(model={"depth": 8, "width": 16}, seed=s) for s in range(5)]
    assert mkl_path.dominant_structure(mkl_path.compiled_runs(small + big, compile=True)) is big[0]
    assert mkl_path.dominant_structure(mkl_path.compiled_runs(small + big, compile=False)) is None


@pytest.mark.process
def test_the_measurement_times_the_step_s_products_on_each_path(monkeypatch):
    """Two real processes: each records one eager step's matrix products and times them replayed."""
    if not torch_blas(torch).startswith("MKL") or not sys.platform.startswith("linux"):
        pytest.skip("torch's BLAS here is not MKL on Linux")
    if not any(shutil.which(cc) for cc in ("cc", "gcc")):
        pytest.skip("no C compiler")
    own, intel = mkl_path.measure(phase(model={"depth": 2, "width": 8}, train={"steps": 3}), 4)
    assert own > 0 and intel > 0


@pytest.mark.process
def test_a_pool_worker_takes_the_path_it_is_given():
    """A worker started with mkl_intel has loaded the library that answers MKL's vendor question before torch;
    one started without it has not (asked from inside each worker)."""
    from normexp.executors import PoolExecutor, _receive, _send

    if not sys.platform.startswith("linux") or not any(shutil.which(cc) for cc in ("cc", "gcc")):
        pytest.skip("the path is taken on Linux with a C compiler")
    probe = "__import__('normexp.environment').environment._MKL_SHIM_LOADED"
    seen = {}
    for intel in (True, False):
        pool = PoolExecutor(1, mkl_intel=intel)
        try:
            pool.start()
            worker = pool._idle[0]
            _send(worker, (eval, probe))
            worker.conn.poll(60)
            seen[intel] = _receive(worker)
        finally:
            pool.close()
    assert seen[True] and seen[False] == []


def test_a_cache_folder_that_cannot_hold_the_lock_still_decides(measuring):
    """A lock that cannot be made (a folder in its place, a read-only cache folder): the paths are measured
    unlocked, as where the platform has no lock, and the sweep goes on instead of ending in a traceback."""
    mkl_path.cache_file().with_suffix(".lock").mkdir(parents=True)
    choice = mkl_path.workers_path([phase()] * 8, compile=True)
    assert choice.intel and len(measuring) == 1


@pytest.mark.parametrize("own, intel", [("Infinity", 1.0), (1e400, 1e400), ("NaN", 1.0), (True, True)])
def test_a_hand_edited_entry_that_is_no_time_is_measured_again(measuring, own, intel):
    """Infinity, an overflowing number, NaN or a boolean is no measured time: the entry counts as missing, not
    as a ratio of inf or nan on the engine line (and Intel's path taken on it)."""
    runs = [phase()] * 8
    mkl_path.cache_file().write_text(json.dumps({"version": mkl_path.CACHE_VERSION, "entries": {
        mkl_path.cache_key(runs[0], 16): {"own_ms": own, "intel_ms": intel}}}))
    choice = mkl_path.workers_path(runs, compile=True)
    assert choice.source == "measured now, cached" and len(measuring) == 1
    assert "inf" not in choice.note() and "nan" not in choice.note()


def test_a_measurement_the_cache_cannot_keep_is_not_said_cached(measuring):
    """A folder where mkl-path.json goes: the choice stands, and the engine line says it was not cached (the
    next sweep measures again), not "cached"."""
    mkl_path.cache_file().mkdir(parents=True)
    choice = mkl_path.workers_path([phase()] * 8, compile=True)
    assert choice.intel and "measured now, not cached (IsADirectoryError" in choice.note()


@pytest.mark.parametrize("answer", ["5", '["a"]', "{}", "[]", "not json"])
def test_a_measuring_process_that_answers_garbage_keeps_mkl_s_own_path(measuring, monkeypatch, tmp_path, answer):
    """A measuring process whose pass times are not a list of seconds (a library printing to stdout, a broken
    build): MKL's own path, said as a failed measurement, never a traceback ending the sweep."""
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nread spec\necho ready\nwhile read line; do echo '{answer}'; done\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    monkeypatch.setattr(mkl_path, "measure", measuring.real)
    choice = mkl_path.workers_path([phase()] * 8, compile=True)
    assert not choice.intel and "measuring failed" in choice.note() and not mkl_path.cache_file().exists()


def test_a_sweep_whose_workers_also_train_exact_runs_keeps_mkl_s_own_path(measuring):
    """A run the fast engine declines (train.log_blocks: blocks.csv is the reference's bits) trains on the exact
    engines in the same worker processes: Intel's path would move its bits, which only the user may choose
    (NORMEXP_MKL_PATH=intel). MKL's own path, unmeasured, and the line says why."""
    runs = [phase(seed=s) for s in range(40)] + [phase(train={"steps": 60, "log_blocks": True})]
    choice = mkl_path.workers_path(runs, compile=True)
    assert not choice.intel and "train.log_blocks" in choice.note() and measuring == []
    assert mkl_path.workers_path(runs[:40], compile=True).intel  # the fast runs alone: measured, Intel's


@pytest.mark.process
def test_a_measuring_process_that_cannot_take_intel_s_path_fails_the_measurement(monkeypatch, tmp_path):
    """Without a C compiler (and no library built before) the "intel" process would time MKL's own path: two
    equal paths, whose noise may pass the margin and cache Intel's path for workers that cannot take it. It
    fails instead: MKL's own path, uncached."""
    if not torch_blas(torch).startswith("MKL") or not sys.platform.startswith("linux"):
        pytest.skip("torch's BLAS here is not MKL on Linux")
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # no library built before
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(RuntimeError, match="no C compiler"):
        mkl_path.measure(phase(model={"depth": 2, "width": 8}, train={"steps": 3}), 4)


def test_history_records_intel_s_path_for_workers_the_user_sent_there(monkeypatch, tmp_path):
    """NORMEXP_MKL_PATH=intel reaches every worker (`set_thread_defaults`), a `--workers` pool's too, whose
    executor was not asked for Intel's path: history.jsonl must say the path they took, not "own"."""
    from normexp.config.grid import load_sweep
    from normexp.executors import PoolExecutor
    from normexp.sweep import Invocation, SweepOptions, _history_record

    config = tmp_path / "s.yaml"
    config.write_text("name: s\nbase: {model: {depth: 2, width: 8}, train: {steps: 2}}\n")
    sweep = load_sweep(config)
    monkeypatch.setenv("NORMEXP_MKL_PATH", "intel")
    record = _history_record(sweep, Invocation(), SweepOptions(workers=2), 1, 1, PoolExecutor(2))
    assert record["workers_mkl_path"] == "intel"
    monkeypatch.setenv("NORMEXP_MKL_PATH", "own")
    for executor, path in ((PoolExecutor(2), "own"), (PoolExecutor(2, True), "intel")):
        assert _history_record(sweep, Invocation(), SweepOptions(), 1, 1, executor)["workers_mkl_path"] == path


def test_a_cached_intel_choice_that_can_no_longer_be_taken_keeps_mkl_s_own_path(measuring, monkeypatch):
    """Measured on a machine with a C compiler, read back where there is none: the workers could not load the
    library that answers MKL, so the sweep says MKL's own path and why, instead of Intel's."""
    runs = [phase()] * 8
    assert mkl_path.workers_path(runs, compile=True).intel
    monkeypatch.setattr(mkl_path, "mkl_intel_library", lambda: "no C compiler (cc, gcc) to build its library")
    choice = mkl_path.workers_path(runs, compile=True)
    assert not choice.intel and "Intel's cannot be taken here (no C compiler" in choice.note()
    assert len(measuring) == 1  # read from the cache, not measured again


def test_doctor_names_the_rest_only_where_some_shape_kept_mkl_s_own_path(measuring):
    mkl_path.workers_path([phase()] * 8, compile=True)
    assert "for the rest" not in mkl_path.workers_summary()
    measuring.times["value"] = (10.0, 9.9)
    mkl_path.workers_path([phase(model={"depth": 5, "width": 16})] * 8, compile=True)
    summary = mkl_path.workers_summary()
    assert "Intel's for 1 of 2 measured shapes, MKL's own for the rest (Intel's 1.01-1.25x" in summary


def test_a_cache_file_whose_version_is_true_is_not_read(tmp_path):
    from normexp.engines.cache import read_entries

    path = tmp_path / "cache.json"
    path.write_text(json.dumps({"version": True, "entries": {"k": {}}}))
    assert read_entries(path, 1) == {}
    path.write_text(json.dumps({"version": 1, "entries": {"k": {}}}))
    assert read_entries(path, 1) == {"k": {}}
