"""What the callbacks say to a user, read in the order they say it: the cause before its consequence, one
message per event, no two messages of a run contradicting each other. The facts are asserted (numbers,
names, the fix), not the wording."""

from __future__ import annotations

import re
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _models import GAN, Classifier, Regressor, loader, regression_data
from conftest import RecordingLogger, trainer_kwargs
from torch import nn
from torch.utils.data import TensorDataset

from trainvitals import (
    BatchVarianceProbe,
    GradNormEarlyStopping,
    GradNormMonitor,
    GraphIntegrityCallback,
    LRScalingAdvisor,
    MemoryTopologyProfiler,
    TrainingGuard,
    UpdateMonitor,
)
from trainvitals.noise.estimate import GradientNoise
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


def test_under_batchnorm_with_accumulation_the_probe_and_the_micro_batches_are_one_source(said):
    """BatchNorm couples a micro-batch's examples, so the probe measures every parameter from the micro-batches:
    GradNormEarlyStopping's estimator on the same gradients. The run's estimate counts it once — the stopper's,
    whose numbers it is — and names one source, where it named "probe, micro_batch"."""
    net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    x = torch.randn(256, 6, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())
    probe, stopper = BatchVarianceProbe(), GradNormEarlyStopping()
    pl.Trainer(**trainer_kwargs(max_steps=8, accumulate_grad_batches=4), callbacks=[probe, stopper]).fit(
        Classifier(net, lr=0.1), loader(data, 8)
    )
    assert int(probe.noise.count) == 8 and "micro-batches/ranks" in probe.sources  # it measured, from micro-batches
    estimate = stopper.gradient_noise.estimate()
    assert estimate.sources == ("micro_batch",)
    alone = GradientNoise()
    alone.attach(stopper.noise_source)
    assert float(estimate.trace_cov) == float(alone.estimate().trace_cov) > 0
    assert float(estimate.grad_sq_norm) == float(alone.estimate().grad_sq_norm)
    rows = dict(r.strip("| ").split(" | ") for r in probe.summary_markdown().splitlines()[2:])
    assert rows["noise sources"] == "micro_batch" and "micro_batch" in rows["probe's estimate"]


def test_an_epochs_ragged_last_window_is_left_out_without_a_warning(said):
    """60 examples in micro-batches of 8 under accumulation of 4: each epoch ends on the window [8, 8, 8, 4].
    Its step is left out of the probe's estimate, as the stopper leaves it out, and nobody is told that the
    probe "cannot measure": nothing is wrong with the run."""
    x = torch.randn(60, 6, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, (x[:, 0] > 0).long())
    probe = BatchVarianceProbe()
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    trainer = pl.Trainer(**trainer_kwargs(max_epochs=2, accumulate_grad_batches=4), callbacks=[probe])
    trainer.fit(Classifier(net), loader(data, 8))
    assert trainer.global_step == 4 and int(probe.noise.count) == 2  # the two whole windows
    assert not [s for s in of(said, "BatchVarianceProbe") if "cannot measure" in s]


def test_a_probe_that_measured_no_step_ends_on_the_cause_it_warned_of(said):
    """Lightning's ManualOptimBoringModel trains on batches of one example: no spread to measure. The end
    line gives that cause again, not the sources planned at fit start."""
    from lightning.pytorch.demos.boring_classes import ManualOptimBoringModel

    probe = BatchVarianceProbe()
    pl.Trainer(**trainer_kwargs(max_steps=3, limit_val_batches=0), callbacks=[probe]).fit(ManualOptimBoringModel())
    warned, end = of(said, "BatchVarianceProbe")[-2:]
    assert (
        "1 example" in warned
        and end.startswith("trainvitals BatchVarianceProbe: no measurement")
        and "1 example" in end
    )


class _Kicked(Regressor):
    """The loss × 1000 at optimizer step 7, the last of 8: a spike of the loss, the gradient norm and the update."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * (1e3 if self.global_step == 7 else 1.0)


def test_one_spike_is_said_once_by_each_callback_that_flags_it(caplog, recwarn):
    """Every console line and warning of the fit, as Lightning gives them (log records, warnings): GradNormMonitor,
    UpdateMonitor and TrainingGuard each say the spike of step 7 once, when they flag it, and count it in their
    fit-end line."""
    callbacks = [
        GradNormMonitor(log_every_n_steps=1, spike_warmup_steps=3),
        UpdateMonitor(log_every_n_steps=1, spike_warmup_steps=3),
        TrainingGuard(spike_warmup_steps=3),
    ]
    with caplog.at_level("INFO"):
        pl.Trainer(**trainer_kwargs(max_steps=8, callbacks=callbacks)).fit(_Kicked(), loader(regression_data(), 8))
    lines = [r.getMessage() for r in caplog.records] + [str(w.message) for w in recwarn]
    counted_as = {
        "GradNormMonitor": ", spikes 1",
        "UpdateMonitor": ", update-norm spikes 1",
        "TrainingGuard": ": 1 event",
    }
    for name, counted in counted_as.items():
        mine = [line for line in lines if line.startswith(f"trainvitals {name}")]
        said = [line for line in mine if "spike" in line and "optimizer step 7" in line and counted not in line]
        assert len(said) == 1, mine  # the fit-end line counts it (and dates its last norm, of step 7 too)
        assert len([line for line in mine if counted in line]) == 1, mine
