"""UpdateMonitor against closed forms (SGD, Adam's first step) and brute-force Δθ of recorded weights."""

from __future__ import annotations

import json
import math

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from _models import GAN, NoiseOnly, Regressor, ReleaseProcessGroup, loader, regression_data
from _spike_rule import flagged_steps
from conftest import HostReads, RecordingLogger, trainer_kwargs
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainvitals import GradNormMonitor, UpdateMonitor
from trainvitals.fused_norms import NormGroups
from trainvitals.updates import monitor as update_monitor
from trainvitals.updates.monitor import at_full_lr, group_lrs


class Weights(pl.Callback):
    """Brute force: every parameter before (``on_train_batch_start``) and after (``on_train_batch_end``) each
    batch's steps, and the gradient each step was taken on (the module's hook runs after the callbacks')."""

    def __init__(self) -> None:
        self.before: dict[int, dict[str, torch.Tensor]] = {}
        self.after: dict[int, dict[str, torch.Tensor]] = {}
        self.grads: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_start(self, trainer, pl_module, *_):
        self.before[trainer.global_step] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.setdefault(
            trainer.global_step, {n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None}
        )

    def on_train_batch_end(self, trainer, pl_module, *_):
        self.after[trainer.global_step - 1] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def norm(self, which, step, prefix=""):
        tensors = [t.double().reshape(-1) for n, t in which[step].items() if n.startswith(prefix)]
        return torch.linalg.vector_norm(torch.cat(tensors)).item()

    def delta_norm(self, step, prefix=""):
        deltas = [
            (self.after[step][n] - t).double().reshape(-1) for n, t in self.before[step].items() if n.startswith(prefix)
        ]
        return torch.linalg.vector_norm(torch.cat(deltas)).item()


class Linear(pl.LightningModule):
    """A linear model under MSE; ``optimizer`` builds its optimizer from its parameters."""

    def __init__(self, d=6, optimizer=lambda params: torch.optim.SGD(params, lr=0.1), zero_input_column=False):
        super().__init__()
        self.body = nn.Linear(d, 3)
        self.head = nn.Linear(3, 1)
        self.make_optimizer = optimizer
        self.zero_input_column = zero_input_column

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.zero_input_column:
            x = torch.cat([x[:, :1] * 0.0, x[:, 1:]], dim=1)  # body.weight[:, 0] gets no gradient
        return F.mse_loss(self.head(self.body(x)), y)

    def configure_optimizers(self):
        return self.make_optimizer(self.parameters())


def fit(model, callbacks, logger=None, *, batch_size=8, n=64, ckpt_path=None, **overrides):
    logger = logger if logger is not None else RecordingLogger()
    trainer = pl.Trainer(**trainer_kwargs(callbacks=callbacks, logger=logger, **overrides))
    trainer.fit(model, loader(regression_data(n), batch_size), ckpt_path=ckpt_path)
    return trainer, logger


def test_sgd_update_norm_is_lr_times_grad_norm_and_ratio_over_the_weights():
    lr = 0.1
    weights = Weights()
    _, logger = fit(Linear(), [UpdateMonitor(log_every_n_steps=1), weights], max_steps=5)
    for group in ("body", "head"):
        steps = [s for s, _ in logger.series[f"update/norm/{group}"]]
        assert steps == [0, 1, 2, 3, 4]
        grad = [weights.norm(weights.grads, s, group) for s in steps]
        weight = [weights.norm(weights.before, s, group) for s in steps]
        assert logger.values(f"update/norm/{group}") == pytest.approx([lr * g for g in grad], rel=1e-6)
        assert logger.values(f"update/weight_norm/{group}") == pytest.approx(weight, rel=1e-6)
        assert logger.values(f"update/ratio/{group}") == pytest.approx(
            [lr * g / w for g, w in zip(grad, weight)], rel=1e-6
        )
        assert logger.values(f"update/grad_cosine/{group}") == pytest.approx([1.0] * 5, abs=1e-6)
        assert f"update/exp_avg_norm/{group}" not in logger.series  # not Adam
    total = [lr * weights.norm(weights.grads, s) / weights.norm(weights.before, s) for s in range(5)]
    assert logger.values("update/total_ratio") == pytest.approx(total, rel=1e-6)
    assert logger.values("update/total_norm") == pytest.approx([weights.delta_norm(s) for s in range(5)], rel=1e-6)


