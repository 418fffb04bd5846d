"""Tables other than the article's step table and pivot (those are `normexp.report`), and the rendering
primitives every table shares: one Rich table, one markdown table, one cell's text.

Every renderer takes computed numbers (`normexp.analysis`, `normexp.diagnostics`, `normexp.verify`) and
returns text or a Rich renderable; rich is imported lazily, so that a CSV or markdown path never loads it.
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Sequence

from normexp.analysis.anova import COLUMNS as ANOVA_COLUMNS
from normexp.analysis.variants import PLACEMENT_LABELS


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str) -> list[str]:
    """A markdown table's lines; `align` has one letter per column, l(eft) or r(ight). Every cell, the
    header's too, goes through `markdown_cell`, so that a `|` in its text (`max |diff|`) stays in it."""
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(markdown_cell(c) for c in cells) + " |"

    rule = "|" + "".join("---|" if a == "l" else "---:|" for a in align)
    return [line(header), rule, *map(line, rows)]



def markdown_cell(text: object) -> str:
    """`text` as one cell of a markdown (GFM) table: a `|` escaped, and a backslash where it would
    escape what follows (before ASCII punctuation; `lr \\ warmup` stays as it is); a line break as
    `<br>` (a raw one would end the row)."""
    text = "<br>".join(str(text).replace("\r\n", "\n").replace("\r", "\n").split("\n"))
    return _ESCAPING_BACKSLASH.sub(r"\\\\", text).replace("|", "\\|")



_ESCAPING_BACKSLASH = re.compile(r"\\(?=[!-/:-@\[-`{-~])")  # CommonMark: a backslash escapes ASCII punctuation



def rich_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str, title: str | None = None):
    """The same table as a rich.table.Table (rich is imported lazily), titled on the left. A cell too wide
    for the terminal wraps, folding a long word across lines, never cut to "…" (an identifier or number
    must be read whole); off a terminal, commands/console.show prints the table at its own width."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for name, a in zip(header, align):
        table.add_column(name, justify="left" if a == "l" else "right", overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table



def csv_number(value: float) -> str:
    """A number for a CSV cell, exactly (repr); empty where it is undefined (nan: a std over fewer than 2
    runs, a mean over none), so that a script reads a missing value, never a spread of 0."""
    value = float(value)
    return "" if math.isnan(value) else repr(value)



def number(value: float) -> str:
    """A loss as the article prints it (4 decimals); past 1e6 in scientific notation, so that a
    diverging run's cell stays narrow enough to be shown whole."""
    return f"{value:.4f}" if not abs(value) >= 1e6 or math.isinf(value) else f"{value:.4e}"



def gradnorm_tables(summary) -> tuple[list[str], list[list[str]], list[str]]:  # summary: GradnormSummary
    """Header, rows and closing lines of the gradnorm table (shared by Rich and markdown)."""
    from normexp.analysis.gradnorm import LayerGradnorm

    if isinstance(summary, LayerGradnorm):
        return layer_gradnorm_tables(summary)
    placements = list(summary.last_grad)
    header = ["depth L", *(f"{_gradnorm_label(p)}: ||grad W2_L||" for p in placements)]
    rows = [[str(depth), *(_mean_std(*summary.last_grad[p][i]) for p in placements)]
            for i, depth in enumerate(summary.depths)]
    deepest = summary.depths[-1]
    slopes = ", ".join(f"{_gradnorm_label(p)} {summary.slopes[p]:+.2f}" for p in placements)
    if len(summary.depths) < 2:
        slopes = "needs two depths or more (e.g. --set model.depth=8,16,32)"
    lines = [f"each cell: {_over_seeds(summary.seeds)}",
             f"fitted slope of log ||grad W2_L|| against log L: {slopes} (Xiong et al.: Post-LN 0, Pre-LN -0.5)"]
    for p in placements:
        stream, norm_in = summary.stream_sq[p], summary.norm_in_sq[p]
        lines.append(f"{_gradnorm_label(p)}, L={deepest}: ||x_l||^2/d entering blocks 1, L/2, L = "
                     f"{stream[0]:.2f}, {stream[len(stream) // 2]:.2f}, {stream[-1]:.2f}; "
                     f"||u||^2/d entering the norms, mean over blocks = {_nanmean(norm_in):.2f}")
    lines.append("Xiong et al. Lemma 2 (xavier_normal init): ||u||^2/d ~ 1.5 entering each Post-LN norm; "
                 "||x_l||^2/d ~ 1 + l/2 along the Pre-LN stream")
    gains = ", ".join(f"{_gradnorm_label(p)} {summary.measured_gain(p):.3f}" for p in placements)
    expected = f"{summary.branch_gain:.3f}" if summary.branch_gain is not None else "unknown for this init"
    lines.append(f"branch energy c = E||F(x)||^2/d per block, measured: {gains}; from the init, 2m/(1+m)^2 = "
                 f"{expected} (Xiong's N(0, 1/d) weights: 0.5). Lemma 2 with c: Post 1 + c, Pre 1 + c*l")
    return header, rows, lines



