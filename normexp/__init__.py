"""normexp: where and which normalization makes a deep residual network trainable without warmup.

Reproduces the Post-LN / Pre-LN, LayerNorm / RMSNorm toy study bit for bit, then sweeps every axis
of it from YAML. See README.md for the file map and shared/SPEC.md for the design.

Importing normexp before torch (the command, its workers, the benchmarks do) sets two threading
defaults where the environment leaves them unset; neither changes a result, both keep it from
depending on the machine's load:
- `MKL_DYNAMIC=FALSE`: MKL may otherwise run a call on fewer threads than torch's count, on its own
  judgement (Intel lists this "dynamic" mode among its causes of run-to-run differences); the exact
  engines promise the same bits for the same thread count.
- `OMP_WAIT_POLICY=PASSIVE`: idle OpenMP threads sleep instead of spinning. On a machine that other
  work also loads, spinning threads starve the thread that holds the work: a 2-thread run of the
  article's model took 15-99 s instead of 1.1 s (the work is split the same way either way).
"""

import os

for _variable, _value in (("MKL_DYNAMIC", "FALSE"), ("OMP_WAIT_POLICY", "PASSIVE")):
    if not os.environ.get(_variable):  # unset or empty: the library's own default
        os.environ[_variable] = _value

__version__ = "0.1.0"
