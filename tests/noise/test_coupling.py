"""The coupled-examples test (estimate.py rule 5, :func:`coupling_shown`) over many runs in closed form.

Per-example gradients g_i ~ N(G, σ²·I_k) of B examples: B‖ḡ − G‖²/σ² ~ χ²_k and Σ_i‖g_i − ḡ‖²/σ² ~ χ²_{k(B−1)},
independent, so a step's (Σ_i‖g_i‖², ‖ḡ‖²) are drawn without the examples. k = 1 is the most skewed per-step
‖G‖² estimate (skewness 2.7), whose heavy lower-tail t-statistic made a normal 3σ on the chosen window drop a plain
MLP's probe (issue #25). Coupled examples: each deviation from the batch mean scaled by ``inflate`` (as batch
statistics do), which leaves ‖ḡ‖² and gives E[‖G‖²_est] = ‖G‖² − (inflate² − 1)·k·σ²/B.
"""

from __future__ import annotations

import torch

from trainvitals.noise.estimate import (
    AGREEMENT_Z,
    MIN_MEASUREMENTS,
    GradientNoise,
    NoiseSource,
    coupling_shown,
    sources_apart,
)
from trainvitals.noise.estimators import per_example_estimates, t_quantile, two_batch_size_estimates

SEEDS, B = 1000, 32


def _vectorised(src: NoiseSource) -> NoiseSource:
    """``src`` with each moment of each window a (SEEDS,) vector: SEEDS runs in one."""
    for ema, error in src.windows:
        for moments in (ema._ema, error._moments):
            moments._ema = torch.zeros(*moments._ema.shape, SEEDS, dtype=torch.float64)
    return src


def _step(gen: torch.Generator, k: int, grad_sq_norm: float = 0.0, inflate: float = 1.0) -> tuple:
    """One step's per-example (‖G‖²_est, S_est) for SEEDS runs, tr Σ = 1, G along one of the k axes."""
    sigma2 = 1.0 / k
    noise = torch.randn(SEEDS, k, generator=gen, dtype=torch.float64) * (sigma2 / B) ** 0.5
    noise[:, 0] += grad_sq_norm**0.5
    mean_sq = noise.square().sum(1)
    within = 2 * torch._standard_gamma(torch.full((SEEDS,), k * (B - 1) / 2, dtype=torch.float64), generator=gen)
    return per_example_estimates(inflate**2 * within * sigma2 + B * mean_sq, mean_sq, B)


def _first_drop(k: int, steps: int, spu: int = 1, grad_sq_norm: float = 0.0, inflate: float = 1.0) -> torch.Tensor:
    """Per run, the first measurement at which :func:`coupling_shown` fires on the band window (as
    ``GradientNoise.disagreement`` reads it, checked at every measurement); −1 where it never does."""
    gen = torch.Generator().manual_seed(k)
    src = _vectorised(NoiseSource("probe", 0.98, steps_per_update=spu))
    first = torch.full((SEEDS,), -1)
    for step in range(steps):
        src.update(*_step(gen, k, grad_sq_norm, inflate))
        if step + 1 >= MIN_MEASUREMENTS:
            g, _, var_g, _, _, n_eff = src.slow_moments()
            first[coupling_shown(g, var_g, n_eff) & (first < 0)] = step
    return first


def test_independent_examples_at_g_zero_are_almost_never_found_coupled_over_a_long_run():
    for k, spu, steps, bound in ((1, 1, 3000, 0.012), (10, 1, 3000, 0.002), (1, 10, 1000, 0.005)):
        dropped = float((_first_drop(k, steps, spu) >= 0).double().mean())
        print(f"k={k}, a measurement every {spu} step(s), {steps} checks: {dropped:.2%} of runs dropped")
        assert dropped <= bound


def test_truly_coupled_examples_are_found_within_three_hundred_measurements():
    """Found where the band window's mean is resolvable from 0: E[‖G‖²_est] beyond ≈ 5.5/√99 of the per-step
    estimate's sd (√(2/k)·tr Σ/B at G = 0). inflate 2 at k = 1: E = 0.05 − 3 tr Σ/B (sd 1.4 tr Σ/B); inflate 1.2 at
    k = 10: 0.05 − 0.44 (sd 0.45); 1.5 with ‖G‖² = 0.5 tr Σ/B: −0.75. A weaker coupling under noisier steps (inflate
    1.2 at k = 1: −0.39 against 1.4) is not resolved by 99 measurements and is missed, not guessed at."""
    for k, grad_sq_norm, inflate in ((1, 0.05, 2.0), (10, 0.05, 1.2), (10, 0.5, 1.5)):
        first = _first_drop(k, 300, grad_sq_norm=grad_sq_norm / B, inflate=inflate)
        print(f"k={k}, inflate {inflate}: found by measurement {int(first.max())} in every run")
        assert bool((first >= 0).all()), (k, inflate)


