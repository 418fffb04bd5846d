"""Take docs/img/mlflow_runs.png, MLflow's run table as docs/export.md shows it: a small sweep (placement x
depth, 2 seeds), its figures drawn by `normexp plot`, exported by `normexp export --to mlflow` into a sqlite
database, opened by `mlflow ui` in headless Chromium (Debian's chromium and chromium-driver; selenium).

    python docs/screenshot_mlflow.py [--out docs/img/mlflow_runs.png] [--keep DIR]

It needs `pip install 'normexp[mlflow]'` (mlflow ui) and selenium (the dev extra). The mlflow ui it starts is
stopped by its process group when the picture is taken.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

SWEEP = """\
name: placements
base:
  model: {depth: 2, width: 16}
  data: {n_samples: 64}
  optim: {name: adamw, lr: 0.003}
  train: {steps: 40, threads: 1}
grid:
  norm.placement: [pre, post]
  model.depth: [2, 4]
seeds: [0, 1]
"""
WIDTH, HEIGHT = 1320, 800
COLUMNS = ("norm.placement", "model.depth", "seed", "final/final_loss", "final/trained")  # shown
HIDDEN = ("Dataset", "Source", "Models")  # MLflow's, empty here


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def normexp(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "normexp", *args], capture_output=True, text=True, check=True)
    return done.stdout


def wait_for(url: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"mlflow ui did not answer at {url}")
        time.sleep(0.5)


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = next(p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))
                                   if p)
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     f"--window-size={WIDTH},{HEIGHT}", "--force-device-scale-factor=1"):
        options.add_argument(argument)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)


def tidy(driver) -> None:
    """The run table as a reader wants it: the model-training view, the assistant panel closed, the
    sidebar folded, and the parent run's row opened so that its nested runs show (MLflow folds them)."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    def click(selector: str, text: str | None = None) -> None:
        for element in driver.find_elements(By.CSS_SELECTOR, selector):
            if text is None or element.text.strip() == text:
                element.click()
                time.sleep(1.5)
                return

    click("button", "Model training")
    click("button[aria-label='Close']")
    click("button[aria-label='Toggle sidebar']")
    click("button[data-component-id*='runnamecellrenderer']")  # the parent run's expander
    click("button[data-testid='column-selection-dropdown']", "Columns")
    box = driver.find_element(By.CSS_SELECTOR, "input[placeholder='Search columns']")
    for key in (*HIDDEN, *COLUMNS):  # each found by its name in the column selector's tree, and (un)ticked
        box.send_keys(Keys.CONTROL, "a")
        box.send_keys(key)
        time.sleep(1)
        for node in driver.find_elements(By.CSS_SELECTOR, "[data-testid='column-selector-tree'] "
                                                          ".du-bois-light-tree-treenode"):
            if node.text.strip() == key:
                node.find_element(By.CSS_SELECTOR, ".du-bois-light-tree-checkbox").click()
                time.sleep(1)
                break
    box.send_keys(Keys.ESCAPE)
    time.sleep(1.5)
    ActionChains(driver).move_to_element(driver.find_element(By.TAG_NAME, "h2")).perform()  # no tooltip
    time.sleep(1)


def shoot(folder: Path, out: Path) -> None:
    normexp("sweep", str(folder / "sweep.yaml"), "--out", str(folder / "placements"), "--engine", "batched", "-q")
    normexp("plot", str(folder / "placements"))
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    print(normexp("export", str(folder / "placements"), uri, "--to", "mlflow").strip())
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host",
                               "127.0.0.1", "--port", str(port), "--workers", "1"], cwd=folder,
                              start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(f"{base}/health")
        import json

        with urllib.request.urlopen(f"{base}/api/2.0/mlflow/experiments/get-by-name?experiment_name=placements",
                                    timeout=30) as response:
            exp_id = json.loads(response.read())["experiment"]["experiment_id"]
        driver = browser()
        try:
            driver.get(f"{base}/#/experiments/{exp_id}/runs")
            deadline = time.monotonic() + 90
            while "placements" not in driver.page_source and time.monotonic() < deadline:
                time.sleep(1)
            time.sleep(4)
            tidy(driver)
            time.sleep(3)
            out.parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(out))
        finally:
            driver.quit()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    from PIL import Image  # matplotlib's: 256 colours keep the picture under 300 KB

    Image.open(out).convert("RGB").quantize(colors=256).save(out, optimize=True)
    print(f"wrote {out} ({out.stat().st_size // 1024} KB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "img" / "mlflow_runs.png")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it (default: a temporary one)")
    args = parser.parse_args()
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        (args.keep / "sweep.yaml").write_text(SWEEP)
        shoot(args.keep, args.out.resolve())
        return
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "sweep.yaml").write_text(SWEEP)
        shoot(Path(tmp), args.out.resolve())


if __name__ == "__main__":
    main()
