"""What a result means, as numbers: pure pandas and statistics, never torch, rich or matplotlib.

- `variants`: which runs form a variant and its label, when a run counts as trained, which engines
  trained a folder's runs;
- `sensitivity`: LR sensitivity (Wortsman et al. 2023) per variant;
- `gradnorm`: the per-block and per-layer gradient-norm summaries at init (Xiong et al. 2020);
- `finals`: each run's row at its last step, judged by the trained rule (what the report reads of each run).

Presentation (`normexp.report`, `normexp.tables`, `normexp.plot`) renders what these compute.
"""
