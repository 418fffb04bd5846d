"""`--engine auto`: the faster exact engine per machine and shape, measured on the sweep's own first runs (a
pair on the reference, the next runs batched: every one a result, bit for bit the reference's) and cached;
a cache that is unreadable, of another version or inconsistent is measured again; a shape too small to
measure takes the reference; the sweep's first lines say what it measures and what it chose, and why."""

from __future__ import annotations

import json
import os
import re
import tempfile
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from normexp import units
from normexp.cli import app
from normexp.config import RunConfig
from normexp.engines import auto
from normexp.engines.auto import Choice, choice_cache_file
from normexp.executors import usable_cores
from normexp.units import AutoPlan, UnitResult, WorkUnit

TINY = {"model": {"depth": 2, "width": 8}, "data": {"n_samples": 16}, "train": {"steps": 3}}
TINY_SWEEP = ("name: a\nbase: {model: {depth: 2, width: 8}, data: {n_samples: 16}, train: {steps: 3}}\n"
              "grid: {norm.placement: [post, pre], norm.kind: [layernorm, rmsnorm]}\nseeds: SEEDS\n")


def tiny(seeds: int = 6, **norm: str) -> list[RunConfig]:
    return [RunConfig.model_validate({**TINY, "norm": norm, "seed": s}) for s in range(seeds)]


def sweep_file(write_yaml, seeds: int):
    return write_yaml(TINY_SWEEP.replace("SEEDS", str(list(range(seeds)))))


def sweep(*args) -> str:
    result = CliRunner().invoke(app, ["sweep", *map(str, args)])
    assert result.exit_code == 0, result.output
    return result.output


def engines(out) -> dict[str, str]:
    return {p.parent.name: json.loads(p.read_text())["engine"] for p in out.glob("*/done.json")}


def metrics(out) -> dict[str, str]:
    return {p.parent.name: p.read_text() for p in out.glob("*/metrics.csv")}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NORMEXP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "engine-choice.json"


def timed(plan: AutoPlan, reference_s: float, batched_s: float) -> list[UnitResult]:
    """The probe's results, as if each reference unit's step took `reference_s` and each batch's `batched_s`."""
    return [UnitResult(u, (), step_s=reference_s if u.engine == "reference" else batched_s) for u in plan.probe]


@pytest.mark.equivalence
def test_a_fresh_cache_measures_on_the_sweeps_runs_keeps_them_and_they_are_the_references_bits(
        write_yaml, tmp_path, cache):
    config = sweep_file(write_yaml, 6)
    output = sweep(config, "--out", tmp_path / "auto")
    lines, paired = output.splitlines(), usable_cores() >= 2  # one core: no pairs
    assert re.fullmatch(f"engine auto: measuring which exact engine is faster here on this sweep's first runs "
                        f"\\(4 on the reference{' in pairs' * paired}, 8 batched, for 2 shapes: (under 1 s|~\\d+ s) "
                        "of runs, each kept as a result\\), then the rest on the faster", lines[0]), lines[0]
    assert re.match(r"engine auto: .*per model-step on this sweep's first runs; it needs >= 1\.18x\)$",
                    next(line for line in lines[1:] if line.startswith("engine auto:"))), output
    assert "24 ran" in output
    trained = engines(tmp_path / "auto")
    first = [rid for rid in trained if rid.startswith("post-") and re.search(r"-s[01]-", rid)]
    probed = [rid for rid in trained if rid.startswith("post-") and re.search(r"-s[2-5]-", rid)]
    assert len(first) == 4 and {trained[rid] for rid in first} == {"reference"}  # each shape's pair
    assert len(probed) == 8 and {trained[rid] for rid in probed} == {"batched"}  # the rest of its first batch
    entries = json.loads(cache.read_text())
    assert entries["version"] == auto.CACHE_VERSION and len(entries["entries"]) == 2
    assert all(e["runs"] == 4 and e["paired"] == paired for e in entries["entries"].values())
    sweep(config, "--out", tmp_path / "reference", "--engine", "reference")
    assert metrics(tmp_path / "auto") == metrics(tmp_path / "reference")  # every run, bit for bit


