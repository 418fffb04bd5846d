"""The report page (`normexp report DIR --format html`, normexp/page/): one self-contained file that holds its
chart library and every run, fetches nothing and writes no absolute path; and, in a real headless Chromium
driven by Selenium (Debian's chromium and chromium-driver), a page whose legend hides a trace, whose points
show their value on hover, whose run table sorts the best run first, and which logs no console error and
makes no network request. Without a browser those tests skip, saying why."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import time
from html.parser import HTMLParser

import pytest
from conftest import trained_sweep
from typer.testing import CliRunner

from normexp.cli import app
from normexp.page import markdown_page, page_path, report_page
from normexp.report import build_report
from normexp.results import load_folder, load_summary

SWEEP = """name: page
base:
  model: {depth: 2, width: 16}
  schedule: {kind: linear_warmup}
  train: {steps: 30}
grid:
  norm.placement: [post, pre]
  optim.lr: [0.01, 0.03, 1.0]
  schedule.warmup_steps: [0, 5]
seeds: [0, 1]
report: {steps: [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30]}
"""
STOPS = """name: stops
base:
  model: {depth: 2, width: 8}
  optim: {lr: 0.03}
  train: {steps: 60, stop_when: trained}
grid:
  norm.placement: [post, pre]
seeds: [0, 1]
"""
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
WIDTH, HEIGHT = 1400, 900


def invoke(*args: str):
    return CliRunner(env={"COLUMNS": "200"}).invoke(app, list(args))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return trained_sweep(tmp_path_factory, "page", SWEEP, "--engine", "batched", "--quiet")


@pytest.fixture(scope="module")
def page(folder):
    """The page as `report --format html -o` writes it."""
    target = folder.parent / "report.html"
    result = invoke("report", str(folder), "--format", "html", "-o", str(target))
    assert result.exit_code == 0, result.output
    return target


class Links(HTMLParser):
    """Every src and href of a page, its <link> elements, and the cells of its run table."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.links = 0
        self.runs: list[str] = []
        self._table = self._first = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.links += tag == "link"
        self.urls += [v for k, v in attrs if k in ("src", "href", "srcset", "data", "poster", "action") and v]
        if tag == "table":
            self._table = dict(attrs).get("id") == "runs-table"
        if tag == "tr" and self._table:
            self._first = True

    def handle_data(self, data: str) -> None:
        if self._table and self._first and data.strip():
            self.runs.append(data.strip())  # a row's first text: its run id
            self._first = False

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._table = False


def test_the_page_is_self_contained_with_its_chart_library_and_every_run(page, folder):
    text = page.read_text(encoding="utf-8")
    links = Links()
    links.feed(text)
    assert links.links == 0 and all(url.startswith("#") for url in links.urls), links.urls[:5]  # anchors only
    assert not re.search(r"https?://|@import", text)  # no URL at all (the library's own are written :\/\/)
    assert "plotly.js v" in text and 'id="page-data"' in text  # the chart library inlined, the data beside it
    summary = load_summary(folder)
    assert links.runs[1:] == list(summary["run_id"])  # every run, one row each (the header first)
    data = json.loads(re.search(r'<script type="application/json" id="page-data">(.*?)</script>', text).group(1))
    assert {"curves", "phase", "parallel"} <= set(data)
    assert len(data["parallel"]["color"]) == len(summary)  # every run a line


def test_the_page_keeps_the_reports_lines_and_what_mattered(page):
    text = page.read_text(encoding="utf-8")
    assert "Trained (final loss &lt; ln(10)/10 = 0.230)" in text  # the verdict
    assert '<table id="steps" class="fit">' in text and "show all 16 steps" in text  # 16 steps: the middle folded
    assert '<table id="anova">' in text and "placement × learning rate" in text and "share of variance" in text
    assert "± one standard error of that mean" in text  # the band says what it is