def test_adam_first_step_moves_each_coordinate_with_a_gradient_by_lr():
    lr, eps = 1e-2, 1e-8
    weights = Weights()
    model = Linear(optimizer=lambda params: torch.optim.Adam(params, lr=lr, eps=eps), zero_input_column=True)
    _, logger = fit(model, [UpdateMonitor(log_every_n_steps=1), weights], max_steps=1)
    grads = weights.grads[0]
    nonzero = sum(int((g != 0).sum()) for g in grads.values())
    assert nonzero == sum(g.numel() for g in grads.values()) - 3  # the zeroed input column of body.weight
    total = logger.values("update/total_norm")[0]
    assert total == pytest.approx(lr * math.sqrt(nonzero), rel=1e-5)
    assert total == pytest.approx(weights.delta_norm(0), rel=1e-6)
    for group in ("body", "head"):
        k = sum(int((g != 0).sum()) for n, g in grads.items() if n.startswith(group))
        g_norm = weights.norm(weights.grads, 0, group)
        assert logger.values(f"update/unit_step_norm/{group}")[0] == pytest.approx(math.sqrt(k), rel=1e-5)
        assert logger.values(f"update/exp_avg_norm/{group}")[0] == pytest.approx(0.1 * g_norm, rel=1e-6)  # (1 − β₁) g
        assert 0.0 < logger.values(f"update/grad_cosine/{group}")[0] < 1.0  # sign(g) is not g's direction


def test_adam_step_per_unit_lr_is_the_update_over_lr_later_too():
    """Without weight decay Adam's Δθ = −lr · m̂/(√v̂ + ε) at every step: the logged unit step × lr is ‖Δθ‖."""
    lr = 1e-2
    model = Linear(optimizer=lambda params: torch.optim.Adam(params, lr=lr))
    _, logger = fit(model, [UpdateMonitor(log_every_n_steps=3)], max_steps=7)
    assert [s for s, _ in logger.series["update/norm/body"]] == [0, 3, 6]
    for group in ("body", "head"):
        unit = logger.values(f"update/unit_step_norm/{group}")
        assert logger.values(f"update/norm/{group}") == pytest.approx([lr * u for u in unit], rel=1e-5)


def test_a_param_group_with_lr_zero_is_named_as_not_moving():
    def optimizer(params):
        model_params = list(params)
        return torch.optim.SGD([{"params": model_params[:2], "lr": 0.1}, {"params": model_params[2:], "lr": 0.0}])

    monitor = UpdateMonitor(log_every_n_steps=2)
    _, logger = fit(Linear(optimizer=optimizer), [monitor], max_steps=6)
    assert logger.values("update/ratio/head") == [0.0, 0.0, 0.0]
    assert all(r > 0 for r in logger.values("update/ratio/body"))
    findings = monitor.findings()
    still = [f for f in findings if "do not move" in f]
    assert len(still) == 1 and "head" in still[0] and "body" not in still[0]
    assert "head" in monitor.summary_markdown()


def test_an_amp_skipped_step_is_counted_not_logged_as_a_ratio():
    monitor = UpdateMonitor(log_every_n_steps=1)
    weights = Weights()
    _, logger = fit(
        Regressor(autocast=False, inf_at_step=2),
        [monitor, weights],
        max_epochs=1,
        plugins=[MixedPrecision("16-mixed", "cpu")],
    )
    steps = [s for s, _ in logger.series["update/total_ratio"]]
    assert 2 not in steps and {0, 1, 3, 4} <= set(steps)
    assert weights.delta_norm(2) == 0.0  # the step really was skipped
    assert logger.values("update/skipped_steps")[-1] == 1
    assert dict(logger.series["update/skipped_steps"])[2] == 1  # counted at the skipped step itself
    assert monitor._tracks[0].state.steps == 8 and monitor._tracks[0].state.skipped == 1
    assert [s for s, _ in logger.series["update/total_norm"]] == steps
    assert logger.values("update/total_norm")[1] == pytest.approx(weights.delta_norm(1), rel=1e-4)


def test_accumulated_gradients_one_update_per_window():
    lr = 0.05
    model = Regressor(autocast=False, lr=lr)
    _, logger = fit(model, [UpdateMonitor(log_every_n_steps=1)], max_steps=4, accumulate_grad_batches=2)
    assert [s for s, _ in logger.series["update/total_norm"]] == [0, 1, 2, 3]
    assert logger.values("update/total_norm") == pytest.approx([lr * g for g in model.reference_norms], rel=1e-6)


