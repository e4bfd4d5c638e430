"""LRScalingAdvisor in real Trainer runs: effective batch per strategy, scheduled lrs, B̂ sources,
the reference warning, loss-reduction detection, logging, and argument checks."""

from __future__ import annotations

import json
import math
import re
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from _models import (
    DigitsMLP,
    ReleaseProcessGroup,
    digits_loader,
    loader,
    one_cycle_lr,
    regression_data,
    warmup_cosine,
)
from conftest import RecordingLogger, trainer_kwargs
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, LearningRateMonitor
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from trainvitals.lr_scaling.advisor import LRScalingAdvisor
from trainvitals.noise.estimate import GradientNoise, NoiseSource
from trainvitals.plumbing.base import TrainvitalsCallback
from trainvitals.plumbing.sharing import GRADIENT_NOISE

D = 6


class Model(pl.LightningModule):
    """Linear regression behind BatchNorm and Dropout (so that RNG and buffers matter).

    ``groups``: lrs of the optimizer's param groups (weight, bias), one lr for one group.
    ``gamma``: a per-step StepLR factor; ``warmup_from_zero``: a linear warmup from 0; ``one_cycle``:
    OneCycleLR peaking at the groups' lrs; ``scheduler``: any other, made from the optimizer. ``jitter``: input
    noise drawn in ``training_step`` itself, which eval mode does not turn off. The buffer ``seen`` counts the
    examples trained on.
    """

    def __init__(
        self,
        optimizer: type = torch.optim.SGD,
        groups: tuple[float, ...] = (0.01,),
        reduction: str = "mean",
        gamma: float | None = None,
        warmup_from_zero: bool = False,
        one_cycle: bool = False,
        jitter: float = 0.0,
        scheduler=None,
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.BatchNorm1d(D), nn.Dropout(0.2), nn.Linear(D, 1))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.optimizer, self.groups, self.reduction = optimizer, groups, reduction
        self.gamma, self.warmup_from_zero, self.one_cycle, self.jitter = gamma, warmup_from_zero, one_cycle, jitter
        self.scheduler = scheduler

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen += x.shape[0]
        x = x + self.jitter * torch.randn_like(x)
        loss = F.mse_loss(self.net(x), y, reduction=self.reduction)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        linear = self.net[2]
        if len(self.groups) == 1:
            opt = self.optimizer(self.parameters(), lr=self.groups[0])
        else:
            opt = self.optimizer(
                [
                    {"params": [linear.weight], "lr": self.groups[0]},
                    {"params": [linear.bias, *self.net[0].parameters()], "lr": self.groups[1]},
                ]
            )
        if self.scheduler is not None:
            scheduler = self.scheduler(opt)
        elif self.gamma is not None:
            scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=self.gamma)
        elif self.warmup_from_zero:
            scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, step / 2))
        elif self.one_cycle:  # the configured lr is the peak; the schedule starts at a 25th of it
            scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=list(self.groups), total_steps=100)
        else:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def fit(model: pl.LightningModule, callbacks, logger=None, batch_size: int = 8, **kwargs) -> Trainer:
    kwargs = dict(max_steps=2) | kwargs
    trainer = Trainer(**trainer_kwargs(callbacks=callbacks, logger=logger if logger is not None else False, **kwargs))
    trainer.fit(model, loader(regression_data(64, D), batch_size))
    return trainer


# ---------------------------------------------------------------- effective batch
@pytest.mark.parametrize("accumulate", [1, 3])
def test_effective_batch_on_a_single_device(accumulate):
    logger, advisor = RecordingLogger(), LRScalingAdvisor(log_every_n_steps=1)
    fit(Model(), [advisor], logger, batch_size=8, accumulate_grad_batches=accumulate)
    assert advisor.per_device_batch == 8
    assert advisor.effective_batch == 8 * accumulate
    assert set(logger.values("lr_scaling/effective_batch")) == {8.0 * accumulate}


def test_an_epoch_shorter_than_the_accumulation_steps_on_what_it_has():
    """limit_train_batches=2 with accumulate_grad_batches=3: each optimizer step gets 2 micro-batches."""
    advisor = LRScalingAdvisor(verbose=False)
    fit(Model(), [advisor], batch_size=8, accumulate_grad_batches=3, limit_train_batches=2, max_steps=2)
    assert advisor.effective_batch == 16


