"""TrainingGuard in fits: skip, rollback with an lr factor, stop, the producer of a NaN, DDP, resume, cost."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from _models import LogModel, NoiseOnly, ReleaseProcessGroup, flat_grad_norm, loader, log_data, regression_data
from _spike_rule import flagged_steps
from conftest import HostReads, RecordingLogger, trainer_kwargs
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from trainvitals import BatchVarianceProbe, GradNormEarlyStopping, GradNormMonitor, TrainingGuard, TrainvitalsDashboard
from trainvitals.guard.callback import SKIP_BATCHES_FILE
from trainvitals.guard.snapshot import BufferCopy
from trainvitals.norms.spikes import SPREAD_Z
from trainvitals.report.events import read_runs

LR, MOMENTUM = 0.05, 0.9


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    """Without a logger the Trainer's folder is the working directory: skip_batches.json goes there."""
    monkeypatch.chdir(tmp_path)


class Net(pl.LightningModule):
    """MLP regression under SGD with momentum; the loss is made NaN (``nan_at``, on ``nan_rank`` only if set)
    or 1000× (``spike_at``) at those optimizer steps. ``seen[step]``: the weights, momentum buffers,
    gradients and lr at each optimizer step, after the callbacks' ``on_before_optimizer_step`` (the
    LightningModule's hook runs after theirs), i.e. what the optimizer is about to use."""

    def __init__(self, nan_at=(), spike_at=(), nan_rank=None, inf_grad_at=(), d: int = 6) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, 8), nn.Tanh(), nn.Linear(8, 1))
        self.nan_at, self.spike_at, self.nan_rank = set(nan_at), set(spike_at), nan_rank
        self.inf_grad_at = set(inf_grad_at)  # a finite loss whose gradient is inf (an fp16 overflow, in effect)
        self.losses: dict[int, list[float]] = {}  # per optimizer step, its micro-batches' losses
        self.seen: dict[int, dict] = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        if self.global_step in self.inf_grad_at:
            out.register_hook(lambda g: g * float("inf"))
        loss = F.mse_loss(out.float(), y)
        if self.global_step in self.nan_at and self.nan_rank in (None, self.global_rank):
            loss = loss * float("nan")
        if self.global_step in self.spike_at:
            loss = loss * 1000.0
        self.losses.setdefault(self.global_step, []).append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer):
        params = list(self.parameters())
        self.seen[self.global_step] = {
            "weights": [p.detach().clone() for p in params],
            "momentum": [optimizer.state[p]["momentum_buffer"].clone() for p in params if p in optimizer.state],
            "grads": [None if p.grad is None else p.grad.clone() for p in params],
            "lr": optimizer.param_groups[0]["lr"],
        }

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)


def _fit(model, guard, max_steps=12, callbacks=(), before=(), **kwargs):
    trainer = pl.Trainer(**trainer_kwargs(max_steps=max_steps, callbacks=[*before, guard, *callbacks], **kwargs))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader(regression_data(64, 6), 8))
    return trainer, [str(w.message) for w in caught if "TrainingGuard" in str(w.message)]


def _equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_nan_loss_with_skip_leaves_the_weights_and_the_run_goes_on(tmp_path):
    model, guard = Net(nan_at={5}), TrainingGuard(on_nonfinite="skip", spike_warmup_steps=3)
    recording = RecordingLogger()
    trainer, said = _fit(model, guard, logger=[CSVLogger(tmp_path, name="run"), recording])
    assert trainer.global_step == 12  # to its end
    assert _equal(model.seen[5]["weights"], model.seen[6]["weights"])  # step 5 not applied
    assert _equal(model.seen[5]["momentum"], model.seen[6]["momentum"])
    assert not _equal(model.seen[6]["weights"], model.seen[7]["weights"])  # the next one is
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert guard.skipped_steps == 1 and guard.rollbacks == 0
    events = json.loads((Path(trainer.log_dir) / SKIP_BATCHES_FILE).read_text())
    assert [(e["global_step"], e["epoch"], e["batch_idx"], e["kind"], e["action"]) for e in events] == [
        (5, 0, 5, "nonfinite", "skip")
    ]
    assert events[0]["loss"] == "nan" and events[0]["grad_norm"] == "nan"
    assert recording.series["guard/skipped_steps"] == [(5, 1.0), (12, 1.0)]
    assert recording.series["guard/rollbacks"][-1] == (12, 0.0)
    assert len(said) == 1 and "optimizer step 5" in said[0] and "skipped" in said[0]
    # The NaN was made outside any module: the producer is the loss computation.
    assert guard.producer.where == "loss" and "loss computation" in said[0]


def test_a_spike_with_rollback_restores_the_snapshot_and_the_lr_factor_applies():
    model = Net(spike_at={7})
    guard = TrainingGuard(
        on_spike="rollback", spike_warmup_steps=3, snapshot_every_n_steps=2, lr_factor=0.5, lr_factor_steps=2
    )
    trainer, said = _fit(model, guard)
    seen = model.seen
    assert guard.rollbacks == 1 and "rolled back to the snapshot of optimizer step 6" in said[0]  # of 0, 2, 4, 6
    # Every reader of step 7 sees its own weights and gradients; after it, the snapshot's weights and momentum.
    assert not _equal(seen[7]["weights"], seen[6]["weights"]) and all(g is not None for g in seen[7]["grads"])
    assert _equal(seen[8]["weights"], seen[6]["weights"]) and _equal(seen[8]["momentum"], seen[6]["momentum"])
    # The lr factor for the two steps after it, then the lr as it was.
    assert [seen[s]["lr"] for s in (6, 7, 8, 9, 10)] == [LR, LR, LR * 0.5, LR * 0.5, LR]
    # The step taken at 8 is SGD's with momentum at half the lr: buf = μ·buf + g, w -= (lr/2)·buf.
    for w8, buf8, g8, w9 in zip(seen[8]["weights"], seen[8]["momentum"], seen[8]["grads"], seen[9]["weights"]):
        torch.testing.assert_close(w9, w8 - 0.5 * LR * (MOMENTUM * buf8 + g8))
    assert all(not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks for opt in trainer.optimizers)


@pytest.mark.parametrize("action", ["skip", "rollback"])
def test_the_guard_acts_after_every_reader_of_the_step_first_or_last_in_the_list(action):
    """GradNormMonitor, BatchVarianceProbe and GradNormEarlyStopping log the same numbers with the guard first
    in the callbacks list as last: it drops the gradients and rolls back only after they read the step."""

    def fit(first: bool):
        guard = TrainingGuard(on_nonfinite=action, on_spike=action, spike_warmup_steps=3, snapshot_every_n_steps=2)
        others = [
            GradNormMonitor(log_every_n_steps=1),
            BatchVarianceProbe(measure_every_n_steps=1),
            GradNormEarlyStopping(min_steps=2, patience=50, check_every_n_steps=1),
        ]
        torch.manual_seed(0)
        recording, model = RecordingLogger(), Net(nan_at={5}, spike_at={9})
        callbacks = [guard, *others] if first else [*others, guard]
        trainer = pl.Trainer(**trainer_kwargs(max_steps=12, callbacks=callbacks, logger=recording, log_every_n_steps=1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, loader(regression_data(64, 6), 8))
        return model, guard, recording.series

    (model_a, guard_a, a), (model_b, guard_b, b) = fit(first=True), fit(first=False)
    assert {"grad_norm/total", "grad_noise/b_simple", "grad_noise/trace_cov", "grad_norm/noise_floor"} <= set(a)
    assert {t: repr(v) for t, v in a.items()} == {t: repr(v) for t, v in b.items()}  # NaNs compared as text
    assert a["grad_norm/nonfinite_steps"][-1] == (11, 1.0)  # GradNormMonitor saw the NaN step in both orders
    assert [s for s, _ in a["grad_noise/trace_cov"]] == list(range(12))  # the probe measured every step
    for model, guard in ((model_a, guard_a), (model_b, guard_b)):
        assert [(e["global_step"], e["kind"]) for e in guard.events] == [(5, "nonfinite"), (9, "spike")]
        target = {"skip": (5, 9), "rollback": (4, 8)}[action]  # the weights before the step, or the snapshot's
        assert _equal(model.seen[6]["weights"], model.seen[target[0]]["weights"])
        assert _equal(model.seen[10]["weights"], model.seen[target[1]]["weights"])
    assert _equal(list(model_a.parameters()), list(model_b.parameters()))


class Scheduled(Net):
    """The net with the lr × 0.9 at every step (a chainable scheduler: it reads the group's lr), recording the lr
    each optimizer step took."""

    def __init__(self, **faults) -> None:
        super().__init__(**faults)
        self.in_step: dict[int, float] = {}

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        self.in_step[self.global_step] = optimizer.param_groups[0]["lr"]
        return super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)


