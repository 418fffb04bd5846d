"""`normexp report DIR --format html`: one interactive page per sweep folder (or per comparison of folders).

From the top: the sweep's name, its constants and how many runs it holds; the verdicts (and the
early-stop, engines and missing-runs lines the table shows); the article's step table; the curves (mean
± standard error over seeds, n in the hover, variants toggled from the legend); the phase diagram where
two numeric axes vary; "what mattered" (the type-II ANOVA of the final metric on the grid's axes); the
parallel coordinates of every run; every run in a sortable, filterable table; the provenance, which
names folders by their name and writes no absolute path.
"""

from __future__ import annotations

import html
import re
import shlex
from pathlib import Path

import pandas as pd

from normexp.analysis.anova import what_mattered
from normexp.analysis.finals import final_values, hold_stopped, numeric_axes
from normexp.analysis.variants import distinct_keys
from normexp.folder import read_history
from normexp.page.data import curves_data, parallel_data, phase_data
from normexp.page.document import html_page
from normexp.page.tables import anova_table, run_rows, step_table
from normexp.report import PARTIAL_NOTE, Report
from normexp.results import Folder, ResultsError, finished_runs

METRIC_LABELS = {"loss": "training loss", "acc": "training accuracy", "grad_norm": "gradient norm",
                 "lr": "learning rate", "val_loss": "held-out loss", "val_acc": "held-out accuracy",
                 "z_loss": "z-loss term"}
SECTIONS = (("verdict", "verdict"), ("table", "table"), ("curves", "curves"), ("phase", "phase diagram"),
            ("mattered", "what mattered"), ("parallel", "parallel coordinates"), ("runs", "runs"),
            ("provenance", "provenance"))


def page_path(folder: Folder) -> Path:
    """Where `report --format html` writes without -o: DIR/report.html; for folders compared side by side,
    report-A-vs-B.html in the current folder (no input folder is written into)."""
    folders = getattr(folder, "folders", None)
    if not folders:
        return folder.path / "report.html"
    return Path("report-" + "-vs-".join(re.sub(r"[^\w.-]+", "_", name) for name, _ in folders) + ".html")


