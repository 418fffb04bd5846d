"""The studies shipped with the package (normexp/configs/, a checkout's configs/): run them all and write
runs/REPORT.md (`make studies`), and beside it REPORT.html, the same as one self-contained page.

    normexp studies [--out runs] [--quick]        (python -m normexp.studies: the same)

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
6. per-block dynamics over the first steps, Post-LN vs Pre-LN with and without warmup
   (configs/studies/blocks.yaml, `train.log_blocks`);
6b. Wortsman et al. 2023's instabilities on the tiny Transformer: qk-norm and the z-loss x Pre / Post /
   Peri-LN x LayerNorm / DyT x lr 1e-4..1, LR sensitivity, attention logits and log Z
   (configs/studies/instabilities.yaml, `train.log_blocks`);
7. the RMSNorm facts of shared/seeds/001 (`normexp norms props`) and the norm speed table.

Sweeps resume: a second `make studies` only rewrites the report. Verdicts count verified runs only;
a study with runs missing, failed or corrupt says which under its verdict.
"""

from __future__ import annotations

import os
import signal

from normexp import stopping

if __name__ == "__main__":  # python -m normexp.studies: a stop signal while the modules below load (pandas,
    # pydantic: about a second) ends the process at once, with one line and 128 + signal, not a traceback
    def _exit_at_once(signum: int, frame: object) -> None:
        os.write(2, f"{signal.Signals(signum).name}: studies stopped before anything was written\n".encode())
        os._exit(128 + signum)

    stopping.on_stop_signals(_exit_at_once)

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import pandas as pd

from normexp.analysis.sensitivity import build_sensitivity, sensitivity_engines
from normexp.analysis.variants import PLACEMENT_LABELS, is_trained, n_choices, thresholds, variant_groups, variant_label
from normexp.config import ConfigError, Sweep, load_sweep
from normexp.environment import set_thread_defaults
from normexp.executors import usable_cores
from normexp.folder import StoreError, lock_owner, out_folder_problem
from normexp.report import build_report, to_markdown
from normexp.results import Folder, as_folder, finished_runs, load_folder, missing_note, varying_keys
from normexp.sweep import SweepInterrupted, SweepOptions, refuse_another_sweep, run_sweep
from normexp.tables import gradnorm_to_markdown, properties_to_markdown, sensitivity_to_markdown, speed_to_markdown

CONFIGS = Path(__file__).resolve().parent / "configs"  # package data: a checkout's configs/ links here


def _finished_summary(source: Path | Folder) -> pd.DataFrame:
    """The summary rows of the study's verified runs: a missing or corrupt run enters no verdict, nor
    does a run another invocation added to the folder (a study judges its own grid)."""
    return finished_runs(as_folder(source).latest).copy()


def _trained(summary: pd.DataFrame) -> pd.Series:
    """Per run, trained by the folder's rule (summary's `threshold`: its report.trained_below, else ln(C)/10)."""
    threshold = summary["threshold"].astype(float) if "threshold" in summary else None
    return is_trained(summary["final_loss"], summary["status"], n_choices(summary), threshold)


def _judged(source: Path | Folder) -> pd.DataFrame:
    """The summary with `trained` per run, and the final loss of diverged runs blanked, so that no mean
    loss in a verdict mixes them in (`coverage` says how many there were)."""
    summary = _finished_summary(source)
    summary["trained"] = _trained(summary)
    summary["final_loss"] = summary["final_loss"].where(summary["status"] != "diverged")
    return summary


def coverage(summary: pd.DataFrame, keys: list[str]) -> str:
    """What a verdict covers: how many runs finished, how many seeds each cell has, and, per cell
    (`keys`), how many runs diverged (they count as not trained, and no mean loss includes them)."""
    finished = summary[summary["status"].isin(("completed", "diverged"))]
    seeds = summary["seed"].nunique()
    text = f"These figures cover {len(finished)} finished runs ({seeds} seed{'s' if seeds > 1 else ''} per cell)"
    if len(finished) < len(summary):
        text += f"; {len(summary) - len(finished)} runs did not finish and count as not trained"
    cells = []
    for label, group in variant_groups(finished, keys):
        diverged = int((group["status"] == "diverged").sum())
        if diverged:
            cells.append(f"{label}: {diverged} of {len(group)}")
    if not cells:
        return text + "; none diverged."
    return (text + f"; diverged runs ({', '.join(cells)}) count as not trained, and each mean final loss "
            "covers only the runs of its cell that did not diverge.")


# The speed table's big shape: the article's hidden size 4096 over 8 x 512 tokens (its (64, 512, 4096)
# takes 8x longer; `normexp norms bench` and `make bench` time that one).
SPEED_SHAPE = (8, 512, 4096)
# Workers for the studies' sweeps: one per usable core, at most 8 (each holds torch and a batch of up
# to ~1 GiB; the studies have ~10-100 batches each, so more would wait anyway).
MAX_STUDY_WORKERS = 8
FAST_STUDIES = ("transformer_warmup",)  # the Transformer: the exact engine would hand each run to the reference


# --quick per study where 2 seeds of the whole grid would still take minutes (default: seeds 0 and 1)
QUICK_SETS = {"warmup": [], "instabilities": ["seeds=0", "optim.lr=0.001,0.01,0.1,1.0"]}


def _spec(name: str, quick: bool) -> Sweep:
    config = CONFIGS / ("warmup.yaml" if name == "warmup" else f"studies/{name}.yaml")
    return load_sweep(config, QUICK_SETS.get(name, ["seeds=0,1"]) if quick else [])


