"""Issue 29's figures side by side with the reference: the phase diagram's shape (Post-LN, depth 24, width 32,
lr x warmup x seeds, 60 steps) per model-step on each engine, `auto` against the reference on the article's
64-run grid end to end, a 10,000-run grid's dry run, and report / plot / verify of a large run folder.

    python benchmarks/bench_scale.py              # or: make bench
    python benchmarks/bench_scale.py --quick      # smaller: a smoke run of every measurement
    python benchmarks/bench_scale.py --runs 10000 # the folder figures at the issue's size

Engines run side by side in one process, alternated; sweeps in fresh processes, alternated. The CPU (model,
family and model numbers, ISA, torch's BLAS) and the load average are printed with each figure: a speed is a
claim about one CPU, and other work on the machine slows every side. The last line sums the issue's figures
up, all measured in that run. Nothing here asserts.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from normexp.environment import cpu_info, cpu_summary, set_thread_defaults, torch_blas

set_thread_defaults()  # before torch loads: its threads wait, and MKL takes its path, as under the normexp command

import torch

from normexp.config import RunConfig, load_sweep
from normexp.engines.fast import train_fast
from normexp.engines.fast.aot import steps_dir
from normexp.engines.reference import train_run
from normexp.folder import (
    SWEEP_FILE,
    FinishedRun,
    append_history,
    atomic_write,
    run_id,
    sweep_yaml,
    write_run,
    write_summary,
)

REPO = Path(__file__).resolve().parents[1]
LRS = [0.0003, 0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.007, 0.01, 0.015, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15]
WARMUPS = [0, 2, 5, 10, 15, 20, 30, 45]


def phase_grid_yaml(seeds: int, steps: int = 60, lrs: list[float] = LRS) -> str:
    return ("name: phase\nbase: {model: {depth: 24, width: 32}, norm: {placement: post}, "
            f"schedule: {{kind: linear_warmup}}, train: {{steps: {steps}}}}}\n"
            f"grid: {{optim.lr: {lrs}, schedule.warmup_steps: {WARMUPS}}}\nseeds: {list(range(seeds))}\n")


def phase_runs(n: int, steps: int) -> list[RunConfig]:
    """The first n runs of the phase diagram in the order a sweep batches them (seeds of one cell together)."""
    return [RunConfig.model_validate({"model": {"depth": 24, "width": 32}, "norm": {"placement": "post"},
                                      "optim": {"lr": lr}, "schedule": {"kind": "linear_warmup", "warmup_steps": w},
                                      "train": {"steps": steps}, "seed": s})
            for s in range(n) for lr in LRS for w in WARMUPS][:n]


def load() -> str:
    """The load average, and the CPU in short, that a figure was measured under."""
    cpu = cpu_info()
    return f"load {os.getloadavg()[0]:.1f}, {cpu.model} ({cpu.ident or 'no id'}; {cpu.isa_text()}; {torch_blas(torch)})"


def per_model_step(runs: list[RunConfig], quick: bool) -> None:
    """Reference, fast eager and fast compiled on the same batch, alternated, ms per model-step."""
    steps = runs[0].train.steps + 1
    train_fast(runs, compile=True)  # compiles, or loads the step from inductor's cache
    times: dict[str, list[float]] = {"reference": [], "fast eager": [], "fast compiled": []}
    for _ in range(1 if quick else 2):
        start = time.perf_counter()
        for cfg in runs[:2]:
            train_run(cfg)
        times["reference"].append((time.perf_counter() - start) / (2 * steps) * 1e3)
        for name, compile in (("fast eager", False), ("fast compiled", True)):
            start = time.perf_counter()
            train_fast(runs, compile=compile)
            times[name].append((time.perf_counter() - start) / (len(runs) * steps) * 1e3)
    ref = statistics.median(times["reference"])
    print(f"\nphase diagram shape (Post-LN depth 24 width 32), {len(runs)}-run batch x {steps} steps, whole calls, "
          f"ms per model-step (median of alternated rounds), {load()}:")
    for name, values in times.items():
        ms = statistics.median(values)
        print(f"  {name:<15} {ms:8.2f} ms   {ref / ms:6.2f}x the reference")
    compiled = statistics.median(times["fast compiled"])
    print(f"  a 10,000-run diagram at this rate: ~{10_000 * 61 * compiled / 1e3 / 60:.1f} min of training "
          f"(+ compile, writing)")


def sweep_seconds(args: list[str]) -> tuple[float, str]:
    """Seconds of `normexp sweep ARGS` and its last line naming the engine (auto: what it chose and why)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "normexp", "sweep", *args], cwd=REPO, check=True,
                          capture_output=True, text=True)
    lines = done.stdout.splitlines() + done.stderr.splitlines()
    engine = [line for line in lines if line.startswith("engine ")]
    return time.perf_counter() - start, (engine or lines or [""])[-1]


