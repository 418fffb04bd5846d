"""The studies' verdicts: each a paragraph computed from the numbers the study just measured (nothing in a
verdict is written in advance). A verdict counts a folder's verified runs of the study's own grid only."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from normexp.analysis.sensitivity import CANNOT_TELL, ArmChange, Sensitivity, arm_change, build_sensitivity, judge
from normexp.analysis.variants import PLACEMENT_LABELS, is_trained, n_choices, thresholds, variant_groups, variant_label
from normexp.report import build_report
from normexp.results import Folder, as_folder, finished_runs


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


def realtext_warmup_verdict(source: Path | Folder) -> str:
    """Per depth and lr (normexp/analysis/realtext.py): does Post-LN without warmup stay at the unigram floor,
    from which warmup does every seed get below it, is Pre-LN (Peri-LN) indifferent; from each run's last
    val_loss against the floor computed from the text; the folder's latest sweep only (its own grid)."""
    from normexp.analysis.realtext import final_val_losses, verdict
    from normexp.corpus import floors

    return verdict(final_val_losses(as_folder(source).metrics(all_config=True, only_last=True)), floors().unigram)


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
# ... and has grown there to at least this many times its step-0 value (seeds' mean): a logit that is
# large from init, or a run that fails before its logits move, shows no growth
LOGIT_GROWTH = 2.0
INSTABILITY_KEYS = ("norm.placement", "norm.kind", "model.qk_norm", "train.z_loss")
WIDTH_KEY = "model.width"
PAPER_LRS = (3e-4, 3e-1)  # Wortsman et al.'s LR sensitivity range


def flag(value: object) -> bool:
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
    keys = tidy.groupby("run_id", sort=False)[[*INSTABILITY_KEYS, WIDTH_KEY, "optim.lr", "seed"]].first()
    runs = keys.join(peak).join(first[["attn_logit_max"]].rename(columns={"attn_logit_max": "logit0"}))
    runs["model.qk_norm"] = runs["model.qk_norm"].map(flag)
    runs["train.z_loss"] = runs["train.z_loss"].astype(float)
    runs[WIDTH_KEY] = runs[WIDTH_KEY].astype(float).astype(int)
    runs["optim.lr"] = runs["optim.lr"].astype(float)
    runs["growth"] = runs["attn_logit_max"] / runs["logit0"]
    return runs.rename(columns={"log_z": "log_z_peak", "attn_logit_max": "logit_peak"}).reset_index()


def grown_lrs(cells: pd.DataFrame) -> list[float]:
    """The lrs (`cells`' index) where the attention logits grow: the seeds' mean largest logit reaches
    LOGIT_LIMIT and the seeds' mean growth over step 0 is at least LOGIT_GROWTH."""
    return [float(lr) for lr, row in cells.iterrows()
            if row["logit_peak"] >= LOGIT_LIMIT and row["growth"] >= LOGIT_GROWTH]


def _says(change: ArmChange, what: str, verb: str = "moves") -> str:
    """'qk-norm lowers its LR sensitivity (...)': both readings, the judgement on the shared one."""
    (s0, s1), (o0, o1) = change.shared, change.own
    if change.effect == CANNOT_TELL:
        head = f"{verb} {what} (one seed: cannot tell whether beyond the seed spread)"
    else:
        head = f"{change.effect} {what}"
    text = (f"{head}: {s0:.3f} -> {s1:.3f} against the best loss of both arms; {o0:.3f} -> {o1:.3f} against "
            f"each arm's own best (the paper's formula)")
    if CANNOT_TELL not in (change.effect, change.own_effect) and change.own_effect != change.effect:
        text += (f", which alone would say it {change.own_effect.replace('leaves', 'leaves it')}, because the best "
                 f"loss itself moves {change.best[0]:.3f} -> {change.best[1]:.3f}")
    return text


def width_trend(by_width: dict[int, Sensitivity]) -> str:
    """'grows', 'shrinks', 'stays flat' (narrowest to widest, against the larger seed spread) or CANNOT_TELL
    (one seed, or under 2 widths with a sensitivity)."""
    rows = [by_width[w] for w in sorted(by_width) if not math.isnan(by_width[w].sensitivity)]
    if len(rows) < 2:
        return CANNOT_TELL
    spreads = [r.spread for r in rows if math.isfinite(r.spread)]
    effect = judge(rows[0].sensitivity, rows[-1].sensitivity, max(spreads) if spreads else math.nan,
                   min(r.seeds for r in rows))
    return {"lowers": "shrinks", "raises": "grows", "leaves within noise": "stays flat"}.get(effect, effect)


