"""GradNormMonitor against brute-force norms of flattened gradients."""

from __future__ import annotations

import copy
import json
import math
import statistics
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from _models import (
    GAN,
    DigitsMLP,
    Regressor,
    digits_loader,
    flat_grad_norm,
    loader,
    one_cycle_lr,
    regression_data,
    warmup_cosine,
)
from _spike_rule import spike_ratios
from conftest import RecordingLogger, trainer_kwargs
from guard.test_guard import TwoPlayers
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainvitals import GradNormEarlyStopping, GradNormMonitor, LRScalingAdvisor
from trainvitals.norms.monitor import MAX_PENDING_STEPS
from trainvitals.plumbing import writers as _writers


def fit(model, monitor, logger, *, batch_size=8, n=64, **overrides):
    trainer = Trainer(**trainer_kwargs(callbacks=[monitor], logger=logger, **overrides))
    trainer.fit(model, loader(regression_data(n), batch_size))
    return trainer


def test_accumulated_norm_equals_one_pass_over_the_update_batch():
    model = Regressor(lr=0.1)
    initial = copy.deepcopy(model.net)
    logger = RecordingLogger()
    fit(
        model,
        GradNormMonitor(log_every_n_steps=2, histogram_every_n_steps=0),
        logger,
        accumulate_grad_batches=2,
        max_epochs=2,
    )

    # Plain PyTorch: one forward/backward over the 16 examples of each update.
    net, data = initial, regression_data(64)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    expected = []
    for _ in range(2):
        for i in range(0, 64, 16):
            opt.zero_grad()
            F.mse_loss(net(data.tensors[0][i : i + 16]), data.tensors[1][i : i + 16]).backward()
            expected.append(flat_grad_norm(net.parameters()))
            opt.step()
    logged = logger.series["grad_norm/total"]
    assert [step for step, _ in logged] == [0, 2, 4, 6]
    assert [v for _, v in logged] == pytest.approx(expected[::2], rel=1e-5)


def test_per_layer_norms_combine_to_the_total():
    logger = RecordingLogger()
    fit(Regressor(), GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0), logger, max_epochs=1)
    layers = [f"grad_norm/net.{i}" for i in (0, 2, 4)]
    for step in range(8):
        total = logger.values("grad_norm/total")[step]
        assert total**2 == pytest.approx(sum(logger.values(t)[step] ** 2 for t in layers), rel=1e-6)


@pytest.mark.parametrize(
    "grouping, tags",
    [
        ("parameter", ["net.0.weight", "net.0.bias", "net.4.bias"]),
        ("block", ["net"]),
    ],
)
def test_groupings(grouping, tags):
    logger = RecordingLogger()
    model = Regressor()
    fit(model, GradNormMonitor(grouping=grouping, log_every_n_steps=1, histogram_every_n_steps=0), logger, max_steps=2)
    for tag in tags:
        assert len(logger.values(f"grad_norm/{tag}")) == 2
    assert logger.values("grad_norm/total") == pytest.approx(model.reference_norms, rel=1e-6)


def test_grad_scaler_norms_are_unscaled():
    scaled, plain = Regressor(autocast=False), Regressor(autocast=False)
    plain.load_state_dict(scaled.state_dict())
    log_amp, log_fp32 = RecordingLogger(), RecordingLogger()
    amp_trainer = fit(
        scaled,
        GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0),
        log_amp,
        max_epochs=1,
        plugins=[MixedPrecision("16-mixed", "cpu")],
    )
    assert amp_trainer.precision_plugin.scaler.get_scale() >= 2.0**15  # the loss really was scaled
    fit(plain, GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0), log_fp32, max_epochs=1)
    assert log_amp.values("grad_norm/total") == pytest.approx(log_fp32.values("grad_norm/total"), rel=1e-4)


def test_inf_step_under_grad_scaler_is_a_skip_not_divergence(recwarn):
    logger = RecordingLogger()
    model = Regressor(autocast=False, inf_at_step=2)
    fit(
        model,
        GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0),
        logger,
        max_epochs=1,
        plugins=[MixedPrecision("16-mixed", "cpu")],
    )
    assert logger.values("grad_norm/amp_skipped_steps")[-1] == 1
    assert logger.values("grad_norm/nonfinite_steps")[-1] == 0
    assert not [w for w in recwarn if "non-finite" in str(w.message)]
    # The skipped step's inf norms are not drawn; the others are.
    steps = [s for s, _ in logger.series["grad_norm/total"]]
    assert 2 not in steps and {0, 1, 3} <= set(steps)
    assert all(math.isfinite(v) for tag, series in logger.series.items() for _, v in series)


