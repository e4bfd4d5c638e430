"""``trainvitals report``: reading event files, the health report, its formats and exit statuses.

The event files are written here with ``torch.utils.tensorboard.SummaryWriter``, the writer Lightning's
TensorBoardLogger uses, so the report is tested against the exact records a run leaves behind.
"""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest
from _models import Regressor, loader, regression_data
from torch.utils.tensorboard import SummaryWriter

from trainvitals.report.command import EXIT_CRITICAL, EXIT_NO_DATA, EXIT_OK, main
from trainvitals.text.intervals import band_ratio_said

STEPS = range(0, 100, 5)


def write_run(folder: Path, scalars: dict[str, float | list[float]], texts: dict[str, str] | None = None) -> None:
    """One run: each scalar logged at every step of STEPS (a list gives one value per step)."""
    writer = SummaryWriter(str(folder))
    for i, step in enumerate(STEPS):
        for tag, value in scalars.items():
            writer.add_scalar(tag, value[i] if isinstance(value, list) else value, step)
    for tag, text in (texts or {}).items():
        writer.add_text(tag, text, STEPS[-1])
    writer.close()


HEALTHY = {
    "grad_norm/total": [1.0 / (1 + s / 10) + 0.1 for s in STEPS],
    "grad_norm/noise_floor": 0.1,
    "grad_norm/in_noise_band": [float(s >= 70) for s in STEPS],
    "grad_noise/b_simple": 200.0,
    "grad_noise/b_simple_rel_err": 0.1,
    "grad_noise/coverage": 1.0,
    "grad_norm/nonfinite_steps": 0.0,
    "grad_norm/amp_skipped_steps": 0.0,
    "grad_norm/spike_steps": 0.0,
    "grad_norm/features.0": 0.5,
    "lr_scaling/effective_batch": 64.0,
    "memory/parameters_bytes": 160_000.0,
    "memory/activations_bytes": 3 * 2**20,
    "memory/activations/features.0": 2 * 2**20,
    "memory/activations/head.1": 2**20,
}


def report(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def report_json(capsys: pytest.CaptureFixture[str], logdir: Path) -> tuple[int, dict]:
    status, out, _ = report(capsys, str(logdir), "--format", "json")
    return status, json.loads(out)


def rows(run: dict, section: str) -> dict[str, float | str | None]:
    return {row["label"]: row["value"] for row in run["sections"][section]}


def test_healthy_run_reads_back_what_was_logged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path / "digits", HEALTHY, {"grad_norm/stop_reason": "stopped at optimizer step 95: in band"})
    status, doc = report_json(capsys, tmp_path)
    assert status == EXIT_OK and doc["critical"] is False
    (run,) = doc["runs"]
    assert run["run"] == "digits" and run["last_step"] == STEPS[-1]
    convergence = rows(run, "convergence")
    assert convergence["gradient norm, last"] == pytest.approx(HEALTHY["grad_norm/total"][-1])
    assert convergence["norm / noise level"] == pytest.approx(HEALTHY["grad_norm/total"][-1] / 0.1, rel=1e-6)
    # 6 of the last 10 logged steps (70..95) are flagged in band.
    assert convergence["fraction in the noise band, last 10 logged steps"] == pytest.approx(0.6)
    assert convergence["stop"] == "stopped at optimizer step 95: in band"
    memory = rows(run, "memory")
    assert memory["parameters"] == 160_000
    assert list(memory)[-2:] == ["saved by features.0", "saved by head.1"]  # largest first
    assert rows(run, "noise scale and batch size")["effective batch B"] == 64
    messages = " ".join(f["message"] for f in run["findings"])
    assert "in its noise band (60%" in messages
    assert "B = 64 < B_simple = 200 (± 10 %)" in messages


@pytest.mark.parametrize("in_band", [0.0, None])
@pytest.mark.parametrize(("error", "said"), [(0.083, "8.3 %"), (0.04028 / 0.03964, "102 %"), (0.005, "0.5 %")])
def test_the_band_verdict_is_one_sentence_with_the_floors_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], in_band: float | None, error: float, said: str
) -> None:
    """The norm's ratio to the floor and the floor's error read as one sentence, not "(…) (…)" side by side; the
    error as a percent a user reads (a fresh user's fine-tune read "noise level ± 1e+02%")."""
    run = {**HEALTHY, "grad_norm/noise_floor_se": 0.1 * error}
    if in_band is not None:
        run["grad_norm/in_noise_band"] = in_band
    write_run(tmp_path / "a", run)
    _, doc = report_json(capsys, tmp_path)
    (verdict,) = [f["message"] for f in doc["runs"][0]["findings"] if "noise band" in f["message"]]
    assert f"noise level ± {said}" in verdict and ") (" not in verdict
    assert verdict.startswith(
        "not in its noise band yet: 0% of the last 10 logged steps were in it; the last norm is "
        if in_band is not None
        else "in its noise band (60% of the last 10 logged steps; noise"
    )


def test_descending_run_and_runs_without_a_band(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path / "a", {**HEALTHY, "grad_norm/in_noise_band": 0.0})
    write_run(tmp_path / "b", {"grad_norm/total": 1.0})
    write_run(tmp_path / "c", {"grad_norm/total": 0.5, "grad_norm/noise_floor": 0.25})
    status, doc = report_json(capsys, tmp_path)
    assert status == EXIT_OK
    a, b, c = doc["runs"]
    assert any(f["message"].startswith("not in its noise band yet: 0% of the last 10") for f in a["findings"])
    assert any("no noise estimate" in f["message"] for f in b["findings"])
    assert any(f["message"].startswith("the last gradient norm is 2.00× its noise level") for f in c["findings"])


@pytest.mark.parametrize(
    ("tag", "section", "words"),
    [
        ("grad_norm/nonfinite_steps", "spikes and non-finite steps", "non-finite (inf/NaN) gradients on 3"),
        ("grad_norm/optimizer_1/nonfinite_steps", "spikes and non-finite steps", "non-finite (inf/NaN) gradients on 3"),
        ("graph/findings_loss_no_grad", "integrity", "the loss had no grad_fn or reached no parameter on 3 step(s)"),
        ("graph/nonfinite_losses", "integrity", "3 non-finite loss value(s) in one check window"),
        ("graph/findings_step_before_backward", "integrity", "an optimizer stepped before the backward"),
        ("graph/unoptimized_params", "integrity", "3 tensor(s) get gradients but belong to no optimizer"),
        ("graph/leaked_graphs", "integrity", "autograd nodes of an earlier step (3 walk(s))"),
    ],
)
def test_critical_counter_fails_ci(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tag: str, section: str, words: str
) -> None:
    # Seen in one early check window only: a problem seen once is still a problem.
    write_run(tmp_path / "run", {**HEALTHY, tag: [0.0, 3.0] + [0.0] * (len(STEPS) - 2)})
    status, doc = report_json(capsys, tmp_path)
    assert status == EXIT_CRITICAL and doc["critical"] is True
    critical = [f for f in doc["runs"][0]["findings"] if f["severity"] == "critical"]
    assert [(f["section"], words in f["message"]) for f in critical] == [(section, True)]


@pytest.mark.parametrize(
    ("counts", "critical"),
    [([0.0, 3.0] + [0.0] * (len(STEPS) - 2), False), ([0.0, 3.0] + [3.0] * (len(STEPS) - 2), True)],
)
def test_unused_parameters_are_critical_when_still_unused_at_the_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], counts: list[float], critical: bool
) -> None:
    """An expert without tokens in one early window that trains later is no failure; a head never used is."""
    write_run(tmp_path / "run", {**HEALTHY, "graph/unused_params": counts})
    status, doc = report_json(capsys, tmp_path)
    assert (status == EXIT_CRITICAL) is critical
    messages = [f["message"] for f in doc["runs"][0]["findings"] if f["severity"] == "critical"]
    assert [m.startswith("3 parameter(s) got no gradient in the last check window") for m in messages] == [
        True
    ] * critical


@pytest.mark.parametrize("tag", ["grad_norm/nonfinite_steps", "graph/nonfinite_losses"])
def test_a_diverged_run_gets_no_convergence_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tag: str
) -> None:
    """After NaN the last finite norm and stale noise EMAs say nothing of convergence, nor does lr advice apply."""
    # The monitor logs no norm for a non-finite step: the last three are gaps in its chart. Without the
    # monitor, the loss counter decides.
    totals = HEALTHY["grad_norm/total"][:-3] + [math.nan] * 3
    scalars = (
        {**HEALTHY, "grad_norm/total": totals}
        if tag.startswith("grad_norm/")
        else {k: v for k, v in HEALTHY.items() if not k.startswith("grad_norm/")}
    )
    # Steps are logged every 5: from the last finite norm on, every step non-finite.
    write_run(tmp_path / "run", {**scalars, tag: [0.0] * (len(STEPS) - 3) + [5.0, 10.0, 15.0]})
    _, doc = report_json(capsys, tmp_path)
    notes = [f["message"] for f in doc["runs"][0]["findings"] if f["severity"] == "note"]
    assert any(m.startswith("the run diverged (non-finite gradients or losses)") for m in notes)
    assert any(m.startswith("the run diverged: find the cause") for m in notes)
    assert not any("noise band" in m for m in notes)