class LBFGSLinear(Linear):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=4)


def test_lbfgs_closure_evaluations_make_one_exact_update():
    weights = Weights()
    monitor = UpdateMonitor(log_every_n_steps=1)
    _, logger = fit(LBFGSLinear(), [monitor, weights], batch_size=16, max_steps=3)
    assert [s for s, _ in logger.series["update/total_norm"]] == [0, 1, 2]
    assert logger.values("update/total_norm") == pytest.approx([weights.delta_norm(s) for s in range(3)], rel=1e-6)
    assert monitor._tracks[0].state.steps == 3 and monitor._tracks[0].state.skipped == 0


def test_manual_optimization_two_optimizers_tags_per_optimizer():
    model = GAN(d=6)
    monitor = UpdateMonitor(log_every_n_steps=1)
    _, logger = fit(model, [monitor], max_steps=6)
    # SGD(lr=0.01): ‖Δθ‖ = 0.01 ‖g‖, g what each optimizer stepped on; up to the float32 rounding of
    # θ − 0.01 g, ~1e-7 ‖θ‖ per coordinate, which at a ratio of ~3e-3 is ~3e-5 of ‖Δθ‖.
    for k in (0, 1):
        expected = [0.01 * g for g in model.reference[k]]
        assert logger.values(f"update/optimizer_{k}/total_norm") == pytest.approx(expected, rel=1e-4)
    assert "update/optimizer_0/ratio/gen.0" in logger.series and "update/optimizer_1/ratio/disc.0" in logger.series
    assert "update/total_ratio" not in logger.series


def test_a_non_logging_step_copies_nothing_and_reads_nothing_on_the_host(monkeypatch):
    copies = []
    original = update_monitor.snapshot
    monkeypatch.setattr(update_monitor, "snapshot", lambda params: copies.append(1) or original(params))
    monitor = UpdateMonitor(log_every_n_steps=4)
    reads = HostReads(monkeypatch)
    reads.watch(monitor, ("on_before_optimizer_step", "on_train_batch_end"))
    after_step = monitor._after_step

    def watched(index, optimizer, *args):
        reads.watching = monitor._tracks[index].begun
        try:
            return after_step(index, optimizer, *args)
        finally:
            reads.watching = None

    monkeypatch.setattr(monitor, "_after_step", watched)
    _, logger = fit(Regressor(autocast=False), [monitor], max_steps=10)
    assert len(copies) == 3
    assert sorted({step for step, _ in reads.reads}) == [0, 4, 8]
    assert [s for s, _ in logger.series["update/total_ratio"]] == [0, 4, 8]


def test_the_step_gradient_norms_are_shared_with_gradnormmonitor():
    grads = GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0)
    updates = UpdateMonitor(log_every_n_steps=1)
    fit(Linear(), [grads, updates], max_steps=4)
    assert updates.vitals is grads.vitals and updates.vitals.grad_norms.passes == 4


def test_a_large_lr_is_a_ratio_above_the_range_and_a_tiny_one_below():
    def optimizer(params):
        model_params = list(params)
        return torch.optim.SGD([{"params": model_params[:2], "lr": 2.0}, {"params": model_params[2:], "lr": 1e-6}])

    monitor = UpdateMonitor(log_every_n_steps=1)
    _, logger = fit(Linear(optimizer=optimizer), [monitor], max_steps=1)
    assert logger.values("update/ratio/body")[0] > 0.1 and 0.0 < logger.values("update/ratio/head")[0] < 1e-5
    findings = monitor.findings()
    assert any("above" in f and "body" in f and "head" not in f for f in findings)
    assert any("below" in f and "head" in f and "body" not in f for f in findings)


def test_a_decayed_lr_makes_no_finding_that_the_lr_is_too_small():
    """SGD at lr 0.1, a schedule that cuts it 10⁶× from step 3 on: the ratios fall below the usual range at the 9
    steps after the cut, most of the logged steps, on purpose. Only steps above half the peak lr are judged for
    that finding, so there is none; the ratios are as logged (below the range after the cut)."""

    class Decayed(Linear):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            cut = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 if step < 3 else 1e-6)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": cut, "interval": "step"}}

    monitor = UpdateMonitor(log_every_n_steps=1)
    _, logger = fit(Decayed(), [monitor], max_steps=12)
    low = monitor.usual_ratio / monitor.ratio_factor
    ratios = logger.values("update/ratio/head")
    assert all(r > low for r in ratios[:3]) and all(0.0 < r < low for r in ratios[3:])
    assert not any("below" in f for f in monitor.findings())
    assert monitor._track_states.get(0).peak_lrs == pytest.approx({"body": 0.1, "head": 0.1})