def _sweep(name: str, spec: Sweep, out: Path) -> tuple[Path, int]:
    """Run (or resume) one study's sweep on a worker process per core (the studies' configs ask for
    one torch thread per run: their runs are small enough that N single-thread processes train more
    of them per second than one N-thread process). Return the folder and how many of its runs an
    earlier call had already finished."""
    workers = min(usable_cores(), MAX_STUDY_WORKERS)
    outcome = run_sweep(spec, out / name, SweepOptions(engine="fast" if name in FAST_STUDIES else "batched",
                                                       workers=workers if workers > 1 else None))
    return out / name, outcome.count("skipped")


def _figures(folder: Folder, x_key: str | None = None) -> list[str]:
    import matplotlib.pyplot as plt

    from normexp.figures import final_loss_figure, save_blocks_plot, save_plots, trained_fraction_figure

    run_dir = folder.path
    if run_dir.name == "instabilities":  # 24 designs x 9 lrs: one panel per design, not one line per variant
        return [str(p.relative_to(run_dir.parent)) for p in instabilities_figures(folder)]
    paths = save_plots(folder, run_dir / "loss.png")
    varying = varying_keys(folder.latest)
    if "norm.placement" in varying and "norm.kind" in varying:  # the placements study: where each pair trains
        fig = trained_fraction_figure(folder.latest, "norm.placement", "norm.kind", folder.trained_rule())
        fig.savefig(run_dir / "trained.png", dpi=150)
        plt.close(fig)
        paths.append(run_dir / "trained.png")
    if x_key:
        fig = final_loss_figure(folder.latest.copy(), x_key, folder.trained_rule())
        fig.savefig(run_dir / "final_loss.png", dpi=120)
        paths.append(run_dir / "final_loss.png")
    if run_dir.name == "blocks":
        paths += [save_blocks_plot(folder, metric=metric) for metric in BLOCKS_FIGURES]
    return [str(p.relative_to(run_dir.parent)) for p in paths]


# ----------------------------------------------------------------------------- verdicts


def article_verdict(source: Path | Folder) -> str:
    report = build_report(source, only_last=True)
    final = {c.label: c.cells[max(c.cells)][0] for c in report.columns}
    trained = {c.label: c.trained == c.runs > 0 for c in report.columns}
    post = [v for k, v in final.items() if k.startswith("Post")]
    pre = [v for k, v in final.items() if k.startswith("Pre")]
    post_trains = [trained[k] for k in final if k.startswith("Post")]
    pre_trains = [trained[k] for k in final if k.startswith("Pre")]
    if post_trains and pre_trains and not any(post_trains) and all(pre_trains):
        why = "where the norm sits decides whether the model trains"
    elif post_trains and pre_trains and all(post_trains) == all(pre_trains) and any(post_trains) == any(pre_trains):
        why = "here the placement does not decide it: both train alike"
    else:
        why = "the placement alone does not sort these columns into trained and not"
    steps = max(max(c.cells) for c in report.columns)
    return (f"{report.verdict_line()} After {steps} steps the Post-LN columns end at "
            f"{', '.join(f'{v:.4f}' for v in post)} (chance is ln 10 = 2.303) and the Pre-LN columns at "
            f"{', '.join(f'{v:.4f}' for v in pre)}: {why}; "
            f"LayerNorm vs RMSNorm changes the final loss by at most {max(_spread(post), _spread(pre)):.4f}.")


def _spread(values: list[float]) -> float:
    return max(values) - min(values) if values else math.nan


def lr_warmup_verdict(source: Path | Folder) -> str:
    summary = _judged(source)
    cells = summary.groupby(["norm.placement", "optim.lr", "schedule.warmup_steps"])["trained"].mean()
    parts = []
    for placement in summary["norm.placement"].unique():
        mine = cells[placement]
        lrs = []
        for lr in sorted(mine.index.get_level_values(0).unique()):
            ok = [int(w) for w, frac in mine[lr].items() if frac == 1.0]
            lrs.append(f"lr {lr:g}: " + ("every warmup" if len(ok) == len(mine[lr]) else
                                         f"warmup {', '.join(map(str, ok))}" if ok else "never"))
        n_ok = int((mine == 1.0).sum())
        parts.append(f"{PLACEMENT_LABELS.get(placement, placement)} trains in every seed in {n_ok} of {len(mine)} "
                     f"cells ({'; '.join(lrs)})")
    post = cells.get("post")
    pre = cells.get("pre")
    contrast = ""
    if post is not None and pre is not None:
        rescued = sorted({lr for (lr, w), frac in post.items() if frac == 1.0 and post.get((lr, 0), 0) < 1.0})
        lost = sorted({lr for (lr, _), frac in post.items() if not (post[lr] == 1.0).any()})  # no warmup helps
        if rescued:
            contrast = (" Warmup makes Post-LN train where it fails without warmup at "
                        f"{', '.join(f'lr {lr:g}' for lr in rescued)}")
            if lost and max(rescued) < min(lost):
                contrast += f", and only below the learning rates where no warmup of the grid helps ({lost[0]:g} up)"
            elif lost:
                contrast += f"; no warmup of the grid helps at {', '.join(f'lr {lr:g}' for lr in lost)}"
            contrast += "."
        pre_fail = [(lr, w) for (lr, w), frac in pre.items() if frac < 1.0]
        if pre_fail:
            contrast += (" Pre-LN fails only at " + ", ".join(f"lr {lr:g} with warmup {w}" for lr, w in pre_fail)
                         + ".")
    return ". ".join(parts) + "." + contrast + " " + coverage(
        summary, ["norm.placement", "optim.lr", "schedule.warmup_steps"])


