"""The studies' REPORT.md as one self-contained page (REPORT.html): its headings, paragraphs, bold, code,
markdown tables and images, each image read from disk and inlined as a PNG `data:` URL."""

from __future__ import annotations

import html
import re
from pathlib import Path

from normexp.page.document import figure_html, html_page, table_html


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
    return html_page(title, "\n".join(out))


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