def test_a_cached_choice_trains_every_run_on_its_engine_without_measuring(write_yaml, tmp_path, cache):
    config = sweep_file(write_yaml, 6)
    sweep(config, "--out", tmp_path / "first")
    chosen = {e["engine"] for e in json.loads(cache.read_text())["entries"].values()}
    output = sweep(config, "--out", tmp_path / "again")
    assert "measuring" not in output and output.startswith("engine auto: ")
    assert "per model-step on this CPU" in output.splitlines()[0] or "a cached measurement" in output.splitlines()[0]
    assert set(engines(tmp_path / "again").values()) == chosen


@pytest.mark.parametrize("seeds", [2, 3])
def test_a_shape_too_small_to_measure_takes_the_reference_and_caches_nothing(write_yaml, tmp_path, cache, seeds):
    output = sweep(sweep_file(write_yaml, seeds), "--out", tmp_path / "out")
    assert output.splitlines()[0] == "engine auto: reference (not measured: batches of fewer than 4 runs)"
    assert set(engines(tmp_path / "out").values()) == {"reference"} and not cache.exists()


def test_a_resumed_sweep_keeps_the_measurements_runs_and_trains_the_rest_on_the_choice(
        write_yaml, tmp_path, cache, monkeypatch):
    """Interrupted once the measurement was taken: the resumed sweep redoes none of its runs (of either
    engine) and trains the rest on the cached choice; a rerun after that trains nothing, cache or none."""
    config, out = sweep_file(write_yaml, 6), tmp_path / "out"
    rest = AutoPlan.rest

    def interrupted(plan, results):
        rest(plan, results)  # the choice is made and cached
        raise KeyboardInterrupt

    monkeypatch.setattr(AutoPlan, "rest", interrupted)
    result = CliRunner().invoke(app, ["sweep", str(config), "--out", str(out)])
    assert result.exit_code == 130 and "12 of 24 runs finished" in result.output, result.output
    measured = engines(out)
    assert sorted(measured.values()) == ["batched"] * 8 + ["reference"] * 4
    monkeypatch.setattr(AutoPlan, "rest", rest)
    output = sweep(config, "--out", out)
    assert "12 ran, 12 already done" in output and "redone" not in output and "measuring" not in output
    assert {rid: engines(out)[rid] for rid in measured} == measured
    cache.unlink()
    assert "0 ran, 24 already done" in sweep(config, "--out", out) and not cache.exists()


def test_the_plan_measures_each_uncached_shape_once_on_its_first_batch(cache):
    runs = tiny(20, placement="post") + tiny(20, placement="pre") + tiny(3, kind="rmsnorm")
    plan = AutoPlan(runs, "cpu", 1, pairs=lambda unit: True)
    assert [(u.engine, len(u.configs)) for u in plan.probe] == [("reference", 1)] * 2 + [("batched", 14)]
    assert [u.runs[0].seed for u in plan.probe] == [0, 1, 2]  # Post's first batch: the placement shares a shape
    rest, note = plan.rest(timed(plan, reference_s=0.010, batched_s=0.014 * 0.5))  # 0.5 ms vs 5 ms a model-step
    assert (sorted((u.engine, len(u.configs)) for u in rest)
            == [("batched", 4), ("batched", 20)] + [("reference", 1)] * 3)
    assert note == ("engine auto: 1 shape batched, 1 shape reference (batched measured 10.00-10.00x the reference per "
                    "model-step on this sweep's first runs; it needs >= 1.18x; 1 not measured: its batches hold too "
                    "few runs to measure)")
    again = AutoPlan(runs, "cpu", 1, pairs=lambda unit: True)
    assert again.probe == [] and again.note.startswith("engine auto: 1 shape batched, 1 shape reference (batched "
                                                       "measured 10.00-10.00x the reference per model-step on this CPU")


@given(reference_s=st.floats(1e-4, 1.0), batched_s=st.floats(1e-4, 10.0), paired=st.booleans(),
       seeds=st.integers(4, 40))
