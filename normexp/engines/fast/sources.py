"""The code a compiled step can run: the normexp modules that build the fast engine's step (`STEP_ROOTS`)
and every normexp module they import, in turn, read from the files (nothing is imported). `aot.source_digest`
hashes them into the name of the step's package on disk, so that a change to any of them compiles the
step again, and a change anywhere else (a report, an exporter, the CLI) keeps every package.

What an import is, here (`imported`): `import normexp.x`, `from normexp.x import y` (normexp.x.y too,
where y is a module), `from normexp import x`, relative imports, wherever the statement sits: in a
function, a class, an `if TYPE_CHECKING:` or a `try:` alike. Importing `normexp.x.y` runs
`normexp/__init__.py` and `normexp/x/__init__.py` first, so every package above a module is in too.
Today (a third of the package's modules): the fast engine (engines/fast/, all of it), engines/__init__.py,
common.py and cost.py, the models (models/), the config (config/), data.py, corpus.py, optim.py,
registry.py, environment.py and normexp/__init__.py. Left out: the CLI and its commands, the sweep,
units, executors, shard and launch, the run folder (folder/, results, compare, verify, merge), report,
tables, progress, output, figures, page, export, analysis, studies, the other engines (reference,
batched, auto), diagnostics, sharpness, blocklog and stopping: what calls the engine or reads what it
wrote, never code its step runs.

No normexp module imports a normexp module by a string: `registry.load_plugin` imports only the module a
user's plugin reference names (`module:attribute`), which `aot` hashes on its own and never vouches for,
so `EXTRA_MODULES` is empty. A package that passed the check against the eager step once is vouched for
and later loads skip that check (`aot.vouch`), so a module this walk missed could let a stale step train
unseen: wherever in doubt, it takes more modules, never fewer.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

TOP = "normexp"  # the package whose modules are walked; imports of anything else are not followed
# The modules that build the step, trace it, compile, check, load and key it, and those that plan its
# batches and run it (train, plan: also reached through the package's __init__, named here so that they
# stay in whatever that file imports): the closure of their imports is the code a package's name covers.
STEP_ROOTS = ("normexp.engines.fast.compiled", "normexp.engines.fast.step", "normexp.engines.fast.optim",
              "normexp.engines.fast.starts", "normexp.engines.fast.aot", "normexp.engines.fast.train",
              "normexp.engines.fast.plan")
# Modules the step's code can run that no import statement names (an import by a string), walked like a
# root: none today (the module docstring says why).
EXTRA_MODULES: tuple[str, ...] = ()


def step_sources(root: Path) -> dict[str, tuple[Path, bytes]]:
    """The modules of the package in folder `root` (normexp's) that the step's code can run, by name, each
    with its file and bytes: `STEP_ROOTS` and `EXTRA_MODULES`, each package above a module, and every
    normexp module one of them imports (`imported`), in turn."""
    found: dict[str, tuple[Path, bytes]] = {}
    looked_up: set[str] = set()  # every name looked up: a module (in `found`) or a name imported from one
    todo = [*STEP_ROOTS, *EXTRA_MODULES]
    while todo:
        parts = todo.pop().split(".")
        for name in (".".join(parts[:i]) for i in range(1, len(parts) + 1)):  # the packages above it, then it
            if name in looked_up:
                continue
            looked_up.add(name)
            path = _module_file(root, name.split(".")[1:])
            if path is None:
                continue
            source = path.read_bytes()
            found[name] = (path, source)
            package = name if path.name == "__init__.py" else name.rpartition(".")[0]
            todo += [n for n in imported(source, package) if n == TOP or n.startswith(TOP + ".")]
    return found


def imported(source: bytes, package: str) -> list[str]:
    """The absolute names that the import statements of `source`, a module of `package`, may import:
    for `from m import a`, both m and m.a (a may be a module)."""
    names = []
    for node in import_statements(source):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
            continue
        base = package.split(".")[:package.count(".") + 2 - node.level] if node.level else []
        module = ".".join([*base, node.module] if node.module else base)
        names += [module, *(f"{module}.{alias.name}" for alias in node.names if alias.name != "*")]
    return names


def import_statements(source: bytes) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of `source`, wherever it sits (a function, a class, an `if`, a `try`), from the
    module's whole syntax tree. A module that does not parse imports nothing (it cannot run either)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def _module_file(root: Path, parts: list[str]) -> Path | None:
    """The file of the module `parts` below the package in folder `root` (a module's .py, or a package's
    __init__.py), or None where there is none (a name imported from a module, not a module)."""
    folder = os.path.join(root, *parts)
    for path in (folder + ".py" if parts else None, os.path.join(folder, "__init__.py")):
        if path is not None and os.path.isfile(path):
            return Path(path)
    return None
