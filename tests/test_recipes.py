"""The README's Use snippet and its Lightning recipes, run as written: they do what their comments say.

The snippets are the README's text (kept here verbatim, to be pasted there): the Use snippet logs charts of
at least 50 points on a 300-step run; the EarlyStopping recipe stops on the evidence-based criterion turning
positive and never because it "did not improve" (Lightning's default patience of 3 stopped an LM with the
criterion at −0.43); the ModelCheckpoint recipe keeps the checkpoint deepest into the noise band by a metric
that does not tie (the band streak is 0 at every checkpoint of a run that never enters the band, so
``mode="max"`` kept the first).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from conftest import trainer_kwargs
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainvitals import BatchVarianceProbe, GradNormEarlyStopping, GradNormMonitor

USE = """
import lightning.pytorch as pl
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

trainer = pl.Trainer(
    logger=TensorBoardLogger("runs"),
    accumulate_grad_batches=4,
    log_every_n_steps=5,  # Lightning's default of 50 leaves a 300-step run 6 points a chart
    callbacks=[
        GraphIntegrityCallback(),
        GradNormMonitor(),
        BatchVarianceProbe(measure_every_n_steps=5),
        GradNormEarlyStopping(),
        LRScalingAdvisor(),
        MemoryTopologyProfiler(),
        TrainvitalsDashboard(),
    ],
)
"""

RECIPES = """
import sys

from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

# keep the checkpoint deepest into the noise band: GradNormEarlyStopping's band_ratio is the smoothed ‖G‖² over
# the band's edge, ≤ 1 inside it (inf until it can decide); unlike the band streak it does not tie outside the band
ModelCheckpoint(monitor="grad_norm/band_ratio", mode="min", every_n_train_steps=100)
# stop when the evidence-based criterion turns positive, checked at each epoch's end; patience=sys.maxsize:
# on the threshold only, never because the criterion "did not improve" (Lightning's default patience is 3)
EarlyStopping(
    monitor="grad_noise/eb_criterion",
    mode="max",
    stopping_threshold=0.0,
    patience=sys.maxsize,
    check_on_train_epoch_end=True,
    strict=False,
)
"""


def recipes(monkeypatch: pytest.MonkeyPatch) -> tuple[ModelCheckpoint, EarlyStopping]:
    """The two callbacks the RECIPES snippet builds, run as written."""
    built: list[pl.Callback] = []
    for cls in (ModelCheckpoint, EarlyStopping):

        def record(self: pl.Callback, *args: Any, _init: Any = cls.__init__, **kwargs: Any) -> None:
            _init(self, *args, **kwargs)
            built.append(self)

        monkeypatch.setattr(cls, "__init__", record)
    exec(compile(RECIPES, "recipes", "exec"), {})
    monkeypatch.undo()
    checkpoint, stopping = built
    assert isinstance(checkpoint, ModelCheckpoint) and isinstance(stopping, EarlyStopping)
    return checkpoint, stopping


class Offset(pl.LightningModule):
    """Regression whose targets sit 3 away from the outputs: a strong, consistent gradient (the evidence-based
    criterion well below 0, the run far outside its noise band); ``lr=0`` keeps it there."""

    def __init__(self, lr: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class ValidatedOffset(Offset):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self.net(x), y))


def offset_data(n: int) -> TensorDataset:
    x = torch.randn(n, 6, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, 3.0 + x[:, :1] + 0.1 * x[:, 1:2])


class EpochEnds(pl.Callback):
    """The criterion EarlyStopping reads at each training epoch's end."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.values.append(float(trainer.callback_metrics["grad_noise/eb_criterion"]))


def test_the_early_stopping_recipe_does_not_stop_while_the_criterion_stays_negative(monkeypatch):
    """Every epoch ends with the same negative criterion (lr = 0, the same batches): the README's former
    line (patience 3) stopped after 4 epochs for "no improvement"; the recipe trains all 8."""
    data = DataLoader(offset_data(64), batch_size=16)
    runs = {}
    for name, stopping in {
        "former": EarlyStopping(
            monitor="grad_noise/eb_criterion",
            mode="max",
            stopping_threshold=0.0,
            check_on_train_epoch_end=True,
            strict=False,
        ),
        "recipe": recipes(monkeypatch)[1],
    }.items():
        seen = EpochEnds()
        trainer = pl.Trainer(
            **trainer_kwargs(max_epochs=8, log_every_n_steps=1),
            callbacks=[BatchVarianceProbe(), seen, stopping],
        )
        trainer.fit(Offset(), data)
        runs[name] = (trainer.current_epoch, seen.values)
    epochs, values = runs["recipe"]
    assert epochs == 8 and len(values) == 8 and max(values) < 0  # it stayed negative, and the run went on
    assert runs["former"][0] == 4  # what the former line did: a stop for want of improvement