def test_the_early_stop_line_the_table_shows_is_on_the_page(tmp_path_factory):
    """The page dropped the line naming the runs train.stop_when stopped (issue 46, item 18)."""
    out = trained_sweep(tmp_path_factory, "stops", STOPS, "--quiet")
    report = build_report(out)
    assert report.stopped.startswith("Stopped early (train.stop_when)")
    text = report_page(report, load_folder(out))
    assert report.stopped.replace("(", "").split(":")[0] in text.replace("(", "")
    assert 'class="e' in text or 'class="t e' in text  # the run table marks the stopped runs for its filter


def test_the_pages_curves_hold_a_stopped_run_as_the_figure_and_table_do(tmp_path_factory):
    """A run train.stop_when stopped stays in every later step's mean at its last value (`hold_stopped`), as in
    the report's table and the curves figure: the page's line counts every run at every step it draws."""
    out = trained_sweep(tmp_path_factory, "stops-held", STOPS, "--quiet")
    folder = load_folder(out)
    assert build_report(out).stopped.startswith("Stopped early (train.stop_when)")  # some run did stop
    text = report_page(build_report(out), folder)
    data = json.loads(re.search(r'<script type="application/json" id="page-data">(.*?)</script>', text).group(1))
    for line in data["curves"]["lines"]:
        assert set(line["n"]) == {line["runs"] - line["diverged"]}, (line["name"], line["n"])  # every step: all


def test_provenance_names_folders_never_their_absolute_path(page, folder, tmp_path):
    text = page.read_text(encoding="utf-8")
    assert str(folder) not in text and str(folder.parent) not in text
    assert "Provenance" in text and "invocation(s)" in text and "name: page" in text  # the commands, the sweep file
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    history = json.loads((copy / "history.jsonl").read_text().splitlines()[-1])
    command = f"normexp sweep {tmp_path}/configs/page.yaml --out={copy} --set 'model.depth=2'"
    record = {key: value for key, value in history.items() if key != "checksum"}  # re-sealed: the command changed
    record["checksum"] = hashlib.sha256(json.dumps({**record, "command": command}, sort_keys=True).encode()).hexdigest()
    with (copy / "history.jsonl").open("a") as log:
        log.write(json.dumps({**record, "command": command}) + "\n")
    text = report_page(build_report(copy), load_folder(copy))
    assert str(tmp_path) not in text
    assert "normexp sweep …/page.yaml --out=…/copy --set model.depth=2" in text


def test_the_page_goes_beside_the_runs_and_a_comparison_into_the_current_folder(folder, tmp_path):
    from normexp.compare import load_folders

    assert page_path(load_folder(folder)) == folder / "report.html"
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    assert str(page_path(load_folders([folder, other]))) == "report-out-vs-other.html"


def test_without_plotly_the_page_says_how_to_get_it(monkeypatch, folder):
    from normexp.page import document

    monkeypatch.setattr(document.importlib.util, "find_spec", lambda name: None)
    document.chart_library.cache_clear()
    try:
        with pytest.raises(document.PageError, match="pip install plotly"):
            report_page(build_report(folder), load_folder(folder))
    finally:
        document.chart_library.cache_clear()


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
    assert text.count("data:image/png;base64,") == 1 and "plotly" not in text  # no chart: no library


# ----------------------------------------------------------------------------- in a real browser


