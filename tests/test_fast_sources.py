"""The code a compiled step's package is named by (`aot.source_digest`): the normexp modules the step's code
can run, found by their imports (`engines/fast/sources.py`), not the whole package. Copies of the package
stand in for it (`normexp.__file__` pointed at each), edited in one module each."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import normexp
from normexp.engines.fast import aot, sources

INSTALLED = Path(normexp.__file__).resolve().parent
INSIDE = ["models/norms.py", "models/transformer.py", "config/schema.py", "engines/fast/step.py",
          "engines/common.py", "engines/fast/__init__.py", "models/__init__.py", "optim.py", "data.py"]
OUTSIDE = ["report.py", "export/runs.py", "export/__init__.py", "page/report.py", "cli.py", "sweep.py",
           "engines/reference.py", "figures/curves.py"]


def copy_package(folder: Path, monkeypatch) -> Path:
    """A copy of the installed package in `folder`/normexp, which `normexp` then is."""
    root = folder / "normexp"
    shutil.copytree(INSTALLED, root, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(normexp, "__file__", str(root / "__init__.py"))
    aot.reset()
    return root


def append(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def test_an_edit_to_a_module_the_step_runs_names_another_package(monkeypatch, tmp_path):
    """A model, a norm, the config, the fast step, what the engines share, a package's __init__: each
    edited in a copy names a package of its own; an unchanged copy names the installed package's."""
    installed = aot.source_digest()
    digests = {}
    for i, edited in enumerate([None, *INSIDE]):
        root = copy_package(tmp_path / str(i), monkeypatch)
        if edited is not None:
            append(root / edited, "# edited\n")
        digests[edited] = aot.source_digest()
    assert digests[None] == installed
    assert len(set(digests.values())) == len(INSIDE) + 1


@pytest.mark.parametrize("edited", OUTSIDE)
def test_an_edit_to_a_module_the_step_never_runs_keeps_every_package(monkeypatch, tmp_path, edited):
    """What calls the engine or reads its results (the report, an exporter, the page, the CLI, the sweep,
    the reference engine, a figure) is not in the key: editing it keeps the installed package's name."""
    installed = aot.source_digest()
    root = copy_package(tmp_path, monkeypatch)
    append(root / edited, "\ndef added():\n    return 'edited'\n")
    assert aot.source_digest() == installed


def test_a_module_imported_only_inside_a_function_is_in_the_closure(monkeypatch, tmp_path):
    """A lazy import in a function of a module the step runs (absolute or relative, under `if` or `try:`
    on one line, broken by a backslash) brings the module it names into the key: an edit to it then
    names another package."""
    installed = aot.source_digest()
    lazy = {"report.py": "    from normexp.report import pivot\n",
            "export/names.py": "    from ..export import names\n",
            "page/markdown.py": "    if True: import normexp.page.markdown\n",
            "figures/phase.py": "    try: from normexp.figures import phase\n    except ImportError: pass\n",
            "tables.py": "    from normexp \\\n        import tables\n"}
    for i, (module, statement) in enumerate(lazy.items()):
        root = copy_package(tmp_path / str(i), monkeypatch)
        append(root / "engines" / "common.py", f"\n\ndef lazy():\n{statement}")
        with_import = aot.source_digest()
        assert with_import != installed
        assert module in {str(path.relative_to(root)) for path, _ in sources.step_sources(root).values()}
        aot.reset()
        append(root / module, "# edited\n")
        assert aot.source_digest() != with_import, module


def test_the_closure_is_the_step_modules_and_their_imports_only():
    """The roots, every package above a module, and what the step's code imports; not the CLI, the
    sweep, the run folder or the presentation."""
    found = {str(path.relative_to(INSTALLED)) for path, _ in sources.step_sources(INSTALLED).values()}
    assert {"__init__.py", "engines/__init__.py", "engines/fast/__init__.py", "engines/fast/aot.py",
            "engines/fast/compiled.py", "engines/fast/sources.py", "models/norms.py", "config/schema.py",
            "registry.py", "environment.py"} <= found
    assert not found & {*OUTSIDE, "folder/__init__.py", "units.py", "executors.py", "__main__.py"}


