"""The studies shipped with the package (normexp/configs/, a checkout's configs/): run them all and write
runs/REPORT.md (`make studies`), and beside it REPORT.html, the same as one self-contained page.

    normexp studies [NAME]... [--out runs] [--quick] [--list]   (python -m normexp.studies: the same command)

Each study states its question, shows its table and figure, and ends with a verdict paragraph that
is computed from the numbers it just measured (nothing in a verdict is written in advance):

1. the article's table (configs/warmup.yaml);
2. learning rate x warmup per placement (configs/studies/lr_warmup.yaml);
3. depth 2..64 (configs/studies/depth.yaml);
4. every placement x norm kind (configs/studies/placements.yaml);
4b. learning-rate sensitivity of every placement, with and without warmup (configs/studies/lr_sensitivity.yaml);
5. Xiong et al.'s gradients and hidden-state norms at init (configs/studies/gradnorm.yaml);
5b. Xiong et al.'s warmup question on the tiny causal Transformer, assoc_recall
   (configs/studies/transformer_warmup.yaml, fast engine);
5c. the same question on real text, Shakespeare by character: Post / Pre / Peri-LN x depth 6, 12 x lr x warmup
   (configs/studies/realtext_warmup.yaml, fast engine; run when named, `normexp studies realtext_warmup`:
   its full grid is hours of runs, its --quick set minutes);
6. per-block dynamics over the first steps, Post-LN vs Pre-LN with and without warmup
   (configs/studies/blocks.yaml, `train.log_blocks`);
6b. Wortsman et al. 2023's instabilities on the tiny Transformer: qk-norm and the z-loss x Pre / Post /
   Peri-LN x LayerNorm / DyT x lr 1e-4..1, LR sensitivity, attention logits and log Z
   (configs/studies/instabilities.yaml, `train.log_blocks`);
6c. why warmup rescues Post-LN: warmup, clipping, AGC, T-Fixup, Adam-2k, large epsilon, GI-Adam, both RAdams,
   Pre-LN as control, across lrs, with sharpness (configs/studies/warmup_explanations.yaml, one sweep per row:
   explanations.py);
7. the RMSNorm facts of shared/seeds/001 (`normexp norms props`) and the norm speed table.

Sweeps resume: a second `make studies` only rewrites the report. Verdicts count verified runs only;
a study with runs missing, failed or corrupt says which under its verdict.

run.py runs them and writes the report; verdicts.py computes the verdicts (explanations.py: the
warmup_explanations study's rows, table, figure and verdict); figures.py draws the studies'
own figures. The command line is `normexp studies` (normexp/commands/tools.py); __main__.py hands
`python -m normexp.studies` to it. Nothing is imported here: `python -m normexp.studies` loads this first.
"""
