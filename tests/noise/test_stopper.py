"""GradNormEarlyStopping: the noise estimator against closed forms, the stop rules, resume, DDP."""

from __future__ import annotations

import json
import math
import re
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from _models import Classifier, Regressor, ReleaseProcessGroup, loader, regression_data
from conftest import HostReads, RecordingLogger, trainer_kwargs
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainvitals import GradNormEarlyStopping, GradNormMonitor
from trainvitals.plumbing.sharing import StepGradNorms


class LinearRegression(pl.LightningModule):
    """y = x·w* + ε with x ~ N(0, I_d), ε ~ N(0, σ²); per-example loss (x·w − y)².

    With δ = w − w*, the per-example gradient is g = 2x(x·δ − ε), so (Gaussian fourth moments)
    ‖G‖² = 4‖δ‖² and tr(Σ) = E‖g‖² − ‖G‖² = 4((d + 1)‖δ‖² + dσ²), at any w.
    """

    def __init__(self, w0: torch.Tensor, lr: float = 0.0):
        super().__init__()
        self.w = nn.Parameter(w0.clone())
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(x @ self.w, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def converging(d: int) -> LinearRegression:
    """A regression that starts outside its noise band (‖G‖² = 4‖δ‖² = 10 against tr Σ/B ≈ 0.7) and falls into it:
    a band held from the start is no stop (test_a_run_noise_dominated_from_step_0_is_not_stopped)."""
    return LinearRegression(torch.full((d,), 0.5), lr=0.02)


def regression_stream(steps: int, batch: int, d: int, w_star: torch.Tensor, sigma: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps * batch, d, generator=g)
    y = x @ w_star + sigma * torch.randn(steps * batch, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


def test_noise_estimates_match_the_closed_form_over_200_steps():
    d, sigma, micro, accumulate, steps = 10, 1.0, 16, 4, 200
    w_star = torch.zeros(d)
    w0 = torch.full((d,), 0.5)  # ‖δ‖² = 2.5
    truth_grad_sq = 4 * 2.5
    truth_trace = 4 * ((d + 1) * 2.5 + d * sigma**2)

    class Record(pl.Callback):
        def __init__(self):
            self.grad_sq, self.trace = [], []

        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step > len(self.trace):  # once per optimizer step, not per micro-batch
                self.grad_sq.append(stopper.noise.grad_sq_norm.item())
                self.trace.append(stopper.noise.trace_cov.item())

    stopper, record = GradNormEarlyStopping(patience=10**6), Record()
    trainer = Trainer(**trainer_kwargs(callbacks=[stopper, record], max_epochs=1, accumulate_grad_batches=accumulate))
    trainer.fit(LinearRegression(w0), regression_stream(steps * accumulate, micro, d, w_star, sigma))
    assert trainer.global_step == steps and stopper.effective_batch_size == micro * accumulate
    # Once the EMA has a full memory (~50 steps), every smoothed estimate is within 10% of the truth.
    grad_sq, trace = torch.tensor(record.grad_sq[100:]), torch.tensor(record.trace[100:])
    assert len(trace) == 100
    assert (grad_sq / truth_grad_sq - 1).abs().max() < 0.10
    assert (trace / truth_trace - 1).abs().max() < 0.10
    floor = stopper.noise.noise_floor(64).item()
    assert floor == pytest.approx(math.sqrt(truth_trace / 64), rel=0.05)


def _fit(model, callbacks, data, logger=False, **overrides):
    trainer = Trainer(**trainer_kwargs(callbacks=callbacks, logger=logger, **overrides))
    trainer.fit(model, data)
    return trainer


def test_noise_band_stops_at_the_optimum_and_not_far_from_it(caplog):
    d = 10
    at_optimum = GradNormEarlyStopping(patience=5, min_steps=20, margin=0.2, check_every_n_steps=1)
    logger = RecordingLogger()
    with caplog.at_level("INFO"):
        trainer = _fit(
            converging(d),
            [at_optimum],
            regression_stream(1200, 16, d, torch.zeros(d), 1.0),
            logger=logger,
            max_epochs=1,
            accumulate_grad_batches=4,
            log_every_n_steps=1,
        )
    assert at_optimum.stopped_step is not None and at_optimum.stopped_step >= 20 + 5 - 1
    assert trainer.global_step == at_optimum.stopped_step + 1
    assert sum("noise band" in r.message for r in caplog.records) == 1
    floors = logger.values("grad_norm/noise_floor")
    assert floors and all(math.isfinite(v) for v in floors)
    assert floors[-1] == pytest.approx(math.sqrt(4 * d / 64), rel=0.15)  # tr Σ = 4dσ² at δ = 0
    assert set(logger.values("grad_norm/held_from_start")) == {0.0}  # out of the band first: no hold

    far = GradNormEarlyStopping(patience=5, min_steps=20, margin=0.2, check_every_n_steps=1)
    trainer = _fit(
        LinearRegression(torch.full((d,), 0.5)),
        [far],
        regression_stream(400, 16, d, torch.zeros(d), 1.0),
        max_epochs=1,
        accumulate_grad_batches=4,
    )
    assert far.stopped_step is None and trainer.global_step == 100


def test_the_lr_advice_after_a_stop_on_the_band_says_what_its_batch_advice_means():
    """The stop and the advice at one step: in the band ‖G‖² ≤ δ·tr(Σ)/B, i.e. B_simple ≥ B/δ, so "below B_simple" is
    what the stop means; the advisor's end report and fit-end line say so once, with the stop's step and B/δ."""
    from trainvitals import LRScalingAdvisor

    d, margin = 10, 0.2
    stopper = GradNormEarlyStopping(patience=5, min_steps=20, margin=margin, check_every_n_steps=1)
    advisor = LRScalingAdvisor(detect_loss_reduction=False, verbose=False)
    _fit(
        converging(d),
        [stopper, advisor],
        regression_stream(1200, 16, d, torch.zeros(d), 1.0),
        max_epochs=1,
        accumulate_grad_batches=4,
    )
    assert stopper.stopped_step is not None and stopper.band_entries() == [(stopper.stopped_step, "stop", margin)]
    said = (
        f"the run stopped in its noise band at optimizer step {stopper.stopped_step} (where its point estimate "
        f"read ‖G‖² ≤ 0.2·tr(Σ)/B, B_simple ≥ B/0.2 = {64 / margin:.4g}): a batch below B_simple is what the band "
        "means, not a sign the run should have gone on at this batch; to go further, take a larger batch at the same "
        "lr, SGD's 0.02, or a lower lr"
    )
    assert f"- **batch advice and the band**: {said}\n" in advisor.summary_markdown()
    assert advisor.summary_line().endswith(f"or trainvitals report. {said[0].upper()}{said[1:]}.")


def test_the_charts_end_at_the_stop_and_hold_no_infinite_value():
    """Logging every 50 steps, a stop between two logging steps is still on the charts — the streak at
    its patience, the monitor's last norm — and B_simple is left out while EMA(‖G‖²) ≤ 0 (at the
    optimum it often is), not logged as inf."""
    d, logger = 10, RecordingLogger()
    stopper = GradNormEarlyStopping(patience=5, min_steps=20, margin=0.2, check_every_n_steps=1)
    _fit(
        converging(d),
        [GradNormMonitor(), stopper],
        regression_stream(1200, 16, d, torch.zeros(d), 1.0),
        logger=logger,
        max_epochs=1,
        accumulate_grad_batches=4,
        log_every_n_steps=50,
    )
    stop = stopper.stopped_step
    assert stop is not None and stop % 50 != 0
    assert logger.series["grad_norm/band_streak"][-1] == (stop, 5)
    assert logger.series["grad_norm/total"][-1][0] == stop
    assert all(math.isfinite(v) for values in logger.series.values() for _, v in values)


def test_the_stop_says_the_streak_grad_norm_band_streak_logs():
    """A fresh user's stop said "for 10 consecutive steps" while ``grad_norm/band_streak`` read 19 at the stop: the
    host reads the streak every ``check_every_n_steps``, so it runs past its patience before the stop. The stop
    says the logged streak, what it counts and how often it is read; a streak broken between two checks (the stop
    is still due) says its patience and the streak at the stop."""
    d, logger = 10, RecordingLogger()
    stopper = GradNormEarlyStopping(patience=5, min_steps=20, margin=0.2, check_every_n_steps=10, verbose=False)
    _fit(
        converging(d),
        [stopper],
        regression_stream(1200, 16, d, torch.zeros(d), 1.0),
        logger=logger,
        max_epochs=1,
        accumulate_grad_batches=4,
        log_every_n_steps=50,
    )
    step, streak = logger.series["grad_norm/band_streak"][-1]
    assert step == stopper.stopped_step and streak == stopper.stopped_streak > 5  # 13: past its patience
    said = stopper.describe_stop()
    assert (
        f"for its last {streak:.0f} counted optimizer steps in a row (grad_norm/band_streak; its patience 5, " in said
    )
    assert "the streak read every 10 steps), after it had been out of the band." in said, said
    stopper.stopped_streak = 3
    assert (
        "for its patience of 5 counted optimizer steps in a row, a streak broken before the check that stopped it "
        "(grad_norm/band_streak 3 at the stop; the streak read every 10 steps)" in stopper.describe_stop()
    )


def test_without_a_noise_source_it_says_so_once_logs_no_nan_and_never_stops():
    logger = RecordingLogger()
    stopper = GradNormEarlyStopping(patience=1, margin=1e9, min_steps=0)
    with pytest.warns(UserWarning, match="no noise source.*accumulate_grad_batches >= 2") as record:
        trainer = _fit(
            Regressor(),
            [stopper, GradNormMonitor(log_every_n_steps=1)],
            loader(regression_data(), 8),
            logger=logger,
            max_epochs=3,
            log_every_n_steps=1,
        )
    assert sum("no noise source" in str(w.message) for w in record) == 1
    assert trainer.global_step == 24 and stopper.stopped_step is None
    assert "grad_norm/noise_floor" not in logger.series
    assert all(math.isfinite(v) for values in logger.series.values() for _, v in values)


def test_threshold_mode_counts_patience_in_optimizer_steps():
    stopper = GradNormEarlyStopping(mode="threshold", threshold=1e9, patience=6, min_steps=0, check_every_n_steps=1)
    trainer = _fit(Regressor(), [stopper], loader(regression_data(), 8), max_epochs=5, accumulate_grad_batches=2)
    assert stopper.stopped_step == 5 and trainer.global_step == 6
    # The Trainer's own min_steps holds the run: the stop is where the run actually stops.
    held = GradNormEarlyStopping(mode="threshold", threshold=1e9, patience=3, min_steps=0, check_every_n_steps=1)
    trainer = _fit(Regressor(), [held], loader(regression_data(), 8), max_epochs=5, min_steps=13)
    assert held.stopped_step == 12 and trainer.global_step == 13
    never = GradNormEarlyStopping(mode="threshold", threshold=1e-12, patience=1)
    trainer = _fit(Regressor(), [never], loader(regression_data(), 8), max_epochs=2)
    assert never.stopped_step is None and trainer.global_step == 16


def test_relative_mode_stops_when_the_norm_has_fallen_below_a_fraction_of_its_early_value():
    d = 5
    # Noise-free regression: gradient descent shrinks the gradient geometrically.
    stopper = GradNormEarlyStopping(
        mode="relative", fraction=0.01, reference_steps=3, patience=2, min_steps=0, check_every_n_steps=1
    )
    trainer = _fit(
        LinearRegression(torch.ones(d), lr=0.1),
        [stopper],
        regression_stream(300, 32, d, torch.zeros(d), 0.0),
        max_epochs=1,
    )
    assert stopper.stopped_step is not None and 10 < trainer.global_step < 300


@pytest.mark.parametrize("order", ["monitor first", "stopper first", "stopper alone"])
def test_with_a_monitor_the_stopper_reads_its_total_instead_of_measuring_again(order, monkeypatch):
    calls = []
    measure = StepGradNorms._take  # a pass over the gradients
    monkeypatch.setattr(StepGradNorms, "_take", lambda *a, **k: calls.append(1) or measure(*a, **k))
    d = 5
    stopper = GradNormEarlyStopping(
        mode="relative", fraction=0.01, reference_steps=3, patience=2, min_steps=0, check_every_n_steps=1
    )
    monitor = GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0)
    callbacks = {"monitor first": [monitor, stopper], "stopper first": [stopper, monitor], "stopper alone": [stopper]}
    trainer = _fit(
        LinearRegression(torch.ones(d), lr=0.1),
        callbacks[order],
        regression_stream(300, 32, d, torch.zeros(d), 0.0),
        max_epochs=1,
    )
    # the same decision as measuring alone (noise-free descent: the norm falls below 1% at a fixed step)
    assert stopper.stopped_step == 23 and trainer.global_step == 24
    assert len(calls) == trainer.global_step  # one pass a step, whoever asks first


def test_without_a_monitor_the_stopper_and_the_probe_share_one_norm_per_step(monkeypatch):
    """Both ask for ‖.grad‖² over the same trainable parameters at each step: one fused pass, and both get
    the norm of that step's gradient (brute force), not an earlier one's."""
    from trainvitals import BatchVarianceProbe

    taken, seen = [], []
    measure, ask = StepGradNorms._take, StepGradNorms.sq_norm

    def counted(self, trainer, optimizer, params, norm_type):
        taken.append(trainer.global_step)
        return measure(self, trainer, optimizer, params, norm_type)

    def asked(self, trainer, optimizer, params):
        value = ask(self, trainer, optimizer, params)
        brute = sum(p.grad.double().square().sum() for p in params if p.grad is not None)
        seen.append((trainer.global_step, float(value), float(brute)))
        return value

    monkeypatch.setattr(StepGradNorms, "_take", counted)
    monkeypatch.setattr(StepGradNorms, "sq_norm", asked)
    probe = BatchVarianceProbe(histogram_every_n_steps=0)
    stopper = GradNormEarlyStopping(min_steps=0, check_every_n_steps=4)
    trainer = _fit(Regressor(autocast=False), [probe, stopper], loader(regression_data(n=8 * 12), 8), max_epochs=1)
    assert trainer.global_step == 12 and taken == list(range(12))
    assert [step for step, _, _ in seen] == [step for step in range(12) for _ in range(2)]
    for _, value, brute in seen:
        assert value == pytest.approx(brute, rel=1e-5)  # float32 gradients


def test_skipped_amp_steps_do_not_count_toward_convergence():
    from lightning.pytorch.plugins.precision import MixedPrecision

    def stop_step(inf_at_step):
        stopper = GradNormEarlyStopping(mode="threshold", threshold=1e9, patience=4, min_steps=0, check_every_n_steps=1)
        _fit(
            Regressor(autocast=False, inf_at_step=inf_at_step),
            [stopper],
            loader(regression_data(), 8),
            max_epochs=2,
            plugins=[MixedPrecision("16-mixed", "cpu")],
        )
        return stopper.stopped_step

    assert stop_step(None) == 3
    assert stop_step(1) == 4


def test_state_round_trips_through_a_checkpoint(tmp_path):
    d = 10

    def run(epochs, callbacks, ckpt_path=None):
        # One epoch = 20 optimizer steps of 2 × 16 examples; resuming at an epoch boundary replays the same data.
        model = LinearRegression(torch.full((d,), 0.3), lr=0.01)
        trainer = Trainer(
            **trainer_kwargs(
                callbacks=callbacks,
                max_epochs=epochs,
                accumulate_grad_batches=2,
                enable_checkpointing=True,
                default_root_dir=tmp_path,
            )
        )
        trainer.fit(model, regression_stream(40, 16, d, torch.zeros(d), 1.0), ckpt_path=ckpt_path)

    straight = GradNormEarlyStopping(patience=10**6)
    run(2, [straight])
    first = GradNormEarlyStopping(patience=10**6)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    run(1, [first, checkpoint])
    assert first.steps == 20
    resumed = GradNormEarlyStopping(patience=10**6)
    run(2, [resumed], ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert resumed.steps == straight.steps == 40
    assert resumed.noise.count.item() == straight.noise.count.item()
    assert resumed.noise.grad_sq_norm.item() == pytest.approx(straight.noise.grad_sq_norm.item(), rel=1e-6)
    assert resumed.noise.trace_cov.item() == pytest.approx(straight.noise.trace_cov.item(), rel=1e-6)
    assert int(resumed._streak) == int(straight._streak)


def _stopping(**overrides):
    return GradNormEarlyStopping(
        **{**dict(mode="threshold", threshold=1e9, patience=6, min_steps=0, check_every_n_steps=1), **overrides}
    )


def _summary_rows(stopper):
    return dict(line.strip("| ").split(" | ", 1) for line in stopper.summary_markdown().splitlines()[2:])


def test_a_streak_past_the_patience_reads_as_reached():
    """The host reads the streak every 5 steps: with patience 2 it stands at 5 at the stop (step 4)."""
    stopper = _stopping(patience=2, check_every_n_steps=5)
    _fit(Regressor(), [stopper], loader(regression_data(), 8), max_epochs=1)
    assert stopper.stopped_step == 4 and int(stopper._streak) == 5
    assert _summary_rows(stopper)["in-condition streak"] == "reached 2 (5 steps in a row)"


@pytest.mark.parametrize("how", ["model_checkpoint", "save_checkpoint"])
def test_a_fit_resumed_after_the_stop_stops_again(tmp_path, caplog, how):
    """8 optimizer steps an epoch; the stop at step 5 ends epoch 0 after 6 steps. A checkpoint written then
    (ModelCheckpoint's last.ckpt at that epoch's end, or trainer.save_checkpoint after the fit), resumed
    with the same arguments, ends the fit before its first step, and the summary says what happened."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    first = _stopping()
    trainer = _fit(
        Regressor(),
        [first, checkpoint] if how == "model_checkpoint" else [first],
        loader(regression_data(), 8),
        max_epochs=5,
        enable_checkpointing=how == "model_checkpoint",
    )
    assert first.stopped_step == 5 and trainer.global_step == 6
    path = tmp_path / "last.ckpt"
    if how == "save_checkpoint":
        trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=False)["callbacks"][first.state_key]["stop_reason"] == "THRESHOLD"

    resumed = _stopping()
    with caplog.at_level("INFO"):
        trainer = Trainer(**trainer_kwargs(callbacks=[resumed], max_epochs=5))
        trainer.fit(Regressor(), loader(regression_data(), 8), ckpt_path=path)
    assert trainer.global_step == 6 and trainer.should_stop
    assert resumed.stopped_step == 5 and resumed.stopped_again_step == 6 and resumed.steps == 6
    assert "stopping again" in caplog.text
    rows = _summary_rows(resumed)
    assert rows["stop"].startswith("stopped at optimizer step 5 (after 6 steps)")
    assert "stopped again at its start (optimizer step 6)" in rows["stop"]
    assert rows["optimizer steps seen"] == "6"
    assert rows["in-condition streak"] == f"{int(resumed._streak)} of 6 steps" and int(resumed._streak) == 6

    # Other arguments are another stopper (another state_key): it starts afresh and trains on.
    changed = _stopping(patience=100)
    trainer = Trainer(**trainer_kwargs(callbacks=[changed], max_epochs=5))
    trainer.fit(Regressor(), loader(regression_data(), 8), ckpt_path=path)
    assert changed.stopped_step is None and changed.stopped_again_step is None
    assert trainer.global_step == 6 + 4 * 8  # epochs 1–4 after the short epoch 0
    # A fresh fit of the stopped instance starts afresh as well.
    trainer = _fit(Regressor(), [resumed], loader(regression_data(), 8), max_epochs=5)
    assert resumed.stopped_again_step is None and resumed.stopped_step == 5 and trainer.global_step == 6


@pytest.mark.parametrize(
    ("kwargs", "fit_kwargs", "earliest"),
    [
        (dict(min_steps=100, patience=30), dict(max_steps=50), 130),
        (dict(min_steps=10, patience=5, check_every_n_steps=10), dict(max_steps=19), 20),  # read at step 20 only
        (
            dict(mode="relative", min_steps=0, reference_steps=12, patience=4),
            dict(max_epochs=1),
            16,
        ),  # 8 steps an epoch
    ],
)
def test_says_once_when_the_fit_is_too_short_for_it_to_stop(kwargs, fit_kwargs, earliest):
    stopper = GradNormEarlyStopping(**{"mode": "threshold", "check_every_n_steps": 1, **kwargs})
    with pytest.warns(UserWarning, match=f"cannot stop before {earliest} ") as record:
        _fit(Regressor(), [stopper], loader(regression_data(), 8), **fit_kwargs)
    assert sum("cannot stop before" in str(w.message) for w in record) == 1


def test_the_summary_table_says_why_it_did_not_stop():
    """The end-of-fit table's stop row gives the reason, as the fit-end line does: a run shorter than min_steps."""
    stopper = GradNormEarlyStopping(mode="threshold", threshold=1e9, min_steps=100, patience=5, check_every_n_steps=1)
    with pytest.warns(UserWarning, match="cannot stop before"):
        _fit(Regressor(), [stopper], loader(regression_data(), 8), max_steps=6)
    stop = _summary_rows(stopper)["stop"]
    assert stop == f"GradNormEarlyStopping {stopper.summary_line()}"
    assert "did not stop the run: the run ended after 6 optimizer steps, before min_steps=100" in stop


def test_no_such_word_when_the_fit_is_long_enough(recwarn):
    stopper = GradNormEarlyStopping(mode="threshold", threshold=1e9, min_steps=10, patience=5, check_every_n_steps=5)
    trainer = _fit(Regressor(), [stopper], loader(regression_data(), 8), max_steps=15)
    assert stopper.stopped_step == 14 and trainer.global_step == 15  # the earliest stop is the last step: it fires
    assert not [w for w in recwarn if "cannot stop before" in str(w.message)]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"mode": "plateau"}, "mode"),
        ({"margin": -0.1}, "margin"),
        ({"patience": 0}, "patience"),
        ({"min_steps": -1}, "min_steps"),
        ({"threshold": 0}, "threshold"),
        ({"fraction": 1.0}, "fraction"),
        ({"reference_steps": 0}, "reference_steps"),
        ({"ema_beta": 1.0}, "ema_beta"),
        ({"check_every_n_steps": 0}, "check_every_n_steps"),
    ],
)
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        GradNormEarlyStopping(**kwargs)


