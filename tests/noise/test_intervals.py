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
from trainvitals.noise.estimators import (
    effective_count,
    fieller_interval,
    per_example_estimates,
    two_batch_size_estimates,
)

SEEDS, STEPS, B, D = 600, 150, 16, 4


def _runs(grad_sq_norm: float, trace: float, seed: int = 0) -> tuple[NoiseSource, list[tuple]]:
    """SEEDS runs at once: one NoiseSource whose EMAs are (SEEDS,) vectors, and the per-step estimates fed."""
    gen = torch.Generator().manual_seed(seed)
    mean = torch.zeros(D, dtype=torch.float64)
    mean[0] = math.sqrt(grad_sq_norm)
    sigma = math.sqrt(trace / D)
    src = _vectorised(NoiseSource("probe", 0.98))
    fed = []
    for _ in range(STEPS):
        g = mean + sigma * torch.randn(SEEDS, B, D, generator=gen, dtype=torch.float64)
        step = per_example_estimates(g.square().sum((1, 2)), g.mean(1).square().sum(1), B)
        src.update(*step)
        fed.append(step)
    return src, fed


def _vectorised(src: NoiseSource) -> NoiseSource:
    """``src`` with each moment of each window a (SEEDS,) vector: SEEDS runs in one."""
    for ema, error in src.windows:
        for moments in (ema._ema, error._moments):
            moments._ema = torch.zeros(*moments._ema.shape, SEEDS, dtype=torch.float64)
    return src


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
        assert one_sided < 0.05  # a run that took a short window (rule 7) has a wider interval
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
    # n_eff of the shorter of the two windows the run took (rule 7), in closed form: 1/Σ w_k² of that EMA.
    beta = min(run.windows[int(i)][0].beta for i in run.choice()[4])
    assert h["effective_measurements"] == pytest.approx(float(effective_count(beta, torch.tensor(STEPS))), rel=1e-9)
    assert effective_count(0.98, torch.tensor(10**4)) == pytest.approx(99)
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


@pytest.mark.parametrize(
    ("grad_half_life", "trace_half_life"),
    [(50, 50), (50, 100), (50, math.inf)],
    ids=["both_halve_every_50", "trace_every_100", "trace_still"],
)
def test_the_intervals_cover_a_falling_truth(grad_half_life, trace_half_life):
    """Issue #24: ‖G‖² halving every 50 steps, tr Σ every 50 or 100 steps or not at all; one probe-like source a
    step. The slow EMAs (memory ≈ 50 steps) put ‖G‖² at 2–3× the truth, outside their interval; each quantity's
    window of least variance + lag² (rule 7) covers the truth in ≥ 80 % of runs over steps 100–300."""
    gen = torch.Generator().manual_seed(0)
    src = _vectorised(NoiseSource("probe", 0.98))
    covered = {name: [] for name in ("grad_sq_norm", "trace_cov", "b_simple")}
    slow_covered = []
    for step in range(301):
        grad_sq_norm, trace = 4.0 * 2 ** (-step / grad_half_life), 16.0 * 2 ** (-step / trace_half_life)
        mean = torch.zeros(D, dtype=torch.float64)
        mean[0] = math.sqrt(grad_sq_norm)
        g = mean + math.sqrt(trace / D) * torch.randn(SEEDS, B, D, generator=gen, dtype=torch.float64)
        src.update(*per_example_estimates(g.square().sum((1, 2)), g.mean(1).square().sum(1), B))
        if step < 100 or step % 20:
            continue
        iv = _intervals(src)
        for name, value in (("grad_sq_norm", grad_sq_norm), ("trace_cov", trace), ("b_simple", trace / grad_sq_norm)):
            low, high = iv[name]
            covered[name].append(float(((low <= value) & (value <= high)).double().mean()))
        # The slow EMA alone, with its sampling error: what the estimate said before rule 7 followed ‖G‖².
        var = src.error.mean_covariance(src.ema)[1]
        slow = noise_intervals(
            src.ema.grad_sq_norm, src.ema.trace_cov, var.sqrt(), var.sqrt(), 0 * var, 99 + 0 * var, B
        )
        low, high = slow["grad_sq_norm"]
        slow_covered.append(float(((low <= grad_sq_norm) & (grad_sq_norm <= high)).double().mean()))
    for name, shares in covered.items():
        print(name, [f"{c:.2f}" for c in shares])
        assert sum(shares) / len(shares) >= 0.8 and min(shares) >= 0.7, (name, shares)
    assert sum(slow_covered) / len(slow_covered) < 0.5, slow_covered  # the failure this replaces
    assert float(src.ema.grad_sq_norm.median()) > 2 * grad_sq_norm  # the slow EMA's lag


@pytest.mark.parametrize("half_life", [9, 50])
def test_on_a_fast_fall_the_shortest_window_reads_its_closed_form_lag(half_life):
    """Rule 7 takes the shortest window (β = 0.8) as unlagged: on a noiseless ‖G‖² = x₀qᵗ it is chosen and reads
    (1 − β)/(1 − β/q) of the value — 1.47× at a half-life of 9 measurements (the char LM's fall,
    docs/benchmarks.md), 1.06× at 50 — while the slower windows, whose lag is measured, are not chosen."""
    src, q = NoiseSource("probe", 0.98), 2 ** (-1 / half_life)
    for step in range(400):
        src.update(torch.tensor(100.0 * q**step, dtype=torch.float64), torch.tensor(10.0, dtype=torch.float64))
    grad_sq_norm = src.smoothed()[0]
    assert int(src.choice()[4][0]) == len(src.windows) - 1 and src.windows[-1][0].beta == 0.8
    assert float(grad_sq_norm) / (100.0 * q**399) == pytest.approx(0.2 / (1 - 0.8 / q), rel=1e-9)