ARTICLE_SEEDS = "--set=seeds=" + ",".join(map(str, range(16)))  # the article's grid: 4 structures x 16 seeds


def auto_vs_reference(rounds: int) -> float:
    """`normexp sweep configs/warmup.yaml` with 16 seeds (64 runs: configs/warmup.yaml alone has one seed, 4 runs,
    where no runs share a batch and auto measures nothing) with --engine auto and reference, fresh processes
    (auto with this machine's cache: a shape not measured before is measured on the first round's runs)."""
    times: dict[str, list[float]] = {"reference": [], "auto": []}
    chose = ""
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for engine in times:
                seconds, line = sweep_seconds([str(REPO / "configs" / "warmup.yaml"), ARTICLE_SEEDS, "--engine", engine,
                                               "--force", "--out", str(Path(tmp) / f"{engine}{r}")])
                times[engine].append(seconds)
                chose = line if engine == "auto" else chose
    ref = statistics.median(times["reference"])
    print(f"\nthe article's 64-run grid end to end (normexp sweep, fresh processes, {rounds} alternated rounds), "
          f"{load()}:")
    for engine, values in times.items():
        print(f"  --engine {engine:<10} {' / '.join(f'{v:.1f}' for v in values)} s   "
              f"{ref / statistics.median(values):5.2f}x the reference")
    print(f"  auto chose: {chose}")
    return ref / statistics.median(times["auto"])


def sweep_per_run(fast_seeds: int) -> tuple[float, float, float, bool]:
    """The issue's hidden check, as a user runs it: `normexp sweep` of the phase grid end to end with the fast
    engine (its defaults: compiled, worker pool), against the reference on a 32-run slice of it (2 learning
    rates x 8 warmups x 2 seeds); seconds per run of each, and their ratio. The fast sweep's time includes
    loading (or, with a cold cache, compiling) its step: see the engine line it prints. The last item says
    whether the fast sweep compiled its step (a package appeared in the step cache during it)."""
    with tempfile.TemporaryDirectory() as tmp:
        grids = {"reference": phase_grid_yaml(2, lrs=[0.001, 0.01]), "fast": phase_grid_yaml(fast_seeds)}
        per_run, first = {}, ""
        packages = set(steps_dir().glob("*.pt2"))
        for engine, text in grids.items():
            (Path(tmp) / f"{engine}.yaml").write_text(text)
            runs = len(load_sweep(Path(tmp) / f"{engine}.yaml", max_runs=100_000).runs)
            seconds, line = sweep_seconds([str(Path(tmp) / f"{engine}.yaml"), "--engine", engine, "--max-runs",
                                           "100000", "--out", str(Path(tmp) / engine)])
            per_run[engine] = (seconds / runs, runs, seconds)
            first = line if engine == "fast" else first
        cold = bool(set(steps_dir().glob("*.pt2")) - packages)
    ref, fast = per_run["reference"][0], per_run["fast"][0]
    print(f"\nthe phase grid end to end (normexp sweep, fresh processes), {load()}:")
    for engine, (each, runs, seconds) in per_run.items():
        print(f"  --engine {engine:<10} {runs:6d} runs in {seconds:7.1f} s: {each * 1e3:7.1f} ms per run")
    print(f"  fast per run: {ref / fast:.2f}x the reference (target >= 10x); a 10,000-run grid at this rate: "
          f"~{10_000 * fast / 60:.1f} min (target 10)")
    print(f"  fast's engine line: {first}; {'its step compiled cold in this sweep' if cold else 'its step on disk'}")
    return ref / fast, fast, ref, cold


