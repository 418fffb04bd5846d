"""Shared fixtures: small configs that train in milliseconds, and the article transcription."""

from __future__ import annotations

import math
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
# A compiled fast sweep's workers measure MKL's two code paths once per CPU and shape (~5 s: two processes).
# The tests' many tiny shapes keep MKL's own path unmeasured; tests/test_mkl_path.py measures, without this.
os.environ.setdefault("NORMEXP_MKL_PATH", "own")

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


def batched_sweep(tmp_path_factory, text: str) -> Path:
    """The folder of the sweep file `text`, trained in process on the batched engine into a fresh folder named
    after the sweep: what the export tests read, or change copies of."""
    from normexp.config import build_sweep, parse_yaml
    from normexp.sweep import SweepOptions, run_sweep

    sweep = build_sweep(parse_yaml(text))
    out = tmp_path_factory.mktemp("export") / sweep.name
    run_sweep(sweep, out, SweepOptions(engine="batched"))
    return out


def run_folders(folder: Path) -> list[Path]:
    """A sweep folder's finished run folders (those holding a done.json), sorted by name."""
    return sorted(p for p in folder.iterdir() if (p / "done.json").is_file())


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """(URI, client) of an empty MLflow file store in tmp_path (skipped without mlflow)."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # to read the file store here (export sets it)
    uri = (tmp_path / "mlruns").as_uri()
    return uri, MlflowClient(tracking_uri=uri)


def fresh_copy(pristine: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(config, out) of a copy of a `trained_sweep`'s folder (symbolic links kept as links)."""
    shutil.copytree(pristine, tmp_path / "copy", symlinks=True)
    return tmp_path / "copy" / "sweep.yaml", tmp_path / "copy" / "out"


def write_curves(folder: Path, runs: list[tuple], engine: str = "reference") -> Path:
    """A sweep folder written through the store: (placement, lr, seed, losses, status[, warmup]) per run,
    each run's `losses` its whole curve (one recorded step each)."""
    from normexp.config import RunConfig, build_sweep
    from normexp.folder import SWEEP_FILE, FinishedRun, run_id, write_run

    def axis(i: int, default: object = None) -> list:
        return list(dict.fromkeys(r[i] if len(r) > i else default for r in runs))

    steps = max(len(r[3]) for r in runs) - 1
    sweep = build_sweep({"name": "curves", "base": {"schedule": {"kind": "linear_warmup"},
                                                     "train": {"steps": steps, "stop_on_nonfinite": False}},
                         "grid": {"norm.placement": axis(0), "optim.lr": axis(1),
                                  "schedule.warmup_steps": axis(5, 0)}, "seeds": axis(2)})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / SWEEP_FILE).write_text(sweep.to_yaml())
    for placement, lr, seed, losses, status, *warmup in runs:
        cfg = RunConfig.model_validate({"norm": {"placement": placement}, "optim": {"lr": lr}, "seed": seed,
                                        "schedule": {"kind": "linear_warmup", "warmup_steps": (warmup or [0])[0]},
                                        "train": {"steps": steps, "stop_on_nonfinite": False}})
        n = len(losses)
        metrics = {"step": list(range(n)), "loss": list(losses), "acc": [0.1] * n, "lr": [lr] * n,
                   "grad_norm": [1.0] * n}
        write_run(folder / run_id(cfg), cfg, FinishedRun(metrics, status, 0.1, 1, engine, "cpu"))
    return folder


NAN, INF = math.nan, math.inf
DIVERGING = [  # curves that end in nan or inf after finite steps, one that recovers after a nan
    ("pre", 0.001, 0, [2.3, 1.0, 0.5, 0.4], "completed"),
    ("pre", 0.01, 0, [2.3, 0.6, 0.2, 0.1], "completed"),
    ("pre", 0.1, 0, [2.3, 1.1, 0.9, NAN], "diverged"),  # GroupBy.last() read 0.9
    ("pre", 0.001, 1, [2.2, 1.2, 0.6, 0.5], "completed"),
    ("pre", 0.01, 1, [2.2, 0.7, 0.3, 0.2], "completed"),
    ("pre", 0.1, 1, [2.2, 0.4, INF, NAN], "diverged"),
    ("none", 0.001, 0, [2.0, 1.9, 1.8, 1.7], "completed"),
    ("none", 0.01, 0, [2.0, 0.3, NAN, NAN], "diverged"),
    ("none", 0.1, 0, [2.0, NAN, 0.05, 0.05], "diverged"),  # met a nan, then finite again: still diverged
]


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

TINY = "name: t\nbase: {model: {depth: 2, width: 8}, train: {steps: 3}}\n"  # one run of 3 steps


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """(config, out) of TINY over two placements and two seeds, trained once per module: a folder that the
    commands read or are misused on."""
    from typer.testing import CliRunner

    from normexp.cli import app

    runner = CliRunner()
    folder = tmp_path_factory.mktemp("finished")
    config = folder / "t.yaml"
    config.write_text(TINY + "grid: {norm.placement: [post, pre]}\nseeds: [0, 1]\n")
    assert runner.invoke(app, ["sweep", str(config), "--out", str(folder / "out"), "-q"]).exit_code == 0
    return config, folder / "out"


# ----------------------------------------------------------------------------- the test layers
#
# Each test module declares the layer of its tests: `pytestmark = pytest.mark.process` for all of them, or
# `@pytest.mark.process` / `@pytest.mark.equivalence` on one (the markers are described in pyproject.toml).
# `process`: the test, or a fixture it uses, starts a process (a subprocess, a worker pool, a Dask cluster);
# `equivalence`: it trains runs to compare engines (bit for bit, or the fast engine within its contract),
# processes or the article's code. A new test that starts a process says so itself: nothing is guessed from
# its source.


# ----------------------------------------------------------------------------- process-wide caches
#
# Each is forgotten through the public function of the module that owns it. A module not imported yet
# holds nothing, and is not imported here: most tests never load an engine.
PROCESS_CACHES = (
    ("normexp.engines.fast.compiled", "reset_cache"),  # the compiled steps kept, and the steps refused
    ("normexp.engines.fast.starts", "reset"),  # the structures met and the starts kept
    ("normexp.engines.fast.aot", "reset"),  # the digest of normexp's source that names a step package
    ("normexp.registry", "reset"),  # the users' placements and norm kinds looked up
    ("normexp.folder.verified", "reset"),  # checks_version, which a .verified.json holds for
)


def reset_process_caches() -> None:
    """Empty every cache of PROCESS_CACHES, as a fresh process starts."""
    for name, function in PROCESS_CACHES:
        module = sys.modules.get(name)
        if module is not None:
            getattr(module, function)()


@pytest.fixture(autouse=True)
def fresh_process_caches():
    """Every test starts from the caches a fresh process starts from, and leaves none of its own behind: a
    fake compiler's steps, a user's plugin, the starts of its structures. Kept: what no test can make
    differ and what would cost seconds to measure again, the batched engine's stacking probe per shape and
    thread count (`batched.stacks_exactly`), a result's provenance (git is asked once), and the memos of
    pure functions of frozen config sections (`config.section_cache`)."""
    reset_process_caches()
    yield
    reset_process_caches()
