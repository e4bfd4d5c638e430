"""BandSchedule on a noisy quadratic (closed form), beside a user's scheduler, resumed, under DDP; its arguments."""

from __future__ import annotations

import json
import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from _models import ReleaseProcessGroup
from conftest import RecordingLogger, trainer_kwargs
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainvitals import BandSchedule, GradNormEarlyStopping
from trainvitals.noise.estimate import MIN_MEASUREMENTS
from trainvitals.noise.stopper import StopReason
from trainvitals.schedule.decision import Action, Cut, measurements_to_show
from trainvitals.text.intervals import band_ratio_said

D, MICRO, ACCUMULATE, SIGMA = 10, 16, 4, 1.0
B = MICRO * ACCUMULATE


class NoisyQuadratic(pl.LightningModule):
    """y = ε ~ N(0, σ²), x ~ N(0, I_d), loss mean (x·w − y)²: H = 2I, and near w = 0 the per-example gradient's
    covariance is 4σ²·I. SGD at lr η on batches of B settles at E‖w‖² = d·ησ²/(B(1 − η)) (per coordinate
    v = (1 − 2η)²v + 4η²σ²/B), the expected loss σ² + ‖w‖²: the excess loss is ∝ η·tr Σ, and a cut η → fη
    lowers it by f(1 − η)/(1 − fη). ``sq_norms`` records ‖w‖² after every optimizer step, ``lrs`` the lr used."""

    def __init__(self, lr: float, w0: float = 0.5, scheduler=None):
        super().__init__()
        self.w = nn.Parameter(torch.full((D,), w0))
        self.lr, self.scheduler = lr, scheduler
        self.sq_norms: list[float] = []
        self.lrs: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(x @ self.w, y)

    def on_before_optimizer_step(self, optimizer):
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        self.sq_norms.append(float(self.w.detach().square().sum()))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        if self.scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.scheduler(optimizer), "interval": "step"}}


AT_MINIMUM = {"min_loss_drop": None}
"""What the schedule's mechanics are tested with on NoisyQuadratic(w0=0.0): it starts at its minimum, where the loss
never falls (its start is its floor), and the loss rule would hold every cut (test_no_cut_on_a_loss_that_never_fell)."""


def stream(steps: int, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps * B, D, generator=g)
    return DataLoader(TensorDataset(x, SIGMA * torch.randn(steps * B, generator=g)), batch_size=MICRO)


def fit(model, callbacks, steps, logger=None, **kwargs):
    trainer = Trainer(
        **trainer_kwargs(
            max_epochs=1,
            accumulate_grad_batches=ACCUMULATE,
            callbacks=callbacks,
            logger=logger or False,
            log_every_n_steps=10,
            **kwargs,
        )
    )
    trainer.fit(model, stream(steps))
    return trainer


def block_mean(values: list[float], blocks: int = 10) -> tuple[float, float]:
    """Mean and its standard error from ``blocks`` batch means (the series is autocorrelated)."""
    size = len(values) // blocks
    means = torch.tensor([sum(values[i * size : (i + 1) * size]) / size for i in range(blocks)], dtype=torch.float64)
    return float(means.mean()), float(means.std() / math.sqrt(blocks))


def test_it_cuts_where_the_stopper_stops_and_the_loss_falls_by_the_predicted_factor():
    eta, factor, steps = 0.05, 0.1, 1500
    stopper = GradNormEarlyStopping(min_steps=50, verbose=False)
    fit(NoisyQuadratic(eta), [stopper], steps)
    assert stopper.stop_reason is StopReason.NOISE_BAND

    schedule, logger = (
        BandSchedule(factor=factor, max_cuts=1, stop=False, min_steps=50, verbose=False),
        RecordingLogger(),
    )
    model = NoisyQuadratic(eta)
    fit(model, [schedule], steps, logger=logger)
    (cut,) = schedule.cuts
    assert cut["step"] == stopper.stopped_step  # the same band test, the same step
    assert schedule.lr_scale == pytest.approx(factor) and cut["lr_scale"] == pytest.approx(factor)
    assert cut["ratio_low"] <= cut["band_ratio"] <= 1.0 <= cut["ratio_high"] or cut["band_ratio"] <= 1.0
    # The optimizer steps at the scheduler's lr × the scale from the step after the cut; the scale is logged.
    assert set(model.lrs[: cut["step"] + 1]) == {eta}
    assert model.lrs[cut["step"] + 1 :] == pytest.approx([eta * factor] * (steps - cut["step"] - 1))
    # schedule/lr_scale is the scale the optimizer took at the logged step: the cut step's is still 1, the next's
    # the cut's (logged off the cadence too); the cut is counted at the cut step.
    scales = dict(logger.series["schedule/lr_scale"])
    assert {cut["step"], cut["step"] + 1} <= set(scales)
    assert all(scale == pytest.approx(model.lrs[step] / eta) for step, scale in scales.items()), scales
    assert dict(logger.series["schedule/cuts"])[cut["step"]] == 1
    assert schedule.margin == pytest.approx(0.2 * factor)  # the band's edge follows the lr
    # The stationary excess loss before the cut and long after it (relaxation time ~1/(4ηf) = 50 steps).
    before = model.sq_norms[50 : cut["step"]]
    after = model.sq_norms[cut["step"] + 300 :]
    (m0, s0), (m1, s1) = block_mean(before, 5), block_mean(after)
    assert m0 == pytest.approx(D * eta * SIGMA**2 / (B * (1 - eta)), rel=0.3)
    predicted = factor * (1 - eta) / (1 - factor * eta)
    measured = m1 / m0
    error = measured * math.hypot(s0 / m0, s1 / m1)
    assert abs(measured - predicted) <= 3 * error, (measured, predicted, error)
    assert abs(measured - predicted) <= 0.35 * predicted