class _DumpPerRank(Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        advisor = next(cb for cb in trainer.callbacks if isinstance(cb, LRScalingAdvisor))
        with open(f"{self.out_dir}/rank{trainer.global_rank}.json", "w") as f:
            json.dump(
                {
                    "effective": advisor.effective_batch,
                    "per_device": advisor.per_device_batch,
                    "reduction": advisor.loss_reduction,
                    "report": advisor.summary_markdown(),
                },
                f,
            )


@pytest.mark.slow
def test_effective_batch_under_ddp_spawn_with_accumulation(tmp_path):
    callbacks = [
        LRScalingAdvisor(log_every_n_steps=1, verbose=False),
        _DumpPerRank(str(tmp_path)),
        ReleaseProcessGroup(),
    ]
    fit(Model(), callbacks, batch_size=4, strategy="ddp_spawn", devices=2, accumulate_grad_batches=2, max_steps=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert rank["per_device"] == 4
        assert rank["effective"] == 16  # 4 per device × 2 devices × 2 accumulated
        assert rank["reduction"] == "mean"  # the probe ran through the DDP wrapper on both ranks
        assert "2 (devices)" in rank["report"] and "DDPStrategy" in rank["report"]


# ---------------------------------------------------------------- lrs, families, B̂
def test_reports_follow_the_scheduled_lr_every_n_steps_and_advise_on_its_base_lr():
    logger = RecordingLogger()
    fit(Model(groups=(0.1,), gamma=0.5), [LRScalingAdvisor(log_every_n_steps=2, verbose=False)], logger, max_steps=6)
    steps = [s for s, _ in logger.series["lr_scaling/effective_batch"]]
    assert steps == [0, 2, 4]  # fit start, then before every 2nd optimizer step; steps 0–5 ran
    assert logger.values("lr_scaling/lr/SGD") == pytest.approx([0.1 * 0.5**s for s in steps])
    # The advice is on the lr set, StepLR's base lr: the suggestions are base lrs, which StepLR scales in turn.
    assert logger.values("lr_scaling/base_lr/SGD") == pytest.approx([0.1] * 3)
    assert logger.values("lr_scaling/suggested_lr_x2/SGD") == pytest.approx([0.2] * 3)  # linear
    assert logger.values("lr_scaling/suggested_lr_x0.5/SGD") == pytest.approx([0.05] * 3)
    assert "lr_scaling/b_noise" not in logger.series  # nothing measured: classic rules, no NaN


def test_a_warmup_and_cosine_to_0_is_advised_on_its_base_lr_at_every_step_and_at_fit_end():
    """A fresh user's run: AdamW set at 1e-3 under a warmup + cosine LambdaLR that ends at 0. The advice scales
    1e-3 (×2 the batch: ×√2, the square-root rule), at the steps where the lr is 0.0005 and at fit end, where it is 0;
    the lr now is LearningRateMonitor's, the schedule replayed in closed form."""
    factor = warmup_cosine(2, 6)
    logger, advisor = RecordingLogger(), LRScalingAdvisor(log_every_n_steps=1, verbose=False)
    model = Model(
        optimizer=torch.optim.AdamW,
        groups=(1e-3,),
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor),
    )
    monitor = LearningRateMonitor(logging_interval="step")
    fit(model, [monitor, advisor], logger, max_steps=6, accumulate_grad_batches=2, log_every_n_steps=1)
    assert [s for s, _ in logger.series["lr_scaling/lr/AdamW"]] == list(range(6))
    assert logger.values("lr_scaling/lr/AdamW") == pytest.approx([1e-3 * factor(s) for s in range(6)])
    assert dict(logger.series["lr-AdamW"]) == pytest.approx(dict(logger.series["lr_scaling/lr/AdamW"]))
    assert logger.values("lr_scaling/base_lr/AdamW") == pytest.approx([1e-3] * 6)
    assert logger.values("lr_scaling/suggested_lr_x2/AdamW") == pytest.approx([1e-3 * math.sqrt(2)] * 6)
    assert factor(6) == 0.0 and advisor.advices["AdamW"].lr == pytest.approx(1e-3)
    assert advisor.summary_line() == (
        "at an effective batch of 16 (no usable noise scale: classic rules): AdamW base lr 0.001 (the optimizer's lr "
        f"under LambdaLR; now 0 at optimizer step 6) → {1e-3 * math.sqrt(2):.3g} at batch 32 (square-root rule); the full table is the "
        "Text tab's lr_scaling/advice, or trainvitals report."
    )
    report = advisor.summary_markdown()
    assert "- **base lr** AdamW: 0.001 (the optimizer's lr under LambdaLR; now 0 at optimizer step 6)\n" in report
    assert (
        f"| AdamW | Adam-like | 0.001 | square-root | {1e-3 / math.sqrt(2):.3g} | {1e-3 * math.sqrt(2):.3g} |" in report
    )
    assert "**the suggestions are base lrs**" in report


def _digits_fit(band: TrainvitalsCallback, max_steps: int, **model: Any) -> LRScalingAdvisor:
    """A :class:`DigitsMLP` (``model``: its arguments) on the digits, batch 32 × 4 accumulated (the band's noise
    measured across the micro-batches), with ``band`` (a stopper or BandSchedule, read every step) and an advisor;
    seeded, whatever ran before."""
    torch.manual_seed(0)
    model = DigitsMLP(**model)
    advisor = LRScalingAdvisor(detect_loss_reduction=False, verbose=False)
    trainer = Trainer(**trainer_kwargs(callbacks=[band, advisor], max_steps=max_steps, accumulate_grad_batches=4))
    trainer.fit(model, digits_loader(32))
    return advisor


def test_after_a_band_stop_under_one_cycle_the_advice_names_max_lr_and_the_lr_now_as_now():
    """A fresh user's run: SGD under OneCycleLR(max_lr=0.1) stops in its band at step 141, where the schedule's lr
    is 0.0356. "take a larger batch at this lr" named neither; the advice says the value set, what it is, and the
    lr now (OneCycleLR's closed form) only as "now"."""
    from trainvitals import GradNormEarlyStopping

    stopper = GradNormEarlyStopping(patience=3, min_steps=30, margin=1.0, check_every_n_steps=1)
    advisor = _digits_fit(stopper, 200, lr=0.1, schedule="one_cycle", total_steps=200)
    assert stopper.stopped_step is not None and stopper.stopped_step < 199  # stopped before the schedule's end
    now = one_cycle_lr(0.1, 200, stopper.stopped_step + 1)  # the lr of the step that would have come next
    said = f"0.1 (OneCycleLR's max_lr; now {now:.3g} at optimizer step {stopper.stopped_step + 1})"
    line = advisor.summary_line()
    assert f"SGD base lr {said} → 0.2 at batch 256 (linear rule);" in line
    assert line.endswith(f"to go further, take a larger batch at the same base lr, SGD's {said}, or a lower base lr.")
    assert "this lr" not in line and f"- **base lr** SGD: {said}\n" in advisor.summary_markdown()


def test_after_a_cut_under_warmup_and_cosine_the_advice_names_the_lr_set_and_the_cut_lr_now():
    """AdamW set at 0.01 under a warmup + cosine LambdaLR; BandSchedule cuts ×0.1 at step 38. At fit end (step
    100 of the schedule's 200) the lr now is 0.01 × the LambdaLR factor × 0.1, said as "now", the base lr 0.01 as
    the optimizer's lr."""
    from trainvitals import BandSchedule

    schedule = BandSchedule(margin=1.0, patience=3, min_steps=30, check_every_n_steps=1, max_cuts=1, stop=False)
    advisor = _digits_fit(
        schedule, 100, optimizer=torch.optim.AdamW, lr=0.01, schedule="warmup_cosine", total_steps=200
    )
    assert [c["lr_scale"] for c in schedule.cuts] == [0.1]
    scheduled = 0.01 * warmup_cosine(20, 200)(100)
    now = f"now {scheduled:.3g} × 0.1 (BandSchedule) = {scheduled / 10:.3g} at optimizer step 100"
    said = f"0.01 (the optimizer's lr under LambdaLR; {now})"
    line = advisor.summary_line()
    assert f"AdamW base lr {said} → {0.01 * math.sqrt(2):.3g} at batch 256 (square-root rule);" in line
    assert "BandSchedule cut the lr in its noise band at optimizer step " in line
    assert line.endswith(f"take a larger batch at the same base lr, AdamW's {said}, or a lower base lr.")


class _Plateau(Model):
    """SGD at 0.1 under ReduceLROnPlateau on the training loss, stepped every step: it halves the lr in place."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "monitor": "train/loss"}}


def test_under_reduce_on_plateau_the_lr_now_is_advised_on_and_called_no_base_lr():
    advisor = LRScalingAdvisor(verbose=False)
    trainer = fit(_Plateau(), [advisor], batch_size=8, max_steps=8, log_every_n_steps=1)
    now = trainer.optimizers[0].param_groups[0]["lr"]
    assert now < 0.1  # it decayed
    said = f"lr {now:.3g} (ReduceLROnPlateau's lr now: it keeps no base lr)"
    assert f"SGD {said} → {2 * now:.3g} at batch 16 (linear rule);" in advisor.summary_line()
    assert f"- **lr** SGD: {now:.3g} (ReduceLROnPlateau's lr now" in advisor.summary_markdown()


@pytest.mark.parametrize("accumulate", [1, 3])
def test_each_step_is_logged_once_with_the_lr_it_used(accumulate):
    """Beside LearningRateMonitor (which logs the lr a step uses before it runs): the same lr at the
    same step, every step at most once, none at a step that never ran."""
    logger = RecordingLogger()
    monitor = LearningRateMonitor(logging_interval="step")
    fit(
        Model(groups=(0.1,), gamma=0.5),
        [monitor, LRScalingAdvisor(log_every_n_steps=1, verbose=False)],
        logger,
        max_steps=5,
        accumulate_grad_batches=accumulate,
        log_every_n_steps=1,
    )
    ours = logger.series["lr_scaling/lr/SGD"]
    assert [s for s, _ in ours] == [0, 1, 2, 3, 4]
    theirs = dict(logger.series["lr-SGD"])  # once per micro-batch under accumulation, the same value
    assert [lr for _, lr in ours] == pytest.approx([theirs[s] for s, _ in ours])
    assert [s for s, _ in logger.series["lr_scaling/effective_batch"]] == [0, 1, 2, 3, 4]


class _NoiseSource(TrainvitalsCallback):
    """A callback feeding the run's estimate: ``steps`` pairs (‖G‖², tr Σ) with relative jitter ``jitter``."""

    provides = (GRADIENT_NOISE,)

    def __init__(
        self,
        grad_sq_norm: float | None,
        trace_cov: float | None,
        steps: int = 20,
        jitter: float = 0.0,
        param_share: float = 1.0,
    ) -> None:
        super().__init__()
        self.gradient_noise = GradientNoise()
        self.noise_source = NoiseSource("fake", 0.9, param_share)
        self.gradient_noise.attach(self.noise_source)
        if grad_sq_norm is not None:
            for k in range(steps):
                sign = 1 if k % 2 else -1
                self.noise_source.update(
                    torch.tensor(grad_sq_norm * (1 + sign * jitter)),
                    torch.tensor(trace_cov),
                    covered_sq_norm=torch.tensor(param_share),
                    total_sq_norm=torch.tensor(1.0),
                )

    def setup_fit(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.gradient_noise = self.vitals.shared(GRADIENT_NOISE, GradientNoise)  # the fit's one estimate
        self.gradient_noise.attach(self.noise_source)


def test_noise_scale_comes_from_a_callback_with_a_noise_estimate():
    logger, advisor = RecordingLogger(), LRScalingAdvisor(log_every_n_steps=1, verbose=False)
    fit(Model(optimizer=torch.optim.Adam, groups=(1e-3,)), [_NoiseSource(0.01, 10.0), advisor], logger, batch_size=8)
    b_hat, b = 10.0 / 0.01, 8
    # One B_simple per run: the estimate's grad_noise/b_simple, no second series of the advisor's.
    assert "lr_scaling/b_noise" not in logger.series
    assert logger.values("lr_scaling/steps_over_min") == pytest.approx([1 + b_hat / b] * 2)  # steps 0 and 1
    assert logger.values("lr_scaling/examples_over_min")[0] == pytest.approx(1 + b / b_hat)
    for m in (0.5, 2, 4, 8):
        gain = (1 + b_hat / b) / (1 + b_hat / (m * b))
        assert logger.values(f"lr_scaling/suggested_lr_x{m:g}/Adam")[0] == pytest.approx(1e-3 * math.sqrt(gain))
    assert "measured: fake" in advisor.summary_markdown() and "noise-aware" in advisor.summary_markdown()


@pytest.mark.parametrize("case", ["unreliable", "partial", "one step"])
def test_no_noise_aware_advice_from_an_unreliable_or_partial_estimate(case):
    source = {
        "unreliable": _NoiseSource(0.01, 10.0, jitter=5.0),
        "partial": _NoiseSource(0.01, 10.0, param_share=0.4),
        "one step": _NoiseSource(0.01, 10.0, steps=1),
    }[case]
    logger, advisor = RecordingLogger(), LRScalingAdvisor(log_every_n_steps=1, verbose=False)
    fit(Model(groups=(0.1,)), [source, advisor], logger, batch_size=8)
    assert "lr_scaling/b_noise" not in logger.series
    assert logger.values("lr_scaling/suggested_lr_x2/SGD")[0] == pytest.approx(0.2)  # the classic linear rule
    why = {
        "unreliable": "B_simple unreliable",
        "partial": "partial: the estimate covers 40%",
        "one step": "not measured enough yet",
    }[case]
    assert f"not used ({why}" in advisor.summary_markdown()


def test_a_reliable_estimate_comes_with_its_range():
    logger, advisor = RecordingLogger(), LRScalingAdvisor(log_every_n_steps=1, verbose=False)
    source = _NoiseSource(0.01, 10.0, steps=40, jitter=0.2)
    fit(Model(groups=(0.1,)), [source, advisor], logger, batch_size=8)
    est = source.gradient_noise.estimate()
    rel_err, (low, high) = float(est.b_simple_rel_err), (float(v) for v in est.intervals["b_simple"])
    assert (
        0 < rel_err < 0.5 and logger.values("lr_scaling/steps_over_min") and "lr_scaling/b_noise" not in logger.series
    )
    report = advisor.summary_markdown()
    # The estimate's own (Fieller) interval, not a symmetric point ± z·se of its own (issue #24): one per quantity.
    quoted = re.search(r"90% range ([0-9.]+)–([0-9.]+)", report)
    assert (float(quoted.group(1)), float(quoted.group(2))) == pytest.approx((low, high), rel=1e-3)
    assert "over B̂'s 90% range the suggested lr spans ×0.5 (4)" in report


def test_given_noise_scale_and_listed_targets():
    logger = RecordingLogger()
    fit(Model(groups=(0.1,)), [LRScalingAdvisor(noise_scale=40.0, target_batch_sizes=(100,), verbose=False)], logger)
    assert logger.values("lr_scaling/b_noise")[0] == 40.0
    assert logger.values("lr_scaling/suggested_lr_b100/SGD")[0] == pytest.approx(0.1 * (1 + 40 / 8) / (1 + 40 / 100))


def test_param_groups_unknown_optimizers_and_zero_lr():
    logger, advisor = RecordingLogger(), LRScalingAdvisor(log_every_n_steps=1, verbose=False)
    fit(Model(groups=(0.1, 0.01)), [advisor], logger)
    assert logger.values("lr_scaling/suggested_lr_x2/SGD/pg1")[0] == pytest.approx(0.2)
    assert logger.values("lr_scaling/suggested_lr_x2/SGD/pg2")[0] == pytest.approx(0.02)

    logger, advisor = RecordingLogger(), LRScalingAdvisor(verbose=False)
    fit(Model(optimizer=torch.optim.Adagrad), [advisor], logger)
    assert logger.values("lr_scaling/lr/Adagrad")[0] == pytest.approx(0.01)
    assert not [tag for tag in logger.series if tag.startswith("lr_scaling/suggested_lr")]
    assert "| Adagrad | unsure |" in advisor.summary_markdown()

    logger, advisor = RecordingLogger(), LRScalingAdvisor(log_every_n_steps=1, verbose=False)
    fit(Model(warmup_from_zero=True), [advisor], logger, max_steps=3)
    # A warmup from 0: the lr set is 0.01 from step 0 on, where the lr now is 0.
    assert logger.series["lr_scaling/lr/SGD"][0] == (0, 0.0) and logger.series["lr_scaling/base_lr/SGD"][0] == (0, 0.01)
    assert advisor.advices["SGD"] is not None

    logger, advisor = RecordingLogger(), LRScalingAdvisor(log_every_n_steps=1, verbose=False)
    fit(Model(groups=(0.0,)), [advisor], logger, max_steps=2)
    assert advisor.advices == {"SGD": None} and "lr_scaling/lr/SGD" not in logger.series  # set to 0: nothing to scale
    assert "base lr is 0 for every parameter group" in advisor.summary_line()


def test_the_fit_end_line_states_the_advice():
    advisor = LRScalingAdvisor(verbose=False)
    fit(Model(optimizer=torch.optim.Adam, groups=(1e-3,)), [_NoiseSource(0.01, 10.0), advisor], batch_size=8)
    gain = (1 + 1000 / 8) / (1 + 1000 / 16)  # B̂ = 10 / 0.01 examples, from batch 8 to 16
    assert advisor.summary_line() == (
        f"at an effective batch of 8 (noise scale B̂ = 1000, below it): Adam lr 0.001 → {1e-3 * math.sqrt(gain):.3g} "
        "at batch 16 (noise-aware rule); the full table is the Text tab's lr_scaling/advice, or trainvitals report."
    )

    advisor = LRScalingAdvisor(noise_scale=4.0, verbose=False)
    fit(Model(groups=(0.1, 0.01)), [advisor], batch_size=8)
    assert advisor.summary_line().startswith(
        f"at an effective batch of 8 (noise scale B̂ = 4, above it: more batch buys little): SGD/pg1 (and 1 more "
        f"group(s)) lr 0.1 → {0.1 * (1 + 4 / 8) / (1 + 4 / 16):.3g} at batch 16 (noise-aware rule); "
    )

    advisor = LRScalingAdvisor(verbose=False)
    fit(Model(groups=(0.1,)), [advisor], batch_size=8)
    assert (
        "(no usable noise scale: classic rules): SGD lr 0.1 → 0.2 at batch 16 (linear rule)" in advisor.summary_line()
    )

    advisor = LRScalingAdvisor(verbose=False)
    fit(Model(optimizer=torch.optim.Adagrad), [advisor], batch_size=8)
    assert "Adagrad lr 0.01: no scaling rule for its family (unsure)" in advisor.summary_line()


# ---------------------------------------------------------------- reference
def _reference_warnings(recwarn) -> list[str]:
    return [str(w.message) for w in recwarn if "lr was tuned at batch" in str(w.message)]


@pytest.mark.parametrize(
    ("optimizer", "reference", "lr", "warns"),
    [
        (torch.optim.SGD, (4, 0.01), 0.01, "SGD's lr was not rescaled: the linear rule suggests 0.04"),
        (torch.optim.SGD, (4, 0.01), 0.02, "SGD's lr is 0.02: the linear rule suggests 0.04"),
        (torch.optim.SGD, (4, 0.01), 0.04, None),
        (torch.optim.SGD, (4, 0.01), 0.041, None),  # within 5%
        (torch.optim.SGD, (16, 0.01), 0.01, None),  # same batch
        (torch.optim.Adam, (4, 1e-3), 1e-3, "Adam's lr was not rescaled: the square-root rule suggests 0.002"),
        (torch.optim.Adam, (4, 1e-3), 2e-3, None),
        (torch.optim.SGD, (4, {"SGD": 0.01}), 0.01, "the linear rule suggests 0.04"),
    ],
)
def test_reference_warning(recwarn, optimizer, reference, lr, warns):
    advisor = LRScalingAdvisor(reference=reference, verbose=False)
    fit(Model(optimizer=optimizer, groups=(lr,)), [advisor], batch_size=16, max_steps=3)
    messages = _reference_warnings(recwarn)
    if warns is None:
        assert messages == []
    else:
        assert len(messages) == 1 and warns in messages[0]
    assert "**reference**" in advisor.summary_markdown()


# ---------------------------------------------------------------- loss reduction
@pytest.mark.parametrize(("reduction", "ratio"), [("mean", 1.0), ("sum", 2.0)])
def test_loss_reduction_is_detected(reduction, ratio):
    advisor = LRScalingAdvisor(verbose=False)
    fit(Model(reduction=reduction), [advisor], batch_size=8)
    assert advisor.loss_reduction == reduction
    assert advisor.loss_ratio == pytest.approx(ratio, rel=1e-5)
    if reduction == "sum":
        assert "effective lr of 8 × 0.01 = 0.08" in advisor.summary_markdown()


class TokenSum(pl.LightningModule):
    """A per-token cross-entropy summed over the batch's 8 × 5 tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(7, 4), nn.Linear(4, 7))

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        return F.cross_entropy(self.net(tokens).flatten(0, 1), targets.flatten(), reduction="sum")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_loss_summed_over_tokens_scales_the_gradient_by_the_tokens():
    """The duplicated batch says "sum"; the first backward's graph says over how many terms: 8 examples × 5
    tokens, the factor between the summed loss's gradient and that of the mean (checked here directly)."""
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, 7, (16, 5)), torch.randint(0, 7, (16, 5)))
    model, advisor = TokenSum(), LRScalingAdvisor(verbose=False)
    tokens, targets = data.tensors[0][:8], data.tensors[1][:8]
    grads = [
        torch.autograd.grad(
            F.cross_entropy(model.net(tokens).flatten(0, 1), targets.flatten(), reduction=r), model.net[1].weight
        )[0]
        for r in ("sum", "mean")
    ]
    factor = float(grads[0].norm() / grads[1].norm())
    trainer = Trainer(**trainer_kwargs(callbacks=[advisor], logger=False, max_steps=2))
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    assert advisor.loss_reduction == "sum" and advisor.summed_terms == round(factor) == 40
    assert "loss summed over 40 terms (8 examples × 5 each)" in advisor.summary_markdown()
    assert "40 × 0.01 = 0.4" in advisor.summary_markdown()


