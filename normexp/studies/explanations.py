"""The study `warmup_explanations` (issue 43): why warmup rescues Post-LN, the competing explanations side by
side on the article's toy. Each row is configs/studies/warmup_explanations.yaml (Post-LN, no warmup) with a
few keys set (`ROWS`), run into its own subfolder OUT/warmup_explanations/<row> (a sweep file has no
non-factorial rows: one sweep per row); the rows' folders are read as one (`compare.load_folders`, the row
being its `sweep` column), the columns are learning rates, with seeds.

The verdict (`explanations_findings`, a pure function of the summary and the sharpness rows, and
`explanations_text`) says which rows rescue Post-LN at which learning rate (every seed trained where the
"nothing" row does not), whether warmup's rescued runs keep lambda_max under 2/lr and the preconditioned
one under (2 + 2 beta1)/((1 - beta1) lr) at every measured step, and whether the unrescued runs cross them;
then which explanation the toy supports and which it does not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

CONTROL = "pre_ln"  # the control row: not a rescue of Post-LN, the placement that needs none
BASELINE = "nothing"
# row -> the `--set` overrides of the study's config that make it. Adam-2k's k: the RAdam paper's 2000 is
# longer than this 30-step toy; k = 3 is 10% of the steps. Large epsilon: 1e-3, against |sqrt(v)| ~ the
# gradients' scale (~1e-3..1e-1 here), so it damps the early updates without making Adam SGD.
ROWS: dict[str, list[str]] = {
    "nothing": [],
    "warmup": ["schedule.warmup_steps=10"],
    "clip": ["optim.clip_norm=1.0"],
    "agc": ["optim.agc=0.01"],
    "tfixup": ["norm.placement=none", "model.init=tfixup", "model.final_norm=false"],
    "adam_2k": ["optim.v_only_steps=3"],
    "large_eps": ["optim.eps=0.001"],
    "gi_adam": ["optim.v0=grad_sq"],
    "radam_torch": ["optim.name=radam", "optim.radam_variant=torch"],
    "radam_official": ["optim.name=radam", "optim.radam_variant=official"],
    "pre_ln": ["norm.placement=pre"],
}
QUICK = ["seeds=0", "optim.lr=0.001,0.01"]
# which explanation each rescue speaks for (the four, and the init family)
FAMILIES = {
    "warmup": "lr warmup", "clip": "clipping", "agc": "clipping", "tfixup": "init (T-Fixup)",
    "adam_2k": "Adam's early variance", "large_eps": "Adam's early variance", "gi_adam": "Adam's early variance",
    "radam_torch": "Adam's early variance", "radam_official": "Adam's early variance",
}


def explanations_verdict(folder) -> str:
    """The verdict of the rows' folders read as one (`compare.load_folders`)."""
    from normexp.studies.verdicts import _judged

    sharpness = folder.sharpness(all_config=True) if folder.has_sharpness() else pd.DataFrame()
    return explanations_text(explanations_findings(_judged(folder), sharpness))


def row_specs(config: Path, quick: bool) -> dict[str, object]:
    """Each row's Sweep, from the study's config and its overrides (QUICK's with --quick)."""
    from normexp.config import load_sweep

    return {row: load_sweep(config, [*sets, *(QUICK if quick else [])]) for row, sets in ROWS.items()}


@dataclass
class Findings:
    """What the verdict says, each from the numbers: `trained[row][lr]` every seed trained; `failing` the
    lrs where the baseline does not; `rescues[row]` the failing lrs where that row trains; `crossed[(row,
    lr)]` whether any of that cell's runs had a measured lambda_max over 2/lr or a preconditioned one over
    Adam's threshold (None: no finite measurement)."""

    trained: dict[str, dict[float, bool]]
    failing: list[float]
    rescues: dict[str, list[float]]
    crossed: dict[tuple[str, float], bool | None] = field(default_factory=dict)

    def warmup_below(self) -> bool | None:
        """Whether warmup's rescued cells all stayed under both thresholds (None: no rescue, or unmeasured)."""
        cells = [self.crossed.get(("warmup", lr)) for lr in self.rescues.get("warmup", [])]
        return None if not cells or None in cells else not any(cells)

    def trained_crossing(self) -> tuple[int, int]:
        """(cells whose every seed trained and that crossed a threshold, such cells measured)."""
        cells = [self.crossed.get((row, rate)) for row, by_lr in self.trained.items()
                 for rate, ok in by_lr.items() if ok]
        measured = [c for c in cells if c is not None]
        return sum(measured), len(measured)

    def unrescued_cross(self) -> bool | None:
        """Whether every failing baseline cell crossed a threshold (None: no failing cell, or unmeasured)."""
        cells = [self.crossed.get((BASELINE, lr)) for lr in self.failing]
        return None if not cells or None in cells else all(cells)


def explanations_findings(summary: pd.DataFrame, sharpness: pd.DataFrame) -> Findings:
    """`summary`: one row per finished run with `sweep` (the row), `optim.lr`, `trained`; `sharpness`: one
    row per run and measured step with `sweep`, `optim.lr`, lambda_max, precond_lambda_max, threshold_gd,
    threshold_adam."""
    lr = summary["optim.lr"].astype(float)
    cells = summary.assign(lr=lr).groupby(["sweep", "lr"], sort=True)["trained"].all()
    trained: dict[str, dict[float, bool]] = {}
    for (row, rate), ok in cells.items():
        trained.setdefault(str(row), {})[float(rate)] = bool(ok)
    base = trained.get(BASELINE, {})
    failing = sorted(rate for rate, ok in base.items() if not ok)
    rescues = {row: [rate for rate in failing if by_lr.get(rate)] for row, by_lr in trained.items()
               if row not in (BASELINE, CONTROL)}
    crossed: dict[tuple[str, float], bool | None] = {}
    if not sharpness.empty:
        frame = sharpness.assign(lr=sharpness["optim.lr"].astype(float))
        over = ((frame["lambda_max"].astype(float) > frame["threshold_gd"].astype(float))
                | (frame["precond_lambda_max"].astype(float) > frame["threshold_adam"].astype(float)))
        measured = frame["lambda_max"].astype(float).notna()
        for (row, rate), group in frame.assign(over=over, measured=measured).groupby(["sweep", "lr"]):
            crossed[(str(row), float(rate))] = bool(group["over"].any()) if group["measured"].any() else None
    return Findings(trained, failing, rescues, crossed)