def transformer_warmup_verdict(source: Path | Folder) -> str:
    """Per placement: the (lr, warmup) cells where every seed trains, where warmup rescues a learning
    rate that fails without it, and the held-out accuracy of the trained runs."""
    folder = as_folder(source)
    summary = _judged(folder)
    finals = folder.metrics(only_last=True).sort_values("step").groupby("run_id").tail(1).set_index("run_id")
    summary["val_acc"] = summary["run_id"].map(finals["val_acc"])
    keys = ["norm.placement", "optim.lr", "schedule.warmup_steps"]
    cells = summary.groupby(keys, sort=False)["trained"].mean()
    parts = []
    for placement in summary["norm.placement"].unique():
        mine = cells[placement]
        ok = [f"lr {lr:g} warmup {int(w)}" for (lr, w), frac in mine.items() if frac == 1.0]
        rescued = sorted({f"lr {lr:g}" for (lr, w), frac in mine.items()
                          if w > 0 and frac == 1.0 and mine.get((lr, 0), 1.0) < 1.0})
        hurt = sorted({f"lr {lr:g}" for (lr, w), frac in mine.items()
                       if w > 0 and frac < 1.0 and mine.get((lr, 0), 0.0) == 1.0})
        trained = summary[(summary["norm.placement"] == placement) & summary["trained"]]
        label = PLACEMENT_LABELS.get(placement, placement)
        text = (f"{label} trains in every seed in {len(ok)} of {len(mine)} cells"
                + (f" ({', '.join(ok)})" if ok else ""))
        text += f"; warmup rescues it at {', '.join(rescued)}" if rescued else "; warmup rescues it nowhere"
        text += f"; warmup stops it training in every seed at {', '.join(hurt)}" if hurt else ""
        if len(trained):
            text += f"; its trained runs reach held-out accuracy {trained['val_acc'].mean():.2f} on average"
        parts.append(text)
    return ". ".join(parts) + ". " + coverage(summary, keys)


def depth_verdict(source: Path | Folder) -> str:
    summary = _judged(source)
    by = summary.groupby(["norm.placement", "model.depth"]).agg(trained=("trained", "mean"),
                                                                 loss=("final_loss", "mean"))
    depths = sorted(summary["model.depth"].unique())
    parts = []
    for placement in ("post", "pre"):
        if placement not in by.index.get_level_values(0):
            continue
        mine = by.loc[placement]
        groups = {"in every seed": [d for d in depths if mine.loc[d, "trained"] == 1.0],
                  "in some seeds": [d for d in depths if 0.0 < mine.loc[d, "trained"] < 1.0],
                  "in no seed": [d for d in depths if mine.loc[d, "trained"] == 0.0]}
        said = [f"{how} at depth {', '.join(str(int(d)) for d in ds)}" for how, ds in groups.items() if ds]
        parts.append(f"{PLACEMENT_LABELS[placement]}-LN/RMS train " + "; ".join(said))
    gap = [by.loc[("post", d), "loss"] - by.loc[("pre", d), "loss"] for d in depths]
    trend = "grows" if gap[-1] > gap[0] + 0.1 else "does not grow"
    return (". ".join(parts) + f". The mean final-loss gap Post minus Pre {trend} with depth: "
            + ", ".join(f"{g:+.3f} at {d}" for d, g in zip(depths, gap)) + ". "
            + coverage(summary, ["norm.placement", "model.depth"]))


def placements_verdict(source: Path | Folder) -> str:
    summary = _judged(source)
    frac = summary.groupby(["norm.placement", "norm.kind"], sort=False)["trained"].mean().unstack("norm.kind")
    loss = summary.groupby(["norm.placement", "norm.kind"], sort=False)["final_loss"].mean().unstack("norm.kind")
    runs = summary.groupby("norm.placement", sort=False)["trained"].agg(["sum", "count"])
    lines = []
    for placement in frac.index:
        row = frac.loc[placement]
        good = [k for k in row.index if row[k] == 1.0]
        bad = [variant_label({"norm.kind": k}) for k in row.index if row[k] < 1.0]
        label = PLACEMENT_LABELS.get(placement, placement)
        share = f"{int(runs.loc[placement, 'sum'])} of {int(runs.loc[placement, 'count'])} runs train"
        if len(good) == len(row):
            lines.append(f"{label}: {share}, every kind in every seed")
        elif not good:
            lines.append(f"{label}: {share}, no kind in every seed")
        else:
            lines.append(f"{label}: {share}; {len(good)} of {len(row)} kinds in every seed (not {', '.join(bad)})")
    medians = loss.median(axis=1)
    typical = loss.sub(medians, axis=0).abs()
    trainable = [p for p in frac.index if (frac.loc[p] == 1.0).mean() >= 0.5]
    outliers = sorted({k for p in trainable for k in frac.columns if frac.loc[p, k] < 1.0})
    text = ("; ".join(lines) + ". "
            f"Across placements the median final loss spans {medians.max() - medians.min():.3f}; within a "
            f"placement the typical kind sits {typical.median().median():.4f} from its placement's median.")
    if outliers:
        text += (" Within the placements that train, the kind changes the outcome only for "
                 f"{', '.join(variant_label({'norm.kind': k}) for k in outliers)}")
        if "prmsnorm" in outliers:
            width = int(summary["model.width"].iloc[0])
            p = float(summary["norm.prms_fraction"].iloc[0])
            k = max(1, int(width * p))
            text += f" (pRMSNorm estimates the RMS from max(1, int({width} x {p:g})) = {k} features)"
        text += "."
    return text + " " + coverage(summary, ["norm.placement", "norm.kind"])