@pytest.mark.parametrize(
    ("counts", "last_finite", "diverged"),
    [
        ([3.0, 8.0, 13.0], 80, True),  # NaN from step 83 on: 3 of the 5 steps after the last finite norm
        ([0.0, 0.0, 2.0], 90, False),  # the last interval partly non-finite: 2 of 5, as before
    ],
)
def test_a_nan_that_began_between_logging_steps_is_divergence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], counts: list[float], last_finite: int, diverged: bool
) -> None:
    """The monitor logs no norm for a non-finite logging step; from the last finite one the counter need
    not rise by every step (the NaN began between two logging steps), but its last interval must."""
    totals = [t if s <= last_finite else math.nan for s, t in zip(STEPS, HEALTHY["grad_norm/total"])]
    counter = [0.0] * (len(STEPS) - 3) + counts
    write_run(
        tmp_path / "run",
        {**HEALTHY, "grad_norm/total": totals, "grad_norm/nonfinite_steps": counter, "grad_norm/in_noise_band": 1.0},
    )
    _, doc = report_json(capsys, tmp_path)
    notes = [f["message"] for f in doc["runs"][0]["findings"] if f["section"] == "convergence"]
    assert any(m.startswith("the run diverged (") for m in notes) is diverged
    assert any(m.startswith("in its noise band") for m in notes) is not diverged


def test_a_non_finite_loss_counted_at_the_last_step_is_no_divergence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """GraphIntegrity flushes its loss counter at the end of training, logged one step past the last
    optimizer step, whose norm is finite."""
    scalars = {**HEALTHY, "graph/nonfinite_losses": [0.0] * len(STEPS)}
    write_run(tmp_path / "run", scalars)
    writer = SummaryWriter(str(tmp_path / "run"))
    writer.add_scalar("graph/nonfinite_losses", 1.0, STEPS[-1] + 1)
    writer.close()
    _, doc = report_json(capsys, tmp_path)
    assert not any(f["message"].startswith("the run diverged") for f in doc["runs"][0]["findings"])


@pytest.mark.parametrize(("skips", "diverged"), [([1.0], False), ([5.0, 10.0, 15.0, 20.0, 25.0], True)])
def test_a_grad_scaler_run_diverges_when_every_step_is_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], skips: list[float], diverged: bool
) -> None:
    """Under a GradScaler a non-finite step is skipped, not counted as non-finite: one skip is calibration,
    every step skipped from the last finite norm on is a run that went NaN for good."""
    n = len(skips)
    totals = HEALTHY["grad_norm/total"][: len(STEPS) - n] + [math.nan] * n if diverged else HEALTHY["grad_norm/total"]
    counter = [0.0] * (len(STEPS) - n) + skips
    write_run(tmp_path / "run", {**HEALTHY, "grad_norm/total": totals, "grad_norm/amp_skipped_steps": counter})
    _, doc = report_json(capsys, tmp_path)
    notes = [f["message"] for f in doc["runs"][0]["findings"] if f["severity"] == "note"]
    assert any(m.startswith("the run diverged (") for m in notes) is diverged


def test_a_run_that_trains_on_after_a_non_finite_step_has_not_diverged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_run(tmp_path / "run", {**HEALTHY, "grad_norm/nonfinite_steps": [0.0, 0.0, 1.0] + [1.0] * (len(STEPS) - 3)})
    status, doc = report_json(capsys, tmp_path)
    assert status == EXIT_CRITICAL  # a non-finite step is still worth a look
    notes = [f["message"] for f in doc["runs"][0]["findings"] if f["severity"] == "note"]
    assert not any(m.startswith("the run diverged") for m in notes) and any("noise band" in m for m in notes)


def test_growing_held_graph_is_critical(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    held = [0.0] * (len(STEPS) - 2) + [2**20, 2 * 2**20]
    write_run(tmp_path / "leak", {**HEALTHY, "memory/held_saved_bytes": held})
    write_run(tmp_path / "flat", {**HEALTHY, "memory/held_saved_bytes": 2**20})
    status, doc = report_json(capsys, tmp_path)
    assert status == EXIT_CRITICAL
    flat, leak = doc["runs"]
    assert not flat["critical"]
    (finding,) = [f for f in leak["findings"] if f["severity"] == "critical"]
    assert finding["section"] == "memory"
    assert "2.00 MiB of saved tensors still held after backward, up from 1.00 MiB" in finding["message"]
    assert rows(leak, "memory")["held after backward"] == 2 * 2**20


def test_amp_skips_and_spikes_are_not_critical(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spike = "gradient-norm spike at optimizer step 55: 6.0× its running average; largest layers: head.1"
    write_run(
        tmp_path / "run",
        {**HEALTHY, "grad_norm/amp_skipped_steps": 4.0, "grad_norm/spike_steps": 1.0},
        {"grad_norm/spikes": spike},
    )
    status, doc = report_json(capsys, tmp_path)
    assert status == EXIT_OK
    findings = {
        f["severity"]: f["message"]
        for f in doc["runs"][0]["findings"]
        if "GradScaler" in f["message"] or "spike" in f["message"]
    }
    assert "skipped 4 step(s)" in findings["note"]
    assert findings["warning"].endswith(spike)


def test_text_and_markdown_formats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    advice = "- **effective batch** 64\n\n| optimizer | lr now |\n|---|---|\n| Adam | 0.001 |"
    write_run(tmp_path / "run", {**HEALTHY, "graph/unused_params": 2.0}, {"lr_scaling/advice": advice})
    status, text, _ = report(capsys, str(tmp_path))
    assert status == EXIT_CRITICAL
    assert text.startswith("run run: CRITICAL, last logged optimizer step 95")
    assert "[critical] integrity: 2 parameter(s) got no gradient" in text
    assert "    saved activations    3.00 MiB\n    parameters           156.25 KiB\n" in text
    status, markdown, _ = report(capsys, str(tmp_path), "--format", "markdown")
    assert status == EXIT_CRITICAL
    assert "## run `run`: CRITICAL" in markdown
    assert (
        "### memory\n\n| measure | value |\n|---|---|\n| saved activations | 3.00 MiB |\n| parameters | 156.25 KiB |"
        in markdown
    )
    assert "- **critical** (integrity): 2 parameter(s) got no gradient" in markdown
    # A callback's own markdown is passed through whole in markdown; in text, as plain text under its title
    # with its table aligned, and the findings come before the sections.
    assert f"### lr scaling advice\n\n{advice}\n" in markdown
    assert (
        "  lr scaling advice\n    - effective batch 64\n\n    optimizer  lr now\n    ---------  ------\n"
        "    Adam       0.001\n"
    ) in text
    assert text.index("[critical] integrity") < text.index("  convergence\n") and "|" not in text
    assert markdown.index("### findings") < markdown.index("### convergence")


def test_infinite_noise_scale_stays_valid_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path / "run", {**HEALTHY, "grad_noise/b_simple": float("inf")})
    status, doc = report_json(capsys, tmp_path)
    assert status == EXIT_OK
    assert rows(doc["runs"][0], "noise scale and batch size")["B_simple = tr Σ / ‖G‖²"] == "inf"


def test_foreign_runs_are_skipped_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path / "ours", HEALTHY)
    write_run(tmp_path / "theirs", {"loss": 1.0})
    status, doc = report_json(capsys, tmp_path)
    assert status == EXIT_OK
    assert [r["run"] for r in doc["runs"]] == ["ours"] and doc["skipped_runs"] == ["theirs"]


def _missing(tmp_path: Path) -> Path:
    return tmp_path / "nowhere"


def _empty(tmp_path: Path) -> Path:
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty"


def _a_file(tmp_path: Path) -> Path:
    (tmp_path / "notes.txt").write_text("hello")
    return tmp_path / "notes.txt"


def _foreign(tmp_path: Path) -> Path:
    write_run(tmp_path / "other", {"loss": 1.0, "accuracy": 0.5})
    return tmp_path


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (_missing, "does not exist"),
        (_empty, "no TensorBoard event files"),
        (_a_file, "is not a folder"),
        (_foreign, "hold no trainvitals metrics"),
    ],
)
def test_nothing_to_report_is_exit_2_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make, words: str
) -> None:
    status, out, err = report(capsys, str(make(tmp_path)))
    assert status == EXIT_NO_DATA
    assert out == ""
    assert err.startswith("trainvitals report: ") and words in err
    assert "Traceback" not in err