def test_a_schedule_decaying_one_param_group_alone_makes_no_finding_for_it():
    """Two param groups at lr 0.1; from step 3 on a schedule cuts the head's 10⁶× and keeps the body's: the head's
    ratios fall below the range on purpose. Each layer is judged against its own group's peak, so no finding — with
    the largest group's peak (the body's, still full), the head was named."""

    class OneDecayed(Linear):
        def configure_optimizers(self):
            params = list(self.parameters())
            optimizer = torch.optim.SGD([{"params": params[:2], "lr": 0.1}, {"params": params[2:], "lr": 0.1}])
            lambdas = [lambda step: 1.0, lambda step: 1.0 if step < 3 else 1e-6]
            cut = torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": cut, "interval": "step"}}

    monitor = UpdateMonitor(log_every_n_steps=1)
    _, logger = fit(OneDecayed(), [monitor], max_steps=12)
    low = monitor.usual_ratio / monitor.ratio_factor
    assert all(r < low for r in logger.values("update/ratio/head")[3:])  # 0 where float32 rounds the step away
    assert not any("below" in f for f in monitor.findings())
    assert monitor._track_states.get(0).records["head"]["full_lr"] == 3


@pytest.mark.parametrize(("lr", "full"), [(0.05, True), (0.03, True), (0.025, False), (0.005, False), (0.0, False)])
def test_a_step_is_at_full_lr_above_half_the_peak_and_a_cut_to_the_share_is_not(lr, full):
    """Peak 0.05: a cut to half (StepLR's gamma=0.5, 0.05 × 0.5 in floating point) or to a tenth (BandSchedule's
    default, StepLR's gamma=0.1) is not full; a rising lr (a warm-up) raises the peak and is full."""
    assert at_full_lr(lr, 0.05) == (full, 0.05)
    assert at_full_lr(0.08, 0.05) == (True, 0.08)
    assert at_full_lr(math.nan, 0.05) == (True, 0.05)


def test_each_group_takes_the_largest_lr_of_the_param_groups_holding_it():
    weight, bias, other = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    optimizer = torch.optim.SGD([{"params": [weight], "lr": 0.1}, {"params": [bias, other], "lr": 0.3}])
    groups = NormGroups.from_names(["layer.weight", "layer.bias", "other.weight"])
    assert group_lrs(optimizer, groups) == [0.3, 0.3]
    optimizer.param_groups[1]["lr"] = torch.tensor(0.01)  # a tensor lr, as capturable optimizers hold it
    assert group_lrs(optimizer, groups) == pytest.approx([0.1, 0.01])


def said(caplog: pytest.LogCaptureFixture, recwarn: pytest.WarningsRecorder, text: str) -> list[str]:
    """Every console line (a log record) and every warning of the test that holds ``text``."""
    lines = [r.getMessage() for r in caplog.records] + [str(w.message) for w in recwarn]
    return [line for line in lines if text in line]


def test_an_update_norm_spike_is_found_and_said_once(caplog, recwarn):
    """Said when flagged (a console line), counted in the fit-end line, listed in the summary, not warned again at
    the fit's end."""

    class Kick(Linear):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * (1e3 if self.global_step == 7 else 1.0)

    monitor = UpdateMonitor(log_every_n_steps=1, spike_warmup_steps=3)
    with caplog.at_level("INFO"):
        fit(Kick(optimizer=lambda p: torch.optim.SGD(p, lr=1e-3)), [monitor], max_steps=8)
    assert monitor._tracks[0].state.spike_steps == 1
    (line,) = said(caplog, recwarn, "spike at optimizer step")
    assert line.startswith("trainvitals UpdateMonitor: update-norm spike at optimizer step 7: ")
    assert "update-norm spikes 1" in said(caplog, recwarn, "UpdateMonitor: 8 steps")[0]  # the fit-end line
    assert any("spike at optimizer step 7" in f for f in monitor.findings())
    assert "- update-norm spike at optimizer step 7: " in monitor.summary_markdown()


