"""The spike rule against direct computations: SpikeDetector's winsorized, bias-corrected EMA; a step's noise weight
by Monte Carlo; the usual batch and its allowance."""

import math

import pytest
import torch
from _spike_rule import spike_ratios

from trainvitals.norms.spikes import (
    SHORT_BATCH_HINT,
    SPREAD_Z,
    SpikeDetector,
    UsualBatch,
    effective_batch,
    noise_weight,
    norm_spike,
    relative_noise_weight,
)


def test_flags_and_ratios_equal_the_direct_computation():
    values = [1.0, 1.2, 0.9, 9.0, 1.1, 30.0, 30.0, 30.0, 1.0] + [40.0] * 40
    detector = SpikeDetector(factor=3.0, beta=0.9, warmup_steps=3)
    flags = [detector.update(v) for v in values]
    expected = spike_ratios(values, 3.0, 0.9, 3)
    assert [f is None for f in flags] == [e is None for e in expected]
    assert [f for f in flags if f] == pytest.approx([e for e in expected if e], rel=1e-12)
    assert flags[3] == pytest.approx(9.0 / ((1.0 * 0.81 + 1.2 * 0.9 + 0.9) / (0.81 + 0.9 + 1.0)))
    assert flags[-1] is None  # a lasting level shift is followed


def _heavy_tailed_batch_losses(steps: int, seed: int = 0) -> list[float]:
    """A classifier's batch losses near convergence: batches of 32 examples, each a hard one (loss 3) with
    probability 0.01, else 0.005: mean 0.035, standard deviation 0.053, 4 % of batches (two hard examples or more)
    above 5× the mean from sampling alone."""
    hard = torch.distributions.Binomial(32, torch.tensor(0.01)).sample((steps,))
    return ((3.0 * hard + 0.005 * (32 - hard)) / 32).tolist()


def test_the_spread_term_equals_the_direct_computation_and_lets_a_noisy_loss_be():
    """With ``spread_z`` a value is a spike only above mean + z s.d. of the values before it as well (the weighted
    mean and variance over the clipped earlier values, computed directly). On batch losses that spread as widely
    as their mean, the plain 5× rule flags 3–5 % of 4,000 steps from sampling alone, the spread's bound (z = 8) at
    most 0.1 %, and still flags a 30× spike; on a steady series the two rules flag the same steps."""
    torch.manual_seed(0)
    values = _heavy_tailed_batch_losses(4000)
    plain, spread = SpikeDetector(5.0, 0.98, 20), SpikeDetector(5.0, 0.98, 20, spread_z=SPREAD_Z)
    flags = [(plain.update(v), spread.update(v)) for v in values]
    expected = spike_ratios(values[:600], 5.0, 0.98, 20, z=SPREAD_Z)
    assert [f is None for _, f in flags[:600]] == [e is None for e in expected]
    assert [f for _, f in flags[:600] if f] == pytest.approx([e for e in expected if e], rel=1e-9)
    assert 0.03 < sum(p is not None for p, _ in flags) / 4000 < 0.05
    assert sum(f is not None for _, f in flags) / 4000 <= 0.001
    assert spread.spread == pytest.approx(0.053, rel=0.3)
    assert spread.update(30.0 * spread.average) is not None and spread.by_spread
    assert " mean + 8 s.d." in spread.spread_words()
    steady = [1.0 + 0.1 * math.sin(i) for i in range(200)] + [6.0] + [1.0] * 50 + [4.9, 5.5]
    assert spike_ratios(steady, 5.0, 0.9, 3, z=SPREAD_Z) == spike_ratios(steady, 5.0, 0.9, 3)
    restored = SpikeDetector(5.0, 0.98, 20, spread_z=SPREAD_Z)
    restored.load_state_dict(spread.state_dict())
    assert (restored.average, restored.spread) == (spread.average, spread.spread)


def test_no_spike_during_warmup_and_state_round_trips():
    detector = SpikeDetector(factor=2.0, beta=0.5, warmup_steps=2)
    assert detector.update(1.0) is None and detector.update(100.0) is None  # warmup
    restored = SpikeDetector(factor=2.0, beta=0.5, warmup_steps=2)
    restored.load_state_dict(detector.state_dict())
    assert (restored.count, restored.average) == (2, detector.average)
    assert restored.update(1000.0) == detector.update(1000.0)


@pytest.mark.parametrize(
    "kwargs, name", [({"factor": 1.0}, "factor"), ({"beta": 1.0}, "beta"), ({"warmup_steps": -1}, "warmup_steps")]
)
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SpikeDetector(**{"factor": 3.0, "beta": 0.9, "warmup_steps": 0, **kwargs})


def test_an_average_of_zero_flags_nothing_and_is_left_behind():
    detector = SpikeDetector(factor=5.0, beta=0.98, warmup_steps=20)
    assert [detector.update(0.0) for _ in range(30)] == [None] * 30
    assert detector.update(1.0) is None  # no scale to exceed: it enters the average
    flags = [detector.update(1.0) for _ in range(200)]
    assert detector.average > 0.5 and flags[-1] is None


