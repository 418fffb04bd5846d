"""The commands of `normexp`, one module per group; normexp/cli.py registers them on its app.

console.py: the two consoles, `fail`, `show` and the option checks every command shares;
sweep.py: `sweep` (run here or launch a job array) and `validate`; read.py: the commands that read a
sweep's folder (`report`, `plot`, `verify`, `export`, `merge`); tools.py: `gradnorm`, `norms`, `studies`,
`doctor`.
"""