class TokenSumOverTheStep(pl.LightningModule):
    """A per-token LM whose micro-batches (4 sequences of different lengths, bucketed) sum their token losses and
    divide by the optimizer step's tokens, times accumulate_grad_batches: transformers' ``num_items_in_batch``."""

    PAD, A = -100, 4

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Embedding(7, 4), nn.Linear(4, 7))
        kept = [int((y != self.PAD).sum()) for _, y in batches]
        self.step_tokens = [sum(kept[k : k + self.A]) for k in range(0, len(kept), self.A)]
        self.grads: list[torch.Tensor] = []

    def token_sum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mask = y != self.PAD
        return F.cross_entropy(self.net(x)[mask], y[mask], reduction="sum")

    def training_step(self, batch, batch_idx):
        return self.token_sum(*batch) / self.step_tokens[batch_idx // self.A] * self.A

    def on_before_optimizer_step(self, optimizer):
        self.grads.append(torch.cat([p.grad.flatten() for p in self.parameters()]).clone())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.0)


def test_a_token_sum_over_the_steps_tokens_is_told_its_measured_gradient_scale():
    """The reviewer's fix for uneven token means: each micro-batch's token sum over the step's 2 + 6 + 12 + 20 = 40
    tokens, times 4. The duplicated batch says "sum" (the divisor is fixed); the graphs say each micro-batch's loss
    divides by 40/4 = 10, over 10 terms on average: the step's gradient is 1× that of the mean of its 40 token
    losses (checked against autograd), so Adam's ε is as it is, not ε/2 (the first micro-batch's 2 terms)."""
    g = torch.Generator().manual_seed(0)
    batches = []
    for lengths in ([1, 1, 0, 0], [2, 2, 1, 1], [3, 3, 3, 3], [5, 5, 5, 5]) * 2:
        x, y = torch.randint(0, 7, (4, 5), generator=g), torch.randint(0, 7, (4, 5), generator=g)
        for i, n in enumerate(lengths):
            y[i, n:] = TokenSumOverTheStep.PAD
        batches.append((x, y))
    model, advisor = TokenSumOverTheStep(batches), LRScalingAdvisor(verbose=False)
    assert model.step_tokens == [40, 40]  # the hand count: 2, 6, 12 and 20 tokens
    trainer = Trainer(**trainer_kwargs(callbacks=[advisor], logger=False, max_steps=2, accumulate_grad_batches=4))
    trainer.fit(model, torch.utils.data.DataLoader(batches, batch_size=None))
    xs, ys = torch.cat([x for x, _ in batches[:4]]), torch.cat([y for _, y in batches[:4]])
    model.zero_grad()
    F.cross_entropy(model.net(xs).flatten(0, 1), ys.flatten(), ignore_index=TokenSumOverTheStep.PAD).backward()
    mean = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert float((model.grads[0] - mean).norm() / mean.norm()) < 1e-5  # 1× the token mean's gradient
    assert advisor.loss_reduction == "sum"
    assert (advisor.summed_terms, advisor.loss_divided_by) == (10, 10)
    text = advisor.summary_markdown()
    assert "**loss reduction** sum, each micro-batch's divided by 10 (" in text
    assert "10 terms (4 examples × 2.5 each) and divided by 10" in text
    assert "Adam divides the 1× gradient scale out, except against ε: the effective ε is ε/1 = 1e-08" in text
    assert "ε/2 " not in text and "ε/10" not in text