def test_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = report(capsys, str(tmp_path), "--format", "yaml")
    assert status == 2 and "invalid choice: 'yaml'" in err
    status, out, _ = report(capsys, "--help")
    assert status == 0 and "--format {text,markdown,json,html}" in out


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"grad_noise/coverage": 0.43}, "partial: the noise estimate covers 43% of ‖ḡ‖²"),
        (
            {"grad_noise/coverage": 0.95, "grad_noise/unmeasured_trace_share": 0.47},
            "partial: the noise estimate covers 95% of ‖ḡ‖², but the unmeasured parameters may hold up to 0.47× the measured tr Σ",
        ),
        ({"grad_noise/b_simple_rel_err": 3.0}, "B_simple = 200 is unreliable (relative error 3)"),
    ],
)
def test_noise_verdicts_carry_the_estimates_caveat(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra, words
) -> None:
    write_run(tmp_path / "run", {**HEALTHY, **extra})
    status, doc = report_json(capsys, tmp_path)
    messages = [f["message"] for f in doc["runs"][0]["findings"]]
    assert status == EXIT_OK and any(words in m for m in messages)
    assert not any(m.startswith("B = 64 < B_simple") for m in messages)  # no batch verdict
    if "partial" in words:  # nor a noise-band verdict on a partly measured model
        assert not any("in its noise band" in m for m in messages)


def test_a_partial_estimate_names_what_the_probe_does_not_measure(tmp_path: Path, capsys) -> None:
    """A fresh user's ViT: its report said "partial" without naming the tensors left out (a bare `pos_embed` and
    `cls_token`, 3 % of the parameters, two thirds of ‖ḡ‖²; read through a slice here); it quotes them from the
    probe's diagnosis panel, and says as before where the log keeps no panel."""
    said = (
        "not measured: 2 tensors (3.2% of parameters), `model.cls_token`, `model.pos_embed`: a parameter of a module "
        "whose forward also runs layers with weight matrices, which a step found not measurable where the graph "
        "broadcasts it over the examples (that step's warning says why); accumulate_grad_batches >= 2 or >= 2 "
        "devices measure it"
    )
    panel = f"| | |\n|---|---|\n| sources | per-example norms in backward: Linear×5 (96.8% of parameters); {said} |\n"
    for texts, named in ((None, False), ({"diagnosis/BatchVarianceProbe": panel}, True)):
        folder = tmp_path / str(named)
        write_run(folder / "run", {**HEALTHY, "grad_noise/coverage": 0.43}, texts)
        _, doc = report_json(capsys, folder)
        partial = [f["message"] for f in doc["runs"][0]["findings"] if "partial:" in f["message"]]
        assert partial and all((said in m) is named for m in partial), partial


@pytest.mark.parametrize(("high", "bounded"), [(260.0, True), (None, False)])
def test_an_unreliable_b_simple_says_no_upper_bound_only_without_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], high, bounded
) -> None:
    """Flagged unreliable with no relative error logged (an infinite one is not): the reason follows the interval
    quoted, "no finite error bar" only where that interval has no upper end (issue #24)."""
    tags = {k: v for k, v in HEALTHY.items() if k != "grad_noise/b_simple_rel_err"}
    ends = {"grad_noise/b_simple_low": 150.0} | ({} if high is None else {"grad_noise/b_simple_high": high})
    write_run(tmp_path / "run", {**tags, "grad_noise/b_simple_unreliable": 1.0, **ends})
    status, doc = report_json(capsys, tmp_path)
    message = next(f["message"] for f in doc["runs"][0]["findings"] if "is unreliable" in f["message"])
    assert status == EXIT_OK and ("150–260 (90 %)" in message) == bounded and ("≥ 150 (90 %)" in message) != bounded
    assert ("no finite error bar" in message) != bounded


def test_an_upper_end_taken_by_the_reshuffled_epoch_s_excess_is_named_in_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fresh user's shuffled fit (N = 455): the report said "no finite error bar: too few measurements, or ‖G‖² not
    resolved from zero" after 98.5 effective measurements, ‖G‖² 5.6 standard errors from zero. The logged δ_R
    (``grad_noise/reshuffle_excess``) was the cause: named, with its numbers; without it the old reason stays."""
    tags = {k: v for k, v in HEALTHY.items() if k != "grad_noise/b_simple_rel_err"}
    tags |= {
        "grad_noise/b_simple": 124.3,
        "grad_noise/b_simple_low": 81.8,
        "grad_noise/b_simple_unreliable": 1.0,
        "grad_noise/grad_sq_norm": 0.0117,
        "grad_noise/grad_sq_norm_se": 0.0021,
        "grad_noise/trace_cov": 1.457,
        "grad_noise/trace_cov_high": 1.861,
        "grad_noise/effective_measurements": 98.5,
    }
    for excess, named in ((0.0164, True), (None, False)):
        folder = tmp_path / str(named)
        write_run(folder / "run", tags | ({} if excess is None else {"grad_noise/reshuffle_excess": excess}))
        _, doc = report_json(capsys, folder)
        message = next(f["message"] for f in doc["runs"][0]["findings"] if "is unreliable" in f["message"])
        assert ("not of the 0.0164 a reshuffled epoch can add" in message and "N = 455" in message) == named, message
        assert ("too few measurements" in message) != named and "≥ 81.8 (90 %)" in message
        section = rows(doc["runs"][0], "noise scale and batch size")
        assert ("δ_R" in str(section["B_simple relative error"])) == named, section


def test_the_noise_section_quotes_the_latest_interval_where_no_point_is_logged(tmp_path: Path, capsys) -> None:
    """A fresh user's CNN: after step 440 ‖G‖² ≤ 0 logged no B_simple point but its lower end went on (265, 496, 330),
    and the section, anchored at the last point, quoted the interval of step 440 beside later, larger bounds."""
    writer = SummaryWriter(str(tmp_path / "run"))
    for step in STEPS:
        if step <= 50:
            writer.add_scalar("grad_noise/b_simple", 254.0, step)
        writer.add_scalar("grad_noise/b_simple_low", 118.0 if step <= 50 else 330.0, step)
        writer.add_scalar("lr_scaling/effective_batch", 64.0, step)
    writer.close()
    _, doc = report_json(capsys, tmp_path)
    section = rows(doc["runs"][0], "noise scale and batch size")
    assert section["B_simple, 90 % interval"] == "≥ 330 (90 %)", section


def _no_point_at_the_end(folder: Path, point_at_end: bool = False, low_at_end: float = 281.0) -> None:
    """A fresh user's BatchNorm run: B_simple flagged unreliable throughout, its last point 554.5 (step 85), then
    ‖G‖² ≤ 0 (-0.0116) at the last two steps, which logged B_simple's lower end and no point (it is infinite);
    ``point_at_end``: its LayerNorm twin, a point at every step."""
    writer = SummaryWriter(str(folder))
    for step in STEPS:
        end = step >= 90
        if point_at_end or not end:
            writer.add_scalar("grad_noise/b_simple", 554.5, step)
        writer.add_scalar("grad_noise/b_simple_low", low_at_end if end else 142.0, step)
        writer.add_scalar("grad_noise/grad_sq_norm", 0.0095 if point_at_end or not end else -0.0116, step)
        writer.add_scalar("grad_noise/b_simple_unreliable", 1.0, step)
        writer.add_scalar("lr_scaling/effective_batch", 32.0, step)
    writer.close()


def test_an_interval_of_a_step_with_no_point_is_not_read_beside_an_older_point(tmp_path: Path, capsys) -> None:
    """The section gave "554.5 examples (at optimizer step 300)" beside the interval "≥ 281 (90 %)" of step 309, as
    one reading: the row says there is no point at the section's step and why, and the older point is its own
    row, dated and called older; no relative error of a point not shown."""
    _no_point_at_the_end(tmp_path / "run")
    _, doc = report_json(capsys, tmp_path)
    (run,) = doc["runs"]
    assert run["steps"]["noise scale and batch size"] == 95
    section = {row["label"]: row for row in run["sections"]["noise scale and batch size"]}
    assert section["B_simple = tr Σ / ‖G‖²"]["value"] == "none: the smoothed ‖G‖² is -0.0116 ≤ 0"
    assert section["B_simple = tr Σ / ‖G‖²"]["step"] is None
    older = section["B_simple's last point estimate (older)"]
    assert (older["value"], older["step"]) == (554.5, 85)
    assert section["B_simple, 90 % interval"]["value"] == "≥ 281 (90 %)" and "B_simple relative error" not in section
    _, text, _ = report(capsys, str(tmp_path))
    assert re.search(r"\n    B_simple's last point estimate \(older\) +554.5 examples \(at optimizer step 85\)\n", text)


@pytest.mark.parametrize("point_at_end", [False, True])
def test_an_unreliable_b_simple_gets_its_note_with_a_point_or_without(
    tmp_path: Path, capsys, point_at_end: bool
) -> None:
    """The LayerNorm run, a point at its last step, got "B_simple = 179 is unreliable …; B_simple ≥ 64.5 (90 %)";
    the BatchNorm run, no point there (‖G‖² ≤ 0), got no note: the note was read off the point. Both get it, of
    the last step, with that step's interval, and no number of an older step."""
    _no_point_at_the_end(tmp_path / "run", point_at_end)
    _, doc = report_json(capsys, tmp_path)
    (note,) = [f["message"] for f in doc["runs"][0]["findings"] if f["section"] == "noise scale and batch size"]
    assert "is unreliable" in note and "at optimizer step 95; B_simple ≥ 281 (90 %): no batch-size verdict" in note
    assert ("B_simple = 554" in note) == point_at_end
    assert ("no point estimate: the smoothed ‖G‖² is -0.0116 ≤ 0" in note) != point_at_end


