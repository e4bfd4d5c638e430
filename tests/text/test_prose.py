"""Names, counts and shares in a message's words."""

from __future__ import annotations

import math

import pytest

from trainvitals.text.prose import by_reason, grouped, percent


@pytest.mark.parametrize(
    ("fraction", "said"),
    [
        (1.016, "102 %"),  # a fresh user's noise level error, which `.2g` wrote "1e+02%"
        (1.0, "100 %"),
        (12.3, "1230 %"),
        (0.12, "12 %"),
        (0.0996, "10 %"),
        (0.0994, "9.9 %"),
        (0.046, "4.6 %"),
        (0.0041, "0.41 %"),
        (0.005, "0.5 %"),
        (0.0, "0 %"),
        (1e-7, "< 0.01 %"),
        (-0.05, "-5 %"),
    ],
)
def test_a_percent_has_no_exponent_and_two_digits_below_ten(fraction: float, said: str) -> None:
    assert percent(fraction) == said
    if fraction >= 1e-4:  # what is said is the fraction, to its digits
        assert float(said.removesuffix(" %")) == pytest.approx(100 * fraction, rel=0.05, abs=0.5)
    assert "e" not in said or not math.isfinite(fraction)


def test_names_are_grouped_under_the_reason_they_share_in_first_seen_order() -> None:
    reasons = {"a": "in place", "b": "tied", "c": "in place", "d": ("in place", "left out"), "e": "in place"}
    assert by_reason(reasons) == {"in place": ["a", "c", "e"], "tied": ["b"], ("in place", "left out"): ["d"]}


@pytest.mark.parametrize(
    ("n", "said"),
    [
        (1, "`m0`"),
        (4, "`m0`, `m1`, `m2`, `m3` (4 modules)"),
        (24, "`m0`, `m1`, `m2`, `m3`, `m4` and 19 more (24 modules)"),
    ],
)
def test_a_group_names_its_first_few_and_counts_them_all(n: int, said: str) -> None:
    assert grouped([f"m{i}" for i in range(n)], "module") == said
