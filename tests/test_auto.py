"""`--engine auto`: the faster exact engine per machine and shape, measured once and cached; a cache that
is unreadable, of another version or inconsistent is measured again; the sweep's first line says why."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from normexp.cli import app
from normexp.config import RunConfig
from normexp.engines import auto
from normexp.engines.auto import Choice, choice_cache_file, choose
from normexp.units import plan_auto_units

TINY = {"model": {"depth": 2, "width": 8}, "data": {"n_samples": 16}, "train": {"steps": 2}}


def tiny(seeds: int = 4, **norm: str) -> list[RunConfig]:
    return [RunConfig.model_validate({**TINY, "norm": norm, "seed": s}) for s in range(seeds)]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NORMEXP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "engine-choice.json"


@pytest.fixture
def measured(monkeypatch):
    """`measure` replaced by a counter that says the reference is faster (8 vs 10 ms a model-step)."""
    calls = []

    def fake(batch, paired=False):
        calls.append(len(batch))
        return Choice("reference", 8.0, 10.0, min(len(batch), 4), paired)

    monkeypatch.setattr(auto, "measure", fake)
    return calls


def test_a_real_probe_measures_both_engines_and_its_answer_is_cached(cache):
    choice = choose(tiny())
    assert choice.engine in ("batched", "reference") and not choice.cached
    assert choice.reference_ms > 0 and choice.batched_ms > 0 and choice.runs == 4
    again = choose(tiny())
    assert again.cached and again.engine == choice.engine and again.batched_ms == choice.batched_ms
    assert choice_cache_file() == cache and json.loads(cache.read_text())["version"] == auto.CACHE_VERSION


def test_placement_shares_a_measurement_and_other_kinds_do_not(cache, measured):
    choose(tiny(placement="post"))
    choose(tiny(placement="pre"))
    assert measured == [4]
    choose(tiny(kind="rmsnorm"))
    assert measured == [4, 4]


@pytest.mark.parametrize("text", ["", "{", "[]", '{"version": 0, "entries": {}}', '{"version": 1, "entries": 3}'])
def test_an_unreadable_cache_or_another_version_is_measured_again_and_rewritten(cache, measured, text):
    cache.parent.mkdir(parents=True)
    cache.write_text(text)
    assert choose(tiny()).engine == "reference" and measured == [4]
    assert json.loads(cache.read_text())["version"] == auto.CACHE_VERSION
    assert choose(tiny()).cached and measured == [4]


@pytest.mark.parametrize("entry", [None, "x", {"engine": "batched"}, {"engine": "fast", "reference_ms": 8.0,
                                   "batched_ms": 1.0, "runs": 4, "paired": False},
                                   {"engine": "batched", "reference_ms": 8.0, "batched_ms": 10.0, "runs": 4,
                                    "paired": False},  # says batched where its own numbers say reference
                                   {"engine": "reference", "reference_ms": float("nan"), "batched_ms": 1.0,
                                    "runs": 4, "paired": False}])
def test_a_cache_entry_that_is_not_a_sound_measurement_is_measured_again(cache, measured, entry):
    key = auto.shape_key(tiny())
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"version": auto.CACHE_VERSION, "entries": {key: entry}}))
    choice = choose(tiny())
    assert measured == [4] and not choice.cached and choice.engine == "reference"


def test_plan_auto_units_sends_each_batch_to_the_engine_its_shape_chose(cache, monkeypatch):
    def fake(batch, paired=False):
        faster = "batched" if batch[0].norm.kind == "rmsnorm" else "reference"
        return Choice(faster, 10.0, 2.0 if faster == "batched" else 20.0, 4, paired)

    monkeypatch.setattr(auto, "measure", fake)
    units, note = plan_auto_units(tiny(kind="layernorm") + tiny(kind="rmsnorm"), "cpu", 1)
    assert sorted((u.engine, len(u.configs)) for u in units) == [("batched", 4)] + [("reference", 1)] * 4
    assert note.startswith("engine auto: 1 shapes batched, 1 shapes reference (batched measured 0.50-5.00x")


def test_the_sweep_says_which_engine_auto_chose_and_why_first(write_yaml, tmp_path, cache, measured):
    config = write_yaml("name: a\nbase: {model: {depth: 2, width: 8}, data: {n_samples: 16}, train: {steps: 2}}\n"
                        "seeds: [0, 1, 2]\n")
    result = CliRunner().invoke(app, ["sweep", str(config), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[0]
    assert first.startswith("engine auto: reference (batched 10.00 ms vs reference") and "0.80x" in first, first
    done = json.loads(next((tmp_path / "out").glob("*/done.json")).read_text())
    assert done["engine"] == "reference"


def test_doctor_says_what_auto_measured_on_this_machine(cache, measured):
    doctor = CliRunner().invoke(app, ["doctor"])
    assert doctor.exit_code == 0 and "engine auto: not measured on this machine yet" in doctor.output
    choose(tiny())
    line = CliRunner().invoke(app, ["doctor"]).output.splitlines()[-1]
    assert line.startswith("engine auto: batched for 0 of 1 measured shapes, the reference for the rest"), line
    assert str(cache) in line


def test_a_cache_of_deeply_nested_brackets_is_measured_again_not_a_traceback(cache, measured):
    cache.parent.mkdir(parents=True)
    cache.write_text("[" * 200_000)  # json.loads raised RecursionError, which no `except` caught
    assert "not measured on this machine yet" in auto.auto_summary()
    assert choose(tiny()).engine == "reference" and measured == [4]
    assert choose(tiny()).cached


def test_the_cache_follows_xdg_cache_home_and_never_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("NORMEXP_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert choice_cache_file() == tmp_path / "xdg" / "normexp" / "engine-choice.json"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # the XDG rule: a relative path is ignored
    assert choice_cache_file() == tmp_path / "home" / ".cache" / "normexp" / "engine-choice.json"


def test_a_cache_that_cannot_be_replaced_leaves_no_temporary_file(cache, measured):
    cache.mkdir(parents=True)  # a folder where the file goes: os.replace fails
    assert choose(tiny()).engine == "reference" and measured == [4]
    assert [p.name for p in cache.parent.iterdir()] == [cache.name]


def test_a_user_without_a_home_folder_still_sweeps_under_auto(tmp_path, monkeypatch, measured):
    """No HOME and no passwd entry (a container under a bare uid): Path.home() raises RuntimeError,
    which was a traceback in every sweep under auto (and in the fast engine's compile)."""
    from pathlib import Path

    from normexp.engines import fast

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("NORMEXP_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(Path, "home", no_home)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert choice_cache_file().parent.parent == tmp_path
    assert choose(tiny()).engine == "reference" and choose(tiny()).cached and measured == [4]
    assert fast.compile_cache_dir() is None  # inductor's own default, not a folder made up here
    assert "TORCHINDUCTOR_CACHE_DIR" not in __import__("os").environ
