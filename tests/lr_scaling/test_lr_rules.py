"""core.lr_scaling: the batch-size / lr rules, efficiency and report pieces, against hand arithmetic
and replayed training."""

import math

import pytest
import torch

from trainvitals.lr_scaling.rules import (
    advice_table,
    advise,
    classify_loss_reduction,
    effective_batch_size,
    examples_over_min,
    loss_reduction_note,
    lr_ratio,
    optimizer_family,
    param_group_labels,
    steps_over_min,
)
from trainvitals.noise.estimators import NoiseScaleEMA, two_batch_size_estimates


# ---------------------------------------------------------------- the rules
def test_noise_aware_gain_on_hand_numbers():
    # B̂ = 100, 50 → 200: (1 + 100/50)/(1 + 100/200) = 3/1.5 = 2.
    assert lr_ratio(50, 200, "sgd", noise_scale=100) == pytest.approx(2.0)
    assert lr_ratio(50, 200, "adam", noise_scale=100) == pytest.approx(math.sqrt(2.0))
    assert lr_ratio(50, 200, "unsure", noise_scale=100) is None


def test_classic_rules_without_an_estimate():
    assert lr_ratio(32, 128, "sgd") == pytest.approx(4.0)
    assert lr_ratio(32, 128, "adam") == pytest.approx(2.0)
    assert lr_ratio(32, 8, "sgd") == pytest.approx(0.25)


def _measured(grad_sq_norm: float, trace_cov: float) -> float:
    noise = NoiseScaleEMA(beta=0.9)
    for _ in range(5):
        noise.update(torch.tensor(grad_sq_norm), torch.tensor(trace_cov))
    return noise.b_simple.item()


def test_measured_noise_scale_saturates_the_suggestion():
    b_hat = _measured(grad_sq_norm=0.01, trace_cov=10.0)
    assert b_hat == pytest.approx(1000.0)
    # B ≫ B̂: doubling the batch asks (almost) no lr change.
    assert lr_ratio(1e6, 2e6, "sgd", b_hat) == pytest.approx(1.0, abs=1e-3)
    assert lr_ratio(1e6, 2e6, "adam", b_hat) == pytest.approx(1.0, abs=1e-3)
    # B ≪ B̂: the linear rule (SGD) and the square-root rule (Adam).
    assert lr_ratio(1, 2, "sgd", b_hat) == pytest.approx(2.0, rel=1e-3)
    assert lr_ratio(1, 2, "adam", b_hat) == pytest.approx(math.sqrt(2.0), rel=1e-3)


def test_steps_and_examples_over_their_minimum():
    assert steps_over_min(500, 500) == pytest.approx(2.0)
    assert examples_over_min(500, 500) == pytest.approx(2.0)
    # docs/science.md §4: B = 8 B̂ costs 9× the minimum examples for 1.125× the minimum steps.
    assert examples_over_min(8000, 1000) == pytest.approx(9.0)
    assert steps_over_min(8000, 1000) == pytest.approx(1.125)


def test_effective_batch_arithmetic():
    assert effective_batch_size(16) == 16
    assert effective_batch_size(16, devices=4, nodes=2, accumulate_grad_batches=3) == 16 * 4 * 2 * 3
    # torch.nn.DataParallel splits one loaded batch over a node's devices.
    assert effective_batch_size(64, devices=4, nodes=1, accumulate_grad_batches=2, splits_batch=True) == 128


@pytest.mark.parametrize(
    ("optimizer", "family"),
    [
        (torch.optim.SGD, "sgd"),
        (torch.optim.Adam, "adam"),
        (torch.optim.AdamW, "adam"),
        (torch.optim.RMSprop, "adam"),
        (torch.optim.NAdam, "adam"),
        (torch.optim.Adagrad, "unsure"),
        (torch.optim.LBFGS, "unsure"),
        (type("MyAdam", (torch.optim.Adam,), {}), "adam"),
        ("Lion", "unsure"),
        ("SGD", "sgd"),
    ],
)
def test_optimizer_family(optimizer, family):
    assert optimizer_family(optimizer) == family


