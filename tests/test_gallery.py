"""The fault gallery: each classic mistake is found, named and explained; the healthy model is not accused."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from trainvitals.noise.estimate import MIN_MEASUREMENTS
from trainvitals.report.schedule import SCHEDULE

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import fault_gallery  # noqa: E402  (the examples folder is not a package)
from fault_gallery import FAULTS, Fault, Outcome, run_fault  # noqa: E402


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    logdir = str(tmp_path_factory.mktemp("gallery"))
    return {fault.name: run_fault(fault, logdir) for fault in FAULTS}


def kinds(outcome: Outcome) -> set[str]:
    return {kind for kind, _ in outcome.findings}


def critical(outcome: Outcome) -> list[str]:
    return [f.message for f in outcome.report.findings if f.severity == "critical"]


def test_every_fault_is_in_the_gallery(outcomes: dict[str, Outcome]) -> None:
    assert list(outcomes) == [
        "detached_loss",
        "unused_head",
        "layers_in_a_list",
        "summed_loss_new_batch",
        "graph_kept_across_steps",
        "recurrent_state_not_detached",
        "dead_relu",
        "head_at_lr_zero",
        "batchnorm_micro_batches",
        "loss_spike",
        "nan_from_a_log",
        "lr_held_in_the_noise_band",
    ]


def test_detached_loss(outcomes: dict[str, Outcome]) -> None:
    out = outcomes["detached_loss"]
    assert out.error.startswith("RuntimeError: element 0 of tensors does not require grad")
    # The note trainvitals adds to the exception points at the line of the gallery that detached.
    assert "trainvitals GraphIntegrityCallback [no_grad_error]" in out.error
    assert "rebuilt from `.detach()`" in out.error and "fault_gallery.py:" in out.error
    assert {"loss_no_grad", "no_grad_error"} <= kinds(out)
    # The failed run's logs say so: `trainvitals report` exits non-zero on them.
    assert any(m.startswith("the loss had no grad_fn") for m in critical(out))


def test_unused_head(outcomes: dict[str, Outcome]) -> None:
    out = outcomes["unused_head"]
    assert out.error is None
    assert {"unreachable_params", "unused_params", "ddp_unused"} <= kinds(out)
    assert "module `aux_head` never ran in forward" in dict(out.findings)["unreachable_params"]
    assert critical(out) == [
        "2 parameter(s) got no gradient in the last check window: not in the loss's graph (an "
        "unused head, a detached branch)"
    ]


def test_layers_in_a_list(outcomes: dict[str, Outcome]) -> None:
    out = outcomes["layers_in_a_list"]
    message = dict(out.findings)["unoptimized_leaves"]
    assert "`hidden[0].weight`" in message and "use nn.ModuleList" in message
    (report,) = critical(out)
    assert report.startswith("4 tensor(s) get gradients but belong to no optimizer")


def test_summed_loss_at_a_new_batch_size(outcomes: dict[str, Outcome]) -> None:
    out = outcomes["summed_loss_new_batch"]
    assert out.loss_reduction == "sum"
    assert any(
        "lr was tuned at batch 32; SGD's lr was not rescaled: the linear rule suggests 0.4" in w for w in out.warnings
    )
    assert "**loss reduction** sum" in out.report.panels["lr scaling advice"]


def test_graph_kept_across_steps(outcomes: dict[str, Outcome]) -> None:
    out = outcomes["graph_kept_across_steps"]
    (warning,) = [w for w in out.warnings if "graph is kept alive across steps" in w]
    assert "held by `self.epoch_loss`" in warning
    (report,) = critical(out)
    assert report.startswith("a computation graph outlives its step")


def test_recurrent_state_not_detached(outcomes: dict[str, Outcome]) -> None:
    out = outcomes["recurrent_state_not_detached"]
    assert out.error.startswith("RuntimeError: Trying to backward through the graph a second time")
    message = dict(out.findings)["second_backward"]
    assert "carried across steps in `hidden`" in message and "`self.hidden = hidden.detach()`" in message
    assert any(m.startswith("the run failed in backward") for m in critical(out))


def test_dead_relu(outcomes: dict[str, Outcome]) -> None:
    out = outcomes["dead_relu"]
    (warning,) = [w for w in out.warnings if w.startswith("trainvitals ActivationMonitor: dead units")]
    assert "`body.2` 100%" in warning
    assert any("dead units above 50%: body.2 (100%)" in f.message for f in out.report.findings)


def test_head_at_lr_zero(outcomes: dict[str, Outcome]) -> None:
    out = outcomes["head_at_lr_zero"]
    (warning,) = [w for w in out.warnings if w.startswith("trainvitals UpdateMonitor: layers that do not move")]
    assert "head" in warning and "body" not in warning
    assert any("never moved" in f.message and "head" in f.message for f in out.report.findings)


def test_batchnorm_with_micro_batches_of_two(outcomes: dict[str, Outcome]) -> None:
    out = outcomes["batchnorm_micro_batches"]
    (warning,) = [w for w in out.warnings if w.startswith("trainvitals BatchVarianceProbe: BatchNorm in training mode")]
    assert "body.2 (2 values per channel)" in warning
    assert "BatchNorm sees one micro-batch of 2, not the 64 examples of the step" in warning


def test_loss_spike(outcomes: dict[str, Outcome]) -> None:
    out = outcomes["loss_spike"]
    assert out.error is None
    (warning,) = [w for w in out.warnings if w.startswith("trainvitals TrainingGuard")]
    assert "spike" in warning and "optimizer step 4" in warning and "snapshot of optimizer step 3" in warning


def test_nan_from_a_log(outcomes: dict[str, Outcome]) -> None:
    out = outcomes["nan_from_a_log"]
    guard = [w for w in out.warnings if w.startswith("trainvitals TrainingGuard")]
    # The layer that made the -inf is named, not the head it went through; two skips, then a stop.
    assert "module `body.3` (LogBackward0) in forward" in guard[0] and "in [0, " in guard[0]
    assert ["skipped" in w for w in guard[:2]] == [True, True] and "escalated" in guard[2]
    assert "stopping the fit" in guard[3] and "guard-stop-step=3.ckpt" in guard[3]


def test_lr_held_in_the_noise_band(outcomes: dict[str, Outcome]) -> None:
    out = outcomes["lr_held_in_the_noise_band"]
    assert out.error is None and critical(out) == []
    # BandSchedule cut the lr once, as soon as the estimate could decide (the run is in its band from the start),
    # and the report says where, on what band ratio and interval, and to what scale.
    rows = {row.label: row.value for row in out.report.sections[SCHEDULE]}
    assert rows["lr cuts"] == 1 and rows["lr scale (× the lr the scheduler set)"] == pytest.approx(0.1)
    (note,) = [f.message for f in out.report.findings if f.section == SCHEDULE]
    step = int(re.search(r"step (\d+): band ratio", note)[1])
    assert MIN_MEASUREMENTS - 1 <= step < out.fault.max_steps and "90 %" in note and "lr × 0.1" in note
    assert f"trainvitals report, {SCHEDULE}: BandSchedule cut the lr 1 time(s)" in fault_gallery.describe(out)


def test_the_healthy_base_model_is_not_accused(tmp_path: Path) -> None:
    out = run_fault(Fault("healthy", "none", fault_gallery.DigitsMLP), str(tmp_path))
    assert out.error is None and out.findings == [] and critical(out) == []
    assert out.loss_reduction == "mean"
    assert out.warnings == []


def test_describe_prints_what_trainvitals_said(outcomes: dict[str, Outcome]) -> None:
    text = fault_gallery.describe(outcomes["unused_head"])
    assert text.startswith("== unused_head: a head is built and registered but never used in the loss\n")
    assert "  graph finding [unused_params]: 2 parameter(s) got no gradient" in text
    assert "  trainvitals report, critical: 2 parameter(s) got no gradient" in text
