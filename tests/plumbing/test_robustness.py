"""A diagnostic never ends a run by its own fault: every callback together, in Trainer set-ups and with
batches and models they cannot measure."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from _models import Regressor, loader, regression_data
from conftest import RecordingLogger, trainer_kwargs
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from trainvitals import (
    BatchVarianceProbe,
    GradNormEarlyStopping,
    GradNormMonitor,
    GraphIntegrityCallback,
    LRScalingAdvisor,
    MemoryTopologyProfiler,
    TrainvitalsDashboard,
    per_example,
)


def every_callback() -> list[pl.Callback]:
    return [
        GraphIntegrityCallback(check_every_n_steps=2, dead_after_steps=1, verbose=False),
        GradNormMonitor(),
        BatchVarianceProbe(),
        GradNormEarlyStopping(),
        LRScalingAdvisor(verbose=False),
        MemoryTopologyProfiler(measure_every_n_steps=2, verbose=False),
        TrainvitalsDashboard(),
    ]


def test_step_logging_turned_off_logs_no_step_scalars():
    """``Trainer(log_every_n_steps=0)`` turns step logging off (Lightning logs nothing then); a cadence of
    0 divided by nothing, and no callback logs per step."""
    logger = RecordingLogger()
    trainer = Trainer(
        **trainer_kwargs(
            callbacks=every_callback(), logger=logger, max_steps=6, log_every_n_steps=0, accumulate_grad_batches=2
        )
    )
    trainer.fit(Regressor(), loader(regression_data(), 8))
    assert trainer.global_step == 6
    assert not [tag for tag in logger.series if tag.startswith(("grad_norm/", "grad_noise/"))]
    # The advisor's report is a fit-level one: at the start and the end of the fit only.
    advice_steps = {
        step for tag, series in logger.series.items() if tag.startswith("lr_scaling/") for step, _ in series
    }
    assert advice_steps <= {0, 6}


class Pairs:
    """A batch Lightning cannot size: a plain object holding the tensors."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y


class PairsRegressor(Regressor):
    def training_step(self, batch: Pairs, batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self(batch.x), batch.y)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return batch


def test_a_batch_lightning_cannot_size_is_said_once_and_the_run_goes_on():
    data = regression_data()
    batches = [Pairs(*data[i : i + 8]) for i in range(0, 64, 8)]
    probe, stopper = BatchVarianceProbe(), GradNormEarlyStopping()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(
            **trainer_kwargs(callbacks=[probe, stopper], logger=False, max_steps=4, accumulate_grad_batches=2)
        )
        trainer.fit(PairsRegressor(), DataLoader(batches, batch_size=None))
    assert trainer.global_step == 4
    messages = [str(w.message) for w in caught]
    assert (
        sum("BatchVarianceProbe: cannot measure: Lightning cannot tell how many examples" in m for m in messages) == 1
    )
    assert sum("GradNormEarlyStopping: cannot tell how many examples" in m for m in messages) == 1
    assert int(probe.noise.count) == 0 and int(stopper.noise.count) == 0


def test_per_example_norms_that_fail_leave_the_layer_to_a_fallback(monkeypatch):
    """An exception inside the probe's backward hook would surface in the user's backward: it is recorded
    as that layer's failure instead, the step is measured over the other layers, and the layer is measured
    another way from then on."""
    measure = per_example.rules.linear.LinearRule.sq_norms

    def fails_on_the_last_layer(self, module, *args, **kwargs):
        if module.out_features == 1:
            raise RuntimeError("an unforeseen layout")
        return measure(self, module, *args, **kwargs)

    monkeypatch.setattr(per_example.rules.linear.LinearRule, "sq_norms", fails_on_the_last_layer)
    probe = BatchVarianceProbe()
    with pytest.warns(UserWarning, match="`net.4`: per-example norms failed: RuntimeError: an unforeseen layout"):
        trainer = Trainer(**trainer_kwargs(callbacks=[probe], logger=False, max_steps=4))
        trainer.fit(Regressor(), loader(regression_data(), 8))
    assert trainer.global_step == 4
    assert "net.4" not in probe._plan.per_example and int(probe.noise.count) == 4  # the failing step too