@pytest.mark.parametrize("monitor_first", [False, True], ids=["monitor-after", "monitor-first"])
def test_the_lr_factor_shows_in_param_groups_and_the_lr_scheduler_keeps_shaping_the_lr(monitor_first):
    """LearningRateMonitor logs the lr each step took wherever it is listed: ahead of the guard it is moved after
    it (LRFactors' monitors_after), else it logged the scheduler's lr at the two scaled steps."""
    model, recording = Scheduled(spike_at={7}), RecordingLogger()
    guard = TrainingGuard(
        on_spike="rollback", spike_warmup_steps=3, snapshot_every_n_steps=2, lr_factor=0.5, lr_factor_steps=2
    )
    monitor = [LearningRateMonitor()]
    where = {"before": monitor} if monitor_first else {"callbacks": monitor}
    _fit(model, guard, logger=recording, log_every_n_steps=1, **where)
    factor = {8: 0.5, 9: 0.5}  # the two steps after the rollback at step 7
    expected = [LR * 0.9**s * factor.get(s, 1.0) for s in range(12)]
    assert [model.in_step[s] for s in range(12)] == pytest.approx(expected, rel=1e-12)
    assert [lr for _, lr in recording.series["lr-SGD"]] == pytest.approx(expected, rel=1e-6)
    assert recording.series["guard/lr_factor"] == [(8, 0.5), (9, 0.5), (10, 1.0)]
    assert model.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR * 0.9**12, rel=1e-12)


class _ScheduledValidated(Scheduled):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y))


def test_a_checkpoint_between_micro_batches_during_the_lr_factor_resumes_at_the_uninterrupted_lrs(tmp_path):
    """2 micro-batches a step, a validation (and a checkpoint on its metric) after every epoch's 3rd batch: inside
    step 9's window, one of the 4 steps the lr factor applies to after the rollback at step 7, its lr × 0.5 in
    ``param_groups``. The checkpoint holds the scheduler's lr: resumed, every step takes the uninterrupted run's lr
    (saved scaled, the factor applied again to it, and StepLR went on from it: × 0.5 for good)."""
    warnings.filterwarnings("ignore", ".*resuming from a checkpoint that ended before the epoch ended.*")

    def fit(ckpt_path=None, callbacks=()):
        guard = TrainingGuard(
            on_spike="rollback", spike_warmup_steps=3, snapshot_every_n_steps=2, lr_factor=0.5, lr_factor_steps=4
        )
        model = _ScheduledValidated(spike_at={7})
        kwargs = dict(max_steps=14, accumulate_grad_batches=2, val_check_interval=3)
        trainer = pl.Trainer(**trainer_kwargs(**kwargs, callbacks=[guard, *callbacks], enable_checkpointing=True))
        data = loader(regression_data(64, 6), 8)
        trainer.fit(model, data, loader(regression_data(16, 6, seed=1), 8), ckpt_path=ckpt_path)
        return guard, model

    checkpoint = ModelCheckpoint(tmp_path, "{step}", "val_loss", save_top_k=-1, save_on_train_epoch_end=False)
    guard, model = fit(callbacks=[checkpoint])
    assert guard.rollbacks == 1 and [e["global_step"] for e in guard.events] == [7]
    factor = {8: 0.5, 9: 0.5, 10: 0.5, 11: 0.5}
    assert model.in_step == pytest.approx({s: LR * 0.9**s * factor.get(s, 1.0) for s in range(14)}, rel=1e-12)
    resumed, again = fit(ckpt_path=str(tmp_path / "step=9.ckpt"))
    assert resumed.lr_steps_left == 0 and again.in_step == pytest.approx(
        {s: lr for s, lr in model.in_step.items() if s >= 9}, rel=1e-12
    )


def test_a_step_the_grad_scaler_skips_during_the_lr_factor_leaves_the_scheduler_its_own_lr():
    """The GradScaler skips step 8 (an inf gradient, a finite loss: no event) inside the lr factor's steps: the
    scheduler steps from its own lr all the same (LRFactors.before_step, as under BandSchedule), and the factor
    applies to the two steps the optimizer took after the rollback."""

    model, recording = Scheduled(spike_at={7}, inf_grad_at={8}), RecordingLogger()
    guard = TrainingGuard(
        on_spike="rollback", spike_warmup_steps=3, snapshot_every_n_steps=2, lr_factor=0.5, lr_factor_steps=2
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)  # the spike's gradient stays finite in float16
    _fit(model, guard, logger=recording, log_every_n_steps=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    assert [(e["global_step"], e["action"]) for e in guard.events] == [(7, "rollback")] and scaler.get_scale() == 0.5
    factor = {8: 0.5, 9: 0.5, 10: 0.5}  # 8 skipped by the scaler, 9 and 10 taken
    assert [model.in_step[s] for s in range(12)] == pytest.approx([LR * 0.9**s * factor.get(s, 1.0) for s in range(12)])
    assert recording.series["guard/lr_factor"] == [(8, 0.5), (9, 0.5), (10, 0.5), (11, 1.0)]
    assert model.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR * 0.9**12, rel=1e-12)


