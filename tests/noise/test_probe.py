"""BatchVarianceProbe in training: against brute force, closed forms, accumulation, DDP, and what it refuses."""

from __future__ import annotations

import functools
import json
import logging
import math
import re
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from _models import GAN, NoiseOnly, ReleaseProcessGroup
from conftest import HostReads, RecordingLogger, trainer_kwargs
from lightning.pytorch import Trainer
from lightning.pytorch.plugins import MixedPrecision
from per_example.test_guards import Lookup
from per_example.test_in_place import Block, ViT
from per_example.test_per_example_core import Scale, SequenceModel, brute_force, cnn, mlp
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainvitals import GradNormMonitor
from trainvitals.noise.estimate import NoiseSource
from trainvitals.noise.estimators import NoiseScaleEMA, gradient_snr
from trainvitals.noise.probe import BatchVarianceProbe
from trainvitals.noise.probe_sources import ProbeSources
from trainvitals.noise.stopper import GradNormEarlyStopping
from trainvitals.per_example import Layouts, PerExampleGradients
from trainvitals.plumbing.sharing import StepGradNorms


def last_logged(logger: RecordingLogger) -> dict[str, float]:
    """The last value of every ``grad_noise/*`` tag, and of the run's one noise floor."""
    return {
        tag: series[-1][1]
        for tag, series in logger.series.items()
        if tag.startswith(("grad_noise/", "grad_norm/noise_floor")) and series
    }


class Classifier(pl.LightningModule):
    def __init__(self, net: nn.Module, reduction: str = "mean", lr: float = 0.0) -> None:
        super().__init__()
        self.net, self.reduction, self.lr = net, reduction, lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y, reduction=self.reduction)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Regression(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return 0.5 * (self(x).squeeze(-1) - y).square().mean()


class Recorder(pl.Callback):
    """The accumulated gradient of each step and the true ‖G‖², tr Σ of a linear regression, at each step."""

    def __init__(self, truth: Any = None) -> None:
        self.grads: list[torch.Tensor] = []
        self.truth = truth
        self.true_values: list[tuple[float, float]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        self.grads.append(torch.cat([p.grad.flatten() for p in pl_module.parameters()]).clone())
        if self.truth is not None:
            self.true_values.append(self.truth(pl_module))


def fit(
    module: pl.LightningModule,
    data: TensorDataset,
    callbacks: list,
    *,
    batch_size: int,
    steps: int,
    accumulate: int = 1,
    precision: Any = "64-true",
    logger: RecordingLogger | None = None,
    **kwargs: Any,
) -> pl.Trainer:
    plugins = [precision] if isinstance(precision, MixedPrecision) else []
    trainer = pl.Trainer(
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        callbacks=callbacks,
        logger=logger or RecordingLogger(),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        num_sanity_val_steps=0,
        plugins=plugins,
        precision=None if plugins else precision,
        **kwargs,
    )
    trainer.fit(module, DataLoader(data, batch_size=batch_size, shuffle=False))
    return trainer


def classification_data(kind: str, n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    if kind == "mlp":
        return TensorDataset(torch.randn(n, 5, generator=g, dtype=torch.float64), y)
    if kind == "cnn":
        return TensorDataset(torch.randn(n, 2, 6, 6, generator=g, dtype=torch.float64), y)
    return TensorDataset(torch.randint(0, 13, (n, 6), generator=g), y)


def network(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return {"mlp": mlp, "cnn": cnn, "sequence": SequenceModel}[kind]().double()


def brute_force_estimates(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(‖G‖²_est, tr Σ̂, per-example gradients by name) from one backward per example."""
    per_example = brute_force(net, x, y)
    flat = torch.cat([g.flatten(1) for g in per_example.values()], 1)
    trace = (flat - flat.mean(0)).square().sum() / (len(x) - 1)
    return flat.mean(0).square().sum() - trace / len(x), trace, per_example


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run faster on one thread than on the cores the other test processes share."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"measure_every_n_steps": 0},
        {"log_every_n_steps": 0},
        {"histogram_every_n_steps": -1},
        {"ema_beta": 1.0},
        {"loss_reduction": "token"},
        {"fallback_sub_batch": 1},
        {"max_rel_err": 0.0},
        {"top_k": -1},
        {"coordinate_budget": 0},
    ],
)
def test_constructor_rejects(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        BatchVarianceProbe(**kwargs)


@pytest.mark.parametrize("kind", ["mlp", "cnn", "sequence"])
def test_estimates_match_brute_force_in_training(kind):
    data = classification_data(kind, 8)
    probe = BatchVarianceProbe(ema_beta=0.0)  # β = 0: the EMA holds the last step's estimate
    logger = RecordingLogger()
    module = Classifier(network(kind))
    fit(module, data, [probe], batch_size=8, steps=1, logger=logger)
    g2, trace, per_example = brute_force_estimates(module.net, *data.tensors)
    assert rel(float(probe.noise.trace_cov), float(trace)) < 1e-5
    assert rel(float(probe.noise.grad_sq_norm), float(g2)) < 1e-5
    assert probe.effective_batch_size == 8 and "per-example norms in backward" in probe.sources
    logged = last_logged(logger)
    for layer in {n.rpartition(".")[0] for n in per_example}:
        parts = [per_example[n] for n in per_example if n.rpartition(".")[0] == layer]
        snr = torch.cat([brute_gsnr(g).flatten() for g in parts])
        assert rel(logged[f"grad_noise/gsnr/net.{layer}"], float(snr.mean())) < 1e-5
    snr_all = torch.cat([brute_gsnr(g).flatten() for g in per_example.values()])
    assert rel(logged["grad_noise/eb_criterion"], float(1 - 8 * snr_all.mean())) < 1e-5
    # The floor's tr Σ is that of the 8 training examples (finite-population correction, N = 8): S·7/8.
    assert math.isclose(logged["grad_norm/noise_floor"], math.sqrt(float(trace) * 7 / 8 / 8), rel_tol=1e-5)
    assert math.isclose(logged["grad_noise/batch_grad_var/full_batch"], float(trace) * 7 / 8 / 8, rel_tol=1e-5)


def test_float32_training_gives_the_gsnr_of_float64_statistics_where_examples_nearly_agree():
    """Tiny inputs and one class: the examples' bias and output-layer gradients nearly agree (GSNR ~1e5–1e6), whose
    variance float32 sums lose (the layers' GSNR were 14 % and 18 % off, the EB criterion 5 %). The logged GSNR and
    EB criterion match float64 statistics of a float32 per-example loop's gradients, floored at float32's eps: each
    example's loss in the batch's forward, so that they are the same float32 numbers, not a one-example forward's."""
    torch.manual_seed(0)
    x, y = 0.003 * torch.randn(8, 8), torch.zeros(8, dtype=torch.long)
    module, logger = Classifier(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))), RecordingLogger()
    fit(
        module,
        TensorDataset(x, y),
        [BatchVarianceProbe(ema_beta=0.0)],
        batch_size=8,
        steps=1,
        precision="32-true",
        logger=logger,
    )
    params = dict(module.net.named_parameters())
    losses = F.cross_entropy(module.net(x), y, reduction="none")
    grads = [torch.autograd.grad(loss, list(params.values()), retain_graph=True) for loss in losses]
    per_example = {n: torch.stack([g[j] for g in grads]).double() for j, n in enumerate(params)}
    snr = {n: gradient_snr(g.mean(0), g.square().sum(0), 8, precision=torch.float32) for n, g in per_example.items()}
    logged = last_logged(logger)
    for layer in ("0", "2"):
        truth = torch.cat([snr[f"{layer}.weight"].flatten(), snr[f"{layer}.bias"]]).mean()
        assert rel(logged[f"grad_noise/gsnr/net.{layer}"], float(truth)) < 1e-6
    assert max(float(s.max()) for s in snr.values()) > 1e5
    snr_all = torch.cat([s.flatten() for s in snr.values()])
    assert rel(logged["grad_noise/eb_criterion"], float(1 - 8 * snr_all.mean())) < 1e-6


def brute_gsnr(g: torch.Tensor) -> torch.Tensor:
    """GSNR_d of one parameter from its per-example gradients ``(B, *shape)`` themselves: ḡ_d²/σ̂_d², σ̂_d² floored
    as ``noise.estimators.gradient_snr`` floors it (tested against the closed form in noise/test_estimators.py)."""
    return gradient_snr(g.mean(0), g.square().sum(0), g.shape[0])


def layer_gsnr(per_example: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each layer's mean over its coordinates of :func:`brute_gsnr`, by GSNR tag."""
    parts: dict[str, list[torch.Tensor]] = {}
    for n, g in per_example.items():
        parts.setdefault(f"grad_noise/gsnr/net.{n.rpartition('.')[0]}", []).append(brute_gsnr(g).flatten())
    return {tag: float(torch.cat(p).mean()) for tag, p in parts.items()}


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
def test_a_coordinate_budget_rotates_through_the_layers_exactly(tmp_path):
    """lr = 0 and one batch: every step has the same per-example gradients, so a layer's GSNR gathered
    over the rows of consecutive logging steps must equal its one-step value. The mlp's 122 coordinates
    at a budget of 30: a pass of at most ⌈122/30⌉ = 5 logging steps logs every layer once, the EB
    criterion never; a fit resumed in the middle of a pass completes the pass with the same values."""
    data = classification_data("mlp", 8)
    module = Classifier(network("mlp"))
    truth = layer_gsnr(brute_force_estimates(module.net, *data.tensors)[2])
    logger = RecordingLogger()
    probe = BatchVarianceProbe(coordinate_budget=30)
    trainer = fit(module, data, [probe], batch_size=8, steps=10, logger=logger)
    assert "grad_noise/eb_criterion" not in logger.series
    for tag, value in truth.items():
        steps = [step for step, _ in logger.series[tag]]
        gaps = [later - earlier for earlier, later in zip([-1, *steps], steps)]
        assert len(steps) >= 2 and max(gaps) <= math.ceil(122 / 30), tag
        assert all(rel(v, value) < 1e-6 for v in logger.values(tag)), tag

    first = Classifier(network("mlp"))  # checkpointed at step 3, where net.2's pass has begun (see the docstring)
    trainer = fit(
        first, data, [BatchVarianceProbe(coordinate_budget=30)], batch_size=8, steps=3, logger=RecordingLogger()
    )
    state = next(c for c in trainer.callbacks if isinstance(c, BatchVarianceProbe)).state_dict()
    assert state["coordinate_cursor"] > 0 and "grad_noise/gsnr/net.2" in state["gsnr_partial"]
    path = tmp_path / "mid_pass.ckpt"
    trainer.save_checkpoint(path)
    resumed_logger = RecordingLogger()
    pl.Trainer(
        max_steps=4,
        callbacks=[BatchVarianceProbe(coordinate_budget=30)],
        logger=resumed_logger,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        precision="64-true",
    ).fit(Classifier(network("mlp")), DataLoader(data, batch_size=8), ckpt_path=path)
    assert [step for step, _ in resumed_logger.series["grad_noise/gsnr/net.2"]] == [3]
    assert rel(resumed_logger.values("grad_noise/gsnr/net.2")[0], truth["grad_noise/gsnr/net.2"]) < 1e-6


def test_the_collector_holds_at_most_the_coordinate_budget(monkeypatch):
    """The per-coordinate sums a step holds (Σg and Σg², two micro-batches added in place) stay within the
    budget rounded up to a row, on a model 8× over it; at the default budget, which covers this model,
    they are the whole model's. Every layer's GSNR is still logged within a pass."""
    held: list[int] = []
    pop = PerExampleGradients.pop

    def record(self: PerExampleGradients, *args: Any, **kwargs: Any) -> Any:
        step = pop(self, *args, **kwargs)
        held.append(sum(v.numel() for v in [*step.grad_sum.values(), *step.sum_sq.values()]))
        return step

    monkeypatch.setattr(PerExampleGradients, "pop", record)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3)).double()
    total = sum(p.numel() for p in net.parameters())
    data = classification_data("mlp", 64)
    data = TensorDataset(torch.randn(64, 64, dtype=torch.float64), data.tensors[1])
    logger = RecordingLogger()
    fit(
        Classifier(net),
        data,
        [BatchVarianceProbe(coordinate_budget=1000)],
        batch_size=8,
        steps=10,
        accumulate=2,
        logger=logger,
    )
    assert len(held) == 10 and 0 < min(held) and max(held) <= 2 * (1000 + 63)
    assert {f"grad_noise/gsnr/net.{i}" for i in (0, 2, 4)} <= set(logger.series)
    held.clear()
    fit(Classifier(net), data, [BatchVarianceProbe()], batch_size=8, steps=2, accumulate=2)
    assert held == [2 * total] * 2


@pytest.mark.parametrize("told", [False, True])
def test_mean_and_sum_losses_give_the_same_statistics(told):
    data = classification_data("mlp", 32)
    results = []
    for reduction in ("mean", "sum"):
        probe = BatchVarianceProbe(ema_beta=0.5, loss_reduction=reduction if told else "auto")
        fit(Classifier(network("mlp"), reduction), data, [probe], batch_size=8, steps=3)
        results.append((float(probe.noise.trace_cov), float(probe.noise.grad_sq_norm)))
    assert rel(results[1][0], results[0][0]) < 1e-9 and rel(results[1][1], results[0][1]) < 1e-9


class TokenSumOverTheStep(pl.LightningModule):
    """A per-token model whose loss is transformers' ``num_items_in_batch`` normalisation: each micro-batch's token
    sum over a fixed 35, times the accumulate_grad_batches Lightning divides by."""

    TOKENS = 35

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Embedding(13, 4), nn.Linear(4, 5)).double()

    def token_sum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mask = y != -100
        return F.cross_entropy(self.net(x)[mask], y[mask], reduction="sum")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.token_sum(*batch) / self.TOKENS * self.trainer.accumulate_grad_batches

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_a_token_sum_over_the_steps_tokens_is_measured_at_its_own_scale(caplog):
    """Micro-batches of 4 sequences, 2 per step, their token sums divided by 35 (no multiple of the 8 examples):
    neither a mean nor a sum over the examples. Each example's gradient is that of its token sum scaled by B/35
    (B = 8): tr Σ and ‖G‖² against one backward per example, and they average to the step's .grad."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 13, (8, 6), generator=g), torch.randint(0, 5, (8, 6), generator=g)
    for i, n in enumerate([2, 6, 3, 5, 1, 6, 4, 2]):  # 29 tokens kept
        y[i, n:] = -100
    module, probe, recorder = TokenSumOverTheStep(), BatchVarianceProbe(ema_beta=0.0), Recorder()
    with caplog.at_level(logging.INFO):
        fit(module, TensorDataset(x, y), [probe, recorder], batch_size=4, steps=1, accumulate=2)
    per_example = []
    for i in range(8):  # brute force: each example's token sum, scaled by B/35
        module.zero_grad()
        (module.token_sum(x[i : i + 1], y[i : i + 1]) * 8 / TokenSumOverTheStep.TOKENS).backward()
        per_example.append(torch.cat([p.grad.flatten() for p in module.parameters()]))
    flat = torch.stack(per_example)
    trace = (flat - flat.mean(0)).square().sum() / 7
    assert rel(float(probe.noise.trace_cov), float(trace)) < 1e-6
    assert rel(float(probe.noise.grad_sq_norm), float(flat.mean(0).square().sum() - trace / 8)) < 1e-6
    assert probe.grad_scale == 1.0 and float((flat.mean(0) - recorder.grads[0]).norm()) < 1e-9  # ḡ is the .grad
    assert "a sum of its terms divided by 35 over the optimizer step" in caplog.text
    assert "the loss is a sum over the examples" not in caplog.text
    assert "the loss is a mean over the examples" not in caplog.text


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_one_noise_floor_is_in_the_units_of_the_gradient_norm_beside_it(accumulate):
    """A loss summed over a micro-batch of b has b× the .grad of its mean: the norm and the run's one
    floor on the "gradient norm vs noise floor" chart scale together, so the chart reads the same for
    either loss. With accumulation the probe and the stopper's micro-batches feed the same estimate."""
    data = classification_data("mlp", 32)
    runs = {}
    for reduction in ("mean", "sum"):
        logger = RecordingLogger()
        callbacks = [GradNormMonitor(), BatchVarianceProbe(ema_beta=0.5), GradNormEarlyStopping(ema_beta=0.5)]
        fit(
            Classifier(network("mlp"), reduction),
            data,
            callbacks,
            batch_size=8 // accumulate,
            steps=3,
            accumulate=accumulate,
            logger=logger,
        )
        runs[reduction] = {
            tag: logger.values(tag)[-1] for tag in ("grad_norm/total", "grad_norm/noise_floor", "grad_noise/trace_cov")
        }
        assert "grad_noise/noise_floor" not in logger.series and "grad_norm/b_simple" not in logger.series
    b = 8 // accumulate
    mean, summed = runs["mean"], runs["sum"]
    assert rel(summed["grad_noise/trace_cov"], b**2 * mean["grad_noise/trace_cov"]) < 1e-9  # .grad units
    for tag in ("grad_norm/total", "grad_norm/noise_floor"):
        assert rel(summed[tag], b * mean[tag]) < 1e-9, tag
    assert rel(mean["grad_norm/noise_floor"], math.sqrt(mean["grad_noise/trace_cov"] / 8)) < 1e-9


def test_accumulated_gradient_is_the_batch_gradient_and_so_are_the_estimates():
    data = classification_data("mlp", 64)
    runs = []
    for accumulate, batch_size in ((4, 16), (1, 64)):
        probe, recorder = BatchVarianceProbe(ema_beta=0.0), Recorder()
        fit(Classifier(network("mlp")), data, [probe, recorder], batch_size=batch_size, steps=1, accumulate=accumulate)
        runs.append((recorder.grads[0], float(probe.noise.trace_cov), float(probe.noise.grad_sq_norm)))
        assert probe.effective_batch_size == 64
    (grad_acc, trace_acc, g2_acc), (grad_full, trace_full, g2_full) = runs
    assert float((grad_acc - grad_full).norm() / grad_full.norm()) < 1e-6
    assert rel(trace_acc, trace_full) < 1e-6 and rel(g2_acc, g2_full) < 1e-6


def test_accumulation_is_not_noisier_than_the_equivalent_batch():
    """The source article: 4 micro-batches of 16 have variance ∝ 1/16. Truth: tr Σ/64, like a batch of 64."""
    steps = 40
    data = classification_data("mlp", 64 * steps, seed=3)
    probe, recorder = BatchVarianceProbe(ema_beta=0.98, log_every_n_steps=steps - 1), Recorder()
    logger = RecordingLogger()
    fit(Classifier(network("mlp")), data, [probe, recorder], batch_size=16, steps=steps, accumulate=4, logger=logger)
    grads = torch.stack(recorder.grads)
    spread = float((grads - grads.mean(0)).square().sum(1).mean()) * steps / (steps - 1)
    logged = last_logged(logger)
    assert 0.7 < spread / logged["grad_noise/batch_grad_var/full_batch"] < 1.4  # not 4: tr Σ/16
    assert math.isclose(
        logged["grad_noise/batch_grad_var/micro_batch"], 4 * logged["grad_noise/batch_grad_var/full_batch"]
    )


def _mixed_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Scale(5), nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))