def test_the_probe_changes_nothing_in_training():
    states = []
    for detect in (False, True):
        torch.manual_seed(0)
        model = Model(jitter=0.1)
        advisor = LRScalingAdvisor(detect_loss_reduction=detect, verbose=False)
        fit(model, [advisor], batch_size=8, max_steps=4)
        states.append({k: v.clone() for k, v in model.state_dict().items()})
        assert model.training and int(model.seen) == 4 * 8
    assert advisor.loss_reduction == "mean"
    for key, value in states[0].items():
        assert torch.equal(value, states[1][key]), key  # RNG (dropout) and BatchNorm buffers untouched


class _Manual(Model):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()


def test_manual_optimization_is_advised_but_not_probed():
    logger, advisor = RecordingLogger(), LRScalingAdvisor(verbose=False)
    fit(_Manual(), [advisor], logger)
    assert advisor.loss_reduction is None
    assert logger.values("lr_scaling/suggested_lr_x2/SGD")[0] == pytest.approx(0.02)


# ---------------------------------------------------------------- logging
def test_tensorboard_gets_scalars_and_the_advice_text(tmp_path, caplog):
    tb = TensorBoardLogger(tmp_path, name="tb", default_hp_metric=False)
    advisor = LRScalingAdvisor(log_every_n_steps=2, verbose=True)
    with caplog.at_level("INFO"):
        fit(Model(), [advisor], tb, max_steps=4)
    events = EventAccumulator(tb.log_dir, size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("lr_scaling/effective_batch")] == [0, 2]
    assert "lr_scaling/suggested_lr_x8/SGD" in events.Tags()["scalars"]
    texts = events.Tensors("lr_scaling/advice/text_summary")
    assert [e.step for e in texts] == [0, 3]  # fit start; the end, at the last step that ran
    end_text = texts[-1].tensor_proto.string_val[0].decode()
    assert end_text == advisor.summary_markdown()
    assert "| SGD | SGD-like | 0.01 | linear |" in advisor.summary_markdown()
    assert "LRScalingAdvisor: advice after 4 optimizer steps" in caplog.text


