"""Throughput of a 256-run grid with 1 and 2 local workers (`normexp sweep --workers N`), end to end.

    python benchmarks/bench_workers.py [--runs 256] [--engine batched|reference]

Each setting runs `normexp sweep` in a fresh process into a fresh folder and reports runs per second;
the results of every setting are compared, loss for loss, with the first one.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from normexp.results import load_metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=256, help="a multiple of 4")
    parser.add_argument("--engine", default="batched")
    args = parser.parse_args()
    seeds = args.runs // 4
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "grid.yaml"
        config.write_text("name: workers\nbase: {train: {steps: 30}}\n"
                          "grid: {norm.placement: [post, pre], norm.kind: [layernorm, rmsnorm]}\n"
                          f"seeds: {list(range(seeds))}\n")
        print(f"{args.runs} runs (article model, 31 steps each), engine {args.engine}")
        baseline = None
        for workers in (1, 2):
            out = Path(tmp) / f"w{workers}"
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "normexp", "sweep", str(config), "--out", str(out), "--quiet",
                            "--engine", args.engine, "--workers", str(workers)], check=True)
            seconds = time.perf_counter() - start
            losses = load_metrics(out).sort_values(["run_id", "step"])["loss"].tolist()
            baseline = baseline or losses
            same = "identical" if losses == baseline else "DIFFERENT"
            print(f"  --workers {workers}: {seconds:7.2f} s  {args.runs / seconds:6.2f} runs/s  losses {same}")


if __name__ == "__main__":
    main()