def as_float32(data: TensorDataset) -> TensorDataset:
    x, y = data.tensors
    return TensorDataset(x.float(), y)


@pytest.mark.parametrize("source", ["micro_batches", "vmap"])
def test_fallback_sources_match_their_formulas(source):
    """A layer without a per-example identity: measured from micro-batch means (4 × 4) or torch.func (4 of 16)."""
    data = classification_data("mlp", 16)
    probe = BatchVarianceProbe(ema_beta=0.0, fallback_sub_batch=4)
    module = Classifier(_mixed_net())
    accumulate, batch_size = (4, 4) if source == "micro_batches" else (1, 16)
    # float32: MicroBatchSquaredNorms (core/noise.py) takes fp32 norms and rejects float64 gradients
    precision, tolerance = ("32-true", 1e-4) if source == "micro_batches" else ("64-true", 1e-6)
    fit(
        module,
        as_float32(data) if precision == "32-true" else data,
        [probe],
        batch_size=batch_size,
        steps=1,
        accumulate=accumulate,
        precision=precision,
    )
    assert (
        "micro-batches/ranks" if source == "micro_batches" else "torch.func vmap on a sub-batch of up to 4 examples"
    ) in probe.sources
    per_example = brute_force(module.net.double(), *data.tensors)
    linear = torch.cat([g.flatten(1) for n, g in per_example.items() if not n.startswith("0.")], 1)
    trace = (linear - linear.mean(0)).square().sum() / 15
    g2 = linear.mean(0).square().sum() - trace / 16
    scale = per_example["0.scale"]
    if source == "micro_batches":  # McCandlish Eq. A.2 with n = 4 groups of b = 4
        groups = scale.view(4, 4, -1).mean(1)
        m, full = groups.square().sum(1).mean(), scale.mean(0).square().sum()
        g2, trace = g2 + (4 * full - m) / 3, trace + 16 * (m - full) / 3
    else:  # Bessel variance of the first 4 examples; ‖G‖² from the batch of 16
        sub = scale[:4]
        sub_trace = (sub - sub.mean(0)).square().sum() / 3
        g2, trace = g2 + scale.mean(0).square().sum() - sub_trace / 16, trace + sub_trace
    assert rel(float(probe.noise.trace_cov), float(trace)) < tolerance
    assert rel(float(probe.noise.grad_sq_norm), float(g2)) < tolerance


def test_closed_form_linear_regression():
    """x ~ N(0, I_d), y = w*·x + ε, ε ~ N(0, σ²), ℓ = ½(w·x − y)², r = w − w*:
    G = r, ‖G‖² = ‖r‖², tr Σ = (d + 1)‖r‖² + dσ² (Isserlis), at every w."""
    d, sigma, batch, steps = 8, 0.5, 256, 200
    g = torch.Generator().manual_seed(0)
    w_star = torch.randn(d, generator=g, dtype=torch.float64)
    x = torch.randn(batch * steps, d, generator=g, dtype=torch.float64)
    y = x @ w_star + sigma * torch.randn(batch * steps, generator=g, dtype=torch.float64)
    torch.manual_seed(0)
    net = nn.Linear(d, 1, bias=False).double()

    def truth(module: pl.LightningModule) -> tuple[float, float]:
        r2 = float((module.net.weight.detach()[0] - w_star).square().sum())
        return r2, (d + 1) * r2 + d * sigma**2

    beta = 0.95
    probe, recorder = BatchVarianceProbe(ema_beta=beta), Recorder(truth)
    history = []

    class Watch(pl.Callback):
        def on_train_batch_end(self, *_: Any) -> None:
            history.append((float(probe.noise.grad_sq_norm), float(probe.noise.trace_cov)))

    fit(Regression(net, lr=0.002), TensorDataset(x, y), [probe, recorder, Watch()], batch_size=batch, steps=steps)
    expected = NoiseScaleEMA(beta)
    worst = [0.0, 0.0]
    for step, ((true_g2, true_trace), (g2, trace)) in enumerate(zip(recorder.true_values, history)):
        expected.update(torch.tensor(true_g2), torch.tensor(true_trace))
        if step >= 50:
            worst = [
                max(worst[0], rel(g2, float(expected.grad_sq_norm))),
                max(worst[1], rel(trace, float(expected.trace_cov))),
            ]
    assert worst[0] < 0.1 and worst[1] < 0.1, worst