class _RecordPerRank(pl.Callback):
    """Writes each rank's per-step totals and its stop to ``<dir>/rank<k>.json``."""

    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.totals = []

    def on_train_batch_end(self, trainer, pl_module, *args):
        monitor = next(cb for cb in trainer.callbacks if isinstance(cb, GradNormMonitor))
        self.totals.append(monitor.last_total[0].item())

    def on_train_end(self, trainer, pl_module):
        stopper = next(cb for cb in trainer.callbacks if isinstance(cb, GradNormEarlyStopping))
        with open(f"{self.out_dir}/rank{trainer.global_rank}.json", "w") as f:
            json.dump(
                {
                    "totals": self.totals,
                    "stopped_step": stopper.stopped_step,
                    "global_step": trainer.global_step,
                    "batch": stopper.effective_batch_size,
                    "stopped_again_step": stopper.stopped_again_step,
                    "steps": stopper.steps,
                    "summary": stopper.summary_markdown(),
                },
                f,
            )


@pytest.mark.slow
def test_ddp_ranks_agree_on_norms_and_stop_at_the_same_step(tmp_path):
    d = 10
    callbacks = [
        GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0),
        GradNormEarlyStopping(patience=3, margin=0.5, min_steps=10, check_every_n_steps=1),
        _RecordPerRank(str(tmp_path)),
        ReleaseProcessGroup(),
    ]
    trainer = Trainer(
        **trainer_kwargs(strategy="ddp_spawn", devices=2, callbacks=callbacks, max_epochs=1, log_every_n_steps=1)
    )
    trainer.fit(converging(d), regression_stream(800, 16, d, torch.zeros(d), 1.0))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["totals"] == pytest.approx(ranks[1]["totals"], rel=1e-6)
    assert ranks[0]["stopped_step"] is not None
    assert ranks[0]["stopped_step"] == ranks[1]["stopped_step"] and ranks[0]["global_step"] == ranks[1]["global_step"]
    assert ranks[0]["batch"] == 32  # 2 ranks × 16