def _lrs(rates: list[float]) -> str:
    return ", ".join(f"{rate:g}" for rate in rates)


def explanations_text(found: Findings) -> str:
    """The verdict's paragraph, every statement read off `found`."""
    if BASELINE not in found.trained:
        return "The baseline row (Post-LN, no warmup) has no finished run: nothing to compare."
    if not found.failing:
        return (f"Post-LN without warmup trains at every learning rate of the grid "
                f"({_lrs(sorted(found.trained[BASELINE]))}): there is nothing to rescue here.")
    parts = [f"Post-LN without warmup fails at lr {_lrs(found.failing)}."]
    rescuing = {row: rates for row, rates in found.rescues.items() if rates}
    for row, rates in rescuing.items():
        parts.append(f"{row} rescues it at lr {_lrs(rates)}.")
    none = [row for row, rates in found.rescues.items() if not rates]
    if none:
        parts.append(f"No rescue at any failing lr: {', '.join(none)}.")
    control = found.trained.get(CONTROL)
    if control is not None:
        ok = [rate for rate in found.failing if control.get(rate)]
        parts.append(f"The Pre-LN control trains at {'lr ' + _lrs(ok) if ok else 'none'} of them.")
    below, cross = found.warmup_below(), found.unrescued_cross()
    if below is not None:
        parts.append("Warmup's rescued runs kept lambda_max under 2/lr and the preconditioned lambda_max under "
                     "(2+2b1)/((1-b1) lr) at every measured step." if below else
                     "Warmup's rescued runs crossed a stability threshold at some measured step.")
    if cross is not None:
        parts.append("Every failing run without warmup crossed a stability threshold at some measured step."
                     if cross else
                     "Not every failing run without warmup crossed a stability threshold at the measured steps.")
    also = found.trained_crossing()
    if also[1]:
        parts.append(f"So did {also[0]} of the {also[1]} measured cells whose every seed trained"
                     f"{': crossing alone does not mark a failure here' if also[0] else ''}.")
    families = sorted({FAMILIES[row] for row in rescuing if row in FAMILIES})
    missing = sorted({FAMILIES[row] for row in found.rescues if row in FAMILIES} - set(families))
    sharp = below is True and cross is True
    if "warmup" in found.rescues and not found.rescues["warmup"]:
        why = "; the sharpness account of warmup is not tested: warmup rescues no failing lr here"
    elif below is None or cross is None:
        why = "; the sharpness account cannot be judged (sharpness unmeasured where needed)"
    else:
        why = "" if sharp else "; nor the sharpness account as measured (see the sentences above)"
    parts.append(f"The toy supports: {', '.join(families) if families else 'none of the controls'}"
                 f"{'; and the sharpness (edge-of-stability) account of warmup' if sharp else ''}. "
                 f"It does not support: {', '.join(missing) if missing else 'no family is left out'}{why}.")
    return " ".join(parts)


def explanations_table(summary: pd.DataFrame) -> str:
    """Markdown: per row (down) and lr (across), seeds trained / seeds and the mean final loss of the runs
    that did not diverge."""
    frame = summary.assign(lr=summary["optim.lr"].astype(float))
    rates = sorted(frame["lr"].unique())
    lines = ["| row | " + " | ".join(f"lr {rate:g}" for rate in rates) + " |",
             "|---|" + "---|" * len(rates)]
    for row in [r for r in ROWS if r in set(frame["sweep"])]:
        cells = []
        for rate in rates:
            group = frame[(frame["sweep"] == row) & (frame["lr"] == rate)]
            if group.empty:
                cells.append("")
                continue
            loss = group.loc[group["status"] != "diverged", "final_loss"].astype(float).mean()
            cells.append(f"{int(group['trained'].sum())}/{len(group)} · {loss:.3g}")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nCells: seeds trained / seeds · mean final loss (diverged runs left out).\n"


def final_loss_by_row(summary: pd.DataFrame, output: Path, threshold: float | None) -> Path:
    """final_loss.png: the mean final loss against lr (log x, log y), one line per row."""
    import matplotlib.pyplot as plt

    frame = summary.assign(lr=summary["optim.lr"].astype(float),
                           final_loss=summary["final_loss"].where(summary["status"] != "diverged").astype(float))
    fig, ax = plt.subplots(figsize=(7.5, 4.8), layout="constrained")
    for row in [r for r in ROWS if r in set(frame["sweep"])]:
        mean = frame[frame["sweep"] == row].groupby("lr")["final_loss"].mean()
        ax.plot(mean.index, mean.to_numpy(), marker="o", linestyle="--" if row == CONTROL else "-", label=row)
    if threshold is not None:
        ax.axhline(threshold, color="grey", linestyle=":", label="trained below")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final training loss (mean over seeds)")
    ax.set_title("Post-LN without warmup: final loss per control")
    ax.legend(fontsize="x-small", ncol=2)
    fig.savefig(output, dpi=120)
    plt.close(fig)
    return output