def lr_sensitivity_verdict(source: Path | Folder) -> str:
    """The ranking by LR sensitivity at each warmup, and whether warmup lowers each placement's."""
    every = build_sensitivity(source)
    rows = [r for r in every if not math.isnan(r.sensitivity)]
    undefined = [_variant(r) for r in every if math.isnan(r.sensitivity)]  # named below, never dropped unsaid
    # keyed by the whole variant but its warmup (placement, and any other varying key: no two variants merge)
    by = {(_variant(r), int(r.values.get("schedule.warmup_steps", 0))): r for r in rows}
    warmups = sorted({w for _, w in by})
    parts = []
    for w in warmups:
        ranked = sorted(((v, r) for (v, ww), r in by.items() if ww == w), key=lambda item: item[1].sensitivity)
        parts.append(f"Ranking by LR sensitivity {'without warmup' if w == 0 else f'with {w} warmup steps'} "
                     "(least sensitive first): " + ", ".join(f"{v} {r.sensitivity:.3f}" for v, r in ranked))
    if len(warmups) == 2:
        lower, higher, same = [], [], []
        for variant in dict.fromkeys(v for v, _ in by):
            before, after = by.get((variant, warmups[0])), by.get((variant, warmups[1]))
            if before is None or after is None:
                continue
            noise = max(_finite(before.spread), _finite(after.spread))
            change = f"{variant} {before.sensitivity:.3f} -> {after.sensitivity:.3f}"
            delta = after.sensitivity - before.sensitivity
            (lower if delta < -noise else higher if delta > noise else same).append(change)
        parts.append(f"Warmup ({warmups[1]} steps) lowers the sensitivity of {', '.join(lower) or 'no placement'}; "
                     f"raises it for {', '.join(higher) or 'none'}; within the larger seed spread of the two for "
                     f"{', '.join(same) or 'none'}")
    if undefined:
        parts.append(f"No LR sensitivity (an lr of the grid has no finished run) for {', '.join(undefined)}")
    diverged = sum(r.diverged for r in rows)
    covered = f"{sum(r.runs for r in rows)} runs, {min((r.seeds for r in rows), default=0)}+ seeds per variant"
    return ". ".join(parts) + f". ({covered}; {diverged} diverged runs counted as their loss at init.)"


def _variant(row) -> str:
    """A sensitivity row's variant without its warmup ('Pre', 'Pre-RMS' where the kind varies too)."""
    return variant_label({k: v for k, v in row.values.items() if k != "schedule.warmup_steps"})


def _finite(value: float) -> float:
    return 0.0 if math.isnan(value) else value


BLOCKS_FIGURES = ("fc2_update", "fc2_grad", "stream_rms")


def _every_seed_mean(rows: pd.DataFrame, column: str) -> pd.Series:
    """The mean of `column` per (warmup, placement, step) over every run of that (warmup, placement);
    nan at a step where one of them has no finite value (it diverged, or stopped before that step):
    groupby().mean() would skip it and call a mean over fewer seeds a mean over all."""
    cell = ["schedule.warmup_steps", "norm.placement"]
    finite = rows[rows[column].astype(float).map(math.isfinite)]
    stats = finite.groupby([*cell, "step"])[column].agg(["mean", "count"])
    runs = rows.groupby(cell)["run_id"].nunique()
    whole = stats["count"].to_numpy() == runs.reindex(stats.index.droplevel("step")).to_numpy()
    return stats["mean"].where(whole)


def blocks_verdict(source: Path | Folder) -> str:
    """When Post-LN's last block takes its largest update relative to its weights, how that compares
    with Pre-LN's, per warmup; and the last block's gradient at step 0."""
    tidy = as_folder(source).blocks(all_config=True)
    last = tidy[tidy["block"] == tidy["model.depth"]]
    update, grad = _every_seed_mean(last, "fc2_update"), _every_seed_mean(last, "fc2_grad")
    seeds = tidy["seed"].nunique()
    parts = []
    for warmup in sorted(tidy["schedule.warmup_steps"].unique()):
        post, pre = update[(warmup, "post")].dropna(), update[(warmup, "pre")].dropna()
        post = post[post.index.isin(pre.index)]  # steps where both have a mean over every seed
        pre = pre[pre.index.isin(post.index)]
        if post.empty:
            parts.append(f"With warmup {int(warmup)}: no step where every seed of Post-LN and of Pre-LN has a finite "
                         "last-block update ratio (a run diverged or stopped first)")
            continue
        peak = int(post.idxmax())
        when = "without warmup" if warmup == 0 else f"with a {int(warmup)}-step linear warmup"
        parts.append(
            f"{when[0].upper()}{when[1:]}, Post-LN's last-block update ratio ||dW||/||W|| of fc2 peaks after "
            f"step {peak} at {post[peak]:.3g} (mean over {seeds} seeds), {post[peak] / pre[peak]:.1f}x Pre-LN's at "
            f"that step ({pre[peak]:.3g}; Pre-LN's own peak: {pre.max():.3g} after step {int(pre.idxmax())})")
        final = int(post.index.max())
        parts[-1] += (f"; by step {final} Post-LN's is {post[final]:.3g}, {post[final] / pre[final]:.2f}x Pre-LN's "
                      f"({pre[final]:.3g})")
    first = int(tidy["schedule.warmup_steps"].min())
    g0 = grad[(first, "post", 0)] / grad[(first, "pre", 0)]
    u0 = update[(first, "post", 0)] / update[(first, "pre", 0)]
    first_step = (f"yet its first Adam update is {u0:.2f}x Pre-LN's: Adam's first step moves every weight by about "
                  "the learning rate whatever the gradient's size" if 0.5 < u0 < 2 else
                  f"and its first Adam update is {u0:.2f}x Pre-LN's")
    return (". ".join(parts) + f". At step 0 Post-LN's last block gets {g0:.1f}x Pre-LN's fc2 gradient (the "
            f"gradnorm study's picture at init), {first_step}.")


# attention logits "grow" at an lr where the largest of them (over layers, logged steps, seeds' mean) reaches
# this: e^50 between two logits makes a softmax one-hot (Wortsman et al.'s attention-entropy collapse); at
# init they are O(1) here (a norm's output through xavier q, k: about 3), and DyT's far smaller
LOGIT_LIMIT = 50.0
INSTABILITY_KEYS = ("norm.placement", "norm.kind", "model.qk_norm", "train.z_loss")
HEATMAP_LR = 0.1  # the heat maps' learning rate: in the grid and in --quick's, where logits grow without qk-norm