def _probe_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "BatchVarianceProbe: cannot measure" in str(w.message)]


class LeafLoss(Classifier):
    """Returns the loss rebuilt from its value: a leaf, so backward reaches no parameter."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.tensor(super().training_step(batch, batch_idx).item(), requires_grad=True)


@pytest.mark.parametrize("case", ["batch_of_one", "nothing_supported", "leaf_loss"])
def test_unavailable_warns_once_and_logs_nothing(case):
    if case == "batch_of_one":
        module, batch_size, probe = Classifier(network("mlp")), 1, BatchVarianceProbe()
    elif case == "leaf_loss":
        module, batch_size, probe = LeafLoss(network("mlp")), 8, BatchVarianceProbe()
    else:
        torch.manual_seed(0)
        module, batch_size, probe = (
            Classifier(nn.Sequential(Scale(5), nn.Tanh())),
            8,
            BatchVarianceProbe(fallback=False),
        )
    logger = RecordingLogger()
    data = TensorDataset(classification_data("mlp", 32).tensors[0], torch.randint(0, 3, (32,)))
    stopper = GradNormEarlyStopping(
        mode="noise_band", patience=1, margin=1e6, min_steps=0, check_every_n_steps=1
    )  # would stop at once on any data
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = fit(module, data, [probe, stopper], batch_size=batch_size, steps=4, logger=logger)
    assert trainer.global_step == 4 and not trainer.should_stop
    (message,) = _probe_warnings(record)
    if case == "nothing_supported":  # the reason of the plan, not a guess at it
        assert (
            "no parameter has a source (one micro-batch per step on one device): Scale has no per-example "
            "identity, fallback off" in message
        )
    assert last_logged(logger) == {}
    assert int(probe.noise.count) == 0 and not bool(probe.noise.in_noise_band(batch_size, 1.0))
    assert math.isfinite(float(probe.noise.trace_cov)) and math.isfinite(float(probe.noise.grad_sq_norm))


@pytest.mark.parametrize("told", ["auto", "sum"])
def test_an_empty_batch_is_left_out_with_a_warning(told):
    """A batch of 0 examples (e.g. from a filtering collate_fn): its step is not measured, the run goes on."""
    x, y = classification_data("mlp", 8).tensors[0], torch.randint(0, 3, (8,))
    batches = DataLoader([(x, y), (x[:0], y[:0]), (x, y)], batch_size=None)
    probe, logger = BatchVarianceProbe(loss_reduction=told), RecordingLogger()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = Trainer(
            **trainer_kwargs(callbacks=[probe], logger=logger, max_steps=3, log_every_n_steps=1, precision="64-true")
        )
        trainer.fit(Classifier(network("mlp"), reduction="sum"), batches)
    assert trainer.global_step == 3 and int(probe.noise.count) == 2
    assert any("an empty micro-batch" in w for w in _probe_warnings(record))
    assert all(math.isfinite(v) for values in logger.series.values() for _, v in values)


def test_batchnorm_micro_batch_warning_and_the_deviation_it_causes():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    data = as_float32(classification_data("mlp", 64))
    probe = BatchVarianceProbe()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(Classifier(net), data, [probe], batch_size=2, steps=2, accumulate=4, precision="32-true")
    assert "BatchNorm (net.1) couples the examples" in probe.sources
    assert any("every feature becomes ±1" in str(w.message) for w in record)

    x, y = data.tensors
    net.train()

    def accumulated_gradient(micro: int) -> torch.Tensor:
        net.zero_grad()
        for chunk in range(0, 64, micro):
            (F.cross_entropy(net(x[chunk : chunk + micro]), y[chunk : chunk + micro]) * micro / 64).backward()
        return torch.cat([p.grad.flatten() for p in net.parameters()])

    full = accumulated_gradient(64)
    deviation = {m: float((accumulated_gradient(m) - full).norm() / full.norm()) for m in (32, 16, 8, 4)}
    print(f"BatchNorm: ‖accumulated − full-batch gradient‖/‖full‖ by micro-batch size: {deviation}")
    assert deviation[32] < deviation[16] < deviation[8] < deviation[4] and deviation[32] > 1e-3


def _batchnorm_fit(accumulate: int, monkeypatch: pytest.MonkeyPatch, **probe_args: Any) -> tuple[Any, ...]:
    """A BatchNorm MLP fitted with a probe and a stopper: (probe, its info lines, the warnings, the logger)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    probe, stopper, logger = BatchVarianceProbe(**probe_args), GradNormEarlyStopping(min_steps=0), RecordingLogger()
    said: list[str] = []
    monkeypatch.setattr(probe, "info", lambda text, once=False: said.append(text))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(
            Classifier(net),
            as_float32(classification_data("mlp", 64)),
            [probe, stopper],
            batch_size=8,
            steps=24 // accumulate,
            accumulate=accumulate,
            precision="32-true",
            logger=logger,
        )
    return probe, said, [str(w.message) for w in record], logger


def test_the_end_line_names_the_probes_batch_when_no_source_is_valid(monkeypatch):
    """With no valid source the estimate has no batch: the end line gives the probe's own, never None, and the
    reason follows as one sentence, without parentheses nested in parentheses."""
    probe, _, _, _ = _batchnorm_fit(1, monkeypatch)
    line = probe.summary_line()
    assert line.startswith("no reliable B_simple at an effective batch of 8 from 24 measured optimizer steps: ")
    assert "None" not in line and "((" not in line and "))" not in line and "no valid noise source" in line


@pytest.mark.parametrize("accumulate", [1, 2])
def test_with_batchnorm_the_fit_start_line_says_gsnr_and_eb_are_not_logged(accumulate, monkeypatch):
    """Per-layer GSNR and the EB criterion need independent per-example gradients: with BatchNorm in training
    mode they are never logged (an EarlyStopping on eb_criterion finds no key), and the first line says so."""
    probe, said, _, logger = _batchnorm_fit(accumulate, monkeypatch)
    first = said[0]
    assert first.startswith("planned sources") and "grad_noise/gsnr/* and grad_noise/eb_criterion, which need" in first
    assert (
        "measured from micro-batches and ranks" if accumulate > 1 else "not logged while BatchNorm is in training mode"
    ) in first
    assert not [tag for tag in logger.series if tag.startswith(("grad_noise/gsnr", "grad_noise/eb_criterion"))]
    _, said, _, logger = _batchnorm_fit(accumulate, monkeypatch, per_coordinate=False)
    assert "not logged" not in said[0]  # turned off by the user: nothing to explain


def test_without_batchnorm_the_fit_start_line_promises_nothing_missing(monkeypatch):
    probe, logger = BatchVarianceProbe(), RecordingLogger()
    said: list[str] = []
    monkeypatch.setattr(probe, "info", lambda text, once=False: said.append(text))
    fit(Classifier(network("mlp")), classification_data("mlp", 32), [probe], batch_size=8, steps=2, logger=logger)
    assert "not logged" not in said[0] and "grad_noise/eb_criterion" in logger.series


def test_batchnorm_on_one_device_is_explained_once_and_referred_to_briefly(monkeypatch):
    """The full explanation, with what would measure the noise, is one warning; the sources line, the stopper's
    caveat and both end-of-fit lines refer to it in brief, and the end line names the batch, never None."""
    probe, said, warned, _ = _batchnorm_fit(1, monkeypatch)
    full = [w for w in warned if "normalises each example with its micro-batch's statistics" in w]
    assert len(full) == 1 and "(net.1)" in full[0] and "GroupNorm or LayerNorm instead of BatchNorm" in full[0]
    caveat = next(w for w in warned if "cannot decide" in w)
    texts = [said[0], caveat, probe.summary_line()]
    assert all("couples the examples, and" not in t and "normalises each example" not in t for t in texts)
    assert all(t.count("(") <= t.count(")") and "((" not in t and "))" not in t for t in texts)
    assert "BatchNorm in training mode" in caveat and "accumulate_grad_batches >= 2" in caveat


class StepValues(pl.Callback):
    """The probe's estimate and coverage right after its measurement of optimizer step ``step`` (read outside the
    probe's hooks): that step's values under ``ema_beta=0``, and at the first step under any (bias correction)."""

    def __init__(self, step: int = 0) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        probe = next(c for c in trainer.callbacks if isinstance(c, BatchVarianceProbe))
        if trainer.global_step == self.step:
            self.values = (
                float(probe.noise.trace_cov),
                float(probe.noise.grad_sq_norm),
                float(probe.noise_source.norm_share),
                sorted(v for _, v in probe.last_outliers),
            )


class LookupRegression(pl.LightningModule):
    """A recommender: one item id per example, looked up in a table ((B,) integer ids), regressed on a target."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Lookup().double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, y = batch
        return (self.net(ids).squeeze(-1) - y).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize("shared", [False, True])
def test_per_example_ids_cost_no_host_read_between_logging_steps(monkeypatch, shared):
    """1-D ids of B integers are told from arange(B) on the device: the probe reads the host only at logging
    steps (every 4th), where it decides them. Per-example ids are measured at every step; ids arange(B), a table
    shared by the batch (here from step 1 on), leave the lookup out of the steps until the next logging step on
    the device (its parameters counted as not measured, as after the re-plan), that one decides it, and the
    lookup is excluded from then on: every step is measured."""
    torch.manual_seed(0)
    n = 8 * 12
    ids = torch.randint(0, 9, (n,))
    if shared:
        ids[8:] = torch.arange(8).repeat(11)
    data = TensorDataset(ids, torch.randn(n, dtype=torch.float64))
    probe, second = BatchVarianceProbe(histogram_every_n_steps=0, log_every_n_steps=4, ema_beta=0.0), StepValues(2)
    host = HostReads(monkeypatch)
    host.watch(probe, ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step"))
    module = LookupRegression()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(module, data, [probe, second], batch_size=8, steps=12)
    monkeypatch.undo()
    assert {step for step, _ in host.reads} <= {0, 4, 8} and host.reads
    assert ("net.items" in probe._excluded) == shared
    assert any("shared by the batch" in str(w.message) for w in record) == shared
    assert int(probe.noise.count) == 12
    # Step 2, undecided on the host: over the head alone when shared, as brute force says (lr = 0).
    net, x, y = module.net, *data.tensors
    per_example = []
    for i in range(16, 24):
        net.zero_grad()
        (net(x[i : i + 1]).squeeze(-1) - y[i : i + 1]).square().sum().backward()
        per_example.append(
            torch.cat(
                [p.grad.flatten() for name, p in net.named_parameters() if not (shared and name.startswith("items"))]
            )
        )
    flat = torch.stack(per_example)
    trace = (flat - flat.mean(0)).square().sum() / 7
    trace_cov, grad_sq_norm, coverage, _ = second.values
    assert rel(trace_cov, float(trace)) < 1e-9
    assert rel(grad_sq_norm, float(flat.mean(0).square().sum() - trace / 8)) < 1e-9
    assert (coverage < 1 - 1e-6) == shared


def test_outlying_examples_are_reported_by_index():
    data = classification_data("mlp", 16)
    data.tensors[1][11] = (data.tensors[1][11] + 1) % 3  # a wrong label: a large gradient
    probe = BatchVarianceProbe(histogram_every_n_steps=1, top_k=3)
    module = Classifier(network("mlp"))
    fit(module, data, [probe], batch_size=16, steps=1)
    norms = sum(g.flatten(1).square().sum(1) for g in brute_force(module.net, *data.tensors).values()).sqrt()
    truth = torch.topk(norms, 3)
    assert [i for i, _ in probe.last_outliers] == truth.indices.tolist()
    assert torch.allclose(torch.tensor([v for _, v in probe.last_outliers], dtype=torch.float64), truth.values)


class IndexedClassifier(Classifier):
    """A dict batch that carries each example's dataset row under ``index``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step((batch["x"], batch["y"]), batch_idx)


