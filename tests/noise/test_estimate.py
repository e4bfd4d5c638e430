"""The run's one noise estimate (core/estimate.py) against closed forms, with calibrated error bars."""

from __future__ import annotations

import math
import re

import pytest
import torch

from trainvitals.noise import estimate
from trainvitals.noise.estimate import (
    AGREEMENT_Z,
    COUPLING_Z,
    Z90,
    GradientNoise,
    NoiseSource,
    b_simple_interval,
    band_ratio,
    noise_intervals,
    reshuffle_excess,
)
from trainvitals.noise.estimators import (
    effective_count,
    fieller_interval,
    per_example_estimates,
    t_quantile,
    two_batch_size_estimates,
)

D, SIGMA, B, MICRO = 8, 0.5, 64, 16


def linear_regression_truth(d: torch.Tensor) -> tuple[float, float]:
    """‖G‖² and tr Σ of g = (x·d − ε) x with x ~ N(0, I_D), ε ~ N(0, σ²), d = w − w*:
    G = d and E[(x·d)² x xᵀ] = ‖d‖² I + 2ddᵀ, so tr Σ = (D + 1)‖d‖² + Dσ²."""
    g2 = float(d.square().sum())
    return g2, (D + 1) * g2 + D * SIGMA**2


def step_estimates(d: torch.Tensor, gen: torch.Generator) -> tuple[tuple, tuple, torch.Tensor]:
    """One step's per-example (b = 1) and micro-batch (b = 16) estimates from the same 64 examples."""
    x = torch.randn(B, D, generator=gen, dtype=torch.float64)
    eps = SIGMA * torch.randn(B, generator=gen, dtype=torch.float64)
    g = (x @ d - eps)[:, None] * x  # (B, D) per-example gradients
    mean = g.mean(0)
    batch_sq = mean.square().sum()
    per_example = per_example_estimates(g.square().sum(), batch_sq, B)
    micro_means = g.view(B // MICRO, MICRO, D).mean(1)
    micro = two_batch_size_estimates(micro_means.square().sum(1).mean(), batch_sq, B // MICRO, MICRO)
    return per_example, micro, batch_sq


def _with_se(src: NoiseSource) -> tuple[tuple[float, float], tuple[float, float]]:
    g, s, var_g, var_s, _, _ = src.smoothed()  # each quantity's window, as disagreement() reads them
    return (float(g), math.sqrt(float(var_g))), (float(s), math.sqrt(float(var_s)))


def run_trial(seed: int, steps: int = 250) -> GradientNoise:
    gen = torch.Generator().manual_seed(seed)
    d = torch.randn(D, generator=gen, dtype=torch.float64) * 0.3
    noise = GradientNoise()
    sources = [NoiseSource("per_example", 0.98), NoiseSource("micro_batch", 0.98)]
    for src in sources:
        src.effective_batch_size = B
        noise.attach(src)
    for _ in range(steps):
        per_example, micro, _ = step_estimates(d, gen)
        sources[0].update(*per_example)
        sources[1].update(*micro)
    noise.truth = linear_regression_truth(d)  # type: ignore[attr-defined]
    return noise


@pytest.mark.slow
def test_the_combined_90_percent_interval_covers_the_truth_and_the_sources_agree():
    trials = [run_trial(seed) for seed in range(40)]
    covered_g = covered_s = agree = 0
    for noise in trials:
        g2, trace = noise.truth  # type: ignore[attr-defined]
        h = noise.host_summary()
        covered_g += abs(h["grad_sq_norm"] - g2) <= Z90 * h["grad_sq_norm_se"]
        covered_s += abs(h["trace_cov"] - trace) <= Z90 * h["trace_cov_se"]
        (g_a, s_a), (g_b, s_b) = (_with_se(noise.sources[n]) for n in ("per_example", "micro_batch"))
        agree += all(abs(a[0] - b[0]) <= 2 * math.hypot(a[1], b[1]) for a, b in ((g_a, g_b), (s_a, s_b)))
        assert noise.disagreement() == "" or not agree
        # The combination sits between its sources and leans to the one with less variance (per-example).
        per, micro = (float(noise.sources[n].smoothed()[1]) for n in ("per_example", "micro_batch"))
        assert min(per, micro) <= h["trace_cov"] <= max(per, micro)
    print(f"90% intervals: ‖G‖² covered {covered_g}/40, tr Σ {covered_s}/40; sources agree {agree}/40")
    assert covered_g >= 34 and covered_s >= 34  # ≥ 85%
    assert agree >= 36
    # Not decorative: the stated errors are of the size of the actual errors, not inflated far beyond them.
    errors = [abs(n.host_summary()["trace_cov"] - n.truth[1]) / n.host_summary()["trace_cov_se"] for n in trials]  # type: ignore[attr-defined]
    assert sorted(errors)[len(errors) // 2] > 0.2


def test_one_source_states_its_own_error_and_b_simple_by_fieller():
    gen = torch.Generator().manual_seed(3)
    d = torch.full((D,), 0.2, dtype=torch.float64)
    noise, src = GradientNoise(), NoiseSource("per_example", 0.9)
    src.effective_batch_size = B
    noise.attach(src)
    for _ in range(100):
        per_example, _, _ = step_estimates(d, gen)
        src.update(*per_example)
    est = noise.estimate()
    _, trace, var_g, var_s, cov, _ = (float(v) for v in src.smoothed())  # the windows it chose (rule 7)
    assert float(est.trace_cov) == pytest.approx(trace)
    assert float(est.trace_cov_se) == pytest.approx(math.sqrt(float(var_s)))
    assert float(est.grad_sq_norm_se) == pytest.approx(math.sqrt(float(var_g)))
    # B_simple's error is its own Fieller interval's, by the quadratic's closed-form roots (Fieller 1954):
    # (S − θG)² ≤ t²(σ_S² − 2θ·Cov + θ²σ_G²), t Student's 95% quantile at n_eff − 1 degrees of freedom.
    g, s = float(est.grad_sq_norm), float(est.trace_cov)
    t = float(t_quantile(Z90, est.effective_measurements - 1))
    a, half_b, c = g * g - t * t * float(var_g), s * g - t * t * cov, s * s - t * t * float(var_s)
    root = math.sqrt(half_b * half_b - a * c)
    low, high = (half_b - root) / a, (half_b + root) / a
    assert a > 0 and (float(est.intervals["b_simple"][0]), float(est.intervals["b_simple"][1])) == pytest.approx(
        (low, high), rel=1e-6
    )
    b = s / g
    assert float(est.b_simple_rel_err) == pytest.approx(max(high / b - 1, 1 - low / b) / t, rel=1e-6)
    assert float(est.noise_floor) == pytest.approx(math.sqrt(trace / B))
    assert float(est.noise_floor_se) == pytest.approx(
        float(est.noise_floor) * float(est.trace_cov_se) / (2 * float(est.trace_cov))
    )


def test_an_invalid_source_never_enters_and_none_left_is_said():
    noise = GradientNoise()
    coupled, micro = NoiseSource("probe", 0.9), NoiseSource("micro_batch", 0.9)
    for src in (coupled, micro):
        src.effective_batch_size = 8
        noise.attach(src)
    coupled.update(torch.tensor(-0.3), torch.tensor(5.0))
    coupled.invalidate("per-example gradients through BatchNorm in training mode")
    assert noise.estimate().count == 0  # the micro-batch source has no update yet; the invalid one is ignored
    micro.update(torch.tensor(1.0), torch.tensor(4.0))
    micro.update(torch.tensor(1.2), torch.tensor(4.4))
    assert float(noise.estimate().trace_cov) == pytest.approx(float(micro.smoothed()[1]))
    assert bool(noise.in_noise_band(1.0)) is False  # ‖G‖² 1.1 > 4.2/8
    noise.detach("micro_batch")
    h = noise.host_summary()
    assert not h["decisive"] and "no valid noise source" in h["why"] and "BatchNorm" in h["why"]
    assert bool(noise.in_noise_band(1e9)) is False  # a broken estimate is never "in the band"


def test_a_negative_grad_sq_norm_from_valid_examples_is_in_the_band():
    noise, src = GradientNoise(), NoiseSource("per_example", 0.9)
    src.effective_batch_size = 8
    noise.attach(src)
    for k in range(20):  # a decision needs 20 measurements
        src.update(torch.tensor(-0.2 + 0.5 * (-1) ** k), torch.tensor(3.0))
    assert bool(noise.in_noise_band(0.2))


def test_partial_coverage_is_not_decisive_and_like_is_compared_with_like():
    noise = GradientNoise()
    part, whole = NoiseSource("probe", 0.9, param_share=0.43), NoiseSource("micro_batch", 0.9)
    part.effective_batch_size = whole.effective_batch_size = 8
    noise.attach(part)
    part.update(
        torch.tensor(-0.1), torch.tensor(2.0), covered_sq_norm=torch.tensor(0.3), total_sq_norm=torch.tensor(1.0)
    )
    h = noise.host_summary()
    assert h["coverage"] == pytest.approx(0.3) and not h["decisive"] and h["why"].startswith("partial")
    part.unit_scale = 2.0
    assert float(noise.metrics()["grad_norm/measured_total"]) == pytest.approx(2.0 * math.sqrt(0.3))
    assert not bool(noise.in_noise_band(1.0))
    # A source over all parameters takes precedence: sources over different parameters are not averaged.
    noise.attach(whole)
    for k in range(20):
        whole.update(torch.tensor(-0.1 + 0.3 * (-1) ** k), torch.tensor(2.5))
    h = noise.host_summary()
    assert h["sources"] == ("micro_batch",) and h["coverage"] == 1.0 and h["decisive"]
    assert h["trace_cov"] == pytest.approx(2.5) and bool(noise.in_noise_band(1.0))
    assert "grad_norm/measured_total" not in noise.metrics()  # the whole model: grad_norm/total is its norm


def test_units_of_each_source_are_converted_to_those_of_grad():
    noise, src = GradientNoise(), NoiseSource("probe", 0.9)
    src.unit_scale, src.effective_batch_size = 4.0, 16
    noise.attach(src)
    src.update(torch.tensor(0.5), torch.tensor(2.0))
    est = noise.estimate()
    assert float(est.trace_cov) == pytest.approx(32.0) and float(est.b_simple) == pytest.approx(4.0)
    assert float(est.noise_floor) == pytest.approx(math.sqrt(32.0 / 16))


def test_the_estimate_is_cached_until_a_source_changes():
    """Two calls with nothing new in between (the stopper's and the probe's logs of one step) return one
    object; an update, a restore, a new unit or population, an invalid source each give a fresh one, equal
    to what an uncached GradientNoise computes from the same sources."""
    noise, sources = GradientNoise(), [NoiseSource("probe", 0.9), NoiseSource("micro_batch", 0.9)]
    for src in sources:
        src.effective_batch_size = 16
        noise.attach(src)
        src.update(torch.tensor(0.5), torch.tensor(2.0))
    first = noise.estimate()
    assert noise.estimate() is first

    def fresh(est):
        other = GradientNoise()
        for src in noise.sources.values():
            other.attach(src)
        expected = other.estimate()
        assert est is not first and est.sources == expected.sources
        for name in ("grad_sq_norm", "trace_cov", "b_simple", "noise_floor", "count"):
            assert float(getattr(est, name)) == float(getattr(expected, name)), name
        return est

    sources[0].update(torch.tensor(0.7), torch.tensor(3.0))
    first = fresh(noise.estimate())
    assert float(first.count) == 2 and noise.estimate() is first
    sources[1].unit_scale = 2.0
    first = fresh(noise.estimate())
    sources[0].population = 100
    first = fresh(noise.estimate())
    sources[1].load_state_dict(sources[0].state_dict())
    first = fresh(noise.estimate())
    sources[0].invalidate("coupled")
    est = fresh(noise.estimate())
    assert est.sources == ("micro_batch",) and noise.estimate() is est


def test_state_round_trips():
    src = NoiseSource("probe", 0.9, 0.5)
    src.unit_scale, src.effective_batch_size = 2.0, 32
    for k in range(5):
        src.update(
            torch.tensor(1.0 + k),
            torch.tensor(3.0 - 0.1 * k),
            covered_sq_norm=torch.tensor(0.5),
            total_sq_norm=torch.tensor(1.0),
        )
    src.invalidate("coupled")
    src.population, src.reshuffled = 100, True
    copy = NoiseSource("probe", 0.9, 0.5)
    copy.load_state_dict(src.state_dict())
    assert (copy.invalid, copy.unit_scale, copy.effective_batch_size) == ("coupled", 2.0, 32)
    assert (copy.population, copy.reshuffled) == (100, True)
    assert float(copy.norm_share) == pytest.approx(0.5)
    assert float(copy.error.relative_error(copy.ema)) == pytest.approx(float(src.error.relative_error(src.ema)))
    fresh = NoiseSource("probe", 0.9)
    fresh.load_state_dict({"noise": src.ema.state_dict()})  # an older checkpoint: no error moments, no norms
    assert float(fresh.norm_share) == 1.0 and fresh.invalid == ""


def test_two_sources_that_disagree_beyond_their_errors_are_named_once():
    noise = GradientNoise()
    a, b = NoiseSource("per_example", 0.5), NoiseSource("micro_batch", 0.5)
    for src, level in ((a, 1.0), (b, 3.0)):
        noise.attach(src)
        for k in range(20):
            src.update(torch.tensor(level + 0.01 * (-1) ** k), torch.tensor(10.0 + 0.1 * (-1) ** k))
    message = noise.disagreement()
    # The micro-batch source is independent by construction: it decides, the per-example one is dropped.
    assert "per_example is dropped" in message and "disagrees with the micro-batch/rank source on ‖G‖²" in message
    assert noise.estimate().sources == ("micro_batch",) and a.invalid
    assert noise.disagreement() == ""  # once
    noise.attach(b)  # the same source again (a new epoch): still said once
    assert noise.disagreement() == ""


def test_two_sources_other_than_micro_batches_that_disagree_are_named_once_and_kept():
    noise = GradientNoise()
    a, b = NoiseSource("per_example", 0.5), NoiseSource("probe", 0.5)
    for src, level in ((a, 1.0), (b, 3.0)):
        noise.attach(src)
        for k in range(20):
            src.update(torch.tensor(level + 0.01 * (-1) ** k), torch.tensor(10.0 + 0.1 * (-1) ** k))
    assert "per_example and probe disagree on ‖G‖²" in noise.disagreement()
    assert noise.disagreement() == "" and noise.estimate().sources == ("per_example", "probe")


def coupled_step(d: torch.Tensor, gen: torch.Generator, inflate: float) -> tuple[tuple, tuple]:
    """Per-example and micro-batch estimates of one step where the per-example addends are coupled: each is
    its example's gradient with its deviation from the batch mean scaled by ``inflate`` (their sum, the batch
    gradient, unchanged), as batch statistics or in-batch negatives do; the micro-batch means are the true ones."""
    x = torch.randn(B, D, generator=gen, dtype=torch.float64)
    eps = SIGMA * torch.randn(B, generator=gen, dtype=torch.float64)
    g = (x @ d - eps)[:, None] * x
    mean = g.mean(0)
    coupled = mean + inflate * (g - mean)
    batch_sq = mean.square().sum()
    micro_means = g.view(B // MICRO, MICRO, D).mean(1)
    return (
        per_example_estimates(coupled.square().sum(), batch_sq, B),
        two_batch_size_estimates(micro_means.square().sum(1).mean(), batch_sq, B // MICRO, MICRO),
    )


def test_a_per_example_source_below_zero_beyond_its_error_is_coupled_and_never_in_the_band():
    gen = torch.Generator().manual_seed(3)
    d = torch.full((D,), 0.02, dtype=torch.float64)
    noise, src = GradientNoise(), NoiseSource("probe", 0.9)
    src.effective_batch_size = B
    noise.attach(src)
    for _ in range(40):
        src.update(*coupled_step(d, gen, 2.0)[0])
    assert not bool(noise.in_noise_band(1e6))  # before any logging step's check: not "G ≈ 0"
    est = noise.estimate()
    assert float(est.grad_sq_norm) < -COUPLING_Z * float(est.grad_sq_norm_se)
    message = noise.disagreement()
    assert "probe is dropped" in message and "batch statistics" in message and "in-batch negatives" in message
    assert src.invalid and noise.estimate().count == 0 and noise.disagreement() == ""


def test_an_independent_per_example_source_at_g_zero_stays_valid():
    gen = torch.Generator().manual_seed(4)
    noise, src = GradientNoise(), NoiseSource("probe", 0.9)
    src.effective_batch_size = B
    noise.attach(src)
    for _ in range(60):
        src.update(*coupled_step(torch.zeros(D, dtype=torch.float64), gen, 1.0)[0])
    assert noise.disagreement() == "" and not src.invalid and bool(noise.in_noise_band(0.2))


def test_a_coupled_per_example_source_is_dropped_for_the_micro_batches():
    gen = torch.Generator().manual_seed(6)
    d = torch.full((D,), 0.2, dtype=torch.float64)
    noise, per, micro = GradientNoise(), NoiseSource("probe", 0.9), NoiseSource("micro_batch", 0.9)
    for src in (per, micro):
        src.effective_batch_size = B
        noise.attach(src)
    for _ in range(60):
        per_example, micro_batch = coupled_step(d, gen, 1.5)
        per.update(*per_example)
        micro.update(*micro_batch)
    message = noise.disagreement()
    assert "probe is dropped" in message and "independent by construction" in message and "BatchNorm" in message
    truth = linear_regression_truth(d)[1]
    est = noise.estimate()
    assert est.sources == ("micro_batch",) and abs(float(est.trace_cov) - truth) < 4 * float(est.trace_cov_se)


def test_the_per_step_band_is_the_full_estimates_band():
    """The stopper's per-step path (cached weights, current EMAs) decides as the full estimate does."""
    gen = torch.Generator().manual_seed(5)
    noise, a, b = GradientNoise(), NoiseSource("per_example", 0.9), NoiseSource("micro_batch", 0.9)
    for src in (a, b):
        src.effective_batch_size = B
        noise.attach(src)
    d = torch.full((D,), 0.05, dtype=torch.float64)
    for step in range(60):
        per_example, micro, _ = step_estimates(d, gen)
        a.update(*per_example)
        b.update(*micro)
        if step % 7 == 0:
            noise.estimate()  # a logging step refreshes the weights
        for margin in (0.05, 0.3, 2.0):
            lean = bool(noise.in_noise_band(margin))
            full = noise.estimate()
            grad, trace = float(full.grad_sq_norm), float(full.trace_cov)
            near = abs(grad - margin * trace / B) < 0.05 * abs(grad) + 1e-12  # stale weights may tip a tie
            assert near or lean == bool(noise.in_noise_band(margin, full)), (step, margin)


def test_coverage_of_the_norm_does_not_bound_the_unmeasured_noise_when_the_signal_dominates():
    """Closed form: the measured part has ‖G‖² 1, tr Σ 8 at B = 64 (B_simple 8 ≪ B: signal-dominated), so
    E‖ḡ_m‖² = 1.125; at 95% coverage the other 5% of ‖ḡ‖² may be pure noise, tr Σ_u = B·0.05·‖ḡ‖², 47% of
    the measured tr Σ: not decisive, though the old 90%-of-‖ḡ‖² rule passed it."""
    noise, src = GradientNoise(), NoiseSource("probe", 0.5, param_share=0.9)
    src.effective_batch_size = 64
    noise.attach(src)
    for _ in range(30):
        src.update(
            torch.tensor(1.0), torch.tensor(8.0), covered_sq_norm=torch.tensor(0.95), total_sq_norm=torch.tensor(1.0)
        )
    total = (1.0 + 8.0 / 64) / 0.95
    worst = 64 * 0.05 * total / 8.0
    h = noise.host_summary()
    assert h["coverage"] == pytest.approx(0.95) and h["unmeasured_trace_share"] == pytest.approx(worst)
    assert not h["decisive"] and h["why"].startswith("partial") and "0.47×" in h["why"]
    assert not bool(noise.in_noise_band(1e6)) and not bool(noise.decisive())
    # Noise-dominated (B/B_simple = 0.08): the same coverage bounds the unmeasured tr Σ to 5.7% of the measured.
    quiet, src = GradientNoise(), NoiseSource("probe", 0.5, param_share=0.9)
    src.effective_batch_size = 64
    quiet.attach(src)
    for _ in range(30):
        src.update(
            torch.tensor(0.01), torch.tensor(8.0), covered_sq_norm=torch.tensor(0.95), total_sq_norm=torch.tensor(1.0)
        )
    h = quiet.host_summary()
    assert h["unmeasured_trace_share"] == pytest.approx(0.05 / 0.95 * (1 + 64 * 0.01 / 8.0)) and h["decisive"]


def test_the_unmeasured_noise_bound_holds_for_batches_drawn_without_replacement():
    """Worst case, brute force: 8 examples, batches of 4 drawn without replacement; 2 unmeasured coordinates
    are pure noise (mean 0 over the population). E‖ḡ_m‖², E‖ḡ_u‖² and E of the estimators over all 70 batches;
    the unmeasured tr Σ is then exactly the bound, which without the factor (N − B)/(N − 1) = 4/7 is too small
    (0.66 against 0.92 here)."""
    import itertools

    g = torch.Generator().manual_seed(0)
    grads = torch.randn(8, 5, generator=g, dtype=torch.float64)
    grads[:, :3] += 0.4
    grads[:, 3:] -= grads[:, 3:].mean(0)
    batches = [list(b) for b in itertools.combinations(range(8), 4)]
    mean_sq = [grads[b].mean(0).square() for b in batches]
    measured, unmeasured = (
        sum(float(m[part].sum()) for m in mean_sq) / len(batches) for part in (slice(0, 3), slice(3, 5))
    )
    # the estimators over the measured part: the unmeasured coordinates' share of ‖ḡ‖² is what coverage leaves out
    pairs_m = [
        per_example_estimates(grads[b][:, :3].square().sum(), grads[b][:, :3].mean(0).square().sum(), 4)
        for b in batches
    ]
    g_m, s_m = (sum(float(p[i]) for p in pairs_m) / len(pairs_m) for i in (0, 1))
    noise, src = GradientNoise(), NoiseSource("probe", 0.5, param_share=0.6)
    src.effective_batch_size, src.population = 4, 8
    noise.attach(src)
    for _ in range(30):
        src.update(
            *(torch.tensor(v, dtype=torch.float64) for v in (g_m, s_m)),
            covered_sq_norm=torch.tensor(measured, dtype=torch.float64),
            total_sq_norm=torch.tensor(measured + unmeasured, dtype=torch.float64),
        )
    true_share = float(((grads[:, 3:] ** 2).sum(1)).mean() / ((grads[:, :3] - grads[:, :3].mean(0)) ** 2).sum(1).mean())
    assert noise.host_summary()["unmeasured_trace_share"] == pytest.approx(true_share, rel=1e-9)


def _population(offset: float) -> tuple[torch.Tensor, float, float]:
    """Per-example gradients of a linear regression at ``offset`` from its optimum (D + 1 coordinates): the
    population of the noisy calibration, its ‖G‖² and tr Σ by brute force."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20000, D, generator=gen, dtype=torch.float64)
    w = torch.randn(D, generator=gen, dtype=torch.float64)
    y = x @ w + 0.5 * torch.randn(20000, generator=gen, dtype=torch.float64)
    r = x @ (w + offset) - y
    g = torch.cat([2 * r[:, None] * x, 2 * r[:, None]], 1)
    mean = g.mean(0)
    return g, float(mean @ mean), float((g - mean).square().sum(1).mean())


def _sampled_summary(g: torch.Tensor, steps: int, batch: int, gen: torch.Generator) -> dict:
    noise, src = GradientNoise(), NoiseSource("probe", 0.98)
    src.effective_batch_size = batch
    noise.attach(src)
    for _ in range(steps):
        b = g[torch.randint(0, len(g), (batch,), generator=gen)]
        src.update(*per_example_estimates(b.square().sum(), b.mean(0).square().sum(), batch))
    return noise.host_summary()


def test_few_measurements_never_decide():
    g, _, _ = _population(0.3)
    h = _sampled_summary(g, 19, 16, torch.Generator().manual_seed(1))
    assert not h["decisive"] and not h["reliable"] and h["why"].startswith("not measured enough yet")
    assert _sampled_summary(g, 20, 16, torch.Generator().manual_seed(1))["decisive"]


@pytest.mark.slow
def test_the_reliability_gate_does_not_select_underestimates_when_noise_dominates():
    """B = 16 at a true B_simple of 370: no run may pass as reliable on a lucky ‖G‖²; where runs pass (a true
    B_simple of 39), the stated 90% range B_simple·(1 ± z·rel_err) holds the truth in ≥ 85% of them."""
    gen = torch.Generator().manual_seed(2)
    g, g2, trace = _population(0.03)
    assert trace / g2 == pytest.approx(370, rel=0.01)
    noisy = [_sampled_summary(g, 100, 16, gen) for _ in range(60)]
    assert sum(h["reliable"] for h in noisy) <= 1
    g, g2, trace = _population(0.1)
    passed = [h for h in (_sampled_summary(g, 100, 16, gen) for _ in range(60)) if h["reliable"]]
    assert len(passed) >= 15
    truth = trace / g2
    covered = [abs(h["b_simple"] - truth) <= Z90 * h["b_simple_rel_err"] * h["b_simple"] for h in passed]
    assert sum(covered) >= 0.85 * len(passed)


def test_the_finite_population_correction_against_brute_force_on_a_small_dataset():
    """Batches of 16 drawn without replacement from N = 48 examples (a shuffled epoch): uncorrected,
    E[‖G‖²_est] = ‖G‖² − S/N; with N given, ‖G‖² and tr Σ of the N examples (brute force) are recovered."""
    gen = torch.Generator().manual_seed(8)
    n, batch = 48, 16
    x = torch.randn(n, D, generator=gen, dtype=torch.float64)
    eps = SIGMA * torch.randn(n, generator=gen, dtype=torch.float64)
    g = (x @ torch.full((D,), 0.15, dtype=torch.float64) - eps)[:, None] * x
    mean = g.mean(0)
    g2, trace = float(mean @ mean), float((g - mean).square().sum(1).mean())
    raw, corrected = GradientNoise(), GradientNoise()
    for noise in (raw, corrected):
        src = NoiseSource("probe", 0.999)
        src.effective_batch_size = batch
        src.population = n if noise is corrected else None
        noise.attach(src)
    for _ in range(1500):
        for perm in torch.randperm(n, generator=gen).view(n // batch, batch):
            b = g[perm]
            est = per_example_estimates(b.square().sum(), b.mean(0).square().sum(), batch)
            for noise in (raw, corrected):
                noise.sources["probe"].update(*est)
    fixed, biased = corrected.estimate(), raw.estimate()
    assert abs(float(fixed.grad_sq_norm) - g2) < 4 * float(fixed.grad_sq_norm_se)
    assert abs(float(fixed.trace_cov) - trace) < 4 * float(fixed.trace_cov_se)
    bias = float(biased.grad_sq_norm) - g2
    assert bias < -4 * float(biased.grad_sq_norm_se)
    assert bias == pytest.approx(-trace / (n - 1), rel=0.25)  # − S/N with S = N tr Σ/(N − 1)


def test_band_ratio_is_grad_sq_norm_over_the_band_edge():
    assert band_ratio(0.5, 40.0, 64, 0.2) == pytest.approx(0.5 / (0.2 * 40.0 / 64))
    ratio = band_ratio(torch.tensor(0.5), torch.tensor(40.0), 64, 0.2)
    assert isinstance(ratio, torch.Tensor) and float(ratio) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="margin"):
        band_ratio(0.5, 40.0, 64, 0.0)


def _noisy_probe(seed: int, grad_sq_norm: float, steps: int, **kw) -> tuple[GradientNoise, NoiseSource]:
    """A probe source at batch 16 fed ``steps`` per-step estimates (‖G‖², tr Σ) = (grad_sq_norm, 10) plus unit normal
    noise, attached to a fresh estimate (``kw``: its arguments)."""
    gen = torch.Generator().manual_seed(seed)
    noise, src = GradientNoise(**kw), NoiseSource("probe", 0.98)
    src.effective_batch_size = 16
    noise.attach(src)
    for _ in range(steps):
        src.update(
            grad_sq_norm + torch.randn((), generator=gen, dtype=torch.float64),
            10.0 + torch.randn((), generator=gen, dtype=torch.float64),
        )
    return noise, src


def test_a_bounded_but_wide_b_simple_is_unreliable_by_its_own_interval():
    """Fieller's interval bounded on both sides but wider than ``max_rel_err`` allows: the flag, the relative error
    and the reason are all that interval's (no "no upper bound" next to an upper bound; issue #24)."""
    noise, src = _noisy_probe(seed=1, grad_sq_norm=1.0, steps=60, max_rel_err=0.05)
    h = noise.host_summary()
    low, high, b = h["b_simple_low"], h["b_simple_high"], h["b_simple"]
    t = float(t_quantile(Z90, torch.tensor(h["effective_measurements"], dtype=torch.float64) - 1))
    assert h["decisive"] and not h["reliable"] and 0 < low < b < high < math.inf
    assert h["b_simple_rel_err"] == pytest.approx(max(high / b - 1, 1 - low / b) / t, rel=1e-9)
    assert 0.05 < h["b_simple_rel_err"] < math.inf
    quoted = re.search(r"B_simple ([0-9.]+)–([0-9.]+) \(90 %\)", h["why"])
    assert (float(quoted.group(1)), float(quoted.group(2))) == pytest.approx((low, high), rel=0.01)
    assert f"{h['b_simple_rel_err']:.2g}" in h["why"] and "no upper bound" not in h["why"]
    # Within the bound, the same interval makes it reliable.
    wide = GradientNoise(max_rel_err=h["b_simple_rel_err"] * 1.01)
    wide.attach(src)
    assert wide.host_summary()["reliable"]


@pytest.mark.parametrize(("seed", "said"), [(0, "no upper bound"), (3, "≤ 0")])
def test_an_unresolved_b_simple_is_said_in_words_not_internal_numbers(seed, said):
    """With no upper end to B_simple's interval (seed 0: ‖G‖² within its error of zero) or at ‖G‖² ≤ 0 (seed 3),
    B_simple's relative error is the marker ``inf``: the caveat and the table say why in words, never ``inf``."""
    noise, _ = _noisy_probe(seed=seed, grad_sq_norm=0.2, steps=30)
    h = noise.host_summary()
    assert h["decisive"] and math.isinf(h["b_simple_rel_err"]) and (h["grad_sq_norm"] > 0) == (seed == 0)
    text = " ".join(f"{k} {v}" for k, v in noise.summary_rows())
    assert said in h["why"] and said in text
    # The interval is said instead: B_simple's 90% lower bound (its calibration: test_intervals.py).
    assert b_simple_interval(h) in h["why"]
    found = re.search(r"B_simple ≥ ([0-9.]+) \(90 %\)", h["why"])
    assert (found is not None) == (h["b_simple_low"] > 0) and (seed == 3 or found is not None)
    assert found is None or float(found.group(1)) == pytest.approx(h["b_simple_low"], rel=0.01)
    assert "inf" not in text.replace("B_simple", "")


def _reshuffled_probe(grad_sq_norm: float, trace: float, grad_sd: float, trace_sd: float) -> GradientNoise:
    """A probe source at batch 32 over N = 455 reshuffled examples (rule 6), fed 300 per-step estimates of mean
    (grad_sq_norm, trace) after rule 6's correction and normal noise of those spreads (seed 0)."""
    gen = torch.Generator().manual_seed(0)
    noise, src = GradientNoise(), NoiseSource("probe", 0.98)
    src.effective_batch_size, src.population, src.reshuffled = 32, 455, True
    noise.attach(src)
    for _ in range(300):
        s = trace * 455 / 454 + trace_sd * torch.randn((), generator=gen, dtype=torch.float64)
        g = grad_sq_norm - trace / 454 + grad_sd * torch.randn((), generator=gen, dtype=torch.float64)
        src.update(g, s)
    return noise


def test_an_upper_end_taken_by_the_reshuffled_epoch_s_excess_names_it():
    """A fresh user's shuffled fit (N = 455, B = 32, lr 0): ‖G‖² 0.0117 ± 0.0021, 5.6 standard errors from zero, and
    the fit-end line said it "is within its error of zero, so B_simple has no upper bound". The cause was rule 6's
    δ_R ≈ 0.0164 > ‖G‖²: said so, with the numbers, the B_simple an upper end needs and what would help."""
    noise = _reshuffled_probe(0.0117, 1.46, 0.021, 2.4)
    h = noise.host_summary()
    t = float(t_quantile(Z90, torch.tensor(h["effective_measurements"] - 1, dtype=torch.float64)))
    delta = reshuffle_excess(h["trace_cov_high"], 455)
    assert h["grad_sq_norm"] > t * h["grad_sq_norm_se"] and h["grad_sq_norm"] < delta  # resolved, yet below δ_R
    assert math.isinf(h["b_simple_high"]) and h["b_simple_low"] > 0
    why = h["why"]
    assert "within its error of zero" not in why, why
    assert f"not of the {delta:.3g} a reshuffled epoch can add" in why and "N = 455" in why and "N/4 = 114" in why
    needs = h["trace_cov"] / (delta + t * h["grad_sq_norm_se"])
    assert f"≈ {needs:.3g} for one" in why and "RandomSampler(replacement=True)" in why
    assert why.endswith(b_simple_interval(h)) and why.count(";") == 2, why
    tags = noise.metrics()
    assert float(tags["grad_noise/reshuffle_excess"]) == pytest.approx(delta, rel=1e-9)
    # Where ‖G‖² is within its own error of zero, that is still the cause said.
    weak = _reshuffled_probe(0.002, 1.46, 0.021, 2.4).host_summary()
    assert "within its error of zero, so B_simple has no upper bound" in weak["why"], weak["why"]


def test_a_b_simple_with_no_bound_at_all_is_said_in_one_sentence():
    """Where tr(Σ) is within its error of zero too, B_simple's interval has no end at all: one sentence, not "…so
    B_simple has no upper bound; B_simple has no bound yet.\""""
    gen = torch.Generator().manual_seed(5)
    noise, src = GradientNoise(), NoiseSource("probe", 0.98)
    src.effective_batch_size = 16
    noise.attach(src)
    for _ in range(40):
        src.update(0.3 + torch.randn((), generator=gen, dtype=torch.float64), 0.3 + 5 * torch.randn((), generator=gen))
    h = noise.host_summary()
    assert h["grad_sq_norm"] > 0 and not h["b_simple_low"] > 0 and math.isinf(h["b_simple_high"]), h
    assert h["why"] == (
        "B_simple unreliable: the smoothed ‖G‖² and tr(Σ) are both within their errors of zero, so B_simple has no "
        "bound yet"
    )


@pytest.mark.slow
def test_attaching_the_micro_batch_source_leaves_the_estimate_within_its_interval():
    """Issue #24: probe alone vs probe + stopper (its micro-batch source) on the same run moved B_simple 2.4×, since
    one lagging source switched every source's window. Now each source takes its own windows (rule 7) and the
    sources are weighted by variance: on a falling ‖G‖² (halving every 50 steps) the estimate with both sources lies
    inside the probe-alone estimate's 90 % intervals (‖G‖², tr Σ, B_simple) in ≥ 90 % of runs."""
    inside = 0
    for seed in range(30):
        gen = torch.Generator().manual_seed(seed)
        alone, both = GradientNoise(), GradientNoise()
        probe, twin, micro = (NoiseSource(n, 0.98) for n in ("probe", "probe", "micro_batch"))
        for noise, sources in ((alone, (probe,)), (both, (twin, micro))):
            for src in sources:
                src.effective_batch_size = 32
                noise.attach(src)
        for step in range(150):  # to ‖G‖² = 0.5 against tr Σ ≈ 18: a resolved B_simple
            g = torch.zeros(D, dtype=torch.float64)
            g[0] = 2 * 2 ** (-step / 100)  # ‖G‖² halves every 50 steps
            per = g + SIGMA * 3 * torch.randn(32, D, generator=gen, dtype=torch.float64)
            batch_sq = per.mean(0).square().sum()
            probe.update(*per_example_estimates(per.square().sum(), batch_sq, 32))
            twin.update(*per_example_estimates(per.square().sum(), batch_sq, 32))
            means = per.view(4, 8, D).mean(1)
            micro.update(*two_batch_size_estimates(means.square().sum(1).mean(), batch_sq, 4, 8))
        a, b = alone.host_summary(), both.host_summary()
        inside += all(a[f"{k}_low"] <= b[k] <= a[f"{k}_high"] for k in ("grad_sq_norm", "trace_cov", "b_simple"))
    assert inside >= 27, inside


def test_a_probe_every_10_steps_agrees_with_the_micro_batches_while_the_gradient_falls():
    """Issue #24: decaying per measurement, a probe every 10 steps keeps ≈ 99 measurements, a window of ≈ 500 steps
    whose slow EMA lags a falling ‖G‖² far behind the micro-batch source's 50-step one; compared on the slow EMAs
    the two disagree beyond AGREEMENT_Z and the probe was dropped. Each source's error now holds its lag (rule 7):
    the check stays quiet, and the probe stays in the estimate."""
    quiet = slow_apart = 0
    for seed in range(12):
        gen = torch.Generator().manual_seed(seed)
        noise, probe, micro = GradientNoise(), NoiseSource("probe", 0.98), NoiseSource("micro_batch", 0.98)
        for src in (probe, micro):
            src.effective_batch_size = 64
            noise.attach(src)
        said = []
        for step in range(600):
            d = torch.full((D,), 0.6 * 2 ** (-step / 300), dtype=torch.float64)  # ‖G‖² halves every 150 steps
            per_example, micro_batch, _ = step_estimates(d, gen)
            micro.update(*micro_batch)
            if step % 10 == 0:
                probe.update(*per_example)
            if step % 50 == 49 and step >= 200:
                said.append(noise.disagreement())
        quiet += not any(said) and not probe.invalid
        (g_p, se_p), (g_m, se_m) = (
            (float(v), float(e.sqrt()))
            for v, e in ((s.ema.grad_sq_norm, s.error.mean_covariance(s.ema)[1]) for s in (probe, micro))
        )
        slow_apart += abs(g_p - g_m) > AGREEMENT_Z * math.hypot(se_p, se_m)
    assert quiet >= 11, quiet
    assert slow_apart >= 6, slow_apart  # the slow EMAs alone would have dropped the probe


def test_every_window_round_trips_through_the_state_dict():
    """The ladder's windows (rule 7) are saved and restored: a restored source chooses and states as the saved one."""
    gen = torch.Generator().manual_seed(0)
    src = NoiseSource("probe", 0.98)
    for step in range(120):
        src.update(2 ** (-step / 30) + torch.randn((), generator=gen, dtype=torch.float64), torch.tensor(4.0 + step))
    restored = NoiseSource("probe", 0.98)
    restored.load_state_dict(src.state_dict())
    assert [float(v) for v in restored.smoothed()] == pytest.approx([float(v) for v in src.smoothed()], rel=1e-12)
    assert restored.choice()[4].tolist() == src.choice()[4].tolist() != [0, 0]  # a falling ‖G‖²: a shorter window
    restored.restart()
    assert int(restored.ema.count) == 0 and all(int(ema.count) == 0 for ema, _ in restored.windows)


@pytest.mark.parametrize(("every", "expected"), [(1, 0.98), (2, 0.95), (10, 0.8), (50, 0.8)])
def test_the_band_window_spans_no_more_steps_than_the_slow_decay_at_one_update_a_step(every, expected) -> None:
    """A probe every 10 steps reads the band on its 0.8 rung (memory 5 updates = 50 steps, as 0.98's at one update a
    step), so its sparser cadence does not make the band's memory 500 steps; none short enough: the shortest."""
    source = NoiseSource("probe", 0.98, steps_per_update=every)
    assert source.windows[source.band_window][0].beta == expected
    for _ in range(40):
        source.update(torch.tensor(2.0), torch.tensor(3.0))
    ema = source.windows[source.band_window][0]
    assert source.band_values()[2] == ema.values[0]
    assert source.slow_moments()[5] == effective_count(ema.beta, ema.count)


def _weights(beta: float, count: int) -> torch.Tensor:
    """The bias-corrected EMA's weights ``(count,)`` on the updates, oldest first: (1 − β)·β^(t−k)/(1 − βᵗ)."""
    ages = torch.arange(count - 1, -1, -1, dtype=torch.float64)
    return (1 - beta) * beta**ages / (1 - beta**count)


@pytest.mark.parametrize("count", [2, 5, 40, 300, 2664, 2665, 9000])
def test_the_count_terms_looked_up_match_the_explicit_weights(count):
    """choice()'s per-count terms (rule 7), read from the table by count (past its end: its last row), against the
    windows' explicit weights w: K = w·wᵀ, n_eff = 1/Σw², the mean ages A = w·(t − k) and from them the lag scales
    A_a/(A_a − A_b)."""
    src = NoiseSource("probe", 0.98)
    src.ema._ema.count = torch.tensor(count)
    overlap, bessel, scale, spread = src._count_terms(src.ema.count, torch.device("cpu"))
    rows = torch.stack([_weights(b, count) for b in (0.98, 0.95, 0.8)])
    ages = rows @ torch.arange(count - 1, -1, -1, dtype=torch.float64)
    assert overlap == pytest.approx(rows @ rows.T, rel=1e-9, abs=1e-15)
    assert scale.tolist() == pytest.approx((ages[:2] / (ages[:2] - ages[1:])).tolist(), rel=1e-9)
    n_eff = 1 / (rows**2).sum(1)
    assert bessel == pytest.approx(n_eff / (n_eff - 1), rel=1e-9)
    assert spread == pytest.approx(((rows[:2] - rows[1:]) ** 2).sum(1), rel=1e-9, abs=1e-15)


def test_the_table_follows_a_restore_and_a_restart(monkeypatch):
    """The table is by count, not a memo of the last call: a source restored to another count, or restarted, states
    what the same state gives computed without a table."""
    gen = torch.Generator().manual_seed(1)
    src, early = NoiseSource("probe", 0.98), NoiseSource("probe", 0.98)
    for step in range(300):
        src.update(2 ** (-step / 40) + 0.3 * torch.randn((), generator=gen, dtype=torch.float64), torch.tensor(4.0))
        if step == 49:
            early.load_state_dict(src.state_dict())
    late, restarted = src.state_dict(), NoiseSource("probe", 0.98)
    restarted.load_state_dict(late)
    src.choice(), early.choice(), restarted.choice()  # each builds its table at its own count
    src.load_state_dict(early.state_dict())
    early.load_state_dict(late)
    restarted.restart()
    got = [[v.clone() for v in s.choice()] for s in (src, early, restarted)]
    monkeypatch.setattr(estimate, "table_rows", lambda beta: None)  # computed at each call
    for state, values in zip((src.state_dict(), late, restarted.state_dict()), got):
        untabled = NoiseSource("probe", 0.98)
        untabled.load_state_dict(state)
        for have, want in zip(values, untabled.choice()):
            torch.testing.assert_close(have, want, rtol=1e-12, atol=0.0, equal_nan=True)  # NaN lags at count 0
        assert untabled._count_table is None
    assert not torch.equal(got[0][0], got[1][0])


def test_a_grad_sq_norm_below_zero_beyond_its_error_bounds_the_band_ratio_at_zero():
    """Issue #25's diabetes MLP: ‖G‖² = −0.231 ± 0.12 (39 measurements), tr Σ = 23.8 ± 0.96 at B = 32. Fieller's set for
    θ ≥ 0 is empty, so B_simple has no information ([0, ∞)); the band ratio is bounded all the same: ‖G‖² ≤ its
    upper end −0.231 + t·0.12 < 0 over tr Σ ≥ its lower end > 0, so the ratio's interval is {0}, not [0, ∞)."""
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    iv = noise_intervals(t(-0.231), t(23.8), t(0.12), t(0.96), t(0.0), t(39.0), 32)
    z = float(t_quantile(Z90, t(38.0)))
    assert -0.231 + z * 0.12 < 0 and 23.8 - z * 0.96 > 0
    assert [float(v) for v in iv["band_ratio"]] == [0.0, 0.0]
    assert float(iv["b_simple"][0]) == 0.0 and math.isinf(float(iv["b_simple"][1]))
    # Within its error of zero the ratio keeps its finite upper end B·(‖G‖² + t·σ)/tr Σ-ish (Fieller's), not 0.
    near = noise_intervals(t(-0.1), t(23.8), t(0.12), t(0.96), t(0.0), t(39.0), 32)["band_ratio"]
    assert float(near[0]) == 0.0 and 0 < float(near[1]) < 32 * (-0.1 + z * 0.12) / (23.8 - z * 0.96) * 1.01


def _reshuffled_pair(seed: int, grad_sq_norm: float, population: int) -> tuple[GradientNoise, GradientNoise]:
    """The same probe stream (:func:`_noisy_probe`, batch 16) read as drawn from ``population`` examples in a fixed
    order and as reshuffled each epoch (rule 6)."""
    fixed, src = _noisy_probe(seed, grad_sq_norm, steps=120)
    src.population = population
    shuffled, copy = GradientNoise(), NoiseSource("probe", 0.98)
    copy.load_state_dict(src.state_dict())
    copy.reshuffled = True
    shuffled.attach(copy)
    return fixed, shuffled


def test_under_reshuffling_the_full_data_intervals_allow_the_epoch_order_excess():
    """Rule 6: reshuffled, ‖G‖²'s low end is lowered by δ_R (tr Σ at its high end), B_simple's high end is Fieller's at
    ‖G‖² − δ_R and the current band ratio's low end B over it; the points, tr Σ, B_simple's low end and everything the
    band decides on (its window's ratio and interval, the per-step band) are the fixed order's."""
    population = 200
    fixed, shuffled = _reshuffled_pair(seed=2, grad_sq_norm=1.5, population=population)
    assert shuffled.reshuffled and not fixed.reshuffled
    a, b = fixed.estimate(), shuffled.estimate()
    delta = reshuffle_excess(float(a.intervals["trace_cov"][1]), population)
    assert delta == pytest.approx(4 * float(a.intervals["trace_cov"][1]) / (population - 1))
    assert 0 < delta < float(a.intervals["grad_sq_norm"][0])  # an excess the test can see at both ends
    for name in ("grad_sq_norm", "trace_cov", "b_simple", "band_grad_sq_norm"):
        assert float(getattr(b, name)) == float(getattr(a, name)), name
    assert float(b.intervals["grad_sq_norm"][0]) == pytest.approx(float(a.intervals["grad_sq_norm"][0]) - delta)
    assert float(b.intervals["grad_sq_norm"][1]) == float(a.intervals["grad_sq_norm"][1])
    assert [float(v) for v in b.intervals["trace_cov"]] == [float(v) for v in a.intervals["trace_cov"]]
    low, high = (float(v) for v in b.intervals["b_simple"])
    assert low == float(a.intervals["b_simple"][0]) and high > float(a.intervals["b_simple"][1])
    assert float(b.intervals["band_ratio"][0]) == pytest.approx(16 / high)
    assert float(b.intervals["band_ratio"][1]) == float(a.intervals["band_ratio"][1])
    # The decision's quantities: unchanged.
    assert float(b.window_band_ratio_low) == float(a.window_band_ratio_low)
    assert float(b.window_band_ratio_high) == float(a.window_band_ratio_high)
    for margin in (0.5, 2.0, 8.0):
        assert bool(shuffled.in_noise_band(margin, b)) == bool(fixed.in_noise_band(margin, a))
    # Reliability is read off the widened interval: farther from the point, a larger relative error.
    assert float(b.b_simple_rel_err) > float(a.b_simple_rel_err)
    said = dict(shuffled.summary_rows())["epoch order (reshuffled)"]
    assert f"allow {delta:.3g} for" in said and "replacement=True" in said
    assert "epoch order (reshuffled)" not in dict(fixed.summary_rows())


def test_the_widened_b_simple_end_is_fiellers_at_the_lowered_grad_sq_norm():
    """noise_intervals with ``reshuffled`` = N: B_simple's high end equals Fieller's interval of (tr Σ, ‖G‖² − δ_R)
    with the same errors, δ_R at tr Σ's high end; where ‖G‖² − δ_R is within its error of 0 the end is infinite."""
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    grad, trace, grad_se, trace_se, cov, n = t(0.9), t(20.0), t(0.1), t(1.0), t(0.02), t(60.0)
    z = t_quantile(Z90, n - 1)
    delta = reshuffle_excess(float(trace + z * trace_se), 400)
    iv = noise_intervals(grad, trace, grad_se, trace_se, cov, n, 32, reshuffled=400)
    expected = fieller_interval(trace, grad - delta, trace_se.square(), grad_se.square(), cov, z)[1]
    assert float(iv["b_simple"][1]) == pytest.approx(float(expected), rel=1e-12)
    assert float(iv["grad_sq_norm"][0]) == pytest.approx(float(grad - z * grad_se) - delta, rel=1e-12)
    few = noise_intervals(grad, trace, grad_se, trace_se, cov, n, 32, reshuffled=40)  # δ_R ≈ 2.2 > ‖G‖²
    assert math.isinf(float(few["b_simple"][1])) and float(few["grad_sq_norm"][0]) == 0.0
    assert float(few["b_simple"][0]) == float(iv["b_simple"][0])


@pytest.mark.parametrize(
    ("sampler", "population", "reshuffled"),
    [
        ("shuffle", 50, True),
        ("sequential", 50, False),
        ("replacement", None, False),
        ("ddp", 50, True),
        ("ddp-fixed", 50, False),
    ],
)
def test_the_sampler_says_whether_each_epoch_reshuffles(sampler, population, reshuffled):
    """Rule 6's excess arises where each epoch draws a new permutation: ``RandomSampler`` without replacement, a
    ``DistributedSampler`` with ``shuffle``; not in a fixed order, and not with replacement (no population then)."""
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler, TensorDataset

    data = TensorDataset(torch.zeros(50, 2))
    samplers = {
        "shuffle": RandomSampler(data),
        "sequential": SequentialSampler(data),
        "replacement": RandomSampler(data, replacement=True),
        "ddp": DistributedSampler(data, num_replicas=2, rank=0, shuffle=True),
        "ddp-fixed": DistributedSampler(data, num_replicas=2, rank=0, shuffle=False),
    }
    src = NoiseSource("probe", 0.98)
    src.read_sampler(DataLoader(data, batch_size=5, sampler=samplers[sampler]))
    assert (src.population, src.reshuffled) == (population, reshuffled)


def test_an_estimate_below_0_beyond_its_error_is_not_an_interval_ending_below_its_start():
    """A fresh user's fit-end table read "‖G‖² −0.3977 ± 0.19, 90 %: 0–-0.0555": the low end held at 0 (‖G‖² ≥ 0)
    above the upper end g + t·se < 0. Such an estimate is said as below 0 beyond its error, with its upper end; an
    interval that straddles 0 keeps its two ends."""
    from trainvitals.noise.estimate import _ends

    grad, se = torch.tensor(-0.3977, dtype=torch.float64), torch.tensor(0.19, dtype=torch.float64)
    trace, trace_se = torch.tensor(146.6, dtype=torch.float64), torch.tensor(5.8, dtype=torch.float64)
    n = torch.tensor(12.9, dtype=torch.float64)
    low, high = noise_intervals(grad, trace, se, trace_se, torch.zeros((), dtype=torch.float64), n, 64)["grad_sq_norm"]
    assert float(low) == 0.0 and float(high) == pytest.approx(-0.3977 + float(t_quantile(Z90, n - 1)) * 0.19)
    said = _ends({"grad_sq_norm_low": float(low), "grad_sq_norm_high": float(high)}, "grad_sq_norm")
    assert said == f", 90 %: below 0 beyond its error (upper end {float(high):.3g})" and "0–-" not in said
    assert _ends({"grad_sq_norm_low": 0.0, "grad_sq_norm_high": 0.31}, "grad_sq_norm") == ", 90 %: 0–0.31"