def test_repeated_update_norm_spikes_are_said_once_and_counted(caplog, recwarn):
    class Kicks(Linear):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * (1e3 if self.global_step in (7, 9) else 1.0)

    monitor = UpdateMonitor(log_every_n_steps=1, spike_warmup_steps=3)
    with caplog.at_level("INFO"):
        fit(Kicks(optimizer=lambda p: torch.optim.SGD(p, lr=1e-3)), [monitor], max_steps=10)
    assert monitor._tracks[0].state.spike_steps == 2
    (line,) = said(caplog, recwarn, "spike at optimizer step")
    assert "spike at optimizer step 7: " in line
    assert "update-norm spikes 2" in monitor.summary_line()
    assert any("spike at optimizer step 9" in f for f in monitor.findings())  # the latest, in the findings


class _UpdateNorms(NoiseOnly):
    """NoiseOnly (d = 2, plain SGD at lr 1e-3: Δθ = −lr · g) recording each step's brute-force ‖Δθ‖ in float64."""

    def __init__(self, spike_at: int, spike: float) -> None:
        super().__init__(spike_at=spike_at, spike=spike, d=2)
        self.updates: dict[int, float] = {}
        self._before = torch.zeros(0)

    def on_before_optimizer_step(self, optimizer):
        super().on_before_optimizer_step(optimizer)
        self._before = self.lin.weight.detach().double().clone()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.updates[self.global_step - 1] = (self.lin.weight.detach().double() - self._before).norm().item()


def test_an_sgd_update_from_an_epochs_one_row_batch_is_no_spike_and_a_20x_one_still_is(caplog):
    """321 rows at batch 16, shuffled, 12 epochs: each epoch ends in a 1-row batch, whose SGD update (lr × its
    gradient) is about √16 = 4× the usual from noise alone. The plain rule (5×, β 0.9, 5 warm-up steps) replayed over
    the brute-force ‖Δθ‖ flags epoch ends and nothing else; with each short step's threshold × √(B / b) it flags
    none, nor does the monitor; the last update of epoch 5 × 20 is flagged by both, said with its batch."""
    data = DataLoader(TensorDataset(torch.randn(20 * 16 + 1, 2)), batch_size=16, shuffle=True)
    spike_at = 6 * 21 - 1
    for spike, expected in ((1.0, []), (20.0, [spike_at])):
        model, monitor = _UpdateNorms(spike_at, spike), UpdateMonitor(log_every_n_steps=1)
        with caplog.at_level("INFO"):
            pl.Trainer(**trainer_kwargs(callbacks=[monitor], max_epochs=12)).fit(model, data)
        steps = sorted(model.updates)
        assert len(steps) == 21 * 12 and model.sizes[spike_at] == [1]
        updates, batches = [model.updates[s] for s in steps], [model.sizes[s][0] for s in steps]
        plain = flagged_steps(updates, [1.0] * len(steps), 5.0, 0.9, 5)
        assert plain and all(batches[s] == 1 for s in plain)  # what the allowance is for
        allowed = [math.sqrt(16 / b) for b in batches]
        assert flagged_steps(updates, allowed, 5.0, 0.9, 5) == expected
        assert monitor._tracks[0].state.spike_steps == len(expected)
        said = [r.getMessage() for r in caplog.records if "spike at optimizer step" in r.getMessage()]
        caplog.clear()
        assert len(said) == len(expected)
        if expected:
            assert f"step {spike_at}: " in said[0] and "(a batch of 1 examples against the usual 16: " in said[0]


def test_state_survives_a_requeued_fit_and_the_resumed_fit_continues_the_cadence(tmp_path):
    def optimizer(params):
        model_params = list(params)
        return torch.optim.SGD([{"params": model_params[:2], "lr": 0.1}, {"params": model_params[2:], "lr": 0.0}])

    monitor = UpdateMonitor(log_every_n_steps=3)
    trainer, _ = fit(Linear(optimizer=optimizer), [monitor], max_steps=4)
    state = monitor.state_dict()["tracks"]["0"]
    assert state["steps"] == 4 and state["records"]["body"]["measured"] == 2 and state["records"]["head"]["still"] == 2
    trainer.save_checkpoint(tmp_path / "first.ckpt")
    # A requeued job: relaunched from the checkpoint with nothing left to run, it saves again.
    requeued = UpdateMonitor(log_every_n_steps=3)
    trainer, _ = fit(Linear(optimizer=optimizer), [requeued], max_steps=4, ckpt_path=tmp_path / "first.ckpt")
    assert requeued.state_dict() == monitor.state_dict()
    assert any("head" in f for f in requeued.findings())  # the findings' counts carried over
    trainer.save_checkpoint(tmp_path / "second.ckpt")
    resumed = UpdateMonitor(log_every_n_steps=3)
    _, logger = fit(Linear(optimizer=optimizer), [resumed], max_steps=7, ckpt_path=tmp_path / "second.ckpt")
    assert resumed._tracks[0].state.steps == 7
    assert [s for s, _ in logger.series["update/total_ratio"]] == [6]  # the cadence goes on: steps 0, 3, then 6
    assert resumed._tracks[0].state.records["head"]["still"] == 3