# ---------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(log_every_n_steps=0), "log_every_n_steps"),
        (dict(log_every_n_steps=1.5), "log_every_n_steps"),
        (dict(target_batch_sizes=(64, 0)), "target_batch_sizes"),
        (dict(target_batch_sizes=(-2,)), "target_batch_sizes"),
        (dict(reference=(0, 0.1)), "reference"),
        (dict(reference=(64, 0.0)), "reference"),
        (dict(reference=(64, -1e-3)), "reference"),
        (dict(reference=(64, {"SGD": 0})), "reference"),
        (dict(noise_scale=0.0), "noise_scale"),
        (dict(noise_scale=-5), "noise_scale"),
        (dict(batch_size=0), "batch_size"),
    ],
)
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        LRScalingAdvisor(**kwargs)


def test_a_reference_that_is_not_a_pair_is_a_type_error():
    with pytest.raises(TypeError, match="`reference`"):
        LRScalingAdvisor(reference=64)


@pytest.mark.parametrize(
    ("schedule", "set_as"),
    [("warmup_from_zero", "the optimizer's lr under LambdaLR"), ("one_cycle", "OneCycleLR's max_lr")],
)
def test_reference_is_compared_with_the_configured_lr_not_the_scheduled_one(recwarn, schedule, set_as):
    # Tuned at batch 4 with lr 0.01, configured at 0.04 for batch 16 (linear rule): correct, though a
    # warmup starts it at 0 and OneCycleLR at 0.04 / 25 (its `initial_lr`).
    advisor = LRScalingAdvisor(reference=(4, 0.01), verbose=False)
    fit(Model(groups=(0.04,), **{schedule: True}), [advisor], batch_size=16, max_steps=3)
    assert _reference_warnings(recwarn) == []
    # The warmup is over at fit end (its lr now is the base lr, not said twice); OneCycleLR is past its peak.
    assert f"the linear rule suggests 0.04 (this run's base lr 0.04 ({set_as}" in advisor.summary_markdown()
    assert f"SGD base lr 0.04 ({set_as}" in advisor.summary_line()
    assert ") → 0.08 at batch 32 (linear rule);" in advisor.summary_line()


