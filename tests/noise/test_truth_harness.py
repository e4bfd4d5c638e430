"""The truth harness itself (tests/noise/_truth.py) against independent computations: one backward per example, the
definitions of ‖G‖² and tr Σ written out, rule 6's expectations, and a fit the harness leaves exactly as it was."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from _truth import (
    CharGPT,
    Classifier,
    RecordingSampler,
    Row,
    Truth,
    TruthCallback,
    char_windows,
    compare,
    digits_train,
    layernorm_mlp,
    per_example_gradients,
    shares,
    truth_of,
)
from conftest import RecordingLogger, trainer_kwargs
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def _loop_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One backward per example of its own loss (a mean over its terms), through ``.grad``: ``(N, D)`` float64."""
    rows = []
    for i in range(len(x)):
        model.zero_grad()
        out = model(x[i : i + 1])
        F.cross_entropy(out.reshape(-1, out.shape[-1]), y[i : i + 1].reshape(-1)).backward()
        rows.append(torch.cat([p.grad.flatten() for p in model.parameters()]).double())
    model.zero_grad()
    return torch.stack(rows)


def _lm_data(n: int = 12) -> tuple[torch.Tensor, torch.Tensor, int]:
    x, y, vocab = char_windows(context=8)
    return x[:n], y[:n], vocab


@pytest.mark.parametrize("which", ["layernorm_mlp", "tied_char_gpt"])
def test_per_example_gradients_are_each_examples_own_backward(which):
    torch.manual_seed(0)
    if which == "layernorm_mlp":
        x, y = digits_train()
        x, y, model = x[:20], y[:20], Classifier(layernorm_mlp(16))
    else:
        x, y, vocab = _lm_data()
        model = Classifier(CharGPT(vocab, context=8, dim=16))
    rows = per_example_gradients(model, x, y, chunk=7)  # chunks that do not divide N
    expected = _loop_gradients(model, x, y)
    assert rows.shape == expected.shape
    torch.testing.assert_close(rows.double(), expected, rtol=1e-4, atol=1e-6)


def test_the_truth_is_the_definitions_and_the_draws_are_unbiased_as_rule_6_says():
    """‖G‖² = ‖mean g_i‖², tr Σ = mean ‖g_i − G‖² (the population's, rule 6); per-example estimates of batches drawn
    without replacement, corrected by rule 6, have exactly those means: 4000 draws agree within 4 standard errors."""
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(40, 5, generator=gen) + torch.tensor([0.5, 0.0, 0.0, 0.0, 0.0])
    truth = truth_of(rows, 3, 8, draws=4000, generator=gen)
    g = rows.double()
    assert truth.grad_sq_norm == pytest.approx(float(g.mean(0).square().sum()), rel=1e-12)
    assert truth.trace_cov == pytest.approx(float((g - g.mean(0)).square().sum(1).mean()), rel=1e-6)  # float32 rows
    assert truth.b_simple == pytest.approx(truth.trace_cov / truth.grad_sq_norm)
    assert (truth.step, truth.batch_size, truth.population) == (3, 8, 40)
    for mean, value, var in zip(
        truth.draw_means, (truth.grad_sq_norm, truth.trace_cov), (truth.var_grad, truth.var_trace)
    ):
        assert abs(mean - value) < 4 * math.sqrt(var / 4000)


def test_rel_err_is_the_delta_method_and_infinite_near_a_zero_gradient():
    truth = Truth(0, 2.0, 10.0, 16, 100, var_grad=0.4, var_trace=4.0, cov=0.5)
    expected = math.sqrt((4.0 / 100 + 0.4 / 4 - 2 * 0.5 / 20) / 10)
    assert truth.rel_err(10) == pytest.approx(expected)
    assert truth.band_ratio(0.2) == pytest.approx(16 * 2.0 / (0.2 * 10.0))
    near_zero = Truth(0, 0.1, 10.0, 16, 100, var_grad=0.4, var_trace=4.0, cov=0.0)
    assert near_zero.rel_err(10) == math.inf  # 0.1 < 1.645·sqrt(0.04): no upper end
    assert Truth(0, 1.0, 1.0, 16, 100).rel_err(10) == math.inf  # no draws, no error