def test_grow_batch_doubles_the_accumulation_and_halves_the_excess_loss():
    eta, steps = 0.05, 1500
    schedule = BandSchedule(factor=0.5, max_cuts=1, stop=False, grow_batch=True, min_steps=50, verbose=False)
    model, logger = NoisyQuadratic(eta), RecordingLogger()
    trainer = fit(model, [schedule], steps, logger=logger)
    (cut,) = schedule.cuts
    # Had a next act waited on this growth, the line names the growth, not a cut (issue #25 said "after a cut").
    schedule._done, schedule._held_back = torch.ones_like(schedule._done), (Action.STOP, 0.3, 0.0, 0.8, 50.0)
    said = schedule.summary_line()
    assert "grew the batch 1 time(s)" in said and "after a batch growth it acts" in said and "a cut" not in said
    step = cut["step"]
    assert cut["batch"] == 2 * B and schedule.lr_scale == 1.0 and set(model.lrs) == {eta}
    assert trainer.accumulate_grad_batches == schedule.accumulate == 2 * ACCUMULATE
    # From the first 8-aligned boundary on, every step takes 8 micro-batches: the epoch's 4·steps run out sooner.
    first = (step + 1) * ACCUMULATE
    aligned = -(-first // (2 * ACCUMULATE)) * 2 * ACCUMULATE
    # The logged accumulation is the one each step took: 4 up to that boundary, 8 from the step it opens (logged).
    opens = step + 1 + (aligned - first) // ACCUMULATE
    logged = dict(logger.series["schedule/accumulate_grad_batches"])
    assert logged[step] == ACCUMULATE and logged[opens] == 2 * ACCUMULATE
    assert all(n == (2 if s >= opens else 1) * ACCUMULATE for s, n in logged.items()), logged
    assert trainer.global_step == step + 1 + (aligned - first) // ACCUMULATE + (steps * ACCUMULATE - aligned) // 8
    # The stationary excess loss ∝ η/B: halved (relaxation ~5 steps at this lr).
    (m0, s0), (m1, s1) = block_mean(model.sq_norms[50:step], 5), block_mean(model.sq_norms[step + 100 :])
    measured, error = m1 / m0, m1 / m0 * math.hypot(s0 / m0, s1 / m1)
    assert abs(measured - 0.5) <= 3 * error and abs(measured - 0.5) <= 0.15, (measured, error)


def test_no_cut_on_an_estimate_that_is_not_decisive():
    # At the minimum from the start, in the band at every step: the estimate decides only after MIN_MEASUREMENTS.
    schedule = BandSchedule(
        **AT_MINIMUM, factor=0.9, max_cuts=None, stop=False, min_steps=0, patience=1, check_every_n_steps=1
    )
    fit(NoisyQuadratic(0.05, w0=0.0), [schedule], 300)
    steps = [c["step"] for c in schedule.cuts]
    assert steps and steps[0] >= MIN_MEASUREMENTS - 1
    # Every cut on an estimate that bounds the ratio, and its record quotes that interval (issue #25).
    assert all(math.isfinite(c["ratio_high"]) for c in schedule.cuts)
    assert all("90 %" in line for line in schedule.cut_record().splitlines())
    # Each cut restarts the estimate: the next waits for MIN_MEASUREMENTS new updates.
    assert all(b - a >= MIN_MEASUREMENTS for a, b in zip(steps, steps[1:]))
    # No noise source at all (one micro-batch a step, one device): never a cut.
    lonely = BandSchedule(min_steps=0, patience=1, check_every_n_steps=1, verbose=False)
    trainer = Trainer(**trainer_kwargs(max_epochs=1, callbacks=[lonely]))
    with pytest.warns(UserWarning, match="no noise source"):
        trainer.fit(NoisyQuadratic(0.05, w0=0.0), stream(50))
    assert lonely.cuts == [] and lonely.lr_scale == 1.0 and lonely.stop_reason is StopReason.NOT_STOPPED


def test_no_cut_on_a_loss_that_never_fell():
    """At its minimum from the start, in the band at every step as on a plateau: its loss never falls from where it
    started, so the default min_loss_drop holds every cut (with it off the same run cuts: the test above)."""
    schedule = BandSchedule(factor=0.9, max_cuts=None, stop=False, min_steps=0, patience=1, check_every_n_steps=1)
    fit(NoisyQuadratic(0.05, w0=0.0), [schedule], 300)
    assert schedule.cuts == [] and schedule.plateau_step is not None
    assert abs(schedule.loss_progress.drop.item()) < 0.1
    line = schedule.summary_line()
    assert line.startswith("made no cut; did not stop the run: in its noise band for a full streak at optimizer step")
    assert "a plateau the run has not left" in line


def test_no_second_cut_on_a_young_estimate():
    # At the minimum from the start: after the first cut the band's edge is 10× lower while the estimate's error
    # (set by tr Σ/B) is not, and the restarted estimate is young. The stopper's rule completes again and again
    # (a full streak on the point estimate) while the band ratio's 90 % interval reaches past the edge: no cut
    # then; a later cut only where the whole interval is inside the band.
    schedule = BandSchedule(
        **AT_MINIMUM, factor=0.1, max_cuts=None, stop=False, min_steps=0, patience=5, check_every_n_steps=1
    )
    logger = RecordingLogger()
    fit(NoisyQuadratic(0.05, w0=0.0), [schedule], 400, logger=logger)
    first, *later = schedule.cuts
    assert all(c["ratio_high"] <= 1.0 for c in later)
    high = dict(logger.series.get("grad_norm/band_ratio_high", []))  # left out where infinite
    then = later[0]["step"] if later else 400
    waited = [
        step
        for step, streak in logger.series["grad_norm/band_streak"]
        if first["step"] < step < then and streak >= 5 and high.get(step, math.inf) > 1.0
    ]
    assert waited, "the stopper's rule never completed between the cuts: nothing was held back"


def test_it_stops_after_the_last_cut_or_below_min_lr():
    schedule = BandSchedule(
        **AT_MINIMUM, factor=0.9, max_cuts=2, min_steps=0, patience=1, check_every_n_steps=1, verbose=False
    )
    trainer = fit(NoisyQuadratic(0.05, w0=0.0), [schedule], 400)
    assert len(schedule.cuts) == 2 and schedule.stop_reason is StopReason.NOISE_BAND
    assert trainer.global_step == schedule.stopped_step + 1 < 400
    assert "cut the lr 2 time(s)" in schedule.describe_stop()
    floor = BandSchedule(
        **AT_MINIMUM, factor=0.5, max_cuts=None, min_lr=0.02, min_steps=0, patience=1, check_every_n_steps=1
    )
    fit(NoisyQuadratic(0.05, w0=0.0), [floor], 400)
    assert len(floor.cuts) == 1 and floor.stop_reason is StopReason.NOISE_BAND  # 0.025 → 0.0125 < 0.02: stop
    assert "min_lr 0.02" in floor.describe_stop() and "min_lr" not in schedule.describe_stop()  # what refused it


def test_a_users_scheduler_still_shapes_the_lr_and_its_warmup_holds_the_cut():
    eta, warmup = 0.05, 150
    schedule = BandSchedule(
        **AT_MINIMUM, factor=0.5, max_cuts=1, stop=False, min_steps=0, patience=1, check_every_n_steps=1
    )

    def scheduler(optimizer):
        warm = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=warmup)
        return torch.optim.lr_scheduler.SequentialLR(
            optimizer, [warm, torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.999)], milestones=[warmup]
        )

    model = NoisyQuadratic(eta, w0=0.0, scheduler=scheduler)
    fit(model, [schedule], 400)
    assert schedule.warmup_steps == warmup and schedule.min_steps == warmup
    (cut,) = schedule.cuts
    assert cut["step"] >= warmup  # in the band from the start, but no cut while the lr warms up
    # The lrs the scheduler alone sets, replayed: the optimizer saw them × 0.5 after the cut, and no compounding.
    replay = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=eta)
    own = scheduler(replay)
    expected = []
    for step in range(400):
        expected.append(replay.param_groups[0]["lr"] * (0.5 if step > cut["step"] else 1.0))
        replay.step()
        own.step()
    assert model.lrs == pytest.approx(expected, rel=1e-9)