@pytest.mark.parametrize("source", [
    "try: import normexp.hidden\nexcept ImportError: pass\n",
    "x = 1; import normexp.hidden\n",
    "try:\n    pass\nexcept ImportError: import normexp.hidden\n",
    "if x:\n    pass\nelse:\n    import normexp.hidden\n",
    "if x:\n    from normexp import hidden\n",
    "from normexp \\\n    import hidden\n",
    'doc = """\nfrom a import b  # """; import normexp.hidden\n',
    "from normexp import (a,  # a word: import\n    hidden)\n",
    "def f():\n    from . import hidden\n",
])
def test_an_import_anywhere_in_a_module_is_found(source):
    """An import wherever it sits in a module (sharing its line, broken over lines, in any block) is found."""
    names = sources.imported(source.encode(), "normexp")
    assert "normexp.hidden" in names


def test_the_source_digest_is_computed_once_per_process_until_reset(monkeypatch, tmp_path):
    """A process reads normexp's source once; `aot.reset` forgets it, as a fresh process starts, and the
    next digest reads the files as they are then (normexp.__file__ pointed at a copy that is edited)."""
    root = copy_package(tmp_path, monkeypatch)
    before = aot.source_digest()
    append(root / "models" / "norms.py", "# edited\n")
    assert aot.source_digest() == before
    aot.reset()
    assert aot.source_digest() != before


# Runs that reach every path of the step's code: the text task run by run (z-loss, qk-norm, a tied
# embedding, GPT-2 init), a synthetic sequence task with Admin's profiling at init, the FFN toy with
# the optimizer controls that keep the update out of the compiled step, and a fused Adam step.
LOADING_RUNS = [
    {"model": {"arch": "transformer", "depth": 1, "width": 8, "n_heads": 2, "qk_norm": True, "init": "gpt2",
               "tie_embeddings": True},
     "data": {"task": "shakespeare_char", "seq_len": 64, "batch_size": 8, "n_val": 3},
     "train": {"steps": 2, "z_loss": 1e-3, "stop_when": "diverged"}},
    {"model": {"arch": "transformer", "depth": 1, "width": 8, "n_heads": 2}, "norm": {"placement": "admin"},
     "data": {"task": "copy"}, "train": {"steps": 2}},
    {"model": {"depth": 2, "width": 8}, "norm": {"placement": "deepnorm", "kind": "dyt"},
     "optim": {"name": "radam", "agc": 0.01}, "train": {"steps": 2}},
    {"model": {"depth": 2, "width": 8}, "optim": {"name": "sgd", "clip_norm": 1.0}, "train": {"steps": 2}},
    {"model": {"depth": 2, "width": 8}, "optim": {"name": "adamw"}, "train": {"steps": 2}},
]
LOADED = """
import json, sys
from pathlib import Path
import normexp
from normexp.config import validate_run
from normexp.engines.fast import aot, train_fast
from normexp.engines.fast.sources import step_sources
aot.load_or_compile = lambda key, trace, inputs, **_: (trace(), True)  # traced and checked, not compiled
for run in json.loads(sys.argv[1]):
    cfg = validate_run(run)
    train_fast([cfg], compile=True)
    train_fast([cfg], compile=False)
loaded = {m for m in sys.modules if m == "normexp" or m.startswith("normexp.")}
print(json.dumps(sorted(loaded - set(step_sources(Path(normexp.__file__).resolve().parent)))))
"""


@pytest.mark.process
def test_every_normexp_module_that_building_tracing_and_running_the_step_loads_is_in_the_closure(tmp_path):
    """The static walk against what a fresh process really loads while it builds, traces, checks and runs the
    step, compiled and not: a module reached any other way (an import by a string, a name looked up at run
    time) is missing from the key and must go in `sources.EXTRA_MODULES`, or a vouched package could go on
    running the old step after it changed."""
    env = {**os.environ, "NORMEXP_CACHE_DIR": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "PYTHONPATH": os.pathsep.join([str(INSTALLED.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", LOADED, json.dumps(LOADING_RUNS)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