def test_the_ranks_step_shape_is_copied_to_the_device_only_when_it_changes():
    """Under DDP each step all-reduces (usable, micro-batches, micro-batch size): the same values reuse one
    device tensor instead of a host-to-device copy per step; new ones (an epoch's short last window) are new."""
    stopper = GradNormEarlyStopping()
    shape, square = stopper._step_shape((1.0, 4.0, 16.0), torch.device("cpu"))
    assert shape.tolist() == [1.0, 4.0, 16.0] and square.tolist() == [1.0, 16.0, 256.0]
    again = stopper._step_shape((1.0, 4.0, 16.0), torch.device("cpu"))
    assert again[0] is shape and again[1] is square
    short = stopper._step_shape((1.0, 3.0, 16.0), torch.device("cpu"))
    assert short[0] is not shape and short[0].tolist() == [1.0, 3.0, 16.0] and short[1].tolist() == [1.0, 9.0, 256.0]


@pytest.mark.slow
def test_ddp_a_fit_resumed_after_the_stop_stops_again_on_every_rank(tmp_path):
    d = 10

    def run(name, ckpt_path=None):
        out = tmp_path / name
        out.mkdir()
        callbacks = [
            GradNormMonitor(histogram_every_n_steps=0),
            GradNormEarlyStopping(mode="threshold", threshold=1e9, patience=4, min_steps=0, check_every_n_steps=1),
            ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True),
            _RecordPerRank(str(out)),
            ReleaseProcessGroup(),
        ]
        trainer = Trainer(
            **trainer_kwargs(
                strategy="ddp_spawn", devices=2, callbacks=callbacks, max_epochs=3, enable_checkpointing=True
            )
        )
        trainer.fit(
            LinearRegression(torch.zeros(d), lr=0.01),
            regression_stream(40, 16, d, torch.zeros(d), 1.0),
            ckpt_path=ckpt_path,
        )
        return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]

    first = run("first")
    assert [r["stopped_step"] for r in first] == [3, 3] and [r["global_step"] for r in first] == [4, 4]
    resumed = run("resumed", ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    for rank in resumed:
        assert rank["global_step"] == 4 and rank["stopped_step"] == 3 and rank["stopped_again_step"] == 4
        assert rank["steps"] == 4 and rank["totals"] == []  # not one more step
        assert "stopped again at its start (optimizer step 4)" in rank["summary"]


class _ZeroGradientBetween(Regressor):
    """The gradient is exactly zero on optimizer steps ``first``..``last``, normal elsewhere."""

    def __init__(self, first: int, last: int):
        super().__init__()
        self.first, self.last = first, last

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * 0.0 if self.first <= self.global_step <= self.last else loss


def test_a_streak_completed_between_two_checks_still_stops_the_run():
    stopper = GradNormEarlyStopping(mode="threshold", threshold=1e-9, patience=5, min_steps=0, check_every_n_steps=10)
    trainer = _fit(_ZeroGradientBetween(12, 16), [stopper], loader(regression_data(), 8), max_epochs=5)
    assert stopper.stopped_step == 19 and trainer.global_step == 20


def test_the_same_instance_starts_afresh_on_a_new_fit():
    stopper = GradNormEarlyStopping(mode="threshold", threshold=1e9, patience=3, min_steps=0, check_every_n_steps=1)
    for _ in range(2):
        trainer = _fit(Regressor(), [stopper], loader(regression_data(), 8), max_epochs=2)
        assert stopper.stopped_step == 2 and trainer.global_step == 3 and stopper.steps == 3


def test_noise_source_follows_a_gradient_accumulation_scheduler(recwarn):
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    d = 10
    stopper = GradNormEarlyStopping(patience=10**6)
    _fit(
        LinearRegression(torch.full((d,), 0.5)),
        [GradientAccumulationScheduler({0: 4}), stopper],
        regression_stream(80, 16, d, torch.zeros(d), 1.0),
        max_epochs=1,
    )
    assert not [w for w in recwarn if "no noise source" in str(w.message)]
    assert stopper.noise.count.item() == 20 and stopper.effective_batch_size == 64


def test_a_ragged_last_window_is_left_out_of_the_estimate():
    d = 10
    stopper = GradNormEarlyStopping(patience=10**6)
    # 150 examples in micro-batches of 16: 9 full micro-batches and one of 6; windows of 4 → 16,16,16,16 | ... | 16,6
    x = torch.randn(150, d)
    data = DataLoader(TensorDataset(x, x @ torch.ones(d)), batch_size=16)
    trainer = _fit(LinearRegression(torch.zeros(d)), [stopper], data, max_epochs=1, accumulate_grad_batches=4)
    assert trainer.global_step == 3
    assert stopper.noise.count.item() == 2 and stopper.effective_batch_size == 64


def test_a_short_last_window_is_measured_at_its_size_and_judged_at_the_full_batch():
    """160 examples in micro-batches of 16, windows of 4: 4, 4 and a last window of 2 full micro-batches. Its
    estimate counts (n = 2, b = 16), but the band stays judged at the batch of a whole step, 64."""
    d = 10
    stopper = GradNormEarlyStopping(patience=10**6)
    x = torch.randn(160, d)
    data = DataLoader(TensorDataset(x, x @ torch.ones(d)), batch_size=16)
    trainer = _fit(LinearRegression(torch.zeros(d)), [stopper], data, max_epochs=1, accumulate_grad_batches=4)
    assert trainer.global_step == 3
    assert stopper.noise.count.item() == 3 and stopper.effective_batch_size == 64


def test_fused_optimizer_under_a_grad_scaler_is_measured_unscaled():
    from lightning.pytorch.plugins.precision import MixedPrecision

    class FusedAdam(LinearRegression):
        def training_step(self, batch, batch_idx):
            with torch.autocast("cpu", enabled=False):  # only the loss scaling differs between the runs
                return super().training_step(batch, batch_idx)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3, fused=True)

    d, results = 10, []
    for plugins in ([], [MixedPrecision("16-mixed", "cpu")]):
        stopper, monitor = GradNormEarlyStopping(patience=10**6), GradNormMonitor(log_every_n_steps=1)
        _fit(
            FusedAdam(torch.full((d,), 0.5)),
            [monitor, stopper],
            regression_stream(40, 16, d, torch.zeros(d), 1.0),
            max_epochs=1,
            accumulate_grad_batches=4,
            plugins=plugins,
        )
        results.append(
            (monitor.last_total[0].item(), stopper.noise.grad_sq_norm.item(), stopper.noise.trace_cov.item())
        )
    assert results[1] == pytest.approx(results[0], rel=1e-4)