class SkippedStep(NoisyQuadratic):
    """An inf in the gradient at optimizer step ``inf_at``: a GradScaler skips that step. ``used`` maps each step
    the optimizer takes to the lr it takes it at (its step pre-hook: a skipped step runs none)."""

    def __init__(self, lr: float, inf_at: int, scheduler):
        super().__init__(lr, w0=0.0, scheduler=scheduler)
        self.inf_at = inf_at
        self.used: dict[int, float] = {}

    def on_fit_start(self):
        def record(optimizer, *_):
            self.used[self.trainer.global_step] = optimizer.param_groups[0]["lr"]

        self.trainer.optimizers[0].register_step_pre_hook(record)

    def on_after_backward(self):
        if self.trainer.global_step == self.inf_at:
            self.w.grad[0] = math.inf


def test_an_asymptotic_warmup_is_read_where_it_has_risen_and_the_warning_names_it():
    # 1 − 0.9·exp(−k/2000) rises until float saturation (~60,000 steps); it has made 95 % of its rise at
    # 2000·ln 20 ≈ 5991. A 30-step fit cannot cut: the warning names the warm-up, where it was read, and the override.
    def scheduler(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1 - 0.9 * math.exp(-k / 2000))

    schedule = BandSchedule(min_steps=100, verbose=False)
    with pytest.warns(UserWarning, match="warm-up") as said:
        fit(NoisyQuadratic(0.05, w0=0.0, scheduler=scheduler), [schedule], 30)
    assert schedule.warmup_steps == math.ceil(2000 * math.log(20)) and schedule.min_steps == schedule.warmup_steps
    warning = next(str(w.message) for w in said if "warm-up" in str(w.message))
    assert "5992" in warning and "LambdaLR" in warning and "warmup_steps" in warning and "min_steps 100" in warning
    assert "Lower min_steps" not in warning
    # The fit-end line labels the warm-up as such (issue #25 said "before min_steps=400" with min_steps=100).
    assert (
        "the run ended after 30 optimizer steps, before min_steps=5992 (the lr scheduler's warm-up, read from "
        "LambdaLR; min_steps passed: 100)" in schedule.summary_line()
    )
    # The override: the warm-up given, min_steps the user's again, and no warning.
    given = BandSchedule(min_steps=20, warmup_steps=0, patience=5, verbose=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*this fit ends after.*")
        fit(NoisyQuadratic(0.05, w0=0.0, scheduler=scheduler), [given], 30)
    assert given.warmup_steps == 0 and given.min_steps == 20


@pytest.mark.parametrize(
    "scheduler",
    [
        lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, 0.99),  # chainable: steps from group["lr"]
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 / (1 + 0.02 * i)),  # closed form
    ],
    ids=["chainable", "closed-form"],
)
def test_a_step_the_grad_scaler_skips_keeps_the_scheduler_update(scheduler):
    from lightning.pytorch.plugins.precision import MixedPrecision

    eta, steps, inf_at = 0.05, 50, 35
    schedule = BandSchedule(
        **AT_MINIMUM, factor=0.5, max_cuts=1, stop=False, min_steps=0, patience=1, check_every_n_steps=1
    )
    model, scaler = SkippedStep(eta, inf_at, scheduler), torch.amp.GradScaler("cpu", init_scale=2.0**8)
    precision = MixedPrecision("16-mixed", "cpu", scaler=scaler)  # fp16 autocast and a GradScaler, on the CPU
    fit(model, [schedule], steps, plugins=[precision], max_steps=steps)
    (cut,) = schedule.cuts
    assert cut["step"] < inf_at - 1 and scaler.get_scale() == 2.0**7  # the scaler skipped the step, once
    assert inf_at not in model.used and len(model.used) == steps - 1
    # The scheduler alone, replayed (it steps at the skipped step too): every step taken at its lr × the scale.
    replay = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=eta)
    own, expected = scheduler(replay), {}
    for step in range(steps):
        expected[step] = replay.param_groups[0]["lr"] * (0.5 if step > cut["step"] else 1.0)
        replay.step()
        own.step()
    del expected[inf_at]
    assert model.used == pytest.approx(expected, rel=1e-9)