# ---------------------------------------------------------------- advise
def test_advise_suggestions_and_efficiency():
    adv = advise(64, 0.1, "sgd", noise_scale=256, target_batch_sizes=(1000,))
    assert [s.key for s in adv.suggestions] == ["x0.5", "x2", "x4", "x8", "b1000"]
    assert [s.batch_size for s in adv.suggestions] == [32, 128, 256, 512, 1000]
    for s in adv.suggestions:
        assert s.lr == pytest.approx(0.1 * (1 + 256 / 64) / (1 + 256 / s.batch_size))
        assert s.steps_over_min == pytest.approx(1 + 256 / s.batch_size)
        assert s.examples_over_min == pytest.approx(1 + s.batch_size / 256)
    assert adv.rule == "noise-aware"
    assert adv.balanced_batch == 256
    assert (adv.steps_over_min, adv.examples_over_min) == (pytest.approx(5.0), pytest.approx(1.25))
    # At a batch of one there is no half batch to suggest an lr for.
    assert [s.key for s in advise(1, 0.1, "sgd").suggestions] == ["x2", "x4", "x8"]


def test_advise_notes():
    adv = advise(64, 0.1, "sgd", noise_scale=256)
    notes = {s.key: " ".join(s.notes) for s in adv.suggestions}
    assert "sweep the lr" in notes["x8"] and "sweep the lr" not in notes["x4"]  # 512 > B̂ = 256 ≥ 256
    assert "warm it up" in notes["x4"]  # 0.1 × 5/2 = 2.5×
    assert "warm it up" not in notes["x2"]  # 5/3 ≈ 1.67×
    assert notes["x0.5"] == ""


def test_advise_adam_beta_and_eps_adjustments():
    adv = advise(64, 1e-3, "adam", betas=(0.9, 0.999), eps=1e-8)
    notes = {s.key: " ".join(s.notes) for s in adv.suggestions}
    # κ = 4: 1 − β → 4(1 − β), ε → ε/2.
    assert "β₁ 0.9 → 0.6" in notes["x4"] and "β₂ 0.999 → 0.996" in notes["x4"] and "ε 1e-08 → 5e-09" in notes["x4"]
    assert "β" not in notes["x2"]  # κ = 2 is not a large ratio
    far = advise(64, 1e-3, "adam", target_batch_sizes=(64 * 16,), betas=(0.9, 0.999))
    assert "beyond the rule's reach" in " ".join(far.suggestions[-1].notes)  # 1 − 16 × 0.1 < 0


def test_advise_classic_and_unsure():
    adam = advise(32, 1e-3, "adam")
    assert adam.rule == "square-root" and adam.noise_scale is None and adam.steps_over_min is None
    assert [s.lr for s in adam.suggestions] == pytest.approx([1e-3 * math.sqrt(m) for m in (0.5, 2, 4, 8)])
    unsure = advise(32, 1e-3, "unsure")
    assert unsure.rule == "none" and all(s.lr is None for s in unsure.suggestions)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(batch_size=0), "batch_size"),
        (dict(batch_size=-8), "batch_size"),
        (dict(batch_size=math.nan), "batch_size"),
        (dict(lr=0.0), "lr"),
        (dict(lr=-0.1), "lr"),
        (dict(lr=math.inf), "lr"),
        (dict(target_batch_sizes=(64, 0)), "target_batch_sizes"),
        (dict(target_batch_sizes=(-1,)), "target_batch_sizes"),
        (dict(family="rmsprop"), "family"),
        (dict(noise_scale=0.0), "noise_scale"),
        (dict(multiples=(0,)), "multiples"),
        (dict(betas=(0.9, 1.0)), "betas"),
        (dict(eps=-1.0), "eps"),
    ],
)
def test_advise_rejects_bad_input(kwargs, name):
    args = dict(batch_size=32, lr=0.1, family="sgd") | kwargs
    with pytest.raises(ValueError, match=f"`{name}`"):
        advise(**args)


def test_advise_rejects_a_bool_lr_as_a_type_error():
    with pytest.raises(TypeError, match="`lr`"):
        advise(batch_size=32, lr=True, family="sgd")