def test_batched_is_chosen_exactly_when_it_saves_the_margin_per_model_step(reference_s, batched_s, paired, seeds):
    """Per model-step: a pair's step advances two runs, a batch's step all of its runs; batched wins at
    MARGIN or better, and the measured figures are what the Choice (and the cache) hold."""
    with tempfile.TemporaryDirectory() as folder, mock.patch.dict(os.environ, {"NORMEXP_CACHE_DIR": folder}):
        plan = units.AutoPlan(tiny(seeds), "cpu", 1, pairs=lambda unit: paired)
        batch = plan.probe[-1]
        choice = next(m for m in plan._measuring.values()).choose(timed(plan, reference_s, batched_s))
        assert auto.cached(list(plan._measuring.values())[0].batch, paired) == Choice(**{**choice.__dict__,
                                                                                         "cached": True})
    per_reference, per_batched = reference_s / (2 if paired else 1), batched_s / len(batch.configs)
    assert len(batch.configs) == min(seeds - 2, auto.BATCHED_RUNS) and choice.runs == len(batch.configs)
    assert choice.engine == ("batched" if per_batched <= auto.MARGIN * per_reference else "reference")
    assert choice.reference_ms == pytest.approx(per_reference * 1e3)
    assert choice.batched_ms == pytest.approx(per_batched * 1e3)


def test_a_measurement_without_timings_takes_the_reference_and_is_not_cached(cache):
    plan = AutoPlan(tiny(6), "cpu", 1)
    failed = [UnitResult(u, ("RuntimeError: boom",) * len(u.configs)) for u in plan.probe]  # untimed
    rest, note = plan.rest(failed)
    assert rest == [] and note == "engine auto: reference (not measured: the runs that measure it failed)"
    assert not cache.exists() and len(AutoPlan(tiny(6), "cpu", 1).probe) == 3  # the next sweep measures


@pytest.mark.parametrize("text", ["", "{", "[]", '{"version": 1, "entries": {}}', '{"version": 2, "entries": 3}'])
def test_an_unreadable_cache_or_another_version_is_measured_again_and_rewritten(cache, text):
    cache.parent.mkdir(parents=True)
    cache.write_text(text)
    plan = AutoPlan(tiny(), "cpu", 1)
    assert len(plan.probe) == 3
    plan.rest(timed(plan, 0.010, 0.020))
    assert json.loads(cache.read_text())["version"] == auto.CACHE_VERSION
    assert AutoPlan(tiny(), "cpu", 1).probe == []


@pytest.mark.parametrize("entry", [None, "x", {"engine": "batched"}, {"engine": "fast", "reference_ms": 8.0,
                                   "batched_ms": 1.0, "runs": 4, "paired": False},
                                   {"engine": "batched", "reference_ms": 8.0, "batched_ms": 10.0, "runs": 4,
                                    "paired": False},  # says batched where its own numbers say reference
                                   {"engine": "reference", "reference_ms": float("nan"), "batched_ms": 1.0,
                                    "runs": 4, "paired": False},
                                   {"engine": "batched", "reference_ms": 8.0, "batched_ms": True, "runs": 4,
                                    "paired": False}])  # JSON's true is no time (Python counts it an int)
def test_a_cache_entry_that_is_not_a_sound_measurement_is_measured_again(cache, entry):
    key = auto.shape_key(tiny())
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"version": auto.CACHE_VERSION, "entries": {key: entry}}))
    assert auto.cached(tiny()) is None and len(AutoPlan(tiny(), "cpu", 1).probe) == 3


def test_on_a_gpu_every_batch_is_batched_unmeasured(cache):
    plan = AutoPlan(tiny(6) + tiny(1, kind="rmsnorm"), "cuda", 1)
    assert plan.probe == [] and plan.note == "engine auto: batched (stacked runs on the GPU)"
    assert sorted((u.engine, len(u.configs)) for u in plan.rest([])[0]) == [("batched", 6), ("reference", 1)]


def test_a_unit_knows_how_long_its_steps_took():
    result = units.run_unit(WorkUnit(tuple(c.model_dump(mode="json") for c in tiny(2)), "batched", "cpu", 1))
    assert result.step_s is not None and 0 < result.step_s < 1
    one = units.run_unit(WorkUnit((tiny(1)[0].model_dump(mode="json"),), "reference", "cpu", 1))
    assert one.step_s is not None and 0 < one.step_s < 1
    clock = units.StepClock()
    for stamp in (1.0, 1.5, 2.5, 3.0):  # step 0's interval is not among them: the first stamp follows it
        clock.stamps.append(stamp)
    assert clock.step_s() == 0.5 and units.StepClock().step_s() is None