def test_under_accumulation_an_event_reports_the_steps_mean_loss_and_its_gradient_norm():
    class NormsBefore(pl.Callback):  # runs before the guard: the gradient it judged
        def __init__(self) -> None:
            self.norms: dict[int, float] = {}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.norms[trainer.global_step] = flat_grad_norm(pl_module.parameters())

    model, guard, before = Net(spike_at={4}), TrainingGuard(on_spike="skip", spike_warmup_steps=3), NormsBefore()
    trainer = pl.Trainer(**trainer_kwargs(max_steps=6, callbacks=[before, guard], accumulate_grad_batches=2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, loader(regression_data(64, 6), 8))
    (event,) = guard.events
    assert (event["global_step"], event["epoch"], event["batch_idx"]) == (4, 1, 1)  # the step's last micro-batch
    assert event["loss"] == pytest.approx(sum(model.losses[4]) / 2)  # Lightning divides each by 2
    assert event["grad_norm"] == pytest.approx(before.norms[4])


@pytest.mark.parametrize("accumulate", [1, 2])
def test_an_epochs_short_last_batch_is_no_spike_and_a_real_spike_in_it_still_is(accumulate):
    """drop_last=False, 16-row batches and a last one of 1 row each epoch: that step's norm is about √(B / b) times
    the usual from noise alone — √16 = 4; under accumulation of 2 the last step is that row alone, divided by 2,
    signal and noise alike, so weighted as that row's mean (b = 1 against B = 32, :func:`relative_noise_weight`) —
    above the factor 2 the plain rule flags. Judged with its
    threshold × √(B / b) it is no event; the same step's gradient × 20 is one. Both as the rule replayed by hand
    over each step's brute-force norm and its effective batch from its micro-batches' sizes."""
    factor, warmup, rows = 2.0, 3, 8 * 16 + 1
    data = DataLoader(TensorDataset(torch.randn(rows, 32)), batch_size=16, shuffle=False, drop_last=False)
    epochs, per_epoch = 4, -(-9 // accumulate)  # the 9 batches, in windows of `accumulate`
    spike_at = 2 * per_epoch - 1  # the second epoch's last, short step
    for spike, expected in ((1.0, []), (20.0, [spike_at])):
        model = NoiseOnly(spike_at=spike_at, spike=spike)
        guard = TrainingGuard(spike_factor=factor, spike_warmup_steps=warmup)
        trainer = pl.Trainer(**trainer_kwargs(max_epochs=epochs, callbacks=[guard], accumulate_grad_batches=accumulate))
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            trainer.fit(model, data)
        steps = sorted(model.norms)
        assert len(steps) == epochs * per_epoch and model.sizes[spike_at] == [1]
        # The mean of the micro-batches that ran: n² / Σ 1/b_k over its n.
        batches = [1.0 / sum(1.0 / (len(model.sizes[s]) ** 2 * b) for b in model.sizes[s]) for s in steps]
        usual = 16.0 * accumulate
        assert batches[spike_at] == 1  # the short step's effective batch: 1 row, alone or halved
        norms = [model.norms[s] for s in steps]
        short = [s for s in steps if batches[s] < usual]
        plain = flagged_steps(norms, [1.0] * len(steps), factor, guard.ema_beta, warmup, SPREAD_Z)
        allowed = flagged_steps(
            norms, [math.sqrt(usual / b) for b in batches], factor, guard.ema_beta, warmup, SPREAD_Z
        )
        assert plain and set(plain) <= set(short)  # the plain rule flags short steps: what the allowance is for
        assert allowed == expected
        assert [(e["global_step"], e["kind"]) for e in guard.events] == [(s, "spike") for s in expected]
        if expected:
            assert f"a batch of 1 examples against the usual {usual:g}" in guard.events[0]["detail"]


class TwoPlayers(pl.LightningModule):
    """A GAN's manual loop: the discriminator's step, then the generator's on the same batch, with losses and
    gradient norms about 100× apart; the discriminator's loss (so its gradient) is × ``spike`` at ``spike_at``.
    ``norms[step]``, ``losses[step]``: each optimizer step's brute-force ‖g‖ over its own parameters, and the loss
    it backpropagated."""

    def __init__(self, spike_at: int, spike: float) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.disc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.spike_at, self.spike = spike_at, spike
        self.norms: dict[int, float] = {}
        self.losses: dict[int, float] = {}

    def _step(self, optimizer, loss: Tensor, params) -> None:
        optimizer.zero_grad()
        self.manual_backward(loss)
        self.losses[self.global_step] = loss.item()
        self.norms[self.global_step] = flat_grad_norm(params)
        optimizer.step()

    def training_step(self, batch, batch_idx):
        (x,) = batch
        disc_opt, gen_opt = self.optimizers()
        fake = self.gen(torch.randn(len(x), 4))
        disc_loss = F.softplus(-self.disc(x)).mean() + F.softplus(self.disc(fake.detach())).mean()
        scale = self.spike if self.global_step == self.spike_at else 1.0
        self._step(disc_opt, scale * disc_loss, self.disc.parameters())
        self._step(gen_opt, 100.0 * F.softplus(-self.disc(fake)).mean(), self.gen.parameters())

    def configure_optimizers(self):
        return torch.optim.Adam(self.disc.parameters(), 1e-3), torch.optim.Adam(self.gen.parameters(), 1e-3)


def test_each_optimizer_of_a_gan_is_judged_against_its_own_averages():
    """A 30× spike of the discriminator's loss and gradient, at its 61st step: one EMA over both players' alternating
    steps averages about half the generator's norm, 50× the discriminator's, and would hide it. Judged per optimizer,
    as the rule replayed by hand over each one's brute-force norms and own losses, it is the fit's one event, with
    the discriminator's own loss (not the step's two losses summed)."""
    torch.manual_seed(0)
    factor, warmup, spike_at = 5.0, 20, 120  # global steps alternate: even the discriminator's, odd the generator's
    model, guard = TwoPlayers(spike_at, 30.0), TrainingGuard(spike_factor=factor, spike_warmup_steps=warmup)
    trainer = pl.Trainer(**trainer_kwargs(max_epochs=4, callbacks=[guard]))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(TensorDataset(torch.randn(1600, 8) * 0.5 + 1.0), batch_size=32))
    steps = sorted(model.norms)
    assert len(steps) == 400
    beta = guard.ema_beta

    def replay(values: list[float]) -> list[int]:
        return flagged_steps(values, [1.0] * len(values), factor, beta, warmup, SPREAD_Z)

    per_player = set()
    for player in (0, 1):
        own = steps[player::2]
        per_player |= {own[i] for i in replay([model.norms[s] for s in own])}
        per_player |= {own[i] for i in replay([model.losses[s] for s in own])}
    assert per_player == {spike_at}
    assert replay([model.norms[s] for s in steps]) == []  # one EMA over both: the spike is hidden
    assert [(e["global_step"], e["kind"]) for e in guard.events] == [(spike_at, "spike")]
    assert guard.events[0]["loss"] == pytest.approx(model.losses[spike_at])
    assert guard.events[0]["grad_norm"] == pytest.approx(model.norms[spike_at])
    assert sorted(guard.state_dict()["tracks"]) == ["0", "1"]


class Residuals(pl.LightningModule):
    """loss = mean over the batch of (w·x − y)², w from 0 under a tiny lr, x small: each example's loss stays about
    y². The loss of the optimizer step ``spike_at`` is × ``spike``. ``losses[step]``: each step's loss."""

    def __init__(self, spike_at: int, spike: float) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1, bias=False)
        nn.init.zeros_(self.lin.weight)
        self.spike_at, self.spike = spike_at, spike
        self.losses: dict[int, float] = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.lin(x).squeeze(1) - y).square().mean()
        loss = loss * (self.spike if self.global_step == self.spike_at else 1.0)
        self.losses[self.global_step] = loss.item()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-4)


def test_an_epochs_one_row_batch_with_a_hard_example_is_no_loss_spike_and_a_real_spike_still_is():
    """Batches of 16 and a last one of 1 row each epoch, that row's loss 15× the others' (a hard example, nothing
    wrong): above the factor 5 the plain rule flags at every epoch's end. A mean of b non-negative losses is at most
    B/b times that of a usual batch holding them, so the loss's threshold × B/b (16) lets it be; the same step's loss
    × 100 is still an event. Both as the rule replayed by hand over the steps' own losses and batch sizes."""
    factor, warmup, rows, epochs = 5.0, 3, 8 * 16 + 1, 4
    x = 0.01 * torch.randn(rows, 8, generator=torch.Generator().manual_seed(0))
    y = torch.ones(rows)
    x[-1], y[-1] = 0.1 * x[-1], math.sqrt(15.0)  # its gradient stays within the norm's allowance
    data = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=False)
    for spike, expected in ((1.0, []), (100.0, [17])):  # 17: the second epoch's last, 1-row step
        model, guard = (
            Residuals(17, spike),
            TrainingGuard(on_spike="skip", spike_factor=factor, spike_warmup_steps=warmup),
        )
        trainer = pl.Trainer(**trainer_kwargs(max_epochs=epochs, callbacks=[guard]))
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            trainer.fit(model, data)
        steps = sorted(model.losses)
        losses = [model.losses[s] for s in steps]
        batches = [1.0 if s % 9 == 8 else 16.0 for s in steps]
        plain = flagged_steps(losses, [1.0] * len(steps), factor, guard.ema_beta, warmup, SPREAD_Z)
        allowed = flagged_steps(losses, [16.0 / b for b in batches], factor, guard.ema_beta, warmup, SPREAD_Z)
        assert len(plain) >= epochs - 1 and all(batches[s] == 1.0 for s in plain)  # the epochs' ends
        assert allowed == expected
        assert [(e["global_step"], e["kind"]) for e in guard.events] == [(s, "spike") for s in expected]
        if expected:
            assert (
                "loss" in guard.events[0]["detail"]
                and "a batch of 1 examples against the usual 16" in (guard.events[0]["detail"])
            )