def test_nonfinite_gradient_without_scaler_is_counted_and_located():
    class NaNInHead(Regressor):
        def on_after_backward(self):
            if self.global_step == 1:
                self.net[4].weight.grad[0, 0] = float("nan")

        def on_before_optimizer_step(self, optimizer):
            # After the monitor has looked: keep the NaN out of the weights, so only one step is bad.
            for p in self.parameters():
                p.grad.nan_to_num_(0.0)

    logger = RecordingLogger()
    with pytest.warns(UserWarning, match=r"non-finite gradient.*first in: net\.4"):
        fit(NaNInHead(lr=0.0), GradNormMonitor(log_every_n_steps=3, histogram_every_n_steps=0), logger, max_steps=4)
    assert logger.values("grad_norm/nonfinite_steps") == [0, 1]


def test_total_is_the_pre_clip_norm_and_clipped_total_the_post_clip_norm():
    logger = RecordingLogger()
    model = Regressor()
    fit(
        model,
        GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0),
        logger,
        max_steps=4,
        gradient_clip_val=0.01,
    )
    totals = logger.values("grad_norm/total")
    assert totals == pytest.approx(model.reference_norms, rel=1e-6)
    assert min(totals) > 0.05  # clipping really happened
    assert logger.values("grad_norm/clipped_total") == pytest.approx([0.01] * 4, rel=1e-3)
    # one call per logging step with both (a CSVLogger writes one row per call)
    monitor_calls = [c for c in logger.calls if "grad_norm/total" in c or "grad_norm/clipped_total" in c]
    assert len(monitor_calls) == 4 and all({"grad_norm/total", "grad_norm/clipped_total"} <= c for c in monitor_calls)


def _clipped_fit(tmp_path, clip, **monitor_kwargs):
    """20 steps at lr 0 (the norms do not depend on the clipping, the batches on the seed), logged every 5th."""
    torch.manual_seed(0)
    model = Regressor(lr=0.0)
    monitor = GradNormMonitor(log_every_n_steps=5, histogram_every_n_steps=0, **monitor_kwargs)
    logger = TensorBoardLogger(str(tmp_path), name="clip", version=0)
    fit(model, monitor, logger, max_steps=20, gradient_clip_val=clip, n=160)
    return model.reference_norms, monitor.summary_line()


def test_the_fit_end_line_says_when_clipping_by_norm_shrank_most_steps(tmp_path, capsys):
    norms, line = _clipped_fit(tmp_path / "free", None)
    assert len(norms) == 20 and "clipping" not in line
    threshold = sum(sorted(norms)[6:8]) / 2  # 13 of the 20 steps above it, most of them off the logging steps
    norms, line = _clipped_fit(tmp_path / "clip", threshold)
    shrunk = [threshold / (n + 1e-6) for n in norms if n > threshold]
    assert len(shrunk) == 13
    assert (
        f"gradient clipping at {threshold:g} (by norm) clipped 13 of 20 steps (65%), each to "
        f"×{sum(shrunk) / 13:.2g} in mean (threshold / pre-clip norm)"
    ) in line
    # The report reads the 4 logged steps: clipped where the clipped norm is the threshold.
    logged = norms[::5]
    from trainvitals.report.command import main

    main([str(tmp_path / "clip"), "--format", "json"])
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    section = {row["label"]: row["value"] for row in run["sections"]["gradient clipping"]}
    assert section["logged steps clipped, of 4"] == sum(n > threshold for n in logged) / 4
    assert section["pre-clip norm, median"] == pytest.approx(statistics.median(logged), rel=1e-6)