def test_outliers_are_dataset_rows_from_the_batch_index_or_a_sequential_sampler():
    data = classification_data("mlp", 16)
    module = Classifier(network("mlp"))
    norms = sum(g.flatten(1).square().sum(1) for g in brute_force(module.net, *data.tensors).values()).sqrt()
    truth = torch.topk(norms, 2).indices.tolist()  # the dataset rows of the two largest, by brute force

    # Sequential, in batches of 8 (2 micro-batches per step): step 0 sees rows 0..15 in order.
    probe = BatchVarianceProbe(histogram_every_n_steps=1, top_k=2)
    fit(module, data, [probe], batch_size=8, steps=1, accumulate=2)
    assert probe.outlier_rows and [i for i, _ in probe.last_outliers] == truth

    # Shuffled, with the row in the batch.
    rows = [{"x": x, "y": y, "index": i} for i, (x, y) in enumerate(zip(*data.tensors))]
    probe = BatchVarianceProbe(histogram_every_n_steps=1, top_k=2)
    trainer = pl.Trainer(
        max_steps=1,
        accumulate_grad_batches=2,
        callbacks=[probe],
        logger=RecordingLogger(),
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        num_sanity_val_steps=0,
        precision="64-true",
    )
    trainer.fit(
        IndexedClassifier(module.net),
        DataLoader(rows, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3)),
    )
    assert probe.outlier_rows and [i for i, _ in probe.last_outliers] == truth
    assert probe.last_outliers[0][1] == pytest.approx(float(norms[truth[0]]), rel=1e-9)

    # Shuffled without it: positions, and the panel says so.
    probe = BatchVarianceProbe(histogram_every_n_steps=1, top_k=2)
    trainer = pl.Trainer(
        max_steps=1,
        callbacks=[probe],
        logger=RecordingLogger(),
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        num_sanity_val_steps=0,
        precision="64-true",
    )
    trainer.fit(module, DataLoader(data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(3)))
    assert not probe.outlier_rows and "position in batch" in probe.summary_markdown()


@pytest.mark.parametrize("every", [1, 3])
def test_beta_is_a_decay_per_measurement_at_any_cadence(every):
    """Measuring every n steps, each measurement enters with decay β (issue #24: ≈ 99 effective measurements at
    0.98, not 99/n); the shorter windows of the ladder follow a moving quantity (estimate.py, rule 7)."""
    probe = BatchVarianceProbe(measure_every_n_steps=every, ema_beta=0.9)
    assert probe.noise.beta == pytest.approx(0.9)
    assert [ema.beta for ema, _ in probe.noise_source.windows] == [0.9, 0.8]


def test_logged_tags_and_cadence():
    logger = RecordingLogger()
    probe = BatchVarianceProbe(measure_every_n_steps=2, log_every_n_steps=3)  # rounded up to every 4 steps
    fit(Classifier(network("mlp")), classification_data("mlp", 80), [probe], batch_size=8, steps=9, logger=logger)
    assert [step for step, _ in logger.series["grad_noise/trace_cov"]] == [0, 4, 8]
    tags = set(last_logged(logger))
    # No grad_noise/b_simple_rel_err: it is infinite (not logged) while ‖G‖² is below the reliability gate.
    assert {
        "grad_noise/trace_cov",
        "grad_noise/grad_sq_norm",
        "grad_noise/b_simple_unreliable",
        "grad_norm/noise_floor",
        "grad_noise/batch_grad_var/micro_batch",
        "grad_noise/batch_grad_var/full_batch",
        "grad_noise/eb_criterion",
        "grad_noise/gsnr/net.0",
    } <= tags
    assert all(math.isfinite(v) for series in logger.series.values() for _, v in series)
    assert int(probe.noise.count) == 5


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
def test_state_round_trips_through_a_checkpoint(tmp_path):
    data = classification_data("mlp", 64)
    probe = BatchVarianceProbe(ema_beta=0.9)
    trainer = fit(Classifier(network("mlp"), "sum", lr=0.1), data, [probe], batch_size=8, steps=4)
    path = tmp_path / "probe.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["callbacks"][probe.state_key]
    assert probe.state_key == "BatchVarianceProbe{'measure_every_n_steps': 1, 'ema_beta': 0.9}"

    restored = BatchVarianceProbe(ema_beta=0.9)
    restored.load_state_dict(state)
    assert int(restored.noise.count) == 4 and restored.effective_batch_size == 8
    assert restored.grad_scale == probe.grad_scale == 8.0  # .grad of a loss summed over 8 examples
    assert float(restored.noise.trace_cov) == pytest.approx(float(probe.noise.trace_cov), rel=1e-12)
    assert float(restored.noise_error.relative_error(restored.noise)) == pytest.approx(
        float(probe.noise_error.relative_error(probe.noise)), rel=1e-12
    )
    # In .grad units (grad_scale² = 64), drawn without replacement from the 64 examples: × (N − 1)/N (rule 6).
    assert restored.noise_source.population == 64
    assert float(restored.gradient_noise.estimate().trace_cov) == pytest.approx(63 * float(probe.noise.trace_cov))
    assert set(state) == {"source", "nonfinite_steps", "coordinate_cursor", "gsnr_partial"}  # no older names

    resumed = BatchVarianceProbe(ema_beta=0.9)
    pl.Trainer(
        max_steps=6,
        callbacks=[resumed],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        precision="64-true",
    ).fit(Classifier(network("mlp"), "sum", lr=0.1), DataLoader(data, batch_size=8), ckpt_path=path)
    assert int(resumed.noise.count) == 6


class FusedSGD(Classifier):
    """Its optimizer unscales the gradients in its own step: they are still scaled in the callbacks' hook."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, fused=True)


@pytest.mark.parametrize("precision", ["64-true", "16-mixed"])
def test_with_a_monitor_the_probe_reads_its_norms_instead_of_measuring_again(precision, monkeypatch):
    """The batch gradient's ‖ḡ‖² comes from a GradNormMonitor that measured the step first: the same
    estimates as measuring alone, in any order, also with the loss scale a fused optimizer leaves."""
    calls = []
    measure = StepGradNorms._take  # a pass over the gradients
    monkeypatch.setattr(StepGradNorms, "_take", lambda *a, **k: calls.append(1) or measure(*a, **k))
    data = classification_data("mlp", 48)
    if precision != "64-true":
        data = TensorDataset(data.tensors[0].float(), data.tensors[1])
        precision = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**12))
    estimates = {}
    for order in ("alone", "monitor first", "probe first"):
        probe, monitor = (
            BatchVarianceProbe(ema_beta=0.5),
            GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0),
        )
        callbacks = {"alone": [probe], "monitor first": [monitor, probe], "probe first": [probe, monitor]}[order]
        net = network("mlp") if precision == "64-true" else network("mlp").float()
        calls.clear()
        fit(FusedSGD(net, lr=0.1), data, callbacks, batch_size=8, steps=6, precision=precision)
        estimates[order] = (float(probe.noise.grad_sq_norm), float(probe.noise.trace_cov))
        assert len(calls) == 6, order  # one pass a step, whoever asks first
    assert estimates["monitor first"] == pytest.approx(estimates["alone"], rel=1e-9)
    assert estimates["probe first"] == pytest.approx(estimates["alone"], rel=1e-9)


def test_a_partly_measured_model_reads_the_gradient_norms_once_per_step(monkeypatch):
    """A layer no source measures (no rule, no fallback, one micro-batch): the coverage is ‖ḡ‖² over the
    measured parameters over ‖ḡ‖² over all of them, both from one fused norm per step."""
    calls = []
    measure = StepGradNorms._take
    monkeypatch.setattr(StepGradNorms, "_take", lambda *a, **k: calls.append(1) or measure(*a, **k))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), Scale(7), nn.Tanh(), nn.Linear(7, 3)).double()
    probe, recorder = BatchVarianceProbe(ema_beta=0.0, fallback=False, histogram_every_n_steps=0), Recorder()
    fit(Classifier(net, lr=0.1), classification_data("mlp", 32), [probe, recorder], batch_size=8, steps=3)
    assert len(calls) == 3 and "not measured" in probe.sources
    grad = recorder.grads[-1]  # the parameters in order: 0.weight, 0.bias, 1.scale, 3.weight, 3.bias
    scale = slice(7 * 5 + 7, 7 * 5 + 7 + 7)
    covered = grad.square().sum() - grad[scale].square().sum()
    assert rel(float(probe.noise_source.last_covered_sq_norm), float(covered)) < 1e-12
    assert rel(float(probe.noise_source.norm_share), float(covered / grad.square().sum())) < 1e-12


def test_a_new_fit_starts_afresh():
    """A second fold with the same probe must not be decided on the first fold's estimates (the
    stopper takes its noise band from ``probe.noise`` when there is no accumulation). A resumed fit
    continues its estimates: test_state_round_trips_through_a_checkpoint."""
    data = classification_data("mlp", 64)
    reused = BatchVarianceProbe(ema_beta=0.9)
    fit(Classifier(network("mlp"), lr=0.1), data, [reused], batch_size=8, steps=5)
    fit(Classifier(network("mlp"), lr=0.1), data, [reused], batch_size=8, steps=8)
    fresh = BatchVarianceProbe(ema_beta=0.9)
    fit(Classifier(network("mlp"), lr=0.1), data, [fresh], batch_size=8, steps=8)
    assert int(reused.noise.count) == int(fresh.noise.count) == 8
    assert float(reused.noise.trace_cov) == pytest.approx(float(fresh.noise.trace_cov), rel=1e-12)


@pytest.mark.parametrize("module", [Classifier, FusedSGD])
def test_amp_loss_scale_is_undone(module):
    data = TensorDataset(classification_data("mlp", 16).tensors[0].float(), classification_data("mlp", 16).tensors[1])
    values = []
    for precision in (
        "32-true",
        MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**12)),
    ):
        probe = BatchVarianceProbe(ema_beta=0.0)
        torch.manual_seed(0)
        fit(module(mlp()), data, [probe], batch_size=16, steps=1, precision=precision)
        values.append((float(probe.noise.trace_cov), float(probe.noise.grad_sq_norm)))
    assert rel(values[1][0], values[0][0]) < 0.02 and rel(values[1][1], values[0][1]) < 0.05


# ------------------------------------------------------------------------------------------- DDP


class InterleavedRanks(pl.LightningDataModule):
    """Rank r gets examples r, r + 2, ... in order (Lightning's own sampler would shuffle training data)."""

    def __init__(self, data: TensorDataset, batch_size: int) -> None:
        super().__init__()
        self.data, self.batch_size = data, batch_size

    def train_dataloader(self) -> DataLoader:
        sampler = DistributedSampler(self.data, self.trainer.world_size, self.trainer.global_rank, shuffle=False)
        return DataLoader(self.data, batch_size=self.batch_size, sampler=sampler)


class RankReport(pl.Callback):
    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        probe = next(c for c in trainer.callbacks if isinstance(c, BatchVarianceProbe))
        report = {
            "trace_cov": float(probe.noise.trace_cov),
            "grad_sq_norm": float(probe.noise.grad_sq_norm),
            "count": int(probe.noise.count),
            "effective_batch_size": probe.effective_batch_size,
            "sources": probe.sources,
        }
        Path(self.folder, f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


@pytest.mark.slow
def test_ddp_uses_rank_and_global_gradients_and_agrees_with_one_process(tmp_path):
    data, steps = as_float32(classification_data("mlp", 16 * 30, seed=5)), 30
    pl.Trainer(
        strategy="ddp_spawn",
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        logger=False,
        callbacks=[BatchVarianceProbe(ema_beta=0.9), RankReport(str(tmp_path)), ReleaseProcessGroup()],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    ).fit(Classifier(_mixed_net()), datamodule=InterleavedRanks(data, batch_size=8))
    ranks = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]  # every rank holds the same value
    assert ranks[0]["count"] == steps and ranks[0]["effective_batch_size"] == 16
    assert "micro-batches/ranks" in ranks[0]["sources"]  # Scale: per-rank vs global gradient

    single = BatchVarianceProbe(ema_beta=0.9, fallback_sub_batch=16)
    module = Classifier(_mixed_net())
    fit(module, data, [single], batch_size=16, steps=steps, precision="32-true")
    assert "torch.func vmap" in single.sources
    assert rel(ranks[0]["trace_cov"], float(single.noise.trace_cov)) < 0.1  # within sampling error

    # The Linear layers' per-example part is the same in both runs (lr = 0): the whole difference is the
    # Scale layer's, measured from the two ranks' halves (n = 2, b = 8) in DDP and per example on one process.
    ranks_part, example_part = NoiseScaleEMA(0.9), NoiseScaleEMA(0.9)
    x, y = data.tensors
    for step in range(steps):
        batch = slice(16 * step, 16 * step + 16)
        g = brute_force(module.net.double(), x[batch].double(), y[batch])["0.scale"]
        full, halves = g.mean(0).square().sum(), torch.stack([g[0::2].mean(0), g[1::2].mean(0)])
        m = halves.square().sum(1).mean()
        ranks_part.update(2 * full - m, 16 * (m - full))
        example_trace = (g - g.mean(0)).square().sum() / 15
        example_part.update(full - example_trace / 16, example_trace)
    for key in ("trace_cov", "grad_sq_norm"):
        measured = ranks[0][key] - float(getattr(single.noise, key))
        expected = float(getattr(ranks_part, key) - getattr(example_part, key))
        assert abs(measured - expected) < 1e-4 * abs(ranks[0][key]), key


def _vit() -> nn.Module:
    from zoo import ViTClassToken

    torch.manual_seed(0)
    net = ViTClassToken()
    net.pos_drop.p = 0.0  # the same forward on the ranks as on one process
    return net


@pytest.mark.slow
def test_ddp_a_vit_s_bare_parameters_are_measured_per_example_on_every_rank(tmp_path):
    """Under DDP the class token and the position table are caught per example on each rank, as on one process:
    no micro-batch source, every rank the same estimate, that of one process over the same 16 examples."""
    torch.manual_seed(3)
    steps = 3
    data = TensorDataset(torch.randn(16 * steps, 3, 8, 8), torch.randint(0, 4, (16 * steps,)))
    pl.Trainer(
        strategy="ddp_spawn",
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        logger=False,
        callbacks=[BatchVarianceProbe(), RankReport(str(tmp_path)), ReleaseProcessGroup()],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    ).fit(Classifier(_vit()), datamodule=InterleavedRanks(data, batch_size=8))
    ranks = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1] and ranks[0]["count"] == steps
    assert "micro-batches" not in ranks[0]["sources"] and "(100.0% of parameters)" in ranks[0]["sources"]
    single = BatchVarianceProbe()
    fit(Classifier(_vit()), data, [single], batch_size=16, steps=steps, precision="32-true")
    for key in ("trace_cov", "grad_sq_norm"):
        assert rel(ranks[0][key], float(getattr(single.noise, key))) < 1e-4, key