def test_the_overview_gives_no_older_point_for_a_step_without_one(tmp_path: Path, capsys) -> None:
    """The overview's B_simple is of the section's step: the bound where that step has one, "none (‖G‖² ≤ 0)"
    where it has neither a point nor a lower end > 0 — never the point of an earlier step."""
    _no_point_at_the_end(tmp_path / "a")
    _no_point_at_the_end(tmp_path / "b", low_at_end=0.0)
    _, text, _ = report(capsys, str(tmp_path))
    a, b = text.splitlines()[3:5]
    assert "≥ 281 (90 %)" in a and "none (‖G‖² ≤ 0)" in b
    assert "554" not in a + b


class _DivergesAt(Regressor):
    """Every loss from optimizer step ``at`` on is NaN: the run diverged for good."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * math.nan if self.global_step >= self.at else loss


@pytest.mark.parametrize("callback", ["stopper", "probe"])
def test_a_diverged_run_watched_by_the_stopper_or_the_probe_alone_is_critical(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], callback: str
) -> None:
    """Without GradNormMonitor the callback that sees every step's gradient counts the non-finite ones
    under the monitor's tag: 10 finite steps, then NaN ones, logged every 5 — the last log, at step 20,
    counts steps 10 to 20."""
    from conftest import trainer_kwargs
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import TensorBoardLogger

    from trainvitals import BatchVarianceProbe, GradNormEarlyStopping

    watcher = GradNormEarlyStopping(min_steps=0, patience=5) if callback == "stopper" else BatchVarianceProbe()
    accumulate = 2 if callback == "stopper" else 1  # the stopper's noise source: micro-batches
    Trainer(
        **trainer_kwargs(
            callbacks=[watcher],
            max_steps=24,
            log_every_n_steps=5,
            accumulate_grad_batches=accumulate,
            logger=TensorBoardLogger(str(tmp_path), name="r", version=0),
        )
    ).fit(_DivergesAt(10), loader(regression_data(n=192), 8))
    status, data = report_json(capsys, tmp_path)
    (run,) = data["runs"]
    assert status == EXIT_CRITICAL and run["status"] == "CRITICAL"
    assert rows(run, "spikes and non-finite steps")["steps with non-finite gradients"] == 11
    assert any("diverged" in f["message"] for f in run["findings"] if f["section"] == "convergence")
    assert not any("noise band" in f["message"] for f in run["findings"] if f["section"] == "convergence")


def test_a_stop_on_the_band_is_the_band_verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The stopper stopped on the band (every step of its patience in it) while the few logged flags were
    mostly out: the verdict is the stop's, not "not in its noise band yet". It says the streak the stop came on
    (a fresh user read "40% of the last 10 logged steps were in it" beside a stop on 19 steps in a row): the flags
    logged within it were set, and the last 10 reach back before it."""
    from trainvitals.noise.stopper import StopReason
    from trainvitals.report.command import BAND_STOP

    assert BAND_STOP == StopReason.NOISE_BAND.value
    stop = f"stopped at optimizer step 95 (after 96 steps): {BAND_STOP} (‖G‖² ≤ 0.2·tr(Σ)/B) for 10 consecutive steps."
    write_run(
        tmp_path / "run",
        {
            **HEALTHY,
            "grad_norm/in_noise_band": [float(s >= 85) for s in STEPS],
            "grad_norm/band_streak": [float(max(s - 82, 0)) for s in STEPS],  # 13 at the stop: steps 83–95
        },
        {"grad_norm/stop_reason": stop},
    )
    _, data = report_json(capsys, tmp_path)
    verdicts = [f["message"] for f in data["runs"][0]["findings"] if f["section"] == "convergence"]
    assert verdicts[0] == stop
    assert verdicts[1].startswith("in its noise band: GradNormEarlyStopping stopped the run on it")
    assert verdicts[1].endswith(
        ", on grad_norm/band_streak 13 at its stop (optimizer steps 83–95 in a row in the band): 3 of the 3 band "
        "flag(s) logged in them set; 30% of the last 10 logged steps were in the band, back to step 50, before the "
        "streak began."
    ), verdicts[1]
    assert not any("not in its noise band" in v for v in verdicts)


def test_a_norm_below_its_floor_never_stands_out_of_the_noise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_run(tmp_path / "run", {**HEALTHY, "grad_norm/total": 0.05, "grad_norm/in_noise_band": 0.0})
    _, data = report_json(capsys, tmp_path)
    (verdict,) = [f["message"] for f in data["runs"][0]["findings"] if "noise band yet" in f["message"]]
    assert "0.50× the noise level" in verdict and "stands out" not in verdict


def test_a_small_relative_error_keeps_two_significant_digits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_run(tmp_path / "run", {**HEALTHY, "grad_noise/b_simple_rel_err": 0.0041})
    _, doc = report_json(capsys, tmp_path)
    messages = " ".join(f["message"] for f in doc["runs"][0]["findings"])
    assert "B_simple = 200 (± 0.41 %)" in messages and "± 0 %" not in messages


def test_a_dropped_noise_source_reaches_the_report_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    said = "the noise source probe is dropped from the estimate: it disagrees with the micro-batch/rank source"
    write_run(tmp_path / "run", HEALTHY, texts={"grad_noise/sources_check": said})
    _, doc = report_json(capsys, tmp_path)
    found = [f for f in doc["runs"][0]["findings"] if said in f["message"]]
    assert len(found) == 1 and found[0]["severity"] == "warning"


def test_the_last_norm_and_the_lr_say_their_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A fresh user's report read "gradient norm, last 0.2587" and "lr now, AdamW 9.518e-07" (step 395) beside
    GradNormMonitor's "last ‖g‖ 0.2279" (step 399) and the advisor's "now 0" (step 400): the rows say their step."""
    write_run(tmp_path / "run", {**HEALTHY, "lr_scaling/lr/SGD": 0.01, "lr_scaling/base_lr/SGD": 0.1})
    status, text, _ = report(capsys, str(tmp_path))
    assert status == 0 and "  convergence\n" in text  # the section's own step is the run's last: no heading date
    norm = HEALTHY["grad_norm/total"][-1]
    assert re.search(rf"\n    gradient norm, last +{norm:.4g} \(at optimizer step 95\)\n", text), text
    assert re.search(r"\n    lr, SGD +0\.01 \(at optimizer step 95\)\n", text), text
    assert re.search(r"\n    base lr, SGD +0\.1\n", text), text  # the lr set: one for the whole run


def test_section_rows_are_labelled_in_words_not_tags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """LRScalingAdvisor's and GraphIntegrityCallback's tags read as words; each value is the one logged."""
    logged = {
        "lr_scaling/b_noise": 400.0,
        "lr_scaling/steps_over_min": 1 + 400 / 64,
        "lr_scaling/examples_over_min": 1 + 64 / 400,
        "lr_scaling/lr/SGD": 0.01,
        "lr_scaling/base_lr/SGD": 0.1,
        "lr_scaling/suggested_lr_x2/SGD": 0.2,
        "lr_scaling/suggested_lr_b100/SGD": 0.15,
        "graph/unoptimized_params": 3.0,
        "graph/unregistered_params": 2.0,
        "graph/dead_params": 0.0,
    }
    write_run(tmp_path / "run", {**HEALTHY, **logged})
    _, doc = report_json(capsys, tmp_path)
    noise = rows(doc["runs"][0], "noise scale and batch size")
    assert noise["noise scale B̂ (given)"] == 400
    assert noise["steps over the fewest, S/S_min = 1 + B̂/B"] == pytest.approx(1 + 400 / 64)
    assert noise["examples over the fewest, E/E_min = 1 + B/B̂"] == pytest.approx(1 + 64 / 400)
    assert noise["lr, SGD"] == pytest.approx(0.01)  # the step's, a schedule's at a tenth of its base lr
    assert noise["base lr, SGD"] == pytest.approx(0.1)
    assert noise["suggested base lr at ×2 (B = 128), SGD"] == pytest.approx(0.2)  # the effective batch is 64
    assert noise["suggested base lr at B = 100, SGD"] == pytest.approx(0.15)
    assert list(rows(doc["runs"][0], "integrity").items()) == [
        ("parameters with an exactly zero gradient", 0),
        ("tensors with a gradient in no optimizer", 3),
        ("of those, not registered on the module", 2),
    ]
    _, text, _ = report(capsys, str(tmp_path))
    assert not re.search(r"\b(b_noise|steps_over_min|suggested_lr|unoptimized_params|dead_params)\b", text)


FROM_START = (
    "in its noise band from the start (optimizer step 80): the batch (64) is below B_simple (B_simple ≥ 192 (90 %)), "
    "and it was never shown out of the band from its 20th measurement, when the estimate could first judge it."
)
CAVEAT = (
    "trainvitals GradNormEarlyStopping: the noise estimate cannot decide: no valid noise source (micro_batch: "
    "fewer than 2 micro-batches). It will not stop on the noise band while that lasts."
)


@pytest.mark.parametrize(
    ("scalars", "texts", "said"),
    [
        (
            {},
            {},
            "not stopped: in the noise band on 6 of 20 logged steps; the logged streak in its condition reached 26 "
            "step(s) in a row, short of its patience or before min_steps",
        ),
        (  # a full streak the stopper held (never out of the band), and no text panel: what the scalars show
            {"grad_norm/held_from_start": [float(s >= 80) for s in STEPS]},
            {},
            "not stopped: held: in its noise band from the start, its streak reached its patience (the logged streak "
            "reached 26 step(s) in a row) but the run was never shown out of the band",
        ),
        (  # the same with its panel: its own words, not read as a stop
            {"grad_norm/held_from_start": [float(s >= 80) for s in STEPS]},
            {"grad_norm/stop_reason": f"trainvitals GradNormEarlyStopping: {FROM_START}."},
            f"not stopped: {FROM_START.removesuffix('.')}",
        ),
        ({"grad_norm/in_noise_band": 0.0}, {}, "not stopped: never in the noise band, on any of the 20 logged steps"),
        (
            {"grad_norm/in_noise_band": None},
            {"grad_noise/caveat": CAVEAT},
            "not stopped: the noise estimate cannot decide: no valid noise source (micro_batch: fewer than 2 micro-batches)",
        ),
        (
            {"grad_norm/in_noise_band": None, "grad_noise/coverage": 0.5},
            {},
            "not stopped: partial: the noise estimate covers 50% of ‖ḡ‖²",
        ),
        (
            {"grad_norm/in_noise_band": None, "grad_norm/noise_floor": None},
            {},
            "not stopped: no noise estimate was logged, so no noise band",
        ),
        (
            {"grad_norm/in_noise_band": None},
            {},
            "not stopped: no noise-band flag was logged (the estimate had fewer than 20",
        ),
        ({"grad_norm/band_streak": None}, {}, "no stop rule: no GradNormEarlyStopping logged"),
    ],
)
def test_the_stop_row_says_why_the_stopper_did_not_stop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], scalars, texts, said
) -> None:
    # HEALTHY is in the band from step 70 (6 of the 20 logged steps): a streak of 26 steps at step 95.
    logged = {**HEALTHY, "grad_norm/band_streak": [float(s - 69) if s >= 70 else 0.0 for s in STEPS]}
    logged = {tag: value for tag, value in {**logged, **scalars}.items() if value is not None}
    write_run(tmp_path / "run", logged, texts)
    _, doc = report_json(capsys, tmp_path)
    assert rows(doc["runs"][0], "convergence")["stop"].startswith(said)


def stopper_panel(stop: str, streak: str, seen: int) -> str:
    """GradNormEarlyStopping's end-of-fit table as TrainvitalsDashboard logs it (the rows the report reads)."""
    from trainvitals.text.markdown import markdown_table

    return "\n".join(
        markdown_table(
            ("quantity", "value"),
            [
                ("rule", "noise band, margin 0.2, patience 30 steps, min_steps 100"),
                ("stop", stop),
                ("optimizer steps seen", str(seen)),
                ("in-condition streak", streak),
                ("noise sources", "probe"),
            ],
        )
    )


