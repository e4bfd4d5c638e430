"""A requeued job: relaunched with the last checkpoint after it finished, it runs no step and saves again;
relaunched once more with more steps, every callback carries on as if the run had never stopped."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from _models import Regressor, loader, regression_data
from conftest import RecordingLogger, trainer_kwargs
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger

from trainvitals import (
    BatchVarianceProbe,
    GradNormEarlyStopping,
    GradNormMonitor,
    GraphIntegrityCallback,
    LRScalingAdvisor,
    MemoryTopologyProfiler,
    TrainvitalsDashboard,
)
from trainvitals.report.assess import assess
from trainvitals.report.events import read_runs
from trainvitals.tags import DIAGNOSIS_TAG, FIT_END_TAG

EPOCHS = 3  # of 4 optimizer steps: 8 batches of 8 examples, 2 micro-batches a step


def _callbacks() -> list[Any]:
    return [
        GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0, spike_warmup_steps=2),
        GradNormEarlyStopping(min_steps=1000, check_every_n_steps=2, verbose=False),
        BatchVarianceProbe(histogram_every_n_steps=0, ema_beta=0.9),
        GraphIntegrityCallback(check_every_n_steps=3, dead_after_steps=2),
        MemoryTopologyProfiler(measure_every_n_steps=3, first_steps=2),
        TrainvitalsDashboard(progress_bar=False),
        LRScalingAdvisor(log_every_n_steps=2, detect_loss_reduction=False),
    ]


def _fit(max_epochs: int, path, ckpt_path=None, logger=None) -> tuple[list[Any], dict[str, Any]]:
    """Fit to ``max_epochs`` (resuming from ``ckpt_path``), save to ``path``; returns the callbacks and the
    saved callback states."""
    torch.manual_seed(0)
    callbacks = _callbacks()
    trainer = Trainer(
        **trainer_kwargs(
            callbacks=callbacks,
            logger=logger or RecordingLogger(),
            max_epochs=max_epochs,
            accumulate_grad_batches=2,
            log_every_n_steps=1,
        )
    )
    with warnings.catch_warnings():  # the stopper's min_steps outlasts the run: said, and meant
        warnings.simplefilter("ignore", UserWarning)
        trainer.fit(Regressor(lr=0.02, autocast=False), loader(regression_data(64), 8), ckpt_path=ckpt_path)
    trainer.save_checkpoint(path)
    return callbacks, torch.load(path, weights_only=False)["callbacks"]


def _assert_same(got: Any, expected: Any, where: str = "") -> None:
    """Equal structure, equal integers and strings, floats and tensors equal to rounding."""
    if isinstance(expected, dict):
        assert isinstance(got, dict) and set(got) == set(expected), (where, set(got) ^ set(expected))
        for key in expected:
            _assert_same(got[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for i, (a, b) in enumerate(zip(got, expected)):
            _assert_same(a, b, f"{where}[{i}]")
    elif isinstance(expected, torch.Tensor):
        assert torch.allclose(got.double(), expected.double(), rtol=1e-9, atol=1e-12, equal_nan=True), where
    elif isinstance(expected, float):
        assert got == pytest.approx(expected, rel=1e-9, abs=1e-12, nan_ok=True), where
    else:
        assert got == expected, where


def test_a_zero_step_fit_keeps_every_callbacks_state_and_the_next_resume_continues_exactly(tmp_path):
    """Fit 2 epochs and save; relaunch on that checkpoint with nothing left to run (no step) and save again;
    relaunch with a third epoch. The saved states equal an uninterrupted 3-epoch run's, callback by callback;
    the zero-step fit saves what it loaded, and says at its end what the fit it resumed said (B_simple with
    the finite-population correction of the 64 examples)."""
    uninterrupted, expected = _fit(EPOCHS, tmp_path / "uninterrupted.ckpt")
    first, saved = _fit(EPOCHS - 1, tmp_path / "first.ckpt")
    relaunched, resaved = _fit(EPOCHS - 1, tmp_path / "relaunched.ckpt", ckpt_path=tmp_path / "first.ckpt")
    _, resumed = _fit(EPOCHS, tmp_path / "resumed.ckpt", ckpt_path=tmp_path / "relaunched.ckpt")

    keeping = [cb for cb in uninterrupted if not isinstance(cb, (TrainvitalsDashboard, LRScalingAdvisor))]
    assert set(expected) == {cb.state_key for cb in keeping} and len(expected) == len(keeping)
    for cb in keeping:
        _assert_same(resaved[cb.state_key], saved[cb.state_key], f"zero-step {type(cb).__name__}")
        _assert_same(resumed[cb.state_key], expected[cb.state_key], f"resumed {type(cb).__name__}")

    # What the states hold, against the run's own counts: 8 optimizer steps, then 12.
    monitor = next(cb for cb in uninterrupted if isinstance(cb, GradNormMonitor)).state_key
    assert saved[monitor]["tracks"]["0"]["steps"] == 8 and resumed[monitor]["tracks"]["0"]["steps"] == 12
    assert resumed[monitor]["tracks"]["0"]["ema"]["count"] == 12
    stopper = next(cb for cb in uninterrupted if isinstance(cb, GradNormEarlyStopping)).state_key
    assert resumed[stopper]["steps"] == 12
    probe = next(cb for cb in uninterrupted if isinstance(cb, BatchVarianceProbe)).state_key
    assert (
        resumed[probe]["source"]["noise"]["trace_cov"]["count"] == 12 and resumed[probe]["source"]["population"] == 64
    )
    profiler = next(cb for cb in uninterrupted if isinstance(cb, MemoryTopologyProfiler)).state_key
    assert resumed[profiler]["profiled_steps"] == 2 + 3  # steps 0, 1; then 3, 6, 9
    integrity = next(cb for cb in uninterrupted if isinstance(cb, GraphIntegrityCallback)).state_key
    assert resumed[integrity]["walks"] == 4  # windows at steps 0, 3, 6, 9
    for cls in (TrainvitalsDashboard, LRScalingAdvisor):  # nothing kept, by design (Lightning saves no empty state)
        assert next(cb for cb in uninterrupted if isinstance(cb, cls)).state_dict() == {}

    def b_simple(callbacks: list[Any]) -> float:
        return next(cb for cb in callbacks if isinstance(cb, BatchVarianceProbe)).gradient_noise.host_summary()[
            "b_simple"
        ]

    assert math.isfinite(b_simple(first)) and b_simple(relaunched) == pytest.approx(b_simple(first), rel=1e-12)
    line = next(cb for cb in first if isinstance(cb, BatchVarianceProbe)).summary_line()
    assert next(cb for cb in relaunched if isinstance(cb, BatchVarianceProbe)).summary_line() == line


def test_a_zero_step_relaunch_into_the_same_log_folder_leaves_the_runs_diagnoses_standing(tmp_path):
    """The requeued job logs into the folder of the fit it resumed: its panels land at the same step, and the
    report reads each panel's latest. Only the diagnoses made from the restored state are written again (the
    stopper's, the integrity findings), equal to the first fit's; the others (the monitor's "no step measured",
    the profiler's "no step profiled", the advisor's empty table) are not written, and the report reads the run
    as the first fit left it, exit status 0."""
    logger = lambda: TensorBoardLogger(tmp_path / "logs", name="", version=0)  # noqa: E731
    _fit(EPOCHS - 1, tmp_path / "first.ckpt", logger=logger())
    (run,) = read_runs(tmp_path / "logs")
    before = {tag: run.text(tag) for tag in run.texts if tag != FIT_END_TAG}
    written = {tag: len(entries) for tag, entries in run.texts.items()}
    expected_report = assess(run)
    assert {f"{DIAGNOSIS_TAG}/MemoryTopologyProfiler", "memory/report", "lr_scaling/advice"} <= set(before)

    relaunched, _ = _fit(EPOCHS - 1, tmp_path / "relaunched.ckpt", ckpt_path=tmp_path / "first.ckpt", logger=logger())
    (run,) = read_runs(tmp_path / "logs")
    assert {tag: run.text(tag) for tag in run.texts if tag != FIT_END_TAG} == before
    rewritten = {tag for tag, entries in run.texts.items() if len(entries) > written[tag]}
    assert rewritten == {
        FIT_END_TAG,
        f"{DIAGNOSIS_TAG}/GradNormEarlyStopping",
        f"{DIAGNOSIS_TAG}/GraphIntegrityCallback",
    }
    assert [step for step, _ in run.texts[FIT_END_TAG]] == [8, 8]  # 8 optimizer steps, the relaunch none
    report = assess(run)
    assert (report.exit_status, report.status, report.last_step) == (0, "ok", expected_report.last_step)
    assert report.panels == expected_report.panels and report.sections == expected_report.sections

    dashboard = next(cb for cb in relaunched if isinstance(cb, TrainvitalsDashboard))
    assert dashboard._panels == 2
    advisor = next(cb for cb in relaunched if isinstance(cb, LRScalingAdvisor))
    assert "batch_size" not in advisor.summary_line() and "batch size" not in advisor.summary_line()