# ---------------------------------------------------------------- the run's one estimate, on models outside the closed forms
def _batchnorm_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def _images(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    return TensorDataset(x, (x[:, 0, :4].sum((1, 2)) > 0).long() + (x[:, 0, 4:].sum((1, 2)) > 2).long())


def _caveats(record) -> list[str]:
    return [str(w.message) for w in record if "cannot decide" in str(w.message)]


def test_a_batchnorm_cnn_on_one_device_is_not_stopped_by_a_broken_estimate():
    """Per-example gradients through BatchNorm are coupled (their ‖G‖² estimate is negative at every
    step): the probe's source is invalid, nothing else measures, so no band stop, and one message."""
    from trainvitals import BatchVarianceProbe

    probe, stopper = BatchVarianceProbe(), GradNormEarlyStopping(min_steps=0, patience=5)
    logger = RecordingLogger()
    with pytest.warns(UserWarning) as record:
        trainer = _fit(
            Classifier(_batchnorm_cnn(), lr=0.05),
            [probe, stopper],
            DataLoader(_images(16 * 300), batch_size=16),
            logger=logger,
            max_epochs=1,
            log_every_n_steps=10,
        )
    assert trainer.global_step == 300 and stopper.stopped_step is None
    (caveat,) = _caveats(record)
    assert "no valid noise source" in caveat and "BatchNorm" in caveat and "accumulate_grad_batches >= 2" in caveat
    assert probe.noise_source.invalid and float(probe.noise.grad_sq_norm) < 0  # what the stop would have read
    assert "grad_norm/in_noise_band" not in logger.series and "grad_norm/noise_floor" not in logger.series


def test_a_batchnorm_cnn_with_accumulation_is_decided_by_the_micro_batches():
    from trainvitals import BatchVarianceProbe

    probe = BatchVarianceProbe(histogram_every_n_steps=0)
    stopper = GradNormEarlyStopping(min_steps=0, patience=5, margin=1e9, check_every_n_steps=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _fit(
            Classifier(_batchnorm_cnn(), lr=0.05),
            [probe, stopper],
            DataLoader(_images(16 * 4 * 40), batch_size=16),
            max_epochs=1,
            accumulate_grad_batches=4,
            log_every_n_steps=1,
        )
    assert not _caveats(record) and not probe.noise_source.invalid
    assert not probe._plan.per_example and "measured from micro-batches and ranks" in probe.sources
    summary = stopper.gradient_noise.host_summary()
    # The probe's micro-batch estimator is the stopper's on the same gradients: counted once.
    assert summary["decisive"] and summary["sources"] == ("micro_batch",)
    markdown = stopper.summary_markdown()  # one line of sources, the estimate's
    assert markdown.count("noise source") == 1 and "| noise sources | " in markdown
    # Decisive from its 20th measurement (step 19), then in the band for its patience without ever having been out
    # of it: noise from step 0, said once, with the batch to use, and no stop.
    assert stopper.stopped_step is None
    assert "in its noise band from the start" in stopper.from_start and "the batch (64)" in stopper.from_start
    assert re.search(r"(?i)a batch of at least \d+", stopper.from_start) and "not convergence" in stopper.from_start
    assert "noise band from the start" in stopper.summary_line()


class _Attention(nn.Module):
    def __init__(self, vocab: int = 12, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        # add_bias_kv keeps attention (most of the parameters) from per-example norms: a partly measured model.
        self.attention = nn.MultiheadAttention(dim, 2, batch_first=True, add_bias_kv=True)
        self.head = nn.Linear(dim, 3)

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.head(self.attention(h, h, h, need_weights=False)[0].mean(1))


def _tokens(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 12, (n, 6), generator=g)
    return TensorDataset(tokens, tokens[:, 0] % 3)


def test_a_partly_measured_model_gets_no_band_stop_and_no_noise_aware_advice():
    from trainvitals import BatchVarianceProbe, LRScalingAdvisor

    probe = BatchVarianceProbe(histogram_every_n_steps=0)
    stopper = GradNormEarlyStopping(min_steps=0, patience=5, margin=1e9, check_every_n_steps=1)
    advisor, logger = LRScalingAdvisor(verbose=False, detect_loss_reduction=False), RecordingLogger()
    with pytest.warns(UserWarning) as record:
        trainer = _fit(
            Classifier(_Attention(), lr=0.05),
            [GradNormMonitor(), probe, stopper, advisor],
            DataLoader(_tokens(16 * 30), batch_size=16),
            logger=logger,
            max_epochs=1,
            log_every_n_steps=5,
        )
    assert trainer.global_step == 30 and stopper.stopped_step is None
    (caveat,) = _caveats(record)
    summary = stopper.gradient_noise.host_summary()
    assert caveat.count("partial: the estimate covers") == 1 and summary["coverage"] < 0.9
    assert summary["param_share"] < 0.5
    assert "not used (partial" in advisor.summary_markdown() and "noise-aware" not in advisor.summary_markdown()
    # Like with like: the floor of the measured part goes beside the norm of the measured part.
    (step, measured), (_, total) = logger.series["grad_norm/measured_total"][-1], logger.series["grad_norm/total"][-1]
    assert step == 25 and 0 < measured < total and "grad_norm/in_noise_band" not in logger.series

    probe = BatchVarianceProbe(histogram_every_n_steps=0)
    stopper = GradNormEarlyStopping(min_steps=0, patience=5, margin=1e9, check_every_n_steps=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _fit(
            Classifier(_Attention(), lr=0.05),
            [probe, stopper],
            DataLoader(_tokens(16 * 2 * 30), batch_size=16),
            max_epochs=1,
            accumulate_grad_batches=2,
            log_every_n_steps=5,
        )
    summary = stopper.gradient_noise.host_summary()
    assert not _caveats(record) and summary["coverage"] == pytest.approx(1.0) and summary["param_share"] == 1.0
    # Decisive (margin 1e9: in the band from its first decided step): said, and no stop on noise from step 0.
    assert stopper.stopped_step is None and "noise band from the start" in stopper.from_start


def test_no_host_sync_on_steps_that_log_nothing(monkeypatch):
    """Between logging and check steps, the stopper and the probe feeding the one estimate never read a
    tensor on the host (counted on CPU by wrapping Tensor's host reads inside their hooks)."""
    from trainvitals import BatchVarianceProbe

    probe = BatchVarianceProbe(histogram_every_n_steps=0, per_coordinate=False)
    stopper = GradNormEarlyStopping(min_steps=0, check_every_n_steps=8)
    host = HostReads(monkeypatch)
    for callback in (probe, stopper):
        host.watch(
            callback,
            (
                "on_train_batch_start",
                "on_before_backward",
                "on_after_backward",
                "on_before_optimizer_step",
                "on_train_batch_end",
            ),
        )
    for accumulate in (1, 2):
        host.reads.clear()
        _fit(
            Regressor(autocast=False),
            [probe, stopper],
            loader(regression_data(n=8 * 2 * 17), 8),
            max_epochs=1,
            accumulate_grad_batches=accumulate,
            log_every_n_steps=8,
        )
        # Logging steps 0, 8, 16 and the checks after every 8th step may read; ``global_step`` is one ahead
        # of the step at on_train_batch_end.
        quiet = [(step, what) for step, what in host.reads if step % 8 not in (0, 1)]
        assert quiet == [], (accumulate, quiet[:5])


def test_what_would_make_it_measurable_names_only_what_applies():
    from trainvitals.noise.stopper import measurable_by

    said = measurable_by(torch.nn.Linear(2, 2), probe=True)
    assert "accumulate_grad_batches >= 2" in said and "BatchNorm" not in said and "BatchVarianceProbe" not in said
    frozen = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)).eval()
    assert "BatchNorm" not in measurable_by(frozen, probe=False)
    said = measurable_by(frozen.train(), probe=False)
    assert "instead of BatchNorm" in said and ", or a BatchVarianceProbe" in said
    # A probe is attached but BatchNorm in training mode makes its per-example source invalid: said, not advised.
    said = measurable_by(frozen, probe=True)
    assert said.startswith(
        "the attached BatchVarianceProbe's per-example source is invalid here (BatchNorm in "
        "training mode); measurable with accumulate_grad_batches >= 2"
    )
    assert "instead of BatchNorm" in said and ", or a BatchVarianceProbe" not in said
    assert measurable_by(frozen, probe=True, say_probe=False).startswith("measurable with accumulate_grad_batches >= 2")


def test_a_noise_band_stop_resumed_still_names_its_estimate(tmp_path):
    """Resumed after a stop on the band, no batch runs: the summary still names the restored estimate and
    its sources, not "no noise source"."""
    d = 10
    first = GradNormEarlyStopping(patience=5, min_steps=20, margin=0.2, check_every_n_steps=1, verbose=False)
    trainer = _fit(
        converging(d),
        [first],
        regression_stream(1200, 16, d, torch.zeros(d), 1.0),
        max_epochs=1,
        accumulate_grad_batches=4,
    )
    assert first.stopped_step is not None
    path = tmp_path / "stopped.ckpt"
    trainer.save_checkpoint(path)
    resumed = GradNormEarlyStopping(patience=5, min_steps=20, margin=0.2, check_every_n_steps=1, verbose=False)
    Trainer(**trainer_kwargs(callbacks=[resumed], logger=False, max_epochs=3, accumulate_grad_batches=4)).fit(
        converging(d), regression_stream(1200, 16, d, torch.zeros(d), 1.0), ckpt_path=str(path)
    )
    text = resumed.summary_markdown()
    assert resumed.stopped_again_step is not None and "no noise source" not in text
    assert "micro_batch" in text and "B_simple" in text


def test_the_expected_batch_norm_is_the_smoothed_rms_of_the_observed_norm():
    """E‖ḡ_B‖² = ‖G‖² + tr Σ/B (McCandlish Eq. A.1). The micro-batch estimators make it exact step by step,
    ‖G‖²_est + S_est/B = ‖ḡ_B‖², and the finite-population correction leaves the sum as it is: the logged
    grad_noise/expected_batch_norm² is the bias-corrected EMA (β = 0.8, no shorter window below it: both quantities
    share it, estimate.py rule 7) of the monitor's ‖ḡ‖², and the noise level sqrt(tr Σ/B) lies below it while
    ‖G‖² > 0."""
    d, steps, accumulate, micro, beta = 6, 30, 4, 8, 0.8
    logger = RecordingLogger()
    _fit(
        LinearRegression(torch.full((d,), 0.5)),
        [GradNormMonitor(), GradNormEarlyStopping(ema_beta=beta)],
        regression_stream(steps * accumulate, micro, d, torch.zeros(d), 1.0),
        logger=logger,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        log_every_n_steps=1,
    )
    norms = logger.values("grad_norm/total")
    assert len(norms) == steps
    ema, smoothed = 0.0, []
    for t, norm in enumerate(norms, 1):
        ema = beta * ema + (1 - beta) * norm**2
        smoothed.append(math.sqrt(ema / (1 - beta**t)))
    logged = dict(logger.series["grad_noise/expected_batch_norm"])
    assert len(logged) == steps
    for step, value in logged.items():
        assert value == pytest.approx(smoothed[step], rel=1e-4)
    level = dict(logger.series["grad_norm/noise_floor"])
    assert all(level[s] < logged[s] for s in logged if s >= 5)


class _LayerNormMLP(pl.LightningModule):
    """The issue's case (#24): a LayerNorm MLP under Adam, every default, on 4 classes whose labels carry noise."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(20, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _noisy_classes(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    w = torch.randn(20, 4, generator=g)
    return TensorDataset(x, (x @ w + 3.0 * torch.randn(n, 4, generator=g)).argmax(1))


def test_a_layernorm_mlp_noise_dominated_from_its_start_is_not_stopped_at_step_109():
    """Issue #24: at batch 32 with the defaults (probe and stopper), the run was stopped at optimizer step 109 "in
    its noise band from the start" while it kept learning. Noise from step 0 is no convergence: no stop there;
    said once, with a batch size from B_simple's interval."""
    from trainvitals import BatchVarianceProbe

    torch.manual_seed(0)
    stopper = GradNormEarlyStopping()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = _fit(
            _LayerNormMLP(),
            [BatchVarianceProbe(histogram_every_n_steps=0, per_coordinate=False), stopper],
            DataLoader(_noisy_classes(32 * 160), batch_size=32, shuffle=True),
            max_epochs=1,
            log_every_n_steps=10,
        )
    assert trainer.global_step == 160 and stopper.stopped_step is None
    said = [str(w.message) for w in record if "from the start" in str(w.message)]
    assert len(said) == 1 and "the batch (32)" in said[0]
    batch = int(re.search(r"(?i)a batch of at least (\d+)", said[0]).group(1))
    summary = stopper.gradient_noise.host_summary()  # at the end; the message's interval is of its step
    assert 32 < batch < summary["b_simple_high"] and "noise band from the start" in stopper.summary_line()


class _LinearRegression(pl.LightningModule):
    """``nn.Linear`` on a mean squared error; at every 10th optimizer step the brute-force band ratio over the whole
    training set, B·‖G‖²/(margin·tr Σ) at batch 64 and margin 0.2, from every example's own gradient 2(x·w − y)(x, 1)."""

    def __init__(self, data: TensorDataset) -> None:
        super().__init__()
        self.net, self.data, self.band_ratios = nn.Linear(data.tensors[0].shape[1], 1), data, {}

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.net(batch[0]), batch[1])

    def on_before_optimizer_step(self, optimizer):
        if self.trainer.global_step % 10:
            return
        x, y = self.data.tensors
        residual = self.net(x).detach() - y
        rows = torch.cat([2 * residual * x, 2 * residual], 1)
        mean = rows.mean(0)
        trace = (rows - mean).square().sum(1).mean()
        self.band_ratios[self.trainer.global_step] = float(64 * mean.square().sum() / (0.2 * trace))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_a_run_that_enters_its_band_before_min_steps_was_out_of_it_and_is_stopped():
    """A run far from its band at step 0 that enters it before ``min_steps`` (100) was out of it: seen from the first
    decisive step, not from ``min_steps`` on, it is stopped, not called noise-dominated from the start. The
    brute-force band ratio: 29× the edge at step 0, inside the band from step 40 (stopping_tasks' diabetes MLP: 14×
    at step 0, in the band from step 40, called "from the start" before)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 8, generator=g)
    data = TensorDataset(x, x @ torch.randn(8, 1, generator=g) + torch.randn(2048, 1, generator=g))
    torch.manual_seed(0)
    model, stopper = _LinearRegression(data), GradNormEarlyStopping()
    _fit(model, [stopper], DataLoader(data, batch_size=16, shuffle=True), max_epochs=8, accumulate_grad_batches=4)
    assert model.band_ratios[0] > 10 and max(r for step, r in model.band_ratios.items() if step >= 40) < 1
    assert stopper.from_start == "" and stopper.stopped_step is not None and stopper.stopped_step >= 100


class _Chased(_LinearRegression):
    """:class:`_LinearRegression` chasing a target that moves from optimizer step ``start`` on (an offset growing by
    ``rate`` a step): SGD then lags behind it by a constant residual, and ‖G‖² rises out of the band as a run leaving
    a plateau does; the brute-force band ratios follow the same target."""

    def __init__(self, data: TensorDataset, start: int, rate: float) -> None:
        super().__init__(data)
        self.start, self.rate = start, rate

    def _offset(self) -> float:
        return self.rate * max(self.trainer.global_step - self.start, 0)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.net(batch[0]), batch[1] + self._offset())

    def on_before_optimizer_step(self, optimizer):
        x, y = self.data.tensors
        self.data = TensorDataset(x, y + self._offset())
        try:
            super().on_before_optimizer_step(optimizer)
        finally:
            self.data = TensorDataset(x, y)


@pytest.mark.slow
def test_no_stop_while_the_current_estimate_reads_out_of_the_band():
    """A fresh user's ConvNeXt left a loss plateau and was stopped at 14.6 % accuracy: the band window's ‖G‖², a mean
    over the last ~50 steps, read 0.54 of the edge while the current estimate (the chosen windows, which follow a
    rise) read 1.83 and the truth 3.28. The same here: from step 270 the target moves, the truth leaves the band
    (2.2× the edge at step 290), the band window lags inside it, and main stopped at step 299. A streak now counts
    only while the current estimate reads inside the band too, so no stop comes while the run is out of it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 8, generator=g)
    data = TensorDataset(x, x @ torch.randn(8, 1, generator=g) + torch.randn(2048, 1, generator=g))
    torch.manual_seed(0)
    model, stopper, logger = (
        _Chased(data, start=270, rate=0.03),
        GradNormEarlyStopping(min_steps=285),
        RecordingLogger(),
    )
    loader = DataLoader(data, batch_size=16, shuffle=True)
    _fit(model, [stopper], loader, logger=logger, max_epochs=12, accumulate_grad_batches=4, log_every_n_steps=10)
    band, current = (dict(logger.series[tag]) for tag in ("grad_norm/band_ratio", "grad_noise/band_ratio"))
    assert model.band_ratios[290] > 1.5 and band[290] < 1 < current[290]  # the scenario: out, the band window lags
    assert min(r for step, r in model.band_ratios.items() if step >= 280) > 1
    assert stopper.stopped_step is None, stopper.stopped_step