@pytest.mark.parametrize(
    ("schedule", "set_as"),
    [(None, ""), ("one_cycle", "OneCycleLR's max_lr"), ("warmup_cosine", "the optimizer's lr under LambdaLR")],
)
def test_the_lr_cut_of_clipping_under_sgd_is_said_on_the_lr_set(tmp_path, capsys, schedule, set_as):
    """SGD set at 0.1 on the digits, clipped at 0.2 on (nearly) every step: the clip factor's mean over the steps,
    weighted by the lr each ran at (the schedule's closed form; at a constant lr the plain mean), is the base-lr cut
    that moves the weights as far (Σ lr_t f_t g_t = s Σ lr_t g_t in sum), said on the lr a user sets (under a
    scheduler its base lr: OneCycleLR's max_lr, the optimizer's lr under LambdaLR), the lr now beside it only as
    "now"; the report the same from the logs, over every step (not the logged ones)."""
    torch.manual_seed(0)
    model = DigitsMLP(lr=0.1, schedule=schedule, total_steps=120)
    monitor = GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0)
    logger = TensorBoardLogger(str(tmp_path), name="clip", version=0)
    callbacks = [monitor, LRScalingAdvisor(detect_loss_reduction=False, log_every_n_steps=1)]
    trainer = Trainer(**trainer_kwargs(callbacks=callbacks, logger=logger, max_steps=60, gradient_clip_val=0.2))
    trainer.fit(model, digits_loader(32))
    lr_at = {
        None: lambda step: 0.1,
        "one_cycle": lambda step: one_cycle_lr(0.1, 120, step),
        "warmup_cosine": lambda step: 0.1 * warmup_cosine(12, 120)(step),
    }[schedule]
    factors = [min(1.0, 0.2 / (n + 1e-6)) for n in model.reference_norms]  # torch's clip factor, brute-force norms
    plain = statistics.fmean(factors)
    scale = sum(lr_at(k) * f for k, f in enumerate(factors)) / sum(map(lr_at, range(60)))  # step k runs at lr_at(k)
    assert len(model.reference_norms) == 60 and scale < 0.9
    # OneCycleLR's peak weights the steps apart to 2 digits; under the warmup-cosine they agree to 2 digits here
    # (the report's row, to 1e-5, tells them apart), and the line says the unweighted mean only where it differs.
    assert schedule != "one_cycle" or f"{scale:.2g}" != f"{plain:.2g}"
    cut = f"×{scale:.2g} to {0.1 * scale:.2g} instead"
    line = monitor.summary_line()
    assert f"last ‖g‖ {model.reference_norms[-1]:.4g} (optimizer step 59)," in line  # dated: the report's is 55
    assert f"| {model.reference_norms[-1]:.4g} (step 59) |" in monitor.summary_markdown()
    weighted = (
        f" (the steps' factors in mean weighted by the lr each ran at, Σ lr·f / Σ lr, the base-lr cut that moves the "
        f"weights as far; ×{plain:.2g} unweighted)"
        if f"{scale:.2g}" != f"{plain:.2g}"
        else ""
    )
    assert (
        f"; under SGD, whose step is lr × gradient, it is an lr cut of ×{scale:.2g} over the 60 steps{weighted}: "
        in line
    )
    said = (
        f"base lr 0.1 ({set_as}; now {lr_at(60):.3g} at optimizer step 60)" if schedule else "lr 0.1"
    )  # the next step's lr now
    assert line.endswith(f"or lower the {said} {cut}")
    # The sums are kept in checkpoints: a resumed fit goes on weighting from them.
    kept = monitor.state_dict()["tracks"]["0"]["clipping"]
    assert kept["lr"] == pytest.approx(sum(map(lr_at, range(60))), rel=1e-9)
    assert kept["lr_factor"] / kept["lr"] == pytest.approx(scale, rel=1e-5)
    resumed = GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0)
    resumed.load_state_dict(copy.deepcopy(monitor.state_dict()))
    assert resumed.state_dict()["tracks"]["0"]["clipping"] == kept

    from trainvitals.report.command import main

    main([str(tmp_path / "clip"), "--format", "json"])
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    (finding,) = [f for f in run["findings"] if f["section"] == "gradient clipping"]
    section = {row["label"]: row["value"] for row in run["sections"]["gradient clipping"]}
    assert section["lr cut over every step (factor's lr-weighted mean)"] == pytest.approx(scale, rel=1e-5)
    assert f"an lr cut of ~×{scale:.2g}" in finding["message"]
    logged = f"(the lr set, which a schedule or cut scales; now {lr_at(59):.3g} at the last logged step)"
    said = f"base lr 0.1 {logged}" if schedule else "lr 0.1"
    assert finding["message"].endswith(f"or lower the {said} {cut}.")


@pytest.mark.parametrize("kwargs", [{"gradient_clip_val": 1e-6}, {"norm_type": 1.0}])
def test_no_clipping_line_for_clipping_by_value_or_another_norm(tmp_path, kwargs):
    clip = kwargs.pop("gradient_clip_val", 1e-6)
    model = Regressor(lr=0.0)
    monitor = GradNormMonitor(log_every_n_steps=5, histogram_every_n_steps=0, **kwargs)
    algorithm = "value" if not kwargs else "norm"
    fit(model, monitor, None, max_steps=20, gradient_clip_val=clip, gradient_clip_algorithm=algorithm)
    assert "clipping" not in monitor.summary_line()


