"""What the callbacks say to a user, read in the order they say it: the cause before its consequence, one
message per event, no two messages of a run contradicting each other. The facts are asserted (numbers,
names, the fix), not the wording."""

from __future__ import annotations

import re
from typing import Any

import lightning.pytorch as pl
import pytest
from _models import GAN, loader, regression_data
from conftest import RecordingLogger, trainer_kwargs

from trainvitals import (
    BatchVarianceProbe,
    GradNormEarlyStopping,
    GradNormMonitor,
    GraphIntegrityCallback,
    LRScalingAdvisor,
    MemoryTopologyProfiler,
)
from trainvitals.plumbing.base import TrainvitalsCallback


@pytest.fixture
def said(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Every message a trainvitals callback gives, ``(kind, text)`` in order; a once-message the first time."""
    out: list[tuple[str, str]] = []
    for kind in ("info", "warn"):
        original = getattr(TrainvitalsCallback, kind)

        def record(self: TrainvitalsCallback, text: str, *args: Any, _kind: str = kind, _f: Any = original, **kw: Any):
            message = self.message(text)
            if not (kw.get("once") or (args and args[0])) or message not in self._warning_cache:
                out.append((_kind, message))
            return _f(self, text, *args, **kw)

        monkeypatch.setattr(TrainvitalsCallback, kind, record)
    return out


def of(said: list[tuple[str, str]], callback: str) -> list[str]:
    return [text for _, text in said if text.startswith(f"trainvitals {callback}")]


def test_a_gan_with_manual_optimization_hears_one_cause_per_callback_and_no_contradiction(said):
    """Two optimizers stepped by the module: the stopper says once that noise_band needs automatic
    optimization (not "train longer", not what would measure the noise: the probe is attached), and the
    probe says at the end why it measured nothing — the two optimizers — as it said at the start."""
    callbacks = [
        GraphIntegrityCallback(),
        GradNormMonitor(),
        BatchVarianceProbe(measure_every_n_steps=2),
        GradNormEarlyStopping(),
        LRScalingAdvisor(),
        MemoryTopologyProfiler(),
    ]
    pl.Trainer(**trainer_kwargs(max_steps=40, logger=RecordingLogger(), log_every_n_steps=1), callbacks=callbacks).fit(
        GAN(d=6), loader(regression_data(n=64), 8)
    )
    stopper = of(said, "GradNormEarlyStopping")
    assert len(stopper) == 2, stopper  # the warning at fit start, the line at fit end
    assert all("automatic" in s for s in stopper)
    assert not any(re.search(r"measurable with|min_steps|optimizer steps", s) for s in stopper)
    probe = of(said, "BatchVarianceProbe")
    assert [s for s in probe if "2 optimizers" in s] == probe[-2:]  # the warning, then the end line's cause
    assert probe[-1].startswith("trainvitals BatchVarianceProbe: no measurement")
