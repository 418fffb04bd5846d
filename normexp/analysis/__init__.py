"""What a result means, as numbers: pure pandas and statistics, never torch, rich or matplotlib.

- `variants`: which runs form a variant and its label, when a run counts as trained, which engines
  trained a folder's runs;
- `sensitivity`: LR sensitivity (Wortsman et al. 2023) per variant;
- `gradnorm`: the per-block and per-layer gradient-norm summaries at init (Xiong et al. 2020);
- `finals`: each run's final value, trained or not, stopped early or not, and which axes are numbers (what
  the figures and the report read of each run);
- `realtext`: the real-text warmup study's verdict: the unigram floor, warmup's rescue of Post-LN, Pre-LN's
  indifference to warmup.

Presentation (`normexp.report`, `normexp.tables`, `normexp.figures`) renders what these compute.
"""