class FailsAtStep(Regressor):
    """An optimizer step that raises (an OOM, an optimizer refusing a non-finite gradient) at ``fail_at``."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at

    def configure_optimizers(self):
        module = self

        class Refusing(torch.optim.SGD):
            def step(self, closure=None):
                loss = closure()  # forward, backward, the callbacks' on_before_optimizer_step, clipping
                if module.global_step == module.fail_at:
                    raise FloatingPointError("the optimizer refused the step")
                super().step()
                return loss

        return Refusing(self.parameters(), lr=self.lr)


def test_with_clipping_a_step_that_fails_in_the_optimizer_still_logs_its_norms():
    logger, model = RecordingLogger(), FailsAtStep(fail_at=3)
    with pytest.raises(FloatingPointError):
        fit(
            model,
            GradNormMonitor(log_every_n_steps=3, histogram_every_n_steps=0),
            logger,
            max_steps=10,
            gradient_clip_val=1.0,
        )
    assert [step for step, _ in logger.series["grad_norm/total"]] == [0, 3]
    assert logger.values("grad_norm/total")[-1] == pytest.approx(model.reference_norms[3], rel=1e-6)
    assert [step for step, _ in logger.series["grad_norm/clipped_total"]] == [0]


class ModuleNamedTotal(Regressor):
    """A submodule named like the monitor's own ``total`` tag."""

    def __init__(self) -> None:
        super().__init__()
        self.total = nn.Linear(1, 1)

    def forward(self, x):
        return self.total(super().forward(x))

    def on_before_optimizer_step(self, optimizer):
        super().on_before_optimizer_step(optimizer)
        self.total_layer_norm = flat_grad_norm(self.total.parameters())


def test_a_module_named_total_keeps_its_own_tag():
    logger, model = RecordingLogger(), ModuleNamedTotal()
    fit(model, GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0, grouping="block"), logger, max_steps=2)
    assert logger.values("grad_norm/total") == pytest.approx(model.reference_norms, rel=1e-6)
    assert logger.values("grad_norm/total (layer)")[-1] == pytest.approx(model.total_layer_norm, rel=1e-6)


def test_manual_optimization_two_optimizers_one_total_each():
    logger = RecordingLogger()
    model = GAN(d=6)
    fit(model, GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0), logger, max_steps=6)
    assert logger.values("grad_norm/optimizer_0/total") == pytest.approx(model.reference[0], rel=1e-6)
    assert logger.values("grad_norm/optimizer_1/total") == pytest.approx(model.reference[1], rel=1e-6)
    assert "grad_norm/optimizer_0/gen.0" in logger.series
    assert "grad_norm/optimizer_1/disc.0" in logger.series


def test_compiled_module_gives_the_eager_norms():
    eager, compiled = Regressor(), Regressor()
    compiled.load_state_dict(eager.state_dict())
    log_eager, log_compiled = RecordingLogger(), RecordingLogger()
    fit(eager, GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0), log_eager, max_steps=4)
    fit(
        torch.compile(compiled, backend="aot_eager"),
        GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0),
        log_compiled,
        max_steps=4,
    )
    assert log_compiled.values("grad_norm/total") == pytest.approx(log_eager.values("grad_norm/total"), rel=1e-5)
    assert log_compiled.values("grad_norm/net.2") == pytest.approx(log_eager.values("grad_norm/net.2"), rel=1e-5)


def test_a_compiled_submodule_keeps_its_layer_names():
    model = Regressor()
    model.net = torch.compile(model.net, backend="aot_eager")
    logger = RecordingLogger()
    fit(model, GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0), logger, max_steps=2)
    assert {t for t in logger.series if t.startswith("grad_norm/net")} == {
        "grad_norm/net.0",
        "grad_norm/net.2",
        "grad_norm/net.4",
    }


def _fit_with_spikes(caplog, factors: dict[int, float]) -> RecordingLogger:
    """41 steps of a frozen Regressor whose loss is × ``factors[step]`` at those steps, under a monitor logging every
    10th step (warm-up 10), with INFO records captured."""

    class Spiky(Regressor):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx) * factors.get(self.global_step, 1.0)

    logger = RecordingLogger()
    with caplog.at_level("INFO"):
        fit(
            Spiky(lr=0.0),
            GradNormMonitor(log_every_n_steps=10, histogram_every_n_steps=0, spike_warmup_steps=10),
            logger,
            max_steps=41,
        )
    return logger


