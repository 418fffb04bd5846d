"""Reference vs batched engine on the article's 64-run grid, measured side by side on this machine.

    python benchmarks/bench_engines.py            # or: make bench
    python benchmarks/bench_engines.py --quick    # 16 runs, no 4096-run memory check

Prints, for each engine: ms per model-step (one training step of one run), the ratio, the peak RSS
while it ran; then the machine's own limit (measured matmul GFLOP/s against the model's FLOPs per
step); then how far the losses move when only the rounding changes (torch's fused Adam kernel, one
intra-op thread instead of two), which is why the batched engine keeps every kernel's bits; then
`normexp sweep` end to end with each engine, its fixed part (the same sweep with 0 steps) and the
end-to-end speed-up a batched engine could reach at best; then the peak RSS of a 4096-run grid run
by the batched engine in chunks. Timings are medians of `--repeats` alternating measurements, so
both engines see the same machine state; nothing here asserts a number.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

from normexp.environment import cpu_summary, set_thread_defaults

set_thread_defaults()  # before torch loads: its threads wait as under the normexp command

import torch

from normexp.config import OptimConfig, RunConfig
from normexp.engines.batched import plan_batches, stack_nets, train_batch
from normexp.engines.common import seeded_init
from normexp.engines.reference import train_run

REPO = Path(__file__).resolve().parents[1]


def grid(seeds: int, steps: int = 30) -> list[RunConfig]:
    """post/pre x layernorm/rmsnorm x seeds, the article's settings."""
    return [RunConfig.model_validate({"norm": {"placement": p, "kind": k}, "train": {"steps": steps}, "seed": s})
            for p in ("post", "pre") for k in ("layernorm", "rmsnorm") for s in range(seeds)]


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux)


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def time_reference(runs: list[RunConfig]) -> float:
    start = time.perf_counter()
    for cfg in runs:
        train_run(cfg)
    return time.perf_counter() - start


