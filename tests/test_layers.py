"""The house's layers, held: the import graph of normexp (every import, lazy ones too, read from the
source) has no circle, and no import runs back up a layer but the one of the `python -m normexp.studies`
shim (UPWARD_ALLOWED); pure-number analysis and the figures never load torch; what the engines share
imports no engine; no engine reaches the run folder, the sweep or the executors; each file of the run
folder (folder/) imports only those before it. A new module must be given a layer here, so that its
place is a decision, not an accident.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "normexp"

FIGURES = ["normexp.figures", "normexp.figures.facets", "normexp.figures.curves", "normexp.figures.phase",
           "normexp.figures.sweep", "normexp.figures.blocks", "normexp.figures.gradnorm",
           "normexp.figures.sharpness"]

# The fast engine, behind one door (its package): what no module outside it imports but the door
FAST_DOOR = "normexp.engines.fast"
FAST = [FAST_DOOR, *(f"{FAST_DOOR}.{m}"
                   for m in ("plan", "mkl_path", "starts", "step", "optim", "sources", "aot", "blockwise", "compiled",
                             "train"))]

EXPORT = ["normexp.export", "normexp.export.runs", "normexp.export.tensorboard", "normexp.export.mlflow",
          "normexp.export.names", "normexp.export.wandb", "normexp.export.parquet"]
PAGE = ["normexp.page", "normexp.page.document", "normexp.page.data", "normexp.page.tables", "normexp.page.report",
        "normexp.page.markdown"]
# Bottom to top: a module imports from its own layer or below, never above.
LAYERS = {
    "foundation": ["normexp", "normexp.registry", "normexp.config.errors", "normexp.config.loader",
                   "normexp.config.fields", "normexp.config.optimizer", "normexp.config.inits", "normexp.corpus",
                   "normexp.config.data", "normexp.config.schema", "normexp.config.sample", "normexp.config.grid",
                   "normexp.config", "normexp.environment", "normexp.stopping", "normexp.blocklog"],
    # the run folder: its contract (folder/), loaded, compared, verified, merged
    "records": ["normexp.folder.layout", "normexp.folder.atomic", "normexp.folder.ids", "normexp.folder.verified",
                "normexp.folder.inspect", "normexp.folder.write", "normexp.folder.sweepfiles", "normexp.folder.lock",
                "normexp.folder", "normexp.results", "normexp.compare", "normexp.verify", "normexp.merge"],
    "analysis": ["normexp.analysis", "normexp.analysis.variants", "normexp.analysis.sensitivity",
                 "normexp.analysis.gradnorm", "normexp.analysis.finals",
                 "normexp.analysis.anova", "normexp.analysis.realtext"],  # pure numbers: pandas and statistics
    "models": ["normexp.models", "normexp.models.norms", "normexp.models.inits", "normexp.models.ffn",
               "normexp.models.transformer", "normexp.data", "normexp.optim"],
    "engine base": ["normexp.engines", "normexp.engines.cost", "normexp.engines.cache", "normexp.engines.common",
                    "normexp.sharpness"],
    "engines": ["normexp.engines.reference", "normexp.engines.batched", *FAST, "normexp.engines.auto",
                "normexp.diagnostics"],
    "running": ["normexp.units", "normexp.executors", "normexp.shard", "normexp.sweep", "normexp.launch"],
    "presentation": ["normexp.output", "normexp.tables", "normexp.report", "normexp.progress",
                     *EXPORT, *FIGURES, *PAGE],
    # the shipped studies: verdicts < figures < run; __main__ is `python -m normexp.studies`
    "studies": ["normexp.studies", "normexp.studies.verdicts", "normexp.studies.explanations",
                "normexp.studies.figures", "normexp.studies.run",
                "normexp.studies.__main__"],
    "commands": ["normexp.commands", "normexp.commands.console", "normexp.commands.sweep", "normexp.commands.read",
                 "normexp.commands.tools", "normexp.cli", "normexp.__main__"],
}
# The one import allowed back up: `python -m normexp.studies` enters the command `normexp studies` as
# `python -m normexp` does, so that the two share one command line, one signal handling, one exit path.
UPWARD_ALLOWED = {("normexp.studies.__main__", "normexp.__main__")}
LAYER_OF = {module: rank for rank, modules in enumerate(LAYERS.values()) for module in modules}
FOLDER = [m for m in LAYERS["records"] if m.startswith("normexp.folder.")]  # each imports only those before it
ENGINES = ("normexp.engines.reference", "normexp.engines.batched", *FAST)
NO_TORCH = ("normexp.config", "normexp.engines.cost", "normexp.engines.cache", FAST_DOOR, f"{FAST_DOOR}.plan",
            f"{FAST_DOOR}.mkl_path", "normexp.analysis",
            "normexp.analysis.variants", "normexp.analysis.sensitivity", "normexp.analysis.gradnorm",
            "normexp.analysis.finals", "normexp.analysis.anova", "normexp.analysis.realtext", *FIGURES,
            "normexp.report", "normexp.tables", "normexp.results", "normexp.compare", *PAGE,
            *EXPORT, "normexp.merge", "normexp.config.sample",
            "normexp.corpus")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Every normexp module and the normexp modules it imports (at the top or inside a function)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "normexp":
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                          for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.split(".")[0] == "normexp"}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


GRAPH = import_graph()


def test_every_module_has_a_layer():
    assert set(GRAPH) - set(LAYER_OF) == set(), "give each new module a layer in tests/test_layers.py"
    assert set(LAYER_OF) - set(GRAPH) == set(), "a layer names a module that no longer exists"


def test_no_import_runs_back_up_a_layer_but_the_studies_shim():
    layer_names = list(LAYERS)
    upward = {(m, d) for m, deps in GRAPH.items() for d in deps if LAYER_OF[d] > LAYER_OF[m]}
    assert [f"{m} ({layer_names[LAYER_OF[m]]}) imports {d} ({layer_names[LAYER_OF[d]]})"
            for m, d in sorted(upward - UPWARD_ALLOWED)] == []
    assert upward == UPWARD_ALLOWED  # the shim still enters through normexp/__main__.py: one exit path


def test_no_import_circle():
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = "open"
        for dep in sorted(GRAPH[module]):
            if state.get(dep) == "open":
                return [*path, module, dep]
            if dep not in state and (cycle := visit(dep, [*path, module])):
                return cycle
        state[module] = "done"
        return None

    for module in sorted(GRAPH):
        if module not in state:
            assert visit(module, []) is None


def test_what_engines_share_imports_no_engine_and_no_engine_reaches_the_run_folder():
    assert not GRAPH["normexp.engines.common"] & set(ENGINES)
    forbidden = {*FOLDER, "normexp.folder", "normexp.sweep", "normexp.executors", "normexp.results", "normexp.verify"}
    assert {engine: GRAPH[engine] & forbidden for engine in ENGINES} == {engine: set() for engine in ENGINES}
    assert GRAPH["normexp.engines.reference"] & set(ENGINES) == set()  # the definition of correct stands alone


def test_each_file_of_the_run_folder_imports_only_those_before_it():
    later = {m: {d for d in GRAPH[m] if d in FOLDER and FOLDER.index(d) > FOLDER.index(m)} for m in FOLDER}
    assert later == {m: set() for m in FOLDER}
    assert not any(GRAPH[m] & {"normexp.folder"} for m in FOLDER)  # a file of it never imports its door


def test_the_fast_engine_is_reached_through_its_door_only():
    """Outside the fast engine's package, a module imports the package (its __init__, the public names), never
    one of its files: the files can be split or renamed without touching a caller."""
    inside = set(FAST) - {FAST_DOOR}
    assert {m: GRAPH[m] & inside for m in GRAPH if m not in FAST and GRAPH[m] & inside} == {}


def test_analysis_imports_no_presentation_and_no_torch_backed_module():
    torch_backed = {m for m in GRAPH if LAYER_OF[m] >= LAYER_OF["normexp.models"]}
    for module in LAYERS["analysis"]:
        assert GRAPH[module] & torch_backed == set(), module


@pytest.mark.process
@pytest.mark.parametrize("module", NO_TORCH)
def test_importing_analysis_and_presentation_loads_no_torch_rich_or_typer(module):
    code = (f"import sys, {module}; heavy = [m for m in ('torch', 'rich', 'typer') if m in sys.modules]; "
            "print(','.join(heavy))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == ""


@pytest.mark.process
@pytest.mark.parametrize("module", LAYERS["analysis"])
def test_importing_analysis_loads_no_matplotlib(module):
    """What a result means is numbers; drawing them is the figures' (normexp.figures)."""
    code = f"import sys, {module}; print('matplotlib' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "False"