def test_spike_is_reported_with_step_and_largest_layers(caplog):
    logger = _fit_with_spikes(caplog, {30: 1000.0})
    assert logger.values("grad_norm/spike_steps") == [0, 0, 0, 1, 1]
    reports = [r.message for r in caplog.records if "spike at optimizer step" in r.message]
    assert len(reports) == 1
    assert "spike at optimizer step 30: " in reports[0] and "× its running average" in reports[0]
    assert "largest layers: net." in reports[0]


def test_two_spikes_in_one_logging_window_say_the_first_and_panel_both(caplog, monkeypatch):
    """Spikes at steps 32 and 35, read back together at the logging step 40: the console's one line is the fit's
    first spike, step 32 (not the window's latest), and the text panel gets each at its own step."""
    panels: list[tuple[str, int]] = []
    monkeypatch.setattr(
        "trainvitals.norms.monitor.log_text", lambda trainer, tag, text, step: panels.append((text, step))
    )
    logger = _fit_with_spikes(caplog, {32: 1000.0, 35: 300.0})
    assert logger.values("grad_norm/spike_steps") == [0, 0, 0, 0, 2]
    said = [r.getMessage() for r in caplog.records if "spike at optimizer step" in r.getMessage()]
    assert len(said) == 1 and "spike at optimizer step 32: " in said[0]
    spikes = [(text.split(":")[0], step) for text, step in panels if "spike at optimizer step" in text]
    assert spikes == [
        ("gradient-norm spike at optimizer step 32", 32),
        ("gradient-norm spike at optimizer step 35", 35),
    ]


def test_tensorboard_scalars_and_histograms(tmp_path):
    tb = TensorBoardLogger(tmp_path, name="tb", default_hp_metric=False)
    fit(Regressor(), GradNormMonitor(log_every_n_steps=2, histogram_every_n_steps=4), tb, max_steps=8)
    events = EventAccumulator(tb.log_dir, size_guidance={"histograms": 0, "scalars": 0})
    events.Reload()
    tags = events.Tags()
    assert [e.step for e in events.Scalars("grad_norm/total")] == [0, 2, 4, 6]
    assert "grad_norm/net.0" in tags["scalars"]
    assert {"grad_norm/hist/net.0", "grad_norm/hist/group_norms"} <= set(tags["histograms"])
    assert [e.step for e in events.Histograms("grad_norm/hist/net.0")] == [0, 4]


def test_csv_logger_gets_scalars_and_a_single_notice_about_histograms(tmp_path, caplog):
    csv = CSVLogger(tmp_path, name="csv")
    _writers._notices.clear()  # the notice is once per process; earlier tests may have had it
    with caplog.at_level("INFO"):
        fit(
            Regressor(),
            GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=1),
            [csv, RecordingLogger()],
            max_steps=3,
        )
    text = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text()
    assert "grad_norm/total" in text.splitlines()[0]
    assert sum("need a TensorBoardLogger" in r.message for r in caplog.records) == 1


def test_no_logger_runs_and_measures():
    monitor = GradNormMonitor(log_every_n_steps=1)
    model = Regressor()
    fit(model, monitor, False, max_steps=3)
    assert monitor.last_total[0].item() == pytest.approx(model.reference_norms[-1], rel=1e-6)


def test_state_round_trips(tmp_path):
    monitor = GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0)
    trainer = fit(Regressor(), monitor, False, max_steps=5)
    trainer.save_checkpoint(tmp_path / "five.ckpt")
    restored = GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0)
    trainer = Trainer(**trainer_kwargs(callbacks=[restored], logger=RecordingLogger(), max_steps=6))
    trainer.fit(Regressor(), loader(regression_data(64), 8), ckpt_path=tmp_path / "five.ckpt")
    assert restored._tracks[0].steps == 6
    assert restored._tracks[0].spikes.count == 6
    assert restored._tracks[0].spikes.average == pytest.approx(monitor._tracks[0].spikes.average, rel=0.5)
    assert monitor.state_key == restored.state_key


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"norm_type": 0}, "norm_type"),
        ({"norm_type": "l2"}, "norm_type"),
        ({"grouping": "layer"}, "grouping"),
        ({"log_every_n_steps": 0}, "log_every_n_steps"),
        ({"histogram_every_n_steps": -1}, "histogram_every_n_steps"),
        ({"spike_factor": 1.0}, "spike_factor"),
        ({"ema_beta": 1.0}, "ema_beta"),
        ({"spike_warmup_steps": -1}, "spike_warmup_steps"),
    ],
)
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        GradNormMonitor(**kwargs)


