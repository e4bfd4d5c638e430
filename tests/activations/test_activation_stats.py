"""Output moments against brute-force float64 moments, a per-unit loop, and the whole tensor for combined parts."""

from __future__ import annotations

import math

import pytest
import torch

from trainvitals.activations.stats import STATS, combine_moments, finish, output_moments, output_tensors


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


def stats(x: torch.Tensor) -> dict[str, float]:
    row, _ = output_moments(x)
    return dict(zip(STATS, finish(row[None])[0].tolist()))


def test_moments_match_float64_brute_force():
    x = torch.randn(32, 10) * 3.0 + 1.5
    x[0, 0] = 40.0  # an outlier: heavy tail
    found = stats(x)
    for key, value in brute(x).items():
        assert found[key] == pytest.approx(value, rel=1e-5), key
    row, mask = output_moments(x)
    assert mask is None and row[-1].item() == 0.0 and row[0].item() == 320


def test_gaussian_kurtosis_is_three_within_sampling_error():
    n = 200_000
    kurtosis = stats(torch.randn(1000, n // 1000))["kurtosis"]
    assert abs(kurtosis - 3.0) < 5 * math.sqrt(24.0 / n)  # the sample kurtosis' standard error, √(24/n)


def test_fourth_powers_of_large_float16_values_do_not_overflow():
    x = (torch.randn(64, 16) * 2000.0).half()  # (2000·4)⁴ ≈ 4e15: beyond float16's range
    assert stats(x)["kurtosis"] == pytest.approx(brute(x)["kurtosis"], rel=1e-4)


def test_parts_combine_to_the_moments_of_the_whole():
    """Ranks' rows of unequal batches (and an empty one) give the statistics of the concatenated batch."""
    whole = torch.cat([torch.randn(5, 4) * 2 + 1, torch.randn(11, 4) - 3, torch.randn(2, 4) * 0.1])
    parts = [whole[:5], whole[5:16], whole[16:]]
    rows = torch.stack([output_moments(p)[0] for p in parts])[:, None]  # (R, K = 1, 7)
    combined = combine_moments(rows)[0]
    exact = output_moments(whole)[0]
    assert combined.tolist() == pytest.approx(exact.tolist(), rel=1e-5)  # float32 parts, float64 sums
    empty = torch.zeros_like(rows[:1])
    assert combine_moments(torch.cat([rows, empty]))[0].tolist() == pytest.approx(combined.tolist(), rel=1e-12)


def test_dead_units_are_those_not_positive_for_any_example():
    x = torch.randn(16, 3, 5).relu()
    x[:, 0, :] = 0.0  # 5 dead units
    x[:, 1, 2] = -0.1  # GELU-like: negative everywhere is dead too
    x[3, 2, 4] = 0.0  # zero for one example only: alive
    _, alive = output_moments(x, dead=True)
    assert alive.shape == (15,) and alive.tolist() == (x > 0).any(0).reshape(-1).tolist()
    assert 1.0 - alive.double().mean().item() == pytest.approx(6 / 15)


def test_non_finite_output_is_flagged_and_a_constant_has_no_kurtosis():
    x = torch.ones(4, 3)
    found = stats(x)
    assert math.isnan(found["kurtosis"]) and found["rms"] == pytest.approx(1.0) and found["abs_max"] == 1.0
    x[1, 1] = float("inf")
    assert output_moments(x)[0][-1].item() == 1.0


def test_output_tensors_flattens_tuples_and_dicts_and_skips_integer_tensors():
    a, b, c = torch.zeros(2), torch.ones(3), torch.full((1,), 2.0)
    found = output_tensors((a, {"h": b, "idx": torch.arange(3)}, [None, (c,)]))
    assert [place for place, _ in found] == ["[0]", "[1][h]", "[2][1][0]"]  # places in the output, not a count
    assert all(t is x for (_, t), x in zip(found, (a, b, c)))
    assert output_tensors(torch.arange(3)) == [] and output_tensors("text") == []
    assert [p for p, _ in output_tensors((a, None))] == ["[0]"]  # attention's (out, None) keeps out's name
    assert [p for p, _ in output_tensors(a)] == [""]


def test_a_constant_output_has_no_kurtosis_and_a_nan_unit_is_not_dead():
    constant = torch.full((64, 5), 0.00668)  # a dead ReLU's successor puts out its bias: float32 rounding only
    assert math.isnan(stats(constant)["kurtosis"])
    x = torch.randn(16, 4)
    x[:, 1] = -1.0  # dead: ≤ 0 for every example
    x[:, 2] = float("nan")  # non-finite, not dead
    _, alive = output_moments(x, dead=True)
    assert alive.tolist() == [True, False, True, True]