def test_demo_cnn_runs_with_the_probe():
    pytest.importorskip("sklearn")
    from trainvitals.demo.data import DigitsDataModule
    from trainvitals.demo.model import DigitsCNN

    probe = BatchVarianceProbe(log_every_n_steps=5, histogram_every_n_steps=5)
    logger = RecordingLogger()
    torch.manual_seed(0)
    trainer = pl.Trainer(
        max_steps=10,
        callbacks=[probe],
        logger=logger,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(DigitsCNN(), DigitsDataModule(batch_size=32))
    assert "Conv2d×2, Linear×2 (100.0% of parameters)" in probe.sources
    assert int(probe.noise.count) == 10 and probe.effective_batch_size == 32
    assert len(logger.series["grad_noise/trace_cov"]) == 2 and float(probe.noise.b_simple) > 0


def test_a_layer_called_with_a_keyword_input_is_skipped_not_fatal():
    class KeywordCall(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.b(torch.tanh(self.a(input=x))), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    probe = BatchVarianceProbe()
    x = torch.randn(32, 4)
    trainer = pl.Trainer(**trainer_kwargs(max_steps=3, callbacks=[probe]))
    with pytest.warns(UserWarning, match=r"`a`: its input was not passed positionally"):
        trainer.fit(KeywordCall(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8))
    assert trainer.global_step == 3


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))


class Encoder(nn.Module):
    """nn.TransformerEncoderLayer at its default dropout (0.1, attention's too), batch-first."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(4, 2, dim_feedforward=16, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(1))


@pytest.mark.parametrize(
    ("model", "layers"),
    [(Attention, "MultiheadAttention×1, Linear×1"), (Encoder, "MultiheadAttention×2, Linear×5, LayerNorm×4")],
)
def test_multihead_attention_is_measured_per_example(model, layers):
    """Also inside nn.TransformerEncoder, whose dropout draws masks in training: attention is measured from what
    the forward computed, and each step's Σ_i g_i adds up to the batch gradient (the probe's check)."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 5, 4, dtype=torch.float64), torch.randint(0, 3, (32,)))
    probe, logger = BatchVarianceProbe(), RecordingLogger()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(Classifier(model()), data, [probe], batch_size=8, steps=3, logger=logger)
    assert _probe_warnings(record) == []
    assert f"per-example norms in backward: {layers} (100.0% of parameters)" in probe.sources, probe.sources
    assert not probe._excluded and len(logger.values("grad_noise/trace_cov")) == 3


class BranchOnOneRank(Classifier):
    """A layer only rank 1 uses, from step 2 on: on rank 0 DDP hands it the averaged gradient without its
    forward running."""

    def __init__(self) -> None:
        super().__init__(nn.Identity())
        self.a, self.b, self.head = nn.Linear(5, 4), nn.Linear(5, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) + (self.b(x) if self.global_rank == 1 and self.global_step >= 2 else 0.0)
        return self.head(h)


@pytest.mark.slow
def test_ddp_a_layer_that_fails_on_one_rank_is_excluded_on_every_rank(tmp_path):
    """The ranks' collectives must keep matching: the failure is shared at the next logging step and
    every rank measures that layer from the ranks from then on."""
    data = as_float32(classification_data("mlp", 16 * 12, seed=6))
    pl.Trainer(
        strategy="ddp_spawn_find_unused_parameters_true",
        accelerator="cpu",
        devices=2,
        max_steps=12,
        logger=False,
        log_every_n_steps=4,
        callbacks=[BatchVarianceProbe(), RankReport(str(tmp_path)), ReleaseProcessGroup()],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    ).fit(BranchOnOneRank(), datamodule=InterleavedRanks(data, batch_size=8))
    ranks = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    assert "micro-batches/ranks: 2 tensors" in ranks[0]["sources"]  # b's weight and bias
    assert ranks[0]["count"] == 12 - 3  # steps 2-4 invalid: rank 0 failed from step 2, shared at step 4


@pytest.mark.slow
def test_ddp_the_step_that_finds_a_shared_position_table_on_every_rank_is_measured(tmp_path):
    """Set aside on every rank, the position table leaves the first step measured over the other layers on
    each (the ranks agree without a read), and the ranks measure it from then on."""
    from zoo import VOCAB

    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (16 * 10, 6))
    pl.Trainer(
        strategy="ddp_spawn",
        accelerator="cpu",
        devices=2,
        max_steps=10,
        logger=False,
        log_every_n_steps=5,
        callbacks=[BatchVarianceProbe(), RankReport(str(tmp_path)), ReleaseProcessGroup()],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    ).fit(
        LanguageModel(PositionedGPT("view", 6)),
        datamodule=InterleavedRanks(TensorDataset(tokens, tokens.roll(-1, 1)), batch_size=8),
    )
    ranks = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1] and ranks[0]["count"] == 10
    assert "micro-batches/ranks: 1 tensors" in ranks[0]["sources"]


def test_a_window_of_one_micro_batch_is_left_out_not_fatal():
    """9 batches with accumulate_grad_batches=2: the epoch's last optimizer step has one micro-batch, no
    spread between micro-batches to measure the layer without a per-example identity from."""
    data = as_float32(classification_data("mlp", 36))
    probe = BatchVarianceProbe(ema_beta=0.0)
    trainer = fit(
        Classifier(_mixed_net()), data, [probe], batch_size=4, steps=-1, accumulate=2, precision="32-true", max_epochs=1
    )
    assert trainer.global_step == 5
    assert "micro-batches/ranks" in probe.sources
    assert int(probe.noise.count) == 4
    assert probe.effective_batch_size == 8 and probe.grad_scale == 1.0  # a whole step's, not the last window's
    assert math.isfinite(float(probe.noise.trace_cov)) and float(probe.noise.trace_cov) > 0


class PositionFirst(nn.Module):
    """A position embedding called with ``arange(T)`` before the token embedding: its input's first
    dimension is T, not the batch. ``scaled``: its output doubled before the add, which no rule reads."""

    def __init__(self, scaled: bool = False) -> None:
        super().__init__()
        self.pos = nn.Embedding(6, 4)
        self.tok = nn.Embedding(13, 4)
        self.head = nn.Linear(4, 3)
        self.scaled = scaled

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = self.pos(torch.arange(tokens.shape[1]))
        h = (2.0 * pos if self.scaled else pos) + self.tok(tokens)
        return self.head(torch.tanh(h)).mean(1)