def report_page(report: Report, folder: Folder, only_last: bool = False) -> str:
    """The whole page of `report` (built by `build_report` from `folder`, with the same `only_last`)."""
    metric, rule = report.metric, report.trained_below
    summary = folder.view(only_last)
    tidy = folder.metrics(all_config=True, only_last=only_last)
    keys = [*report.keys, *report.pooled]
    lines, _ = distinct_keys(summary, list(report.keys))  # compared folders, each at its own depth: the depth
    finals = final_values(tidy, metric, rule)
    label = METRIC_LABELS.get(metric, metric)
    data: dict[str, object] = {}
    title, *notes = report.title.split("\n")
    names = [name for name, _ in getattr(folder, "folders", ())] or [folder.path.name]
    parts = [f"<h1>{html.escape(' vs '.join(names))}: {html.escape(label)}</h1>",
             f'<p class="constants">{html.escape(title)}</p>',
             *(f"<p>{html.escape(n)}</p>" for n in notes if n.strip()), f"<p>{_counts(summary, report)}</p>"]
    parts += _verdicts(report, folder)
    parts += ['<h2 id="table">The table</h2>', step_table(report)]
    if report.partial:
        parts.append(f'<p class="aside">{html.escape(PARTIAL_NOTE)}</p>')

    curves = curves_data(hold_stopped(tidy), lines, metric, rule)  # stopped: held, as the figure and table hold it
    data["curves"] = {**curves, "label": label}
    parts += ['<h2 id="curves">Curves</h2>',
              f'<p class="lede">Each line: a variant\'s mean {html.escape(label)} per step over its runs whose loss is '
              "finite there; the band: ± one standard error of that mean (std / √n), n in the hover. Click a "
              "legend entry to hide its line, double-click to show it alone; drag to zoom, double-click to "
              "reset.</p>", *_pooled(curves), *_clipped(curves), '<div id="curves-chart" class="chart"></div>']

    axes = [k for k in numeric_axes(summary) if k in keys]
    if len(axes) >= 2:
        phase = phase_data(tidy, axes[0], axes[1], [k for k in lines if k not in axes[:2]], metric, rule)
        data["phase"] = {**phase, "label": f"final {label}" + (" (log scale)" if phase["log"] else ""),
                         "accuracy": metric.endswith("acc")}
        what = ("each run's final value, a point per sampled (x, y), the mean over its seeds (each seed in the "
                "hover)" if phase["sampled"] else "a cell's colour: the mean final value of its runs")
        parts += ['<h2 id="phase">Phase diagram</h2>',
                  f'<p class="lede">Where the runs train: {what}; outlined in red where every run trained '
                  f"({html.escape(report.rule)}). Hover a cell for its value, runs and trained count.</p>",
                  *_pooled(phase), '<div id="phase-panels" class="panels"></div>']

    parts += ['<h2 id="mattered">What mattered</h2>', _mattered(folder, metric, only_last, rule)]

    if keys:
        parallel = parallel_data(finals, distinct_keys(summary, keys)[0], metric)
        data["parallel"] = {**parallel, "label": f"final {label}", "accuracy": metric.endswith("acc")}
        each = (f"One line per finished run (all {parallel['runs']})" if not parallel["note"] else
                "One line per configuration")
        parts += ['<h2 id="parallel">Parallel coordinates</h2>',
                  f'<p class="lede">{each}, across the grid\'s axes to its final {html.escape(label)}, coloured by '
                  "it; a diverged run sits on the top tick. Drag along an axis to keep a range, click outside it "
                  "to clear.</p>", *_pooled({"pooled": parallel["note"]}),
                  '<div id="parallel-chart" class="parallel"></div>']

    parts += ['<h2 id="runs">Runs</h2>', _run_tools(), '<div id="runs-box">',
              run_rows(summary, finals, keys, metric), "</div>"]
    parts.append(provenance_html(folder))
    sections = [(a, t) for a, t in SECTIONS if f'id="{a}"' in "".join(parts)]
    return html_page(f"{' vs '.join(names)}: {label}", "\n".join(parts), data, nav=sections)


def _counts(summary: pd.DataFrame, report: Report) -> str:
    """'48 runs: 45 completed, 3 diverged · 16 variants'."""
    counts = summary["status"].value_counts()
    said = ", ".join(f"{int(n)} {status}" for status, n in counts.items())
    return html.escape(f"{len(summary)} runs: {said} · {len(report.columns)} variants")


def _verdicts(report: Report, folder: Folder) -> list[str]:
    parts = ['<h2 id="verdict">Verdict</h2>']
    if report.metric == "loss":
        counted, full = report.verdict_line(), report.verdict_line(full=True)
        parts.append(f'<p class="verdict">{html.escape(counted)}</p>')
        if counted != full:
            parts.append(f"<details><summary>every column</summary><p>{html.escape(full)}</p></details>")
    else:
        parts.append(f'<p class="aside">The verdicts judge the final training loss: this page shows '
                     f"{html.escape(report.metric)}; the training loss's page has them.</p>")
    for line, style in ((report.stopped, "aside"), (report.engines, "note"),
                        (_without_paths(report.missing, folder), "note")):
        if line:
            parts.append(f'<p class="{style}">{html.escape(line)}</p>')
    return parts


def _clipped(chart: dict) -> list[str]:
    return [f'<p class="aside">{html.escape(chart["clipped"])}.</p>'] if chart.get("clipped") else []


def _pooled(chart: dict) -> list[str]:
    return [f'<p class="aside">{html.escape(chart["pooled"])}.</p>'] if chart.get("pooled") else []


