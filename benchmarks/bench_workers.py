"""Throughput of a 256-run grid with 1 and 2 local workers (`normexp sweep --workers N`), end to end.

    python benchmarks/bench_workers.py [--runs 256] [--engine batched|reference]

Each setting runs `normexp sweep` in a fresh process into a fresh folder and reports runs per second.
By default every run keeps the sweep's torch thread count (2 here), so 2 workers oversubscribe 2
cores but give the same numbers; the last setting splits the cores instead (`train.threads=1`),
which changes LayerNorm runs' rounding. Each setting's losses are compared with the first one's,
per norm kind.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from normexp.environment import cpu_summary
from normexp.results import load_metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=256, help="a multiple of 4")
    parser.add_argument("--engine", default="batched")
    args = parser.parse_args()
    seeds = args.runs // 4
    print(f"CPU: {cpu_summary()}")
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "grid.yaml"
        config.write_text("name: workers\nbase: {train: {steps: 30}}\n"
                          "grid: {norm.placement: [post, pre], norm.kind: [layernorm, rmsnorm]}\n"
                          f"seeds: {list(range(seeds))}\n")
        print(f"{args.runs} runs (article model, 31 steps each), engine {args.engine}")
        baseline = None
        for workers, threads in ((1, None), (2, None), (2, 1)):
            out = Path(tmp) / f"w{workers}t{threads}"
            split = ["--set", f"train.threads={threads}"] if threads else []
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "normexp", "sweep", str(config), "--out", str(out), "--quiet",
                            "--engine", args.engine, "--workers", str(workers), *split], check=True)
            seconds = time.perf_counter() - start
            losses = load_metrics(out, all_config=True).sort_values(["norm.kind", "norm.placement", "seed", "step"])
            losses = losses.groupby("norm.kind")["loss"].apply(list)
            baseline = losses if baseline is None else baseline
            same = ", ".join(f"{kind} {_compare(losses[kind], baseline[kind])}" for kind in losses.index)
            label = f"--workers {workers}" + (f" x train.threads={threads}" if threads else "")
            print(f"  {label:<30} {seconds:7.2f} s  {args.runs / seconds:6.2f} runs/s  losses: {same}")


def _compare(losses: list[float], baseline: list[float]) -> str:
    if losses == baseline:
        return "identical"
    return f"max |delta| {max(abs(a - b) for a, b in zip(losses, baseline)):.2g}"

if __name__ == "__main__":
    main()