@pytest.mark.parametrize(
    ("layer", "said"), [(nn.BatchNorm1d(8), "BatchNorm in training mode"), (nn.Dropout(0.1), "dropout")]
)
def test_a_layer_without_a_per_example_truth_is_refused_by_name(layer, said):
    model = nn.Sequential(nn.Linear(4, 8), layer, nn.Linear(8, 3))
    with pytest.raises(ValueError, match=f"'1'.*{said}"):
        per_example_gradients(model, torch.randn(6, 4), torch.randint(0, 3, (6,)))
    per_example_gradients(model.eval(), torch.randn(6, 4), torch.randint(0, 3, (6,)))  # eval: deterministic, allowed


def _fit(with_truth: bool) -> tuple[list[torch.Tensor], dict, TruthCallback | None]:
    from trainvitals import BatchVarianceProbe

    torch.manual_seed(0)
    x, y = digits_train()
    x, y = x[:256], y[:256]
    model = Classifier(nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 10)))
    truth = TruthCallback(x, y, every_n_steps=4, draws=10) if with_truth else None
    logger = RecordingLogger()
    probe = BatchVarianceProbe(histogram_every_n_steps=0, per_coordinate=False)
    trainer = pl.Trainer(
        **trainer_kwargs(
            logger=logger,
            callbacks=[probe, truth] if truth else [probe],
            max_steps=12,
            accumulate_grad_batches=2,
            log_every_n_steps=4,
        )
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True))
    return [p.detach().clone() for p in model.parameters()], logger.series, truth


def test_the_harness_leaves_the_fit_as_it_was_and_meets_the_logged_steps():
    """Same seed with and without the harness: the same weights and the same logged estimate (no RNG drawn, no
    `.grad` or buffer touched), and a truth at every logged step, with the step's effective batch."""
    bare, bare_series, _ = _fit(False)
    params, series, truth = _fit(True)
    for a, b in zip(bare, params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert series["grad_noise/trace_cov"] == bare_series["grad_noise/trace_cov"]
    assert set(truth.truths) == {0, 4, 8} and all(
        t.batch_size == 32 and t.population == 256 for t in truth.truths.values()
    )
    rows = compare(truth.truths, series)
    assert [row.truth.step for row in rows] == [s for s, _ in series["grad_noise/grad_sq_norm"]]
    got = shares(rows, skip=0.0)
    assert got["steps"] == 3 and 0 <= got["grad_sq_norm_covered"] <= 1 and got["grad_sq_norm_ratio"] > 0


def test_shares_count_the_steps_after_the_first_tenth_as_logged():
    """Hand-made rows: 10 logged steps, the first (step 0 < a tenth of 90) left out; B_simple's high end left out of
    the log where infinite counts as unbounded; reachable from the truth's own error at the logged measurements."""

    def row(step: int, b_simple_low: float, b_simple_high: float | None, reliable: bool, n: float) -> Row:
        truth = Truth(step, 1.0, 10.0, 16, 100, var_grad=1.0, var_trace=4.0, cov=0.0)  # B_simple 10, band ratio 8
        logged = {
            "grad_sq_norm": 2.0,
            "grad_sq_norm_low": 1.5,
            "grad_sq_norm_high": 2.5,  # never covers 1
            "trace_cov": 10.0,
            "trace_cov_low": 9.0,
            "trace_cov_high": 11.0,
            "b_simple": 5.0,
            "b_simple_low": b_simple_low,
            "effective_measurements": n,
            "b_simple_unreliable": 0.0 if reliable else 1.0,
        }
        if b_simple_high is not None:
            logged["b_simple_high"] = b_simple_high
        return Row(truth, logged, margin=0.2)

    rows = [row(0, 20.0, 30.0, True, 1.0)]  # left out: it would cover nothing
    rows += [row(10 * k, 4.0, 12.0, True, 400.0) for k in range(1, 6)]  # covered, reliable, reachable
    rows += [row(10 * k, 11.0, None, False, 4.0) for k in range(6, 10)]  # unbounded above, not covering 10
    got = shares(rows)
    assert got["steps"] == 9
    assert got["grad_sq_norm_covered"] == 0 and got["grad_sq_norm_ratio"] == 2.0
    assert got["trace_cov_covered"] == 1 and got["trace_cov_ratio"] == 1.0
    assert got["b_simple_covered"] == pytest.approx(5 / 9) and got["b_simple_ratio"] == 0.5
    assert "band_ratio_covered" not in got  # no stopper logged it
    assert got["b_simple_bounded"] == 1 and got["reliable"] == pytest.approx(5 / 9) and got["reliable_covered"] == 1
    # rel_err at n = 400: sqrt((4/100 + 1/1) / 400) ≈ 0.05; at n = 4 ‖G‖² = 1 < 1.645·sqrt(1/4): unbounded.
    assert got["reachable"] == pytest.approx(5 / 9)
    assert rows[1].true("band_ratio") == pytest.approx(16 * 1.0 / (0.2 * 10.0))


class _StepGradient(pl.Callback):
    """‖.grad‖² at each optimizer step, before the update: the step's batch mean gradient."""

    def __init__(self) -> None:
        self.sq_norms: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_) -> None:
        self.sq_norms[trainer.global_step] = float(sum(p.grad.double().square().sum() for p in pl_module.parameters()))


