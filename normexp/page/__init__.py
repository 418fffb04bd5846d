"""Self-contained HTML pages: a sweep folder's interactive report (`report_page`, written by
`normexp report DIR --format html` to `page_path`), and the studies' REPORT.html (`markdown_page`).

- `document`: the HTML document (`html_page`) (style, script, data, the inlined chart library: Plotly's plotly.js);
- `data`: what the charts carry (curves, phase diagram, parallel coordinates), aggregated and said so;
- `tables`: the step table, the run table and the "what mattered" table as HTML;
- `report`: the report page, its sections and its provenance;
- `markdown`: REPORT.md as a page;
- `page.js`, `page.css`: the page's own script (charts, sorting, filtering) and style.
"""

from normexp.page.document import PageError, chart_library, figure_html, html_page, table_html
from normexp.page.markdown import markdown_page
from normexp.page.report import page_path, provenance_html, report_page

__all__ = ["PageError", "chart_library", "figure_html", "html_page", "markdown_page", "page_path", "provenance_html",
           "report_page", "table_html"]