class ManyBackwards(Regressor):
    """Manual optimization with a data-dependent number of backwards per step (here: 1 to 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        for chunk in range(1 + batch_idx % 3):
            self.manual_backward(F.mse_loss(self(x[chunk::3]), y[chunk::3]))
        opt.step()


class CollectiveSpy(pl.Callback):
    """Records the hooks from which any callback calls a collective (``strategy.reduce``)."""

    def __init__(self) -> None:
        self.callers: set[str] = set()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        reduce = trainer.strategy.reduce

        def spied(*args: Any, **kwargs: Any) -> Any:
            self.callers.update(f.function for f in inspect.stack() if f.function.startswith("on_"))
            return reduce(*args, **kwargs)

        trainer.strategy.reduce = spied


@pytest.mark.parametrize("strict", [False, True])
def test_collectives_happen_where_every_rank_calls_them(monkeypatch, strict):
    """Under DDP a collective that one rank calls more often than another hangs the job: none may run in a
    per-backward hook, where ranks can differ (here also when the pending losses are counted)."""
    monkeypatch.setattr("trainvitals.integrity.checks.loss.MAX_PENDING_LOSSES", 2)
    spy = CollectiveSpy()
    graph = GraphIntegrityCallback(check_every_n_steps=3, dead_after_steps=1, strict=strict, verbose=False)
    trainer = Trainer(**trainer_kwargs(callbacks=[spy, graph], logger=False, max_steps=7))
    trainer.fit(ManyBackwards(), loader(regression_data(), 8))
    assert trainer.global_step == 7
    assert spy.callers and "on_before_backward" not in spy.callers and "on_after_backward" not in spy.callers


class Validated(Regressor):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self(x), y))


def test_a_checkpoint_loaded_for_validate_does_not_carry_into_the_next_fit(tmp_path):
    """Lightning restores callback states for ``validate(ckpt_path=...)`` too: a later fit of the same
    callbacks without a checkpoint must still start afresh."""
    callbacks = every_callback()
    data = loader(regression_data(), 8)
    trainer = Trainer(**trainer_kwargs(callbacks=callbacks, logger=False, max_steps=4))
    trainer.fit(Validated(), data)
    trainer.save_checkpoint(tmp_path / "fold1.ckpt")
    Trainer(**trainer_kwargs(callbacks=callbacks, logger=False)).validate(
        Validated(), data, ckpt_path=tmp_path / "fold1.ckpt"
    )
    Trainer(**trainer_kwargs(callbacks=callbacks, logger=False, max_steps=3)).fit(Validated(), data)
    graph, monitor, probe, stopper = callbacks[0], callbacks[1], callbacks[2], callbacks[3]
    assert int(probe.noise.count) == 3 and stopper.steps == 3 and monitor._tracks[0].steps == 3
    assert graph._walks == 2  # steps 0 and 2 of this fit (check_every_n_steps=2)


def test_callbacks_whose_saved_state_means_different_things_have_different_state_keys():
    """Lightning refuses a Trainer with two stateful callbacks of one state_key; a state saved under one
    EMA decay or spike rule must not be restored into another."""
    pairs = [
        (GradNormEarlyStopping(ema_beta=0.9), GradNormEarlyStopping(ema_beta=0.99)),
        (
            GradNormEarlyStopping(mode="relative", reference_steps=10),
            GradNormEarlyStopping(mode="relative", reference_steps=20),
        ),
        (GradNormMonitor(spike_factor=3.0), GradNormMonitor(spike_factor=10.0)),
        (GradNormMonitor(ema_beta=0.9), GradNormMonitor(ema_beta=0.99)),
    ]
    for first, second in pairs:
        assert first.state_key != second.state_key
        Trainer(**trainer_kwargs(callbacks=[first, second], logger=False, max_steps=1))


class FailsFirst(Regressor):
    """A training_step with a bug the user fixes between two fits (a notebook)."""

    fail = True

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.fail:
            raise ValueError("a bug in training_step")
        return super().training_step(batch, batch_idx)


def test_a_fit_that_failed_on_its_first_step_leaves_nothing_behind():
    """The failed fit stopped inside a measured step: its hooks stayed on the model and its open step made
    the next fit's first step look measured but unseen, so every layer was excluded for good."""
    probe, model = BatchVarianceProbe(), FailsFirst()
    trainer = Trainer(**trainer_kwargs(callbacks=[probe], logger=False, max_steps=4))
    with pytest.raises(ValueError, match="a bug in training_step"):
        trainer.fit(model, loader(regression_data(), 8))
    hooked = [m for m in model.modules() if m._forward_hooks or m._forward_pre_hooks]
    assert hooked == [] and not any(p._backward_hooks for p in model.parameters())
    model.fail = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(**trainer_kwargs(callbacks=[probe], logger=False, max_steps=4)).fit(model, loader(regression_data(), 8))
    assert int(probe.noise.count) == 4 and not probe._excluded
    assert not [w for w in caught if "BatchVarianceProbe: cannot measure" in str(w.message)]


class SkipsSomeBatches(Regressor):
    """Returns None on every third batch: Lightning skips those steps."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        return None if batch_idx % 3 == 1 else super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        pass  # a skipped step has no gradient for the reference norm


def test_a_skipped_step_is_not_reported_as_a_fault():
    probe = BatchVarianceProbe()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(**trainer_kwargs(callbacks=[probe], logger=False, max_epochs=1)).fit(
            SkipsSomeBatches(), loader(regression_data(), 8)
        )
    assert not [w for w in caught if "BatchVarianceProbe: cannot measure" in str(w.message)]
    assert int(probe.noise.count) == 5  # 8 batches, those at 1, 4 and 7 skipped