def test_a_resumed_run_keeps_its_multiplier(tmp_path):
    eta = 0.05
    first = BandSchedule(
        **AT_MINIMUM, factor=0.1, max_cuts=1, stop=False, min_steps=0, patience=1, check_every_n_steps=1
    )
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    trainer = Trainer(
        **trainer_kwargs(
            max_steps=100, accumulate_grad_batches=ACCUMULATE, callbacks=[first, checkpoint], enable_checkpointing=True
        )
    )
    trainer.fit(NoisyQuadratic(eta, w0=0.0), stream(200))
    assert first.cuts and first.lr_scale == pytest.approx(0.1)
    last = str(tmp_path / "last.ckpt")

    # A requeued job with no step left saves the multiplier again, untouched.
    again = BandSchedule(
        **AT_MINIMUM, factor=0.1, max_cuts=1, stop=False, min_steps=0, patience=1, check_every_n_steps=1
    )
    trainer = Trainer(**trainer_kwargs(max_steps=100, accumulate_grad_batches=ACCUMULATE, callbacks=[again]))
    trainer.fit(NoisyQuadratic(eta, w0=0.0), stream(200), ckpt_path=last)
    trainer.save_checkpoint(tmp_path / "requeued.ckpt")
    state = torch.load(tmp_path / "requeued.ckpt", weights_only=False)["callbacks"][again.state_key]
    assert state["lr_scale"] == pytest.approx(0.1) and state["cuts"] == first.cuts

    # With steps left, every one of them is taken at the cut lr.
    resumed = BandSchedule(
        **AT_MINIMUM, factor=0.1, max_cuts=1, stop=False, min_steps=0, patience=1, check_every_n_steps=1
    )
    model = NoisyQuadratic(eta, w0=0.0)
    trainer = Trainer(**trainer_kwargs(max_steps=150, accumulate_grad_batches=ACCUMULATE, callbacks=[resumed]))
    trainer.fit(model, stream(200), ckpt_path=str(tmp_path / "requeued.ckpt"))
    assert resumed.lr_scale == pytest.approx(0.1) and resumed.margin == pytest.approx(0.02)
    assert model.lrs == pytest.approx([eta * 0.1] * 50)


class _Validated(NoisyQuadratic):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(x @ self.w, y))


@pytest.mark.parametrize(
    "scheduler",
    [
        None,
        lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5),  # chainable: reads group["lr"]
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.01 * s)),
    ],
    ids=["no scheduler", "StepLR", "LambdaLR"],
)
def test_a_run_resumed_from_any_checkpoint_takes_the_lrs_of_the_uninterrupted_one(tmp_path, scheduler):
    """Checkpoints at every validation (every 10 micro-batches of 4-batch steps: between a step's micro-batches,
    while the cut lr is in ``param_groups``, or at a step's end) and every epoch's end, before and after the cut;
    the run resumed from each takes, step for step, the lrs of the run never interrupted. A checkpoint saved between
    micro-batches after the cut held the cut lr: resumed, the cut applied to it again (× 0.01 with no scheduler,
    compounded by StepLR, the first step × 0.01 with LambdaLR)."""
    warnings.filterwarnings("ignore", ".*resuming from a checkpoint that ended before the epoch ended.*")

    def fit(ckpt_path=None, callbacks=()):
        schedule = BandSchedule(**AT_MINIMUM, factor=0.1, max_cuts=1, stop=False, min_steps=0, patience=1,
                                check_every_n_steps=1, verbose=False)  # fmt: skip
        model, val = _Validated(0.05, w0=0.0, scheduler=scheduler), stream(1, seed=1)
        kwargs = dict(max_epochs=4, accumulate_grad_batches=ACCUMULATE, val_check_interval=10)
        trainer = Trainer(
            **trainer_kwargs(**kwargs, callbacks=[schedule, *callbacks], enable_checkpointing=bool(callbacks))
        )
        trainer.fit(model, stream(8), val, ckpt_path=ckpt_path)
        return schedule, model

    on_val = ModelCheckpoint(
        tmp_path / "val", "{step}-{val_loss:.5f}", "val_loss", save_top_k=-1, save_on_train_epoch_end=False
    )
    on_epoch = ModelCheckpoint(tmp_path / "epoch", "{step}", save_top_k=-1, save_on_train_epoch_end=True)
    schedule, model = fit(callbacks=[on_val, on_epoch])
    (cut,) = schedule.cuts
    total, steps = len(model.lrs), []
    # The uninterrupted run, checkpoints written all along: the scheduler's lr (replayed) × 0.1 after the cut's step.
    replay = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.05)
    own, expected = scheduler(replay) if scheduler else None, []
    for step in range(total):
        expected.append(replay.param_groups[0]["lr"] * (0.1 if step > cut["step"] else 1.0))
        replay.step()
        if own is not None:
            own.step()
    assert model.lrs == pytest.approx(expected, rel=1e-12)
    for path in sorted((tmp_path / "val").glob("*.ckpt")) + sorted((tmp_path / "epoch").glob("*.ckpt")):
        step = torch.load(path, weights_only=False)["global_step"]
        if step >= total:
            continue
        steps.append(step)
        resumed, again = fit(ckpt_path=str(path))
        # Resumed mid-epoch, the loader starts its epoch again: other batches, the cut at the same step all the same.
        assert [(c["step"], c["lr_scale"]) for c in resumed.cuts] == [(cut["step"], 0.1)], path.name
        assert again.lrs == pytest.approx(model.lrs[step:], rel=1e-12), path.name
    epoch = 8  # optimizer steps an epoch; validations 2 or 0 micro-batches into a step: 10 batches apart
    assert {s % epoch for s in steps} >= {2, 5, 7, 0} and min(steps) < cut["step"] < max(steps) and len(steps) >= 12


@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_learning_rate_monitor_ahead_of_it_logs_the_lr_each_step_took(interval):
    """LearningRateMonitor listed first, 4 micro-batches a step: it read the scheduler's lr at a step's first
    micro-batch and the lr × the scale at the others (a fresh user's lr chart zigzagged ×10 after a cut), and at an
    epoch's start the scheduler's (``logging_interval="epoch"``). Every lr it logs is the one the optimizer took at
    that step, the scheduler's × the scale; the optimizer's own lrs are untouched."""
    eta, steps, epochs = 0.05, 20, 4
    schedule = BandSchedule(
        **AT_MINIMUM, factor=0.1, max_cuts=1, stop=False, min_steps=0, patience=1, check_every_n_steps=1
    )
    monitor, logger = LearningRateMonitor(logging_interval=interval), RecordingLogger()
    scheduler = (lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, 0.99)) if interval == "step" else None
    model = NoisyQuadratic(eta, w0=0.0, scheduler=scheduler)
    kwargs = dict(max_epochs=epochs, accumulate_grad_batches=ACCUMULATE, log_every_n_steps=1)
    trainer = Trainer(**trainer_kwargs(callbacks=[monitor, schedule], logger=logger, **kwargs))
    trainer.fit(model, stream(steps))
    (cut,) = schedule.cuts
    assert cut["step"] < steps * (epochs - 1)  # epochs start after the cut
    logged = logger.series["lr-SGD"]
    per_step = ACCUMULATE if interval == "step" else 1  # every micro-batch's start, or every epoch's
    assert [step for step, _ in logged] == [
        s for s in range(0, steps * epochs, 1 if per_step > 1 else steps) for _ in range(per_step)
    ]
    assert [lr for _, lr in logged] == pytest.approx([model.lrs[step] for step, _ in logged], rel=1e-6)
    assert any(step > cut["step"] for step, _ in logged)
    if interval == "step":  # the scheduler kept its own lr: 0.99 per step, no compounding of the scale
        assert model.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(eta * 0.99 ** (steps * epochs))