def test_the_batch_is_sized_from_the_batch_not_from_the_first_layer_that_runs():
    """The first layer to run once set "the batch size" (here T = 6): every real layer was then reported as
    "not the batch" and nothing was measured. Every layer is measured, the position embedding where its add
    broadcasts it, and matches brute force."""
    torch.manual_seed(0)
    net = PositionFirst().double()
    data = classification_data("sequence", 24)
    probe = BatchVarianceProbe(ema_beta=0.0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(Classifier(net), data, [probe], batch_size=8, steps=3)
    assert _probe_warnings(record) == [] and not probe._excluded
    assert "(100.0% of parameters)" in probe.sources and "not measured" not in probe.sources
    x, y = data.tensors
    per_example = brute_force(net, x[16:24], y[16:24])  # the last step's batch; lr = 0 keeps the weights
    flat = torch.cat([g.flatten(1) for g in per_example.values()], 1)
    trace = (flat - flat.mean(0)).square().sum() / 7
    assert rel(float(probe.noise.trace_cov), float(trace)) < 1e-6
    assert rel(float(probe.noise.grad_sq_norm), float(flat.mean(0).square().sum() - trace / 8)) < 1e-6


class ManualClassifier(Classifier):
    """The classifier under manual optimization, where the sums check cannot compare with ``.grad``."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        optimizer.step()


def test_per_coordinate_sums_are_formed_on_the_first_and_the_logging_steps_only():
    """Also where the sums check cannot run (manual optimization): not on every step until it has."""
    probe = BatchVarianceProbe(log_every_n_steps=3)
    formed: list[bool] = []

    class Record(pl.Callback):
        def on_train_batch_start(self, *_: Any) -> None:  # after the probe's, which selects the step's sums
            formed.append(probe._step is not None and bool(probe._step.selection))

    fit(ManualClassifier(network("mlp")), classification_data("mlp", 64), [probe, Record()], batch_size=8, steps=7)
    assert formed == [True, False, False, True, False, False, True]


def test_two_optimizers_are_named_as_the_reason_nothing_is_measured():
    probe, logger = BatchVarianceProbe(), RecordingLogger()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(
            GAN(d=5),
            as_float32(classification_data("mlp", 32)),
            [probe],
            batch_size=8,
            steps=6,
            precision="32-true",
            logger=logger,
        )
    (message,) = _probe_warnings(record)
    assert "the run has 2 optimizers" in message
    assert last_logged(logger) == {} and int(probe.noise.count) == 0


class SkipsOneBatch(Classifier):
    """Returns None for one batch (Lightning's way to skip it), after its forward ran."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx == 2 else loss  # under accumulation of 2: the first micro-batch of a step


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_skipped_batch_leaves_per_example_measurement_intact(accumulate):
    torch.manual_seed(0)
    probe, logger = BatchVarianceProbe(), RecordingLogger()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(
            SkipsOneBatch(network("mlp")),
            classification_data("mlp", 96),
            [probe],
            batch_size=8,
            steps=4,
            accumulate=accumulate,
            logger=logger,
        )
    assert not any("more than once" in m for m in _probe_warnings(record)) and not probe._excluded
    assert set(probe._plan.per_example) == {"net.0", "net.2", "net.4"}
    steps = [step for step, _ in logger.series["grad_noise/gsnr/net.0"]]
    assert steps[-1] == 3 and len(steps) >= 3  # per-example statistics logged after the skipped batch too


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_position_table_is_said_in_plain_words_with_where_it_goes_and_the_coverage_left(accumulate, monkeypatch):
    """The fit-start line is the planned coverage; the position table, found shared by the batch at the first
    step, is warned about once: why in words, where it is measured from then on, and what the sources cover."""
    torch.manual_seed(0)
    probe = BatchVarianceProbe()
    said: list[str] = []
    monkeypatch.setattr(probe, "info", lambda text, once=False: said.append(text))
    data = classification_data("sequence", 48)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(
            Classifier(PositionFirst(scaled=True).double()), data, [probe], batch_size=8, steps=3, accumulate=accumulate
        )
    assert said[0].startswith("planned sources") and "Embedding×2" in said[0] and "(100.0% of parameters)" in said[0]
    (message,) = _probe_warnings(record)
    assert "`net.pos`: it is looked up with 6 ids for a batch of 8, not one per example" in message
    assert "shared by all examples in the batch" in message and "first dimension" not in message
    assert "read by MulBackward0" in message
    if accumulate > 1:
        assert "From the next step on it is measured from micro-batches and ranks" in message
        assert "micro-batches/ranks: 1 tensors" in message
    else:
        assert "left to micro-batches and ranks, which this run does not have" in message
        assert "not measured: 1 tensor" in message
    assert "the sources now are per-example norms in backward: Embedding×1, Linear×1 (" in message
    assert probe._excluded == {"net.pos"} and "Embedding×1" in probe.sources


@pytest.mark.parametrize("blocks", [2, 4])
def test_layers_that_fail_for_one_reason_are_said_together_with_the_reason_once(blocks):
    """A timm-style ViT's in-place layer-scales (``x.mul_(gamma)``, 2 a block) fail torch.func for one reason: the
    warning names them in one group, the first few and a count of the rest, and gives the reason, what became of
    the step and where they go once, not once per layer (24 times over for a 12-block ViT)."""
    torch.manual_seed(0)
    vit = ViT(inplace=True)
    vit.blocks = nn.Sequential(*[Block(inplace=True) for _ in range(blocks)])
    data = TensorDataset(torch.randn(32, 5, 6, dtype=torch.float64), torch.randint(0, 3, (32,)))
    probe = BatchVarianceProbe()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(Classifier(vit.double()), data, [probe], batch_size=8, steps=2)
    scales = [f"net.blocks.{b}.ls{k}" for b in range(blocks) for k in (1, 2)]
    assert probe._excluded == set(scales)
    (message,) = _probe_warnings(record)
    shown = ", ".join(f"`{n}`" for n in scales[:5])
    rest = f" and {len(scales) - 5} more" if len(scales) > 5 else ""
    assert f"cannot measure per example: {shown}{rest} ({len(scales)} modules), each: its forward changes" in message
    assert not any(n in message for n in scales[5:])
    for words in (
        "its forward changes its input in place",
        "with inplace=False (timm's LayerScale default) it is measured",
        "the steps they failed in are measured over the other layers, their parameters counted as not measured",
        "From the next step on they are left to micro-batches and ranks, which this run does not have",
    ):
        assert message.count(words) == 1, words


def test_layers_said_together_share_their_reason_and_their_fate():
    """Two layers of one reason, one measured without at its step and one whose step is left out, are said apart;
    a layer of another reason on its own, in the words of one."""
    scales = ["net.blocks.0.ls1", "net.blocks.0.ls2", "net.blocks.1.ls1", "net.blocks.1.ls2"]
    sources = ProbeSources(Classifier(ViT(inplace=True)), False, True, set(scales[:3]), 8, Layouts())
    message = sources.moved(dict.fromkeys(scales[:3], "R") | {scales[3]: "Q"}, set(scales[:2]), 1)
    said = message.removeprefix("cannot measure per example: ").split("; the sources now are")[0].split("; ")
    assert said == [
        "`net.blocks.0.ls1`, `net.blocks.0.ls2` (2 modules), each: R",
        "the steps they failed in are measured over the other layers, their parameters counted as not measured. "
        "From the next step on they are left to micro-batches and ranks, which this run does not have "
        "(accumulate_grad_batches >= 2 or >= 2 devices)",
        "`net.blocks.1.ls1`: R",
        "the steps it failed in are left out. From the next step on it is left to micro-batches and ranks, which "
        "this run does not have (accumulate_grad_batches >= 2 or >= 2 devices)",
        "`net.blocks.1.ls2`: Q",
        "the steps it failed in are left out. From the next step on it is measured by torch.func on a sub-batch of "
        "8 examples",
    ]


class LanguageModel(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())


def test_a_gpt_with_tied_embeddings_is_measured_per_example_end_to_end():
    from zoo import GPT, VOCAB

    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (32, 6))
    probe, logger = BatchVarianceProbe(), RecordingLogger()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(
            LanguageModel(GPT().double()),
            TensorDataset(tokens, tokens.roll(-1, 1)),
            [probe],
            batch_size=8,
            steps=3,
            logger=logger,
        )
    # Every parameter measured per example from the first step on, the position table where its add broadcasts
    # it, the GSNR of the tied table and the EB criterion too.
    assert _probe_warnings(record) == [] and not probe._excluded
    assert probe.sources == "per-example norms in backward: Embedding×2, LayerNorm×5, Linear×9 (100.0% of parameters)"
    assert len(logger.values("grad_noise/trace_cov")) == 3 and len(logger.values("grad_noise/gsnr/net.wpe")) == 3
    assert [step for step, _ in logger.series["grad_noise/eb_criterion"]] == [0, 1, 2]


class PositionedGPT(nn.Module):
    """GPT-2 with its position table looked up as HF writes it (``position_ids = arange(T).unsqueeze(0)``,
    (1, T)) or as nanoGPT does (``wpe(arange(T))``, 1-D: with T = B told from per-example ids on the device), or
    nanoGPT's read through a view (``"view"``), which no rule reads."""

    def __init__(self, style: str, t: int) -> None:
        super().__init__()
        from zoo import VOCAB, D, PreLNBlock

        self.style = style
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(t, D)
        self.h = nn.ModuleList(PreLNBlock(D, 2, causal=True) for _ in range(2))
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        pos = self.wpe(positions.unsqueeze(0) if self.style == "hf" else positions)
        x = self.wte(idx) + (pos.view(idx.shape[1], -1) if self.style == "view" else pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def assert_first_step_exact(net: nn.Module, loss_of, n: int, first: StepValues) -> torch.Tensor:
    """The first step's tr(Σ), ‖G‖² and coverage (``first``'s values) against a loop over its ``n`` examples'
    own losses (``loss_of(i)``) and ALL parameters, the weights unchanged (lr = 0); returns their ``(n, P)``
    gradients."""
    grads: dict[str, list[torch.Tensor]] = {name: [] for name, _ in net.named_parameters()}
    for i in range(n):
        net.zero_grad()
        loss_of(i).backward()
        for name, p in net.named_parameters():
            grads[name].append(p.grad.clone())
    flat = torch.cat([torch.stack(g).flatten(1) for g in grads.values()], 1)
    trace = (flat - flat.mean(0)).square().sum() / (n - 1)
    trace_cov, grad_sq_norm, coverage, _ = first.values
    assert rel(trace_cov, float(trace)) < 1e-5
    assert rel(grad_sq_norm, float(flat.mean(0).square().sum() - trace / n)) < 1e-5
    assert coverage == 1.0
    return flat


@pytest.mark.parametrize(("style", "accumulate"), [("hf", 1), ("hf", 2), ("nanogpt", 1), ("nanogpt T=B", 1)])
def test_a_gpt_s_position_table_is_measured_per_example_from_the_first_step(style, accumulate):
    """HF's (1, T) position ids and nanoGPT's arange(T) (with T = B too: its ids told from the examples' own on the
    device): every parameter measured per example, no micro-batch source, the first step's tr(Σ), ‖G‖² and
    per-example norms those of a per-example loop over ALL parameters."""
    from zoo import VOCAB

    torch.manual_seed(0)
    b, t = 8, 8 if style == "nanogpt T=B" else 6
    net = PositionedGPT(style.split()[0], t).double()
    tokens = torch.randint(0, VOCAB, (b * accumulate * 3, t))
    probe = BatchVarianceProbe(histogram_every_n_steps=1, top_k=b * accumulate)
    first, second = StepValues(0), StepValues(1)  # the second sees the first step's per-example norms
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(
            LanguageModel(net),
            TensorDataset(tokens, tokens.roll(-1, 1)),
            [probe, first, second],
            batch_size=b,
            steps=3,
            accumulate=accumulate,
        )
    assert _probe_warnings(record) == [] and not probe._excluded and "micro-batches" not in probe.sources
    assert "(100.0% of parameters)" in probe.sources and int(probe.noise.count) == 3

    n = b * accumulate  # the first step's examples; lr = 0 keeps the weights
    x, y = tokens[:n], tokens[:n].roll(-1, 1)
    flat = assert_first_step_exact(  # each example's own loss: the mean over its tokens
        net, lambda i: F.cross_entropy(net(x[i : i + 1]).flatten(0, 1), y[i : i + 1].flatten()), n, first
    )
    norms = second.values[3]
    torch.testing.assert_close(torch.tensor(norms, dtype=flat.dtype), flat.norm(dim=1).sort().values, rtol=1e-5, atol=0)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_vit_s_bare_class_token_and_position_table_are_measured_per_example(accumulate):
    """timm's and torchvision's ViT keep ``cls_token`` and ``pos_embed`` as bare parameters of the model beside its
    layers (a fresh user's: 3 % of the parameters, two thirds of ‖ḡ‖², unmeasured without accumulation): measured
    where the graph broadcasts them over the batch, every parameter per example, no micro-batch source, the first
    step's tr(Σ) and ‖G‖² those of a per-example loop over ALL parameters."""
    from zoo import ViTClassToken

    torch.manual_seed(0)
    b, net = 8, ViTClassToken().double()
    net.pos_drop.p = 0.0  # the loop below draws no masks
    x, y = torch.randn(b * accumulate * 3, 3, 8, 8, dtype=torch.float64), torch.randint(0, 4, (b * accumulate * 3,))
    probe, first = BatchVarianceProbe(), StepValues(0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(Classifier(net), TensorDataset(x, y), [probe, first], batch_size=b, steps=3, accumulate=accumulate)
    assert _probe_warnings(record) == [] and not probe._excluded and "micro-batches" not in probe.sources
    assert "parameters broadcast over the batch×1" in probe.sources and "(100.0% of parameters)" in probe.sources
    assert_first_step_exact(net, lambda i: F.cross_entropy(net(x[i : i + 1]), y[i : i + 1]), b * accumulate, first)


@pytest.mark.parametrize(("style", "accumulate"), [("view", 1), ("view", 2), ("view T=B", 1)])
def test_the_step_that_finds_a_shared_position_table_is_measured_without_it(style, accumulate, monkeypatch):
    """A position table shared by the batch that no rule can read (its output read through a view; with 1-D ids
    and T = B, compared on the device with arange(B) and decided at the logging step, with no host read between
    logging steps) is found at the first step, which is measured over the other layers (its tr(Σ) and ‖G‖² those
    of a per-example loop over them, the coverage without wpe), not thrown away: every step of the fit enters
    the estimate."""
    from zoo import VOCAB

    torch.manual_seed(0)
    b, t, steps = 8, 8 if style == "view T=B" else 6, 25
    net = PositionedGPT(style.split()[0], t).double()
    tokens = torch.randint(0, VOCAB, (b * accumulate * steps, t))
    probe = BatchVarianceProbe(log_every_n_steps=5, histogram_every_n_steps=steps, top_k=b * accumulate)
    first = StepValues()
    host = HostReads(monkeypatch)
    host.watch(probe, ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step"))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(
            LanguageModel(net),
            TensorDataset(tokens, tokens.roll(-1, 1)),
            [probe, first],
            batch_size=b,
            steps=steps,
            accumulate=accumulate,
        )
    monkeypatch.undo()
    assert {step for step, _ in host.reads} <= set(range(0, steps, 5))
    (message,) = _probe_warnings(record)
    assert message.startswith("trainvitals BatchVarianceProbe: cannot measure per example: `net.wpe`: ")
    assert (
        "the steps it failed in are measured over the other layers, its parameters counted as not measured" in message
    )
    assert probe._excluded == {"net.wpe"}
    assert int(probe.noise.count) == steps and int(probe.gradient_noise.estimate().count) == steps

    n = b * accumulate  # the first step's examples; lr = 0 keeps the weights
    x, y = tokens[:n], tokens[:n].roll(-1, 1)
    grads: dict[str, list[torch.Tensor]] = {name: [] for name, _ in net.named_parameters()}
    for i in range(n):  # each example's own loss: the mean over its tokens
        net.zero_grad()
        F.cross_entropy(net(x[i : i + 1]).flatten(0, 1), y[i : i + 1].flatten()).backward()
        for name, p in net.named_parameters():
            grads[name].append(p.grad.clone())
    flat = torch.cat([torch.stack(g).flatten(1) for name, g in grads.items() if name != "wpe.weight"], 1)
    everything = torch.cat([torch.stack(g).flatten(1) for g in grads.values()], 1)
    trace = (flat - flat.mean(0)).square().sum() / (n - 1)
    trace_cov, grad_sq_norm, coverage, norms = first.values
    assert rel(trace_cov, float(trace)) < 1e-5
    assert rel(grad_sq_norm, float(flat.mean(0).square().sum() - trace / n)) < 1e-5
    assert rel(coverage, float(flat.mean(0).square().sum() / everything.mean(0).square().sum())) < 1e-5 < 1 - coverage
    assert norms == []  # no per-example norms panel on a step a layer failed in: its coverage line would not hold


class NoisyScale(nn.Module):
    """A layer of one's own with dropout inside its forward: torch.func cannot draw the batch's masks again."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x * self.weight, 0.5, self.training)


def test_a_random_forward_measured_by_torch_func_is_named_with_what_would_make_it_exact():
    probe = BatchVarianceProbe()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(
            Classifier(nn.Sequential(NoisyScale(), nn.Linear(5, 3)).double()),
            classification_data("mlp", 16),
            [probe],
            batch_size=8,
            steps=2,
        )
    (message,) = [m for m in _probe_warnings(record) if "net.0" in m]
    assert "draws random numbers" in message and "nn.Dropout module outside it" in message
    assert "randomness flag" not in message and probe._excluded == {"net.0"}


class DirectWeightNet(nn.Module):
    """``proj`` is called, and its weight also used outside its call (`x @ proj.weight.T`)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.out = nn.Linear(5, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.proj(x)) + torch.tanh(x @ self.proj.weight.T))


@pytest.mark.parametrize("per_coordinate", [True, False])
def test_a_layer_whose_per_example_gradients_do_not_add_up_is_measured_from_micro_batches(per_coordinate):
    """The check runs whether or not GSNR is asked for."""
    torch.manual_seed(0)
    probe = BatchVarianceProbe(per_coordinate=per_coordinate)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(
            Classifier(DirectWeightNet().double()),
            classification_data("mlp", 64),
            [probe],
            batch_size=8,
            steps=2,
            accumulate=2,
        )
    assert [m for m in _probe_warnings(record) if "`net.proj`: its per-example gradients do not add up" in m]
    assert probe._excluded == {"net.proj"} and set(probe._plan.micro_batch) == {"net.proj.weight", "net.proj.bias"}


def test_a_short_last_batch_does_not_change_the_effective_batch():
    """40 examples in batches of 16 (drop_last=False): the third step has 8; the floor stays at B = 16."""
    logger, probe = RecordingLogger(), BatchVarianceProbe(histogram_every_n_steps=0)
    fit(Classifier(network("mlp")), classification_data("mlp", 40), [probe], batch_size=16, steps=3, logger=logger)
    assert probe.effective_batch_size == 16
    (step, floor), (_, trace) = logger.series["grad_norm/noise_floor"][-1], logger.series["grad_noise/trace_cov"][-1]
    assert step == 2 and floor == pytest.approx(math.sqrt(trace / 16), rel=1e-9)


class TokenModel(Classifier):
    """A model of tokens, its loss by the zoo entry's (the mean of the examples' own losses)."""

    def __init__(self, net: nn.Module, loss: Any) -> None:
        super().__init__(net)
        self.loss = loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.loss(self(x), y)


class RngAtBatchStart(pl.Callback):
    """The default generator's state as the training step begins: the forward's dropout masks come from it."""

    def on_train_batch_start(self, *_: Any) -> None:
        self.state = torch.get_rng_state()


@pytest.mark.parametrize("name", ["word_language_model_dropout", "lstm_classifier_packed"])
def test_a_real_recurrent_model_is_measured_per_example(name):
    """PyTorch's word_language_model (dropout between the LSTM's layers) and a packed LSTM classifier: their
    LSTM per example in backward, the estimates those of each example's gradient through the fit's forward."""
    from zoo import ZOO

    entry = ZOO[name]
    torch.manual_seed(0)
    net = entry.make().double()
    x, y = entry.batch(8)
    probe, rng = BatchVarianceProbe(ema_beta=0.0), RngAtBatchStart()
    fit(TokenModel(net, entry.loss), TensorDataset(x, y), [probe, rng], batch_size=8, steps=1)
    lstm = next(f"net.{n}" for n, m in net.named_modules() if isinstance(m, nn.LSTM))
    assert lstm in probe._plan.per_example and not probe._excluded and "per-example norms in backward" in probe.sources
    params = [p for p in net.parameters() if p.requires_grad]  # lr 0: as in the fit's step
    torch.set_rng_state(rng.state)
    out = net(x)
    per_example = [
        torch.cat(
            [
                g.flatten()
                for g in torch.autograd.grad(entry.loss(out[i : i + 1], y[i : i + 1]), params, retain_graph=True)
            ]
        )
        for i in range(8)
    ]
    flat = torch.stack(per_example)
    trace = (flat - flat.mean(0)).square().sum() / 7
    assert rel(float(probe.noise.trace_cov), float(trace)) < 1e-5
    assert rel(float(probe.noise.grad_sq_norm), float(flat.mean(0).square().sum() - trace / 8)) < 1e-5


class Logits(nn.Module):
    """transformers' causal LM as a module of token ids to logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits


def test_hf_gpt2_is_measured_over_all_parameters_without_accumulation():
    """transformers' GPT-2 from its config (dropout on, the head tied to wte, (1, T) position ids): its position
    table per example where its add broadcasts it, its Conv1D layers by torch.func over the whole batch, nothing
    left to micro-batches; the estimates those of each example's gradient through the fit's forward."""
    transformers = pytest.importorskip("transformers")
    from zoo import VOCAB, T, token_loss

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=16, n_layer=2, n_head=2)
    net = Logits(transformers.GPT2LMHeadModel(config)).double()
    x = torch.randint(0, VOCAB, (8, T))
    probe, rng = BatchVarianceProbe(ema_beta=0.0, fallback_sub_batch=8), RngAtBatchStart()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(TokenModel(net, token_loss), TensorDataset(x, x), [probe, rng], batch_size=8, steps=1)
    assert _probe_warnings(record) == [] and not probe._excluded
    assert "net.model.transformer.wpe" in probe._plan.per_example and "micro-batches" not in probe.sources
    assert float(probe.noise_source.norm_share) == 1.0
    params = [p for p in net.parameters() if p.requires_grad]  # lr 0: as in the fit's step
    torch.set_rng_state(rng.state)
    out = net(x)
    flat = torch.stack(
        [
            torch.cat(
                [
                    g.flatten()
                    for g in torch.autograd.grad(token_loss(out[i : i + 1], x[i : i + 1]), params, retain_graph=True)
                ]
            )
            for i in range(8)
        ]
    )
    trace = (flat - flat.mean(0)).square().sum() / 7
    assert rel(float(probe.noise.trace_cov), float(trace)) < 1e-5
    assert rel(float(probe.noise.grad_sq_norm), float(flat.mean(0).square().sum() - trace / 8)) < 1e-5


def test_a_batch_holding_a_list_of_examples_is_sized_by_the_list():
    """Variable-length sequences collated as a list beside their labels (for pack_sequence): B is the list's
    length where the other tensors agree; not told where nothing beside the list sizes it."""
    from trainvitals.plumbing.batch import batch_size

    def sequences(*lengths: int) -> list[torch.Tensor]:
        return [torch.zeros(n, 2) for n in lengths]

    assert batch_size((sequences(5, 3, 7), torch.zeros(3))) == 3
    assert batch_size({"x": sequences(4, 4, 4), "y": torch.zeros(3, 2)}) == 3  # equal lengths, 3 labels
    assert batch_size((sequences(5, 3, 7), torch.zeros(5))) is None  # the labels count something else
    assert batch_size(sequences(5, 3, 7)) is None  # alone it looks as a tuple of batch tensors would
    assert batch_size([torch.zeros(4, 2), torch.zeros(4)]) == 4  # the batch's own tensors
    assert batch_size([torch.zeros(2, 3), torch.zeros(2, 3)]) == 2
    assert batch_size((torch.zeros(8, 3), torch.zeros(5))) == 8  # no list of examples: Lightning's first


class PackedClassifier(Classifier):
    """An embedding called on each sequence of the batch's list (per example), the sequences packed into a
    two-layer bidirectional LSTM with dropout between its layers, a head on its final states."""

    def __init__(self) -> None:
        super().__init__(
            nn.ModuleDict(
                {
                    "emb": nn.Embedding(11, 4),
                    "rnn": nn.LSTM(4, 3, 2, dropout=0.3, bidirectional=True),
                    "head": nn.Linear(6, 2),
                }
            ).double()
        )

    def forward(self, sequences: list[torch.Tensor]) -> torch.Tensor:
        packed = nn.utils.rnn.pack_sequence([self.net.emb(s) for s in sequences], enforce_sorted=False)
        _, (h, _) = self.net.rnn(packed)
        return self.net.head(torch.cat([h[-2], h[-1]], -1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch[0]), batch[1])


def collate_list(
    items: list[tuple[torch.Tensor, torch.Tensor]], split: bool
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The sequences as a list (``split``: views of one tensor), the labels stacked."""
    sequences = [s for s, _ in items]
    if split:
        sequences = list(torch.cat(sequences).split([len(s) for s in sequences]))
    return sequences, torch.stack([y for _, y in items])


@pytest.mark.parametrize(
    ("lengths", "split"),
    [([3, 6, 2, 5], False), ([4, 4, 4, 4], False), ([4, 4, 4, 4], True)],
    ids=["varied", "each-the-batch-size", "views-of-one-tensor"],
)
def test_a_list_of_sequences_is_measured_with_the_embedding_called_per_example_named(lengths, split):
    """B = 4 from the list; the embedding, fed one sequence a call, is named as called per example (also where
    every sequence is 4 long, as long as the batch, and where they are views of one tensor), the LSTM and head
    measured: their estimates those of each example's gradient through the fit's forward (dropout), one
    backward each, float64."""
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randint(0, 11, (n,), generator=g), torch.randint(0, 2, (), generator=g)) for n in lengths]
    torch.manual_seed(0)
    module, probe, rng = PackedClassifier(), BatchVarianceProbe(ema_beta=0.0), RngAtBatchStart()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pl.Trainer(**trainer_kwargs(callbacks=[probe, rng], max_steps=1, precision="64-true")).fit(
            module, DataLoader(rows, batch_size=4, collate_fn=functools.partial(collate_list, split=split))
        )
    said = " ".join(str(w.message) for w in caught)
    assert probe.effective_batch_size == 4 and "`net.emb`: it is called on one example at a time" in said
    assert "position table" not in said and probe._excluded == {"net.emb"}
    sequences, labels = [s for s, _ in rows], torch.stack([y for _, y in rows])
    params = [p for n, p in module.net.named_parameters() if not n.startswith("emb.")]
    torch.set_rng_state(rng.state)
    out = module(sequences)
    flat = torch.stack(
        [
            torch.cat(
                [
                    g.flatten()
                    for g in torch.autograd.grad(
                        F.cross_entropy(out[i : i + 1], labels[i : i + 1]), params, retain_graph=True
                    )
                ]
            )
            for i in range(4)
        ]
    )
    trace = (flat - flat.mean(0)).square().sum() / 3
    assert rel(float(probe.noise.trace_cov), float(trace)) < 1e-6
    assert rel(float(probe.noise.grad_sq_norm), float(flat.mean(0).square().sum() - trace / 4)) < 1e-6