@pytest.mark.parametrize(
    ("stop", "streak", "verdict", "said"),
    [
        (
            "GradNormEarlyStopping did not stop the run: 27 step(s) in a row in the condition at the end, of the 30 it "
            "needs; at the end the smoothed ‖G‖² is 0.89× the band's edge 0.2·tr(Σ)/B.",
            "27 of 30 steps",
            "in its noise band at the end, for 27 step(s) in a row, short of the 30",
            "not stopped: 27 step(s) in a row in the condition at the end, of the 30 it needs; at the end the smoothed",
        ),
        # An older table says only that it did not stop: its streak is the reason.
        (
            "GradNormEarlyStopping did not stop the run.",
            "27 of 30 steps",
            "in its noise band at the end, for 27 step(s)",
            "not stopped: 27 of 30 steps in a row in its condition at the end, over 288 optimizer steps",
        ),
        (
            "GradNormEarlyStopping did not stop the run: the run ended after 60 optimizer steps, before min_steps=100; 0 "
            "step(s) in a row in the condition at the end, of the 30 it needs.",
            "0 of 30 steps",
            "no noise-band verdict: the run ended before the stopper's min_steps",
            "not stopped: the run ended after 60 optimizer steps, before min_steps=100",
        ),
        # An older table of a run shorter than min_steps: its rule and steps seen say so.
        (
            "GradNormEarlyStopping did not stop the run.",
            "0 of 30 steps",
            "no noise-band verdict: the run ended before the stopper's min_steps",
            "not stopped: the run ended after 60 optimizer steps, before min_steps=100",
        ),
    ],
)
def test_the_stop_verdict_is_the_stoppers_own_at_fit_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], stop, streak, verdict, said
) -> None:
    """Logged every 50 steps, the 5 band flags were all out while the stopper, counting every step, ended 27 steps
    into the band: the report's verdict and stop row are the stopper's, and name how few flags it saw."""
    flags = [0.0] * len(STEPS)
    seen = 60 if "min_steps" in said else 288
    write_run(
        tmp_path / "run",
        {**HEALTHY, "grad_norm/in_noise_band": flags, "grad_norm/band_streak": 0.0},
        {"diagnosis/GradNormEarlyStopping": stopper_panel(stop, streak, seen)},
    )
    _, doc = report_json(capsys, tmp_path)
    (run,) = doc["runs"]
    assert rows(run, "convergence")["stop"].startswith(said)
    assert [r["step"] for r in run["sections"]["convergence"] if r["label"] == "stop"] == [None]  # written at step 95
    notes = [f["message"] for f in run["findings"] if f["section"] == "convergence"]
    assert any(m.startswith(verdict) and f"logged on 20 of its {seen} steps" in m for m in notes), notes
    assert not any("never in the noise band" in m or "not in its noise band yet" in m for m in notes)


PLATEAU = (
    "in its noise band for a full streak at optimizer step 249, but the training loss fell 2% since the start "
    "(2.35 → 2.30), below min_loss_drop 10%: a plateau the run has not left, not a minimum it reached (the gradient's "
    "statistics cannot tell the two apart)"
)
ADVICE = (
    "to leave a plateau, train at a higher learning rate or with a warm-up, or change the initialisation or add "
    "normalisation layers; a run that started at its minimum (fine-tuning a converged model) is no plateau: "
    "min_loss_drop=None lets the band {acts} there"
)


@pytest.mark.parametrize(
    ("tag", "stop", "severity", "acts"),
    [
        (  # held on its plateau to the end, in the stopper's words with their advice
            "GradNormEarlyStopping",
            f"GradNormEarlyStopping did not stop the run: {PLATEAU}; its streak full at the end (429 step(s) in a row, "
            f"of the 30 it needs) and held by min_loss_drop; {ADVICE.format(acts='stop the run')}.",
            "warning",
            "stop the run",
        ),
        (  # an older table, without the advice: the report gives it
            "GradNormEarlyStopping",
            f"GradNormEarlyStopping did not stop the run: {PLATEAU}; 429 step(s) in a row in the condition at the end, "
            "of the 30 it needs.",
            "warning",
            "stop the run",
        ),
        (
            "BandSchedule",
            f"BandSchedule made no cut; did not stop the run: {PLATEAU}; its streak full at the end (429 step(s) in a "
            f"row, of the 30 it needs) and held by min_loss_drop; {ADVICE.format(acts='cut the lr or stop the run')}; "
            "the band did not end the fit: bound it by steps or by a validation-loss EarlyStopping.",
            "warning",
            "cut the lr or stop the run",
        ),
        (  # held on its plateau once (its panel), then left it: the rule released it, a note as before
            "GradNormEarlyStopping",
            "GradNormEarlyStopping did not stop the run: 3 step(s) in a row in the condition at the end, of the 30 it "
            "needs.",
            "note",
            None,
        ),
    ],
)
def test_a_run_that_ended_on_its_plateau_is_a_warning_with_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tag, stop, severity, acts
) -> None:
    """A fresh user's report gave only a note for a run held on its plateau to the end, and no advice: it is a
    warning that says the run ended held there, with what gets a run off a plateau (once); a run the loss rule
    released later keeps its note."""
    streak = "reached 30 (429 steps in a row)" if severity == "warning" else "3 of 30 steps"
    write_run(
        tmp_path / "run",
        {**HEALTHY, "grad_norm/band_streak": 0.0},
        {
            f"diagnosis/{tag}": stopper_panel(stop, streak, 678),
            "grad_norm/stop_reason": f"trainvitals {tag}: {PLATEAU}.",
        },
    )
    _, doc = report_json(capsys, tmp_path)
    (run,) = doc["runs"]
    (verdict,) = [f for f in run["findings"] if f["section"] == "convergence" and "noise band" in f["message"]]
    assert verdict["severity"] == severity, verdict
    if acts is None:
        assert "plateau" not in verdict["message"] and "not stopped: 3 step(s)" in rows(run, "convergence")["stop"]
        return
    assert verdict["message"].startswith(
        "ended on a plateau its training loss never left: in its noise band for 429 step(s) in a row (its patience is "
        "30), held there by min_loss_drop"
    ), verdict
    assert verdict["message"].count(ADVICE.format(acts=acts)) == 1, verdict
    assert rows(run, "convergence")["stop"].startswith(
        f"not stopped: {'made no cut; ' if tag == 'BandSchedule' else ''}{PLATEAU}"
    )


