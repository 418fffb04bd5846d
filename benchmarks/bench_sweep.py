"""The main job against the code it reproduces: `normexp sweep configs/warmup.yaml` end to end vs the
article's own script (tests/article_toy.py training the same four runs), in fresh processes.

    python benchmarks/bench_sweep.py                  # or: make bench
    python benchmarks/bench_sweep.py --repeats 9
    python benchmarks/bench_sweep.py --also OLD_CHECKOUT   # a third side: another checkout's normexp

Each repeat starts one fresh process per side, the sides in turn (so both see the same machine
state); the headline is the median over repeats of each pair's ratio, and the sweep's target is at
most 0.6x the article script's time.
Both sides print their losses; the sweep writes its run folders and prints its table as a user sees
it (into a temporary folder, `--force`). The load average is printed next to the figures, since other
work on the machine slows both sides. Both sides run with the threading defaults normexp sets
(OMP_WAIT_POLICY, MKL_DYNAMIC): under load, a spinning OpenMP default would slow the article side alone.
Nothing here asserts a number.
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

from normexp.environment import cpu_summary, set_thread_defaults

set_thread_defaults()  # torch's threading defaults in os.environ, which both sides inherit

REPO = Path(__file__).resolve().parents[1]
TARGET = 0.6

# The article's script: its four runs (Post/Pre x LN/RMS, depth 32, width 32, Adam 0.01, 30 steps), printed.
ARTICLE_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from article_toy import train_losses
for placement in ("Post", "Pre"):
    for kind in ("LN", "RMS"):
        losses = train_losses(placement, kind, 32, 32, 30, 0.01)
        print(placement, kind, " ".join(f"{{losses[s]:.4f}}" for s in (0, 1, 2, 3, 5, 10, 20, 30)))
"""


def commands(out_dir: Path, also: Path | None) -> dict[str, tuple[list[str], dict[str, str], Path]]:
    """Each side's command line, environment and working folder."""
    env = dict(os.environ)  # normexp's threading defaults included: both sides wait and thread alike
    sweep = [sys.executable, "-m", "normexp", "sweep", str(REPO / "configs" / "warmup.yaml"), "--force"]
    sides = {
        "article script": ([sys.executable, "-c", ARTICLE_SCRIPT.format(tests=str(REPO / "tests"))], env, REPO),
        "normexp sweep": ([*sweep, "--out", str(out_dir / "sweep")], env, REPO),
    }
    if also is not None:  # run from that checkout: `python -m` puts the working folder first on sys.path
        also = also.resolve()
        sides[f"normexp sweep ({also})"] = ([*sweep, "--out", str(out_dir / "also")],
                                            {**env, "PYTHONPATH": str(also)}, also)
    return sides


def time_once(command: list[str], env: dict[str, str], cwd: Path) -> float:
    start = time.perf_counter()
    subprocess.run(command, env=env, cwd=cwd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per side (median)")
    parser.add_argument("--also", type=Path, help="a checkout whose normexp runs as a third side")
    args = parser.parse_args()
    print(f"CPU: {cpu_summary()}")
    with tempfile.TemporaryDirectory() as tmp:
        sides = commands(Path(tmp), args.also)
        times: dict[str, list[float]] = {name: [] for name in sides}
        load_before = os.getloadavg()[0]
        for _ in range(args.repeats):
            for name, (command, env, cwd) in sides.items():
                times[name].append(time_once(command, env, cwd))
        load_after = os.getloadavg()[0]
    article = statistics.median(times["article script"])
    print(f"both sides with OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, MKL_DYNAMIC={os.environ['MKL_DYNAMIC']}")
    print(f"configs/warmup.yaml end to end, fresh processes, {args.repeats} alternated repeats "
          f"(load average {load_before:.1f} -> {load_after:.1f} on {os.cpu_count()} CPUs)")
    for name, values in times.items():
        median = statistics.median(values)
        spread = f"{min(values):.2f}-{max(values):.2f}"
        print(f"  {name:<32} median {median:6.2f} s  (range {spread} s)  {median / article:5.2f}x the article's")
    # the ratio of each repeat's pair (measured moments apart), then their median: robust to load that varies
    ratio = statistics.median(s / a for s, a in zip(times["normexp sweep"], times["article script"]))
    print(f"target: normexp sweep <= {TARGET}x the article script: {'met' if ratio <= TARGET else 'NOT met'} "
          f"({ratio:.2f}x)")


if __name__ == "__main__":
    main()
