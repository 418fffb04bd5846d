"""The warmup_explanations study's verdict (normexp/studies/explanations.py) follows from its own numbers:
synthetic summaries and sharpness rows, the findings recomputed here independently, and the text checked
against them."""

from __future__ import annotations

import itertools

import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from normexp.studies.explanations import (
    BASELINE,
    CONTROL,
    FAMILIES,
    ROWS,
    explanations_findings,
    explanations_table,
    explanations_text,
)

LRS = (0.001, 0.003, 0.01, 0.03)
SEEDS = (0, 1)


@st.composite
def frames(draw):
    rows = [BASELINE, *draw(st.lists(st.sampled_from([r for r in ROWS if r != BASELINE]), unique=True,
                                     min_size=1, max_size=5))]
    lrs = draw(st.lists(st.sampled_from(LRS), unique=True, min_size=1, max_size=4))
    summary, sharp = [], []
    for row, lr, seed in itertools.product(rows, lrs, SEEDS):
        trained = draw(st.booleans())
        summary.append({"sweep": row, "optim.lr": lr, "seed": seed, "trained": trained,
                        "status": "completed" if trained or draw(st.booleans()) else "diverged",
                        "final_loss": 0.01 if trained else 2.0})
        for step in (0, 10):
            lam = draw(st.floats(0.1, 1000.0))
            pre = draw(st.one_of(st.just(float("nan")), st.floats(1.0, 1e5)))
            sharp.append({"sweep": row, "optim.lr": lr, "seed": seed, "step": step, "lambda_max": lam,
                          "precond_lambda_max": pre, "threshold_gd": 2 / lr, "threshold_adam": 38 / lr})
    return pd.DataFrame(summary), pd.DataFrame(sharp)


def _independent(summary, sharp):
    ok = {(r, lr): all(g["trained"]) for (r, lr), g in summary.groupby(["sweep", "optim.lr"])}
    failing = sorted(lr for (r, lr), v in ok.items() if r == BASELINE and not v)
    rescues = {r: [lr for lr in failing if ok.get((r, lr), False)]
               for r in set(summary["sweep"]) - {BASELINE, CONTROL}}
    crossed = {}
    for (r, lr), g in sharp.groupby(["sweep", "optim.lr"]):
        crossed[(r, lr)] = any((a > b) or (c > d) for a, b, c, d in
                               zip(g["lambda_max"], g["threshold_gd"], g["precond_lambda_max"], g["threshold_adam"]))
    return failing, rescues, crossed


@settings(max_examples=60, deadline=None)
@given(frames())
def test_findings_and_text_follow_the_numbers(data):
    summary, sharp = data
    found = explanations_findings(summary, sharp)
    failing, rescues, crossed = _independent(summary, sharp)
    assert found.failing == failing
    assert found.rescues == rescues
    assert found.crossed == crossed
    text = explanations_text(found)
    if not failing:
        assert "nothing to rescue" in text
        return
    assert f"fails at lr {', '.join(f'{lr:g}' for lr in failing)}." in text
    for row, rates in rescues.items():
        if rates:
            assert f"{row} rescues it at lr {', '.join(f'{lr:g}' for lr in rates)}." in text
        else:
            assert row in text.split("No rescue at any failing lr: ")[1].split(".")[0]
    supported = sorted({FAMILIES[r] for r, rates in rescues.items() if rates and r in FAMILIES})
    assert f"The toy supports: {', '.join(supported) if supported else 'none of the controls'}" in text
    warm = [crossed[("warmup", lr)] for lr in rescues.get("warmup", [])]
    base = [crossed[(BASELINE, lr)] for lr in failing]
    sharp_holds = bool(warm) and not any(warm) and all(base)
    assert ("sharpness (edge-of-stability) account of warmup" in text) == sharp_holds
    if warm:
        assert ("kept lambda_max under 2/lr" in text) == (not any(warm))
    assert ("Every failing run without warmup crossed a stability threshold" in text) == all(base)
    ok_cells = [crossed[key] for key, v in
                ((k, all(g["trained"])) for k, g in summary.groupby(["sweep", "optim.lr"])) if v]
    if ok_cells:
        assert f"So did {sum(ok_cells)} of the {len(ok_cells)} measured cells whose every seed trained" in text
    if "warmup" in rescues and not rescues["warmup"]:
        assert "warmup rescues no failing lr here" in text


def test_a_cell_with_one_untrained_seed_is_not_rescued():
    summary = pd.DataFrame([
        {"sweep": BASELINE, "optim.lr": 0.01, "seed": 0, "trained": False, "status": "completed", "final_loss": 2.0},
        {"sweep": "clip", "optim.lr": 0.01, "seed": 0, "trained": True, "status": "completed", "final_loss": 0.01},
        {"sweep": "clip", "optim.lr": 0.01, "seed": 1, "trained": False, "status": "completed", "final_loss": 2.0},
        {"sweep": "warmup", "optim.lr": 0.01, "seed": 0, "trained": True, "status": "completed", "final_loss": 0.01},
    ])
    found = explanations_findings(summary, pd.DataFrame())
    assert found.rescues == {"clip": [], "warmup": [0.01]}
    text = explanations_text(found)
    assert "warmup rescues it at lr 0.01." in text and "No rescue at any failing lr: clip." in text
    assert "sharpness unmeasured" in text and "So did" not in text
    assert "| clip | 1/2 · 1 |" in explanations_table(summary)  # the mean of 0.01 and 2.0, 3 digits