def test_each_logged_band_ratio_lies_in_its_own_interval():
    """Issue #25: ``grad_norm/band_ratio`` (the band window's, what the decision reads) was logged with the current
    estimate's interval, and on a falling ‖G‖² sat above its high end at most steps. Each ratio now has its own:
    the band windows' sampling interval, and ``grad_noise/band_ratio`` with the chosen windows' (lag in the error)."""
    d, logger = 10, RecordingLogger()
    stopper = GradNormEarlyStopping(patience=5, min_steps=10**6, margin=0.2, check_every_n_steps=1)
    _fit(
        converging(d),
        [stopper],
        regression_stream(1600, 16, d, torch.zeros(d), 1.0),
        logger=logger,
        max_epochs=1,
        accumulate_grad_batches=4,
        log_every_n_steps=1,
    )
    series = {tag: dict(values) for tag, values in logger.series.items()}
    band, current = series["grad_norm/band_ratio"], series["grad_noise/band_ratio"]
    assert len(band) >= 300 and set(band) == set(current)
    apart = 0
    for tag, values in (("grad_norm/band_ratio", band), ("grad_noise/band_ratio", current)):
        for step, ratio in values.items():
            assert series[f"{tag}_low"][step] <= max(ratio, 0.0) * (1 + 1e-9), (tag, step)  # low ends clamped at 0
            high = series.get(f"{tag}_high", {}).get(step, math.inf)
            assert ratio <= high * (1 + 1e-9), (tag, step)
    for step, ratio in band.items():
        apart += ratio > series.get("grad_noise/band_ratio_high", {}).get(step, math.inf)
    print(f"steps where the band window's ratio is above the current estimate's interval: {apart} of {len(band)}")
    assert apart > 0  # the two quantities do differ: one interval could not serve both


