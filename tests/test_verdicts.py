"""Every verdict sentence of the studies is computed from the numbers: the same function, given numbers
that contradict a claim, no longer makes it. Folders are written through the store with chosen losses (no
training), gradnorm summaries are built by hand."""

from __future__ import annotations

from normexp.analysis.gradnorm import GradnormSummary
from normexp.config import build_sweep, parse_yaml
from normexp.folder import FinishedRun, atomic_write, run_id, write_run, write_summary
from normexp.studies.verdicts import article_verdict, gradnorm_verdict, lr_warmup_verdict


def folder(tmp_path, text: str, final_loss) -> object:
    """A sweep folder of `text`'s runs, each with losses [2.3, 1.5, final_loss(cfg)]."""
    sweep = build_sweep(parse_yaml(text))
    out = tmp_path / sweep.name
    out.mkdir(parents=True)
    atomic_write(out / "sweep.yaml", sweep.to_yaml())
    for cfg in sweep.runs:
        metrics = {"step": [0, 1, 2], "loss": [2.3, 1.5, final_loss(cfg)], "acc": [0.1] * 3, "lr": [0.01] * 3,
                   "grad_norm": [1.0] * 3}
        write_run(out / run_id(cfg), cfg, FinishedRun(metrics, "completed", 0.1, 1, "reference", "cpu"))
    write_summary(out, sweep.runs)
    return out


ARTICLE = """\
name: article
base: {model: {depth: 2, width: 4}, train: {steps: 2}}
grid: {norm.placement: [post, pre], norm.kind: [layernorm, rmsnorm]}
"""


def test_the_article_verdict_says_the_placement_decides_only_when_it_does(tmp_path):
    as_in_the_article = folder(tmp_path / "a", ARTICLE, lambda cfg: 2.2 if cfg.norm.placement == "post" else 0.02)
    assert "where the norm sits decides whether the model trains" in article_verdict(as_in_the_article)
    assert "After 2 steps" in article_verdict(as_in_the_article)  # the folder's steps, not the article's 30
    both_train = folder(tmp_path / "b", ARTICLE, lambda cfg: 0.02)
    said = article_verdict(both_train)
    assert "decides whether" not in said and "both train alike" in said


LR_WARMUP = """\
name: lrw
base: {model: {depth: 2, width: 4}, schedule: {kind: linear_warmup}, train: {steps: 2}}
grid: {norm.placement: [post, pre], optim.lr: [0.001, 0.01, 0.1], schedule.warmup_steps: [0, 5]}
"""


def test_warmup_rescuing_post_ln_at_small_learning_rates_only_is_said_only_when_so(tmp_path):
    def small(cfg):  # warmup rescues lr 0.001 and 0.01; nothing rescues 0.1
        rescued = cfg.schedule.warmup_steps and cfg.optim.lr < 0.1
        return 0.02 if cfg.norm.placement == "pre" or rescued else 2.2

    said = lr_warmup_verdict(folder(tmp_path / "a", LR_WARMUP, small))
    assert "train where it fails without warmup at lr 0.001, lr 0.01, and only below" in said

    def large(cfg):  # warmup rescues lr 0.1 only; lr 0.001 fails whatever the warmup
        rescued = cfg.schedule.warmup_steps and cfg.optim.lr == 0.1
        return 0.02 if cfg.norm.placement == "pre" or rescued or cfg.optim.lr == 0.01 else 2.2

    said = lr_warmup_verdict(folder(tmp_path / "b", LR_WARMUP, large))
    assert "only below" not in said and "no warmup of the grid helps at lr 0.001" in said


def summary(post_slope: float, pre_slope: float, post_last: float, pre_last: float, c: float) -> GradnormSummary:
    """Two placements over depths 2 and 8; Pre-LN's stream grows by c per block, Post-LN's norm sees 1 + c."""
    return GradnormSummary(
        depths=[2, 8], last_grad={"post": [(1.0, 0.1), (post_last, 0.1)], "pre": [(1.0, 0.1), (pre_last, 0.1)]},
        slopes={"post": post_slope, "pre": pre_slope},
        stream_sq={"post": [1.0] * 8, "pre": [1 + c * b for b in range(8)]},
        norm_in_sq={"post": [1 + c] * 8, "pre": [float("nan")] * 8}, branch_gain=0.32)


def test_the_gradnorm_verdict_says_the_direction_rates_and_lemma_hold_only_when_they_do():
    xiong = gradnorm_verdict(summary(0.02, -0.48, 1.0, 0.5, 0.32))
    assert "direction matches Xiong" in xiong and "so do the rates" in xiong and "norms hold in form" in xiong
    reversed_ = gradnorm_verdict(summary(-0.6, 0.3, 0.3, 1.5, 0.9))
    assert "does not match Xiong" in reversed_ and "rates differ" in reversed_ and "do not hold in form" in reversed_