def layer_gradnorm_tables(summary) -> tuple[list[str], list[list[str]], list[str]]:  # LayerGradnorm
    """The Transformer's table: per layer, each variant's gradient of each sublayer's output projection;
    then per variant the last/first ratio and its verdict."""
    from normexp.analysis.gradnorm import GROWTH_FACTOR, SUBLAYERS

    columns = [(v, c) for v in summary.grads for c in SUBLAYERS]
    header = ["layer l", *(f"{_gradnorm_label(v)}: {SUBLAYERS[c]}" for v, c in columns)]
    rows = [[str(layer), *("—" if math.isnan(summary.grads[v][c][i][0]) else _mean_std(*summary.grads[v][c][i])
                           for v, c in columns)]
            for i, layer in enumerate(summary.layers)]
    lines = [f"each cell: {_over_seeds(summary.seeds)}"]
    if len(summary.depths) > 1:
        lines.append(f"depths {', '.join(map(str, summary.depths))}: each is its own variant (L=depth); "
                     "— where that model has no such layer")
    lines += [f"{_gradnorm_label(v)}: last/first layer " + ", ".join(
        f"{SUBLAYERS[c]} {summary.ratio(v, c):.2f} ({summary.verdict(v, c)})" for c in SUBLAYERS)
        for v in summary.grads]
    lines.append(f"verdict: grows above {GROWTH_FACTOR}x, shrinks below 1/{GROWTH_FACTOR}, flat between "
                 "(Xiong et al. Fig. 3: Post-LN grows with the layer index, Pre-LN flat)")
    return header, rows, lines



def _over_seeds(seeds: int) -> str:
    return f"mean ± std over {seeds} seed{'s' if seeds > 1 else ''}" + (
        " (one seed: no spread, so no std; add --set seeds=0,1,2)" if seeds == 1 else "")



def _mean_std(mean: float, std: float) -> str:
    """'mean ± std', or the mean alone where the std is undefined (nan: one seed)."""
    return f"{mean:.4f}" if math.isnan(std) else f"{mean:.4f} ± {std:.4f}"



def _gradnorm_label(variant: str) -> str:
    """'post kind="rmsnorm"' -> 'Post kind="rmsnorm"': the placement's label, then the other axes."""
    placement, _, rest = variant.partition(" ")
    return " ".join(filter(None, [PLACEMENT_LABELS.get(placement, placement), rest]))



def _nanmean(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan



def gradnorm_to_rich(summary):  # -> rich.console.Group
    from rich.console import Group
    from rich.text import Text

    header, rows, lines = gradnorm_tables(summary)
    table = rich_table(header, rows, "l" + "r" * (len(header) - 1),
                        title=f"gradient norms at initialisation ({_over_seeds(summary.seeds)})")
    return Group(table, *(Text(line) for line in lines))



def gradnorm_to_markdown(summary) -> str:
    header, rows, lines = gradnorm_tables(summary)
    out = markdown_table(header, rows, "l" + "r" * (len(header) - 1))
    return "\n".join(out + [""] + [f"- {line}" for line in lines]) + "\n"



def _fmt(value: object) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)



