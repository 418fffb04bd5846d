"""Hostile review 4: a pool worker handed its next unit before the last one's results are written, a
unit's run folders synced together, and step packages vouched for by their bytes."""

from __future__ import annotations

import hashlib
import sys
import textwrap

import pytest
from normexp import registry
from normexp.config import validate_run
from normexp.engines import aot, fast
from normexp.engines.fast import train_fast

PLUGIN = '''
import torch
from torch import nn

import scalehelper


class ScaledNorm(nn.Module):
    """x / rms(x) times a gain and a constant from another module of the user's (scalehelper.SCALE)."""

    stackable = True

    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        rms = (x * x).mean(-1, keepdim=True).add(self.eps).sqrt()
        return self.weight * x / rms * scalehelper.SCALE
'''


def _fresh_process(*modules: str) -> None:
    """What a later process starts from: nothing compiled or imported of the user's."""
    fast._COMPILED.clear()
    registry.load_plugin.cache_clear()
    for name in modules:
        sys.modules.pop(name, None)


def test_a_vouched_package_is_checked_again_when_a_module_its_plugin_imports_changed(monkeypatch, tmp_path):
    """A package's name covers a plugin's own module file, not what that module imports: the check against
    the eager step covered the rest (aot._plugin_digests). A package vouched for by its bytes alone skipped
    that check in a later process, which then trained the old helper's step: losses of another model,
    looking normal."""
    graphs: dict = {}

    def fake_compile(graph, inputs, package):  # the compiler stood in for by the traced graph
        graphs[package] = graph
        package.write_bytes(b"package")

    def fake_load(package):
        step = graphs[package]

        def call(*args):
            return step(*args)
        call.digest = hashlib.sha256(package.read_bytes()).hexdigest()
        return call

    (tmp_path / "scalednorm.py").write_text(textwrap.dedent(PLUGIN))
    (tmp_path / "scalehelper.py").write_text("SCALE = 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("NORMEXP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(aot, "compile_package", fake_compile)
    monkeypatch.setattr(aot, "load_package", fake_load)
    monkeypatch.setattr(fast, "_COMPILED", {})

    def configs():
        return [validate_run({"model": {"depth": 2, "width": 8}, "data": {"n_samples": 16},
                              "norm": {"placement": "pre", "kind": "scalednorm:ScaledNorm"},
                              "optim": {"lr": 0.01}, "train": {"steps": 4}, "seed": s}) for s in range(2)]

    try:
        _fresh_process("scalednorm", "scalehelper")
        train_fast(configs(), compile=True)  # compiled and checked
        assert not list((tmp_path / "cache" / "steps").glob("*.checked"))  # a plugin's step: never vouched for
        (tmp_path / "scalehelper.py").write_text("SCALE = 3.0\n")  # the user changes the helper
        _fresh_process("scalednorm", "scalehelper")
        got = train_fast(configs(), compile=True)
        want = train_fast(configs(), compile=False)
        assert [r.metrics["loss"][-1] for r in got] == pytest.approx([r.metrics["loss"][-1] for r in want],
                                                                     rel=1e-4)
    finally:
        _fresh_process("scalednorm", "scalehelper")
