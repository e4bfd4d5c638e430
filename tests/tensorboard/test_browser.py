"""The trainvitals dashboard in a real TensorBoard, looked at by a real browser.

Runs the digits example for two epochs (its exit status is its report's: 0, healthy), starts
``tensorboard --logdir`` on 127.0.0.1, opens the
Custom Scalars dashboard in Debian's headless Chromium through Playwright (no browser download), and
checks each chart's DOM: its title, how many logged tags it matched, and that lines were drawn.

Set ``TRAINVITALS_SCREENSHOT=docs/dashboard.png`` to refresh the README's screenshot.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_dashboard import chart_tags, read_layout

from trainvitals.tensorboard.layout import BAND_CHART, GRAD_NORM_CHART, IN_BAND_CHART

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: pip install -e '.[dev]'")
if CHROMIUM is None:
    pytest.skip("no system Chromium: apt-get install -y chromium", allow_module_level=True)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # TensorBoard shows its --logdir in the sidebar: a relative "runs", as the README's command has it.
    logdir = tmp_path_factory.mktemp("logs") / "runs"
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "digits_cnn.py"), "--logdir", str(logdir), "--max-epochs", "2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run,) = logdir.glob("digits_cnn/version_*")
    return run


def _launch(p, tmp_path: Path):
    return p.chromium.launch_persistent_context(
        str(tmp_path / "profile"),
        executable_path=CHROMIUM,
        headless=True,
        args=CHROMIUM_ARGS,
        viewport={"width": 1300, "height": 2900},  # TensorBoard scrolls inside the page: the viewport is the picture
    )


def test_html_report_opens_offline_without_errors(run_dir: Path, tmp_path: Path) -> None:
    from trainvitals.report.command import EXIT_OK, main

    assert main([str(run_dir.parents[1]), "--format", "html", "--output", str(tmp_path / "report.html")]) == EXIT_OK
    with sync_api.sync_playwright() as p:
        context = _launch(p, tmp_path)
        try:
            requests: list[str] = []
            errors: list[str] = []
            # Everything but the file itself is refused and recorded: the page must need nothing else.
            context.route(
                re.compile(r"^(?!file:|data:).*"), lambda route: (requests.append(route.request.url), route.abort())
            )
            page = context.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto((tmp_path / "report.html").as_uri())
            page.wait_for_load_state("load")
            images = page.locator("figure img")
            assert images.count() == 5
            for i in range(images.count()):
                assert images.nth(i).evaluate("img => img.complete && img.naturalWidth > 300")
            assert "noise scale and batch size" in page.locator("ul.findings").inner_text()
            assert errors == [] and requests == []
            shot = tmp_path / "report.png"
            page.screenshot(path=str(shot))  # the first screen: findings and plots
            assert shot.stat().st_size > 10_000
            if os.environ.get("TRAINVITALS_REPORT_SCREENSHOT"):
                shutil.copyfile(shot, ROOT / os.environ["TRAINVITALS_REPORT_SCREENSHOT"])
        finally:
            context.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tensorboard_url(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    log = (tmp_path_factory.mktemp("tb") / "tensorboard.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorboard.main",
            "--logdir",
            run_dir.parents[1].name,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--load_fast",
            "false",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=run_dir.parents[2],
    )
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url + "data/plugins_listing", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"tensorboard did not come up: {Path(log.name).read_text()}")
                time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def expected_matches(run_dir: Path) -> dict[str, int]:
    """How many logged scalar tags each chart of the written layout shows, matched as TensorBoard's server matches."""
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    return {title: len(tags) for title, tags in chart_tags(read_layout(acc), acc).items()}


# A line's bounding box outside its plot's: TensorBoard clipped part of it (outliers ignored, a fixed domain).
OUTSIDE = """line => { const a = line.getBoundingClientRect(), b = line.ownerSVGElement.getBoundingClientRect();
    return a.top < b.top - 1 || a.bottom > b.bottom + 1 }"""


