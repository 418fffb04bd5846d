"""normexp: where and which normalization makes a deep residual network trainable without warmup.

Reproduces the Post-LN / Pre-LN, LayerNorm / RMSNorm toy study bit for bit, then sweeps every axis
of it from YAML. See README.md for the file map and shared/SPEC.md for the design.

Importing normexp changes nothing of its importer's: the threading defaults its own processes run with
are set where they start (`environment.set_thread_defaults`).
"""

__version__ = "0.1.0"