@pytest.mark.parametrize("p", [1.0, 1.5, math.inf])
def test_p_norms(p):
    logger = RecordingLogger()
    model = Regressor()
    monitor = GradNormMonitor(norm_type=p, log_every_n_steps=1, histogram_every_n_steps=0)
    expected = []

    class Probe(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            flat = torch.cat([q.grad.reshape(-1).double() for q in pl_module.parameters()])
            expected.append(torch.linalg.vector_norm(flat, p).item())

    trainer = Trainer(**trainer_kwargs(callbacks=[monitor, Probe()], logger=logger, max_steps=3))
    trainer.fit(model, loader(regression_data(), 8))
    assert logger.values("grad_norm/total") == pytest.approx(expected, rel=1e-6)


def test_the_same_monitor_measures_a_new_model_on_a_new_fit():
    monitor = GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0)
    for _ in range(2):
        model = Regressor()
        fit(model, monitor, False, max_steps=3)
        assert monitor.last_total[0].item() == pytest.approx(model.reference_norms[-1], rel=1e-6)
        assert monitor._tracks[0].steps == 3


class Unfreezes(Regressor):
    """The first layer is frozen and outside the optimizer until epoch 1 (as BackboneFinetuning does)."""

    def on_train_epoch_start(self):
        first = self.net[0]
        if self.current_epoch == 0:
            first.requires_grad_(False)
        elif not first.weight.requires_grad:
            first.requires_grad_(True)
            self.trainer.optimizers[0].add_param_group({"params": list(first.parameters())})

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.net[1:].parameters()], lr=self.lr)


def test_parameters_added_to_the_optimizer_later_are_measured():
    logger = RecordingLogger()
    model = Unfreezes()
    fit(model, GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0), logger, max_epochs=2)
    assert logger.values("grad_norm/total") == pytest.approx(model.reference_norms, rel=1e-6)
    assert len(logger.values("grad_norm/net.0")) == 8  # logged once it has a gradient


def test_a_lasting_level_shift_is_followed_not_counted_as_spikes_forever():
    class Shifts(Regressor):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * 10.0 if self.global_step >= 30 else loss

    logger = RecordingLogger()
    fit(
        Shifts(lr=0.0),
        GradNormMonitor(log_every_n_steps=10, histogram_every_n_steps=0, spike_factor=3.0, spike_warmup_steps=10),
        logger,
        max_steps=200,
    )
    spikes = logger.values("grad_norm/spike_steps")
    assert spikes[3] >= 1  # the shift is a spike at first
    assert spikes[-1] == spikes[-10] < 40  # then the running average has caught up


def test_a_run_of_consecutive_spikes_is_said_once_and_counted(caplog):
    """A 10× level shift at step 30 is a spike at every step until the EMA catches up: the console says the
    first, once; the counter and the fit-end line count them all, as the rule does on the logged totals."""

    class Shifts(Regressor):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * 10.0 if self.global_step >= 30 else loss

    logger = RecordingLogger()
    monitor = GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0, spike_factor=3.0, spike_warmup_steps=10)
    with caplog.at_level("INFO"):
        fit(Shifts(lr=0.0), monitor, logger, max_steps=80)
    flags = [f is not None for f in spike_ratios(logger.values("grad_norm/total"), 3.0, monitor.ema_beta, 10)]
    assert not any(flags[:30]) and all(flags[30:40])  # a run of consecutive spikes from the shift on
    assert logger.values("grad_norm/spike_steps")[-1] == sum(flags)
    said = [r.getMessage() for r in caplog.records if "spike at optimizer step" in r.getMessage()]
    assert len(said) == 1 and "spike at optimizer step 30: " in said[0] and "grad_norm/spike_steps" in said[0]
    assert f"spikes {sum(flags)}" in monitor.summary_line()


