"""Running the studies shipped with the package (normexp/configs/, a checkout's configs/): each study's
sweep into OUT/<study>, resumed where an earlier call stopped, then OUT/REPORT.md with its question,
table, figures and computed verdict, and OUT/REPORT.html, the same as one self-contained page."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from normexp.analysis.sensitivity import build_sensitivity, sensitivity_engines
from normexp.config import PACKAGED_CONFIGS, Sweep, build_sweep, load_sweep, read_mapping
from normexp.executors import usable_cores
from normexp.folder import StoreError, lock_owner
from normexp.report import build_report, to_markdown
from normexp.results import Folder, load_folder, missing_note
from normexp.studies.explanations import (
    explanations_table,
    explanations_verdict,
    final_loss_by_row,
    row_specs,
)
from normexp.studies.figures import study_figures
from normexp.studies.verdicts import (
    article_verdict,
    blocks_verdict,
    depth_verdict,
    gradnorm_verdict,
    instabilities_verdict,
    lr_sensitivity_verdict,
    lr_warmup_verdict,
    placements_verdict,
    props_verdict,
    realtext_warmup_verdict,
    speed_verdict,
    transformer_warmup_verdict,
)
from normexp.sweep import SweepOptions, refuse_another_sweep, run_sweep
from normexp.tables import gradnorm_to_markdown, properties_to_markdown, sensitivity_to_markdown, speed_to_markdown

CONFIGS = PACKAGED_CONFIGS

# The speed table's big shape: the article's hidden size 4096 over 8 x 512 tokens (its (64, 512, 4096)
# takes 8x longer; `normexp norms bench` and `make bench` time that one).
SPEED_SHAPE = (8, 512, 4096)
# Workers for the studies' sweeps: one per usable core, at most 8 (each holds torch and a batch of up
# to ~1 GiB; the studies have ~10-100 batches each, so more would wait anyway).
MAX_STUDY_WORKERS = 8
EXPLANATIONS = "warmup_explanations"  # several sweeps, one per row (studies/explanations.py)
FAST_STUDIES = ("transformer_warmup", "realtext_warmup")  # the Transformer: the exact engine would hand each run to
# the reference


# --quick per study where 2 seeds of the whole grid would still take minutes (default: seeds 0 and 1)
# instabilities: seed 0, LayerNorm designs, z-loss off, 4 lrs over the paper's range 3e-4..3e-1
# realtext_warmup: depth 12, lr 3e-3 (where Post-LN without warmup stays at the unigram floor), Post-LN and
# Pre-LN, no warmup and the long one, seeds 0 and 1: 8 runs of 300 steps (docs/studies.md: its time on 2 cores)
QUICK_SETS = {"warmup": [], "instabilities": ["seeds=0", "norm.kind=layernorm", "train.z_loss=0.0",
                                              "optim.lr=0.0003,0.003,0.03,0.3"],
              "realtext_warmup": ["seeds=0,1", "model.depth=12", "optim.lr=0.003", "norm.placement=post,pre",
                                  "schedule.warmup_steps=0,200"]}
# --quick's own points of a study's `sample:` section (a sampled key cannot be `--set`). instabilities: widths
# 16, 32, 64 (heads 1, 2, 4: head dim 16, as the full study's 32, 64, 128): one width-128 run costs more CPU
# than one run of each of the three together (docs/studies.md), and the quick's 72 runs then end in minutes.
QUICK_POINTS = {"instabilities": [{"model.width": 16, "model.n_heads": 1}, {"model.width": 32, "model.n_heads": 2},
                                  {"model.width": 64, "model.n_heads": 4}]}
# Studies whose fast step is not compiled: realtext_warmup's runs are 2,048 tokens a step, their time the matmuls'
# (a compile's fixed batches of 8 would pad its quick set's 4 runs per structure to 8, and its depth-12 step's
# trace held 4.4 GB and had not compiled after 16 min on a shared 2-core machine)
UNCOMPILED_STUDIES = ("realtext_warmup",)


def _config(name: str) -> Path:
    return CONFIGS / ("warmup.yaml" if name == "warmup" else f"studies/{name}.yaml")


def _spec(name: str, quick: bool) -> Sweep:
    sets = QUICK_SETS.get(name, ["seeds=0,1"]) if quick else []
    if not (quick and name in QUICK_POINTS):
        return load_sweep(_config(name), sets)
    data = read_mapping(_config(name))
    points = QUICK_POINTS[name]
    axes = {key: {"choice": list(dict.fromkeys(point[key] for point in points))} for key in points[0]}
    return build_sweep({**data, "sample": {**axes, "points": points}}, sets)


def _explanations(out: Path, quick: bool) -> tuple[Folder, int, list[str], str]:
    """warmup_explanations: each row's sweep into OUT/warmup_explanations/<row> (studies/explanations.py),
    read as one folder; its figures (final loss per row and lr, sharpness against its thresholds) and
    table."""
    from normexp.compare import load_folders
    from normexp.figures import save_sharpness_plot
    from normexp.studies.verdicts import _judged

    resumed = 0
    rows = row_specs(_config(EXPLANATIONS), quick)
    for row, spec in rows.items():
        resumed += _sweep(row, spec, out / EXPLANATIONS)[1]
    run_dir = out / EXPLANATIONS
    folder = load_folders([run_dir / row for row in rows])
    summary = _judged(folder)
    paths = [final_loss_by_row(summary, run_dir / "final_loss.png", folder.trained_rule())]
    if folder.has_sharpness():
        paths.append(save_sharpness_plot(folder, run_dir / "sharpness.png", ["sweep", "optim.lr"]))
    return folder, resumed, [str(p.relative_to(out)) for p in paths], explanations_table(summary)


def _sweep(name: str, spec: Sweep, out: Path) -> tuple[Path, int]:
    """Run (or resume) one study's sweep on a worker process per core (the studies' configs ask for
    one torch thread per run: their runs are small enough that N single-thread processes train more
    of them per second than one N-thread process). Return the folder and how many of its runs an
    earlier call had already finished."""
    workers = min(usable_cores(), MAX_STUDY_WORKERS)
    outcome = run_sweep(spec, out / name, SweepOptions(engine="fast" if name in FAST_STUDIES else "batched",
                                                       workers=workers if workers > 1 else None,
                                                       compile=False if name in UNCOMPILED_STUDIES else None))
    return out / name, outcome.count("skipped")


@dataclass(frozen=True)
class Study:
    name: str  # its folder under OUT, its section of REPORT.md, and the NAME of `normexp studies NAME`
    about: str  # one line: what `normexp studies --list` says of it
    question: str  # REPORT.md's question
    verdict: Callable[..., str] | None = None  # None: gradnorm and norms, which have their own measurements
    x_key: str | None = None  # a final-loss figure against this key
    when_named: bool = False  # run only when named (`normexp studies NAME`), not by `make studies`: hours of runs


# Every study, in the order they run and REPORT.md shows them: the sweeps (configs/warmup.yaml and
# configs/studies/NAME.yaml), then the measurements at init and of the norms themselves.
STUDIES = (
    Study("warmup", "the article's table: Post-LN vs Pre-LN without warmup, LayerNorm vs RMSNorm, depth 32",
          "The article's table: does Post-LN train without warmup? (depth 32, Adam 0.01, 30 steps)", article_verdict),
    Study("lr_warmup", "learning rate x warmup per placement: where Post-LN starts to train",
          "Where does Post-LN start to train as learning rate and warmup change?", lr_warmup_verdict),
    Study("depth", "depth 2..64: does the Post/Pre gap grow with depth?", "Does the Post/Pre gap grow with depth?",
          depth_verdict, "model.depth"),
    Study("placements", "every placement x every norm kind: which train without warmup",
          "Every placement x every norm kind: which train without warmup?", placements_verdict),
    Study("lr_sensitivity", "learning-rate sensitivity of every placement, with and without warmup",
          "Which placement is least sensitive to the learning rate, with and without warmup? "
          "(Wortsman et al. 2023's yardstick: 7 learning rates 1e-4..1e-1, 60 steps)", lr_sensitivity_verdict),
    Study("transformer_warmup", "Xiong et al.'s warmup question on a 16-layer causal Transformer (fast engine)",
          "On a 16-layer causal Transformer (assoc_recall), where does Post-LN train, and where does warmup "
          "rescue it? Post / Pre / B2T / DeepNorm x Adam lr x warmup (fast engine)", transformer_warmup_verdict),
    Study("realtext_warmup", "Xiong et al.'s warmup question on Shakespeare by character (fast engine; run when named)",
          "On Shakespeare's plays by character, does Post-LN without warmup stay at the unigram floor, does warmup "
          "rescue it and from which length, and is Pre-LN (and Peri-LN) indifferent to warmup? Post / Pre / Peri "
          "x depth 6, 12 x Adam lr x warmup 0, 50, 200 of 300 steps (fast engine)", realtext_warmup_verdict,
          when_named=True),
    Study("blocks", "per-block gradients and Adam updates over the first steps, Post-LN vs Pre-LN",
          "Inside the blocks: how large are each block's gradients and Adam updates over the first steps, "
          "Post-LN vs Pre-LN, with and without warmup?", blocks_verdict),
    Study("instabilities", "Wortsman et al. 2023: qk-norm and the z-loss on a 4-layer causal Transformer",
          "Wortsman et al. 2023 at toy scale: do qk-norm and the z-loss lower the learning-rate sensitivity of a "
          "4-layer causal Transformer, Pre / Post / Peri-LN, LayerNorm or DyT, and do its attention logits and "
          "output log Z grow at high learning rates as theirs did?", instabilities_verdict),
    Study(EXPLANATIONS, "why warmup rescues Post-LN: warmup, clipping, AGC, T-Fixup, Adam's variance, sharpness",
          "Post-LN without warmup on the article's toy: which of warmup, clipping (norm 1), AGC (0.01), T-Fixup "
          "without norm, Adam-2k (k = 3, 10% of the steps), a large epsilon (1e-3), GI-Adam and both RAdam "
          "variants rescue it, at which lr; and does warmup's rescue keep the sharpness under its "
          "edge-of-stability threshold while the failing runs cross it? (Pre-LN: the control)",
          explanations_verdict),
    Study("gradnorm", "Xiong et al. at init: the last block's gradient and hidden-state norms against depth",
          "Xiong et al. at initialisation: how does the last block's gradient scale with depth, and how do "
          "hidden-state norms grow?"),
    Study("norms", "the RMSNorm facts of seed 001 and LayerNorm vs RMSNorm speed, measured here",
          "The RMSNorm facts of shared/seeds/001, measured here; and LayerNorm vs RMSNorm speed"),
)
NAMES = tuple(study.name for study in STUDIES)


def _what_mattered(folder) -> str:
    """The study's "what mattered" table (the ANOVA of its final metric on its axes), or why it has none."""
    from normexp.analysis.anova import what_mattered
    from normexp.results import ResultsError
    from normexp.tables import anova_to_markdown

    try:
        return anova_to_markdown(what_mattered(folder, only_last=True))
    except ResultsError as exc:
        return f"What mattered: not computed ({exc}).\n"