def test_the_estimate_drops_a_source_exactly_where_the_closed_form_test_fires():
    gen = torch.Generator().manual_seed(7)
    noise, src = GradientNoise(), NoiseSource("probe", 0.98)
    src.effective_batch_size = B
    noise.attach(src)
    for step in range(200):
        g, s = _step(gen, 10, inflate=1.1)
        src.update(g[0], s[0])
        slow_g, _, var_g, _, _, n_eff = src.slow_moments()
        shown = step + 1 >= MIN_MEASUREMENTS and bool(coupling_shown(slow_g, var_g, n_eff))
        message = noise.disagreement()
        assert bool(message) == shown
        if shown:
            assert "probe is dropped" in message and "below zero by more than" in message and src.invalid
            return
    raise AssertionError("inflate 1.1 (E[‖G‖²_est] = −0.21 tr Σ/B) was never found in 200 measurements")


def _agreement_runs(dims: int, rising: bool, steps: int = 120) -> tuple[float, float]:
    """SEEDS runs of a probe (per-example) and the micro-batches (4 of 16) on the same 64 examples a step, tr Σ 40
    (``rising``: until step 10, then doubling in 30 steps, as a fresh user's Transformer's did), ‖G‖² 1. The share of
    runs where the agreement test (rule 5, :func:`sources_apart` on the band windows) fires from step 20 on, checked
    at every step, and where the old test, on each source's chosen windows with their lag-widened errors, did."""
    gen = torch.Generator().manual_seed(dims)
    probe, micro = _vectorised(NoiseSource("probe", 0.98)), _vectorised(NoiseSource("micro_batch", 0.98))
    fired, old = torch.zeros(SEEDS, dtype=torch.bool), torch.zeros(SEEDS, dtype=torch.bool)
    batch, groups = 64, 4
    for step in range(steps):
        trace = 40.0 * 2 ** (min(max(step - 10, 0), 30) / 30 if rising else 0.0)
        g = torch.randn(SEEDS, batch, dims, generator=gen, dtype=torch.float64) * (trace / dims) ** 0.5
        g[..., 0] += 1.0
        batch_sq = g.mean(1).square().sum(1)
        probe.update(*per_example_estimates(g.square().sum((1, 2)), batch_sq, batch))
        means = g.view(SEEDS, groups, batch // groups, dims).mean(2)
        micro.update(*two_batch_size_estimates(means.square().sum(2).mean(1), batch_sq, groups, batch // groups))
        if step + 1 < MIN_MEASUREMENTS:
            continue
        a, b = probe.slow_moments(), micro.slow_moments()
        (age_a, *drift_a), (age_b, *drift_b) = probe.band_drift(), micro.band_drift()
        n = torch.minimum(a[5], b[5])
        for k, var in ((0, 2), (1, 3)):
            lag = torch.maximum(drift_a[k], drift_b[k]) * (age_a - age_b).abs()
            fired |= sources_apart(a[k], b[k], a[var] + b[var] + lag.square(), n)
        a, b = probe.smoothed(), micro.smoothed()  # the chosen windows, as stated
        z = t_quantile(AGREEMENT_Z, torch.minimum(a[5], b[5]) - 1)
        for k, var in ((0, 2), (1, 3)):
            old |= (a[k] - b[k]).abs() > z * (a[var] + b[var]).sqrt()
    return float(fired.double().mean()), float(old.double().mean())


def test_two_sources_of_one_fast_rising_trace_are_not_found_apart():
    """Issue #24: the micro-batches' chosen window lagged a tr Σ that doubled in 30 steps beyond its stated error, and
    the agreement test dropped a correct probe. Measured at the same steps, the two band windows weight the same
    steps alike: their lag is common and cancels, and the rise adds no alarm to those a still tr Σ gives."""
    still, _ = _agreement_runs(3, rising=False)
    for dims in (3, 10):
        fired, old = _agreement_runs(dims, rising=True)
        print(f"{dims} dimensions: {fired:.1%} of runs found apart on the band windows, {old:.1%} on the chosen ones")
        assert fired <= still + 0.005, (fired, still)
        assert old >= 0.05  # the failure this replaces
    print(f"tr Σ still: {still:.1%}")
    assert still <= 0.04  # at 3 standard errors, Student-widened, checked at each of 100 steps
