"""Configs: one run's typed config, a sweep file, YAML loading, `--set` overrides and grid expansion.

YAML stops here. Everything past this package receives validated pydantic objects
(`RunConfig` and its sections), never dicts:

- `schema.py`: the run's sections (model, norm, train) and `RunConfig`; every section forbids
  unknown keys and validates strictly (no "32" -> 32, no true -> 1); keys a run does not use go back to
  their default; which keys fit which architecture.
- `optimizer.py`: the optimizer's and the schedule's sections (`optim`, `schedule`) and their rules.
- `fields.py`: what the sections are made of: the strict section base, the number types, the rule that
  puts an unused key back to its default.
- `data.py`: the data section (`DataConfig`): the tasks, the sequence tasks' shapes (`sequence_shape`), the
  text task's keys.
- `grid.py`: the sweep file (`SweepFile`), `--set` overrides, and the expansion to runs: the Cartesian
  product of the grid axes (in file order, with `--set` axes replacing or appending), seeds innermost.
- `loader.py`: YAML read with a safe loader that also rejects duplicate keys and keys that are not
  strings, and reads `1e-3` as a float (YAML 1.2), as users expect.
- `errors.py`: every error is a `ConfigError` whose message names the key path
  (`base.optim.lr: must be > 0`) and, for a typo, the closest valid key. The CLI prints it and exits 2.

Import from `normexp.config`: the names below are its interface.
"""

from normexp.config.data import (
    DEFAULT_SEQ_LEN,
    SEQUENCE_TASKS,
    TEXT_BATCH_SIZE,
    TEXT_TASKS,
    TRANSFORMER_TASKS,
    DataConfig,
    SequenceShape,
    TaskName,
    sequence_shape,
)
from normexp.config.errors import MAX_ERROR_LINES, ConfigError, TooManyRuns
from normexp.config.grid import DEFAULT_MAX_RUNS, Sweep, SweepFile, build_sweep, load_sweep, parse_set
from normexp.config.loader import (
    MAX_YAML_NODES,
    PACKAGED_CONFIGS,
    SYMLINK_LOOP,
    is_symlink_loop,
    packaged_config,
    parse_yaml,
    read_mapping,
)
from normexp.config.optimizer import OptimName, ScheduleKind
from normexp.config.schema import (
    ACTS_ONLY_UNDER,
    ACTS_ONLY_UNDER_BY_SECTION,
    ARCH_ONLY,
    GENERIC_LEAVES,
    METRIC_COLUMNS,
    METRICS,
    STOP_REASONS,
    TRAINED_FRACTION,
    TRANSFORMER_ONLY,
    VAL_COLUMNS,
    Z_LOSS_COLUMN,
    Activation,
    Arch,
    Init,
    Metric,
    ModelConfig,
    NormConfig,
    NormKind,
    OptimConfig,
    Placement,
    ReportConfig,
    RunConfig,
    ScheduleConfig,
    TrainConfig,
    arch_problem,
    chance_classes,
    flatten,
    inert_keys,
    key_label,
    load_run_config,
    mixln_post_count,
    run_keys,
    section_cache,
    trained_threshold,
    validate_run,
)

__all__ = [
    "ACTS_ONLY_UNDER", "ACTS_ONLY_UNDER_BY_SECTION", "ARCH_ONLY", "DEFAULT_MAX_RUNS", "DEFAULT_SEQ_LEN",
    "GENERIC_LEAVES", "MAX_ERROR_LINES", "MAX_YAML_NODES", "METRICS", "METRIC_COLUMNS", "SEQUENCE_TASKS",
    "PACKAGED_CONFIGS", "STOP_REASONS", "TEXT_BATCH_SIZE", "TEXT_TASKS", "TRANSFORMER_ONLY", "TRANSFORMER_TASKS",
    "Activation", "SequenceShape",
    "SYMLINK_LOOP", "TRAINED_FRACTION", "VAL_COLUMNS", "Z_LOSS_COLUMN", "Arch", "ConfigError", "DataConfig",
    "Init", "Metric",
    "ModelConfig", "NormConfig", "NormKind", "OptimConfig", "OptimName", "Placement", "ReportConfig",
    "RunConfig", "ScheduleConfig", "ScheduleKind", "Sweep", "SweepFile", "TaskName", "TooManyRuns",
    "TrainConfig", "arch_problem", "chance_classes", "build_sweep", "flatten", "inert_keys", "is_symlink_loop",
    "key_label", "load_run_config", "load_sweep", "mixln_post_count", "packaged_config", "parse_set", "parse_yaml",
    "read_mapping",
    "run_keys", "section_cache", "sequence_shape", "trained_threshold", "validate_run",
]