def chromium() -> tuple[str, str] | str:
    """(browser, driver) paths, or why there are none."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install 'normexp[dev]')"
    browser = next((path for path in map(shutil.which, BROWSERS) if path), None)
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        return "no Chromium and chromedriver (apt-get install chromium chromium-driver)"
    return browser, driver


@pytest.fixture(scope="module")
def browser():
    found = chromium()
    if isinstance(found, str):
        pytest.skip(found + "; the page's self-containment is tested above")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     f"--window-size={WIDTH},{HEIGHT}", "--enable-unsafe-swiftshader"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(found[1]), options=options)
    yield driver
    driver.quit()


def load(browser, page) -> None:
    """Open the page afresh and wait until its script says every chart is drawn."""
    browser.get(page.as_uri())
    deadline = time.monotonic() + 60
    state = "pending"
    while state == "pending" and time.monotonic() < deadline:
        time.sleep(0.1)
        state = browser.execute_script("return document.body.getAttribute('data-ready')")
    assert state == "ok", state


def test_in_a_browser_every_chart_draws_with_no_console_error_and_no_request(browser, page):
    browser.get_log("browser"), browser.get_log("performance")  # what earlier pages logged
    load(browser, page)
    errors = [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert errors == []
    requested = []
    for entry in browser.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            requested.append(message["params"]["request"]["url"])
    assert requested and all(url == page.as_uri() or url.startswith(("data:", "blob:")) for url in requested), \
        requested
    drawn = browser.execute_script(
        "return ['curves-chart', 'phase-0', 'phase-1', 'parallel-chart'].map("
        "  id => document.getElementById(id) && document.getElementById(id).querySelectorAll('.main-svg').length)")
    assert all(drawn), drawn


@pytest.mark.process
def test_clicking_a_legend_entry_hides_its_trace(browser, page):
    from selenium.webdriver.common.by import By

    load(browser, page)
    chart = "document.getElementById('curves-chart')"
    named = f"{chart}.data.filter(t => t.showlegend !== false)"
    assert browser.execute_script(f"return {named}[0].visible") in (None, True)
    entry = browser.find_elements(By.CSS_SELECTOR, "#curves-chart .legend .traces .legendtoggle")[0]
    entry.click()
    time.sleep(0.5)
    assert browser.execute_script(f"return {named}[0].visible") == "legendonly"
    assert browser.execute_script(f"return {named}[1].visible") in (None, True)  # the others stay
    band = browser.execute_script(f"return {chart}.data.filter(t => t.legendgroup === {named}[0].legendgroup"
                                  " && t.showlegend === false).map(t => t.visible)")
    assert band == ["legendonly"]  # its standard-error band goes with it


@pytest.mark.process
def test_hovering_a_point_shows_its_value(browser, page):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    load(browser, page)
    chart = browser.find_element(By.ID, "curves-chart")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", chart)
    browser.execute_script(  # one variant alone (as a double click on its legend entry does): no other is nearer
        "const gd = document.getElementById('curves-chart'); "
        "const group = gd.data.filter(t => t.showlegend !== false)[0].legendgroup;"
        "return Plotly.restyle(gd, {visible: gd.data.map(t => t.legendgroup === group ? true : 'legendonly')})")
    time.sleep(0.3)
    line = browser.execute_script(
        "const gd = document.getElementById('curves-chart'); const t = gd.data.filter(t => t.showlegend !== false)[0];"
        "const k = t.x.length - 1; const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;"
        "const box = gd.getBoundingClientRect();"
        "return [t.x[k], t.y[k], xa._offset + xa.c2p(t.x[k]) - box.width / 2,"
        "        ya._offset + ya.c2p(t.y[k]) - box.height / 2]")
    step, value, dx, dy = line
    ActionChains(browser).move_to_element_with_offset(chart, int(round(dx)), int(round(dy))).perform()
    time.sleep(0.5)
    hover = " ".join(t.text for t in browser.find_elements(By.CSS_SELECTOR, "#curves-chart .hoverlayer .hovertext"))
    said = re.search(rf"step {step}: ([-\d.e+]+)", hover)
    assert said, hover
    assert float(said.group(1)) == pytest.approx(value, rel=1e-3) and "mean of" in hover and "runs" in hover


@pytest.mark.process
def test_sorting_the_run_table_by_final_loss_puts_the_best_run_first(browser, page, folder):
    from selenium.webdriver.common.by import By

    load(browser, page)
    head = next(th for th in browser.find_elements(By.CSS_SELECTOR, "#runs-table thead th")
                if th.text.startswith("final loss"))
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", head)
    head.click()
    first = browser.find_element(By.CSS_SELECTOR, "#runs-table tbody tr td").text
    summary = load_summary(folder)
    finite = summary[summary["final_loss"].map(math.isfinite) & (summary["status"] == "completed")]
    assert first == finite.loc[finite["final_loss"].idxmin(), "run_id"]
    head.click()  # again: the worst first, and a run without a final loss still last
    rows = browser.find_elements(By.CSS_SELECTOR, "#runs-table tbody tr")
    assert rows[0].find_element(By.CSS_SELECTOR, "td").text == finite.loc[finite["final_loss"].idxmax(), "run_id"]


@pytest.mark.process
def test_one_click_shows_the_runs_that_did_not_train(browser, page, folder):
    from selenium.webdriver.common.by import By

    load(browser, page)
    button = browser.find_element(By.CSS_SELECTOR, '#runs-tools button[data-kind="n"]')
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", button)
    button.click()
    shown = [row.find_element(By.CSS_SELECTOR, "td").text
             for row in browser.find_elements(By.CSS_SELECTOR, "#runs-table tbody tr") if row.is_displayed()]
    summary = load_summary(folder)
    assert sorted(shown) == sorted(summary.loc[summary["trained"].astype(str) != "True", "run_id"])
    assert browser.find_element(By.ID, "runs-count").text == f"{len(shown)} of {len(summary)} runs"


def test_at_1400_px_the_last_step_and_trained_are_in_view(browser, page):
    load(browser, page)
    edges = browser.execute_script(
        "const heads = Array.from(document.querySelectorAll('#steps thead th'))"
        "  .filter(th => th.offsetParent !== null);"
        "return [window.innerWidth, document.documentElement.scrollWidth,"
        "        heads.map(th => [th.textContent, th.getBoundingClientRect().right])]")
    width, scrolled, heads = edges
    assert scrolled <= width  # no horizontal scrolling
    assert heads[-2][0] == "step 30" and heads[-1][0] == "trained"
    assert all(right <= width for _, right in heads)


def test_past_what_a_chart_can_show_it_aggregates_and_says_so():
    """Nothing sampled: 3,000 runs draw 300 lines of seed means, and 300 variants 10 curves pooled over the
    key of most values, each chart saying so; every run stays in the means."""
    import itertools

    import pandas as pd

    from normexp.page import data

    rows = [{"run_id": f"r{a}-{b}-{s}", "a": float(a), "b": b, "seed": s, "status": "completed", "step": step,
             "loss": 1.0 + a + b / 10 + s / 100 + 1 / (1 + step)}
            for a, b, s in itertools.product(range(30), range(10), range(10)) for step in (0, 1)]
    tidy = pd.DataFrame(rows)
    finals = tidy[tidy["step"] == 1].assign(final=lambda t: t["loss"])
    lines = data.parallel_data(finals, ["a", "b"], "loss")
    assert (lines["runs"], lines["lines"]) == (3000, 300) and "one line per configuration" in lines["note"]
    assert len(lines["color"]) == 300
    curves = data.curves_data(tidy.assign(**{"model.n_classes": 10}), ["a", "b"], "loss", None)
    assert len(curves["lines"]) == 10 and curves["pooled"].startswith("each curve pools its runs over a (30 values)")
    assert {line["runs"] for line in curves["lines"]} == {300} and curves["lines"][0]["n"] == [300, 300]


def test_report_html_without_o_writes_beside_the_runs_and_prints_no_html(folder):
    written = folder / "report.html"
    written.unlink(missing_ok=True)
    result = invoke("report", str(folder), "--format", "html")
    assert result.exit_code == 0, result.output
    assert "<html" not in result.output.lower() and f"wrote {written}" in " ".join(result.output.split())
    assert written.read_text(encoding="utf-8").lstrip().lower().startswith("<!doctype html")


def test_report_anova_csv_is_what_mattered_in_its_columns(folder):
    from normexp.analysis.anova import COLUMNS, what_mattered
    from normexp.tables import anova_to_csv

    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["report", str(folder), "--anova", "--format", "csv"])
    assert result.exit_code == 0, result.output
    assert result.stdout == anova_to_csv(what_mattered(folder))
    assert result.stdout.splitlines()[0].split(",") == list(COLUMNS)
    refused = invoke("report", str(folder), "--anova", "--pivot", "norm.placement,seed")
    assert refused.exit_code == 2 and "--anova and --pivot" in refused.output