def _limits(runs: pd.DataFrame, widths: list[int]) -> str:
    """What this grid cannot conclude: one seed, under 3 widths, an lr range short of the paper's."""
    cannot = []
    if runs["seed"].nunique() < 2:
        cannot.append("whether any change is beyond the seed spread (one seed; the full study has 2)")
    if len(widths) < 3:
        cannot.append(f"how the LR sensitivity moves with width ({len(widths)} width{'s' if len(widths) > 1 else ''}; "
                      "the paper's claim needs at least 3)")
    lo, hi = float(runs["optim.lr"].min()), float(runs["optim.lr"].max())
    if lo > PAPER_LRS[0] * 1.05 or hi < PAPER_LRS[1] * 0.95:
        cannot.append(f"the sensitivity over the paper's lr range {PAPER_LRS[0]:g}..{PAPER_LRS[1]:g} "
                      f"(this grid: {lo:g}..{hi:g})")
    return f" This grid cannot conclude {'; nor '.join(cannot)}." if cannot else ""


def instabilities_verdict(source: Path | Folder) -> str:
    """Per design (placement x kind), at the widest width: where its attention logits grow without qk-norm,
    and what qk-norm does to its LR sensitivity; then the z-loss's effect on sensitivity and on log Z; then,
    with a width axis, how the sensitivity moves with width without and with qk-norm (the paper's claim);
    then what the grid cannot conclude. Changes are scored against the best loss of both arms, the paper's
    own-best reading given alongside (normexp/analysis/sensitivity.py, `arm_change`)."""
    folder = as_folder(source)
    runs = instability_runs(folder)
    fixed = runs.iloc[0]  # a key the grid does not vary: its one value
    sens = {}
    for row in build_sensitivity(folder):
        v = {key: row.values.get(key, fixed[key]) for key in (*INSTABILITY_KEYS, WIDTH_KEY)}
        sens[(v["norm.placement"], v["norm.kind"], flag(v["model.qk_norm"]), float(v["train.z_loss"]),
              int(float(v[WIDTH_KEY])))] = row
    summary = _finished_summary(folder)
    threshold = float(thresholds(summary, folder.trained_rule()).iloc[0])  # the folder's trained rule
    diverged = int((summary["status"] == "diverged").sum())
    return instabilities_text(runs, sens, threshold, diverged)


def _peak_text(value: float) -> str:
    """A logit peak as the verdict prints it: 3 significant digits, more where those would round it across
    LOGIT_LIMIT (49.96 is not printed "50" beside "grows to 50 at no lr")."""
    text = f"{value:.3g}"
    if math.isfinite(value) and (float(text) >= LOGIT_LIMIT) != (value >= LOGIT_LIMIT):
        text = repr(float(value))
    return text