def measured_reference() -> Choice:
    """tiny()'s shape measured: the reference 8 ms a model-step, batched 10 (its 4 runs' step 40 ms)."""
    plan = AutoPlan(tiny(), "cpu", 1)
    plan.rest(timed(plan, 0.008, 0.040))
    return next(iter(plan._choices.values()))


def test_doctor_says_what_auto_measured_on_this_machine(cache):
    doctor = CliRunner().invoke(app, ["doctor"])
    assert doctor.exit_code == 0 and "engine auto: not measured on this machine yet" in doctor.output
    assert measured_reference().engine == "reference"
    line = next(line for line in CliRunner().invoke(app, ["doctor"]).output.splitlines() if line.startswith("engine"))
    assert line.startswith("engine auto: batched for 0 of 1 measured shapes, the reference for the rest"), line
    assert str(cache) in line


def test_a_cache_of_deeply_nested_brackets_is_measured_again_not_a_traceback(cache):
    cache.parent.mkdir(parents=True)
    cache.write_text("[" * 200_000)  # json.loads raised RecursionError, which no `except` caught
    assert "not measured on this machine yet" in auto.auto_summary()
    assert len(AutoPlan(tiny(), "cpu", 1).probe) == 3 and measured_reference().engine == "reference"
    assert auto.cached(tiny()).engine == "reference"


def test_the_cache_follows_xdg_cache_home_and_never_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("NORMEXP_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert choice_cache_file() == tmp_path / "xdg" / "normexp" / "engine-choice.json"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # the XDG rule: a relative path is ignored
    assert choice_cache_file() == tmp_path / "home" / ".cache" / "normexp" / "engine-choice.json"


def test_a_cache_that_cannot_be_replaced_leaves_no_temporary_file(cache):
    cache.mkdir(parents=True)  # a folder where the file goes: os.replace fails
    assert measured_reference().engine == "reference"
    assert [p.name for p in cache.parent.iterdir()] == [cache.name]


def test_a_user_without_a_home_folder_still_sweeps_under_auto(tmp_path, monkeypatch):
    """No HOME and no passwd entry (a container under a bare uid): Path.home() raises RuntimeError,
    which was a traceback in every sweep under auto (and in the fast engine's compile)."""
    from pathlib import Path

    from normexp.engines.fast import compiled as compiling

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("NORMEXP_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(Path, "home", no_home)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert choice_cache_file().parent.parent == tmp_path
    assert measured_reference().engine == "reference" and auto.cached(tiny()).cached
    assert compiling.compile_cache_dir() is None  # inductor's own default, not a folder made up here
    assert "TORCHINDUCTOR_CACHE_DIR" not in __import__("os").environ


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_the_cache_file_is_made_with_the_users_umask(cache, umask):
    """engine-choice.json was written mode 0600 (NamedTemporaryFile's), whatever the umask: a cache folder
    shared by a group (NORMEXP_CACHE_DIR, umask 002) held a file only its writer could read."""
    import stat

    before = os.umask(umask)
    try:
        assert measured_reference().engine == "reference"
    finally:
        os.umask(before)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o666 & ~umask
    assert [p.name for p in cache.parent.iterdir()] == [cache.name]


def test_a_measurement_under_mkl_s_intel_path_is_another_machine_s(monkeypatch):
    """NORMEXP_MKL_PATH=intel makes MKL take other kernels (docs/reproducibility.md): a choice measured under
    one path is not looked up under the other; unset (or any other value), the key is what it always was."""
    monkeypatch.delenv("NORMEXP_MKL_PATH", raising=False)
    before = auto.machine_key()
    monkeypatch.setenv("NORMEXP_MKL_PATH", "auto")
    assert auto.machine_key() == before
    monkeypatch.setenv("NORMEXP_MKL_PATH", "intel")
    assert auto.machine_key() != before