def test_custom_scalars_dashboard_renders_the_trainvitals_charts(
    run_dir: Path, tensorboard_url: str, tmp_path: Path
) -> None:
    expected = expected_matches(run_dir)
    # The callbacks of the digits example log at least these; the other charts wait for theirs.
    for title in (
        GRAD_NORM_CHART,
        BAND_CHART,
        IN_BAND_CHART,
        "B_simple and its 90 % interval (no high end: unbounded above) vs effective batch (examples)",
        "per-layer gradient norm: features",
        "per-layer gradient norm: head",
        "per-layer GSNR",
        "gradient noise: tr(Σ) per example, its standard error and 90 % interval",
        "gradient noise: ‖G‖², the true gradient's squared norm, its standard error and 90 % interval",
        "batch-gradient variance at the micro-batch and the full batch (Var ∝ 1/B)",
        "memory by category (bytes)",
        "saved activations per module (bytes)",
        "integrity counters",
        "learning rate and its suggestion",
    ):
        assert expected[title] > 0, title
    assert expected[BAND_CHART] == 3  # the norm, the floor and the band's edge

    with sync_api.sync_playwright() as p:
        context = _launch(p, tmp_path)
        try:
            page = context.new_page()
            page.goto(tensorboard_url + "#custom_scalars")
            cards = page.locator("tf-custom-scalar-multi-line-chart-card, tf-custom-scalar-margin-chart-card")
            sync_api.expect(cards).to_have_count(len(expected), timeout=60_000)
            by_title = {
                cards.nth(i).locator("tf-card-heading .heading-label").first.text_content().strip(): cards.nth(i)
                for i in range(len(expected))
            }
            assert set(by_title) == set(expected)
            # TensorBoard clips each chart to its central values by default, and scales it to the smoothed
            # lines: both off, so every logged point is in view.
            outliers = page.get_by_role("checkbox", name="Ignore outliers in chart scaling")
            outliers.uncheck()
            sync_api.expect(outliers).not_to_be_checked()
            smoothing = page.locator("tf-smoothing-input input")
            smoothing.fill("0")
            smoothing.press("Enter")
            # A chart computes its y range when its data loads: reload (TensorBoard keeps both settings).
            page.wait_for_timeout(500)
            page.reload()
            sync_api.expect(cards).to_have_count(len(expected), timeout=60_000)
            sync_api.expect(outliers).not_to_be_checked()
            by_title = {
                cards.nth(i).locator("tf-card-heading .heading-label").first.text_content().strip(): cards.nth(i)
                for i in range(len(expected))
            }
            for title, n in expected.items():
                card = by_title[title]
                lines = card.locator("path.line")
                if title != BAND_CHART:
                    sync_api.expect(card.locator(".matches-text")).to_have_text(f"Matches ({n})", timeout=30_000)
                if not n:
                    assert lines.count() == 0, title
                    continue
                # A path through the first point: "M x,y" then "L x,y" per further point (a counter logged once: one).
                sync_api.expect(lines.first).to_have_attribute("d", re.compile(r"^M-?[\d.]+,-?[\d.]+"), timeout=30_000)
                page.wait_for_timeout(300)  # the range follows once every series of the chart has loaded
                clipped = [i for i in range(lines.count()) if lines.nth(i).evaluate(OUTSIDE)]
                assert not clipped, f"{title}: lines {clipped} leave the plot"
            sync_api.expect(by_title[BAND_CHART].locator("path.area")).to_have_count(1)

            grad_norm = by_title[GRAD_NORM_CHART]
            sync_api.expect(grad_norm.locator("path.line").first).to_have_attribute(
                "d", re.compile(r"^M[^L]+(L[^L]+){10}")
            )
            grad_norm.locator('paper-icon-button[title="Toggle y-axis log scale"]').click()
            sync_api.expect(grad_norm.locator('paper-icon-button[title="Toggle y-axis log scale"]')).to_have_attribute(
                "selected", ""
            )
            assert grad_norm.locator("tf-line-chart-data-loader").evaluate("e => e.logScaleActive") is True

            # No temporary folder on the picture: the sidebar names the relative --logdir only.
            assert str(run_dir.parents[2]) not in page.locator("body").inner_text()
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            if os.environ.get("TRAINVITALS_SCREENSHOT"):
                shutil.copyfile(shot, ROOT / os.environ["TRAINVITALS_SCREENSHOT"])

            # The Text tab opens on the diagnoses: their group comes first, and open.
            page.goto(tensorboard_url + "#text")
            views = page.locator("tf-text-dashboard tf-category-paginated-view")
            sync_api.expect(views.filter(has_text="diagnosis/GradNormMonitor")).to_have_count(1, timeout=60_000)
            groups = views.evaluate_all(
                "views => views.map(v => [v.category && v.category.name, v.opened]).filter(([name]) => name)"
            )
            assert groups[0] == ["diagnosis", True], groups
        finally:
            context.close()