def _ratio_line(name: str, said: str, then: str) -> str:
    """The stop row of a stopper that did not stop, as ``noise.stopper`` words its band ratio at the end."""
    cuts = " made no cut;" if name == "BandSchedule" else ""
    return (
        f"{name}{cuts} did not stop the run: 0 step(s) in a row in the condition at the end, of the 30 it needs; at "
        "the end the current estimate ‖G‖² = 0.00804 ± 0.0074 puts the band ratio (‖G‖² over the band's edge "
        f"0.2·tr(Σ)/B, its interval from ‖G‖²'s and tr(Σ)'s errors) at {said}{then}."
    )


@pytest.mark.parametrize("name", ["GradNormEarlyStopping", "BandSchedule"])
@pytest.mark.parametrize(
    ("ratio", "then", "verdict"),
    [
        (
            (1.3, 0.0, 3.4),
            "; that interval reaches into the band: not shown to be outside it",
            "not shown inside or outside its noise band at the end (band ratio 1.3, 90 %: 0–3.4)",
        ),
        (
            (-0.4, 0.0, 1.2),
            "; that interval reaches into the band: not shown to be outside it",
            "not shown inside or outside its noise band at the end (band ratio ≤ 1.2, 90 %; ‖G‖² within its error of 0)",
        ),
        (
            (0.5, 0.2, 0.8),
            "; that interval lies inside the band",
            "inside its noise band at the end, its streak not yet begun (band ratio 0.5, 90 %: 0.2–0.8)",
        ),
        ((3.0, 1.5, 4.5), "", "not in its noise band at the end (band ratio 3, 90 %: 1.5–4.5)"),
    ],
)
def test_the_end_verdict_is_the_band_ratio_s_interval_as_the_stopper_says_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name, ratio, then, verdict
) -> None:
    """A fresh user's UNet: the stopper ended "at 1.3 (90 %: 0–3.4); that interval reaches into the band: not shown
    to be outside it" (the full-data ratio 0.12: inside), and the report's verdict read "not in its noise band at the
    end (the last step the stopper counted was outside it)". The interval decides the verdict's words too."""
    write_run(
        tmp_path / "run",
        {**HEALTHY, "grad_norm/in_noise_band": 0.0, "grad_norm/band_streak": 0.0},
        {f"diagnosis/{name}": stopper_panel(_ratio_line(name, band_ratio_said(*ratio), then), "0 of 30 steps", 400)},
    )
    _, doc = report_json(capsys, tmp_path)
    notes = [f["message"] for f in doc["runs"][0]["findings"] if f["section"] == "convergence"]
    assert any(m.startswith(f"{verdict}. {name} at fit end: ") for m in notes), notes
    assert ("not in its noise band" in " ".join(notes)) == (ratio[1] > 1)


def test_an_estimate_that_cannot_decide_is_no_verdict_at_fit_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A BatchNorm CNN on one device: no valid noise source, so the stopper's streak stays 0. An older table
    (no reason in its stop row) reads as its caveat, not as "not in its noise band"."""
    write_run(
        tmp_path / "run",
        {**HEALTHY, "grad_norm/band_streak": 0.0, "grad_norm/in_noise_band": 0.0},
        {
            "diagnosis/GradNormEarlyStopping": stopper_panel(
                "GradNormEarlyStopping did not stop the run.", "0 of 30 steps", 276
            ),
            "grad_noise/caveat": CAVEAT,
        },
    )
    _, doc = report_json(capsys, tmp_path)
    (run,) = doc["runs"]
    assert rows(run, "convergence")["stop"] == "not stopped: " + CAVEAT.removeprefix(
        "trainvitals GradNormEarlyStopping: "
    ).rstrip(".")
    notes = [f["message"] for f in run["findings"] if f["section"] == "convergence"]
    assert any(m.startswith("no noise-band verdict: the noise estimate could not decide.") for m in notes), notes
    assert not any("not in its noise band" in m for m in notes)


def test_a_handful_of_band_flags_says_how_few(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without the stopper's table (a fit that did not end), a verdict from 5 logged flags says they are 5 single
    steps, not a share of the time."""
    writer = SummaryWriter(str(tmp_path / "run"))
    for step in range(0, 250, 50):
        for tag, value in {
            "grad_norm/total": 0.08,
            "grad_norm/noise_floor": 0.44,
            "grad_norm/in_noise_band": 0.0,
            "grad_norm/band_streak": 0.0,
        }.items():
            writer.add_scalar(tag, value, step)
    writer.close()
    _, doc = report_json(capsys, tmp_path)
    notes = [f["message"] for f in doc["runs"][0]["findings"] if f["section"] == "convergence"]
    (verdict,) = [m for m in notes if "noise band" in m]
    assert verdict.startswith("not in its noise band yet: 0 of only 5 logged steps were in it")
    assert "Only 5 band flag(s) were logged, each of one step" in verdict and "0%" not in verdict


