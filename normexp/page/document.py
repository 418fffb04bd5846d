"""One self-contained HTML document: its style, its script, its data and the chart library inlined, so
that it opens the same from a mail attachment, offline, years later, and fetches nothing.

The chart library is Plotly's plotly.js, read from the `plotly` Python package (a dependency of normexp),
which ships it whole as `plotly/package_data/plotly.min.js` (MIT licence, about 4.8 MB). Plotly draws
what the page needs with no server and no network: hover values, zoom, legend toggling, heat maps,
parallel coordinates; its releases are tested and frequent. In the inlined text, each `://` is written
`:\\/\\/` (the same string to JavaScript): the page holds no literal URL, and the browser tests check
that it requests none.

Figures that are images (the studies' REPORT.html) are inlined as base64 PNG `data:` URLs.
"""

from __future__ import annotations

import base64
import html
import importlib.util
import io
import json
import re
from collections.abc import Sequence
from functools import cache
from pathlib import Path

from normexp.results import ResultsError

PAGE_DPI = 110  # an image figure inlined: sharp on screen, a few hundred kB
HERE = Path(__file__).parent


class PageError(ResultsError):
    """The page cannot be made (the chart library is not installed)."""


@cache
def chart_library() -> str:
    """plotly.min.js from the installed `plotly` package (found without importing it), ready to inline."""
    spec = importlib.util.find_spec("plotly")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / "package_data" / "plotly.min.js"
        if path.is_file():
            text = path.read_text(encoding="utf-8").replace("://", ":\\/\\/")
            return re.sub(r"</(script)", r"<\\/\1", text, flags=re.IGNORECASE)  # none in plotly.js; never end early
    raise PageError("the interactive page needs Plotly's chart library, which the `plotly` package ships: "
                    "pip install plotly (a dependency of normexp; a plain install has it)")


def asset(name: str) -> str:
    """The page's own style or script (normexp/page/page.css, page.js)."""
    return (HERE / name).read_text(encoding="utf-8")


def data_script(data: object) -> str:
    """`data` as JSON in a script element the page's script reads (no `</` inside, so it cannot end early)."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False, ensure_ascii=False, default=_plain)
    text = text.replace("</", "<\\/")
    return f'<script type="application/json" id="page-data">{text}</script>'


def html_page(title: str, body: str, data: object | None = None, nav: Sequence[tuple[str, str]] = ()) -> str:
    """A whole HTML document around `body` (already HTML); with `data`, the chart library and the page's
    script that draws from it. `nav`: (anchor, label) links to the page's sections, kept at the top."""
    links = "".join(f'<a href="#{html.escape(anchor)}">{html.escape(label)}</a>' for anchor, label in nav)
    scripts = (f"{data_script(data)}\n<script>{chart_library()}</script>\n<script>{asset('page.js')}</script>"
               if data is not None else "")
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{html.escape(title)}</title>\n<style>{asset('page.css')}</style>\n</head>\n"
            f'<body data-ready="{"pending" if data is not None else "ok"}">\n'
            + (f"<nav>{links}</nav>\n" if links else "")
            + f"<main>\n{body}\n</main>\n{scripts}\n</body>\n</html>\n")


def table_html(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1, attrs: str = "") -> str:
    """A table; its first `left` columns (the labels) aligned left, the numbers right."""
    def cells(values: Sequence[str], tag: str) -> str:
        return "".join(f'<{tag}{" class=label" if i < left else ""}>{html.escape(str(v))}</{tag}>'
                       for i, v in enumerate(values))

    body = "".join(f"<tr>{cells(row, 'td')}</tr>" for row in rows)
    return (f'<div class="scroll"><table{attrs}><thead><tr>{cells(header, "th")}</tr></thead>'
            f"<tbody>{body}</tbody></table></div>")


def figure_html(figure: object, caption: str = "", note: str = "") -> str:
    """A figure (a matplotlib Figure, drawn here, or a PNG file's bytes) as an inline PNG with its caption."""
    if not isinstance(figure, bytes):
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


def _plain(value: object) -> object:
    """A numpy scalar (a bool, an int) as the Python value JSON writes."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON")
