"""The report page's tables as HTML: the article's step table (its wide form fitted to the page), every
run of the folder (sortable, filterable), and the "what mattered" ANOVA."""

from __future__ import annotations

import html
import math
import re
from collections.abc import Sequence

import pandas as pd

from normexp.analysis.variants import axis_label, is_null, value_label
from normexp.report import Report, grid_cells, spread_steps
from normexp.results import FINISHED

TALL = 24  # rows of the step table past which it scrolls in a box of its own
STEP_COLUMNS = 7  # step columns of a transposed table shown at once (first and last always): fits 1,400 px


def _cell(text: str) -> str:
    """'0.0512 ± 0.0031 (2 of 4)' as the mean, then its spread and count in a smaller line below."""
    match = re.fullmatch(r"(-?[\d.e+-]+|inf|nan)( ± .*| \(.*)", text)
    if not match:
        return html.escape(text)
    return f"{html.escape(match.group(1))}<small>{html.escape(match.group(2).strip())}</small>"


def step_table(report: Report, table_id: str = "steps") -> str:
    """The article's table (`grid_cells`: steps down and variants across, or past 6 variants the other way
    round with each variant's trained count). Transposed with more than STEP_COLUMNS steps, the steps
    between are folded away (a button shows them), so that the last step and `trained` fit 1,400 px."""
    header, rows = grid_cells(report)
    folded: set[int] = set()
    if report.is_transposed and len(report.steps) > STEP_COLUMNS:
        shown = set(spread_steps(report.steps, STEP_COLUMNS))
        folded = {1 + i for i, step in enumerate(report.steps) if step not in shown}

    def cls(i: int, label: bool) -> str:
        names = [n for n, on in (("label", label), ("more", i in folded)) if on]
        return f' class="{" ".join(names)}"' if names else ""

    head = "".join(f"<th{cls(i, i == 0 and report.is_transposed)}>{html.escape(h)}</th>" for i, h in enumerate(header))
    body = "".join("<tr>" + "".join(f"<td{cls(i, i == 0 and report.is_transposed)}>"
                                    f"{html.escape(v) if i == 0 else _cell(v)}</td>" for i, v in enumerate(row))
                   + "</tr>" for row in rows)
    attrs = f' id="{table_id}"' + (' class="fit"' if folded else "")
    button = (f'<button data-steps="{table_id}" data-more="show all {len(report.steps)} steps">show all '
              f"{len(report.steps)} steps</button> <span class=aside>{len(folded)} steps between are folded "
              "away, so that the last step and the trained count fit the page</span>" if folded else "")
    table = f"<table{attrs}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    tall = len(rows) > TALL  # hundreds of variants: the table scrolls in its own box, the charts stay near
    note = (f' <span class=aside>{len(rows)} rows: the table scrolls within its box</span>' if tall else "")
    return f'<div class="scroll{" tall" if tall else ""}">{table}</div>{button}{note}'


def run_rows(summary: pd.DataFrame, finals: pd.DataFrame, keys: Sequence[str], metric: str) -> str:
    """Every run of the folder, one row each: its id, its values of `keys`, seed, status, final `metric`
    (exact, in data-v), trained, last step and whether it stopped early; a run with no verified result
    says so in its status and has no numbers. A row's class says what it is, for the quick filters:
    t trained, n not trained, d diverged, e stopped early, m missing, failed or corrupt."""
    by_id = finals.set_index("run_id")[["final", "trained", "stopped", "step"]].to_dict("index") if len(finals) else {}
    header = ["run", *(axis_label(k) for k in keys), "seed", "status", f"final {metric}", "trained", "last step",
              "stopped early"]
    types = ["text", *("num" if _numeric(summary[k]) else "text" for k in keys), "num", "text", "num", "text", "num",
             "text"]
    head = "".join(f'<th data-type="{t}">{html.escape(h)}</th>' for h, t in zip(header, types))
    lines = []
    wanted = ["run_id", *keys, "seed", "status", "stopped_at", "train.stop_when"]
    read = [c for c in dict.fromkeys(wanted) if c in summary]
    for record in summary[read].to_dict("records"):
        run, status = str(record["run_id"]), str(record["status"])
        cells = [run, *(value_label(k, record[k]) for k in keys), str(record["seed"]), status]
        if status in FINISHED and run in by_id:
            one = by_id[run]
            final, trained, stopped, last = one["final"], bool(one["trained"]), bool(one["stopped"]), int(one["step"])
            value = "" if is_null(final) else repr(float(final))
            shown = "diverged" if status == "diverged" else "—" if not value else f"{float(final):.4g}"
            cells += [f'<td data-v="{value}">{shown}', "yes" if trained else "no", str(last),
                      _stopped(record) if stopped else ""]
            kinds = ["t" if trained else "n", *(["d"] if status == "diverged" else []), *(["e"] if stopped else [])]
        else:
            cells += ["<td>—", "—", "—", ""]
            kinds = ["m"]
        tds = "".join(c if c.startswith("<td") else f"<td>{html.escape(c)}" for c in cells)
        lines.append(f'<tr class="{" ".join(kinds)}">{tds}</tr>')
    return f'<table id="runs-table"><thead><tr>{head}</tr></thead><tbody>{"".join(lines)}</tbody></table>'


def _stopped(record: dict) -> str:
    """'at step 12 (trained)': where train.stop_when stopped the run, and by which rule."""
    at, why = record.get("stopped_at"), record.get("train.stop_when")
    step = "" if at is None or is_null(at) else f"at step {int(float(at))}"
    return " ".join(filter(None, [step, f"({why})" if why is not None and not is_null(why) else ""])) or "yes"


def _numeric(column: pd.Series) -> bool:
    return pd.api.types.is_numeric_dtype(column) and not pd.api.types.is_bool_dtype(column)


def anova_table(result) -> str:  # result: normexp.analysis.anova.Anova
    """The ANOVA's rows (term, df, sums of squares, F, p), each term's share of the variance as a bar."""
    from normexp.tables import anova_cells

    rows = []
    for cells, share in zip(anova_cells(result), result.table["share"]):
        term = " × ".join(axis_label(part) for part in cells[0].split(":")) if cells[0] != "Residual" else \
            "residual (seeds, higher interactions)"
        width = 0 if math.isnan(share) else max(0.0, min(1.0, float(share))) * 150
        bar = f'<td class="bar"><span class="share" style="width:{width:.0f}px"></span>{html.escape(cells[6])}</td>'
        rows.append("<tr><td class=label>" + html.escape(term) + "</td>"
                    + "".join(f"<td>{html.escape(c)}</td>" for c in cells[1:6]) + bar + "</tr>")
    head = "".join(f"<th{' class=label' if i in (0, 6) else ''}>{h}</th>" for i, h in
                   enumerate(["term", "df", "sum of squares", "mean square", "F", "p", "share of variance"]))
    table = f'<table id="anova"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
    return f'<div class="scroll">{table}</div>'