class _MicroBatchesPerStep(pl.Callback):
    """The micro-batches each optimizer step took, counted at their start."""

    def __init__(self):
        self.seen, self.per_step = 0, []

    def on_train_batch_start(self, *_):
        self.seen += 1

    def on_before_optimizer_step(self, *_):
        self.per_step.append(self.seen)
        self.seen = 0


@pytest.mark.parametrize("where", ["mid-epoch", "epoch end"])
def test_a_resumed_run_takes_its_grown_batch_from_its_first_step(tmp_path, where):
    def schedule():
        return BandSchedule(**AT_MINIMUM, factor=0.1, max_cuts=1, stop=False, grow_batch=True, min_steps=0, patience=1,
                            check_every_n_steps=1, verbose=False)  # fmt: skip

    # 51 steps of 4 micro-batches an epoch (204); a growth × 10 to 40 micro-batches a step, at a boundary both
    # divide (step 19's 80 batches). Saved mid-epoch (step 22: 160 batches) or at the epoch's end (its 204th).
    grown = 10 * ACCUMULATE
    length = {"max_steps": 22} if where == "mid-epoch" else {"max_epochs": 1}
    first = schedule()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    trainer = Trainer(**trainer_kwargs(**length, accumulate_grad_batches=ACCUMULATE, callbacks=[first, checkpoint],
                                       enable_checkpointing=True))  # fmt: skip
    trainer.fit(NoisyQuadratic(0.05, w0=0.0), stream(51))
    assert first.accumulate == trainer.accumulate_grad_batches == grown
    # A requeued job with no step left keeps the grown accumulation in its state, at the Trainer's own meanwhile.
    again, counted = schedule(), _MicroBatchesPerStep()
    trainer = Trainer(**trainer_kwargs(**length, accumulate_grad_batches=ACCUMULATE, callbacks=[again, counted]))
    trainer.fit(NoisyQuadratic(0.05, w0=0.0), stream(51), ckpt_path=str(tmp_path / "last.ckpt"))
    assert counted.per_step == [] and again.accumulate == grown
    trainer.save_checkpoint(tmp_path / "requeued.ckpt")
    # Resumed with steps left: every step takes the grown batch from the first (but an epoch's ragged last one).
    resumed, counted = schedule(), _MicroBatchesPerStep()
    more = {"max_steps": 25} if where == "mid-epoch" else {"max_epochs": 2}
    trainer = Trainer(**trainer_kwargs(**more, accumulate_grad_batches=ACCUMULATE, callbacks=[resumed, counted]))
    trainer.fit(NoisyQuadratic(0.05, w0=0.0), stream(51), ckpt_path=str(tmp_path / "requeued.ckpt"))
    assert resumed.cuts == first.cuts
    # Windows of 40 from where the checkpoint left the epoch (160 of its 204 batches, or 0), each epoch's last one
    # ragged (Lightning steps on an epoch's last batch); the old accumulation would take 4 a step until aligned.
    epoch, done, expected = 51 * ACCUMULATE, (160 if where == "mid-epoch" else 0), []
    while len(expected) < len(counted.per_step):
        expected.append(min(grown, epoch - done))
        done = (done + expected[-1]) % epoch
    assert counted.per_step == expected and len(expected) >= 3 and expected[0] == grown


class _RecordPerRank(pl.Callback):
    def __init__(self, folder: str):
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        schedule = next(cb for cb in trainer.callbacks if isinstance(cb, BandSchedule))
        with open(f"{self.folder}/rank{trainer.global_rank}.json", "w") as f:
            json.dump({"cuts": schedule.cuts, "lr_scale": schedule.lr_scale, "lrs": pl_module.lrs}, f)


@pytest.mark.slow
def test_ddp_ranks_cut_at_the_same_step(tmp_path):
    callbacks = [
        BandSchedule(**AT_MINIMUM, factor=0.5, max_cuts=1, stop=False, min_steps=0, patience=3, check_every_n_steps=1),
        _RecordPerRank(str(tmp_path)),
        ReleaseProcessGroup(),
    ]
    trainer = Trainer(**trainer_kwargs(strategy="ddp_spawn", devices=2, callbacks=callbacks, max_epochs=1))
    trainer.fit(NoisyQuadratic(0.05, w0=0.0), stream(100))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["cuts"] and ranks[0]["cuts"] == ranks[1]["cuts"]
    assert ranks[0]["lr_scale"] == ranks[1]["lr_scale"] == 0.5
    assert ranks[0]["lrs"] == ranks[1]["lrs"]


class _ManualQuadratic(NoisyQuadratic):
    def __init__(self):
        super().__init__(0.05)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer, loss = self.optimizers(), super().training_step(batch, batch_idx)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()


