"""Shared fixtures: small configs that train in milliseconds, and the article transcription."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

from normexp.environment import set_thread_defaults

# The tests' process, and the processes it starts, wait in OpenMP as normexp's own processes do (set before
# anything loads torch): threads spinning long would starve each other on a loaded machine.
set_thread_defaults()

# CI draws the same hypothesis examples on every run, so a red CI is a reproducible defect and never a
# draw's luck; a developer's run keeps drawing new examples (and keeps the failures it finds).
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

sys.path.insert(0, str(Path(__file__).parent))  # tests/article_toy.py

# `--engine auto` caches its engine measurements per machine: the tests measure into their own folder,
# never reading (or writing) the user's ~/.cache/normexp
if "NORMEXP_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["NORMEXP_CACHE_DIR"] = tempfile.mkdtemp(prefix="normexp-test-cache-")

REPO = Path(__file__).resolve().parents[1]


def subprocess_output(code: str) -> str:
    """What Python `code` prints, run in a fresh process on this checkout (its exit status checked)."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    return done.stdout


def done_markers(out: Path) -> list[Path]:
    """The done.json of every run folder swapped in, while a sweep may still be writing: a folder
    being built (hidden, `.<run_id>.tmp-<pid>`) is not a finished run yet."""
    return [p for p in out.glob("*/done.json") if not p.parent.name.startswith(".")]


def trained_sweep(tmp_path_factory, name: str, text: str, *options: str) -> Path:
    """The out/ folder of a sweep file `text`, trained once with `options` (an engine, --set axes, -q) into
    a fresh folder `name` beside its sweep.yaml: what a module's tests read, or change copies of."""
    from typer.testing import CliRunner

    from normexp.cli import app

    folder = tmp_path_factory.mktemp(name)
    (folder / "sweep.yaml").write_text(text)
    result = CliRunner().invoke(app, ["sweep", str(folder / "sweep.yaml"), "--out", str(folder / "out"), *options])
    assert result.exit_code == 0, result.output
    return folder / "out"


def fresh_copy(pristine: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(config, out) of a copy of a `trained_sweep`'s folder (symbolic links kept as links)."""
    shutil.copytree(pristine, tmp_path / "copy", symlinks=True)
    return tmp_path / "copy" / "sweep.yaml", tmp_path / "copy" / "out"


@pytest.fixture
def write_yaml(tmp_path: Path):
    """Write a YAML string to a file under tmp_path and return its path."""

    def write(text: str, name: str = "sweep.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write


SMALL_SWEEP = """\
name: small
base:
  model: {depth: 4, width: 8}
  optim: {name: adam, lr: 0.01}
  train: {steps: 5}
grid:
  norm.placement: [post, pre]
  norm.kind: [layernorm, rmsnorm]
seeds: [0, 1]
report: {steps: [0, 1, 5]}
"""


# ----------------------------------------------------------------------------- the test layers
#
# `pytest -m "not process and not equivalence and not slow"` is the unit layer (seconds). A test is
# tagged `process` where it (or a helper of its module that it calls) starts a process: a subprocess,
# a worker pool (--workers, workers=), a Dask cluster; `equivalence` where it trains runs to compare
# engines, the article's code or processes bit for bit. Tags are found from the test's source, so a
# new test lands in its layer without anyone remembering to tag it.

SPAWNS = ("subprocess", "Popen", "sys.executable", "multiprocessing", "--workers", "workers=", "--cluster",
          "LocalCluster", "ProcessPool", "PoolExecutor(", "DaskExecutor(", "make_executor(", "os.fork", "_spawn",
          "spawn(")
EQUIVALENCE_MODULES = ("test_article", "test_batched", "test_hostile_paired", "test_hostile_pairfast")
EQUIVALENCE_NAMES = ("bit_for_bit", "bits", "_equal", "agree", "identical", "same_as", "equals_")


def _source(obj: object) -> str:
    import inspect

    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _spawns(function, module, depth: int = 2) -> bool:
    """Whether `function`'s source starts a process, or a function of its module it names does."""
    source = _source(function)
    if any(token in source for token in SPAWNS):
        return True
    if depth == 0:
        return False
    code = getattr(function, "__code__", None)
    names = code.co_names if code is not None else ()
    return any(callable(helper := getattr(module, name, None)) and getattr(helper, "__module__", "") ==
               module.__name__ and _spawns(helper, module, depth - 1) for name in names)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        function, module = getattr(item, "function", None), getattr(item, "module", None)
        if function is None or module is None:
            continue
        if _spawns(function, module):
            item.add_marker(pytest.mark.process)
        name = module.__name__.rsplit(".", 1)[-1]
        if name in EQUIVALENCE_MODULES or any(token in item.name for token in EQUIVALENCE_NAMES):
            item.add_marker(pytest.mark.equivalence)


@pytest.fixture
def fresh_fast_engine():
    """The fast engine's process-wide caches emptied before the test and again after it, as a fresh process
    starts: its compiled steps and refusals (`compiled.reset_cache`), the structures it met and the starts it
    kept (`starts.reset`). A test that stands a fake in for the compiler leaves no step of it behind."""
    from normexp.engines.fast import compiled, starts

    compiled.reset_cache()
    starts.reset()
    yield
    compiled.reset_cache()
    starts.reset()