def _counting_transfers(monitor, monkeypatch):
    """Count host transfers (``tolist``/``item``/``float``) inside the monitor's per-step hook, per call."""
    counts, inside = [], [False]
    for name in ("tolist", "item", "__float__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            if inside[0]:
                counts[-1] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    hook = monitor.on_before_optimizer_step

    def timed_hook(*args, **kwargs):
        counts.append(0)
        inside[0] = True
        try:
            return hook(*args, **kwargs)
        finally:
            inside[0] = False

    monitor.on_before_optimizer_step = timed_hook  # Lightning looks hooks up on the instance
    return counts


def test_only_logging_steps_move_numbers_to_the_host(monkeypatch):
    monitor = GradNormMonitor(log_every_n_steps=4, histogram_every_n_steps=0)
    transfers = _counting_transfers(monitor, monkeypatch)
    logger = RecordingLogger()
    model = Regressor()
    fit(model, monitor, logger, max_steps=10)
    assert [i for i, n in enumerate(transfers) if n] == [0, 4, 8]
    assert max(transfers) == 1  # the window's totals and the last step's groups in one transfer
    assert logger.values("grad_norm/total") == pytest.approx(model.reference_norms[::4], rel=1e-6)


def test_rare_logging_reads_back_every_max_pending_steps_and_still_counts(monkeypatch):
    class NaNAt(Regressor):
        def on_after_backward(self):
            if self.global_step in (5, 300):
                self.net[0].weight.grad[0, 0] = float("nan")

        def on_before_optimizer_step(self, optimizer):
            for p in self.parameters():
                p.grad.nan_to_num_(0.0)

    monitor = GradNormMonitor(log_every_n_steps=10**6, histogram_every_n_steps=0)
    transfers = _counting_transfers(monitor, monkeypatch)
    with pytest.warns(UserWarning, match=r"non-finite gradient.*first in: net\.0"):
        fit(NaNAt(lr=0.0), monitor, False, max_steps=2 * MAX_PENDING_STEPS + 10)
    assert [i for i, n in enumerate(transfers) if n] == [0, MAX_PENDING_STEPS, 2 * MAX_PENDING_STEPS]
    assert monitor.state_dict()["tracks"]["0"]["counts"]["nonfinite_steps"] == 2


def test_a_nonfinite_step_after_the_last_logging_step_is_logged_at_the_end():
    class NaNLast(Regressor):
        def on_after_backward(self):
            if self.global_step == 6:
                self.net[2].weight.grad[0, 0] = float("inf")

    logger = RecordingLogger()
    with pytest.warns(UserWarning, match=r"non-finite gradient.*first in: net\.2"):
        fit(NaNLast(lr=0.0), GradNormMonitor(log_every_n_steps=5, histogram_every_n_steps=0), logger, max_steps=7)
    assert logger.series["grad_norm/nonfinite_steps"] == [(0, 0.0), (5, 0.0), (6, 1.0)]
    assert [s for s, _ in logger.series["grad_norm/total"]] == [0, 5]  # norms keep their cadence


def test_a_nonfinite_step_just_before_a_regrouping_is_still_reported():
    class NaNBeforeUnfreezing(Unfreezes):
        def on_after_backward(self):
            if self.global_step == 6:  # epoch 0 is steps 0-7; logging at 0 and 5; regrouping at 8
                self.net[2].weight.grad[0, 0] = float("nan")

        def on_before_optimizer_step(self, optimizer):
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.nan_to_num_(0.0)

    logger = RecordingLogger()
    with pytest.warns(UserWarning, match=r"non-finite gradient \(inf/NaN\) at optimizer step 6; first in: net\.2"):
        fit(
            NaNBeforeUnfreezing(lr=0.0),
            GradNormMonitor(log_every_n_steps=5, histogram_every_n_steps=0),
            logger,
            max_epochs=2,
        )
    assert logger.series["grad_norm/nonfinite_steps"] == [(0, 0.0), (5, 0.0), (10, 1.0), (15, 1.0)]


def test_the_end_of_training_report_survives_a_checkpoint_in_between(tmp_path):
    class InfLate(Regressor):
        def on_after_backward(self):
            if self.global_step == 6:
                self.net[2].weight.grad[0, 0] = float("inf")

    logger = RecordingLogger()
    with pytest.warns(UserWarning, match=r"non-finite gradient.*step 6"):
        # ModelCheckpoint saves (and so reads the monitor's state) after step 7, before training ends.
        fit(
            InfLate(lr=0.0),
            GradNormMonitor(log_every_n_steps=5, histogram_every_n_steps=0),
            logger,
            max_epochs=1,
            enable_checkpointing=True,
            default_root_dir=tmp_path,
        )
    assert logger.series["grad_norm/nonfinite_steps"] == [(0, 0.0), (5, 0.0), (7, 2.0)]  # the inf stays in .grad


def test_a_norm_that_was_zero_so_far_is_no_division_by_zero():
    class WeightedLater(Regressor):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * (0.0 if self.global_step < 25 else 1.0)  # e.g. a discriminator loss switched on later

    logger = RecordingLogger()
    fit(WeightedLater(lr=0.0), GradNormMonitor(log_every_n_steps=10, histogram_every_n_steps=0), logger, max_steps=120)
    spikes = logger.values("grad_norm/spike_steps")
    assert spikes[-1] == spikes[-3] < 60  # the switch-on is followed, not flagged forever


class StopAt(pl.Callback):
    """Requests a stop from optimizer step ``step`` on, as a stopping callback does."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *_: object) -> None:
        if trainer.global_step > self.step:
            trainer.should_stop = True


@pytest.mark.parametrize(
    ("overrides", "logged"),
    [
        (dict(max_epochs=2), [0, 5, 10, 15]),  # ends at max_epochs: the cadence only
        (dict(max_epochs=2, stop_at=7), [0, 5, 7]),  # stopped early: the chart ends at the stop
        # Lightning trains on until min_epochs, the request still set, and ends at max_epochs.
        (dict(max_epochs=2, min_epochs=2, stop_at=7), [0, 5, 10, 15]),
        (dict(max_steps=19, min_steps=12, stop_at=7), [0, 5, 10, 11]),  # stops once min_steps allows it
    ],
)
def test_the_cadence_is_kept_unless_the_run_was_stopped_early(overrides, logged):
    logger = RecordingLogger()
    stop_at = overrides.pop("stop_at", None)
    callbacks = [GradNormMonitor(log_every_n_steps=5)] + ([StopAt(stop_at)] if stop_at is not None else [])
    # 9 optimizer steps an epoch: the last step of a fit is never a logging step.
    Trainer(**trainer_kwargs(callbacks=callbacks, logger=logger, **overrides)).fit(
        Regressor(), loader(regression_data(72), 8)
    )
    assert [step for step, _ in logger.series["grad_norm/total"]] == logged


class LBFGSRegressor(Regressor):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=4)


class FirstGradients(pl.Callback):
    """The gradient norm at the first closure evaluation of each step: the gradient at the step's point."""

    def __init__(self) -> None:
        self.norms: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step not in self.norms:
            self.norms[trainer.global_step] = flat_grad_norm(pl_module.parameters())


def test_lbfgs_closure_evaluations_are_one_step():
    """Lightning calls on_before_optimizer_step after each of LBFGS's closure evaluations (4 per step here):
    one total per optimizer step, that of its first evaluation, and one step counted."""
    logger, first, monitor = (
        RecordingLogger(),
        FirstGradients(),
        GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0),
    )
    stopper = GradNormEarlyStopping(mode="threshold", threshold=1e-12, min_steps=0, check_every_n_steps=1)
    trainer = pl.Trainer(
        **trainer_kwargs(max_steps=3, callbacks=[first, monitor, stopper], logger=logger, log_every_n_steps=1)
    )
    trainer.fit(LBFGSRegressor(), loader(regression_data(), 16))
    assert [s for s, _ in logger.series["grad_norm/total"]] == [0, 1, 2]
    assert logger.values("grad_norm/total") == pytest.approx([first.norms[s] for s in range(3)], rel=1e-6)
    assert monitor._tracks[0].steps == 3 and stopper.steps == 3