class _PartlyMeasured(pl.LightningModule):
    """Attention with ``add_bias_kv`` has no per-example rule: a BatchVarianceProbe measures a part of the model."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(12, 16), nn.Linear(16, 3)
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True, add_bias_kv=True)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        h = self.embed(tokens)
        return F.cross_entropy(self.head(self.attention(h, h, h, need_weights=False)[0].mean(1)), tokens[:, 0] % 3)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_every_message_names_the_schedule_and_its_cuts(caplog):
    from trainvitals import BatchVarianceProbe

    tokens = DataLoader(TensorDataset(torch.randint(0, 12, (16 * 30, 6), generator=torch.Generator().manual_seed(0))),
                        batch_size=16)  # fmt: skip
    fits = [  # the stopper's warning paths: manual optimization; too short a fit and no noise source; a partial model
        (_ManualQuadratic(), [BandSchedule(grow_batch=True)], stream(3), {"max_steps": 3}),
        (NoisyQuadratic(0.05), [BandSchedule(grow_batch=True)], stream(5), {"max_steps": 20}),
        (
            _PartlyMeasured(),
            [BatchVarianceProbe(histogram_every_n_steps=0), BandSchedule(grow_batch=True, min_steps=0, patience=5)],
            tokens,
            {"max_epochs": 1},
        ),
    ]
    said = []
    for model, callbacks, data, kwargs in fits:
        with warnings.catch_warnings(record=True) as record, caplog.at_level("INFO"):
            warnings.simplefilter("always")
            Trainer(**trainer_kwargs(callbacks=callbacks, **kwargs)).fit(model, data)
        said.append([str(w.message) for w in record if str(w.message).startswith("trainvitals BandSchedule")])
    (manual,), (short, lonely), (partial,) = said
    assert "automatic optimization" in manual and "cannot" in short and "no noise source" in lonely
    assert "cannot decide: partial" in partial
    for message in [manual, short, lonely, partial]:  # what it will not do: grow the batch, cut the lr, stop
        assert "grow the batch" in message and "cut the lr" in message and "stop the run" in message, message
    ends = [
        r.message for r in caplog.records if r.message.startswith("trainvitals BandSchedule") and "cut" in r.message
    ]
    assert len(ends) == 3 and all(e.count("made no cut") == 1 for e in ends)  # the end of each fit
    for message in [manual, short, lonely, partial, *ends]:
        assert "stopper" not in message and "mode=" not in message and "GradNormEarlyStopping" not in message
    # Its end-of-fit diagnosis names it once, and only what it was asked to do.
    assert BandSchedule().describe_stop().startswith("BandSchedule made no cut; did not")
    acts = BandSchedule(stop=False)._band_acts()
    assert "cut the lr" in acts[0] and "schedule" in acts[0] and "stop" not in acts[1] and "grow" not in acts[1]


def test_not_beside_a_noise_band_stopper():
    trainer = Trainer(**trainer_kwargs(max_epochs=1, callbacks=[BandSchedule(), GradNormEarlyStopping()]))
    with pytest.raises(MisconfigurationException, match="GradNormEarlyStopping"):
        trainer.fit(NoisyQuadratic(0.05), stream(4))


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"factor": 1.0}, ValueError, "factor"),
        ({"factor": 0.0}, ValueError, "factor"),
        ({"factor": "0.1"}, TypeError, "factor"),
        ({"max_cuts": -1}, ValueError, "max_cuts"),
        ({"max_cuts": "2"}, TypeError, "max_cuts"),
        ({"min_lr": -1e-3}, ValueError, "min_lr"),
        ({"stop": 1}, TypeError, "stop"),
        ({"grow_batch": "yes"}, TypeError, "grow_batch"),
        ({"margin": 0.0}, ValueError, "margin"),
        ({"patience": 0}, ValueError, "patience"),
        ({"warmup_steps": -1}, ValueError, "warmup_steps"),
        ({"warmup_steps": "5"}, TypeError, "warmup_steps"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, name):
    with pytest.raises(error, match=name):
        BandSchedule(**kwargs)


def test_every_cut_reaches_the_dashboard_and_the_report(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    from trainvitals import TrainvitalsDashboard
    from trainvitals.report.assess import assess
    from trainvitals.report.events import read_runs
    from trainvitals.report.schedule import SCHEDULE
    from trainvitals.tensorboard.layout import trainvitals_layout

    # factor 0.9: the scaled edge barely moves, so the second cut comes soon (shown inside the band at 2 checks).
    schedule = BandSchedule(
        **AT_MINIMUM, factor=0.9, max_cuts=2, stop=False, min_steps=0, patience=1, check_every_n_steps=1
    )
    logger = TensorBoardLogger(str(tmp_path), name="run", default_hp_metric=False)
    fit(NoisyQuadratic(0.05, w0=0.0), [schedule, TrainvitalsDashboard(progress_bar=False)], 200, logger=logger)
    assert len(schedule.cuts) == 2
    (run,) = read_runs(tmp_path)
    report = assess(run)
    rows = {row.label: row.value for row in report.sections[SCHEDULE]}
    assert rows["lr scale (× the lr the scheduler set)"] == pytest.approx(0.81) and rows["lr cuts"] == 2
    assert [str(c["step"]) in rows[f"cut {i}"] for i, c in enumerate(schedule.cuts, 1)] == [True, True]
    assert any(f.section == SCHEDULE and "2 time(s)" in f.message for f in report.findings)
    assert "lr × 0.81" in report.panels["band-driven schedule at fit end"]
    assert "margin 0.2 (× lr scale 0.81: 0.162)" in report.panels["band-driven schedule at fit end"]
    charts = trainvitals_layout()["trainvitals"]
    assert any(tags == [r"schedule/lr_scale$"] for _, tags in charts.values())


@pytest.mark.parametrize("grow", [False, True], ids=["cut-then-stop", "grow-despite-min-lr"])
def test_trainvitals_report_reads_the_schedules_cuts_and_its_stop(tmp_path, capsys, grow):
    from lightning.pytorch.loggers import TensorBoardLogger

    from trainvitals import TrainvitalsDashboard
    from trainvitals.report.command import main
    from trainvitals.report.convergence import CUTS_ROW

    # Cut once (by 0.9: the stop after it comes soon), then stop at the next band entry; or (grow) two batch
    # growths, which min_lr = 0.04 > 0.05 × 0.5 does not refuse (it bounds an lr cut only), and no stop.
    kwargs = {"max_cuts": 2, "stop": False, "grow_batch": True, "min_lr": 0.04, "factor": 0.5}
    schedule = BandSchedule(
        **AT_MINIMUM,
        min_steps=0,
        patience=1,
        check_every_n_steps=1,
        verbose=False,
        **(kwargs if grow else {"max_cuts": 1, "factor": 0.9}),
    )
    logger = TensorBoardLogger(str(tmp_path), name="run", default_hp_metric=False)
    callbacks = [schedule, TrainvitalsDashboard(progress_bar=False)]
    trainer = fit(NoisyQuadratic(0.05, w0=0.0), callbacks, 200, logger=logger)
    capsys.readouterr()
    main([str(tmp_path), "--format", "json"])
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    rows = {row["label"]: row["value"] for row in run["sections"]["convergence"]}
    said = [f["message"] for f in run["findings"] if f["section"] == "convergence"]
    cuts = rows[CUTS_ROW]
    (cuts_row,) = [row for row in run["sections"]["convergence"] if row["label"] == CUTS_ROW]
    assert cuts_row["step"] is None  # each cut says its own step; the end-of-fit table's would read as one
    # No LRScalingAdvisor: the effective batch is the end-of-fit table's, dated when not the section's step.
    noise = {row["label"]: row for row in run["sections"]["noise scale and batch size"]}
    assert noise["effective batch B"]["value"] == (4 * B if grow else B)
    at_end = None if run["steps"]["noise scale and batch size"] == trainer.global_step else trainer.global_step
    assert noise["effective batch B"]["step"] == at_end
    assert len(schedule.cuts) == (2 if grow else 1)
    for cut in schedule.cuts:  # each cut's step, band ratio and 90 % interval, as the cut record says them
        line = Cut(**cut).line()
        assert line in cuts and f"step {cut['step']}" in line
        assert f"{cut['band_ratio']:.2g}" in line or cut["band_ratio"] < 0  # ‖G‖² < 0 within its error: the upper end
        assert f"{cut['ratio_high']:.2g}" in line
    if grow:
        assert [c["batch"] for c in schedule.cuts] == [2 * B, 4 * B] and schedule.lr_scale == 1.0
        assert schedule.stop_reason is StopReason.NOT_STOPPED
        assert rows["stop"].startswith("not stopped: grew the batch 2 time(s)") and "stop=False" in rows["stop"]
        assert any("grew the batch 2 time(s)" in f["message"] for f in run["findings"])
        labels = {row["label"] for row in run["sections"]["band-driven schedule"]}
        assert {"batch growth 1", "batch growth 2"} <= labels and "cut 1" not in labels  # a growth said as one
    else:
        assert schedule.stop_reason is StopReason.NOISE_BAND
        assert rows["stop"].startswith("cut the lr 1 time(s)") and f"step {schedule.stopped_step}" in rows["stop"]
        assert any(s.startswith("in its noise band: BandSchedule stopped the run") for s in said)
    assert not any("GradNormEarlyStopping" in s for s in said) and "GradNormEarlyStopping" not in rows["stop"]


def test_the_reports_stop_row_says_the_streaks_cut_without_the_end_of_fit_table(tmp_path, capsys):
    from lightning.pytorch.loggers import TensorBoardLogger

    from trainvitals.report.command import main

    # No dashboard: no end-of-fit table, so the stop row is read from the logged streaks and the cut record. The
    # streaks that reached their patience cut the lr: the row says so, not that they fell short of it.
    schedule = BandSchedule(
        **AT_MINIMUM, factor=0.9, max_cuts=2, stop=False, min_steps=0, patience=5, check_every_n_steps=1
    )
    logger = TensorBoardLogger(str(tmp_path), name="run", default_hp_metric=False)
    fit(NoisyQuadratic(0.05, w0=0.0), [schedule], 400, logger=logger)
    assert len(schedule.cuts) == 2
    capsys.readouterr()
    main([str(tmp_path), "--format", "json"])
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    stop = {row["label"]: row["value"] for row in run["sections"]["convergence"]}["stop"]
    assert stop.startswith("not stopped") and "cut the lr 2 time(s)" in stop
    assert all(str(c["step"]) in stop for c in schedule.cuts)
    assert "short of its patience" not in stop


def test_a_full_streak_held_back_after_a_cut_is_said_with_its_interval():
    # One cut at 0.1, the edge 10× lower and the run not yet settled at the lower lr (~100 steps): the streak
    # completes, but the run is not shown inside the band, so no stop (issue #25's false second cuts came here).
    schedule = BandSchedule(
        **AT_MINIMUM, factor=0.1, max_cuts=1, min_steps=0, patience=5, check_every_n_steps=1, verbose=False
    )
    fit(NoisyQuadratic(0.05, w0=0.0), [schedule], 200)
    assert len(schedule.cuts) == 1 and schedule.stop_reason is StopReason.NOT_STOPPED
    act, ratio, low, high, measured = schedule._held_back
    assert act.value == "stop" and low <= 1.0 and not (high <= 1.0 and schedule._shown >= 6)
    said = schedule.summary_line()
    streak = int(schedule._streak)
    at_end = f"for {streak} step(s) in a row at the end" if streak else "out of it at the end"
    assert "cut the lr 1 time(s)" in said and at_end in said and "stop" in said and "after a cut it acts" in said
    # The point that kept the act beside its interval (issue #25: the interval alone, garbled where unbounded).
    # In the one wording of a band ratio: a negative point is not quoted beside an interval of a ratio ≥ 0.
    assert (
        f"band ratio (‖G‖² over the edge {schedule.margin:g}·tr(Σ)/B) was {band_ratio_said(ratio, low, high)}" in said
    )
    assert said.endswith("; the band did not end the fit: max_epochs=1 did.")  # the fit's one epoch ended it
    assert (ratio < 0 and high <= 1) == ("its point below 0" in said) and (high > 1) == ("upper end above" in said)
    # Held by the upper end: what showing the run inside would take (decision.py's measurements_to_show).
    need = f"needs at least ≈ {measurements_to_show(ratio, high, measured):.2g} effective measurements"
    assert (need in said and "100× those of the unscaled one" in said) == (high > 1)
    assert "it needs" not in said  # the stopper's "N of the P it needs": the streak did reach its patience


class LoggedQuadratic(NoisyQuadratic):
    """NoisyQuadratic logging its epoch's mean loss, for a Lightning EarlyStopping to watch."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("fit_loss", loss, on_step=False, on_epoch=True)
        return loss