def test_effective_batch_rejects_bad_input():
    with pytest.raises(ValueError, match="`per_device_batch`"):
        effective_batch_size(0)
    with pytest.raises(ValueError, match="`accumulate_grad_batches`"):
        effective_batch_size(8, accumulate_grad_batches=0)


# ---------------------------------------------------------------- loss reduction, names, table
@pytest.mark.parametrize(
    ("loss", "doubled", "expected"),
    [
        (0.7, 0.7, "mean"),
        (0.7, 0.75, "mean"),
        (3.0, 6.0, "sum"),
        (-2.0, -4.0, "sum"),
        (1.0, 1.5, "unsure"),
        (0.0, 0.0, "unsure"),
        (1.0, -1.0, "unsure"),
        (math.nan, 1.0, "unsure"),
        (1.0, math.inf, "unsure"),
    ],
)
def test_classify_loss_reduction(loss, doubled, expected):
    assert classify_loss_reduction(loss, doubled) == expected


def test_loss_reduction_notes_per_family():
    sgd = loss_reduction_note("sum", "sgd", per_device_batch=16, lr=0.01, terms=16)
    assert "16 × 0.01 = 0.16" in sgd
    adam = loss_reduction_note("sum", "adam", per_device_batch=16, lr=1e-3, eps=1e-8, terms=16)
    assert "ε/16 = 6.25e-10" in adam
    assert "unknown" in loss_reduction_note("sum", "unsure", per_device_batch=16, lr=0.1)
    tokens = loss_reduction_note("sum", "adam", per_device_batch=16, lr=1e-3, eps=1e-8, terms=16 * 64)
    assert "1024 terms (16 examples × 64 each)" in tokens and "ε/1024 = 9.77e-12" in tokens
    # Terms not known: no scale, no ε, no effective lr is said
    for family in ("sgd", "adam"):
        unknown = loss_reduction_note("sum", family, per_device_batch=16, lr=1e-3, eps=1e-8)
        assert "unknown" in unknown and "ε/" not in unknown and " = " not in unknown, unknown
    assert "as they are" in loss_reduction_note("mean", "sgd", per_device_batch=16, lr=0.1)
    # A micro-batch's 27 token losses summed and divided by 87.5 (the step's 350 tokens over its 4 micro-batches):
    # the gradient is 27/87.5 = 0.309× that of their mean, so ε acts as ε/0.309, not ε/27
    scaled = loss_reduction_note("sum", "adam", per_device_batch=8, lr=3e-3, eps=1e-8, terms=27, divisor=87.5)
    assert "27 terms (8 examples × 3.38 each) and divided by 87.5" in scaled
    assert f"ε/0.309 = {1e-8 / (27 / 87.5):.3g}" in scaled and "ε/27" not in scaled
    scaled_sgd = loss_reduction_note("sum", "sgd", per_device_batch=8, lr=0.1, terms=87.5, divisor=87.5)
    assert "the gradient is 1× that of their mean" in scaled_sgd and "1 × 0.1 = 0.1" in scaled_sgd
    with pytest.raises(ValueError, match="`reduction`"):
        loss_reduction_note("none", "sgd", 16, 0.1)


def test_param_group_labels_follow_learning_rate_monitor():
    labels = param_group_labels(["SGD", "Adam", "SGD", "Adam"], [[None], [None, None], ["head"], ["enc", None]])
    assert labels == [["SGD"], ["Adam/pg1", "Adam/pg2"], ["SGD-1/head"], ["Adam-1/enc", "Adam-1/pg2"]]


def test_advice_table():
    b_hat = 256.0
    table = advice_table(
        {
            "SGD": advise(64, 0.1, "sgd", b_hat),
            "Adagrad": advise(64, 0.01, "unsure", b_hat),
        }
    )
    lines = table.splitlines()
    assert lines[0].startswith("| optimizer | family | base lr | rule | ×0.5 (32) | ×2 (128)")
    assert "| SGD | SGD-like | 0.1 | noise-aware | 0.0556 | 0.167 | 0.25 | 0.333 |" in lines  # 0.1 × 5/(1 + 256/B)
    assert "| Adagrad | unsure | 0.01 | none | – | – | – | – |" in lines
    assert any(line.startswith("| steps S/S_min | 5 | 9 |") for line in lines)
    assert "no scaling rule is known" in table
    assert "S/S_min" not in advice_table({"SGD": advise(64, 0.1, "sgd")})


