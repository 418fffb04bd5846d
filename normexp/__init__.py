"""normexp: where and which normalization makes a deep residual network trainable without warmup.

Reproduces the Post-LN / Pre-LN, LayerNorm / RMSNorm toy study bit for bit, then sweeps every axis
of it from YAML. See README.md for the file map and shared/SPEC.md for the design.

Importing normexp before torch makes torch's OpenMP threads sleep when idle instead of spinning
(`OMP_WAIT_POLICY=PASSIVE`, unless the environment sets another policy): on a machine that other work also
loads, spinning threads starve the thread that holds the work, and a 2-thread run took 15-99 s
instead of 1.1 s. The policy changes no result (the work is split the same way), only who waits how.
"""

import os

if not os.environ.get("OMP_WAIT_POLICY"):  # unset or empty: OpenMP's default, spinning
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

__version__ = "0.1.0"
