"""One StepBatches a fit, shared by GradNormMonitor and TrainingGuard through the hub: each micro-batch sized once,
the same decisions as each callback alone; the weight a step gets under LBFGS and under a GAN's manual optimization,
against the noise of the gradient it measures."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from _models import GAN, NoiseOnly, flat_grad_norm
from conftest import RecordingLogger, trainer_kwargs
from torch.utils.data import DataLoader, TensorDataset

from trainvitals import GradNormMonitor, TrainingGuard
from trainvitals.guard import callback as guard_module
from trainvitals.norms import monitor as monitor_module
from trainvitals.plumbing import batch as batch_module
from trainvitals.plumbing.sharing import Vitals

BATCH, D = 16, 2


def _count_sizing(monkeypatch) -> list[int]:
    """Every call of ``batch_size`` from StepBatches, counted (one entry each)."""
    calls: list[int] = []
    sized = batch_module.batch_size

    def counted(batch, *args, **kwargs):
        calls.append(1)
        return sized(batch, *args, **kwargs)

    monkeypatch.setattr(batch_module, "batch_size", counted)
    return calls


def _spy_weights(monkeypatch, module) -> list[tuple[list[int | None], int, float]]:
    """The (sizes, divisor, weight) of each ``relative_noise_weight`` call of ``module``'s callback."""
    seen: list[tuple[list[int | None], int, float]] = []
    weigh = module.relative_noise_weight

    def spied(sizes, divisor):
        seen.append((list(sizes), divisor, weigh(sizes, divisor)))
        return seen[-1][2]

    monkeypatch.setattr(module, "relative_noise_weight", spied)
    return seen


@pytest.mark.parametrize("accumulate", [1, 2])
def test_both_callbacks_size_each_micro_batch_once_and_decide_as_each_alone(monkeypatch, accumulate):
    """321 rows at batch 16, shuffled, 12 epochs: a 1-row batch at each epoch's end and the gradient of the last step of
    epoch 5 × 20. GradNormMonitor alone, TrainingGuard alone, both on the fit's hub, both on hubs of their own
    (``Vitals(monitor)``, ``Vitals(guard)``): the micro-batches are sized once a fit on one hub (twice on two), and
    each callback flags the same steps, with the same words, in every arrangement — the injected spike, no epoch end."""
    data = DataLoader(TensorDataset(torch.randn(20 * BATCH + 1, D)), batch_size=BATCH, shuffle=True)
    per_epoch, epochs = -(-21 // accumulate), 12
    spike_at = 6 * per_epoch - 1
    calls = _count_sizing(monkeypatch)

    def fit(monitor: bool, guard: bool, hubs: bool = False) -> tuple[list, list, int]:
        made = [GradNormMonitor(log_every_n_steps=7, histogram_every_n_steps=0)] if monitor else []
        made += [TrainingGuard()] if guard else []
        if hubs:
            for callback in made:
                Vitals(callback)
        torch.manual_seed(1)  # one shuffle order for every fit
        del calls[:]
        model = NoiseOnly(spike_at=spike_at, spike=20.0, d=D)
        trainer = pl.Trainer(
            **trainer_kwargs(
                callbacks=made, max_epochs=epochs, accumulate_grad_batches=accumulate, logger=RecordingLogger()
            )
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, data)
        assert model.sizes[spike_at] == [1]
        found = {type(cb): cb for cb in made}
        monitored = found.get(GradNormMonitor)
        guarded = found.get(TrainingGuard)
        flagged = (
            [(monitored._tracks[0].counts["spike_steps"], monitored._tracks[0].spike)] if monitored is not None else []
        )
        events = [(e["global_step"], e["kind"], e["detail"]) for e in guarded.events] if guarded is not None else []
        return flagged, events, len(calls)

    micro_batches = 21 * epochs
    alone_monitor, _, sized = fit(monitor=True, guard=False)
    assert sized == micro_batches
    _, alone_guard, sized = fit(monitor=False, guard=True)
    assert sized == micro_batches
    assert alone_monitor[0][0] == 1 and alone_monitor[0][1][0] == spike_at
    assert [(step, kind) for step, kind, _ in alone_guard] == [(spike_at, "spike")]
    assert "a batch of 1 examples against the usual" in alone_guard[0][2]
    assert fit(monitor=True, guard=True) == (alone_monitor, alone_guard, micro_batches)
    assert fit(monitor=True, guard=True, hubs=True) == (alone_monitor, alone_guard, 2 * micro_batches)


class LBFGSNoise(NoiseOnly):
    """NoiseOnly stepped by LBFGS (4 iterations a step: several closure evaluations, each after Lightning's
    zero_grad); ``evaluations[step]``: how many ran, ``first_norms[step]``: the brute-force ‖g‖ after the first."""

    def __init__(self) -> None:
        super().__init__(d=D)
        self.evaluations: dict[int, int] = {}
        self.first_norms: dict[int, float] = {}

    def training_step(self, batch, batch_idx):
        self.evaluations[self.global_step] = self.evaluations.get(self.global_step, 0) + 1
        return super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer):
        self.first_norms.setdefault(self.global_step, flat_grad_norm(self.parameters()))

    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=1e-3, max_iter=4, tolerance_grad=0.0, tolerance_change=0.0)