def test_a_reference_naming_no_group_is_said_once_at_fit_start() -> None:
    """``{"Adam": 0.1}`` on an SGD model names none of its groups: one warning, and the advice says it."""
    import warnings as _warnings

    from _models import Regressor

    advisor = LRScalingAdvisor(reference=(64, {"Adam": 0.1}), verbose=False)
    with _warnings.catch_warnings(record=True) as caught:
        _warnings.simplefilter("always")
        Trainer(**trainer_kwargs(callbacks=[advisor], max_steps=3, log_every_n_steps=1)).fit(
            Regressor(), loader(regression_data(), 8)
        )
    said = [w for w in caught if "none of the optimizers' parameter groups" in str(w.message)]
    assert len(said) == 1 and "'Adam'" in str(said[0].message)
    assert "none of the optimizers' parameter groups" in advisor.summary_markdown()


class CarriedState(Model):
    """A state of one row per example kept from batch to batch, as a recurrent hidden state is: the step
    fails on any other batch size, the duplicated batch of the loss-reduction probe included."""

    def __init__(self) -> None:
        super().__init__()
        self.state = torch.zeros(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x) + self.state
        self.state = out.detach()
        return F.mse_loss(out, y)


@pytest.mark.parametrize("detect", [True, False])
def test_a_step_that_cannot_be_rerun_on_a_doubled_batch_is_told_the_switch_that_skips_it(detect):
    advisor = LRScalingAdvisor(detect_loss_reduction=detect)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(CarriedState(), [advisor], batch_size=8)
    said = [str(w.message) for w in record if "LRScalingAdvisor" in str(w.message)]
    assert len(said) == detect
    if detect:
        assert "RuntimeError" in said[0] and "detect_loss_reduction=False" in said[0]
    assert advisor.loss_reduction is None  # nothing was learnt, nothing assumed


