"""Calibration of the 90% intervals on ‖G‖², tr Σ, B_simple and the band ratio (estimate.py, rule 8).

Closed form: per-example gradients g_i ~ N(G, σ²·I_D), so ‖G‖², tr Σ = D·σ² and B_simple = tr Σ/‖G‖² are known.
Each seed is one run of a probe-like source (per-example estimates of B examples a step, EMAs at β = 0.98);
the seeds are a batch dimension of the same EMAs, so 400 runs cost one run's kernels.
"""

from __future__ import annotations

import math

import pytest
import torch

from trainvitals.noise.estimate import GradientNoise, NoiseSource, noise_intervals
from trainvitals.noise.estimators import fieller_interval, per_example_estimates

SEEDS, STEPS, B, D = 600, 150, 16, 4


def _runs(grad_sq_norm: float, trace: float, seed: int = 0) -> tuple[NoiseSource, list[tuple]]:
    """SEEDS runs at once: one NoiseSource whose EMAs are (SEEDS,) vectors, and the per-step estimates fed."""
    gen = torch.Generator().manual_seed(seed)
    mean = torch.zeros(D, dtype=torch.float64)
    mean[0] = math.sqrt(grad_sq_norm)
    sigma = math.sqrt(trace / D)
    src = NoiseSource("probe", 0.98)
    for ema in (src.ema._ema, src.error._moments, src.fast._ema, src.fast_error._moments):
        ema._ema = torch.zeros(*ema._ema.shape, SEEDS, dtype=torch.float64)  # a (SEEDS,) vector of each moment
    fed = []
    for _ in range(STEPS):
        g = mean + sigma * torch.randn(SEEDS, B, D, generator=gen, dtype=torch.float64)
        step = per_example_estimates(g.square().sum((1, 2)), g.mean(1).square().sum(1), B)
        src.update(*step)
        fed.append(step)
    return src, fed


def _intervals(src: NoiseSource) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g, t, var_g, var_s, cov, n_eff = src.smoothed()
    return noise_intervals(g, t, var_g.sqrt(), var_s.sqrt(), cov, n_eff, B)


@pytest.mark.parametrize(
    ("grad_sq_norm", "trace"),
    [(1.0, 16.0), (0.05, 16.0)],  # B_simple 16 (= B), and 320 with ‖G‖² near 0 (a one-sided B_simple bound)
    ids=["signal", "near_zero"],
)
def test_the_90_percent_intervals_cover_the_truth_in_85_to_95_percent_of_runs(grad_sq_norm, trace):
    src, _ = _runs(grad_sq_norm, trace)
    iv = _intervals(src)
    truth = {
        "grad_sq_norm": grad_sq_norm,
        "trace_cov": trace,
        "b_simple": trace / grad_sq_norm,
        "band_ratio": B * grad_sq_norm / trace,  # B/B_simple: the band ratio at margin 1
    }
    for name, value in truth.items():
        low, high = iv[name]
        covered = float(((low <= value) & (value <= high)).double().mean())
        print(f"{name}: {covered:.1%} of {SEEDS} runs covered")
        assert 0.85 <= covered <= 0.95, (name, covered)
    low, high = iv["b_simple"]
    one_sided = float(torch.isinf(high).double().mean())
    if grad_sq_norm < 0.1:
        # Where ‖G‖² is within its error of 0 the interval has no upper end, yet a lower bound that is news.
        bounds = low[torch.isinf(high)]
        assert one_sided > 0.3 and float((bounds > 0).double().mean()) > 0.9
        assert float(bounds.median()) > 0.2 * trace / grad_sq_norm
    else:
        assert one_sided < 0.02
        # Not decorative: the interval is about as wide as the truth's spread needs, not everything.
        assert float((high / low).median()) < 3.0


def test_the_estimate_states_the_same_intervals_as_the_calibrated_computation():
    """GradientNoise over one source gives, in .grad units, what the calibrated path gives for that run."""
    src, fed = _runs(0.05, 16.0, seed=1)
    run = NoiseSource("probe", 0.98)
    run.effective_batch_size = B
    noise = GradientNoise()
    noise.attach(run)
    for g, s in fed:
        run.update(g[7], s[7])
    h = noise.host_summary()
    iv = _intervals(src)
    for name, (low, high) in iv.items():
        assert h[f"{name}_low"] == pytest.approx(float(low[7]), rel=1e-9)
        assert h[f"{name}_high"] == pytest.approx(float(high[7]), rel=1e-9)
    assert h["effective_measurements"] == pytest.approx(99 * (1 - 0.98**STEPS) ** 2 / (1 - 0.98 ** (2 * STEPS)), 0.01)
    tags = noise.metrics()
    assert float(tags["grad_noise/b_simple_low"]) == pytest.approx(h["b_simple_low"])


def test_fieller_matches_a_brute_force_search_over_theta():
    """Fieller's ends are the edges of {θ ≥ 0: (S − θG)² ≤ z²(v_S − 2θc + θ²v_G)}, found here on a grid."""
    theta = torch.linspace(0, 400, 400_001, dtype=torch.float64)
    z = 1.645
    for s, g, vs, vg, c in [(16.0, 1.0, 4.0, 0.04, 0.1), (16.0, 0.05, 4.0, 0.01, 0.05), (0.5, 0.05, 1.0, 0.01, 0.0)]:
        inside = (s - theta * g) ** 2 <= z**2 * (vs - 2 * theta * c + theta**2 * vg)
        low, high = (
            float(v) for v in fieller_interval(*(torch.tensor(x, dtype=torch.float64) for x in (s, g, vs, vg, c)), z)
        )
        found = theta[inside]
        assert low == pytest.approx(float(found.min()), abs=2e-3)
        if math.isfinite(high):
            assert high == pytest.approx(float(found.max()), abs=2e-3)
        else:
            assert bool(inside[-1])  # unbounded: the grid's end is inside


def test_the_estimate_follows_a_trace_that_halves_every_50_steps():
    """Issue #24's BatchNorm digits run: tr Σ halving every ~50 steps, which the slow EMAs (memory ≈ 50 steps) put
    at about twice its value. Per step S ~ tr Σ·(1 ± 0.8) (4 micro-batches); ‖G‖² stays put. The fast EMAs take
    over where the slow ones lag beyond their error (rule 7): the interval then covers the moving truth, the slow
    EMAs' would not."""
    gen = torch.Generator().manual_seed(0)
    src = NoiseSource("micro_batch", 0.98)
    for ema in (src.ema._ema, src.error._moments, src.fast._ema, src.fast_error._moments):
        ema._ema = torch.zeros(*ema._ema.shape, SEEDS, dtype=torch.float64)
    trace = 1.0
    for step in range(250):
        trace = 8.0 * 2 ** (-step / 50)
        noise = torch.randn(2, SEEDS, generator=gen, dtype=torch.float64)
        src.update(0.05 + 0.02 * noise[0], trace * (1 + 0.8 * noise[1]))
    low, high = _intervals(src)["trace_cov"]
    covered = float(((low <= trace) & (trace <= high)).double().mean())
    g, t, var_g, var_s, cov, n_eff = src.smoothed(torch.tensor(False))  # the slow EMAs alone
    slow = noise_intervals(g, t, var_g.sqrt(), var_s.sqrt(), cov, n_eff, B)["trace_cov"]
    slow_covered = float(((slow[0] <= trace) & (trace <= slow[1])).double().mean())
    assert float(src.lagging().double().mean()) > 0.9
    assert covered >= 0.8 and slow_covered < 0.2, (covered, slow_covered)
    assert float(t.median()) > 1.6 * trace  # the slow EMA's lag: about twice the truth