def test_a_run_held_from_its_start_reads_so_in_the_report_of_a_tensorboard_and_a_csv_log(tmp_path):
    """A fresh user's CSV report said "the logged streak … reached 11 step(s) in a row, short of its patience or before
    min_steps" (patience 10, min_steps 50) and "in its noise band … further steps mostly move within noise" for a run
    the stopper held as noise-dominated from its start, a reason only its text panel says, which CSV does not keep.
    At the optimum from step 0 (w = w* = 0: ‖G‖² = 0, in the band at every step) the stopper holds its full streak;
    ``grad_norm/held_from_start`` says so to every logger, and the report of either log says it was held."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from trainvitals.report.assess import assess
    from trainvitals.report.events import read_runs

    d, stopper = 10, GradNormEarlyStopping(min_steps=50, patience=10, verbose=False)
    loggers = [TensorBoardLogger(str(tmp_path / "tb"), name="run"), CSVLogger(str(tmp_path / "csv"), name="run")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the from-start warning, and CSV's "no text panels"
        _fit(
            LinearRegression(torch.zeros(d), lr=0.02),
            [stopper],
            regression_stream(300 * 4, 16, d, torch.zeros(d), 1.0),
            logger=loggers,
            max_epochs=1,
            accumulate_grad_batches=4,
            log_every_n_steps=25,
        )
    assert stopper.stopped_step is None and "noise band from the start" in stopper.from_start
    for kind, own_words in (("tb", True), ("csv", False)):
        (run,) = read_runs(tmp_path / kind)
        assert run.last(r"grad_norm/held_from_start$") == 1.0
        report = assess(run)
        stop = {row.label: row.value for row in report.sections["convergence"]}["stop"]
        said = [f.message for f in report.findings if f.section == "convergence"]
        assert stop.startswith("not stopped: ") and "from the start" in stop and "not convergence" in stop, stop
        assert "short of its patience" not in stop
        assert bool(re.search("(?i)a batch of at least", stop)) is own_words  # its words where the log kept its panel
        assert own_words or "this logger keeps no text" in stop
        assert not any("further steps mostly move within noise" in s for s in said), said
        # At its optimum from step 0, the loss flat: its panel says both readings, and so does the report's note; a
        # CSV log without the panel cannot tell the loss's reading.
        lead = "held from the start" if own_words else "noise-dominated from the start"
        assert [s for s in said if s.startswith(lead) and "not convergence" in s], said
        assert any("started at its minimum" in s for s in said) is own_words, said


@pytest.mark.parametrize(("band", "current", "said"), [(4.99, 0.03, "lags a falling"), (0.5, 1.8, "lags a rising")])
def test_the_fit_end_line_says_when_the_band_window_and_the_current_estimate_disagree(monkeypatch, band, current, said):
    """A fresh user's ViT ended with "0 step(s) in a row … the current estimate is 0.03× the band's edge … inside the
    band" while the band window, which the streak counts on, read 4.99×: the line now says which one the streak reads
    and why they differ; where both read one side, it says nothing more."""
    stopper = GradNormEarlyStopping(margin=0.2)
    stopper._source, stopper.steps = "hooks", 500
    edge = 0.2 * 8.0 / 64  # margin·tr Σ/B
    summary = {
        "decisive": True,
        "trace_cov": 8.0,
        "batch_size": 64,
        "grad_sq_norm": current * edge,
        "grad_sq_norm_se": 0.01,
        "band_grad_sq_norm": band * edge,
        "band_ratio_low": 0.0,
        "band_ratio_high": 0.2 * 2 * max(current, 1.0),
    }
    monkeypatch.setattr(stopper.gradient_noise, "host_summary", lambda *_: summary)
    line = stopper.summary_line()
    assert f"band's edge 0.2·tr(Σ)/B, its interval from ‖G‖²'s and tr(Σ)'s errors) at {current:.2g} (90 %: " in line
    assert f"{band:.2f}× the edge" in line and said in line, line
    summary["band_grad_sq_norm"] = current * edge
    assert "band window" not in stopper.summary_line()


def test_a_run_held_from_its_start_and_then_shown_out_is_not_said_to_be_held_at_the_end(monkeypatch):
    """A fresh user's tanh net was held as noise-dominated from its start, then left its band (brute force 20× the
    edge); its fit-end line still said "never shown out of the band … every step it judged was noise-dominated"."""
    stopper = GradNormEarlyStopping(margin=0.2)
    stopper._source, stopper.steps = "hooks", 500
    stopper.from_start = "in its noise band from the start (optimizer step 109): … it does not stop on it."
    summary = {"decisive": False, "why": "not measured yet"}
    monkeypatch.setattr(stopper.gradient_noise, "host_summary", lambda *_: summary)
    assert "from the start" in stopper.summary_line()
    stopper._left = torch.ones((), dtype=torch.bool)
    assert "from the start" not in stopper.summary_line()


class _HeldLoss(LinearRegression):
    """:func:`converging`'s regression (out of its band, then in it) whose loss *value* is ``level(step)``, its
    gradient the mean squared error's: ``mse − mse.detach() + level``. A closed form for the loss rule: the
    gradient's statistics of a run that settles in its band, the loss of a plateau held where it started."""

    def __init__(self, level):
        super().__init__(torch.full((10,), 0.5), lr=0.02)
        self.level = level

    def training_step(self, batch, batch_idx):
        mse = super().training_step(batch, batch_idx)
        return mse - mse.detach() + self.level(self.trainer.global_step)


