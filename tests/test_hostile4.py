"""Hostile review 4: a pool worker handed its next unit before the last one's results are written, a
unit's run folders synced together, and step packages vouched for by their bytes."""

from __future__ import annotations

import sys
import textwrap
import time

import pytest
from test_fast import packaged_graphs

from normexp import registry
from normexp.config import validate_run
from normexp.engines.fast import compiled as compiling
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
    compiling.reset_cache()
    registry.load_plugin.cache_clear()
    for name in modules:
        sys.modules.pop(name, None)


def test_a_vouched_package_is_checked_again_when_a_module_its_plugin_imports_changed(monkeypatch, tmp_path,
                                                                                     fresh_fast_engine):
    """A package's name covers a plugin's own module file, not what that module imports: the check against
    the eager step covered the rest (aot._plugin_digests). A package vouched for by its bytes alone skipped
    that check in a later process, which then trained the old helper's step: losses of another model,
    looking normal."""
    (tmp_path / "scalednorm.py").write_text(textwrap.dedent(PLUGIN))
    (tmp_path / "scalehelper.py").write_text("SCALE = 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("NORMEXP_CACHE_DIR", str(tmp_path / "cache"))
    packaged_graphs(monkeypatch)
    compiling.reset_cache()

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


def seed_or_die(unit):
    """Stands in for run_unit in a pool worker: says its unit's seed; dies on seed 1 while $HOSTILE4_DIE
    names a file that it may still create (once: `die once`), or always (`die always`)."""
    import os
    from pathlib import Path

    from normexp.units import UnitResult

    seed, flag = unit.runs[0].seed, os.environ.get("HOSTILE4_DIE", "")
    mode, _, path = flag.partition(":")
    if seed == 1 and mode == "always":
        os._exit(3)
    if seed == 1 and mode == "once" and not Path(path).exists():
        Path(path).write_text("died")
        os._exit(3)
    return UnitResult(unit, (), status=str(seed))


@pytest.mark.parametrize("mode", ["once", "always"])
def test_a_worker_that_dies_holding_the_unit_it_got_before_the_last_results_were_written(monkeypatch, tmp_path,
                                                                                        mode):
    """One worker: it is handed seed 1 while the consumer still holds seed 0's results, and dies on it. Seed 1
    costs one attempt per death (retried once, then crashed); no unit is lost or reported twice."""
    from normexp.config import RunConfig
    from normexp.executors import PoolExecutor
    from normexp.units import WorkUnit

    units = [WorkUnit((RunConfig(seed=s).model_dump(mode="json"),), engine="reference", device="cpu", threads=1)
             for s in range(3)]
    monkeypatch.setenv("HOSTILE4_DIE", f"{mode}:{tmp_path / 'died'}")
    monkeypatch.setattr("normexp.executors.run_unit", seed_or_die)
    pool = PoolExecutor(1)
    try:
        got = sorted((r.unit.runs[0].seed, r.status) for r in pool.run(units))
    finally:
        pool.close()
    assert got == [(0, "0"), (1, "1" if mode == "once" else "crashed"), (2, "2")]


def seed_after(unit):
    """Stands in for run_unit in a pool worker: says its unit's seed after `train.steps` hundredths of a second."""
    import time

    from normexp.units import UnitResult

    time.sleep(unit.runs[0].train.steps / 100)
    return UnitResult(unit, (), status=str(unit.runs[0].seed))


def test_units_a_pool_finished_but_never_yielded_when_the_sweep_stopped_are_unreported_not_lost(monkeypatch):
    """The consumer stops (Ctrl-C while it writes seed 0's results) after the pool handed that worker its next
    unit: seed 2 finishes meanwhile, as does seed 1 on the other worker. Both are trained runs the sweep never
    saw: the pool keeps them in `unreported` (as InProcessExecutor does) for the sweep to record, not thrown
    away with the workers. Seed 3 was never handed out."""
    from normexp.config import RunConfig
    from normexp.executors import PoolExecutor
    from normexp.units import WorkUnit

    steps = {0: 1, 1: 100, 2: 1, 3: 1}  # seed 0 first (or 1: then 0 and 2 end while it is written)
    units = [WorkUnit((RunConfig(seed=s, train={"steps": steps[s]}).model_dump(mode="json"),), engine="reference",
                      device="cpu", threads=1) for s in range(4)]
    monkeypatch.setattr("normexp.executors.run_unit", seed_after)
    pool = PoolExecutor(2)
    try:
        running = pool.run(units)
        first = next(running)
        time.sleep(2.5)  # its results being written: the Ctrl-C is raised when they are in place
        running.close()
        assert sorted([first.status] + [r.status for r in pool.unreported]) == ["0", "1", "2"]
    finally:
        pool.close()


def test_a_ctrl_c_while_a_pool_sweep_writes_records_the_units_its_workers_finished_meanwhile(monkeypatch, tmp_path):
    """The sweep end to end (--workers 2, the reference engine): Ctrl-C while the first unit's run is written;
    the worker handed its next unit meanwhile, and the other worker, finish theirs. Every run that trained is
    in its folder and reported as such in the summary; no run is reported that was not written."""
    from normexp import sweep as sweep_module
    from normexp.config import build_sweep
    from normexp.results import load_summary
    from normexp.sweep import SweepInterrupted, SweepOptions, run_sweep

    spec = build_sweep({"name": "c", "base": {"model": {"depth": 1, "width": 4}, "train": {"steps": 2}},
                        "seeds": [0, 1, 2, 3, 4, 5]})
    real, calls = sweep_module._record_unit, []

    def record_then_ctrl_c(result, *args):
        real(result, *args)
        calls.append(result)
        if len(calls) == 1:
            time.sleep(4.0)  # the other units finish meanwhile
            raise KeyboardInterrupt

    monkeypatch.setattr(sweep_module, "_record_unit", record_then_ctrl_c)
    with pytest.raises(SweepInterrupted) as stopped:
        run_sweep(spec, tmp_path, SweepOptions(engine="reference", workers=2))
    statuses = stopped.value.outcome.statuses
    written = {p.parent.name for p in tmp_path.glob("*/done.json")}
    assert len(calls) == 3  # the first unit, then the two finished while it was written
    assert {rid for rid, status in statuses.items() if status == "completed"} == written and len(written) == 3
    summary = load_summary(tmp_path)
    assert sorted(summary["status"]) == ["completed"] * 3 + ["interrupted"] * 3