def test_an_unreliable_estimate_with_an_informative_interval_advises_from_its_bound():
    """‖G‖² within its error of 0 (jitter 5×): no point estimate, but B_simple ≥ low (90 %) bounds what doubling the
    batch costs (E = E_min(1 + B/B̂)) and saves (S = S_min(1 + B̂/B)), each at B̂ = low, the safe side."""
    source = _NoiseSource(0.01, 10.0, jitter=5.0)
    advisor = LRScalingAdvisor(log_every_n_steps=1, verbose=False)
    fit(Model(groups=(0.1,)), [source, advisor], RecordingLogger(), batch_size=8)
    h = source.gradient_noise.host_summary()
    low = h["b_simple_low"]
    assert not h["reliable"] and h["decisive"] and 0 < low < 1000 and math.isinf(h["b_simple_high"])
    report = advisor.summary_markdown()
    extra = (1 + 2 * 8 / low) / (1 + 8 / low) - 1
    saved = 1 - (1 + low / 16) / (1 + low / 8)
    assert f"B_simple ≥ {low:.3g} (90 %)" in report
    assert (
        f"at most {100 * extra:.3g}% more examples" in report
        and f"at least {100 * saved:.3g}% of the optimizer" in report
    )
    assert f"B_simple ≥ {low:.3g} (90 %)" in advisor.summary_line()