PROPERTY_HEADER = ["check", "measured", "expected", "article", "result"]



def _property_rows(props) -> list[list[str]]:  # props: list[normexp.diagnostics.Property]
    return [[p.name, _fmt(p.measured), p.expectation, p.article, "pass" if p.passed else "FAIL"] for p in props]



def properties_to_rich(props):
    return rich_table(PROPERTY_HEADER, _property_rows(props), "lllll",
                       title="RMSNorm facts (shared/seeds/001), measured here")



def properties_to_markdown(props) -> str:
    return "\n".join(markdown_table(PROPERTY_HEADER, _property_rows(props), "lrlrl")) + "\n"



def _speed_rows(timings) -> list[list[str]]:
    rows = []
    for t in timings:
        ln = next(x for x in timings if x.kind == "layernorm" and x.shape == t.shape)
        rows.append([str(t.shape), t.kind, f"{t.forward_ms:.3f}", f"{t.forward_ms / ln.forward_ms:.2f}x",
                     f"{t.backward_ms:.3f}", f"{t.backward_ms / ln.backward_ms:.2f}x"])
    return rows



SPEED_HEADER = ["shape", "norm", "forward ms", "vs LayerNorm", "fwd+bwd ms", "vs LayerNorm"]



def speed_to_rich(timings):
    return rich_table(SPEED_HEADER, _speed_rows(timings), "llrrrr",
                       title="norm speed on this machine (median of repeats, float32, CPU)")



def speed_to_markdown(timings) -> str:
    return "\n".join(markdown_table(SPEED_HEADER, _speed_rows(timings), "llrrrr")) + "\n"



SENSITIVITY_HEADER = ["variant", "LR sensitivity", "best lr", "l* (best seed-mean)", "lrs", "seeds", "runs",
                      "diverged", "missing"]



SENSITIVITY_NOTE = ("LR sensitivity = mean over the lr grid of [min(final loss, loss at init) - l*], l* the "
                    "lowest of those seed-means (the best lr's); ± the std over seeds (Wortsman et al. 2023). "
                    "Lower: less sensitive.")



def _sensitivity_value(row) -> str:  # row: normexp.sensitivity.Sensitivity
    if math.isnan(row.sensitivity):  # no run missing: the variant was never run at every lr (a sampled lr)
        return "— (an lr has no finished run)" if row.missing else "— (not run at every lr of the grid)"
    return f"{row.sensitivity:.4f}" + ("" if math.isnan(row.spread) else f" ± {row.spread:.4f}")



def _sensitivity_rows(rows: list) -> list[list[str]]:
    return [[r.label, _sensitivity_value(r), f"{r.best_lr:g}", f"{r.best_loss:.4f}", f"{r.lrs}/{r.grid_lrs}",
             str(r.seeds), str(r.runs), str(r.diverged), str(r.missing)] for r in rows]



def sensitivity_to_markdown(rows: list, engines: str = "") -> str:
    """`engines`: `engine_note` of the sweep, a line under the table ("" for none)."""
    table = markdown_table(SENSITIVITY_HEADER, _sensitivity_rows(rows), "lrrrrrrrr")
    return "\n".join([*table, "", SENSITIVITY_NOTE, *(["", f"**{engines}**"] if engines else [])]) + "\n"



def sensitivity_to_rich(rows: list, engines: str = ""):  # -> rich.console.Group
    from rich.console import Group
    from rich.text import Text

    table = rich_table(SENSITIVITY_HEADER, _sensitivity_rows(rows), "lrrrrrrrr", title="learning-rate sensitivity")
    return Group(table, Text(SENSITIVITY_NOTE), *([Text(engines, style="bold")] if engines else []))



