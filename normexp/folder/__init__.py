"""The run-folder contract (SPEC §6): what a sweep folder holds, how it is written, and whether a run in it
can be trusted.

    layout.py      the files' names and texts (done.json's encoding), what is not normexp's, RunState
    atomic.py      atomic writes: a file is the old one or all of the new, never half
    ids.py         a run's id: its config hashed, stable across releases
    verified.py    .verified.json: what passed, and `checks_version`, whose checks wrote it
    inspect.py     inspect_run and verified_states: whether a run folder can be trusted
    write.py       a run folder written aside and swapped in whole; strays tidied; stamping
    sweepfiles.py  sweep.yaml, history.jsonl, summary.csv; the runs a folder holds
    lock.py        the folder's lock, exclusive or shared by shards

Each file imports only those above it. The rest of normexp imports the names below from `normexp.folder`;
`normexp.results` is the public API for reading a folder.
"""

from normexp.folder.atomic import atomic_write, synced_together
from normexp.folder.ids import is_run_id, run_id, superseded_problem
from normexp.folder.inspect import inspect_run, other_threads, read_text, verified_states
from normexp.folder.layout import (
    BLOCKS_FILE,
    CONFIG_FILE,
    DONE_FILE,
    FAILED_FILE,
    FINISHED_STATUSES,
    HISTORY_FILE,
    IN_THE_WAY_REMEDY,
    METRICS_FILE,
    SHARPNESS_FILE,
    SUMMARY_FILE,
    SWEEP_FILE,
    VOUCHED_FILES,
    InTheWay,
    RunState,
    StoreError,
    foreign_entries,
    in_the_way,
    not_normexp_s,
    out_folder_problem,
)
from normexp.folder.lock import SweepLock, folder_writes, lock_owner
from normexp.folder.sweepfiles import (
    HISTORY_DAMAGE_EFFECT,
    append_history,
    cached_statuses,
    folder_run_ids,
    folder_runs,
    history_damage,
    read_history,
    read_sweep,
    rows_csv,
    summary_csv,
    summary_rows,
    superseded_folder,
    sweep_name,
    sweep_yaml,
    trained_rule,
    write_summary,
)
from normexp.folder.write import (
    FinishedRun,
    recover_strays,
    remove_run_folder,
    staged,
    stamp_run,
    stray_paths,
    swap_in,
    write_failed,
    write_run,
)

__all__ = [
    "BLOCKS_FILE", "CONFIG_FILE", "DONE_FILE", "FAILED_FILE", "FINISHED_STATUSES",
    "HISTORY_DAMAGE_EFFECT", "HISTORY_FILE",
    "IN_THE_WAY_REMEDY", "METRICS_FILE", "SHARPNESS_FILE", "SUMMARY_FILE", "SWEEP_FILE", "VOUCHED_FILES",
    "FinishedRun", "InTheWay", "RunState", "StoreError", "SweepLock",
    "append_history", "atomic_write", "cached_statuses", "folder_run_ids", "folder_runs", "folder_writes",
    "foreign_entries", "history_damage", "in_the_way", "inspect_run", "is_run_id", "lock_owner", "not_normexp_s",
    "other_threads",
    "out_folder_problem", "read_history", "read_sweep", "read_text", "recover_strays", "remove_run_folder",
    "rows_csv", "run_id", "stamp_run", "staged", "stray_paths", "summary_csv", "summary_rows",
    "superseded_folder", "superseded_problem", "swap_in", "sweep_name", "sweep_yaml", "synced_together",
    "trained_rule", "verified_states", "write_failed", "write_run", "write_summary",
]