def _flag(value: object) -> bool:
    """A bool grid value as a folder's summary may hold it (True, 'True', 1)."""
    return str(value).strip().lower() in ("true", "1", "1.0")


def instability_runs(source: Path | Folder) -> pd.DataFrame:
    """One row per run of the instabilities study: its keys, `logit_peak` (the largest attention logit over
    layers and logged steps; finite steps only, so a run that diverged counts up to the step before),
    `growth` (logit_peak over its step-0 value), `log_z_peak` (the largest |log Z| of its finite logged steps)."""
    tidy = as_folder(source).blocks(all_config=True)
    tidy["attn_logit_max"] = tidy["attn_logit_max"].astype(float)
    tidy["log_z"] = tidy["log_z"].astype(float).abs()
    per_step = tidy.groupby(["run_id", "step"], sort=False)[["attn_logit_max", "log_z"]].max()  # over layers
    finite = per_step[per_step.map(math.isfinite).all(axis=1)].reset_index()
    first = finite.sort_values("step").groupby("run_id").head(1).set_index("run_id")
    peak = finite.groupby("run_id")[["attn_logit_max", "log_z"]].max()
    keys = tidy.groupby("run_id", sort=False)[[*INSTABILITY_KEYS, "optim.lr", "seed"]].first()
    runs = keys.join(peak).join(first[["attn_logit_max"]].rename(columns={"attn_logit_max": "logit0"}))
    runs["model.qk_norm"] = runs["model.qk_norm"].map(_flag)
    runs["train.z_loss"] = runs["train.z_loss"].astype(float)
    runs["optim.lr"] = runs["optim.lr"].astype(float)
    runs["growth"] = runs["attn_logit_max"] / runs["logit0"]
    return runs.rename(columns={"log_z": "log_z_peak", "attn_logit_max": "logit_peak"}).reset_index()


def _compare(before, after) -> str:
    """'lowers', 'raises' or 'leaves within noise' the sensitivity, from `before` to `after` (Sensitivity
    rows; noise: the larger of their seed spreads, 0 with one seed)."""
    noise = max(_finite(before.spread), _finite(after.spread))
    delta = after.sensitivity - before.sensitivity
    return "lowers" if delta < -noise else "raises" if delta > noise else "leaves within noise"


def instabilities_verdict(source: Path | Folder) -> str:
    """Per design (placement x kind): where its attention logits grow without qk-norm, and what qk-norm
    does to its LR sensitivity; then the z-loss's effect on sensitivity and on log Z; then whether the
    paper's two trends show here."""
    folder = as_folder(source)
    runs = instability_runs(folder)
    fixed = runs.iloc[0]  # a key the grid does not vary: its one value
    sens = {}
    for row in build_sensitivity(folder):
        v = {key: row.values.get(key, fixed[key]) for key in INSTABILITY_KEYS}
        sens[(v["norm.placement"], v["norm.kind"], _flag(v["model.qk_norm"]), float(v["train.z_loss"]))] = row
    seeds = runs["seed"].nunique()
    summary = _finished_summary(folder)
    threshold = float(thresholds(summary, folder.trained_rule()).iloc[0])  # the folder's trained rule
    cells = runs.groupby([*INSTABILITY_KEYS, "optim.lr"])[["logit_peak", "log_z_peak"]].mean()
    designs = list(dict.fromkeys((p, k) for p, k, _, _ in sens))
    z_on = max((z for *_, z in sens), default=0.0)
    parts, grows, helped = [], [], []
    for placement, kind in designs:
        label = variant_label({"norm.placement": placement, "norm.kind": kind})
        off, on = sens.get((placement, kind, False, 0.0)), sens.get((placement, kind, True, 0.0))
        if off is None or on is None or math.isnan(off.sensitivity) or math.isnan(on.sensitivity):
            parts.append(f"{label}: no LR sensitivity with and without qk-norm (an lr has no finished run)")
            continue
        peak = cells.loc[(placement, kind, False, 0.0), "logit_peak"]
        grown = [lr for lr, g in peak.items() if g >= LOGIT_LIMIT]
        qk_peak = cells.loc[(placement, kind, True, 0.0), "logit_peak"]
        effect = _compare(off, on)
        where = (f"at least {LOGIT_LIMIT:g} from lr {min(grown):g} up" if grown
                 else f"under {LOGIT_LIMIT:g} at every lr")
        by_lr = ", ".join(f"{p:.3g}" for p in peak)
        text = (f"{label}: without qk-norm its largest attention logit peaks at {by_lr} over the lrs ({where}); "
                f"with qk-norm at {', '.join(f'{p:.3g}' for p in qk_peak)}; qk-norm {effect} its LR sensitivity "
                f"({off.sensitivity:.3f} -> {on.sensitivity:.3f})")
        parts.append(text)
        if min(off.best_loss, on.best_loss) >= threshold:  # a design that never trains: its sensitivity is no evidence
            parts[-1] += (f" (it trains at no lr of the grid, l* {min(off.best_loss, on.best_loss):.2f}: a design "
                          "that never trains, left out of the tally below)")
            continue
        if grown:
            grows.append(label)
            if effect == "lowers":
                helped.append(label)
    if not grows:
        qk = (f"No design's attention logits reach {LOGIT_LIMIT:g} at any learning rate here: the toy does not "
              "reach the regime of the paper's attention-logit growth, so it cannot test qk-norm's fix")
    elif len(helped) == len(grows):
        qk = (f"Where the attention logits grow ({', '.join(grows)}), qk-norm lowers the LR sensitivity in every "
              "design: the paper's trend reproduces here")
    elif helped:
        qk = (f"Where the attention logits grow ({', '.join(grows)}), qk-norm lowers the LR sensitivity of "
              f"{', '.join(helped)} only: the paper's trend reproduces in part")
    else:
        qk = (f"Where the attention logits grow ({', '.join(grows)}), qk-norm lowers the LR sensitivity of no "
              "design: the paper's trend does not reproduce here")
    z_parts, z_changed, z_tamed = [], [], []
    top = float(runs["optim.lr"].max())
    for placement, kind in designs:
        label = variant_label({"norm.placement": placement, "norm.kind": kind})
        without, with_z = sens.get((placement, kind, False, 0.0)), sens.get((placement, kind, False, z_on))
        if z_on == 0.0 or without is None or with_z is None or math.isnan(without.sensitivity) \
                or math.isnan(with_z.sensitivity):
            continue
        effect = _compare(without, with_z)
        peak_off = cells.loc[(placement, kind, False, 0.0, top), "log_z_peak"]
        peak_on = cells.loc[(placement, kind, False, z_on, top), "log_z_peak"]
        z_parts.append(f"{label} {without.sensitivity:.3f} -> {with_z.sensitivity:.3f} ({effect}; peak |log Z| at "
                       f"lr {top:g} {peak_off:.1f} -> {peak_on:.1f})")
        if effect != "leaves within noise":
            z_changed.append(label)
        if peak_on < 0.9 * peak_off:
            z_tamed.append(label)
    if z_parts:
        z_text = (f"The z-loss ({z_on:g}, without qk-norm) moves the LR sensitivity thus: {'; '.join(z_parts)}. "
                  + (f"It moves the sensitivity beyond the seed spread for {', '.join(z_changed)}"
                     + (" (one seed: beyond zero, with no spread to judge it by)" if seeds < 2 else "")
                     if z_changed else "It moves no design's sensitivity beyond the seed spread: at these sizes "
                     "the z-loss does not matter for the loss, as the paper expects of models without output-logit "
                     "divergence")
                  + (f"; it keeps log Z nearer 0 (peak |log Z| at least 10% lower) for {', '.join(z_tamed)}."
                     if z_tamed else "; it does not lower the peak |log Z| by 10% for any design."))
    else:
        z_text = "The grid has no z-loss axis, or no sensitivity to compare it on."
    if seeds < 2:
        qk += " (one seed: no change is judged against seed noise)"
    diverged = int((summary["status"] == "diverged").sum())
    return (". ".join(parts) + f". {qk}. {z_text} ({len(runs)} runs, {seeds} seed{'s' if seeds > 1 else ''} per "
            f"cell, {diverged} diverged: a diverged run counts at its loss at init in the sensitivity, and "
            "up to its last finite logged step in the logit peaks.)")