def test_a_short_windows_dip_alone_never_enters_the_band():
    """Issue #24's step-130 failure: the short windows' noise dipping into the band. 4 micro-batches of 8 a step
    (the stopper's source), ‖G‖² held at 1.5× the band's edge 0.2·tr Σ/B: no run stays in the band for the
    stopper's patience (10 steps) after its min_steps (100) on what the band is judged on (rule 7), as none does on
    the slow EMAs, while on the chosen window alone some would."""
    gen = torch.Generator().manual_seed(0)
    src = _vectorised(NoiseSource("micro_batch", 0.98))
    groups, size, dims, trace, margin, patience = 4, 8, 64, 16.0, 0.2, 10
    batch = groups * size
    grad_sq_norm = 1.5 * margin * trace / batch
    mean = torch.zeros(dims, dtype=torch.float64)
    mean[0] = math.sqrt(grad_sq_norm)
    streak, chosen_streak, slow_streak = torch.zeros(SEEDS), torch.zeros(SEEDS), torch.zeros(SEEDS)
    slow_stopped = torch.zeros(SEEDS, dtype=torch.bool)
    stopped, chosen_stopped = torch.zeros(SEEDS, dtype=torch.bool), torch.zeros(SEEDS, dtype=torch.bool)
    for step in range(600):
        means = mean + math.sqrt(trace / dims / size) * torch.randn(
            SEEDS, groups, dims, generator=gen, dtype=torch.float64
        )
        src.update(
            *two_batch_size_estimates(means.square().sum(2).mean(1), means.mean(1).square().sum(1), groups, size)
        )
        if step < 100:  # the stopper's min_steps
            continue
        g, t, band_g = src.band_values()
        edge = margin * t / batch
        streak = torch.where(band_g <= edge, streak + 1, 0)
        chosen_streak = torch.where(g <= edge, chosen_streak + 1, 0)
        stopped |= streak >= patience
        slow_streak = torch.where(src.ema.grad_sq_norm <= margin * src.ema.trace_cov / batch, slow_streak + 1, 0)
        slow_stopped |= slow_streak >= patience
        chosen_stopped |= chosen_streak >= patience
    shares = [float(x.double().mean()) for x in (stopped, slow_stopped, chosen_stopped)]
    print(
        "stopped: judged as the band is {:.1%}, on the slow window {:.1%}, on the chosen one alone {:.1%}".format(
            *shares
        )
    )
    assert shares[0] <= 0.005 and shares[1] <= 0.005  # no earlier than the slow EMAs alone (main's ‖G‖²)
    assert shares[2] >= 0.03  # the chosen window alone would: the longer window's check is what holds it


def _rising(main: float | None = None, **kwargs):
    """A rising case; ``main``: the mean share covered now, where it is below the bar (a strict expected failure)."""
    marks = [] if main is None else [pytest.mark.xfail(strict=True, reason=f"{main:.0%} of runs on average")]
    return pytest.param(*kwargs.values(), marks=marks)


@pytest.mark.parametrize(
    ("grad_sq_norm", "trace", "first"),
    [
        _rising(0.68, g=lambda step: 4.0 * 2 ** ((step - 300) / 50), t=lambda step: 16.0, first=100),
        _rising(0.75, g=lambda step: 4.0 * 2 ** ((step - 300) / 20), t=lambda step: 16.0, first=100),
        _rising(0.76, g=lambda step: 1.0, t=lambda step: 16.0 * 2 ** ((step - 300) / 50), first=100),
        _rising(g=lambda step: 0.25 if step < 150 else 4.0, t=lambda step: 16.0, first=160),
    ],
    ids=["grad_doubles_every_50", "grad_doubles_every_20", "trace_doubles_every_50", "grad_steps_up_16x"],
)
def test_the_intervals_cover_a_rising_truth(grad_sq_norm, trace, first):
    """Issue #24: a rising ‖G‖² or tr Σ, one probe-like source a step. The bar of the falling case: covered in ≥ 80 %
    of runs over the steps from ``first``, ≥ 70 % at each. A rise is covered less often than a fall: its lag, read
    linearly from two windows' difference, comes out short (an exponential rise's lag saturates), and the window
    chosen for the least variance + lag² is the one whose lag read low. A one-sided lag that held these lost the
    demo's B_simple lower bound (docs/science.md, §3, "Drift")."""
    gen = torch.Generator().manual_seed(0)
    src = _vectorised(NoiseSource("probe", 0.98))
    covered = {name: [] for name in ("grad_sq_norm", "trace_cov", "b_simple", "band_ratio")}
    for step in range(301):
        g2, tr = grad_sq_norm(step), trace(step)
        mean = torch.zeros(D, dtype=torch.float64)
        mean[0] = math.sqrt(g2)
        g = mean + math.sqrt(tr / D) * torch.randn(SEEDS, B, D, generator=gen, dtype=torch.float64)
        src.update(*per_example_estimates(g.square().sum((1, 2)), g.mean(1).square().sum(1), B))
        if step < first or step % 10:
            continue
        iv = _intervals(src)
        for name, value in (
            ("grad_sq_norm", g2),
            ("trace_cov", tr),
            ("b_simple", tr / g2),
            ("band_ratio", B * g2 / tr),
        ):
            low, high = iv[name]
            covered[name].append(float(((low <= value) & (value <= high)).double().mean()))
    for name, shares in covered.items():
        print(name, f"mean {sum(shares) / len(shares):.2f}", [f"{c:.2f}" for c in shares])
    for name, shares in covered.items():
        assert sum(shares) / len(shares) >= 0.8 and min(shares) >= 0.7, (name, shares)
