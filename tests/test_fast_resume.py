"""Resuming a fast sweep cannot change a run's bits: a batch is planned over every run of the sweep, and
one with a run still to train is trained whole (the runs done already are left as they are)."""

from __future__ import annotations

import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from normexp.cli import app
from normexp.config import load_sweep
from normexp.engines.fast import plan_fast
from normexp.folder import run_id
from normexp.units import plan_units

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_reliability import done_markers, start_sweep  # noqa: E402

# Post-LN at a high learning rate: chaotic, so a run trained in a smaller batch shows it in its bits
SWEEP = """\
name: resume
base: {model: {depth: 4, width: 16}, norm: {placement: post}, optim: {lr: 0.03}, train: {steps: 20}}
grid: {norm.kind: [layernorm, rmsnorm]}
seeds: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
"""
runner = CliRunner()


def _runs_of(text: str):
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "sweep.yaml").write_text(text)
        return load_sweep(Path(folder) / "sweep.yaml").runs


RUNS = _runs_of(SWEEP)


def sweep(config: Path, out: Path) -> str:
    result = runner.invoke(app, ["sweep", str(config), "--out", str(out), "--engine", "fast"])
    assert result.exit_code == 0, result.output
    return result.output


def bits(out: Path) -> dict[str, bytes]:
    return {p.parent.name: p.read_bytes() for p in sorted(out.glob("*/metrics.csv"))}


def test_a_partly_written_batch_is_retrained_whole_and_its_written_runs_are_left_alone(write_yaml, tmp_path):
    config = write_yaml(SWEEP)
    clean, out = tmp_path / "clean", tmp_path / "out"
    sweep(config, clean)
    shutil.copytree(clean, out)
    rids = [run_id(cfg) for cfg in load_sweep(config).runs]
    for rid in rids[1:12] + rids[15:]:  # as a kill or a full disk leaves two batches: half written
        shutil.rmtree(out / rid)
    kept = {rid: (out / rid / "done.json").stat().st_mtime_ns for rid in set(rids) - set(rids[1:12] + rids[15:])}
    output = sweep(config, out)
    assert f"{len(rids) - len(kept)} ran, {len(kept)} already done" in output
    assert bits(out) == bits(clean) and len(bits(out)) == len(rids)
    assert {rid: (out / rid / "done.json").stat().st_mtime_ns for rid in kept} == kept  # not rewritten


@pytest.mark.equivalence
def test_kill_9_while_a_batch_is_written_then_resume_gives_the_uninterrupted_bits(write_yaml, tmp_path):
    config = write_yaml(SWEEP)
    clean = tmp_path / "clean"
    sweep(config, clean)
    for attempt in range(5):  # the kill must land while a batch's 12 folders are being written
        out = tmp_path / f"out{attempt}"
        proc = start_sweep(config, out, "-q", engine="fast")
        while not done_markers(out) and proc.poll() is None:
            pass
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if 0 < len(done_markers(out)) % 12 or len(done_markers(out)) == 0:
            break
    finished = len(done_markers(out))
    assert 0 < finished % 12, f"the kill never landed inside a batch's write ({finished} runs written)"
    sweep(config, out)
    assert bits(out) == bits(clean)


@settings(max_examples=50, deadline=None)
@given(st.sets(st.integers(0, 23)))
def test_fast_units_are_the_full_plans_batches_whatever_is_done(done):
    """Batch composition is a function of the sweep, not of what is done: the units of a resumed sweep
    are the batches of the full plan that hold a run to train, recording exactly those runs."""
    runs = RUNS
    pending = [cfg for i, cfg in enumerate(runs) if i not in done]
    units = plan_units(pending, "fast", "cpu", 1, compile=False, planned=runs)
    wanted = {run_id(cfg) for cfg in pending}
    expected = [batch for batch in plan_fast(runs) if any(run_id(cfg) in wanted for cfg in batch)]
    assert [[run_id(c) for c in u.runs] for u in units] == [[run_id(c) for c in b] for b in expected]
    recorded = [run_id(c) for u in units for i, c in enumerate(u.runs) if u.recorded(i)]
    assert sorted(recorded) == sorted(wanted)
