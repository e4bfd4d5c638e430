"""The step's measurements shared by declaration: one gradient pass a step, one estimate, any callback order."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from _models import Regressor, loader, regression_data
from conftest import RecordingLogger, trainer_kwargs
from lightning.pytorch.callbacks import Callback

from trainvitals import (
    BatchVarianceProbe,
    GradNormEarlyStopping,
    GradNormMonitor,
    LRScalingAdvisor,
    TrainingGuard,
    TrainvitalsDashboard,
    UpdateMonitor,
)
from trainvitals.noise.estimate import GradientNoise
from trainvitals.plumbing.base import TrainvitalsCallback
from trainvitals.plumbing.sharing import GRAD_SQ_NORMS, NONFINITE_STEPS, StepGradNorms, Vitals

STEPS, LOG_EVERY = 24, 4


class _Trainer:
    """What StepGradNorms reads of a Trainer: the step and a strategy that shards nothing."""

    def __init__(self, step: int = 0) -> None:
        self.global_step = step
        self.strategy = object()
        self.precision_plugin = object()


def _params(*shapes: tuple[int, ...]) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.randn(*s, dtype=torch.float64)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def test_step_grad_norms_are_each_parameters_norm_taken_once_per_step():
    params = _params((3, 4), (5,), (2, 2))
    params[1].grad = None  # a parameter without gradient counts 0
    optimizer = torch.optim.SGD(params, lr=0.1)
    norms, trainer = StepGradNorms(), _Trainer()
    brute = torch.stack([p.grad.square().sum() if p.grad is not None else torch.zeros(()) for p in params])
    assert torch.allclose(norms.sq_norms(trainer, optimizer, params), brute, rtol=1e-12)
    subset = [params[2], params[0]]  # another caller's list, in its own order: indexed, not measured again
    assert torch.allclose(norms.sq_norms(trainer, optimizer, subset), brute[[2, 0]], rtol=1e-12)
    assert float(norms.sq_norm(trainer, optimizer, params)) == pytest.approx(float(brute.sum()), rel=1e-12)
    assert norms.sq_norms(trainer, optimizer, [params[1]]) is None  # none of them has a gradient
    assert norms.passes == 1
    params[0].grad = params[0].grad * 2  # the next step's gradient: measured afresh
    trainer.global_step = 1
    assert float(norms.sq_norms(trainer, optimizer, params)[0]) == pytest.approx(4 * float(brute[0]), rel=1e-12)
    outside = _params((4,))  # a parameter no pass of this step covers: one more pass, over that list
    assert float(norms.sq_norm(trainer, optimizer, outside)) == pytest.approx(float(outside[0].grad.square().sum()))
    assert norms.passes == 3
    inf = norms.norms(trainer, optimizer, params, math.inf)  # another norm type is kept apart
    assert float(inf[0]) == pytest.approx(float(params[0].grad.abs().max())) and norms.passes == 4


class _Reader(TrainvitalsCallback):
    reads = (GRAD_SQ_NORMS, NONFINITE_STEPS)


def _fit(callbacks, logger=None, accumulate=2, steps=STEPS):
    torch.manual_seed(0)  # the same model in every fit
    trainer = pl.Trainer(
        **trainer_kwargs(
            max_steps=steps,
            log_every_n_steps=LOG_EVERY,
            accumulate_grad_batches=accumulate,
            logger=logger or False,
        ),
        callbacks=callbacks,
    )
    trainer.fit(Regressor(autocast=False), loader(regression_data(n=8 * accumulate * steps), 8))
    return trainer


def test_every_callback_of_a_fit_gets_one_hub_and_an_explicit_one_ties_its_own():
    monitor, stopper, reader = GradNormMonitor(), GradNormEarlyStopping(), _Reader()
    _fit([reader, monitor, stopper], steps=2)
    hub = monitor.vitals
    assert stopper.vitals is hub and reader.vitals is hub and hub.callbacks == [reader, monitor, stopper]
    assert hub.speaker(NONFINITE_STEPS) is monitor  # the monitor logs the counter, wherever it stands
    _fit([reader, monitor, stopper], steps=2)
    assert monitor.vitals is not hub and stopper.vitals is monitor.vitals  # a hub lasts one fit
    # Two probes, each with its own stopper: two estimates, neither fed by the other pair.
    first, second = (
        BatchVarianceProbe(histogram_every_n_steps=0),
        BatchVarianceProbe(ema_beta=0.9, histogram_every_n_steps=0),
    )
    stoppers = GradNormEarlyStopping(), GradNormEarlyStopping(margin=0.5)
    tied = Vitals(first, stoppers[0])
    _fit([first, second, *stoppers], steps=2)
    assert first.vitals is tied and stoppers[0].vitals is tied and second.vitals is stoppers[1].vitals is not tied
    assert first.gradient_noise is stoppers[0].gradient_noise is not second.gradient_noise
    assert list(first.gradient_noise.sources.values()) == [first.noise_source, stoppers[0].noise_source]
    assert list(second.gradient_noise.sources.values()) == [second.noise_source, stoppers[1].noise_source]


def _orders(callbacks: list[Callback]) -> list[tuple[int, ...]]:
    """Each rotation of ``callbacks`` and its reverse: every callback first and last, each pair in both orders."""
    n = len(callbacks)
    rotations = [tuple((i + k) % n for i in range(n)) for k in range(n)]
    return rotations + [r[::-1] for r in rotations]


def _make():
    return [
        GradNormMonitor(log_every_n_steps=LOG_EVERY, histogram_every_n_steps=0),
        BatchVarianceProbe(histogram_every_n_steps=0),
        GradNormEarlyStopping(min_steps=0, patience=1000),
        LRScalingAdvisor(),
        TrainvitalsDashboard(),
        UpdateMonitor(log_every_n_steps=LOG_EVERY),  # the gradient's other readers
        TrainingGuard(),
    ]


class _PerStep(Callback):
    """How many of ``calls`` each optimizer step added, read after every other callback's hook."""

    def __init__(self, calls: list) -> None:
        self.calls, self.seen, self.per_step = calls, len(calls), [0] * (STEPS + 1)

    def on_train_batch_end(self, trainer, *_):
        self.per_step[trainer.global_step] += len(self.calls) - self.seen  # 1 + the step this batch ended
        self.seen = len(self.calls)