def _held_fit(level, steps=400, **kwargs):
    stopper = GradNormEarlyStopping(patience=5, min_steps=20, check_every_n_steps=1, **kwargs)
    logger = RecordingLogger()
    data = regression_stream(4 * steps, 16, 10, torch.zeros(10), 1.0)
    _fit(_HeldLoss(level), [stopper], data, logger=logger, max_epochs=1, accumulate_grad_batches=4, log_every_n_steps=1)
    return stopper, logger


def test_no_stop_while_the_loss_has_not_fallen_from_its_start(caplog):
    """In its band (a full streak at step 171) as at a minimum, but the loss flat at its start: a plateau the run never left.
    Without the rule it stops there; with it, it never does, and says why once and at the end."""
    without, _ = _held_fit(lambda step: 2.0, min_loss_drop=None)
    assert without.stopped_step is not None and without.stopped_step < 250
    with caplog.at_level("INFO"):
        held, logger = _held_fit(lambda step: 2.0)
    assert held.stopped_step is None and held.plateau_step == without.stopped_step
    assert set(logger.values("grad_norm/loss_drop")) == {0.0}  # (2 − 2)/2, from the start's 10th step on
    said = [
        r.message for r in caplog.records if "a plateau the run has not left" in r.message and "watching" in r.message
    ]
    assert len(said) == 1 and f"at optimizer step {without.stopped_step}" in said[0]
    line = held.summary_line()
    assert line.startswith(
        f"did not stop the run: in its noise band for a full streak at optimizer step {without.stopped_step}"
    )
    assert "the training loss fell 0% since the start (2 → 2), below min_loss_drop 10%" in line


def test_a_stop_once_the_loss_has_fallen_by_min_loss_drop():
    """The loss held at 2 for 250 steps, then 1: the stop comes at the first step whose smoothed loss (the stopper's
    EMA, β = ema_beta) is 10 % below the start, computed by hand."""
    held, _ = _held_fit(lambda step: 2.0 if step < 250 else 1.0)
    beta, ema, weight, expected = 0.98, 0.0, 0.0, None
    for step in range(400):
        ema, weight = beta * ema + (1 - beta) * (2.0 if step < 250 else 1.0), beta * weight + (1 - beta)
        if expected is None and (2.0 - ema / weight) / 2.0 >= 0.1:
            expected = step
    assert held.plateau_step is not None and held.stopped_step == expected > 250


def test_a_non_positive_start_loss_is_said_once_and_the_band_decides_alone():
    without, _ = _held_fit(lambda step: -1.0, min_loss_drop=None)
    with pytest.warns(UserWarning, match="first 10 steps is -1, not positive: min_loss_drop") as seen:
        alone, _ = _held_fit(lambda step: -1.0)
    assert sum("not positive" in str(w.message) for w in seen) == 1
    assert alone.stopped_step == without.stopped_step is not None


def test_a_resumed_run_keeps_its_start_loss(tmp_path):
    """Saved on a plateau at loss 2 (no stop), resumed where the loss is 1: the start stays the first run's 2, so the
    resumed run has fallen by 50 % and stops; re-measured, its start would be 1 and it would not."""
    first = GradNormEarlyStopping(patience=5, min_steps=20, check_every_n_steps=1)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    data = regression_stream(4 * 250, 16, 10, torch.zeros(10), 1.0)
    _fit(
        _HeldLoss(lambda step: 2.0),
        [first, checkpoint],
        data,
        max_epochs=1,
        accumulate_grad_batches=4,
        enable_checkpointing=True,
    )
    assert first.stopped_step is None and first.plateau_step is not None
    resumed = GradNormEarlyStopping(patience=5, min_steps=20, check_every_n_steps=1)
    trainer = Trainer(**trainer_kwargs(callbacks=[resumed], max_epochs=2, accumulate_grad_batches=4))
    trainer.fit(_HeldLoss(lambda step: 1.0), data, ckpt_path=str(tmp_path / "last.ckpt"))
    assert resumed.loss_progress.start.item() == pytest.approx(2.0)
    assert resumed.stopped_step is not None and resumed.stopped_step > 250


class _SigmoidMLP(pl.LightningModule):
    """A fresh user's digits model: 64 → 64 → 64 → 64 sigmoid → 10, SGD lr 0.2 momentum 0.9. From seed 0 it sits at
    chance on a plateau in its noise band until about step 600, then learns (0.90 at step 1,380)."""

    def __init__(self):
        super().__init__()
        layers = [nn.Flatten()]
        for width_in in (64, 64, 64):
            layers += [nn.Linear(width_in, 64), nn.Sigmoid()]
        self.net = nn.Sequential(*layers, nn.Linear(64, 10))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["stopper", "schedule"])
def test_a_sigmoid_mlp_on_its_plateau_is_neither_stopped_nor_cut(kind, tmp_path):
    """Without the loss rule the stopper stopped it at step 249 at chance (0.11), and BandSchedule cut its lr there
    (0.10 at step 1,380 against 0.90 uncut): its loss had not fallen from its start. Ended on that plateau, its
    fit-end line says the streak is full and held, and what gets a run off a plateau; the report warns of it."""
    pytest.importorskip("sklearn")
    from lightning.pytorch.loggers import TensorBoardLogger

    from trainvitals import TrainvitalsDashboard
    from trainvitals.demo.data import DigitsDataModule
    from trainvitals.report.assess import assess
    from trainvitals.report.events import read_runs
    from trainvitals.schedule.callback import BandSchedule

    pl.seed_everything(0, verbose=False)
    callback = GradNormEarlyStopping(verbose=False) if kind == "stopper" else BandSchedule(verbose=False)
    logger = TensorBoardLogger(str(tmp_path), name="run")
    trainer = Trainer(
        **trainer_kwargs(
            callbacks=[callback, TrainvitalsDashboard()], logger=logger, max_epochs=14, accumulate_grad_batches=4
        )
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_SigmoidMLP(), DigitsDataModule(batch_size=16))
    assert trainer.global_step == 14 * 23 and callback.stopped_step is None  # 89 micro-batches an epoch
    assert getattr(callback, "cuts", []) == [] and callback.plateau_step is not None
    progress = callback.loss_progress.summary()
    assert progress["drop"] < 0.1 and progress["start"] == pytest.approx(math.log(10), rel=0.05)
    line = callback.summary_line()
    streak = int(callback._streak)
    assert "a plateau the run has not left" in line and streak >= callback.patience
    assert (
        f"its streak full at the end ({streak} step(s) in a row, of the 10 it needs) and held by min_loss_drop" in line
    )
    assert "a higher learning rate or with a warm-up" in line and "min_loss_drop=None lets the band" in line, line
    (run,) = read_runs(tmp_path)
    (verdict,) = [f for f in assess(run).findings if f.section == "convergence" and "noise band" in f.message]
    assert verdict.severity == "warning" and verdict.message.startswith("ended on a plateau"), verdict
    assert "a higher learning rate" in verdict.message


def test_a_run_held_on_its_plateau_reads_not_stopped_in_the_report(tmp_path):
    """The plateau's panel (grad_norm/stop_reason) is no stop: the report's stop row says "not stopped" in its words."""
    from lightning.pytorch.loggers import TensorBoardLogger

    from trainvitals.report.assess import assess
    from trainvitals.report.events import read_runs

    stopper = GradNormEarlyStopping(patience=5, min_steps=20, check_every_n_steps=1, verbose=False)
    data = regression_stream(4 * 300, 16, 10, torch.zeros(10), 1.0)
    logger = TensorBoardLogger(str(tmp_path), name="run")
    _fit(_HeldLoss(lambda step: 2.0), [stopper], data, logger=logger, max_epochs=1, accumulate_grad_batches=4)
    (run,) = read_runs(tmp_path)
    stop = {row.label: row.value for row in assess(run).sections["convergence"]}["stop"]
    assert stopper.stopped_step is None and stop.startswith("not stopped: in its noise band for a full streak"), stop
    assert "a plateau the run has not left" in stop


