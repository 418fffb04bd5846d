"""The compiled phase-grid step's kernels, one at a time: its six matmuls in the layout the step calls them
and in the other, and its Adam update, each in cache and out of it (docs/performance.md, "The step's memory").

One thread. A compiled batch (`COMPILED_CHUNK` runs: 8; 16 before 19b3fbe, when docs/performance.md's "The step's
memory" was measured) of the phase grid's toy (width 32, hidden 128, 64 samples): "in cache" repeats one
call on the same operands; "out of cache" cycles through 24 layers' operands with an L2-sized write between
calls (that write's own time subtracted), as a step meets them, and for Adam through 48 tensors' parameters,
gradients and moments (25 MB at 8 runs). Microseconds per call, best of 5 rounds.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from normexp.engines.fast import COMPILED_CHUNK
from normexp.environment import cpu_summary

RUNS, SAMPLES, WIDTH, HIDDEN, LAYERS = COMPILED_CHUNK, 64, 32, 128, 24
EVICT_FLOATS = 400_000  # the write between two calls: 1.6 MB, about an L2 (what it was at 16 runs), whatever RUNS is
Call = Callable[[], object]


def best_us(calls: list[Call], repeats: int) -> float:
    for call in calls:
        call()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            for call in calls:
                call()
        best = min(best, (time.perf_counter() - start) / repeats / len(calls))
    return best * 1e6


def in_and_out_of_cache(make: Callable[[], Call], sets: int = LAYERS, evict_between: bool = True
                        ) -> tuple[float, float]:
    """One call repeated on the same operands, then `sets` calls' operands cycled through (with an L2-sized
    write between calls where `evict_between`)."""
    calls = [make() for _ in range(sets)]
    if not evict_between:
        return best_us(calls[:1], 300), best_us(calls, 20)
    evict = [torch.randn(EVICT_FLOATS) for _ in range(sets)]
    cycled = [lambda c=c, e=e: (e.mul_(1.0), c()) for c, e in zip(calls, evict)]
    eviction = best_us([lambda e=e: e.mul_(1.0) for e in evict], 5)
    return best_us(calls[:1], 300), best_us(cycled, 5) - eviction


def product(a: tuple[int, int], a_t: bool, b: tuple[int, int], b_t: bool) -> Callable[[], Call]:
    """A maker of one batched product of operands stored (RUNS, *a) and (RUNS, *b), each used transposed
    where its flag says so (a view: the layout MKL is handed)."""
    def make() -> Call:
        x, y = torch.randn(RUNS, *a), torch.randn(RUNS, *b)
        x, y = (x.transpose(1, 2) if a_t else x), (y.transpose(1, 2) if b_t else y)
        return lambda: torch.bmm(x, y)
    return make


def matmuls() -> None:
    n, d, h = SAMPLES, WIDTH, HIDDEN
    products = {  # name: (as the step calls it, the other layout); weights stored (out, in) as nn.Linear's
        "forward x @ W1^T": (product((n, d), False, (h, d), True), product((n, d), False, (d, h), False)),
        "forward h @ W2^T": (product((n, h), False, (d, h), True), product((n, h), False, (h, d), False)),
        "dW1 = dH^T @ x": (product((n, h), True, (n, d), False), product((n, d), True, (n, h), False)),
        "dW2 = dY^T @ h": (product((n, d), True, (n, h), False), product((n, h), True, (n, d), False)),
        "dx = dH @ W1": (product((n, h), False, (h, d), False), product((n, h), False, (d, h), True)),
        "dh = dY @ W2": (product((n, d), False, (d, h), False), product((n, d), False, (h, d), True)),
    }
    print(f"the step's matmuls, {RUNS} runs a call, us in cache / out of cache:")
    print(f"  {'product':<20} {'as the step calls it':>22} {'the other layout':>22}")
    sums = [0.0, 0.0, 0.0]
    for name, (called, other) in products.items():
        a, b = in_and_out_of_cache(called), in_and_out_of_cache(other)
        sums[0], sums[1], sums[2] = sums[0] + a[0], sums[1] + b[0], sums[2] + a[1]
        print(f"  {name:<20} {a[0]:9.1f} / {a[1]:8.1f}   {b[0]:9.1f} / {b[1]:8.1f}")
    print(f"  in cache, a layer's six: {sums[0]:.0f} us as called, {sums[1]:.0f} us in the other layouts")
    flops = 6 * 2 * SAMPLES * WIDTH * HIDDEN * LAYERS  # per run per model-step: 24 layers' six products
    print(f"  the matmul floor per run and model-step ({LAYERS} layers, {flops / 1e6:.1f} MFLOP): "
          f"{sums[0] * LAYERS / RUNS / 1e3:.3f} ms in cache ({flops * RUNS / (sums[0] * LAYERS) / 1e3:.0f} GFLOP/s), "
          f"{sums[2] * LAYERS / RUNS / 1e3:.3f} ms out of cache")


def adam() -> None:
    def update(p, g, m, v, lr, b1, b2, eps, wd, c2):
        g = g + wd * p
        m.lerp_(g, 1 - b1)
        v.mul_(b2).add_((1 - b2) * g * g)
        p.sub_(lr * m / (v.sqrt() / c2 + eps))

    def moments_only(p, g, m, v, lr, b1, b2, eps, wd, c2):
        g = g + wd * p
        m.lerp_(g, 1 - b1)
        v.mul_(b2).add_((1 - b2) * g * g)

    hypers = [torch.rand(RUNS, 1) * 0.01 for _ in range(6)]
    print(f"\nAdam on one {RUNS} x {WIDTH * HIDDEN} stacked tensor (compiled), us in cache / out of cache:")
    for name, fn in (("the update", update), ("the moments alone", moments_only)):
        compiled = torch.compile(fn, dynamic=False)

        def make(compiled: Callable = compiled) -> Call:
            p, g, m, v = (torch.randn(RUNS, WIDTH * HIDDEN) for _ in range(4))
            v.abs_()
            return lambda: compiled(p, g, m, v, *hypers)
        inside, outside = in_and_out_of_cache(make, sets=48, evict_between=False)
        print(f"  {name:<20} {inside:9.1f} / {outside:8.1f}")


def main() -> None:
    torch.set_num_threads(1)
    print(f"CPU: {cpu_summary()}")
    print(f"torch {torch.__version__}, 1 thread")
    matmuls()
    adam()


if __name__ == "__main__":
    main()