def run_studies(out: Path, quick: bool = False, log: Callable[[str], None] = print,
                names: Sequence[str] | None = None) -> Path:
    """Run (or resume) the studies named (by default every study but those run only when named,
    `Study.when_named`; in STUDIES' order whatever the order given) into `out` and write out/REPORT.md
    and REPORT.html; return REPORT.md's path. Every chosen study's folder is checked before the first
    trains: one in use, or holding another sweep, is refused (StoreError) with nothing trained."""
    from normexp.config import RunConfig  # noqa: F401 - torch-backed modules below
    from normexp.diagnostics import gradnorm_study, norm_properties, norm_speed
    from normexp.figures import save_gradnorm_plot

    unknown = sorted(set(names or ()) - set(NAMES))
    if unknown:
        raise ValueError(f"no such study: {', '.join(unknown)}")
    chosen = [study for study in STUDIES if (study.name in names if names is not None else not study.when_named)]
    out.mkdir(parents=True, exist_ok=True)
    sections, times = [], {}
    studies = [study for study in chosen if study.verdict is not None]  # the sweeps
    specs = {study.name: _spec(study.name, quick) for study in studies}
    checked = [(out / name, spec) for name, spec in specs.items() if name != EXPLANATIONS]
    if EXPLANATIONS in specs:
        checked += [(out / EXPLANATIONS / row, spec) for row, spec in row_specs(_config(EXPLANATIONS), quick).items()]
    for path, spec in checked:  # before anything trains, not after the studies before it
        refuse_another_sweep(path, spec, remedy="choose another --out")
        owner = lock_owner(path)
        if owner is not None:
            raise StoreError(f"{path}: another sweep is writing here ({owner}); wait for it, or choose "
                             "another --out")
    for study in studies:
        name = study.name
        log(f"study {name} ...")
        start = time.perf_counter()
        if name == EXPLANATIONS:
            folder, resumed, figures, table = _explanations(out, quick)
            run_dir = out / name
        else:
            run_dir, resumed = _sweep(name, specs[name], out)
            folder = load_folder(run_dir)  # read and verified once for the study's table, figures and verdict
            figures = study_figures(folder, study.x_key)
        sensitivity = (sensitivity_to_markdown(build_sensitivity(folder), sensitivity_engines(folder))
                       if name.startswith("lr_") or name == "instabilities" else "")
        table = (table if name == EXPLANATIONS else sensitivity if name in ("lr_sensitivity", "instabilities")
                 else to_markdown(build_report(folder, only_last=True)))
        if name == "lr_warmup":
            from normexp.report import build_pivot, pivot_to_markdown

            table += "\n" + pivot_to_markdown(build_pivot(folder, "optim.lr", "schedule.warmup_steps"))
            table += "\n" + sensitivity
        table += "\n" + _what_mattered(folder)
        note = missing_note(folder.latest, run_dir)
        verdict_text = study.verdict(folder) + (f" {note}." if note else "")
        times[name] = time.perf_counter() - start
        earlier = f"{resumed} of its runs {'was' if resumed == 1 else 'were'} done by an earlier call"
        sections.append(_section(study.question, name, table, figures, verdict_text, times[name],
                                 earlier if resumed else ""))

    by_name = {study.name: study for study in chosen}
    if "gradnorm" in by_name:
        log("study gradnorm ...")
        start = time.perf_counter()
        spec = load_sweep(CONFIGS / "studies" / "gradnorm.yaml", ["seeds=0,1,2"] if quick else [])
        summary = gradnorm_study(spec, out / "gradnorm")
        save_gradnorm_plot(summary, out / "gradnorm" / "gradnorm.png")
        times["gradnorm"] = time.perf_counter() - start
        sections.append(_section(by_name["gradnorm"].question, "gradnorm", gradnorm_to_markdown(summary),
                                 ["gradnorm/gradnorm.png"], gradnorm_verdict(summary), times["gradnorm"]))

    if "norms" in by_name:
        log("norm facts and speed ...")
        start = time.perf_counter()
        props = norm_properties()
        timings = norm_speed([(64, 32)] + ([] if quick else [SPEED_SHAPE]), repeats=3)
        times["norms"] = time.perf_counter() - start
        sections.append(_section(by_name["norms"].question, "norms",
                                 properties_to_markdown(props) + "\n" + speed_to_markdown(timings), [],
                                 props_verdict(props) + " " + speed_verdict(timings), times["norms"]))
    report = out / "REPORT.md"
    total = sum(times.values())
    quick_flag = " --quick" if quick else ""
    written = (f"`make studies` (`normexp studies{quick_flag}`)" if names is None else
               f"`normexp studies {' '.join(s.name for s in chosen)}{quick_flag}` ({len(chosen)} of the "
               f"{len(STUDIES)} studies)")
    header = (f"# normexp studies\n\nWritten by {written}; every verdict below is computed from these runs. "
              f"Total {total / 60:.1f} min on {usable_cores()} cores.\n")
    report.write_text(header + "\n".join(sections))
    log(f"wrote {report}")
    from normexp.page import markdown_page  # the same report as one page to send: figures inline

    page = out / "REPORT.html"
    page.write_text(markdown_page(report.read_text(), out), encoding="utf-8")
    log(f"wrote {page}")
    return report


def _section(question: str, name: str, table: str, figures: list[str], verdict: str, seconds: float,
             resumed: str = "") -> str:
    images = "\n".join(f"![{Path(f).stem}]({f})" for f in figures)
    return f"\n## {name}\n\n**Question.** {question}\n\n{table}\n{images}\n\n**Verdict.** {verdict}\n\n" \
           f"_Runtime: {seconds:.0f} s{f' ({resumed})' if resumed else ''}._\n"