@pytest.mark.parametrize(("sizes", "divisor"), [([8], 1), ([2], 1), ([8, 8], 2), ([8, 2], 2), ([8], 2), ([3, 5, 1], 4)])
def test_the_noise_weight_is_the_variance_of_the_steps_gradient_by_monte_carlo(sizes, divisor):
    """Per-example gradients G + ξ (ξ ~ N(0, diag σ²)), micro-batches of ``sizes`` rows, each mean divided by
    ``divisor`` and summed, as Lightning accumulates: E‖g‖² over 100,000 draws against c²‖G‖² + weight · tr Σ,
    c = len(sizes) / divisor; and the step's norm against the usual one's (``divisor`` full micro-batches of 8)
    within the allowance √(B / b) that UsualBatch gives its effective batch b = 1 / weight."""
    g = torch.Generator().manual_seed(1)
    mean, sigma = torch.tensor([0.3, -0.2, 0.1, 0.0]), torch.tensor([1.0, 2.0, 0.5, 1.5])

    def mean_sq_norm(micro: list[int]) -> float:
        grad = sum(
            (mean + sigma * torch.randn(100_000, b, 4, generator=g, dtype=torch.float64)).mean(1) / divisor
            for b in micro
        )
        return grad.square().sum(1).mean().item()

    weight = noise_weight(sizes, divisor)
    c = len(sizes) / divisor
    expected = c**2 * mean.square().sum().item() + weight * sigma.square().sum().item()
    assert mean_sq_norm(sizes) == pytest.approx(expected, rel=0.02)
    usual = UsualBatch(span=10)
    usual.allowance(1.0 / noise_weight([8] * divisor, divisor))  # the usual step: B = 8 · divisor
    allowance, batch = usual.allowance(1.0 / weight)
    assert batch == 8 * divisor
    assert mean_sq_norm(sizes) <= allowance**2 * mean_sq_norm([8] * divisor) * 1.02


def test_a_short_accumulation_is_weighted_as_the_mean_of_what_ran_and_does_not_raise_the_usual_batch():
    """325 rows at batch 16 under accumulation of 4 end each epoch with one 5-row micro-batch, divided by 4: its noise
    weight is that of 80 examples, but its signal is scaled by 1/4 too. Weighted relative to its signal (the 5 rows'
    mean), its norm is within √(B / b) of a full step's by Monte Carlo (100,000 draws), and the full step after it is
    judged against the usual 64, not 80 (a fresh user's fit: every full step had been allowed √(80 / 64))."""
    g = torch.Generator().manual_seed(2)
    mean, sigma = torch.tensor([0.3, -0.2, 0.1, 0.0]), torch.tensor([1.0, 2.0, 0.5, 1.5])

    def mean_sq_norm(micro: list[int]) -> float:
        draws = [(mean + sigma * torch.randn(100_000, b, 4, generator=g, dtype=torch.float64)).mean(1) for b in micro]
        return (sum(draws) / 4).square().sum(1).mean().item()

    assert effective_batch(noise_weight([5], 4)) == 80.0  # its noise alone
    usual = UsualBatch(span=10)
    assert usual.allowance(effective_batch(relative_noise_weight([16] * 4, 4))) == (1.0, 0.0)
    allowance, batch = usual.allowance(effective_batch(relative_noise_weight([5], 4)))
    assert batch == 64.0 and allowance == pytest.approx(math.sqrt(64 / 5))
    assert mean_sq_norm([5]) <= allowance**2 * mean_sq_norm([16] * 4)
    assert usual.allowance(64.0) == (1.0, 64.0)  # the next full step: no allowance


def test_the_noise_weight_is_unknown_without_every_size():
    assert (
        math.isnan(noise_weight([8, None], 1)) and math.isnan(noise_weight([], 1)) and math.isnan(noise_weight([0], 1))
    )


def test_the_usual_batch_is_the_largest_of_the_last_one_to_two_spans():
    usual = UsualBatch(span=3)
    assert usual.allowance(16.0) == (1.0, 0.0)  # nothing usual yet
    assert usual.allowance(4.0) == (2.0, 16.0)  # √(16 / 4)
    assert usual.allowance(math.nan) == (1.0, 16.0)  # an unsized batch is allowed nothing and counts for nothing
    assert usual.allowance(16.0)[0] == 1.0 and usual.allowance(32.0) == (1.0, 16.0)  # a larger one: 1
    copy = UsualBatch(span=3)
    copy.load_state_dict(usual.state_dict())
    for u in (usual, copy):
        assert [u.allowance(4.0) for _ in range(6)][-1] == (1.0, 4.0)  # after 2 spans of 4s, 4 is usual


def test_a_short_batchs_norm_is_judged_at_its_allowance_and_said():
    """Batches of 16 with one of 1 every 10th: norm_spike flags what the direct computation does with the short
    batches' thresholds × √(16 / 1) = 4 (what UsualBatch allows them), not what the plain rule does (it flags the
    first 6), and says why it allowed the 80 more."""
    values, batches = [], []
    for i in range(60):
        short = i % 10 == 9
        values.append((80.0 if i == 39 else 6.0) if short else 1.0 + 0.1 * (i % 3))
        batches.append(effective_batch(noise_weight([1 if short else 16], 1)))
    spikes, usual = SpikeDetector(5.0, 0.9, 3), UsualBatch(span=10)
    found = [norm_spike(v, b, spikes, usual) for v, b in zip(values, batches)]
    allowed = spike_ratios(values, 5.0, 0.9, 3, [4.0 if b == 1.0 else 1.0 for b in batches])
    assert [f is None for f in found] == [a is None for a in allowed]
    assert [i for i, a in enumerate(allowed) if a] == [39]
    assert [i for i, p in enumerate(spike_ratios(values, 5.0, 0.9, 3)) if p] == [9, 39]  # the plain rule: a 6 too
    ratio, said = found[39]
    assert ratio == pytest.approx(allowed[39], rel=1e-12)
    assert said == f" (a batch of 1 examples against the usual 16: beyond the 20× its noise allows; {SHORT_BATCH_HINT})"
    average = spikes.average
    assert norm_spike(100.0, math.nan, spikes, None) == (pytest.approx(100.0 / average, rel=1e-12), "")  # allowed 1