def test_the_early_stopping_recipe_stops_when_the_criterion_turns_positive(monkeypatch):
    """A criterion above 0 at an epoch's end stops the run there, on the threshold."""

    class Positive(pl.Callback):
        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if trainer.current_epoch == 2:
                trainer.callback_metrics["grad_noise/eb_criterion"] = torch.tensor(0.25)

    stopping = recipes(monkeypatch)[1]
    trainer = pl.Trainer(**trainer_kwargs(max_epochs=8, log_every_n_steps=1), callbacks=[Positive(), stopping])
    trainer.fit(Offset(), DataLoader(offset_data(64), batch_size=16))
    assert trainer.current_epoch == 3 and stopping.stopped_epoch == 2  # stopped at the end of epoch 2


class AtCheckpoints(pl.Callback):
    """What each of ModelCheckpoint's every-n-steps saves sees (it runs after every other callback)."""

    def __init__(self, every: int, keys: tuple[str, ...]) -> None:
        self.every, self.keys = every, keys
        self.values: dict[int, dict[str, float]] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *_) -> None:
        step = trainer.global_step  # the first batch end at a multiple of `every`: the one that stepped there
        if step and step % self.every == 0 and step not in self.values:
            self.values[step] = {k: float(trainer.callback_metrics[k]) for k in self.keys}


def test_the_checkpoint_recipe_keeps_the_best_by_a_metric_that_does_not_tie(tmp_path, monkeypatch):
    """A run that never enters its band: the band streak is 0 at every save, so mode="max" on it keeps the
    first; band_ratio differs from save to save, and the recipe keeps the save where it is lowest."""
    checkpoint = recipes(monkeypatch)[0]
    # Every 25 steps rather than the README's 100: the band is judged from the 20th measurement on.
    checkpoint.dirpath, checkpoint._every_n_train_steps = str(tmp_path / "recipe"), 25
    streak = ModelCheckpoint(
        str(tmp_path / "streak"), monitor="grad_norm/band_streak", mode="max", every_n_train_steps=25
    )
    seen = AtCheckpoints(25, ("grad_norm/band_ratio", "grad_norm/band_streak"))
    trainer = pl.Trainer(
        **trainer_kwargs(max_steps=150, accumulate_grad_batches=4, log_every_n_steps=5, enable_checkpointing=True),
        callbacks=[GradNormMonitor(), GradNormEarlyStopping(), seen, checkpoint, streak],
    )
    trainer.fit(Offset(), DataLoader(offset_data(256), batch_size=8))
    ratios = {step: v["grad_norm/band_ratio"] for step, v in seen.values.items()}
    assert len(ratios) == 6 and min(ratios.values()) > 1  # never in the band (≤ 1)
    assert len(set(ratios.values())) == len(ratios)  # no two saves tie
    best = min(ratios, key=ratios.get)
    assert float(checkpoint.best_model_score) == pytest.approx(ratios[best])
    assert checkpoint.best_model_path.endswith(f"step={best}.ckpt")
    assert {v["grad_norm/band_streak"] for v in seen.values.values()} == {0.0}
    assert streak.best_model_path.endswith(f"step={min(ratios)}.ckpt")  # the former recipe: the first save


def test_the_checkpoint_recipe_saves_on_a_run_the_band_cannot_judge(tmp_path, monkeypatch):
    """No accumulation, no probe: no noise estimate, so no band. The monitored key is there all the same
    (inf, the worst): ModelCheckpoint, which fails a fit whose monitored key is missing once validation has
    run, saves and the run goes on."""
    checkpoint = recipes(monkeypatch)[0]
    checkpoint.dirpath, checkpoint._every_n_train_steps = str(tmp_path), 5
    data = DataLoader(offset_data(64), batch_size=8)
    trainer = pl.Trainer(
        **trainer_kwargs(max_steps=20, log_every_n_steps=5, val_check_interval=4, enable_checkpointing=True),
        callbacks=[GradNormEarlyStopping(), checkpoint],
    )
    trainer.fit(ValidatedOffset(), data, data)
    assert trainer.global_step == 20 and float(trainer.callback_metrics["grad_norm/band_ratio"]) == float("inf")
    assert checkpoint.best_model_path.endswith("step=5.ckpt")  # the first save; no later one is better


def test_the_use_snippet_logs_charts_of_at_least_50_points_in_300_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    run = USE.replace("accumulate_grad_batches=4,", "accumulate_grad_batches=4, max_steps=300, accelerator='cpu',")
    exec(compile(run, "use", "exec"), namespace)
    trainer: pl.Trainer = namespace["trainer"]
    trainer.fit(Offset(lr=0.01), DataLoader(offset_data(512), batch_size=8, shuffle=True))
    assert trainer.global_step == 300
    events = EventAccumulator(trainer.logger.log_dir, size_guidance={"scalars": 0}).Reload()
    for tag in (
        "grad_norm/total",
        "grad_noise/expected_batch_norm",
        "grad_norm/noise_floor",
        "grad_noise/trace_cov",
        "grad_norm/band_norm",
        "grad_norm/in_noise_band",
        "grad_norm/band_streak",
    ):
        assert len(events.Scalars(tag)) >= 50, tag