def test_hooks_are_removed_at_the_end_of_the_fit():
    model = Linear()
    monitor = UpdateMonitor(log_every_n_steps=1)
    trainer, _ = fit(model, [monitor], max_steps=2)
    assert not trainer.optimizers[0]._optimizer_step_post_hooks


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"grouping": "layer"}, ValueError, "grouping"),
        ({"log_every_n_steps": 0}, ValueError, "log_every_n_steps"),
        ({"usual_ratio": 0.0}, ValueError, "usual_ratio"),
        ({"ratio_factor": 1.0}, ValueError, "ratio_factor"),
        ({"ratio_factor": "100"}, TypeError, "ratio_factor"),
        ({"spike_factor": 1.0}, ValueError, "spike_factor"),
        ({"ema_beta": 1.0}, ValueError, "ema_beta"),
    ],
)
def test_bad_arguments(kwargs, error, name):
    with pytest.raises(error, match=name):
        UpdateMonitor(**kwargs)


def _adam(params):
    return torch.optim.Adam(params, lr=1e-2)  # a module-level function: ddp_spawn pickles the model


class _RecordPerRank(pl.Callback):
    def __init__(self, out_dir):
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        logged = {k: v for k, v in trainer.callback_metrics.items() if k.startswith("update/")}
        with open(f"{self.out_dir}/rank{trainer.global_rank}.json", "w") as f:
            json.dump({k: float(v) for k, v in logged.items()}, f)


@pytest.mark.slow
def test_ddp_ranks_log_identical_values(tmp_path):
    callbacks = [UpdateMonitor(log_every_n_steps=1), _RecordPerRank(str(tmp_path)), ReleaseProcessGroup()]
    trainer = pl.Trainer(**trainer_kwargs(strategy="ddp_spawn", devices=2, callbacks=callbacks, max_steps=3))
    trainer.fit(Linear(optimizer=_adam), loader(regression_data(64), 8))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert "update/ratio/body" in ranks[0] and "update/unit_step_norm/head" in ranks[0]
    assert ranks[0] == pytest.approx(ranks[1], rel=1e-12)


def test_a_measurement_that_fails_warns_and_the_run_goes_on(monkeypatch):
    def broken(before, params):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(update_monitor, "step_change", broken)
    with pytest.warns(UserWarning, match="could not be measured.*no such kernel"):
        trainer, _ = fit(Linear(), [UpdateMonitor(log_every_n_steps=1)], max_steps=3)
    assert trainer.global_step == 3
    strict = UpdateMonitor(log_every_n_steps=1)
    strict.strict = True
    with pytest.raises(RuntimeError, match="could not be measured"):
        fit(Linear(), [strict], max_steps=1)


def test_under_norm_clipping_the_step_is_lr_times_the_clip_and_keeps_the_gradient_direction():
    lr, clip = 0.1, 0.1
    weights = Weights()
    _, logger = fit(Linear(), [UpdateMonitor(log_every_n_steps=1), weights], max_steps=3, gradient_clip_val=clip)
    grads = [weights.norm(weights.grads, s) for s in range(3)]
    assert min(grads) > 2 * clip  # every step was clipped
    expected = [lr * clip * g / (g + 1e-6) for g in grads]  # torch's clip_grad_norm_: clip / (‖g‖ + 1e-6)
    assert logger.values("update/total_norm") == pytest.approx(expected, rel=1e-4)
    for group in ("body", "head"):
        assert logger.values(f"update/grad_cosine/{group}") == pytest.approx([1.0] * 3, abs=1e-5)


def test_under_value_clipping_no_cosine_is_logged():
    _, logger = fit(
        Linear(),
        [UpdateMonitor(log_every_n_steps=1)],
        max_steps=2,
        gradient_clip_val=1e-3,
        gradient_clip_algorithm="value",
    )
    assert "update/norm/body" in logger.series and "update/grad_cosine/body" not in logger.series