def test_the_fit_end_line_names_what_ended_a_fit_the_band_did_not_end():
    """A fresh user's BandSchedule under max_steps=400 ended its line with "bound it by steps or by a validation-loss
    EarlyStopping", which was set: that advice is for a fit nothing bounds; a bounded one names what ended it."""
    ended = {}
    for bound in ("max_steps", "max_epochs", "max_time", "EarlyStopping"):
        schedule = BandSchedule(verbose=False)
        watch = EarlyStopping("fit_loss", min_delta=1e9, patience=1, check_on_train_epoch_end=True)
        limits = {"max_steps": {"max_steps": 12}, "max_epochs": {"max_epochs": 2}}
        limits = limits.get(bound, {"max_time": {"milliseconds": 300}} if bound == "max_time" else {"max_epochs": 9})
        callbacks = [schedule, watch] if bound == "EarlyStopping" else [schedule]
        trainer = Trainer(**trainer_kwargs(accumulate_grad_batches=ACCUMULATE, callbacks=callbacks, **limits))
        trainer.fit(LoggedQuadratic(0.05), stream(8))  # the time limit's epochs go on until it is over
        assert schedule.stop_reason is StopReason.NOT_STOPPED
        ended[bound] = schedule.summary_line().rsplit("; ", 1)[1]
    assert ended == {
        "max_steps": "the band did not end the fit: max_steps=12 did.",
        "max_epochs": "the band did not end the fit: max_epochs=2 did.",
        "max_time": "the band did not end the fit: max_time (Timer) did.",
        "EarlyStopping": "the band did not end the fit: EarlyStopping on fit_loss did.",
    }