@pytest.mark.parametrize("action", ["warn", "skip"])
def test_under_manual_optimization_a_nan_says_its_producer_is_not_searched(action):
    """A training_step that steps its optimizers itself cannot be re-run: the event says so, not that its read-back
    came too late (which a logging cadence or another action would not change)."""
    model, guard = TwoPlayers(20, float("nan")), TrainingGuard(on_nonfinite=action, spike_warmup_steps=3)
    trainer = pl.Trainer(**trainer_kwargs(max_steps=30, callbacks=[guard]))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(TensorDataset(torch.randn(640, 8)), batch_size=32))
    event = guard.events[0]  # under "warn" the NaN weights make every later step one too
    assert (event["global_step"], event["kind"], event["producer"]) == (20, "nonfinite", None)
    assert "not searched under manual optimization" in event["detail"] and "too late" not in event["detail"]


def test_stop_writes_a_checkpoint_and_says_why(tmp_path):
    model, guard = Net(nan_at={5}), TrainingGuard(on_nonfinite="stop")
    trainer, said = _fit(model, guard, default_root_dir=tmp_path)
    assert trainer.global_step == 6 and trainer.should_stop
    assert "non-finite loss" in guard.stop_reason and "optimizer step 5" in guard.stop_reason
    path = guard.stop_reason.split("checkpoint: ")[1]
    checkpoint = torch.load(path, weights_only=False)
    assert Path(path).parent.parent == tmp_path
    weights = [checkpoint["state_dict"][n] for n, _ in model.named_parameters()]
    assert _equal(weights, model.seen[5]["weights"])  # the bad step was not applied before the checkpoint
    # Its name says the global step it holds (6: step 5 counted, not applied), its guard state the stop.
    assert Path(path).name == f"guard-stop-step={checkpoint['global_step']}.ckpt" == "guard-stop-step=6.ckpt"
    assert checkpoint["callbacks"][guard.state_key]["stop_reason"] == guard.stop_reason
    assert any("stopping the fit" in s and "non-finite loss" in s for s in said)


def test_the_budget_escalates_a_run_of_skips_to_a_rollback():
    model = Net(nan_at={4, 5, 6})
    guard = TrainingGuard(on_nonfinite="skip", budget_events=2, budget_window=10, snapshot_every_n_steps=2)
    _, said = _fit(model, guard)
    assert [e["action"] for e in guard.events] == ["skip", "skip", "rollback"]
    assert guard.skipped_steps == 2 and guard.rollbacks == 1 and "escalated" in said[2]