def test_the_remaining_set_is_what_the_epoch_has_left_from_the_steps_first_example():
    """8 examples, 2 optimizer steps of 2 micro-batches of 2 an epoch: at an epoch's first step the remaining set is
    the whole set (G_R = G), at its last the step's own batch (G_R = the step's ``.grad``): the sampler's recorded
    permutation and the callback's count of the micro-batches meet the batches the fit drew."""
    torch.manual_seed(0)
    x, y = digits_train()
    x, y = x[:8], y[:8]
    model = Classifier(nn.Sequential(nn.Flatten(), nn.Linear(64, 10)))
    truth, grads = TruthCallback(x, y, every_n_steps=1), _StepGradient()
    trainer = pl.Trainer(**trainer_kwargs(callbacks=[grads, truth], max_steps=6, accumulate_grad_batches=2))
    data = TensorDataset(x, y)
    sampler = RecordingSampler(data, seed=3)
    trainer.fit(model, DataLoader(data, batch_size=2, sampler=sampler))
    assert len(sampler.orders) == 3 and sorted(truth.truths) == list(range(6))
    for step, t in truth.truths.items():
        if step % 2 == 0:
            assert t.remaining == 8 and t.remaining_grad_sq_norm == pytest.approx(t.grad_sq_norm, rel=1e-6)
            assert t.remaining_excess == pytest.approx(0.0, abs=1e-9 * t.grad_sq_norm)
            assert t.cross_grad_sq_norm == pytest.approx(t.grad_sq_norm, rel=1e-6)
        else:
            assert t.remaining == 4 and t.remaining_grad_sq_norm == pytest.approx(grads.sq_norms[step], rel=1e-5)
            assert t.remaining_grad_sq_norm != pytest.approx(t.grad_sq_norm, rel=1e-3)


