"""normexp: where and which normalization makes a deep residual network trainable without warmup.

Reproduces the Post-LN / Pre-LN, LayerNorm / RMSNorm toy study bit for bit, then sweeps every axis
of it from YAML. See README.md for the file map and shared/SPEC.md for the design.

Importing normexp before torch (the command, its workers, the benchmarks do) sets three threading
defaults where the environment leaves them unset; none changes a result; they keep the speed from
depending on the machine's load:
- `MKL_DYNAMIC=FALSE`: MKL may otherwise run a call on fewer threads than torch's count, on its own
  judgement (Intel lists this "dynamic" mode among its causes of run-to-run differences); the exact
  engines promise the same bits for the same thread count.
- `OMP_WAIT_POLICY=PASSIVE` with `GOMP_SPINCOUNT=2000`: an idle OpenMP thread spins briefly (2,000
  pause loops, tens of microseconds: the gap between a step's parallel regions), then sleeps. Spinning
  long starves the thread that holds the work on a machine that other work loads (torch's default, a
  300,000-loop spin: a 2-thread run of the article's model took 15-99 s instead of 1.1 s); sleeping at
  once makes every parallel region wait for a wake-up, which on a virtual machine can cost more than
  the work (an Intel Xeon VM, 2 threads: 30 ms per model-step asleep at once, 8 ms after a short spin,
  7 ms with 1 thread; 25 ms under a full load of other work, 16 ms asleep at once, 86 ms after a
  10,000-loop spin: docs/performance.md). GOMP_SPINCOUNT is set only where neither it nor
  OMP_WAIT_POLICY is: a policy the user chose is theirs.
"""

import os

if not os.environ.get("OMP_WAIT_POLICY") and not os.environ.get("GOMP_SPINCOUNT"):
    os.environ["GOMP_SPINCOUNT"] = "2000"  # libgomp: overrides the policy's spin count (PASSIVE alone: none)
for _variable, _value in (("MKL_DYNAMIC", "FALSE"), ("OMP_WAIT_POLICY", "PASSIVE")):
    if not os.environ.get(_variable):  # unset or empty: the library's own default
        os.environ[_variable] = _value

__version__ = "0.1.0"
