"""The screenshot of TensorBoard's HParams table in docs/export.md, taken as a user would see it.

Trains a small sweep (placement x kind x depth, two seeds), exports it with `normexp export --to
tensorboard`, starts TensorBoard's own server on 127.0.0.1, opens its HParams tab in headless Chromium and
saves docs/img/tensorboard_hparams.png (and, with --scalars, docs/img/tensorboard_scalars.png: the Time
Series dashboard). Needs the tensorboard and dev extras and Debian's chromium and chromium-driver.

    python docs/screenshot_tensorboard.py [--scalars]
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from normexp.config import build_sweep, parse_yaml  # noqa: E402
from normexp.export.tensorboard import to_tensorboard  # noqa: E402
from normexp.sweep import SweepOptions, run_sweep  # noqa: E402

SWEEP = """\
name: screenshot
base:
  model: {width: 16}
  data: {n_samples: 64}
  optim: {name: adam, lr: 0.01}
  train: {steps: 60, threads: 1, log_blocks: true}
grid:
  norm.placement: [pre, post]
  norm.kind: [layernorm, rmsnorm]
  model.depth: [2, 8]
seeds: [0, 1]
"""
IMAGES = ROOT / "docs" / "img"
WIDTH, HEIGHT = 1600, 640


def main(scalars: bool = False) -> None:
    with tempfile.TemporaryDirectory(prefix="normexp-screenshot-") as tmp:
        folder, logdir = Path(tmp) / "sweep", Path(tmp) / "tb"
        run_sweep(build_sweep(parse_yaml(SWEEP)), folder, SweepOptions(engine="batched"))
        to_tensorboard(folder, logdir)
        port = _free_port()
        server = subprocess.Popen([sys.executable, "-c", "from tensorboard.main import run_main; run_main()",
                                   "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_for_hparams(f"http://127.0.0.1:{port}")
            browser = _chromium()
            try:
                IMAGES.mkdir(exist_ok=True)
                _shoot(browser, f"http://127.0.0.1:{port}/#hparams", IMAGES / "tensorboard_hparams.png")
                if scalars:
                    _shoot(browser, f"http://127.0.0.1:{port}/#timeseries", IMAGES / "tensorboard_scalars.png")
            finally:
                browser.quit()
        finally:
            server.terminate()
            server.wait(timeout=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_hparams(url: str) -> None:
    """Until the server has read the runs (its HParams experiment lists the metrics)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(1)
        request = urllib.request.Request(f"{url}/data/plugin/hparams/experiment", b'{"experimentName": ""}',
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                if json.loads(response.read()).get("metricInfos"):
                    return
        except OSError:
            continue
    raise SystemExit("TensorBoard did not load the export within 120 s")


def _chromium():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        raise SystemExit("no Chromium and chromedriver: apt-get install chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     f"--window-size={WIDTH},{HEIGHT}", "--hide-scrollbars"):
        options.add_argument(argument)
    return webdriver.Chrome(service=Service(driver), options=options)


def _shoot(browser, url: str, path: Path) -> None:
    """Open `url`, let the dashboard draw, and save a small PNG of it (a 256-colour palette)."""
    from PIL import Image

    browser.get(url)
    time.sleep(12)  # the dashboard's first requests and its drawing: no signal to wait on from outside
    browser.save_screenshot(str(path))
    Image.open(path).convert("RGB").quantize(256).save(path, optimize=True)
    print(f"{path.relative_to(ROOT)}: {path.stat().st_size // 1024} KB")


if __name__ == "__main__":
    main(scalars="--scalars" in sys.argv[1:])