def synthetic_folder(out: Path, seeds: int) -> int:
    """A phase-diagram run folder written through the store, without training (made-up loss curves); its
    summary written last, as a sweep's, records the runs that pass in .verified.json."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(phase_grid_yaml(seeds))
    sweep = load_sweep(f.name, max_runs=100_000)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / SWEEP_FILE, sweep_yaml(sweep))
    append_history(out, {"command": "bench_scale", "sweep": sweep.name, "runs_planned": len(sweep.runs),
                         "resolved": sweep.to_yaml()})  # as a sweep records its grid
    rnd = random.Random(0)
    for cfg in sweep.runs:
        n, lr = cfg.train.steps + 1, cfg.optim.lr
        start, floor = 2.3 + 0.1 * rnd.random(), 0.01 if lr < 0.02 else 2.3
        metrics = {"step": list(range(n)), "loss": [floor + (start - floor) * math.exp(-5 * s * lr) for s in range(n)],
                   "acc": [0.1] * n, "lr": [lr] * n, "grad_norm": [1.0] * n}
        write_run(out / run_id(cfg), cfg, FinishedRun(metrics, "completed", 0.1, 2, "fast", "cpu"), "bench")
    write_summary(out, sweep.runs, {run_id(c): "completed" for c in sweep.runs})
    return len(sweep.runs)


def folder_commands(runs: int) -> tuple[int, float]:
    """report, verify and plot of a synthetic folder of about `runs` runs, each a fresh process; returns the
    folder's runs and report's seconds."""
    seeds = max(1, runs // (len(LRS) * len(WARMUPS)))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "phase"
        start = time.perf_counter()
        n = synthetic_folder(folder, seeds)
        print(f"\na {n}-run folder (written in {time.perf_counter() - start:.0f} s), each command a fresh process, "
              f"{load()} (target: <= 10 s each at 10,000 runs):")
        report_s = 0.0
        for command in (["report", str(folder)], ["verify", str(folder)], ["verify", str(folder)],
                        ["plot", str(folder), "-o", str(Path(tmp) / "fig.png")]):
            start = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "normexp", *command], cwd=REPO, capture_output=True, text=True)
            seconds = time.perf_counter() - start
            report_s = seconds if command[0] == "report" else report_s
            print(f"  normexp {command[0]:<8} {seconds:6.1f} s  (exit {done.returncode})")
        (Path(tmp) / "grid.yaml").write_text(phase_grid_yaml(79))
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "normexp", "sweep", str(Path(tmp) / "grid.yaml"), "--dry-run",
                        "--max-runs", "20000", "--out", str(folder)], cwd=REPO, check=True, capture_output=True)
        print(f"  sweep --dry-run of the 10,112-run grid against it: {time.perf_counter() - start:.1f} s (target 2 s)")
    return n, report_s


def summary(per_run: tuple[float, float, float, bool] | None, auto: float, folder: tuple[int, float]) -> str:
    """The one line `make bench` ends with: the issue's four figures, each measured in this run, and the CPU."""
    fast = (f"fast/reference per run {per_run[0]:.2f}x ({per_run[1] * 1e3:.1f} vs {per_run[2] * 1e3:.1f} ms a run), "
            f"10,240 runs ~{10_240 * per_run[1] / 60:.1f} min at that rate "
            f"({'step compiled cold in the sweep' if per_run[3] else 'step on disk'})"
            if per_run else "fast/reference not measured (--quick)")
    return (f"SUMMARY: {fast}; auto {auto:.2f}x the reference (article's 64-run grid); report of a {folder[0]}-run "
            f"folder {folder[1]:.1f} s; {load()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--runs", type=int, default=2048, help="runs in the synthetic folder")
    parser.add_argument("--fast-seeds", type=int, default=16, help="seeds of the phase grid the fast sweep trains "
                        "(128 runs each; from 16 its defaults compile)")
    args = parser.parse_args()
    print(f"CPU: {cpu_summary()}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores, {load()}")
    per_model_step(phase_runs(16 if args.quick else 64, 5 if args.quick else 10), args.quick)
    per_run = None if args.quick else sweep_per_run(args.fast_seeds)
    auto = auto_vs_reference(1 if args.quick else 2)
    folder = folder_commands(128 if args.quick else args.runs)
    print(f"\n{summary(per_run, auto, folder)}")


if __name__ == "__main__":
    main()
