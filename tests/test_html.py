"""`normexp report --format html`: one self-contained page (no URL it would fetch), with the table, the
verdicts, the figures and the provenance; loaded in a real headless Chromium where one is installed,
with no console error and every figure decoded."""

from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
from conftest import trained_sweep
from typer.testing import CliRunner

from normexp.cli import app
from normexp.htmlpage import markdown_page

SWEEP = """name: page
base:
  model: {depth: 2, width: 8}
  schedule: {kind: linear_warmup}
  train: {steps: 2}
grid:
  norm.placement: [post, pre]
  optim.lr: [0.01, 0.03, 0.1]
  schedule.warmup_steps: [0, 1]
"""
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def invoke(*args: str):
    return CliRunner(env={"COLUMNS": "200"}).invoke(app, list(args))


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    out = trained_sweep(tmp_path_factory, "page", SWEEP, "--engine", "batched", "--quiet")
    target = out.parent / "report.html"
    result = invoke("report", str(out), "--format", "html", "-o", str(target))
    assert result.exit_code == 0, result.output
    return target


class Links(HTMLParser):
    """Every src and href of a page, and its images' sources."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.images: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in ("src", "href", "srcset", "data", "poster") and value is not None:
                self.urls.append(value)
                if tag == "img":
                    self.images.append(value)


def test_the_page_is_self_contained(page):
    text = page.read_text(encoding="utf-8")
    links = Links()
    links.feed(text)
    assert len(links.images) == 3  # curves, final loss vs lr, phase diagram
    assert all(url.startswith("data:image/png;base64,") for url in links.urls), links.urls[:3]
    assert not re.search(r"https?://|url\(|@import", text)  # no network: no URL, no CSS fetch
    assert "<table>" in text and "Trained (final loss &lt; ln(10)/10 = 0.230)" in text
    assert "Provenance" in text and "invocation(s)" in text and "name: page" in text  # the commands, the sweep file


def test_html_refuses_what_it_cannot_show(page):
    folder = page.parent / "out"
    result = invoke("report", str(folder), "--format", "html", "--pivot", "norm.placement,optim.lr")
    assert result.exit_code == 2 and "--format html" in result.output
    result = invoke("report", str(folder), "-o", str(page.parent / "t.txt"))
    assert result.exit_code == 2 and "-o: write markdown, csv or html" in result.output


def test_the_studies_markdown_becomes_one_page(tmp_path):
    from PIL import Image

    Image.new("RGB", (4, 3), "white").save(tmp_path / "f.png")
    text = markdown_page("# t\n\n**Question.** why `x`?\n\n| a | b \\| c |\n|---|---:|\n| x | 1 |\n\n![f](f.png)\n",
                         tmp_path)
    assert "<h1>t</h1>" in text and "<b>Question.</b> why <code>x</code>?" in text
    assert "<th class=label>a</th><th>b | c</th>" in text and "<td class=label>x</td><td>1</td>" in text
    assert text.count("data:image/png;base64,") == 1


def browser() -> str | None:
    return next((path for path in map(shutil.which, BROWSERS) if path), None)


@pytest.mark.process
def test_the_page_loads_in_a_headless_browser_with_every_figure_decoded(page):
    chromium = browser()
    if chromium is None:
        pytest.skip("no Chromium installed (apt-get install chromium); the page's self-containment is tested above")
    result = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
         "--virtual-time-budget=10000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert 'data-figures="ok"' in result.stdout, re.findall(r'data-figures="[^"]*"', result.stdout)
    console = [line for line in result.stderr.splitlines() if ":CONSOLE" in line]
    assert console == []