def test_sections_and_the_lr_advice_say_their_step_when_it_is_not_the_last(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The advice is written at fit end (step 99), after the last logging step (95): it says its step, which its
    B̂ is of; the sections, read at the last logged step, need not."""
    write_run(tmp_path / "run", HEALTHY)
    writer = SummaryWriter(str(tmp_path / "run"))
    writer.add_text("lr_scaling/advice", "- noise scale B̂ = 210", 99)
    writer.close()
    _, doc = report_json(capsys, tmp_path)
    (run,) = doc["runs"]
    assert run["last_step"] == 95
    assert run["steps"] == {
        "convergence": 95,
        "noise scale and batch size": 95,
        "lr scaling advice": 99,
        "memory": 95,
        "spikes and non-finite steps": 95,
    }
    _, text, _ = report(capsys, str(tmp_path))
    assert "\n  lr scaling advice, as of optimizer step 99\n    - noise scale B̂ = 210\n" in text
    assert "\n  noise scale and batch size\n" in text and "\n  convergence\n" in text
    _, markdown, _ = report(capsys, str(tmp_path), "--format", "markdown")
    assert "### lr scaling advice, as of optimizer step 99\n" in markdown
    _, page, _ = report(capsys, str(tmp_path), "--format", "html")
    assert "<summary>lr scaling advice, as of optimizer step 99</summary>" in page


def test_a_section_logged_before_the_last_step_says_when(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path / "run", {tag: v for tag, v in HEALTHY.items() if not tag.startswith("memory/")})
    writer = SummaryWriter(str(tmp_path / "run"))
    writer.add_scalar("memory/parameters_bytes", 160_000.0, 2)
    writer.close()
    _, text, _ = report(capsys, str(tmp_path))
    assert "\n  memory, as of optimizer step 2\n    parameters  156.25 KiB\n" in text


def test_a_section_takes_its_rows_from_one_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """B_simple is logged to step 95, its error only while finite (to step 50), S/S_min only while B̂ was reliable
    (to step 30), one module's saved bytes only at step 10: the error and the ratio, computed from a B̂ that is
    not shown, are left out; the older memory row says its step; the verdict does not set the step-95 B_simple
    against the step-50 error."""
    logged = {tag: v for tag, v in HEALTHY.items() if tag != "grad_noise/b_simple_rel_err"}
    write_run(tmp_path / "run", {**logged, "grad_noise/b_simple": [300.0 + s for s in STEPS]})
    writer = SummaryWriter(str(tmp_path / "run"))
    for step in STEPS:
        if step <= 50:
            writer.add_scalar("grad_noise/b_simple_rel_err", 2.0 + step, step)
        if step <= 30:
            writer.add_scalar("lr_scaling/steps_over_min", 1 + step / 10, step)
    writer.add_scalar("memory/activations/old", 5 * 2**20, 10)
    writer.close()
    _, doc = report_json(capsys, tmp_path)
    (run,) = doc["runs"]
    assert run["steps"]["noise scale and batch size"] == 95
    noise = {row["label"]: (row["value"], row["step"]) for row in run["sections"]["noise scale and batch size"]}
    assert noise["B_simple = tr Σ / ‖G‖²"] == (395.0, None)
    assert "B_simple relative error" not in noise and "steps over the fewest, S/S_min = 1 + B̂/B" not in noise
    assert noise["effective batch B"] == (64.0, None)
    memory = {row["label"]: (row["value"], row["step"]) for row in run["sections"]["memory"]}
    assert memory["saved by old"] == (5 * 2**20, 10) and list(memory)[-1] == "saved by old"  # after the step's rows
    (verdict,) = [f["message"] for f in run["findings"] if "B_simple = 395" in f["message"]]
    assert "(its error was not logged with it) at optimizer step 95" in verdict and "5200%" not in verdict
    _, text, _ = report(capsys, str(tmp_path))
    assert "B_simple relative error" not in text and "S/S_min" not in text
    assert re.search(r"saved by old +5.00 MiB \(at optimizer step 10\)\n", text)


def test_an_integrity_finding_that_is_not_critical_is_in_the_findings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A param group at lr 0 (zero_lr, not critical: it may be meant) reaches the findings list, in words."""
    from trainvitals.integrity.checks.zero_lr import ZERO_LR

    write_run(
        tmp_path / "run",
        {**HEALTHY, ZERO_LR.counter: [0.0] * 10 + [1.0] * 10},
        {"graph/findings": "| step | kind | names | finding |\n|---|---|---|---|\n| 52 | zero_lr | g | lr 0 |"},
    )
    status, doc = report_json(capsys, tmp_path)
    (found,) = [f for f in doc["runs"][0]["findings"] if f["section"] == "integrity"]
    assert status == EXIT_OK and found["severity"] == "warning"
    assert found["message"].startswith(
        "a param group at lr exactly 0 whose parameters require grad: they do not train (found 1 time(s))"
    )
    assert "zero_lr" not in found["message"]


def test_a_crashed_run_does_not_ask_for_callbacks_it_had(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The fit crashed after one logged step (a layout, no end-of-fit diagnosis): the stopper was attached but had
    logged no band flag, or nothing at all; the report says the run ended, not "add GradNormEarlyStopping"."""
    from trainvitals.tensorboard.layout import TRAINVITALS_LAYOUT

    for name, stopper in (("with_streak", True), ("without", False)):
        writer = SummaryWriter(str(tmp_path / name))
        writer.add_custom_scalars(TRAINVITALS_LAYOUT)
        writer.add_scalar("grad_norm/total", 1.1, 0)
        writer.add_scalar("grad_norm/noise_floor", 0.8, 0)
        if stopper:
            writer.add_scalar("grad_norm/band_streak", 0.0, 0)
        writer.close()
    _, doc = report_json(capsys, tmp_path)
    for run in doc["runs"]:
        text = " ".join(
            [f["message"] for f in run["findings"]] + [str(r["value"]) for r in run["sections"]["convergence"]]
        )
        assert "would log whether" not in text and "band_streak" not in text and "no stop rule" not in text
        assert "the fit ended after optimizer step 0 (the last logged)" in text


def test_a_run_that_logged_nothing_is_no_clean_bill_and_no_failure_beside_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run that crashed before its first step left only the integrity panel (an older callback's "clean bill" of
    0 walks): it says nothing was logged, shows no empty sections, and the folder's status is the other run's."""
    old_panel = "**Graph integrity: clean bill of health.** No findings in 0 graph walk(s) and 0 gradient check(s)."
    write_run(tmp_path / "a_crashed", {}, {"graph/findings": old_panel})
    status, doc = report_json(capsys, tmp_path)
    assert status == EXIT_NO_DATA  # alone, nothing to report
    write_run(tmp_path / "b_healthy", HEALTHY)
    status, doc = report_json(capsys, tmp_path)
    assert status == EXIT_OK
    crashed = doc["runs"][0]
    assert crashed["status"] == "nothing measured" and not any(crashed["sections"].values())
    assert "the run may have ended before its first step" in crashed["findings"][0]["message"]
    assert "clean bill" not in crashed["panels"]["integrity findings"]
    assert "nothing checked" in crashed["panels"]["integrity findings"]
    _, text, _ = report(capsys, str(tmp_path))
    assert "clean bill" not in text and "n/a" not in text.split("run b_healthy")[0]


@pytest.mark.parametrize(
    ("flags", "label", "value"),
    [
        ([], "fraction in the noise band", "no band flag logged"),
        ([0.0], "in the noise band on its only logged step", "no"),
        ([1.0, 0.0, 1.0], "in the noise band, of only 3 logged steps", "2 (too few for a share)"),
        ([1.0] * 6 + [0.0] * 4, "fraction in the noise band, last 10 logged steps", "60.0%"),
    ],
)
def test_rows_say_in_words_what_was_logged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags, label, value
) -> None:
    """Too few band flags for a share are counted in words; shares are percents; labels are words, not tags."""
    writer = SummaryWriter(str(tmp_path / "run"))
    for step in range(10):
        for tag, v in {
            "grad_norm/total": 1.0,
            "grad_noise/coverage": 0.5,
            "memory/held_saved_bytes": 0.0,
            "grad_norm/nonfinite_steps": 0.0,
            "grad_norm/amp_skipped_steps": 0.0,
        }.items():
            writer.add_scalar(tag, v, step)
    for step, flag in zip(range(10 - len(flags), 10), flags):
        writer.add_scalar("grad_norm/in_noise_band", flag, step)
    writer.close()
    _, text, _ = report(capsys, str(tmp_path))
    assert re.search(rf"\n    {re.escape(label)} +{re.escape(value)}\n", text), text
    assert re.search(r"\n    share of ‖ḡ‖² measured +50.0%\n", text)
    assert "held after backward" in text and "steps with non-finite gradients" in text
    assert "steps a GradScaler skipped" in text
    assert not re.search(r"held saved|nonfinite steps|amp skipped|last [01] logged|% of the last 1 ", text)


def test_the_lr_advice_says_its_step_when_b_simple_is_of_another(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The advice (written at step 95, the last) and B_simple (last logged at step 90) are of different steps:
    both say theirs, so their B̂ and B_simple need not agree."""
    write_run(
        tmp_path / "run",
        {tag: v for tag, v in HEALTHY.items() if not tag.startswith("grad_noise/")},
        {"lr_scaling/advice": "- noise scale B̂ = 210"},
    )
    writer = SummaryWriter(str(tmp_path / "run"))
    for step in STEPS[:-1]:
        writer.add_scalar("grad_noise/b_simple", 200.0, step)
        writer.add_scalar("grad_noise/b_simple_rel_err", 0.1, step)
    writer.close()
    _, text, _ = report(capsys, str(tmp_path))
    assert "\n  lr scaling advice, as of optimizer step 95\n" in text
    assert "B = 64 < B_simple = 200 (± 10 %) at optimizer step 90" in text


def test_an_unreliable_b_simple_does_not_speak_for_lr_advice_of_another_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """B_simple unreliable at its last logged step (95), the lr advice written at fit end (99): the finding does not
    say which rule that later advice followed, it points to the advice and its step."""
    write_run(tmp_path / "run", {**HEALTHY, "grad_noise/b_simple_rel_err": 5.0})
    writer = SummaryWriter(str(tmp_path / "run"))
    writer.add_text("lr_scaling/advice", "noise-aware: B̂ = 33 ± 49%", 99)
    writer.close()
    _, doc = report_json(capsys, tmp_path)
    (run,) = doc["runs"]
    (note,) = [f["message"] for f in run["findings"] if "is unreliable" in f["message"]]
    assert "at optimizer step 95" in note and "classic rules" not in note
    assert "the lr advice, written at optimizer step 99" in note
    assert run["steps"]["lr scaling advice"] == 99


def test_several_runs_get_an_overview_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One line per run, in the report's order, before the first run's report: its status, last step, stop and
    the headline numbers as its own sections show them."""
    stop = "stopped at optimizer step 95 (after 96 steps): in its noise band for 10 consecutive steps."
    write_run(tmp_path / "a", HEALTHY, {"grad_norm/stop_reason": stop})
    write_run(tmp_path / "b", {**HEALTHY, "grad_norm/nonfinite_steps": [0.0] * (len(STEPS) - 1) + [3.0]})
    _, doc = report_json(capsys, tmp_path)
    status, text, _ = report(capsys, str(tmp_path))
    assert status == EXIT_CRITICAL and text.startswith("overview\n")
    lines = text.splitlines()
    first_run = lines.index("run a: ok, last logged optimizer step 95")
    table = [line.split() for line in lines[1:first_run] if line.strip()]
    assert [cells[0] for cells in table[2:]] == ["a", "b"]
    for cells, run in zip(table[2:], doc["runs"]):
        convergence, noise = rows(run, "convergence"), rows(run, "noise scale and batch size")
        assert cells[1:3] == [run["status"], str(run["last_step"])]
        assert f"{convergence['norm / noise level']:.4g}" in cells and f"{noise['B_simple = tr Σ / ‖G‖²']:.4g}" in cells
    assert "stopped at optimizer step 95 (after 96 steps)" in lines[3]
    _, markdown, _ = report(capsys, str(tmp_path), "--format", "markdown")
    assert markdown.startswith("## overview\n\n| run | status |")
    _, text, _ = report(capsys, str(tmp_path / "a"))
    assert text.startswith("run a: ok")  # one run: its own report is the overview


def write_csv_run(folder: Path, scalars: dict[str, float | list[float]]) -> None:
    """:func:`write_run`'s run as a CSVLogger writes it: ``metrics.csv``, a row per step of STEPS."""
    folder.mkdir(parents=True)
    with open(folder / "metrics.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", *scalars])
        for i, step in enumerate(STEPS):
            writer.writerow([step, *(v[i] if isinstance(v, list) else v for v in scalars.values())])


def test_one_fits_logs_by_two_kinds_of_logger_are_one_entry_and_an_exact_rerun_is_its_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fresh user's TensorBoardLogger and CSVLogger made every run appear twice with identical findings: runs
    whose trainvitals tags hold the same values at the same steps, written by different kinds of logger, are one
    entry named with each folder, saying why; another tool's tag (``hp_metric``) is not compared; one value apart,
    they are two runs. An exact rerun in a second TensorBoard folder is a second fit, reported as its own (it was
    merged too, and said to be one fit)."""
    write_run(tmp_path / "stop", {**HEALTHY, "hp_metric": -1.0})
    write_csv_run(tmp_path / "stop_csv", HEALTHY)
    write_run(tmp_path / "stop_rerun", HEALTHY)
    write_run(tmp_path / "other", {**HEALTHY, "grad_noise/b_simple": [200.0] * (len(STEPS) - 1) + [201.0]})
    _, doc = report_json(capsys, tmp_path)
    assert [(r["run"], r["same_logs"]) for r in doc["runs"]] == [
        ("other", []),
        ("stop", ["stop_csv"]),
        ("stop_rerun", []),
    ]
    assert [r["loggers"] for r in doc["runs"]] == [[], ["TensorBoard", "CSV"], []]
    assert doc["runs"][1]["sections"] == doc["runs"][2]["sections"]  # the rerun's values are the fit's
    _, text, _ = report(capsys, str(tmp_path))
    lines = text.splitlines()
    assert [line.split()[0] for line in lines[3:6]] == ["other", "stop", "stop_rerun"] and "stop = stop_csv" in lines[4]
    heading = lines.index("run stop = stop_csv: ok, last logged optimizer step 95")
    assert lines[heading + 1] == (
        "  the same logs as stop_csv: every trainvitals tag at the same steps with the same values, written by its "
        "TensorBoard and CSV loggers: one fit, reported once."
    )
    rerun = lines.index("run stop_rerun: ok, last logged optimizer step 95")
    assert "same logs" not in lines[rerun + 1] and sum(line.startswith("run ") for line in lines) == 3


def test_the_overview_gives_b_simples_bound_where_its_point_is_unreliable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The overview showed a fresh user's B_simple point (3370) unmarked while the run's section said it had no
    upper bound: where its 90 % interval has no upper end the overview gives that bound, as the section does; a
    two-sided one leaves the point."""
    unbounded = {**HEALTHY, "grad_noise/b_simple_unreliable": 1.0, "grad_noise/b_simple_low": 290.4}
    write_run(tmp_path / "a", unbounded)
    write_run(tmp_path / "b", {**HEALTHY, "grad_noise/b_simple_low": 150.0, "grad_noise/b_simple_high": 260.0})
    _, doc = report_json(capsys, tmp_path)
    assert rows(doc["runs"][0], "noise scale and batch size")["B_simple, 90 % interval"] == "≥ 290 (90 %)"
    _, text, _ = report(capsys, str(tmp_path))
    a, b = text.splitlines()[3:5]
    assert "≥ 290 (90 %)" in a and "200 examples" not in a
    assert "200 examples" in b and "(90 %)" not in b


def test_the_last_logged_step_is_the_callbacks_last_optimizer_step(tmp_path: Path, capsys) -> None:
    """40 optimizer steps (0–39), an integrity window closing at the last one, and a metric of the model's own
    logged at Lightning's count of steps taken (40): the last logged optimizer step is 39."""
    import lightning.pytorch as pl
    from conftest import trainer_kwargs
    from lightning.pytorch.loggers import TensorBoardLogger

    from trainvitals.integrity.callback import GraphIntegrityCallback
    from trainvitals.norms.monitor import GradNormMonitor

    class LogsTaken(Regressor):
        def on_train_end(self) -> None:
            self.logger.log_metrics({"steps_taken": float(self.global_step)}, step=self.global_step)

    callbacks = [GradNormMonitor(), GraphIntegrityCallback(check_every_n_steps=10, dead_after_steps=10)]
    fit = pl.Trainer(
        **trainer_kwargs(max_steps=40, logger=TensorBoardLogger(tmp_path), callbacks=callbacks, log_every_n_steps=5)
    )
    fit.fit(LogsTaken(), loader(regression_data(160), 4))
    _, doc = report_json(capsys, tmp_path)
    (run,) = doc["runs"]
    assert run["last_step"] == 39 and run["steps"]["integrity"] == 39
    status, text, _ = report(capsys, str(tmp_path))
    assert "last logged optimizer step 39" in text.splitlines()[0] and "integrity, as of" not in text


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_integrity_findings_read_as_blocks_in_a_terminal(tmp_path: Path, capsys) -> None:
    """Each finding of GraphIntegrityCallback's table is its step and kind, then its text at the terminal's width:
    the whole message in order, its names once."""
    import lightning.pytorch as pl
    from conftest import trainer_kwargs
    from lightning.pytorch.loggers import TensorBoardLogger
    from torch import nn

    from trainvitals.integrity.callback import GraphIntegrityCallback
    from trainvitals.text.terminal import WIDTH

    class UnusedHeads(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.never = nn.Linear(6, 3)
            self.also_never = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))

    integrity = GraphIntegrityCallback(check_every_n_steps=4)
    fit = pl.Trainer(**trainer_kwargs(max_steps=8, logger=TensorBoardLogger(tmp_path), callbacks=[integrity]))
    fit.fit(UnusedHeads(), loader(regression_data(64), 4))
    assert len(integrity.findings) >= 2
    _, text, _ = report(capsys, str(tmp_path))
    panel = text.split("\n  integrity findings\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert all(len(line) <= WIDTH for line in panel)
    starts = [i for i, line in enumerate(panel) if line.startswith("    step ")] + [len(panel)]
    assert len(starts) - 1 == len(integrity.findings)
    for finding, begin, end in zip(integrity.findings, starts, starts[1:]):
        block = " ".join(line.strip() for line in panel[begin:end])
        assert block.startswith(f"step {finding.step}, {finding.kind.value}")
        assert " ".join(finding.message.replace("`", "").split()) in block
        assert block.count(finding.names[0]) == 1


def test_a_partial_estimate_says_so_and_what_its_data_show(tmp_path: Path, capsys) -> None:
    """B_simple of 60% of ‖ḡ‖², without a finite relative error: its row says it is of the measured parameters
    only; B_simple's logged 90% lower end is shown (no high end logged: ≥), and the unmeasured parameters' bound
    on tr Σ."""
    partial = {
        **HEALTHY,
        "grad_noise/coverage": 0.6,
        "grad_noise/b_simple": 187.3,
        "grad_noise/trace_cov": 100.0,
        "grad_noise/trace_cov_se": 10.0,
        "grad_noise/grad_sq_norm": 0.534,
        "grad_noise/grad_sq_norm_se": 0.1,
        "grad_noise/unmeasured_trace_share": 0.45,
        "grad_noise/b_simple_low": 120.5,
    }
    del partial["grad_noise/b_simple_rel_err"]
    write_run(tmp_path / "run", partial)
    _, doc = report_json(capsys, tmp_path)
    (run,) = doc["runs"]
    noise = rows(run, "noise scale and batch size")
    assert "B_simple = tr Σ / ‖G‖²" not in noise  # not the model's
    (label,) = [k for k in noise if k.startswith("B_simple = tr Σ / ‖G‖²")]
    assert "partial" in label and noise[label] == pytest.approx(187.3)
    (low,) = [v for k, v in noise.items() if "lower" in k]
    assert low == pytest.approx(120.5) and noise["B_simple, 90 % interval"] == "≥ 120 (90 %)"
    assert noise["B_simple relative error"] is not None  # says why there is none
    assert any("0.45" in str(v) for k, v in noise.items() if "unmeasured" in k)
    (verdict,) = [f["message"] for f in run["findings"] if f["section"] == "noise scale and batch size"]
    assert "partial" in verdict and "187" in verdict and f"{low:.3g}" in verdict and "B = 64" not in verdict


def test_an_unreliable_b_simple_is_quoted_with_its_logged_interval(tmp_path: Path, capsys) -> None:
    """Where the point estimate is unreliable, the row and the finding say the 90% interval the run logged: a
    one-sided "B_simple ≥ x (90 %)" when no high end was logged (it was infinite)."""
    run_tags = {**HEALTHY, "grad_noise/b_simple_unreliable": 1.0, "grad_noise/b_simple_low": 180.4}
    run_tags.pop("grad_noise/b_simple_high", None)
    write_run(tmp_path / "run", run_tags)
    _, doc = report_json(capsys, tmp_path)
    (run,) = doc["runs"]
    assert rows(run, "noise scale and batch size")["B_simple, 90 % interval"] == "≥ 180 (90 %)"
    (verdict,) = [f["message"] for f in run["findings"] if f["section"] == "noise scale and batch size"]
    assert "unreliable" in verdict and "B_simple ≥ 180 (90 %)" in verdict