def test_a_resumed_run_logs_its_cut_record_again(tmp_path):
    """Issue #25: a resumed run's log had no ``schedule/cut_record``, so its report said "lr cuts 1" with no row."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = BandSchedule(
        **AT_MINIMUM, factor=0.1, max_cuts=1, stop=False, min_steps=0, patience=1, check_every_n_steps=1
    )
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    trainer = Trainer(
        **trainer_kwargs(
            max_steps=100, accumulate_grad_batches=ACCUMULATE, callbacks=[first, checkpoint], enable_checkpointing=True
        )
    )
    trainer.fit(NoisyQuadratic(0.05, w0=0.0), stream(200))
    assert first.cuts
    resumed = BandSchedule(
        **AT_MINIMUM, factor=0.1, max_cuts=1, stop=False, min_steps=0, patience=1, check_every_n_steps=1
    )
    logger = TensorBoardLogger(str(tmp_path), name="resumed", version=0)
    trainer = Trainer(
        **trainer_kwargs(max_steps=110, accumulate_grad_batches=ACCUMULATE, callbacks=[resumed], logger=logger)
    )
    trainer.fit(NoisyQuadratic(0.05, w0=0.0), stream(200), ckpt_path=str(tmp_path / "last.ckpt"))
    logger.experiment.flush()
    acc = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = acc.Tensors("schedule/cut_record/text_summary")
    assert event.step == 100 and event.tensor_proto.string_val[0].decode() == first.cut_record()


@pytest.mark.parametrize("advisor_first", [False, True], ids=["advisor-after", "advisor-before"])
def test_the_lr_advisor_advises_on_the_base_lr_and_quotes_the_cut_lr_as_the_lr_now(tmp_path, advisor_first):
    from lightning.pytorch.loggers import TensorBoardLogger

    from trainvitals import LRScalingAdvisor, TrainvitalsDashboard
    from trainvitals.report.assess import assess
    from trainvitals.report.events import read_runs

    # A cut by 0.1 beside a user's chainable scheduler: the lr now the advisor quotes is the one the steps ran at (the
    # scheduler's × the scale), whatever the order of the callbacks, also at fit end when BandSchedule has put the
    # scheduler's lr back in param_groups; the lr it advises on is the one set, ExponentialLR's base lr, which a run
    # at another batch sets and BandSchedule cuts again. The expected lrs: the scheduler alone, in closed form.
    eta, gamma, factor = 0.05, 0.999, 0.1
    schedule = BandSchedule(
        **AT_MINIMUM, factor=factor, max_cuts=1, stop=False, min_steps=0, patience=1, check_every_n_steps=1
    )
    advisor = LRScalingAdvisor(detect_loss_reduction=False)
    model = NoisyQuadratic(eta, w0=0.0, scheduler=lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma))
    callbacks = [advisor, schedule] if advisor_first else [schedule, advisor]
    logger = TensorBoardLogger(str(tmp_path), name="run", default_hp_metric=False)
    trainer = fit(model, [*callbacks, TrainvitalsDashboard(progress_bar=False)], 200, logger=logger)
    (cut,) = schedule.cuts
    steps = trainer.global_step
    expected = [eta * gamma**s * (factor if s > cut["step"] else 1.0) for s in range(steps + 1)]
    assert model.lrs == pytest.approx(expected[:steps], rel=1e-9)
    (run,) = read_runs(tmp_path)
    logged = run.matching(r"lr_scaling/lr/SGD$")["lr_scaling/lr/SGD"]
    assert any(step > cut["step"] for step, _ in logged)
    assert all(lr == pytest.approx(expected[step], rel=1e-6) for step, lr in logged), logged
    base = run.matching(r"lr_scaling/base_lr/SGD$")["lr_scaling/base_lr/SGD"]
    assert [lr for _, lr in base] == pytest.approx([eta] * len(logged), rel=1e-6)  # float32 in the event file
    # Fit end: the lr the next step would take, the cut's (the scheduler's lr in place is 10× that), as context.
    now, batch = expected[steps], B
    assert advisor.advices["SGD"].lr == pytest.approx(eta, rel=1e-12)
    assert (
        f"SGD base lr {eta:.3g} (the optimizer's lr under ExponentialLR; now {now / factor:.3g} × 0.1 (BandSchedule) "
        f"= {now:.3g} at optimizer step {steps}) → " in advisor.summary_line()
    )
    # The band was entered and cut on: the batch advice squared with it, B_simple ≥ B/δ there.
    band = (
        f"BandSchedule cut the lr in its noise band at optimizer step {cut['step']} (where its point "
        f"estimate read ‖G‖² ≤ {schedule.base_margin:g}·tr(Σ)/B, B_simple ≥ B/{schedule.base_margin:g} = "
        f"{batch / schedule.base_margin:.4g}): a batch below B_simple is what the band means"
    )
    assert band in advisor.summary_markdown() and band[0].upper() + band[1:] in advisor.summary_line()
    report = assess(run)
    advice = report.panels["lr scaling advice"]
    assert f"| {eta:.3g} |" in advice and band in advice, advice
    noise = {row.label: row for row in report.sections["noise scale and batch size"]}
    row = noise["lr, SGD"]
    at = report.steps["noise scale and batch size"] if row.step is None else row.step
    assert at > cut["step"] and row.value == pytest.approx(expected[at], rel=1e-6)
    assert noise["base lr, SGD"].value == pytest.approx(eta)