def fused_adam(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    """torch's Adam with its fused kernel: the same update, one pass per tensor, rounded differently."""
    return torch.optim.Adam(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                            fused=True)


def max_loss_change(runs: list[RunConfig], reference: list[list[float]], variant: str) -> float:
    """The largest |loss difference| at any step between the reference engine's losses and a run that
    differs from it only in rounding: `fused-adam` (torch's fused Adam kernel) or `1-thread`
    (LayerNorm's backward then sums its rows in one pass instead of two)."""
    worst = 0.0
    for cfg, base in zip(runs, reference):
        if variant == "fused-adam":
            # no optimizer replayed: the reference engine then builds torch's (here fused) Adam
            with mock.patch("normexp.engines.batched.REPLAYED_OPTIMIZERS", ()), \
                    mock.patch("normexp.engines.reference.build_optimizer", fused_adam):
                other = train_run(cfg).losses
        else:
            other = train_run(cfg.model_copy(update={"train": cfg.train.model_copy(update={"threads": 1})})).losses
        worst = max(worst, max(abs(a - b) for a, b in zip(base, other)))
    return worst


def time_batched(runs: list[RunConfig]) -> float:
    start = time.perf_counter()
    batches, alone = plan_batches(runs)
    for batch in batches:
        train_batch(batch)
    for cfg in alone:
        train_run(cfg)
    return time.perf_counter() - start


def model_flops(cfg: RunConfig) -> float:
    """FLOPs of one training step of one run: forward matmuls x 3 (forward, input and weight grads)."""
    n, d, h, depth = cfg.data.n_samples, cfg.model.width, cfg.model.width * cfg.model.hidden_mult, cfg.model.depth
    forward = 2 * n * (2 * d * h * depth + d * cfg.model.n_classes)
    return 3 * forward


def matmul_gflops(shape: tuple[int, ...], repeats: int = 20) -> float:
    """Measured GFLOP/s of torch.bmm at `shape` = (batch, m, k, n)."""
    b, m, k, n = shape
    x, w = torch.randn(b, m, k), torch.randn(b, k, n)
    torch.bmm(x, w)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.bmm(x, w)
    return 2 * b * m * k * n * repeats / (time.perf_counter() - start) / 1e9


def adam_ms_per_model_step(cfg: RunConfig, runs: int = 16, steps: int = 10) -> float:
    """ms per model-step of torch's single-tensor Adam (the reference's update, whose bits an exact
    engine must reproduce) stepping the stacked parameters of `runs` runs shaped like `cfg`."""
    params = list(stack_nets([seeded_init(cfg)[0] for _ in range(runs)], cfg.data.n_samples).parameters())
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer = torch.optim.Adam(params, lr=cfg.optim.lr)
    optimizer.step()
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return (time.perf_counter() - start) / (steps * runs) * 1e3


def sweep_seconds(engine: str, seeds: int, steps: int = 30) -> float:
    """Wall time of `normexp sweep` of the grid with one engine, end to end (a fresh process)."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "grid.yaml"
        config.write_text(f"name: bench\nbase: {{train: {{steps: {steps}}}}}\n"
                          "grid: {norm.placement: [post, pre], norm.kind: [layernorm, rmsnorm]}\n"
                          f"seeds: {list(range(seeds))}\n")
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "normexp", "sweep", str(config), "--out", str(Path(tmp) / "out"),
                        "--engine", engine, "--quiet"], check=True, cwd=REPO)
        return time.perf_counter() - start


def rss_of_big_grid(n_runs: int) -> float:
    """Peak RSS (MB) of a child process that trains `n_runs` article-sized runs (2 steps) batched."""
    code = (
        "import resource\n"
        "from normexp.config import RunConfig\n"
        "from normexp.engines.batched import plan_batches, stack_nets, train_batch\n"
        f"runs = [RunConfig.model_validate({{'train': {{'steps': 2}}, 'seed': s}}) for s in range({n_runs})]\n"
        "batches, alone = plan_batches(runs)\n"
        "assert not alone\n"
        "for batch in batches:\n"
        "    train_batch(batch)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, len(batches))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    return float(out[0]), int(out[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="4 seeds per variant; skip the end-to-end and 4096-run checks")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    seeds = 4 if args.quick else 16
    runs = grid(seeds)
    model_steps = len(runs) * (runs[0].train.steps + 1)
    print(f"CPU: {cpu_summary()}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores; "
          f"grid: {len(runs)} runs x {runs[0].train.steps + 1} steps (post/pre x layernorm/rmsnorm x {seeds} seeds)")

    times: dict[str, list[float]] = {"reference": [], "batched": []}
    rss: dict[str, float] = {}
    time_batched(grid(2, steps=2))  # warm-up: first-call costs stay out of the numbers
    for _ in range(args.repeats):
        for engine, run in (("reference", time_reference), ("batched", time_batched)):
            reset_peak_rss()
            times[engine].append(run(runs))
            rss[engine] = max(rss.get(engine, 0.0), peak_rss_mb())
    ms = {e: statistics.median(t) / model_steps * 1e3 for e, t in times.items()}
    print(f"\n{'engine':<10} {'ms/model-step':>14} {'speed-up':>9} {'peak RSS MB':>12}")
    for engine in ("reference", "batched"):
        print(f"{engine:<10} {ms[engine]:>14.3f} {ms['reference'] / ms[engine]:>8.2f}x {rss[engine]:>12.0f}")

    flops = model_flops(runs[0])
    big = matmul_gflops((1, 1024, 1024, 1024), repeats=5)
    toy = matmul_gflops((64, 64, 32, 128))
    print(f"\nmachine limit: {flops / 1e6:.1f} MFLOP per model-step; matmul {big:.0f} GFLOP/s at 1024^3, "
          f"{toy:.0f} GFLOP/s at the toy's (64 runs x 64x32 @ 32x128)")
    for engine in ("reference", "batched"):
        achieved = flops / (ms[engine] / 1e3) / 1e9
        print(f"  {engine:<10} {achieved:6.1f} GFLOP/s achieved = {achieved / big:.0%} of the large-matmul rate; "
              f"floor at that rate {flops / big / 1e6:.3f} ms/model-step, at the toy-bmm rate {flops / toy / 1e6:.3f}")
    if args.quick:
        return
    print("\nloss change from rounding alone (max |delta| over every run and step, vs the reference engine):")
    reference = [train_run(cfg).losses for cfg in runs]
    for variant in ("fused-adam", "1-thread"):
        print(f"  {variant:<11} {max_loss_change(runs, reference, variant):.3g}")

    print("\nnormexp sweep end to end (fresh process, writes included); fixed = the same sweep with 0 steps:")
    wall = {engine: sweep_seconds(engine, seeds) for engine in ("reference", "batched")}
    fixed = {engine: sweep_seconds(engine, seeds, steps=0) for engine in ("reference", "batched")}
    for engine, seconds in wall.items():
        print(f"  --engine {engine:<10} {seconds:7.2f} s   fixed {fixed[engine]:5.2f} s   "
              f"training {(seconds - fixed[engine]) / model_steps * 1e3:6.3f} ms/model-step")
    print(f"  speed-up {wall['reference'] / wall['batched']:.2f}x")
    floor_s = model_steps * flops / toy / 1e9
    adam_s = model_steps * adam_ms_per_model_step(runs[0]) / 1e3
    print(f"  best cases for batched training: free {wall['reference'] / fixed['batched']:.2f}x; "
          f"only its matmuls, at the toy-bmm rate ({floor_s:.2f} s) "
          f"{wall['reference'] / (fixed['batched'] + floor_s):.2f}x; those plus torch's Adam step "
          f"({adam_s:.2f} s) {wall['reference'] / (fixed['batched'] + floor_s + adam_s):.2f}x")
    mb, chunks = rss_of_big_grid(4096)
    print(f"\n4096-run grid, batched in {chunks} chunks: peak RSS {mb:.0f} MB")


if __name__ == "__main__":
    main()