def instabilities_figures(folder: Folder) -> list[Path]:
    """final_loss-lr.png: per design (placement across, kind down) the final loss against lr, one line per
    (qk-norm, z-loss), mean over seeds (a diverged run at its loss at init, as the LR sensitivity counts
    it); then the block heat maps of the largest attention logit, the attention entropy and log Z at lr
    HEATMAP_LR without the z-loss: placements across, kind x qk-norm down."""
    import matplotlib.pyplot as plt

    from normexp.analysis.sensitivity import lr_table
    from normexp.figures import BLOCK_METRIC_LABELS, blocks_figure

    table, _ = lr_table(folder)
    table["model.qk_norm"] = table["model.qk_norm"].map(_flag)
    table["train.z_loss"] = table["train.z_loss"].astype(float)
    table["optim.lr"] = table["optim.lr"].astype(float)
    placements = list(dict.fromkeys(table["norm.placement"]))
    kinds = list(dict.fromkeys(table["norm.kind"]))
    fig, axes = plt.subplots(len(kinds), len(placements), figsize=(4.2 * len(placements), 3.4 * len(kinds)),
                             squeeze=False, sharex=True, sharey=True, layout="constrained")
    for (placement, kind), group in table.groupby(["norm.placement", "norm.kind"], sort=False):
        ax = axes[kinds.index(kind), placements.index(placement)]
        for (qk, z), line in group.groupby(["model.qk_norm", "train.z_loss"]):
            mean = line.groupby("optim.lr")["clipped"].mean()
            ax.plot(mean.index, mean.to_numpy(), marker="o", linestyle="-" if qk else "--",
                    label=f"qk-norm {'on' if qk else 'off'}, z-loss {z:g}")
        ax.set_xscale("log")
        ax.set_title(variant_label({"norm.placement": placement, "norm.kind": kind}))
        ax.set_xlabel("optim.lr")
        ax.grid(True, alpha=0.3)
    axes[0, 0].set_ylabel("final loss (mean over seeds)")
    axes[0, 0].legend(fontsize="small")
    fig.suptitle("final training loss vs learning rate per design (a diverged run counts as its loss at init)")
    paths = [folder.path / "final_loss-lr.png"]
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)

    tidy = folder.blocks(all_config=True)
    chosen = tidy[(tidy["optim.lr"].astype(float) == HEATMAP_LR) & (tidy["train.z_loss"].astype(float) == 0.0)]
    if chosen.empty:
        return paths
    for metric in ("attn_logit_max", "attn_entropy", "log_z"):
        fig = blocks_figure(chosen.copy(), ["norm.placement", "norm.kind", "model.qk_norm"], metric)
        fig.suptitle(f"per-block dynamics: {BLOCK_METRIC_LABELS[metric]} (lr {HEATMAP_LR:g}, no z-loss)")
        path = folder.path / f"blocks-{metric}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


LEMMA_TOLERANCE = 0.25  # a measured branch energy c within 25% of the computed one: Lemma 2 holds in form