def instabilities_text(runs: pd.DataFrame, sens: dict, threshold: float, diverged: int) -> str:
    """The instabilities verdict from its inputs: `runs` (instability_runs' rows), `sens` (Sensitivity rows
    keyed by (placement, kind, qk_norm, z_loss, width)), the folder's trained threshold and its diverged
    count. Every sentence follows from the numbers printed beside it."""
    seeds = runs["seed"].nunique()
    cells = runs.groupby([*INSTABILITY_KEYS, WIDTH_KEY, "optim.lr"])[["logit_peak", "log_z_peak", "growth"]].mean()
    widths = sorted({w for *_, w in sens})
    wide = widths[-1]
    designs = list(dict.fromkeys((p, k) for p, k, *_ in sens))
    z_on = max((z for _, _, _, z, _ in sens), default=0.0)
    at = f" at width {wide}" if len(widths) > 1 else ""
    parts, grows, helped, reached, untallied = [], [], [], [], []
    for placement, kind in designs:
        label = variant_label({"norm.placement": placement, "norm.kind": kind})
        off, on = sens.get((placement, kind, False, 0.0, wide)), sens.get((placement, kind, True, 0.0, wide))
        key = (placement, kind, False, 0.0, wide)
        design_cells = cells.loc[key] if key in cells.index.droplevel("optim.lr") else cells.iloc[:0]
        grown = grown_lrs(design_cells)
        if grown:
            reached.append(label)
        by_lr = ", ".join(_peak_text(p) for p in design_cells["logit_peak"])
        if off is None or on is None or math.isnan(off.sensitivity) or math.isnan(on.sensitivity):
            parts.append(f"{label}{at}: no LR sensitivity with and without qk-norm (an lr has no finished run)"
                         + (f"; without qk-norm its largest attention logit peaks at {by_lr} over the lrs"
                            if by_lr else ""))
            if grown:
                untallied.append(label)
            continue
        qk_peak = cells.loc[(placement, kind, True, 0.0, wide), "logit_peak"]
        change = arm_change(off, on)
        where = (f"at least {LOGIT_LIMIT:g} and {LOGIT_GROWTH:g}x its step-0 value at lr "
                 f"{', '.join(f'{lr:g}' for lr in grown)}" if grown
                 else f"it grows to {LOGIT_LIMIT:g} at no lr")
        parts.append(f"{label}{at}: without qk-norm its largest attention logit peaks at {by_lr} over the lrs "
                     f"({where}); with qk-norm at {', '.join(_peak_text(p) for p in qk_peak)}; qk-norm "
                     + _says(change, "its LR sensitivity"))
        if min(off.best_loss, on.best_loss) >= threshold:  # a design that never trains: its sensitivity is no evidence
            parts[-1] += (f" (it trains at no lr of the grid, l* {min(off.best_loss, on.best_loss):.2f}: a design "
                          "that never trains, left out of the tally below)")
            if grown:
                untallied.append(label)
            continue
        if grown:
            grows.append(label)
            if change.effect == "lowers":
                helped.append(label)
    if not reached:
        qk = (f"No design's attention logits grow to {LOGIT_LIMIT:g} (and {LOGIT_GROWTH:g}x their step-0 value) "
              "at any learning rate here: the toy does not reach the regime of the paper's attention-logit growth, "
              "so it cannot test qk-norm's fix")
    elif not grows:
        qk = (f"The attention logits grow to {LOGIT_LIMIT:g} in {', '.join(reached)}, but only in designs that "
              "never train or lack an LR sensitivity here, so this grid cannot test qk-norm's fix")
    elif seeds < 2:
        qk = (f"Where the attention logits grow ({', '.join(grows)}), one seed cannot tell whether qk-norm's change "
              "in LR sensitivity is beyond the seed spread: the paper's trend is neither confirmed nor refuted here")
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
        without, with_z = sens.get((placement, kind, False, 0.0, wide)), sens.get((placement, kind, False, z_on, wide))
        if z_on == 0.0 or without is None or with_z is None or math.isnan(without.sensitivity) \
                or math.isnan(with_z.sensitivity):
            continue
        change = arm_change(without, with_z)
        peak_off = cells.loc[(placement, kind, False, 0.0, wide, top), "log_z_peak"]
        peak_on = cells.loc[(placement, kind, False, z_on, wide, top), "log_z_peak"]
        z_parts.append(f"{label} {_says(change, 'it')} (peak |log Z| at lr {top:g} {peak_off:.1f} -> {peak_on:.1f})")
        if change.effect in ("lowers", "raises"):
            z_changed.append(label)
        if peak_on < 0.9 * peak_off:
            z_tamed.append(label)
    if z_parts:
        moved = (f"It moves the sensitivity beyond the seed spread for {', '.join(z_changed)}" if z_changed else
                 "With one seed it cannot tell whether the z-loss moves any design's sensitivity beyond the seed "
                 "spread" if seeds < 2 else
                 "It moves no design's sensitivity beyond the seed spread: at these sizes the z-loss does not "
                 "matter for the loss, as the paper expects of models without output-logit divergence")
        z_text = (f"The z-loss ({z_on:g}, without qk-norm{at}): {'; '.join(z_parts)}. {moved}"
                  + (f"; it keeps log Z nearer 0 (peak |log Z| at least 10% lower) for {', '.join(z_tamed)}."
                     if z_tamed else "; it does not lower the peak |log Z| by 10% for any design."))
    else:
        z_text = "The grid has no z-loss axis, or no sensitivity to compare it on."
    width_text = _width_text(sens, designs, widths) if len(widths) > 1 else ""
    if grows and untallied:
        qk += (f" (the logits also grow to {LOGIT_LIMIT:g} in {', '.join(untallied)}, left out: a design that "
               "never trains or has no LR sensitivity to judge)")
    return (". ".join(parts) + f". {qk}. {z_text}{width_text} ({len(runs)} runs, "
            f"{seeds} seed{'s' if seeds > 1 else ''} per cell, {diverged} diverged: a diverged run counts at its "
            "loss at init in the sensitivity, and up to its last finite logged step in the logit peaks. Each "
            "qk-norm and z-loss change is judged on "
            "the sensitivities scored against the best loss of both arms, so that an arm is not called more "
            "sensitive for reaching a lower loss; each arm against its own best, the paper's formula for one "
            "arm, is given alongside.)" + _limits(runs, widths))


def _width_text(sens: dict, designs: list, widths: list[int]) -> str:
    """The paper's claim across widths: without qk-norm the LR sensitivity grows with width, with it it stays
    flat (each arm against its own best, the paper's formula, z-loss off)."""
    parts, holds, judged = [], [], 0
    for placement, kind in designs:
        label = variant_label({"norm.placement": placement, "norm.kind": kind})
        arms = {qk: {w: sens[(placement, kind, qk, 0.0, w)] for w in widths if (placement, kind, qk, 0.0, w) in sens}
                for qk in (False, True)}
        trends = {qk: width_trend(arms[qk]) for qk in arms}
        shown = {qk: ", ".join(f"{arms[qk][w].sensitivity:.3f}" for w in sorted(arms[qk])) for qk in arms}
        parts.append(f"{label} without qk-norm {shown[False]} ({trends[False]}), with {shown[True]} ({trends[True]})")
        if CANNOT_TELL not in trends.values():
            judged += 1
            if trends[False] == "grows" and trends[True] in ("stays flat", "shrinks"):
                holds.append(label)
    claim = ("one seed cannot tell whether any trend is beyond the seed spread" if not judged else
             f"the paper's claim (grows without qk-norm, stays flat with it) holds for {', '.join(holds)}"
             if holds else "the paper's claim (grows without qk-norm, stays flat with it) holds for no design")
    return (f" Across widths {', '.join(map(str, widths))} (LR sensitivity, each arm against its own best, z-loss "
            f"off): {'; '.join(parts)}: {claim}.")


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
