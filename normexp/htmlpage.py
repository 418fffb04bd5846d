"""One self-contained HTML page: `normexp report DIR --format html -o FILE.html` and the studies' REPORT.html.

The page carries everything it shows: figures inline as base64 PNG (`data:` URLs), its style in a
<style> element, no script or font or image from anywhere else, so that it opens the same from a mail
attachment, offline, years later. What it holds: the title (the metric, the constants that define the
runs, what each cell pools), the table, the verdicts (counts, and every column's verdict under
"every column"), the figures, and the provenance (where the runs are, what trained them and with which
normexp, torch and CPU, each invocation's command line, the sweep file).

One inline script checks, once the page has loaded, that every figure decoded, and writes the outcome
in the <body>'s `data-figures` attribute (`ok`, or `broken: N`); a headless browser reads it back
(tests/test_html.py).
"""

from __future__ import annotations

import base64
import html
import io
import re
from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure

from normexp.folder import read_history
from normexp.report import PARTIAL_NOTE, Report, grid_cells
from normexp.results import Folder

PAGE_DPI = 110  # figures inline: sharp on screen, a few hundred kB each

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1200px;
       padding: 0 1em; color: #222; line-height: 1.45; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.85em; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; white-space: nowrap; }
th { background: #f3f3f3; } td.label, th.label { text-align: left; }
.table { overflow-x: auto; }
figure { margin: 1.5em 0; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-size: 0.85em; color: #555; }
.verdict { background: #f6f8fa; border-left: 4px solid #2a7; padding: 0.5em 1em; }
.note { color: #a00; } pre { background: #f6f8fa; padding: 0.8em; overflow-x: auto; font-size: 0.8em; }
dl { display: grid; grid-template-columns: max-content auto; gap: 0.2em 1em; font-size: 0.9em; }
dt { font-weight: bold; } dd { margin: 0; }
"""

CHECK_FIGURES = """
window.addEventListener("load", function () {
  var images = Array.prototype.slice.call(document.images);
  var broken = images.filter(function (img) { return !img.complete || img.naturalWidth === 0; }).length;
  document.body.setAttribute("data-figures", broken ? "broken: " + broken : "ok");
});
"""


def page(title: str, body: str) -> str:
    """A whole HTML document around `body` (already HTML), with the style and the figures' check."""
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{html.escape(title)}</title>\n<style>{STYLE}</style>\n</head>\n"
            f'<body data-figures="pending">\n{body}\n<script>{CHECK_FIGURES}</script>\n</body>\n</html>\n')


def figure_html(figure: Figure | bytes, caption: str = "", note: str = "") -> str:
    """A figure (drawn, or a PNG file's bytes) as an inline PNG with its caption."""
    if isinstance(figure, Figure):
        if note:
            figure.text(0.005, 0.005, note, fontsize="x-small", color="darkred", ha="left", va="bottom", wrap=True)
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=PAGE_DPI)
        import matplotlib.pyplot as plt

        plt.close(figure)
        figure = buffer.getvalue()
    data = base64.b64encode(figure).decode("ascii")
    alt = html.escape(caption or "figure", quote=True)
    below = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
    return f'<figure><img alt="{alt}" src="data:image/png;base64,{data}">{below}</figure>'


def table_html(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """A table; its first `left` columns (the labels) aligned left, the numbers right."""
    def cells(values: Sequence[str], tag: str) -> str:
        return "".join(f'<{tag}{" class=label" if i < left else ""}>{html.escape(str(v))}</{tag}>'
                       for i, v in enumerate(values))

    body = "".join(f"<tr>{cells(row, 'td')}</tr>" for row in rows)
    return f'<div class="table"><table><thead><tr>{cells(header, "th")}</tr></thead><tbody>{body}</tbody></table></div>'


def report_page(report: Report, folder: Folder, figures: Sequence[tuple[str, Figure, str]] = ()) -> str:
    """`normexp report --format html`: the step table, its verdicts, the sweep's figures, the provenance."""
    title, *notes = report.title.split("\n")
    header, rows = grid_cells(report)
    parts = [f"<h1>{html.escape(title)}</h1>", *(f"<p>{html.escape(n)}</p>" for n in notes if n.strip())]
    parts.append(table_html(header, rows, left=1))
    if report.partial:
        parts.append(f"<p>{html.escape(PARTIAL_NOTE)}</p>")
    if report.metric == "loss":
        counted, full = report.verdict_line(), report.verdict_line(full=True)
        parts.append(f'<p class="verdict">{html.escape(counted)}</p>')
        if counted != full:
            parts.append(f"<details><summary>every column</summary><p>{html.escape(full)}</p></details>")
    for line in (report.engines, report.missing):
        if line:
            parts.append(f'<p class="note">{html.escape(line)}</p>')
    if figures:
        parts.append("<h2>Figures</h2>")
        parts += [figure_html(fig, _caption(suffix), note) for suffix, fig, note in figures]
    parts.append(provenance_html(folder))
    return page(title, "\n".join(parts))


def _caption(suffix: str) -> str:
    return {"": "curves per step", "-lr": "final training loss against the learning rate",
            "-phase": "phase diagram: where the runs train"}.get(suffix, suffix)


def provenance_html(folder: Folder) -> str:
    """Where the runs are and what made them: each folder's invocations (time, command, normexp, commit,
    torch, CPU, engine) and its latest sweep file."""
    folders = getattr(folder, "folders", None) or [(folder.path.name, folder)]
    parts = ["<h2>Provenance</h2>"]
    for name, one in folders:
        history = read_history(one.path)
        summary = one.summary
        finished = int(summary["status"].isin(("completed", "diverged")).sum())
        facts = {"folder": str(one.path.resolve()), "runs": f"{finished} finished of {len(summary)}",
                 "engines": ", ".join(sorted(map(str, summary["engine"].dropna().unique()))) if "engine" in summary
                 else "unknown"}
        if history:
            last = history[-1]
            facts.update({k: str(last.get(k, "")) for k in ("normexp", "commit", "torch", "cpu") if last.get(k)})
        rows = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in facts.items())
        parts.append(f"<h3>{html.escape(name)}</h3><dl>{rows}</dl>")
        if history:
            lines = "\n".join(f"{h.get('time', '?')}  {h.get('command', '?')}" for h in history)
            parts.append(f"<details><summary>{len(history)} invocation(s)</summary><pre>{html.escape(lines)}</pre>"
                         "</details>")
            text = history[-1].get("sweep_file") or ""
            if text:
                parts.append(f"<details><summary>sweep file (latest)</summary><pre>{html.escape(text)}</pre></details>")
    return "\n".join(parts)


# ----------------------------------------------------------------------------- the studies' REPORT.html


def markdown_page(markdown: str, base: Path, title: str = "normexp studies") -> str:
    """REPORT.md as one page: its headings, paragraphs, bold, code, markdown tables and images (read from
    `base` and inlined). Only the markdown normexp writes is understood; anything else is shown as text."""
    out, table, lines = [], [], markdown.splitlines()

    def flush_table() -> None:
        if table:
            header, *rows = [[c.strip() for c in _split_row(row)] for row in table if not _is_rule(row)]
            numeric = [bool(re.match(r"^-?[\d.]", rows[0][i])) if rows and i < len(rows[0]) else False
                       for i in range(len(header))]
            left = next((i for i, n in enumerate(numeric) if n), len(header))
            out.append(table_html([_inline_text(h) for h in header], [[_inline_text(c) for c in r] for r in rows],
                                  left=max(left, 1)))
            table.clear()

    for line in lines:
        if line.startswith("|"):
            table.append(line)
            continue
        flush_table()
        image = re.fullmatch(r"!\[([^\]]*)\]\(([^)]+)\)", line.strip())
        if image:
            path = base / image.group(2)
            out.append(figure_html(path.read_bytes(), image.group(1)) if path.is_file()
                       else f'<p class="note">missing figure: {html.escape(image.group(2))}</p>')
        elif line.startswith("#"):
            level = min(len(line) - len(line.lstrip("#")), 3)
            out.append(f"<h{level}>{_inline(line.lstrip('#').strip())}</h{level}>")
        elif line.startswith("- "):
            out.append(f"<p>• {_inline(line[2:])}</p>")
        elif line.strip():
            out.append(f"<p>{_inline(line)}</p>")
    flush_table()
    return page(title, "\n".join(out))


def _split_row(row: str) -> list[str]:
    """A markdown table row's cells (a `\\|` inside a cell is a `|` of its text)."""
    cells = re.split(r"(?<!\\)\|", row.strip().strip("|"))
    return [c.replace("\\|", "|") for c in cells]


def _is_rule(row: str) -> bool:
    return bool(re.fullmatch(r"\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?", row.strip()))


def _inline_text(text: str) -> str:
    """A cell's text without markdown's emphasis and escapes (table_html escapes it for HTML)."""
    return re.sub(r"\\(.)", r"\1", text.replace("**", "").replace("<br>", " "))


def _inline(text: str) -> str:
    """**bold**, _italic_ and `code` of one line, the rest escaped."""
    text = html.escape(text)
    text = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", text)
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
    return re.sub(r"(?<![\w])_(.+?)_(?![\w])", r"<i>\1</i>", text)