def gradnorm_verdict(summary) -> str:  # summary: GradnormSummary
    post, pre = summary.slopes.get("post", math.nan), summary.slopes.get("pre", math.nan)

    def shape(slope: float) -> str:
        return "flat" if abs(slope) < 0.1 else ("grows" if slope > 0 else "shrinks")

    gain = summary.branch_gain
    c_post, c_pre = summary.measured_gain("post"), summary.measured_gain("pre")
    ratio = summary.last_grad["post"][-1][0] / summary.last_grad["pre"][-1][0]
    direction = ("matches Xiong et al. (Post-LN's slope above Pre-LN's, its last block's gradient the larger)"
                 if post > pre and ratio > 1 else "does not match Xiong et al.")
    rates = ("and so do the rates, within 0.1 of the theorem's" if abs(post) < 0.1 and abs(pre + 0.5) < 0.1
             else "the rates differ from the theorem's")
    text = (f"Post-LN's last-block gradient {shape(post)} with depth (fitted slope {post:+.2f}; Theorem 1 says "
            f"independent of depth, so 0) and Pre-LN's {shape(pre)} (slope {pre:+.2f}; Theorem 1: -0.5). "
            f"The direction {direction}: at depth {summary.depths[-1]}, Post-LN's last block gets "
            f"{ratio:.1f}x Pre-LN's gradient; {rates}.")
    if gain is None:
        return text
    close = all(abs(c - gain) <= LEMMA_TOLERANCE * gain for c in (c_pre, c_post))
    return text + (f" Lemma 2's hidden-state norms {'hold' if close else 'do not hold'} in form with this init's "
                   f"branch energy (within {LEMMA_TOLERANCE:.0%}): each block adds c = {c_pre:.3f} (Pre-LN stream "
                   f"growth) and Post-LN norms see 1 + {c_post:.3f}, against c = {gain:.3f} computed from xavier "
                   "init with a 4x-wide FFN; Xiong's 3/2 and 1 + l/2 assume c = 1/2.")


def props_verdict(props) -> str:
    failed = [p.name for p in props if not p.passed]
    return (f"{len(props) - len(failed)} of {len(props)} facts of the RMSNorm article reproduce here"
            + (f"; failing: {', '.join(failed)}." if failed else "."))


RANKED_MS = 1.0  # under this LayerNorm forward time, a call is per-call overhead and run-to-run noise


def speed_verdict(timings) -> str:
    parts = []
    for shape in dict.fromkeys(t.shape for t in timings):
        mine = [t for t in timings if t.shape == shape]
        ln = next(t for t in mine if t.kind == "layernorm")
        ratios = ", ".join(f"{t.kind} {t.forward_ms / ln.forward_ms:.2f}x" for t in mine if t.kind != "layernorm")
        if ln.forward_ms < RANKED_MS:
            ranking = (f"at {ln.forward_ms:.3g} ms a call is overhead, and these ratios move from run to run: "
                       "no ranking at this shape")
        else:
            slower = all(t.forward_ms > ln.forward_ms for t in mine if t.kind.startswith("rmsnorm_torch"))
            ranking = f"nn.RMSNorm is {'slower' if slower else 'not slower'} than LayerNorm here"
        parts.append(f"At {shape}, forward time relative to LayerNorm ({ln.forward_ms:.3g} ms): {ratios}; {ranking}")
    return ". ".join(parts) + ". (The article measured RMSNorm about 3x slower than LayerNorm on its CPU.)"


# ----------------------------------------------------------------------------- the report


def run_studies(out: Path, quick: bool = False, log: Callable[[str], None] = print) -> Path:
    from normexp.config import RunConfig  # noqa: F401 - torch-backed modules below
    from normexp.diagnostics import gradnorm_study, norm_properties, norm_speed
    from normexp.figures import save_gradnorm_plot

    out.mkdir(parents=True, exist_ok=True)
    sections, times = [], {}
    studies = [
        ("warmup", "The article's table: does Post-LN train without warmup? (depth 32, Adam 0.01, 30 steps)",
         None, article_verdict),
        ("lr_warmup", "Where does Post-LN start to train as learning rate and warmup change?", None,
         lr_warmup_verdict),
        ("depth", "Does the Post/Pre gap grow with depth?", "model.depth", depth_verdict),
        ("placements", "Every placement x every norm kind: which train without warmup?", None, placements_verdict),
        ("lr_sensitivity", "Which placement is least sensitive to the learning rate, with and without warmup? "
         "(Wortsman et al. 2023's yardstick: 7 learning rates 1e-4..1e-1, 60 steps)", None, lr_sensitivity_verdict),
        ("transformer_warmup", "On a 16-layer causal Transformer (assoc_recall), where does Post-LN train, and "
         "where does warmup rescue it? Post / Pre / B2T / DeepNorm x Adam lr x warmup (fast engine)",
         None, transformer_warmup_verdict),
        ("blocks", "Inside the blocks: how large are each block's gradients and Adam updates over the first steps, "
                   "Post-LN vs Pre-LN, with and without warmup?", None, blocks_verdict),
        ("instabilities", "Wortsman et al. 2023 at toy scale: do qk-norm and the z-loss lower the learning-rate "
         "sensitivity of a 4-layer causal Transformer, Pre / Post / Peri-LN, LayerNorm or DyT, and do its "
         "attention logits and output log Z grow at high learning rates as theirs did?", None, instabilities_verdict),
    ]
    specs = {name: _spec(name, quick) for name, *_ in studies}
    for name, spec in specs.items():  # before anything trains, not after the studies before it
        refuse_another_sweep(out / name, spec, remedy="choose another --out")
        owner = lock_owner(out / name)
        if owner is not None:
            raise StoreError(f"{out / name}: another sweep is writing here ({owner}); wait for it, or choose "
                             "another --out")
    for name, question, x_key, verdict in studies:
        log(f"study {name} ...")
        start = time.perf_counter()
        run_dir, resumed = _sweep(name, specs[name], out)
        folder = load_folder(run_dir)  # read and verified once for the study's table, figures and verdict
        figures = _figures(folder, x_key)
        sensitivity = (sensitivity_to_markdown(build_sensitivity(folder), sensitivity_engines(folder))
                       if name.startswith("lr_") or name == "instabilities" else "")
        table = (sensitivity if name in ("lr_sensitivity", "instabilities")
                 else to_markdown(build_report(folder, only_last=True)))
        if name == "lr_warmup":
            from normexp.report import build_pivot, pivot_to_markdown

            table += "\n" + pivot_to_markdown(build_pivot(folder, "optim.lr", "schedule.warmup_steps"))
            table += "\n" + sensitivity
        note = missing_note(folder.latest, run_dir)
        verdict_text = verdict(folder) + (f" {note}." if note else "")
        times[name] = time.perf_counter() - start
        earlier = f"{resumed} of its runs {'was' if resumed == 1 else 'were'} done by an earlier call"
        sections.append(_section(question, name, table, figures, verdict_text, times[name],
                                 earlier if resumed else ""))

    log("study gradnorm ...")
    start = time.perf_counter()
    spec = load_sweep(CONFIGS / "studies" / "gradnorm.yaml", ["seeds=0,1,2"] if quick else [])
    summary = gradnorm_study(spec, out / "gradnorm")
    save_gradnorm_plot(summary, out / "gradnorm" / "gradnorm.png")
    times["gradnorm"] = time.perf_counter() - start
    sections.append(_section("Xiong et al. at initialisation: how does the last block's gradient scale with "
                             "depth, and how do hidden-state norms grow?", "gradnorm", gradnorm_to_markdown(summary),
                             ["gradnorm/gradnorm.png"], gradnorm_verdict(summary), times["gradnorm"]))

    log("norm facts and speed ...")
    start = time.perf_counter()
    props = norm_properties()
    timings = norm_speed([(64, 32)] + ([] if quick else [SPEED_SHAPE]), repeats=3)
    times["norms"] = time.perf_counter() - start
    sections.append(_section("The RMSNorm facts of shared/seeds/001, measured here; and LayerNorm vs RMSNorm speed",
                             "norms", properties_to_markdown(props) + "\n" + speed_to_markdown(timings), [],
                             props_verdict(props) + " " + speed_verdict(timings), times["norms"]))
    report = out / "REPORT.md"
    total = sum(times.values())
    header = (f"# normexp studies\n\nWritten by `make studies` (`normexp studies"
              f"{' --quick' if quick else ''}`); every verdict below is computed from these runs. "
              f"Total {total / 60:.1f} min on {usable_cores()} cores.\n")
    report.write_text(header + "\n".join(sections))
    log(f"wrote {report}")
    from normexp.htmlpage import markdown_page  # the same report as one page to send: figures inline

    page = out / "REPORT.html"
    page.write_text(markdown_page(report.read_text(), out), encoding="utf-8")
    log(f"wrote {page}")
    return report