def test_an_lbfgs_step_is_weighted_as_the_one_evaluation_its_gradient_is(monkeypatch):
    """33 rows at batch 16 (16, 16, 1), LBFGS: every step runs its closure several times, each after a zero_grad, and
    both callbacks measure the gradient after the first (Lightning calls ``on_before_optimizer_step`` after each; the
    first counts): one evaluation of the batch, E‖g‖² = d/b, weight 1/b — the 1-row batch 1, not the n/b of n
    evaluations counted as accumulated micro-batches. The logged norm is that first evaluation's."""
    monitor_weights = _spy_weights(monkeypatch, monitor_module)
    guard_weights = _spy_weights(monkeypatch, guard_module)
    data = DataLoader(TensorDataset(torch.randn(2 * BATCH + 1, D)), batch_size=BATCH)
    model, logger = LBFGSNoise(), RecordingLogger()
    callbacks = [GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0), TrainingGuard()]
    pl.Trainer(**trainer_kwargs(callbacks=callbacks, max_epochs=2, logger=logger)).fit(model, data)
    steps = sorted(model.evaluations)
    assert len(steps) == 6 and all(model.evaluations[s] > 1 for s in steps), model.evaluations
    rows = [len(model.sizes[s]) and model.sizes[s][0] for s in steps]
    assert rows == [BATCH, BATCH, 1] * 2
    expected = [([b], 1, 1.0 / b) for b in rows]
    assert monitor_weights == expected and guard_weights == expected
    logged = [value for _, value in logger.series["grad_norm/total"]]
    assert logged == pytest.approx([model.first_norms[s] for s in steps], rel=1e-6)


def test_a_gans_two_steps_are_each_weighted_by_the_backward_of_its_own_gradient(monkeypatch):
    """A GAN's ``training_step`` (manual optimization): zero_grad, backward and step of the discriminator, then of the
    generator, on a batch of 16 rows, 16, then 1. Each optimizer's gradient is its one backward's on the batch
    (zeroed before it): weight 1/b for both. The generator's step runs at the next ``global_step`` (the
    discriminator's step moved it on), so the discriminator's backward before it is not counted; both callbacks
    weigh each step [b]: 1/b (counted as two backwards, the generator's steps would be 2/b, a batch of b/2, and
    TrainingGuard, one usual batch for both optimizers, would allow every generator step √2)."""
    monitor_weights = _spy_weights(monkeypatch, monitor_module)
    guard_weights = _spy_weights(monkeypatch, guard_module)
    x = torch.randn(2 * BATCH + 1, 4)
    data = DataLoader(TensorDataset(x, torch.zeros(len(x))), batch_size=BATCH)
    callbacks = [GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0), TrainingGuard()]
    pl.Trainer(**trainer_kwargs(callbacks=callbacks, max_epochs=2)).fit(GAN(), data)
    rows = [BATCH, BATCH, 1] * 2
    expected = [([b], 1, 1.0 / b) for b in rows for _ in ("discriminator", "generator")]
    assert monitor_weights == expected and guard_weights == expected
