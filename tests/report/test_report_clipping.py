"""The report's gradient-clipping section and finding, from GradNormMonitor's pre- and post-clip norms written the
way the loggers write them; every number against its own computation from the series."""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

import pytest
from test_report import STEPS, report_json, rows, write_run

from trainvitals.norms.clipping import UNKNOWN_LR

SECTION = "gradient clipping"
# The pre-clip norms of the 20 logged steps: 16 above a threshold of 1, 4 below.
TOTALS = [5.2, 4.5, 3.4, 2.0, 1.6, 0.7, 1.4, 1.3, 1.5, 0.9, 1.45, 1.35, 1.6, 0.8, 1.5, 1.4, 1.55, 0.95, 1.5, 1.45]


def _norm_clipped(totals: list[float], threshold: float) -> list[float]:
    """torch's clip_grad_norm_: the norm becomes ‖g‖ · min(1, threshold / (‖g‖ + 1e-6))."""
    return [t * min(1.0, threshold / (t + 1e-6)) for t in totals]


def _run(
    capsys,
    tmp_path: Path,
    optimizer: str = "AdamW",
    noise: float | None = 1.5,
    clipped=None,
    totals=TOTALS,
    extra: dict | None = None,
) -> dict:
    scalars = {
        "grad_norm/total": TOTALS,
        "grad_norm/clipped_total": clipped or _norm_clipped(TOTALS, 1.0),
        f"lr_scaling/lr/{optimizer}": 1e-3,
        **(extra or {}),
    }
    if noise is not None:
        scalars["grad_norm/noise_floor"] = noise
    write_run(tmp_path / "run", scalars)
    return report_json_run(capsys, tmp_path)


def report_json_run(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> dict:
    _, doc = report_json(capsys, tmp_path)
    (run,) = doc["runs"]
    return run


def _findings(run: dict) -> list[dict]:
    return [f for f in run["findings"] if f["section"] == SECTION]


def test_the_section_reads_share_threshold_median_and_factors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run(capsys, tmp_path)
    shrunk = [1.0 / t for t in TOTALS if t > 1.0]  # threshold / norm of each clipped step
    section = rows(run, SECTION)
    assert section["logged steps clipped, of 20"] == pytest.approx(len(shrunk) / 20) and len(shrunk) == 16
    assert section["threshold (clipping by norm)"] == pytest.approx(1.0, rel=1e-5)
    assert section["pre-clip norm, median"] == pytest.approx(statistics.median(TOTALS), rel=1e-6)
    assert section["factor on a clipped step, mean"] == pytest.approx(statistics.fmean(shrunk), rel=1e-5)
    assert section["factor on a logged step, mean"] == pytest.approx((sum(shrunk) + 4) / 20, rel=1e-5)
    assert section["noise level sqrt(tr Σ/B), median"] == pytest.approx(1.5)


def test_under_adamw_noise_above_the_threshold_is_said_and_no_lr_cut(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (finding,) = _findings(_run(capsys, tmp_path))
    median = statistics.median(TOTALS)
    assert finding["severity"] == "note"
    message = finding["message"]
    assert message.startswith(f"gradient clipping at 1 clipped 80% of the 20 logged steps (pre-clip norm {median:.3g}")
    assert "the noise level sqrt(tr Σ/B) is 1.5 (median), above the threshold" in message
    assert f"≈ {min(1.0, (1.5 / median) ** 2):.0%} of ‖ḡ‖²" in message
    assert "under AdamW" in message and "it is no lr cut" in message
    assert message.endswith("raise gradient_clip_val above ~2× the noise level (3) so that it catches outliers only.")


def test_under_sgd_the_mean_factor_is_the_lr_cut(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (finding,) = _findings(_run(capsys, tmp_path, optimizer="SGD"))
    scale = statistics.fmean(min(1.0, 1.0 / t) for t in TOTALS)
    assert finding["severity"] == "warning"
    assert f"an lr cut of ~×{scale:.2g}" in finding["message"] and "the logs do not say" not in finding["message"]
    # No LRScalingAdvisor's base lr logged: which lr the cut is on, said without a value.
    assert finding["message"].endswith(f"or lower {UNKNOWN_LR} ×{scale:.2g} instead.")


def test_under_sgd_the_logged_lr_weighted_cut_is_the_lr_cut(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """GradNormMonitor's grad_norm/clip_lr_cut (over every step so far, the clip factor's mean weighted by the lr
    each step ran at): its last value is the lr cut, and said apart from the logged steps' plain mean."""
    cuts = [0.6 - 0.004 * i for i in range(20)]
    run = _run(capsys, tmp_path, optimizer="SGD", extra={"grad_norm/clip_lr_cut": cuts})
    (finding,) = _findings(run)
    assert rows(run, SECTION)["lr cut over every step (factor's lr-weighted mean)"] == pytest.approx(cuts[-1])
    assert rows(run, SECTION)["factor on a logged step, mean"] == pytest.approx(
        statistics.fmean(min(1.0, 1.0 / t) for t in TOTALS), rel=1e-5
    )
    assert f"an lr cut of ~×{cuts[-1]:.2g} over every step (the factor's mean weighted by the lr" in finding["message"]
    assert finding["message"].endswith(f"or lower {UNKNOWN_LR} ×{cuts[-1]:.2g} instead.")


def test_a_threshold_above_the_noise_level_caps_signal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (finding,) = _findings(_run(capsys, tmp_path, optimizer="Lion", noise=0.3))
    median = statistics.median(TOTALS)
    assert "below the threshold: the steps it clips carry signal" in finding["message"]
    assert "the logs do not say the optimizer" in finding["message"]
    assert f"above ~2× the median norm ({2 * median:.2g})" in finding["message"]  # 2× the noise is below it


def test_few_clipped_steps_are_no_finding(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(capsys, tmp_path, clipped=_norm_clipped(TOTALS, 1.5))  # 6 of 20 above 1.5
    assert rows(run, SECTION)["logged steps clipped, of 20"] == pytest.approx(sum(t > 1.5 for t in TOTALS) / 20)
    assert _findings(run) == []


def test_clipping_by_value_gives_no_threshold(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    clipped = [t * (0.6 + 0.02 * i) for i, t in enumerate(TOTALS)]  # norms that do not agree
    run = _run(capsys, tmp_path, noise=None, clipped=clipped)
    assert rows(run, SECTION)["threshold (clipping by norm)"] == "not by norm"
    (finding,) = _findings(run)
    scale = statistics.fmean(0.6 + 0.02 * i for i in range(20))
    assert "not by norm" in finding["message"] and f"×{scale:.2g} in mean" in finding["message"]


def test_a_csv_log_gives_the_same_finding(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tb = _findings(_run(capsys, tmp_path / "tb", optimizer="SGD"))
    folder = tmp_path / "csv" / "run"
    folder.mkdir(parents=True)
    clipped = _norm_clipped(TOTALS, 1.0)
    with open(folder / "metrics.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(
            ["step", "grad_norm/total", "grad_norm/clipped_total", "grad_norm/noise_floor", "lr_scaling/lr/SGD"]
        )
        writer.writerows([s, t, c, 1.5, 1e-3] for s, t, c in zip(STEPS, TOTALS, clipped))
    assert len(tb) == 1 and _findings(report_json_run(capsys, tmp_path / "csv")) == tb