@pytest.mark.slow
def test_callbacks_in_any_order_log_the_same_values(monkeypatch):
    """Micro-batches (accumulation) and per-example norms both feed the estimate: whatever the order, every
    tag gets the same values at the same steps, one gradient pass a step and one estimate per logging step."""
    passes, estimates = [], []
    take, estimate = StepGradNorms._take, GradientNoise._combine
    monkeypatch.setattr(
        StepGradNorms, "_take", lambda self, trainer, *a: passes.append(trainer.global_step) or take(self, trainer, *a)
    )
    monkeypatch.setattr(GradientNoise, "_combine", lambda self, *a: estimates.append(1) or estimate(self, *a))
    logged, bars = {}, {}
    orders = _orders(_make())
    n = len(_make())
    assert len(orders) == 2 * n and {o[0] for o in orders} == {o[-1] for o in orders} == set(range(n))
    for order in orders:
        callbacks = _make()
        logger = RecordingLogger()
        passes.clear()
        counted = _PerStep(estimates)
        trainer = _fit([*(callbacks[i] for i in order), counted], logger)
        assert passes == list(range(STEPS)), order  # the step's gradient read once, whoever asks first
        # One estimate at each logging step, for all who log or judge it; at most one on the others (the stopper's
        # host checks), the band judged on cached weights between them.
        per_step = counted.per_step[1:]  # the advisor's first advice, before the first step, aside
        assert max(per_step) == 1 and all(per_step[::LOG_EVERY]), f"{order} {per_step}"
        logged[order] = dict(logger.series)
        bars[order] = dict(trainer.progress_bar_metrics)
    reference = logged[orders[0]]
    assert {"grad_norm/total", "grad_noise/b_simple", "grad_norm/band_streak", "update/total_ratio"} <= set(reference)
    assert any(tag.startswith("lr_scaling/") for tag in reference)
    for order in orders[1:]:
        assert set(logged[order]) == set(reference), order
        for tag, series in reference.items():
            assert [s for s, _ in logged[order][tag]] == [s for s, _ in series], (order, tag)
            assert [v for _, v in logged[order][tag]] == pytest.approx([v for _, v in series], rel=1e-12), (order, tag)
        assert bars[order] == pytest.approx(bars[orders[0]], rel=1e-12)
