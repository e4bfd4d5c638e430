"""``trainvitals report --format html``: one self-contained page with the text report's findings and plots."""

from __future__ import annotations

import base64
import math
import re
from pathlib import Path

import pytest
from test_report import HEALTHY, STEPS, write_run

from trainvitals.report.command import EXIT_CRITICAL, main
from trainvitals.report.html import markdown_to_html

pytest.importorskip("matplotlib")

RUN = {
    **HEALTHY,
    "grad_norm/band_edge": 0.1 * 1.2**0.5,
    "grad_noise/b_simple": [150.0 + s for s in STEPS],
    "grad_noise/b_simple_rel_err": 0.2,
    "grad_noise/b_simple_low": [120.0 + s for s in STEPS],
    "grad_noise/b_simple_high": [190.0 + s for s in STEPS],
    "grad_norm/head.1": [0.05 * (1 + s) for s in STEPS],
    "lr_scaling/lr/Adam": 5e-4,
    "lr_scaling/base_lr/Adam": 1e-3,
    "lr_scaling/suggested_lr_x2/Adam": 1.4e-3,
    "lr_scaling/suggested_lr_x0.5/Adam": 7e-4,
    "graph/unused_params": 1.0,
}


def write_report(tmp_path: Path) -> tuple[int, str]:
    write_run(
        tmp_path / "logs" / "run",
        RUN,
        {"lr_scaling/advice": "- **effective batch** 64\n\n| optimizer | lr now |\n|---|---:|\n| Adam | 0.001 |"},
    )
    out = tmp_path / "report.html"
    status = main([str(tmp_path / "logs"), "--format", "html", "--output", str(out)])
    return status, out.read_text(encoding="utf-8")


def test_html_report_has_the_findings_and_one_inline_png_per_plot(tmp_path: Path) -> None:
    status, page = write_report(tmp_path)
    assert status == EXIT_CRITICAL  # the same exit status as the text report: an unused parameter
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "1 parameter(s) got no gradient" in page and "CRITICAL" in page
    images = re.findall(r'<img alt="([^"]*)" src="data:image/png;base64,([^"]+)"', page)
    # norm in its band, B_simple, per-layer heatmap, memory, lr suggestions
    assert len(images) == 5
    for _, data in images:
        assert base64.b64decode(data)[:8] == b"\x89PNG\r\n\x1a\n"
    # Nothing to fetch: no URL other than the inline images.
    assert not re.search(r'(?:src|href)="(?!data:)', page) and "http" not in page.replace("http-equiv", "")
    # The callback's panel is rendered, not shown as markdown.
    assert '<td class="num">0.001</td>' in page and "**" not in page


def test_markdown_to_html_escapes_and_renders_tables() -> None:
    rendered = markdown_to_html("## Memory\n| a | b |\n|---|---:|\n| `x<y` | 1 |\n- **bold** & more")
    assert rendered.splitlines() == [
        "<h4>Memory</h4>",
        "<table>",
        "<tr><th>a</th><th>b</th></tr>",
        '<tr><td><code>x&lt;y</code></td><td class="num">1</td></tr>',
        "</table>",
        "<ul>",
        "<li><b>bold</b> &amp; more</li>",
        "</ul>",
    ]


def test_a_run_of_one_logged_step_plots_without_warnings_and_marks_a_bare_b_simple(
    tmp_path: Path, recwarn: pytest.WarningsRecorder
) -> None:
    """One logged step: every plot is drawn (points, an x range around the step) without matplotlib's identical-
    xlims warning; B_simple without a finite error is shown as not yet reliable, not as a precise line."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "logs" / "run"))
    for tag, value in {
        "grad_norm/total": 1.1,
        "grad_norm/noise_floor": 0.8,
        "grad_norm/head.1": 0.5,
        "grad_noise/b_simple": 74.0,
        "grad_noise/b_simple_rel_err": math.inf,
        "grad_noise/b_simple_low": 40.0,  # no high end logged: one-sided
        "lr_scaling/effective_batch": 64.0,
    }.items():
        writer.add_scalar(tag, value, 0)
    writer.close()
    out = tmp_path / "report.html"
    main([str(tmp_path / "logs"), "--format", "html", "--output", str(out)])
    page = out.read_text(encoding="utf-8")
    assert not [w for w in recwarn if "xlims" in str(w.message) or "matplotlib" in w.filename], list(recwarn)
    captions = re.findall(r"<figcaption>([^<]*)</figcaption>", page)
    assert len(captions) == 3  # norm in its band, B_simple, per-layer heatmap
    assert "Hollow points (1 of 1 logged steps)" in captions[1]


def test_b_simple_with_an_error_bar_everywhere_has_no_hollow_points(tmp_path: Path) -> None:
    _, page = write_report(tmp_path)
    assert "Hollow points" not in page


def test_b_simple_s_band_is_its_own_interval_not_its_relative_error(tmp_path: Path) -> None:
    """The shaded band is the logged Fieller interval: with a finite relative error but no high end logged, every
    point is hollow (one interval per quantity, issue #24)."""
    run = {k: v for k, v in RUN.items() if k != "grad_noise/b_simple_high"}
    write_run(tmp_path / "logs" / "run", run)
    out = tmp_path / "report.html"
    main([str(tmp_path / "logs"), "--format", "html", "--output", str(out)])
    captions = re.findall(r"<figcaption>([^<]*)</figcaption>", out.read_text(encoding="utf-8"))
    assert any(f"Hollow points ({len(STEPS)} of {len(STEPS)} logged steps)" in c for c in captions)


@pytest.mark.parametrize("points", [True, False])
def test_a_lower_end_logged_without_a_point_is_plotted(tmp_path: Path, points: bool) -> None:
    """A fresh user's BatchNorm run ended with ‖G‖² ≤ 0: its last steps logged B_simple's lower end (165, 281) and
    no point, and the plot ended at the last point (step 300), the section's interval nowhere on it. Those ends
    are drawn and said; a run with no point at all still gets the plot."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "logs" / "run"))
    for step in STEPS:
        if points and step < 90:
            writer.add_scalar("grad_noise/b_simple", 200.0 + step, step)
        writer.add_scalar("grad_noise/b_simple_low", 165.0 if step < 95 else 281.0, step)
        writer.add_scalar("lr_scaling/effective_batch", 32.0, step)
    writer.close()
    out = tmp_path / "report.html"
    main([str(tmp_path / "logs"), "--format", "html", "--output", str(out)])
    captions = re.findall(r"<figcaption>([^<]*)</figcaption>", out.read_text(encoding="utf-8"))
    (caption,) = [c for c in captions if c.startswith("The gradient noise scale")]
    ends = 2 if points else len(STEPS)
    assert f"Triangles ({ends} logged steps, the last at optimizer step 95): no point estimate there" in caption