def test_the_end_line_never_counts_more_effective_than_measured_measurements():
    """With a micro-batch source measuring every step and the probe every 5th, the estimate's effective
    measurements (1/Σw² per source, weighted over the sources) exceed the probe's own count: the end line states
    them against the most-measured source's count, which bounds them (issue #24)."""
    gen = torch.Generator().manual_seed(0)
    probe, micro = BatchVarianceProbe(), NoiseSource("micro_batch", 0.98)
    micro.effective_batch_size = probe.noise_source.effective_batch_size = 8
    probe.gradient_noise.attach(micro)
    for step in range(300):
        pair = (
            1.0 + 0.1 * torch.randn((), generator=gen, dtype=torch.float64),
            10.0 + torch.randn((), generator=gen, dtype=torch.float64),
        )
        micro.update(*pair)
        if step % 5 == 0:
            probe.noise_source.update(*pair)
    summary = probe.gradient_noise.host_summary()
    n_eff, probe_count = summary["effective_measurements"], int(probe.noise.count)
    assert probe_count == 60 and summary["count"] == 300 and probe_count < n_eff <= summary["count"]
    line = probe.summary_line()
    stated = re.search(r"from (\d+) measured optimizer steps \(the estimate: ([0-9.]+) effective of the (\d+) ", line)
    assert (int(stated.group(1)), float(stated.group(2)), int(stated.group(3))) == (
        60,
        pytest.approx(n_eff, rel=1e-2),
        300,
    )
    assert float(stated.group(2)) <= int(stated.group(3))