class _StepEstimate(pl.Callback):
    """Each optimizer step's per-example estimates, from the micro-batches it trained on: one ``autograd.grad`` per
    example of its own loss (``.grad`` untouched), then the estimators written out, rule 6 with ``population``."""

    def __init__(self, population: int | None) -> None:
        self.population, self.parts = population, []
        self.estimates: dict[int, tuple[float, float]] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, *_) -> None:
        self.parts.append(batch)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_) -> None:
        x, y = (torch.cat(part) for part in zip(*self.parts))
        self.parts = []
        params = list(pl_module.parameters())
        rows = []
        for i in range(len(x)):
            loss = F.cross_entropy(pl_module(x[i : i + 1]), y[i : i + 1])
            rows.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)]).double())
        g = torch.stack(rows)
        b, mean_sq, batch_sq = len(g), float(g.square().sum(1).mean()), float(g.mean(0).square().sum())
        grad, trace = (b * batch_sq - mean_sq) / (b - 1), b * (mean_sq - batch_sq) / (b - 1)
        if self.population:
            n = self.population
            grad, trace = grad + trace / n, trace * (n - 1) / n
        self.estimates[trainer.global_step] = (grad, trace)


@pytest.mark.parametrize("replacement", [True, False])
def test_each_truth_holds_its_steps_own_estimate_from_the_batch_it_trained_on(replacement):
    """2 micro-batches of 3 a step: the step estimate is the per-example estimators' value on the examples the step
    trained on, rule 6 corrected where they were drawn without replacement from N = 12."""
    torch.manual_seed(0)
    x, y = digits_train()
    x, y = x[:12], y[:12]
    model = Classifier(nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), lr=0.05)
    truth, expected = TruthCallback(x, y, every_n_steps=1), _StepEstimate(None if replacement else 12)
    trainer = pl.Trainer(**trainer_kwargs(callbacks=[expected, truth], max_steps=5, accumulate_grad_batches=2))
    data = TensorDataset(x, y)
    trainer.fit(model, DataLoader(data, batch_size=3, sampler=torch.utils.data.RandomSampler(data, replacement)))
    assert sorted(truth.truths) == sorted(expected.estimates) == list(range(5))
    for step, t in truth.truths.items():
        assert t.step_estimate == pytest.approx(expected.estimates[step], rel=1e-5, abs=1e-9)


def test_with_replacement_the_steps_own_estimates_are_unbiased_for_the_moving_truth():
    """Batches drawn with replacement do not depend on θ, so at every step E[estimate | θ] is the step's truth, while
    Adam moves θ and ‖G‖² falls: over 300 steps the mean of estimate − truth is 0 within 4 standard errors (they are
    uncorrelated from step to step), for ‖G‖² and tr Σ; :func:`shares` reports the same ratio with that error."""
    torch.manual_seed(0)
    x, y = digits_train()
    x, y = x[:64], y[:64]
    model = Classifier(nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10)), lr=0.01)
    truth = TruthCallback(x, y, every_n_steps=1)
    trainer = pl.Trainer(**trainer_kwargs(callbacks=[truth], max_steps=300))
    data = TensorDataset(x, y)
    trainer.fit(model, DataLoader(data, batch_size=8, sampler=torch.utils.data.RandomSampler(data, True)))
    truths = [truth.truths[step] for step in sorted(truth.truths)]
    assert truths[-1].grad_sq_norm < 0.2 * truths[0].grad_sq_norm  # it moved
    for k, quantity in enumerate(("grad_sq_norm", "trace_cov")):
        diff = torch.tensor([t.step_estimate[k] - getattr(t, quantity) for t in truths], dtype=torch.float64)
        assert abs(float(diff.mean())) < 4 * float(diff.std()) / math.sqrt(len(diff)), quantity
    rows = [Row(t, {"b_simple_low": 0.0, "b_simple_unreliable": 1.0, "effective_measurements": 1.0}) for t in truths]
    got = shares(rows, skip=0.0)
    diff = [t.step_estimate[0] - t.grad_sq_norm for t in truths]
    total = sum(t.grad_sq_norm for t in truths)
    assert got["step_grad_sq_norm_ratio"] == pytest.approx(1 + sum(diff) / total)
    assert got["step_grad_sq_norm_ratio_se"] == pytest.approx(float(torch.tensor(diff).std()) * math.sqrt(300) / total)