def _mattered(folder: Folder, metric: str, only_last: bool, rule: float | None) -> str:
    try:
        result = what_mattered(folder, metric, only_last, rule)
    except ResultsError as exc:
        return f'<p class="aside">{html.escape(str(exc))}.</p>'
    lede = (f'<p class="lede">Is it the placement, the learning rate, or their interaction? A type-II ANOVA of each '
            f"run's final {html.escape(metric)} on the grid's axes: main effects and two-way interactions, the "
            f"seeds as replicates ({result.n_runs} runs). Share: the term's part of the total sum of squares.</p>")
    notes = "".join(f'<p class="aside">{html.escape(note)}.</p>' for note in result.notes)
    return lede + anova_table(result) + notes


def _run_tools() -> str:
    kinds = (("", "all"), ("n", "not trained"), ("d", "diverged"), ("e", "stopped early"),
             ("m", "missing or failed"), ("t", "trained"))
    buttons = "".join(f'<button data-kind="{k}"{" class=on" if not k else ""}>{t}</button>' for k, t in kinds)
    return ('<div class="tools"><input id="runs-filter" type="search" placeholder="filter: words of a row, e.g. '
            f'post 0.01" aria-label="filter the runs"><span id="runs-tools">{buttons}</span>'
            '<span id="runs-count" class="aside"></span></div>'
            '<p class="aside">Click a column\'s name to sort by it (again: the other way); a run with no value '
            "sorts last.</p>")


def provenance_html(folder: Folder) -> str:
    """What made the runs, per folder (named, never by its absolute path): runs finished, engines, the
    latest invocation's normexp, commit, torch and CPU, every invocation's command line (paths reduced to
    their last part) and the latest sweep file."""
    folders = getattr(folder, "folders", None) or [(folder.path.name, folder)]
    parts = ['<h2 id="provenance">Provenance</h2>']
    for name, one in folders:
        history = read_history(one.path)
        summary = one.summary
        facts = {"folder": name, "runs": f"{len(finished_runs(summary))} finished of {len(summary)}",
                 "engines": ", ".join(sorted(map(str, summary["engine"].dropna().unique())))
                 if "engine" in summary else "unknown"}
        if history:
            last = history[-1]
            facts.update({k: str(last.get(k, "")) for k in ("normexp", "commit", "torch", "cpu") if last.get(k)})
        rows = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in facts.items())
        parts.append(f"<h3>{html.escape(name)}</h3><dl>{rows}</dl>")
        if history:
            lines = "\n".join(f"{h.get('time', '?')}  {_command(str(h.get('command', '?')))}" for h in history)
            parts.append(f"<details><summary>{len(history)} invocation(s)</summary><pre>{html.escape(lines)}</pre>"
                         "</details>")
            text = history[-1].get("sweep_file") or ""
            if text:
                parts.append(f"<details><summary>sweep file (latest)</summary><pre>{html.escape(text)}</pre></details>")
    return "\n".join(parts)


def _command(command: str) -> str:
    """A command line with each absolute path (or ~ path, alone or after `--opt=`) reduced to …/its name."""
    try:
        words = shlex.split(command)
    except ValueError:
        return _without_paths(command)
    out = []
    for word in words:
        option, equals, value = word.partition("=") if word.startswith("-") else ("", "", word)
        out.append(option + equals + _short_path(value))
    return " ".join(word if re.fullmatch(r"[\w@%+=:,./…-]+", word) else shlex.quote(word) for word in out)


def _short_path(word: str) -> str:
    if word.startswith(("/", "~")) or re.match(r"[A-Za-z]:[\\/]", word):
        name = re.split(r"[\\/]", word.rstrip("/\\"))[-1]
        return f"…/{name}" if name else "…"
    return word


def _without_paths(text: str, folder: Folder | None = None) -> str:
    """`text` with each absolute path in it reduced to …/its name (a folder's own path to its name)."""
    if folder is not None:
        for name, one in getattr(folder, "folders", None) or [(folder.path.name, folder)]:
            for path in {str(one.path), str(Path(one.path).resolve())}:
                text = text.replace(path, name)
    return re.sub(r"(?<![\w.)\]])(/[^\s'\",;()]+)", lambda m: _short_path(m.group(1)), text)