# ---------------------------------------------------------------- the arithmetic, replayed
def _regression(seed: int, amplitude: float) -> tuple[torch.Tensor, torch.Tensor]:
    """512 × 10 linear regression, true weights spread over [-amplitude, amplitude], label noise 1."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 10, generator=gen)
    return x, x @ torch.linspace(-amplitude, amplitude, 10) + torch.randn(512, generator=gen)


def _train(x, y, optimizer: str, batch: int, lr: float, noise: NoiseScaleEMA | None = None) -> float:
    """5 epochs from w = 0 on the mean squared error; the final full-data loss. ``noise`` gets
    (‖G‖², tr Σ) each step from the per-example gradients g_i = 2 (x_i·w − y_i) x_i."""
    w = torch.zeros(10, requires_grad=True)
    opt = torch.optim.SGD([w], lr=lr) if optimizer == "sgd" else torch.optim.Adam([w], lr=lr)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        order = torch.randperm(len(y), generator=gen)
        for i in range(0, len(y), batch):
            idx = order[i : i + batch]
            residual = x[idx] @ w - y[idx]
            opt.zero_grad()
            residual.square().mean().backward()
            if noise is not None:
                per_example = 2 * residual.detach()[:, None] * x[idx]
                noise.update(
                    *two_batch_size_estimates(
                        per_example.square().sum(1).mean(), per_example.mean(0).square().sum(), batch, 1
                    )
                )
            opt.step()
    with torch.no_grad():
        return (x @ w - y).square().mean().item()


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize(("optimizer", "amplitude"), [("sgd", 2.0), ("adam", 1.1)])
def test_suggested_lr_recovers_the_baseline_at_four_times_the_batch(optimizer, amplitude, seed):
    # Baseline: batch 8, lr 0.01, 5 epochs. At batch 32 (a quarter of the steps) the same lr leaves
    # the weights short of the optimum; the advisor's lr, with B̂ measured during the baseline,
    # recovers the baseline's loss. B̂ is infinite when the smoothed ‖G‖² ends at or below 0 (deep in
    # the noise): the advisor then uses the classic rule, the B̂ → ∞ limit.
    x, y = _regression(seed, amplitude)
    noise = NoiseScaleEMA(beta=0.95)
    baseline = _train(x, y, optimizer, batch=8, lr=0.01, noise=noise)
    b_hat = noise.b_simple.item()
    assert b_hat > 32  # batch 32 is still below the noise scale
    noise_scale = b_hat if math.isfinite(b_hat) else None
    suggested = advise(8, 0.01, optimizer, noise_scale, target_batch_sizes=(32,)).suggestions[-1].lr
    assert suggested == pytest.approx(0.01 * lr_ratio(8, 32, optimizer, noise_scale))
    unchanged = _train(x, y, optimizer, batch=32, lr=0.01)
    rescaled = _train(x, y, optimizer, batch=32, lr=suggested)
    assert unchanged > 1.5 * baseline
    assert rescaled == pytest.approx(baseline, rel=0.10)


def test_doubling_bounds_are_the_worst_case_over_the_interval():
    """Brute force over B̂ in [low, high]: the most extra examples and the least saved steps of doubling B."""
    import numpy as np

    from trainvitals.lr_scaling.rules import doubling_bounds

    batch, low, high = 32.0, 180.0, 5000.0
    b_hat = np.linspace(low, high, 100_001)
    examples = (1 + 2 * batch / b_hat) / (1 + batch / b_hat) - 1
    steps = 1 - (1 + b_hat / (2 * batch)) / (1 + b_hat / batch)
    gain = (1 + b_hat / batch) / (1 + b_hat / (2 * batch))
    extra, saved, least_gain = doubling_bounds(batch, low, high)
    assert extra == pytest.approx(examples.max()) and saved == pytest.approx(steps.min())
    assert least_gain == pytest.approx(gain.min()) and gain.max() < 2
    with pytest.raises(ValueError, match="b_high"):
        doubling_bounds(batch, low, low / 2)
