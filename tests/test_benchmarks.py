"""The benchmarks measure what they say: bench_kernels times the compiled step's kernels at the compiled
batch's size (COMPILED_CHUNK runs) and evicts an L2 between calls whatever that size."""

from __future__ import annotations

import sys
from pathlib import Path

from normexp.engines.fast import COMPILED_CHUNK

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_bench_kernels_measures_the_compiled_steps_batch_size():
    """bench_kernels says it measures the compiled phase-grid step's kernels (its matmuls and its Adam update,
    one batch's operands a call); it built 16-run operands after the compiled batch became 8 runs, so the
    shapes it timed were no longer the step's."""
    import bench_kernels

    assert bench_kernels.RUNS == COMPILED_CHUNK


def test_bench_kernels_evicts_an_l2_between_calls_whatever_the_batch_size():
    """Its "out of cache" figures write about an L2 (2 MB on the machine of docs/performance.md) between two
    calls; that write was sized by RUNS (1.6 MB at 16 runs), so following the batch size to 8 would have
    halved it and let the next call's operands stay in cache."""
    import bench_kernels

    assert 1_000_000 <= 4 * bench_kernels.EVICT_FLOATS <= 2 * 1024 * 1024


def test_bench_scale_ends_with_one_line_of_the_issue_s_figures_and_the_cpu():
    """`make bench` ends with bench_scale's summary: fast/reference per run, the 10,240-run extrapolation from the
    fast sweep's own rate, auto against the reference, report of the folder, and the CPU they were measured on."""
    import bench_scale

    from normexp.environment import cpu_info

    line = bench_scale.summary((9.5, 0.05, 0.475, False), 1.74, (2048, 3.1))
    assert line.startswith("SUMMARY: ") and "\n" not in line
    for part in ("fast/reference per run 9.50x", "50.0 vs 475.0 ms a run", "10,240 runs ~8.5 min",
                 "auto 1.74x the reference", "report of a 2048-run folder 3.1 s", cpu_info().model, "load ",
                 "(step on disk)"):
        assert part in line, (part, line)
    assert "compiled cold" in bench_scale.summary((4.3, 0.1, 0.43, True), 1.74, (2048, 3.1))  # says which it was
    assert "not measured" in bench_scale.summary(None, 1.0, (128, 1.0))