def test_the_layer_that_made_the_nan_is_named_and_agrees_with_detect_anomaly():
    model, guard = LogModel(), TrainingGuard(on_nonfinite="skip")
    data = log_data(bad_batch=3)
    trainer = pl.Trainer(**trainer_kwargs(max_steps=8, callbacks=[guard]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data)
    said = [str(w.message) for w in caught if "TrainingGuard" in str(w.message)]
    assert [e["global_step"] for e in guard.events] == [3] and guard.skipped_steps == 1
    assert "`net.2` (LogBackward0) in forward" in said[0] and "`net.3`" not in said[0] and "`net.4`" not in said[0]
    assert "in [0, " in said[0]  # the log's input reached 0
    x, y = next(b for i, b in enumerate(data) if i == 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autograd.detect_anomaly(), pytest.raises(RuntimeError, match="returned nan values") as error:
            F.mse_loss(model.net(x), y).backward()
    assert str(error.value).split("'")[1] == guard.producer.op == "LogBackward0"
    assert all(not m._forward_hooks for m in model.modules())  # the search left nothing installed


def test_under_accumulation_a_nan_is_pinned_on_its_micro_batch_and_a_finite_rerun_is_said():
    class NanInBatch(Net):  # the loss of one micro-batch (batch_idx 5: step 1's second of four) is NaN
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * float("nan") if batch_idx == 5 else loss

    guard = TrainingGuard(on_nonfinite="skip")
    trainer = pl.Trainer(**trainer_kwargs(max_steps=3, callbacks=[guard], accumulate_grad_batches=4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(NanInBatch(), loader(regression_data(64, 6), 8))
    said = [str(w.message) for w in caught if "TrainingGuard" in str(w.message)]
    (event,) = guard.events
    assert (event["global_step"], event["batch_idx"], event["batches"]) == (1, 5, [4, 5, 6, 7])
    assert guard.producer.where == "loss"  # batch 5 was the one re-run, and its loss is where the NaN was made
    assert "batch 5 of batches 4–7" in said[0]

    # A finite loss with a NaN gradient in micro-batch 4: the last one (7) is re-run, and its finiteness said.
    model, guard = LogModel(), TrainingGuard(on_nonfinite="skip")
    trainer = pl.Trainer(**trainer_kwargs(max_steps=3, callbacks=[guard], accumulate_grad_batches=4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, log_data(bad_batch=4))
    said = [str(w.message) for w in caught if "TrainingGuard" in str(w.message)]
    (event,) = guard.events
    assert (event["global_step"], event["batch_idx"], event["batches"]) == (1, 7, [4, 5, 6, 7])
    assert guard.producer is None and "re-run of batch 7 was finite" in event["detail"]
    assert (
        "The re-run of batch 7 was finite: the inf/NaN came from another micro-batch of the step (batches 4–7)"
        in said[0]
    )


class RMS(nn.Module):
    """sqrt(mean(h²)) per row: finite in forward at h = 0, where its backward is inf (d√m/dm = 1/(2√m)), then NaN."""

    def forward(self, h: Tensor) -> Tensor:
        return torch.sqrt(h.pow(2).mean(dim=1, keepdim=True))


class Tapped(pl.LightningModule):
    """``h = net.stem(x)`` (no bias) feeds both ``net.rms`` and ``net.norm``, in the order ``rms_first`` says: a zero
    row of ``x`` makes a finite forward and a NaN gradient made in ``net.rms``'s backward only."""

    def __init__(self, rms_first: bool) -> None:
        super().__init__()
        self.rms_first = rms_first
        self.net = nn.ModuleDict(
            {"stem": nn.Linear(4, 8, bias=False), "rms": RMS(), "norm": nn.LayerNorm(8), "head": nn.Linear(9, 1)}
        )

    def forward(self, x: Tensor) -> Tensor:
        h = self.net["stem"](x)
        if self.rms_first:
            e, n = self.net["rms"](h), self.net["norm"](h)
        else:
            n, e = self.net["norm"](h), self.net["rms"](h)
        return self.net["head"](torch.cat([n, e], 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("rms_first", [True, False])
def test_a_nan_made_in_backward_is_pinned_on_its_module_when_the_input_has_two_consumers(rms_first):
    """The gradient reaching ``h`` is the sum of both consumers' shares: only ``net.rms``'s share is NaN, whichever
    ran last in forward. Checked against each module's own share (full backward hooks) on the same batch, and the
    node against the closed form: ``SqrtBackward0`` returns 1/(2√0) = inf."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    x[26] = 0.0  # in batch 3
    data = DataLoader(TensorDataset(x, y), batch_size=8)
    model, guard = Tapped(rms_first), TrainingGuard(on_nonfinite="skip")
    trainer = pl.Trainer(**trainer_kwargs(max_steps=6, callbacks=[guard]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data)
    said = [str(w.message) for w in caught if "TrainingGuard" in str(w.message)]
    assert [e["global_step"] for e in guard.events] == [3]
    producer = guard.producer
    assert (producer.where, producer.module, producer.op, producer.value) == (
        "backward",
        "net.rms",
        "SqrtBackward0",
        "inf",
    )
    assert "`net.rms` (SqrtBackward0) in backward" in said[0] and "`net.norm`" not in said[0]

    turned = []  # the modules whose own gradient was finite at their output and not at their input
    for name in ("rms", "norm", "head"):  # the stem's input needs no gradient
        model.net[name].register_full_backward_hook(
            lambda m, g_in, g_out, name=name: (
                turned.append(name)
                if all(torch.isfinite(g).all() for g in g_out if g is not None)
                and not all(torch.isfinite(g).all() for g in g_in if g is not None)
                else None
            )
        )
    bad_x, bad_y = x[24:32], y[24:32]
    F.mse_loss(model(bad_x), bad_y).backward()
    assert turned == ["rms"]


@pytest.mark.parametrize("guard_first", [True, False])
def test_the_monitors_warning_quotes_the_guards_producer_in_either_order(guard_first):
    """GradNormMonitor names the layers whose gradient held the NaN; beside a TrainingGuard it also says which one
    made it, whichever of the two comes first in the list."""
    guard, monitor = TrainingGuard(on_nonfinite="skip"), GradNormMonitor(log_every_n_steps=1)
    callbacks = [guard, monitor] if guard_first else [monitor, guard]
    trainer = pl.Trainer(**trainer_kwargs(max_steps=6, callbacks=callbacks))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(LogModel(), log_data(bad_batch=3))
    said = [str(w.message) for w in caught if "GradNormMonitor" in str(w.message) and "non-finite" in str(w.message)]
    assert len(said) == 1 and "optimizer step 3" in said[0]
    assert "`net.2` (LogBackward0)" in said[0] and "divergence" not in said[0]


def _monitor_fit(monitor: GradNormMonitor, bad_batch: int = 3, callbacks=(), **kwargs) -> tuple[LogModel, list[str]]:
    """LogModel fitted with ``monitor``; the monitor's non-finite warnings."""
    model = LogModel()
    trainer = pl.Trainer(**trainer_kwargs(max_steps=6, callbacks=[monitor, *callbacks], **kwargs))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, log_data(bad_batch=bad_batch))
    said = [str(w.message) for w in caught if "GradNormMonitor" in str(w.message) and "non-finite" in str(w.message)]
    return model, said


@pytest.mark.parametrize("search", ["flags", "anomaly"])
def test_without_a_guard_the_monitors_warning_names_the_producer(search):
    """GradNormMonitor alone on the five-layer model whose third layer (``net.2``, a log) makes -inf: its one
    warning names that layer, not the clamp or the linear layer after it, by either search."""
    monitor = GradNormMonitor(log_every_n_steps=1, producer_search=search)
    model, said = _monitor_fit(monitor)
    assert len(said) == 1 and "optimizer step 3" in said[0]
    assert "`net.2` (LogBackward0)" in said[0] and "`net.3`" not in said[0] and "`net.4`" not in said[0]
    producer = monitor.search.producer
    assert (producer.module, producer.op, producer.found_by) == ("net.2", "LogBackward0", search)
    assert producer.input_range[0] == 0.0  # the log's input reached 0 (softplus underflowed)
    assert monitor.search.rerun == [3]
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())  # nothing left


def test_the_monitors_producer_agrees_with_the_guards_and_detect_anomaly():
    monitor = GradNormMonitor(log_every_n_steps=1)
    _monitor_fit(monitor)
    guard = TrainingGuard(on_nonfinite="skip", producer_search="anomaly")
    model = LogModel()
    trainer = pl.Trainer(**trainer_kwargs(max_steps=6, callbacks=[guard]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, log_data(bad_batch=3))
    assert (guard.producer.module, guard.producer.op) == (monitor.search.producer.module, monitor.search.producer.op)
    assert guard.producer.found_by == "anomaly" and guard.producer.where == "backward"
    x, y = next(b for i, b in enumerate(log_data(bad_batch=3)) if i == 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autograd.detect_anomaly(), pytest.raises(RuntimeError, match="returned nan values") as error:
            F.mse_loss(model.net(x), y).backward()
    assert str(error.value).split("'")[1] == guard.producer.op


def test_the_monitor_says_why_it_cannot_name_a_producer_read_back_after_its_update():
    # Logging every 2 steps: step 3 is read back at step 4, after its NaN gradient made the weights NaN.
    monitor = GradNormMonitor(log_every_n_steps=2)
    _, said = _monitor_fit(monitor)
    assert len(said) == 1 and "optimizer step 3" in said[0] and "read back at step 4" in said[0]
    assert monitor.search.producer is None and monitor.search.rerun == []  # no re-run with non-finite weights
    # The same cadence, the NaN at a logging step: named.
    monitor = GradNormMonitor(log_every_n_steps=2)
    _, said = _monitor_fit(monitor, bad_batch=4)
    assert "`net.2` (LogBackward0)" in said[0]


def test_the_monitor_leaves_the_search_to_a_guard_unless_it_does_not_search():
    monitor, guard = GradNormMonitor(log_every_n_steps=1), TrainingGuard(on_nonfinite="warn")
    _, said = _monitor_fit(monitor, callbacks=[guard], log_every_n_steps=1)  # an all-warn guard reads at the Trainer's
    assert not monitor.search.searched and guard.producer.module == "net.2"
    assert "as TrainingGuard's re-run" in said[0]
    monitor, guard = GradNormMonitor(log_every_n_steps=1), TrainingGuard(on_nonfinite="warn", name_producer=False)
    _, said = _monitor_fit(monitor, callbacks=[guard])
    assert guard.producer is None and monitor.search.producer.module == "net.2" and "`net.2`" in said[0]
    monitor = GradNormMonitor(log_every_n_steps=1, name_producer=False)
    _, said = _monitor_fit(monitor)
    assert not monitor.search.searched and "name_producer=True" in said[0]


class HalfEpsSGD(torch.optim.SGD):
    """SGD whose update at optimizer step ``at`` divides by an eps kept in float16, where 1e-8 rounds to 0:
    finite gradients, infinite parameters after the step."""

    def __init__(self, params, at: int) -> None:
        super().__init__(params, lr=0.01)
        self.at, self.steps = at, 0

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        if self.steps == self.at:
            eps = torch.tensor(1e-8, dtype=torch.float16).float()
            for p in self.param_groups[0]["params"]:
                if p.grad is not None:
                    p.sub_(0.01 * p.grad / eps)
        self.steps += 1
        return loss


def test_the_optimizer_step_is_named_when_it_made_the_parameters_nonfinite():
    class Model(Net):
        def configure_optimizers(self):
            return HalfEpsSGD(self.parameters(), at=4)

    model, guard = Model(), TrainingGuard(on_nonfinite="warn")
    _, said = _fit(model, guard, max_steps=7, log_every_n_steps=1)  # all-warn: read at every logging step
    assert guard.events[0]["global_step"] == 5 and guard.producer.where == "optimizer"
    assert "the optimizer step itself" in said[0] and "`net.0.weight`" in said[0]
    # GradNormMonitor alone says the same, and re-runs nothing (the weights were the non-finite thing).
    monitor = GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0)
    trainer = pl.Trainer(**trainer_kwargs(max_steps=7, callbacks=[monitor]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Model(), loader(regression_data(64, 6), 8))
    said = [str(w.message) for w in caught if "GradNormMonitor" in str(w.message) and "non-finite" in str(w.message)]
    assert monitor.search.producer.where == "optimizer" and monitor.search.rerun == []
    assert "optimizer step 5" in said[0] and "the optimizer step itself" in said[0] and "`net.0.weight`" in said[0]


def test_the_guard_reads_the_shared_norm_and_reads_the_host_once_a_clean_step(monkeypatch):
    monitor, guard = GradNormMonitor(log_every_n_steps=1000, histogram_every_n_steps=0), TrainingGuard()
    host = HostReads(monkeypatch)
    host.watch(guard, ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step", "on_train_batch_end"))
    trainer, _ = _fit(Net(), guard, max_steps=6, callbacks=[monitor])
    assert guard.vitals.grad_norms.passes == 6  # one fused pass a step, the monitor's and the guard's
    assert sorted(host.reads) == [(s, "tolist") for s in range(6)]
    total = monitor.last_total[0].item()
    assert guard.tracks.get(0).norm_spikes.count == 6 and math.isfinite(total)


def test_with_every_action_warn_the_guard_reads_the_host_at_logging_steps_only(monkeypatch):
    """No action needs the step's numbers before its update: they wait on the device and are read at the Trainer's
    logging steps (0, 4, 8) and at the end, one transfer each; the events keep their own steps, and the producer is
    named when the first non-finite step is a logging step (read before its update)."""
    guard = TrainingGuard(on_nonfinite="warn", on_spike="warn", spike_warmup_steps=3)
    host = HostReads(monkeypatch)
    host.watch(guard, ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step", "on_train_end"))
    _, said = _fit(Net(spike_at={6}, nan_at={8}), guard, max_steps=12, log_every_n_steps=4)
    kinds = {kind: [e["global_step"] for e in guard.events if e["kind"] == kind] for kind in ("spike", "nonfinite")}
    assert {e["action"] for e in guard.events} == {"warn"} and len(said) == 2  # the first of each kind
    assert kinds["spike"][0] == 6 and max(kinds["spike"]) < 8  # the applied spike may make the next step one too
    assert kinds["nonfinite"] == [8, 9, 10, 11]  # the NaN step is applied: the weights are NaN after it
    reads = [step for step, _ in host.reads]
    assert reads[:3] == [0, 4, 8] and set(reads[3:]) == {12}  # at the end: the steps' rows, then each NaN's losses
    assert guard.producer is not None and guard.producer.where == "loss" and "made by" in guard.events[-4]["detail"]
    # A first non-finite step between logging steps is read after its update: said, not searched.
    guard = TrainingGuard(on_nonfinite="warn")
    _fit(Net(nan_at={5}), guard, max_steps=8, log_every_n_steps=4)
    assert guard.producer is None and guard.search.searched and guard.events[0]["global_step"] == 5
    assert "too late to re-run its batch" in guard.events[0]["detail"]


def test_resume_after_a_rollback_continues_counters_and_budget(tmp_path):
    def fit(spike_at, max_steps, ckpt_path=None):  # the guard and its warnings
        guard = TrainingGuard(on_spike="rollback", spike_warmup_steps=3, snapshot_every_n_steps=2, budget_events=2)
        checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=1)
        trainer = pl.Trainer(
            **trainer_kwargs(max_steps=max_steps, callbacks=[guard, checkpoint], enable_checkpointing=True)
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(Net(spike_at=spike_at), loader(regression_data(64, 6), 8), ckpt_path=ckpt_path)
        return guard, [str(w.message) for w in caught if "TrainingGuard" in str(w.message)]

    first, _ = fit({6}, 8)
    assert first.rollbacks == 1 and first.budget.spent == [(6, "rollback")]
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["callbacks"][first.state_key]
    assert saved["snapshot_step"] == 7 and "snapshot" not in saved  # the snapshot itself stays out
    resumed, said = fit({10}, 12, ckpt_path=str(tmp_path / "last.ckpt"))
    assert resumed.rollbacks == 2 and [e["global_step"] for e in resumed.events] == [6, 10]
    assert resumed.budget.spent == [(6, "rollback"), (10, "rollback")]
    assert resumed.tracks.get(0).loss_spikes.count == 12  # the EMA went on: every step entered it (a spike winsorized)
    assert "snapshot of optimizer step 8" in said[0]  # a fresh one at the first clean step after the resume


def test_the_snapshot_goes_into_checkpoints_when_asked():
    guard = TrainingGuard(snapshot_in_checkpoint=True, snapshot_every_n_steps=2)
    _fit(Net(), guard, max_steps=5)
    state = guard.state_dict()
    assert state["snapshot"]["step"] == 4 and state["snapshot_step"] == 4
    again = TrainingGuard(snapshot_in_checkpoint=True)
    again.load_state_dict(state)
    assert again.snapshot.step == 4 and _equal(again.snapshot._module, guard.snapshot._module)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"on_nonfinite": "retry"}, ValueError, "on_nonfinite"),
        ({"on_spike": 1}, TypeError, "on_spike"),
        ({"spike_factor": 1.0}, ValueError, "spike_factor"),
        ({"snapshot_on": "gpu"}, ValueError, "snapshot_on"),
        ({"lr_factor": 0.0}, ValueError, "lr_factor"),
        ({"budget_events": 0}, ValueError, "budget_events"),
        ({"budget_window": 1.5}, ValueError, "budget_window"),
        ({"name_producer": "yes"}, TypeError, "name_producer"),
        ({"producer_search": "grad"}, ValueError, "producer_search"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, error, name):
    with pytest.raises(error, match=name):
        TrainingGuard(**kwargs)


def test_a_run_that_diverged_under_warn_says_its_first_event_and_counts_the_rest():
    """A NaN applied under ``"warn"`` makes every later step non-finite: one warning, not one a step; every event is
    still recorded, and the fit-end line says how many were not said."""
    model, guard = Net(nan_at={3}), TrainingGuard(on_nonfinite="warn", name_producer=False)
    _, said = _fit(model, guard, max_steps=12)
    assert [e["global_step"] for e in guard.events] == list(range(3, 12))
    assert len(said) == 1 and "optimizer step 3" in said[0] and "first" in said[0]
    assert "9 event(s)" in guard.summary_line() and "8 later warn-only event(s)" in guard.summary_line()
    # A spike is a kind of its own: its first is said too.
    model, guard = Net(spike_at={7}, nan_at={9}), TrainingGuard(on_nonfinite="warn", spike_warmup_steps=3)
    _, said = _fit(model, guard, max_steps=12)
    kinds = [e["kind"] for e in guard.events]
    assert kinds[0] == "spike" and "nonfinite" in kinds and len(kinds) > 2
    assert len(said) == 2 and said[0].split(": ")[1] == "spike" and "non-finite" in said[1].split(": ")[1]
    assert f"{len(kinds) - 2} later warn-only event(s)" in guard.summary_line()


@pytest.mark.parametrize(
    ("kwargs", "blocker"),
    [
        ({"lr_factor_steps": 0}, "lr_factor_steps"),
        ({"snapshot_every_n_steps": 0}, "snapshot_every_n_steps"),
        ({"on_nonfinite": "warn", "on_spike": "stop"}, "on_nonfinite"),
    ],
)
def test_an_lr_factor_that_cannot_take_effect_is_refused_naming_why(kwargs, blocker):
    with pytest.raises(ValueError, match="lr_factor") as error:
        TrainingGuard(lr_factor=0.5, **kwargs)
    assert f"`{blocker}" in str(error.value)
    TrainingGuard(lr_factor=1.0, **kwargs)  # no factor: nothing to refuse


def test_an_lr_factor_alone_applies_for_the_default_steps():
    """``lr_factor`` without ``lr_factor_steps`` applies for 100 steps: here every step after the rollback."""
    model = Net(spike_at={7})
    guard = TrainingGuard(on_spike="rollback", spike_warmup_steps=3, snapshot_every_n_steps=2, lr_factor=0.5)
    _fit(model, guard)
    assert guard.rollbacks == 1 and guard.lr_steps_left == 100 - 4  # steps 8–11 applied
    assert [model.seen[s]["lr"] for s in range(6, 12)] == [LR, LR, *[LR * 0.5] * 4]


class _RecordPerRank(pl.Callback):
    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        guard = next(cb for cb in trainer.callbacks if isinstance(cb, TrainingGuard))
        seen = pl_module.seen
        seen.setdefault(5, {"weights": [p.detach() for p in pl_module.parameters()]})  # a fit stopped after step 4
        record = {
            "events": [(e["global_step"], e["kind"], e["action"]) for e in guard.events],
            "global_step": trainer.global_step,
            "weights": [p.detach().reshape(-1).tolist() for p in pl_module.parameters()],
            "unchanged": _equal(seen[4]["weights"], seen[5]["weights"]),
            "producer": guard.producer.where if guard.producer else None,
        }
        Path(self.folder, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


@pytest.mark.slow
@pytest.mark.parametrize("action", ["skip", "stop"])
def test_ddp_a_nan_on_rank_1_only_gets_the_same_action_on_both_ranks(tmp_path, action):
    callbacks = [TrainingGuard(on_nonfinite=action), _RecordPerRank(str(tmp_path)), ReleaseProcessGroup()]
    kwargs = trainer_kwargs(
        strategy="ddp_spawn", devices=2, callbacks=callbacks, max_steps=8, default_root_dir=tmp_path
    )
    pl.Trainer(**kwargs).fit(Net(nan_at={4}, nan_rank=1), loader(regression_data(64, 6), 8))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["events"] == ranks[1]["events"] == [[4, "nonfinite", action]]
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == (8 if action == "skip" else 5)
    assert (tmp_path / "checkpoints" / "guard-stop-step=5.ckpt").exists() == (action == "stop")
    assert ranks[0]["unchanged"] and ranks[1]["unchanged"] and ranks[0]["weights"] == ranks[1]["weights"]
    assert ranks[0]["producer"] == ranks[1]["producer"] == "loss"  # rank 1's finding, told to rank 0


def test_the_events_reach_tensorboard_as_scalars_and_a_panel(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="tb", default_hp_metric=False)
    guard = TrainingGuard(on_nonfinite="skip", on_spike="skip", spike_warmup_steps=3)
    _fit(Net(nan_at={4}, spike_at={8}), guard, logger=logger)
    run = read_runs(logger.log_dir)[0]
    assert run.is_trainvitals and run.scalars["guard/skipped_steps"] == [(4, 1.0), (8, 2.0), (12, 2.0)]
    panel = run.text("guard/event_log")
    assert panel.count("| skip |") == 2 and "| nonfinite |" in panel and "| spike |" in panel
    assert json.loads((Path(logger.log_dir) / SKIP_BATCHES_FILE).read_text())[1]["batch_idx"] == 0  # 8 of 8


def test_the_dashboard_shows_the_guards_diagnosis_panel(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="tb", default_hp_metric=False)
    guard = TrainingGuard(on_nonfinite="skip", spike_warmup_steps=3)
    _fit(Net(nan_at={4}), guard, logger=logger, callbacks=[TrainvitalsDashboard(progress_bar=False, report=False)])
    panel = read_runs(logger.log_dir)[0].text("diagnosis/TrainingGuard")
    assert "1 step(s) skipped" in panel and "| nonfinite |" in panel and "| skip |" in panel


def _amp() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))


def test_under_a_grad_scaler_its_own_skip_is_respected_not_doubled():
    # An inf gradient with a finite loss: the scaler's calibration, no event.
    model, guard = Net(inf_grad_at={3}), TrainingGuard(on_nonfinite="skip")
    trainer, said = _fit(model, guard, max_steps=6, plugins=[_amp()])
    assert guard.events == [] and said == [] and trainer.precision_plugin.scaler.get_scale() == 2.0**7
    assert _equal(model.seen[3]["weights"], model.seen[4]["weights"])  # the scaler skipped it
    # A NaN loss: an event; the scaler skips the step, the guard leaves the gradients to it.
    model, guard = Net(nan_at={3}), TrainingGuard(on_nonfinite="skip")
    trainer, said = _fit(model, guard, max_steps=6, plugins=[_amp()])
    assert [(e["global_step"], e["action"]) for e in guard.events] == [(3, "skip")] and guard.skipped_steps == 1
    assert all(g is not None for g in model.seen[3]["grads"]) and "the GradScaler skips" in said[0]
    assert _equal(model.seen[3]["weights"], model.seen[4]["weights"])
    assert trainer.precision_plugin.scaler.get_scale() == 2.0**7  # backed off once
    # A spike to skip: the scaler steps, the guard drops the gradients before the update (no closure then).
    model, guard = Net(spike_at={5}), TrainingGuard(on_spike="skip", spike_warmup_steps=3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)  # the spike's gradient stays finite in float16
    trainer, _ = _fit(model, guard, max_steps=7, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    assert [(e["global_step"], e["action"]) for e in guard.events] == [(5, "skip")]
    assert _equal(model.seen[5]["weights"], model.seen[6]["weights"]) and all(
        g is not None for g in model.seen[5]["grads"]
    )
    assert scaler.get_scale() == 1.0  # no skip of the scaler's own
    # A NaN loss to roll back: the scaler skips the step, the guard restores the snapshot at the batch's end.
    model, guard = Net(nan_at={5}), TrainingGuard(on_nonfinite="rollback", snapshot_every_n_steps=2)
    trainer, _ = _fit(model, guard, max_steps=7, plugins=[_amp()])
    assert guard.rollbacks == 1 and _equal(model.seen[6]["weights"], model.seen[4]["weights"])


def test_a_rollback_without_a_target_is_a_skip_not_a_crash():
    class Unfreeze(pl.Callback):  # as BackboneFinetuning does: a parameter group added after the snapshot
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 5:
                trainer.optimizers[0].add_param_group({"params": list(pl_module.extra.parameters())})

    class WithFrozen(Net):
        def __init__(self) -> None:
            super().__init__(spike_at={6})
            self.extra = nn.Linear(2, 2)

        def configure_optimizers(self):
            return torch.optim.SGD(self.net.parameters(), lr=LR, momentum=MOMENTUM)

    model = WithFrozen()
    guard = TrainingGuard(on_spike="rollback", spike_warmup_steps=3, snapshot_every_n_steps=4)
    trainer, said = _fit(model, guard, max_steps=8, callbacks=[Unfreeze()])
    assert trainer.global_step == 8 and [e["action"] for e in guard.events] == ["skip"] and guard.rollbacks == 0
    assert _equal(model.seen[6]["weights"], model.seen[7]["weights"])
    assert any("could not roll back" in s for s in said)


class BatchNormNet(Net):
    """Linear → BatchNorm1d → Tanh → Linear; the first Linear's output made NaN at the optimizer steps
    ``nan_at`` (on the micro-batch ``nan_micro`` of the step only, if set), so BatchNorm's forward updates its
    running statistics with NaN before any decision. ``buffers[step]``: the buffers at the step's first
    micro-batch, before its forward."""

    def __init__(self, nan_at=(), nan_micro=None) -> None:
        super().__init__(nan_at=())
        self.net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
        self.bad_at, self.nan_micro = set(nan_at), nan_micro
        self.buffers_at: dict[int, list[Tensor]] = {}
        self.micro = 0

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step not in self.buffers_at:
            self.buffers_at[self.global_step] = [b.clone() for b in self.net[1].buffers()]
            self.micro = 0
        else:
            self.micro += 1

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.net[0](x)
        if self.global_step in self.bad_at and self.nan_micro in (None, self.micro):
            h = h * float("nan")
        loss = F.mse_loss(self.net[1:](h), y)
        self.losses.setdefault(self.global_step, []).append(loss.item())
        return loss


@pytest.mark.parametrize(("action", "accumulate"), [("skip", 1), ("skip", 2), ("stop", 1)])
def test_a_skipped_step_puts_back_the_batchnorm_buffers_its_forward_changed(action, accumulate):
    """The weights alone do not undo a step: BatchNorm's forward updated its running statistics (and
    num_batches_tracked) with the NaN batch. After the skip they are bit-identical to the step's start."""
    model = BatchNormNet(nan_at={5}, nan_micro=1 if accumulate > 1 else None)
    guard = TrainingGuard(on_nonfinite=action, spike_warmup_steps=3)
    trainer, said = _fit(model, guard, max_steps=9, accumulate_grad_batches=accumulate)
    assert [(e["global_step"], e["action"]) for e in guard.events] == [(5, action)]
    assert guard.producer is not None  # the producer search re-ran the bad batch through BatchNorm
    bn = model.net[1]
    seen = model.buffers_at
    names = [n for n, _ in bn.named_buffers()]
    assert names == ["running_mean", "running_var", "num_batches_tracked"]
    assert not _equal(seen[4], seen[5])  # a clean step moves them
    if action == "stop":
        assert trainer.global_step == 6 and guard.stop_reason
        after = [b.clone() for b in bn.buffers()]
        saved = torch.load(guard.stop_reason.split("checkpoint: ")[1], weights_only=False)["state_dict"]
        assert _equal([saved[f"net.1.{n}"] for n in names], seen[5])  # the checkpoint carries no NaN
    else:
        assert trainer.global_step == 9
        after = seen[6]
        assert not _equal(seen[6], seen[7])  # the clean steps after it update them again
    assert _equal(after, seen[5])  # the skipped step's forward undone, bit for bit
    assert int(after[2]) == int(seen[4][2]) + accumulate  # num_batches_tracked: the clean steps' batches only
    assert all(torch.isfinite(b).all() for b in model.buffers() if b.is_floating_point())
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_rollback_puts_back_the_batchnorm_buffers_as_the_snapshot_step_started(accumulate):
    """The snapshot of step 6 is taken at its optimizer step, after its forward moved BatchNorm's running statistics:
    a rollback puts back those before that forward (the test's own copy, at the step's first micro-batch), with
    the weights of that step, so that the step after starts from step 6's own starting state."""
    model = BatchNormNet(nan_at={7})
    guard = TrainingGuard(on_nonfinite="rollback", snapshot_every_n_steps=2, spike_warmup_steps=3)
    trainer, said = _fit(model, guard, max_steps=9, accumulate_grad_batches=accumulate)
    assert [(e["global_step"], e["action"]) for e in guard.events] == [(7, "rollback")]
    assert "rolled back to the snapshot of optimizer step 6" in said[0]
    seen = model.buffers_at
    assert not _equal(seen[6], seen[7])  # step 6's forward moved them: the snapshot must not take those
    assert _equal(seen[8], seen[6])  # running_mean, running_var and num_batches_tracked, bit for bit
    assert int(seen[8][2]) == 6 * accumulate  # the batches of steps 0-5 only
    assert _equal(model.seen[8]["weights"], model.seen[6]["weights"])


def test_the_buffer_copy_restores_in_place_and_refuses_a_changed_layout():
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.BatchNorm1d(4))
    module[2].register_buffer("scratch", torch.ones(5), persistent=False)  # not in the state_dict: not copied
    copy = BufferCopy()
    with pytest.raises(RuntimeError):
        copy.restore(module)
    copy.take(module)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    assert copy.nbytes == 2 * (4 * 4 + 4 * 4 + 8)  # two running means and vars (fp32), two int64 counters
    module.train()(torch.randn(6, 3))
    module[1].running_var.fill_(1e30)  # finite but polluted: restored all the same
    module[2].scratch.fill_(2.0)
    copy.restore(module)
    after = module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(module[2].scratch, torch.full((5,), 2.0))
    module[1].register_buffer("extra", torch.zeros(2))
    with pytest.raises(RuntimeError):
        copy.restore(module)
    lazy = nn.Sequential(nn.LazyLinear(4), nn.LazyBatchNorm1d())  # not materialized: only num_batches_tracked
    copy.take(lazy)
    assert copy.nbytes == 8
    lazy(torch.randn(3, 5))
    with pytest.raises(RuntimeError):  # materialized since: no copy of these buffers
        copy.restore(lazy)
    copy.take(lazy)
    assert copy.nbytes == 4 * 4 + 4 * 4 + 8


def test_the_buffer_copy_keeps_its_list_until_the_modules_buffers_change():
    """One walk while nothing changes; a new one after a ``.to()``, a swapped submodule, a new buffer, a lazy
    module's first forward; and what is copied is always the module's current buffers."""
    registered = len(nn.modules.module._global_buffer_registration_hooks)
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.BatchNorm1d(4))
    copy = BufferCopy()

    def round_trip() -> None:  # take, pollute, restore: the state_dict comes back bit for bit
        copy.take(module)
        before = {k: v.clone() for k, v in module.state_dict().items()}
        for b in module.buffers():
            b.add_(1)
        copy.restore(module)
        assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())

    for _ in range(3):
        round_trip()
    assert copy.walks == 1 and len(nn.modules.module._global_buffer_registration_hooks) == registered + 1
    module.to(torch.float64)  # every buffer replaced by a new tensor
    round_trip()
    assert copy.walks == 2 and copy._copies[0].dtype == torch.float64
    module[2] = nn.BatchNorm1d(4, dtype=torch.float64)  # the same layout, other tensors
    round_trip()
    assert copy.walks == 3 and any(b is module[2].running_mean for b in copy._held.buffers)
    module[1].register_buffer("extra", torch.zeros(2, dtype=torch.float64))
    round_trip()
    assert copy.walks == 4 and copy.nbytes == 2 * (2 * 4 * 8 + 8) + 2 * 8
    round_trip()
    assert copy.walks == 4
    lazy = nn.Sequential(nn.LazyLinear(4), nn.LazyBatchNorm1d())
    copy.take(lazy)
    lazy(torch.randn(3, 5))  # materialized in place: the same tensors, now with a shape
    copy.take(lazy)
    assert copy.walks == 6 and copy.nbytes == 4 * 4 + 4 * 4 + 8
    copy.close()
    assert len(nn.modules.module._global_buffer_registration_hooks) == registered


def test_a_fit_walks_the_module_for_its_buffers_once_and_leaves_no_hook():
    registered = len(nn.modules.module._global_module_registration_hooks)
    model, guard = BatchNormNet(nan_at={4}), TrainingGuard(on_nonfinite="skip")
    _fit(model, guard, max_steps=8)
    assert [e["action"] for e in guard.events] == ["skip"] and guard._buffers.walks == 1
    assert len(nn.modules.module._global_module_registration_hooks) == registered