def _section(question: str, name: str, table: str, figures: list[str], verdict: str, seconds: float,
             resumed: str = "") -> str:
    images = "\n".join(f"![{Path(f).stem}]({f})" for f in figures)
    return f"\n## {name}\n\n**Question.** {question}\n\n{table}\n{images}\n\n**Verdict.** {verdict}\n\n" \
           f"_Runtime: {seconds:.0f} s{f' ({resumed})' if resumed else ''}._\n"


USAGE_ERROR = 2  # as `normexp`'s exit code for bad usage or an output folder in use (1 says a run failed)


def _fail(message: str) -> NoReturn:
    """One `error:` line on stderr and exit 2, as `normexp sweep` does for the same errors."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(USAGE_ERROR)


QUICK_HELP = "a smoke test: 2 seeds per sweep (gradnorm 3, the article's table its 1), no big-shape speed table"


def run_command(out_option: str | Path, quick: bool = False) -> None:
    """`normexp studies` (and `python -m normexp.studies`): every study into `out`, stopping cleanly on
    a first Ctrl-C or SIGTERM (finished runs kept, a rerun resumes) and exiting 128 + signal; a folder
    in use, an unusable `out` or an edited study config is one `error:` line and exit 2."""
    stopping.on_stop_signals(stopping.stop_cleanly)
    from normexp.executors import ExecutorError

    out = _check_out(str(out_option))
    try:
        run_studies(out, quick)
    except (StoreError, ExecutorError, ConfigError) as exc:  # a folder in use or full, an edited study config
        _fail(str(exc))
    except OSError as exc:  # a folder that cannot be written, a full disk: say which file
        where = f" ({exc.filename})" if exc.filename else ""
        _fail(f"--out {out}: cannot write the studies{where}: {exc.strerror or exc}")
    except (SweepInterrupted, KeyboardInterrupt):
        signum = stopping.received or signal.SIGINT
        kept = f"every finished run is kept in {out}" if out.is_dir() else "nothing was written yet"
        print(f"{signal.Signals(signum).name}: studies stopped; {kept}. Run the same command again to resume.",
              file=sys.stderr)
        stopping.exit_stopped(128 + signum)


def _check_out(option: str) -> Path:
    """--out must name a folder, or a path where one can be made: as `normexp sweep` checks its --out."""
    if not option.strip():  # Path("") is the current folder: every study would land there
        _fail("--out: empty; name a folder for the studies (the default is runs)")
    out = Path(option)
    problem = out_folder_problem(out)  # as `normexp sweep` checks its --out (else mkdir says "File exists")
    if problem is not None:
        _fail(f"--out {out}: {problem}")
    return out


def main() -> None:
    """`python -m normexp.studies`: the same as `normexp studies`."""
    set_thread_defaults()  # as the normexp command does first: before a sweep loads torch
    parser = argparse.ArgumentParser(description="Run normexp's studies and write REPORT.md.")
    parser.add_argument("--out", default="runs")
    parser.add_argument("--quick", action="store_true", help=QUICK_HELP)
    args = parser.parse_args()
    run_command(args.out, args.quick)


if __name__ == "__main__":
    main()