class _MetricsAtLogSteps(pl.Callback):
    """``trainer.callback_metrics``' ``grad_noise/*`` values at each training batch's end."""

    def __init__(self) -> None:
        self.seen: dict[int, dict[str, float]] = {}

    def on_train_batch_end(self, trainer, *_: Any) -> None:
        held = trainer.callback_metrics
        self.seen[trainer.global_step - 1] = {k: float(v) for k, v in held.items() if k.startswith("grad_noise/")}


def test_an_unbounded_or_undefined_value_reaches_callback_metrics_as_such():
    """A pure-noise gradient (‖G‖² = 0): B_simple's interval is unbounded above at every logged step and its point
    often undefined. The logger gets the finite values only; ``callback_metrics`` holds, after each logging step,
    exactly what that step measured — the logged value, or inf/NaN where the chart skipped it — never an earlier
    step's."""
    recording, seen = RecordingLogger(), _MetricsAtLogSteps()
    probe = BatchVarianceProbe(log_every_n_steps=5)
    trainer = pl.Trainer(**trainer_kwargs(logger=recording, max_steps=60, callbacks=[probe, seen]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(NoiseOnly(), DataLoader(TensorDataset(torch.randn(256, 32)), batch_size=16, shuffle=True))
    logged_steps = sorted({s for series in recording.series.values() for s, _ in series if s % 5 == 0})
    assert len(logged_steps) >= 8
    skipped = 0
    for step in logged_steps:
        logged = {k: v for k, series in recording.series.items() for s, v in series if s == step}
        for tag in ("grad_noise/b_simple_high", "grad_noise/b_simple_low", "grad_noise/b_simple"):
            held = seen.seen[step][tag]
            if tag in logged:
                assert held == pytest.approx(logged[tag], rel=1e-6)
            else:
                skipped += 1
                assert not math.isfinite(held)
    assert skipped >= len(logged_steps)  # b_simple_high at least: unbounded wherever ‖G‖² may be 0


@pytest.mark.parametrize("per_coordinate", [True, False])
def test_the_sums_check_runs_at_the_first_and_every_tenth_logging_step(per_coordinate, monkeypatch):
    """Its own schedule (probe.SUMS_CHECK_EVERY): without GSNR, a logging step forms no per-coordinate sums but for
    the check's; with GSNR, every logging step forms them and the check reads them at its steps only."""
    checked: list[int] = []
    unbalanced = PerExampleGradients.unbalanced

    def counted(self: PerExampleGradients, step: Any, to_grad: Any) -> dict[str, str]:
        checked.append(probe._step.step)
        return unbalanced(self, step, to_grad)

    monkeypatch.setattr(PerExampleGradients, "unbalanced", counted)
    probe = BatchVarianceProbe(log_every_n_steps=2, per_coordinate=per_coordinate)
    formed: list[bool] = []

    class Record(pl.Callback):
        def on_train_batch_start(self, *_: Any) -> None:  # after the probe's, which selects the step's sums
            formed.append(probe._step is not None and bool(probe._step.selection))

    fit(Classifier(network("mlp")), classification_data("mlp", 8 * 22), [probe, Record()], batch_size=8, steps=22)
    assert checked == [0, 20]
    logging = [step % 2 == 0 for step in range(22)]
    assert formed == (logging if per_coordinate else [step in (0, 20) for step in range(22)])


class _GraphNet(pl.LightningModule):
    """A PyG-style graph classifier written by hand: the nodes of a batch's graphs concatenated, a ``batch`` vector
    mapping nodes to graphs, one message-free node layer, a mean pool per graph (``index_add_``), a head; the loss a
    mean over graphs. ``targets_first``: the batch is ``(y, x, batch)`` rather than ``(x, batch, y)``."""

    def __init__(self, targets_first: bool):
        super().__init__()
        self.targets_first = targets_first
        self.node = torch.nn.Linear(4, 8)
        self.head = torch.nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        y, x, graph = batch if self.targets_first else (batch[2], batch[0], batch[1])
        h = torch.relu(self.node(x))
        graphs = y.shape[0]
        pooled = h.new_zeros(graphs, h.shape[1]).index_add_(0, graph, h)
        pooled = pooled / torch.bincount(graph, minlength=graphs).clamp_min(1).unsqueeze(1)
        return F.cross_entropy(self.head(pooled), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _graph_batches(targets_first: bool, steps: int = 24, graphs: int = 8):
    """Batches of ``graphs`` graphs of 3–9 nodes each (never a multiple of the graph count in all)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        sizes = torch.randint(3, 10, (graphs,), generator=g)
        if int(sizes.sum()) % graphs == 0:
            sizes[0] += 1
        x = torch.randn(int(sizes.sum()), 4, generator=g)
        graph = torch.repeat_interleave(torch.arange(graphs), sizes)
        y = torch.randint(0, 2, (graphs,), generator=g)
        out.append((y, x, graph) if targets_first else (x, graph, y))
    return out


@pytest.mark.parametrize("targets_first", [False, True])
def test_a_graph_batch_led_by_its_nodes_is_not_measured_with_nodes_for_examples(targets_first):
    """A fresh user's GNN with its batch ``(x, edge_index, batch, y)``: Lightning counts a batch's examples by its
    first tensor, the nodes, so every node layer was measured per node — its per-node gradients add up to ``.grad``,
    the sums check passed, and tr Σ, ‖G‖², B_simple were silently wrong (‖G‖² 15× too high). The loss's graph shows
    the mean is over the graphs: such steps are left out, said with the fix; with the targets first the node
    layers are excluded by their own first dimension and the head is measured."""
    logger = RecordingLogger()
    probe = BatchVarianceProbe(histogram_every_n_steps=0, per_coordinate=False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        Trainer(**trainer_kwargs(logger=logger, callbacks=[probe], max_steps=24, log_every_n_steps=4)).fit(
            _GraphNet(targets_first), torch.utils.data.DataLoader(_graph_batches(targets_first), batch_size=None)
        )
    said = " ".join(str(w.message) for w in record)
    fix = "Put a tensor with one row per example first in the batch (the targets: `(y, x, ...)`"
    if targets_first:
        assert fix not in said and "`node`: first dimension" in said and "is not the batch (8)" in said
        assert any(values for tag, values in logger.series.items() if tag == "grad_noise/trace_cov")
    else:
        assert said.count(fix) == 1, said
        assert not any(values for tag, values in logger.series.items() if tag.startswith("grad_noise/trace_cov"))