def sensitivity_to_csv(rows: list) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["variant", "lr_sensitivity", "seed_std", "best_lr", "best_loss", "lrs", "grid_lrs", "seeds",
                     "runs", "diverged", "missing"])
    for r in rows:
        writer.writerow([r.label, csv_number(r.sensitivity), csv_number(r.spread), csv_number(r.best_lr),
                         csv_number(r.best_loss), r.lrs, r.grid_lrs, r.seeds, r.runs, r.diverged, r.missing])
    return buffer.getvalue()



VERIFY_HEADER = ["path", "problem", "fix"]



def verification_to_rich(result):  # result: normexp.verify.Verification -> rich.console.Group
    """The findings of `normexp verify` as a table, then one line: clean, or what is left to do."""
    from rich.console import Group
    from rich.text import Text

    rows = [[f.path, f.problem if f.severity == "problem" else f"note: {f.problem}", f.remedy]
            for f in result.findings]
    title = f"{result.out_dir}: {result.verified} of {result.runs} runs verified"
    parts = [rich_table(VERIFY_HEADER, rows, "lll", title=title)] if rows else [Text(title)]
    if result.clean:
        parts.append(Text("clean" + (" after the fixes above" if result.fixed and rows else ""), style="bold"))
    else:
        left = f"{result.remaining} problem{'s' if result.remaining != 1 else ''}"
        parts.append(Text(f"{left} {'left' if result.fixed else 'found'}: {result.next_step}", style="bold"))
    return Group(*parts)



ANOVA_HEADER = list(ANOVA_COLUMNS)  # term, df, sum_sq, mean_sq, F, p, share


def anova_cells(result) -> list[list[str]]:  # result: normexp.analysis.anova.Anova
    """The 'what mattered' table's rows as text: df whole, sums of squares and F to 4 digits, p to 2 (below
    1e-16: '< 1e-16'), the share of the variance in percent; an undefined value (the residual's F) '—'."""
    def text(value: float, spec: str) -> str:
        return "—" if math.isnan(value) else format(value, spec)

    rows = []
    for r in result.table.itertuples(index=False):
        p = "—" if math.isnan(r.p) else "< 1e-16" if r.p < 1e-16 else f"{r.p:.2g}"
        rows.append([r.term, f"{r.df:.0f}", text(r.sum_sq, ".4g"), text(r.mean_sq, ".4g"), text(r.F, ".4g"), p,
                     "—" if math.isnan(r.share) else f"{100 * r.share:.1f}%"])
    return rows


def anova_title(result) -> str:
    seeds = (f"{result.replicates} runs per cell (seeds as replicates)" if result.replicates > 1
             else "one run per cell" if result.replicates == 1 else "unbalanced")
    return (f"what mattered: type-II ANOVA of the final {result.metric} on {', '.join(result.factors)} "
            f"(main effects and two-way interactions; {result.n_runs} runs, {seeds})")


def anova_to_rich(result):  # -> rich.console.Group
    from rich.console import Group
    from rich.text import Text

    table = rich_table(ANOVA_HEADER, anova_cells(result), "lrrrrrr", title=anova_title(result))
    return Group(table, *(Text(note) for note in result.notes))


def anova_to_markdown(result) -> str:
    lines = [f"**{anova_title(result)}**", "", *markdown_table(ANOVA_HEADER, anova_cells(result), "lrrrrrr")]
    return "\n".join(lines + ([""] + [f"- {note}" for note in result.notes] if result.notes else [])) + "\n"


def anova_to_csv(result) -> str:
    """Exactly the columns term, df, sum_sq, mean_sq, F, p, share (numbers as repr, an undefined one empty);
    the notes are not part of it (the command says them on stderr)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(ANOVA_HEADER)
    for r in result.table.itertuples(index=False):
        writer.writerow([r.term, *(csv_number(v) for v in (r.df, r.sum_sq, r.mean_sq, r.F, r.p, r.share))])
    return buffer.getvalue()