@pytest.mark.parametrize("every", [1, 10])
def test_under_manual_optimization_the_nan_warning_says_no_producer_is_searched(every):
    """A training_step that steps its optimizers itself is never re-run: the warning says so, whatever the logging
    cadence, instead of a cadence or a TrainingGuard that would not help."""
    monitor = GradNormMonitor(log_every_n_steps=every, histogram_every_n_steps=0)
    trainer = pl.Trainer(**trainer_kwargs(max_steps=30, callbacks=[monitor]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TwoPlayers(20, float("nan")), DataLoader(TensorDataset(torch.randn(640, 8)), batch_size=32))
    said = [str(w.message) for w in caught if "non-finite gradient (inf/NaN)" in str(w.message)]
    assert said and all("not searched under manual optimization" in text for text in said)  # one per optimizer
    assert not any("log_every_n_steps=1" in text or "TrainingGuard()" in text for text in said)


def test_clipping_totals_of_a_checkpoint_without_lr_sums_still_give_a_cut():
    """A checkpoint written before the lr-weighted cut holds no lr sums: the cut is then the plain mean, no KeyError."""
    from trainvitals.norms.monitor import _lr_cut

    old = {"steps": 4, "clipped": 2, "shrink": 1.0, "max_norm": 0.5}
    assert _lr_cut(old) == pytest.approx((1.0 + 4 - 2) / 4)
