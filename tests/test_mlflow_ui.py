"""The MLflow UI as a person sees it (`vlmexp ui`, rendered by headless Chromium): a GRPO run's page opens on
the section `Summary` holding the reward and the main evaluation metric, before TRL's sections. It checks the
premise tests/test_flow.py builds on (the UI orders sections by name, upper case first) against the installed
MLflow's own JavaScript. Needs the `chromium` package (`make test` installs it where apt-get runs as root);
where it is missing the skip below fails the run (tests/conftest.py), saying so."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prefect_server import free_port, stop, wait_http

from vlmexp.checks.loader import load_config

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    CHROMIUM is None, reason="needs chromium (`make chromium`, or the system's chromium package)")]


def _sections(url: str) -> list[tuple[str, int]]:
    """(section, number of charts) in page order, from the section headers of the DOM Chromium rendered (the
    charts themselves draw later, as they scroll into view)."""
    dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                          "--disable-background-networking", "--window-size=1600,1400",
                          "--virtual-time-budget=30000", "--dump-dom", url],
                         capture_output=True, text=True, timeout=180, check=True).stdout
    parts = dom.split('data-testid="experiment-view-compare-runs-section-header"')[1:]
    headers = [re.search(r'white-space: pre;">([^<]*)</div><div[^>]*>\((\d+)\)</div>', part)
               for part in parts]
    return [(h.group(1), int(h.group(2))) for h in headers if h]


def _screenshot(url: str, out: Path):
    """The page as headless Chromium renders it, as an RGB image."""
    from PIL import Image

    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                    "--disable-background-networking", "--window-size=1400,1000",
                    "--virtual-time-budget=30000", "--hide-scrollbars", f"--screenshot={out}", url],
                   capture_output=True, text=True, timeout=180, check=True)
    return Image.open(out).convert("RGB")


def _near(image, colour, tolerance: int = 24) -> int:
    """How many pixels of `image` are within `tolerance` of `colour` on every channel."""
    return sum(n for n, c in image.getcolors(1 << 24)
               if all(abs(a - b) <= tolerance for a, b in zip(c, colour)))


def _picture(tmp_path: Path) -> Path:
    """A record's picture as evaluation draws it: a white image, the ground truth and GRPO's box."""
    from PIL import Image

    from vlmexp.pictures import Answer, Shown, record_picture, save_png

    Image.new("RGB", (200, 100), "white").save(tmp_path / "white.png")
    shown = Shown(str(tmp_path / "white.png"), "rec", [{"box": [20, 10, 120, 90], "label": ""}], "",
                  [Answer("grpo", [{"box": [60, 20, 180, 80], "label": ""}], "[60, 20, 180, 80]", 0.3)])
    return save_png(record_picture(shown), tmp_path / "record_000.png")


def test_a_grpo_run_page_opens_on_the_reward_and_the_evaluation_metric(tmp_path):
    from vlmexp.tracking.tracker import HEADLINE, HEADLINE_REWARD, make_tracker

    cfg = load_config(REPO / "configs/demo.yaml", [f"run.output_dir={tmp_path}"], check_paths=False)
    tracker = make_tracker(cfg)
    parent = tracker.start_pipeline("demo-pipeline", {}, {})
    grpo = tracker.start_stage(parent, "demo-grpo")
    for step in (1, 2, 3):  # TRL's keys (clip_ratio/... sorted first until now) and the headline reward
        tracker.log_metrics(grpo, {"clip_ratio/low_mean": 0.0, "completions/mean_length": 12.0 + step,
                                   "reward": 0.1 * step, "rewards/iou/mean": 0.05 * step, "loss": 1.0 / step,
                                   f"{HEADLINE}/{HEADLINE_REWARD['grpo'][1]}": 0.1 * step}, step)
    tracker.log_metrics(grpo, {f"{HEADLINE}/{cfg.export.metric}": 0.31, "eval/rec_mean_iou": 0.31}, 3)
    tracker.log_artifact(grpo, _picture(tmp_path), "evaluation/pictures")  # as the evaluation report logs it
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "vlmexp.cli", "ui", "--store", tracker.uri, "--port",
                               str(port)],
                              cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 120)
        sections = _sections(f"http://127.0.0.1:{port}/#/experiments/{tracker.experiment_id}/runs/{grpo}/"
                             "model-metrics?workflowType=machine_learning")
        shot = _screenshot(f"http://127.0.0.1:{port}/#/experiments/{tracker.experiment_id}/runs/{grpo}/"
                           "artifacts/evaluation/pictures/record_000.png?workflowType=machine_learning",
                           tmp_path / "page.png")
    finally:
        stop(server)
    from vlmexp.pictures import COLOURS

    # the run's artifact page shows the picture: its boxes' colours are on screen (the page itself has
    # neither)
    assert _near(shot, COLOURS["truth"][1]) > 200 and _near(shot, COLOURS["grpo"][1]) > 200, shot.size
    assert sections[:3] == [("Summary", 2), ("clip_ratio", 1), ("completions", 1)], sections
    assert sections[-1] == ("Model metrics", 2), sections  # reward and loss: keys without a section come last
