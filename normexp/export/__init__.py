"""`normexp export DIR DEST --to TARGET`: a sweep folder's verified runs (runs.py reads them; the folder is
only read), for browsing and comparing in the tools researchers already use: one module per target
(tensorboard.py, mlflow.py, wandb.py: W&B offline runs, parquet.py: tables for pandas and SQL). A run exported
before that no longer verifies has its export removed, and named. Each target's module imports its tool's
package only when it runs.
"""

from __future__ import annotations

from normexp.export.runs import ExportedRun, ExportResult, read_folder, read_runs

TARGETS = ("tensorboard", "mlflow", "wandb", "parquet")

__all__ = ["TARGETS", "ExportResult", "ExportedRun", "read_folder", "read_runs"]
