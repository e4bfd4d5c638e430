"""activation_stats against brute-force float64 moments and a per-unit loop."""

from __future__ import annotations

import math

import pytest
import torch

from trainvitals.activations.stats import STATS, activation_stats, output_tensors


def brute(x: torch.Tensor) -> dict[str, float]:
    x = x.double().reshape(-1)
    mu = x.mean()
    c = x - mu
    return {
        "rms": x.square().mean().sqrt().item(),
        "abs_max": x.abs().max().item(),
        "mean": mu.item(),
        "kurtosis": (c**4).mean().item() / (c**2).mean().item() ** 2,
    }


def test_moments_match_float64_brute_force():
    x = torch.randn(32, 10) * 3.0 + 1.5
    x[0, 0] = 40.0  # an outlier: heavy tail
    row = dict(zip(STATS, activation_stats(x).tolist()))
    for key, value in brute(x).items():
        assert row[key] == pytest.approx(value, rel=1e-5), key
    assert math.isnan(row["dead_fraction"]) and row["nonfinite"] == 0.0


def test_gaussian_kurtosis_is_three_within_sampling_error():
    n = 200_000
    kurtosis = activation_stats(torch.randn(1000, n // 1000))[STATS.index("kurtosis")].item()
    assert abs(kurtosis - 3.0) < 5 * math.sqrt(24.0 / n)  # the sample kurtosis' standard error, √(24/n)


def test_fourth_powers_of_large_float16_values_do_not_overflow():
    x = (torch.randn(64, 16) * 2000.0).half()  # (2000·4)⁴ ≈ 4e15: beyond float16, and float32 squares of squares
    row = dict(zip(STATS, activation_stats(x).tolist()))
    assert row["kurtosis"] == pytest.approx(brute(x)["kurtosis"], rel=1e-4)


def test_dead_fraction_counts_units_not_positive_for_any_example():
    x = torch.randn(16, 3, 5).relu()
    x[:, 0, :] = 0.0  # 5 dead units
    x[:, 1, 2] = -0.1  # GELU-like: negative everywhere is dead too
    x[3, 2, 4] = 0.0  # zero for one example only: alive
    per_unit = (x > 0).any(0).reshape(-1)
    expected = 1.0 - per_unit.double().mean().item()
    dead = activation_stats(x, dead=True)[STATS.index("dead_fraction")].item()
    assert dead == pytest.approx(expected) and dead == pytest.approx(6 / 15)


def test_non_finite_output_is_flagged_and_a_constant_has_no_kurtosis():
    x = torch.ones(4, 3)
    row = dict(zip(STATS, activation_stats(x).tolist()))
    assert math.isnan(row["kurtosis"]) and row["rms"] == pytest.approx(1.0)
    x[1, 1] = float("inf")
    assert activation_stats(x)[STATS.index("nonfinite")].item() == 1.0


def test_output_tensors_flattens_tuples_and_dicts_and_skips_integer_tensors():
    a, b, c = torch.zeros(2), torch.ones(3), torch.full((1,), 2.0)
    found = output_tensors((a, {"h": b, "idx": torch.arange(3)}, [None, (c,)]))
    assert [t is x for t, x in zip(found, (a, b, c))] == [True, True, True] and len(found) == 3
    assert output_tensors(torch.arange(3)) == [] and output_tensors("text") == []