def test_a_plateau_held_to_the_end_says_its_streak_full_and_what_to_do():
    """A fresh user read "… a plateau the run has not left …; 429 step(s) in a row in the condition at the end, of the
    10 it needs" as a contradiction, with no advice: the line says the streak is full and held by min_loss_drop (the
    streak the logger saw at the last step), and what gets a run off a plateau, or frees a run at its minimum."""
    held, logger = _held_fit(lambda step: 2.0)
    streak = int(logger.values("grad_norm/band_streak")[-1])
    line = held.summary_line()
    assert held.stopped_step is None and streak >= held.patience
    assert (
        f"its streak full at the end ({streak} step(s) in a row, of the 5 it needs) and held by min_loss_drop" in line
    )
    assert "in the condition at the end, of the" not in line, line
    assert "a higher learning rate or with a warm-up" in line and "initialisation" in line, line
    assert "fine-tuning a converged model" in line and "min_loss_drop=None lets the band stop the run" in line, line
    released, _ = _held_fit(lambda step: 2.0 if step < 250 else 1.0)  # left the plateau: stopped, no plateau advice
    assert released.stopped_step is not None and "plateau" not in released.summary_line()


def _trained_regression(d: int = 10) -> LinearRegression:
    """converging(d) trained 300 steps to its minimum, a converged model to fine-tune: ‖δ‖² from 2.5 to SGD's
    stationary spread (~0.004 here), ‖G‖² = 4‖δ‖² an eighth of the band's edge 0.2·tr(Σ)/B ≈ 0.13."""
    model = converging(d)
    data = regression_stream(300 * 4, 16, d, torch.zeros(d), 1.0, seed=1)
    Trainer(**trainer_kwargs(max_epochs=1, accumulate_grad_batches=4)).fit(model, data)
    assert (model.w.detach() ** 2).sum() < 0.01
    return model


def _fine_tune(model: LinearRegression, **kwargs) -> GradNormEarlyStopping:
    """Training on from ``model``'s weights with a fresh Trainer and stopper (defaults but ``kwargs``), 300 steps."""
    stopper = GradNormEarlyStopping(verbose=False, **kwargs)
    tuned = LinearRegression(model.w.detach(), lr=0.02)
    data = regression_stream(300 * 4, 16, 10, torch.zeros(10), 1.0, seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(**trainer_kwargs(callbacks=[stopper], max_epochs=1, accumulate_grad_batches=4)).fit(tuned, data)
    return stopper


def test_fine_tuning_a_converged_model_says_both_readings_and_stops_with_hold_from_start_off():
    """A fresh user fine-tuning a converged model was told "noise from the start … not convergence … a batch of at
    least 478", with no switch. Its loss has not fallen either (it is at its minimum, σ² = 1): the stopper says both
    readings and what to do in each; with hold_from_start=False and min_loss_drop=None it stops at its first full
    streak after min_steps — steps 100–109 in the band, read at the check of step 109 — saying it was in its band from
    the start; hold_from_start=False alone leaves the loss rule, whose fit-end line names min_loss_drop=None."""
    model = _trained_regression()
    held = _fine_tune(model)
    assert held.stopped_step is None and held.from_start.startswith("in its noise band from the start")
    said = held.from_start
    assert "either the batch (64) is far below B_simple" in said and re.search(r"a batch of at least \d+", said)
    assert "or the run started at its minimum (e.g. fine-tuning a converged model)" in said, said
    assert "hold_from_start=False and min_loss_drop=None let the band stop the run" in said, said
    assert re.search(
        r"the training loss (fell|rose) \d+% since the start \(\d\.\d+ → \d\.\d+\), (below|not the fall of) min_loss_drop 10%",
        said,
    )
    assert "held by the from-start rule" in held.summary_line() and "in the condition at the end, of" not in said
    assert held.plateau_step is None  # one rule holds it, said once

    free = _fine_tune(model, hold_from_start=False, min_loss_drop=None)
    assert free.stopped_step == free.min_steps + free.patience - 1 == 109 and free.from_start == ""
    assert free.describe_stop().endswith(
        ", in its band from the start (never shown out of it; hold_from_start=False lets it stop there)."
    ), free.describe_stop()

    loss_rule = _fine_tune(model, hold_from_start=False)
    assert loss_rule.stopped_step is None and loss_rule.plateau_step == 109
    assert "min_loss_drop=None lets the band stop the run there" in loss_rule.summary_line()


class AdamRegression(LinearRegression):
    """LinearRegression trained with Adam, as a fresh user fine-tunes."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def test_fine_tuning_a_tiny_noisy_loss_says_both_readings_its_fall_within_noise():
    """A fresh user fine-tuning a converged model (train loss ~5e-4, Adam) was told only "the batch is below
    B_simple": its 10-step start mean and EMA differed by 38 % by noise alone, read as "fallen". Here w = w* from the
    start, loss σ² = 4e-4 over batches of 2 × 4 (a step's loss ~50 % noise), Adam 1e-3: at step 109 the loss read 10 %+
    below its start, within its noise; the message gives both readings and says the fall is within the noise."""
    d, micro, steps = 10, 2, 300
    g = torch.Generator().manual_seed(7)
    x = torch.randn(steps * 4 * micro, d, generator=g)
    y = 0.02 * torch.randn(steps * 4 * micro, generator=g)
    stopper = GradNormEarlyStopping(verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(**trainer_kwargs(callbacks=[stopper], max_epochs=1, accumulate_grad_batches=4)).fit(
            AdamRegression(torch.zeros(d), lr=1e-3), DataLoader(TensorDataset(x, y), batch_size=micro)
        )
    said = stopper.from_start
    assert stopper.stopped_step is None and said.startswith("in its noise band from the start"), said
    assert "or the run started at its minimum (e.g. fine-tuning a converged model)" in said, said
    assert re.search(r"fell \d+% since the start \([\d.e-]+ → [\d.e-]+\), within its own noise: a fall", said), said


def test_hold_from_start_round_trips_as_an_argument_not_as_state():
    """Not in the state key (a run's band history means the same under either): a checkpoint saved under one
    resumes under the other, and an older state (no such key) loads."""
    on, off = GradNormEarlyStopping(), GradNormEarlyStopping(hold_from_start=False)
    state = on.state_dict()
    assert not any("hold_from_start" in str(key) for key in state)
    off.load_state_dict(state)
    assert off.hold_from_start is False and on.state_key == off.state_key


class _LinearLayerRegression(pl.LightningModule):
    """:func:`converging`'s regression through an ``nn.Linear`` (no bias), which the probe measures per example."""

    def __init__(self, d: int = 10):
        super().__init__()
        self.lin = nn.Linear(d, 1, bias=False)
        nn.init.constant_(self.lin.weight, 0.5)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.lin(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.02)


@pytest.mark.parametrize("every", [1, 5])
def test_a_band_first_judged_late_says_the_steps_before_it_were_not_seen(every):
    """A fresh user's FT-Transformer, probed every 5 steps, was held "in its noise band from the start" although the
    truth put it out of its band until step ~40: the estimate first judges at its 20th measurement, step ~100 there.
    The regression starts out of its band (‖G‖² = 10 against tr Σ/B ≈ 0.7) and falls into it: measured every step
    it is seen out and stopped; every 5 steps it is held, and the line says when it could first judge and how to
    see the start."""
    from trainvitals import BatchVarianceProbe

    probe = BatchVarianceProbe(measure_every_n_steps=every, histogram_every_n_steps=0, per_coordinate=False)
    stopper = GradNormEarlyStopping(verbose=False)
    data = regression_stream(300, 16, 10, torch.zeros(10), 1.0, seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(**trainer_kwargs(callbacks=[probe, stopper], max_epochs=1)).fit(_LinearLayerRegression(), data)
    if every == 1:
        assert stopper.stopped_step is not None and stopper.from_start == ""
        return
    assert stopper.stopped_step is None
    assert (
        "when the estimate could first judge it (at about optimizer step 100, measuring every 5 steps: the steps "
        "before were not seen, and the run may have been out of the band then; measure_every_n_steps=1 on "
        "BatchVarianceProbe lets it judge from step 20)"
    ) in stopper.from_start, stopper.from_start


@pytest.mark.parametrize(
    ("low", "point", "population", "said"),
    [
        (33.5, 60.0, 455, "a batch of at least 34 (B_simple's 90 % lower end) balances steps against examples"),
        (0.0, 60.0, None, "a batch of at least 60 (B_simple's point estimate; its interval has no lower end yet)"),
        (
            0.0,
            885.0,
            455,
            "a batch of 885 (B_simple's point estimate; its interval has no lower end yet) is beyond the training "
            "set's 455 examples: full-batch steps (455) have no sampling noise",
        ),
        (0.0, math.inf, None, "a larger batch lowers the noise per step"),
    ],
)
def test_the_batch_a_run_noisy_from_its_start_is_told_is_what_its_interval_shows(
    low, point, population, said, monkeypatch
):
    """A fresh user was told "a batch of at least 885 (B_simple's 90 % lower end)" where the interval had no lower
    end (885 was the point estimate) and the training set held 455 examples."""
    stopper = GradNormEarlyStopping()
    monkeypatch.setattr(type(stopper.gradient_noise), "population", property(lambda self: population))
    assert stopper._batch_suggested({"b_simple_low": low, "b_simple": point}).startswith(said)
