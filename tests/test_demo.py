"""The main job end to end: ``trainvitals demo`` and ``trainvitals report`` on its logs."""

from __future__ import annotations

import json
import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainvitals.cli import main


@pytest.mark.slow
def test_demo_stops_in_the_noise_band_and_logs_the_dashboard(tmp_path, capsys):
    assert main(["demo", "--logdir", str(tmp_path), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "why it stopped:    stopped at optimizer step" in out and "noise band" in out
    assert "smoothed:          E‖ḡ‖ ≈" in out
    assert f"tensorboard --logdir {tmp_path}" in out and "on 1 torch thread, --threads" in out
    events = EventAccumulator(str(tmp_path / "digits" / "version_0"), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    tags = events.Tags()
    assert {
        "grad_norm/total",
        "grad_norm/features.0",
        "grad_norm/head.3",
        "grad_norm/noise_floor",
        "grad_noise/b_simple",
        "lr_scaling/effective_batch",
        "memory/activations_bytes",
    } <= set(tags["scalars"])
    assert "grad_norm/hist/features.0" in tags["histograms"]
    last_step = events.Scalars("grad_norm/total")[-1].step
    assert last_step < 60 * 23  # stopped before max_epochs (23 optimizer steps an epoch: 89 micro-batches by 4)

    # One floor and one B_simple per run, and the report reads the same estimate the summary printed.
    assert not {"grad_noise/noise_floor", "grad_norm/b_simple"} & set(tags["scalars"])
    floors = events.Scalars("grad_norm/noise_floor")
    assert floors[-1].step == last_step and len({e.step for e in floors}) == len(floors)
    printed_floor = float(re.search(r"noise level sqrt\(tr Σ/B\) = ([0-9.]+)", out).group(1))
    assert floors[-1].value == pytest.approx(printed_floor, abs=1e-4)
    # Beside the last norm, the norm a batch gradient is expected to have: sqrt(‖G‖² + tr Σ/B), as logged.
    expected = events.Scalars("grad_noise/expected_batch_norm")
    assert expected[-1].step == last_step
    assert expected[-1].value == pytest.approx(float(re.search(r"vs expected ([0-9.]+)", out).group(1)), abs=1e-4)
    # E‖ḡ‖² = ‖G‖² + f·tr Σ/B, f = (N − B)/(N − 1) ≈ 0.96 for a batch of 64 drawn from the ~1,400 training digits.
    g2, level = events.Scalars("grad_noise/grad_sq_norm")[-1].value, floors[-1].value
    assert g2 + 0.9 * level**2 <= expected[-1].value ** 2 <= (g2 + level**2) * (1 + 1e-6)

    assert main(["report", str(tmp_path)]) == 0
    report = capsys.readouterr().out
    assert "convergence" in report and "noise band" in report
    assert main(["report", str(tmp_path), "--format", "json"]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    rows = {row["label"]: row["value"] for section in run["sections"].values() for row in section}
    assert rows["noise floor sqrt(tr Σ/B), last"] == pytest.approx(floors[-1].value)
    assert rows["B_simple = tr Σ / ‖G‖²"] == pytest.approx(events.Scalars("grad_noise/b_simple")[-1].value)


def test_report_of_a_missing_folder_exits_2(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_the_summary_comes_last_and_the_diagnoses_are_plain_text() -> None:
    from trainvitals.demo.run import DemoResult, format_summary

    result = DemoResult(
        steps=910,
        epochs=40,
        stop_reason="stopped at optimizer step 909",
        grad_norm=0.36,
        noise_floor=0.39,
        smoothed_ratio=1.09,
        band_edge=1.1,
        val_acc=0.986,
        log_dir="runs/digits/version_0",
        seconds=31.0,
        threads=1,
        diagnoses={"GradNormMonitor": "| optimizer | steps |\n|---|---:|\n| 0 | 910 |"},
        expected_norm=0.41,
    )
    out = format_summary(result, "runs")
    short = format_summary(result, "runs", details=False)
    assert out.endswith(short)  # where the eye is when the run is over, after ~150 lines of tables
    assert short.startswith(
        "trainvitals demo — digits CNN\n  optimizer steps:   910 (40 epochs, 31 s on 1 torch thread"
    )
    assert "GradNormMonitor\n===============\noptimizer  steps\n---------  -----\n0            910" in out
    assert out.index("GradNormMonitor") < out.index("trainvitals demo")
    assert "|" not in out and "**" not in out
    assert "0.3600 at the last step vs expected 0.4100 (0.88× the expected)" in short
    assert "1.09× the noise level sqrt(tr Σ/B) = 0.3900" in short and short.count("\n") == 7


def test_version(capsys) -> None:
    from importlib.metadata import version

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.split() == ["trainvitals", version("trainvitals")]
