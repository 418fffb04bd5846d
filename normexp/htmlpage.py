"""The commands' former import path of the HTML pages, kept while `normexp.cli` and `normexp.studies` still
import from here: the pages are `normexp.page` (`report_page`, `markdown_page`). Nothing is defined here."""

from __future__ import annotations

from collections.abc import Sequence

from normexp.page import markdown_page
from normexp.page import report_page as _report_page
from normexp.report import Report
from normexp.results import Folder

__all__ = ["markdown_page", "report_page"]


def report_page(report: Report, folder: Folder, figures: Sequence[tuple] = ()) -> str:
    """`normexp.page.report_page`; the figures the commands drew for the former page are closed unused (the
    page draws its own, interactive, from the folder)."""
    if figures:
        import matplotlib.pyplot as plt

        for _, figure, _ in figures:
            plt.close(figure)
    return _report_page(report, folder)
