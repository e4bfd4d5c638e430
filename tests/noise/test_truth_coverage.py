"""The probe's 90 % intervals against the brute-force truth on real fits (issue #24; tests/noise/_truth.py).

At every logged step after the first tenth, ‖G‖², tr Σ, B_simple (and, with the stopper, the band ratio) are compared
with their exact values over the whole training set at that step's parameters. A calibrated 90 % interval covers the
truth at about 90 % of the steps; the logged steps are serially correlated (an EMA's window spans ten of them), so
the share of one run scatters, and the bar is :data:`BAR`. Where main falls short the case is an expected failure
with the share it measured, so that the fix flips it (strict).
"""

from __future__ import annotations

import contextlib
import functools
from unittest import mock

import pytest
import torch
from _truth import CharGPT, Classifier, Row, char_windows, digits_train, fit_with_truth, layernorm_mlp, shares

from trainvitals import BatchVarianceProbe, GradNormEarlyStopping
from trainvitals.noise import estimate

BAR = 0.7
"""Share of logged steps, after the first tenth, whose interval must cover the truth."""


@functools.cache
def _rows(case: str) -> tuple[Row, ...]:
    """One fit per case, shared by its quantities: ``mlp-1``/``mlp-4``: the LayerNorm MLP on digits at batch 32,
    accumulating 1 or 4, probe and stopper (``-probe``: the probe alone); ``lm``: the character GPT at batch 16;
    ``-frozen``: at lr 0, where the truth stays what it was at step 0 (80 steps); ``-no-excess``: the sampler taken for
    one that does not reshuffle, so that the intervals leave out the epoch order's excess (estimate.py, rule 6)."""
    no_excess = case.endswith("-no-excess")
    case = case.removesuffix("-no-excess")
    torch.manual_seed(0)
    callbacks = [BatchVarianceProbe(histogram_every_n_steps=0, per_coordinate=False)]
    if "-probe" not in case:
        callbacks.append(GradNormEarlyStopping(min_steps=10**6, verbose=False))  # measures, never stops
    lr = 0.0 if case.endswith("-frozen") else 1e-3
    if case.startswith("lm"):
        x, y, vocab = char_windows(context=16)
        model, data, batch, accumulate, steps = Classifier(CharGPT(vocab, context=16), lr), (x, y), 16, 1, 150
    else:
        accumulate = int(case.split("-")[1])
        model, data, batch, steps = Classifier(layernorm_mlp(), lr), digits_train(), 32, 200 if accumulate == 1 else 120
    steps = 80 if lr == 0 else steps
    sampler = mock.patch.object(estimate, "reshuffles", lambda loader: False) if no_excess else contextlib.nullcontext()
    with sampler:
        return tuple(fit_with_truth(model, data, callbacks, batch, accumulate, steps, log_every_n_steps=5))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mlp-4-frozen", "lm-frozen"])
def test_with_the_weights_frozen_the_estimate_converges_to_the_truth(case):
    """At lr 0 nothing drifts: the estimate, its units and rule 6's correction must meet the truth on real per-example
    gradients (per-example norms and micro-batches at accumulate 4; a tied head and ``arange(T)`` positions in the LM)
    — what fails in the moving runs is the tracking, not the estimator."""
    got = shares(_rows(case))
    assert got["steps"] >= 14
    for quantity in ("grad_sq_norm", "trace_cov", "b_simple", "band_ratio"):
        assert got[f"{quantity}_covered"] >= BAR, quantity
        assert got[f"{quantity}_ratio"] == pytest.approx(1.0, abs=0.05), quantity


def _case(case: str, quantity: str, main: float | None = None):
    """A (case, quantity) parameter; ``main``: the share covered before the drift-aware windows (rule 7), where it
    is still below :data:`BAR` (an expected failure)."""
    if main is None:
        return pytest.param(case, quantity, id=f"{case}-{quantity}")
    reason = f"{main:.0%} of the steps before the drift-aware windows; still below the bar"
    marks = pytest.mark.xfail(strict=True, reason=reason)
    return pytest.param(case, quantity, marks=marks, id=f"{case}-{quantity}")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "quantity"),
    [
        _case("mlp-1", "grad_sq_norm"),
        _case("mlp-1", "trace_cov", 0.056),
        _case("mlp-1", "b_simple"),
        _case("mlp-1", "band_ratio"),
        _case("mlp-4", "grad_sq_norm"),
        _case("mlp-4", "trace_cov", 0.19),
        _case("mlp-4", "b_simple"),
        _case("mlp-4", "band_ratio"),
        _case("mlp-4-probe", "grad_sq_norm"),
        _case("mlp-4-probe", "trace_cov", 0.19),
        _case("mlp-4-probe", "b_simple"),
        _case("lm", "grad_sq_norm", 0.037),
        _case("lm", "trace_cov"),
        _case("lm", "b_simple"),
        _case("lm", "band_ratio"),
    ],
)
def test_the_90_percent_interval_covers_the_brute_force_truth(case, quantity):
    got = shares(_rows(case))
    assert got["steps"] >= 20
    covered, ratio = got[f"{quantity}_covered"], got[f"{quantity}_ratio"]
    assert covered >= BAR, f"covered at {covered:.0%} of {got['steps']} steps; median estimate/truth {ratio:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            case, marks=pytest.mark.xfail(strict=True, reason=f"{main:.0%} before the drift-aware windows"), id=case
        )
        for case, main in (("lm", 0.038),)
    ]
    + [pytest.param(case, id=case) for case in ("mlp-1", "mlp-4")],
)
def test_a_b_simple_called_reliable_is_covered_by_its_interval(case):
    """Issue #24's aim is a reliable point estimate wherever one can be had; one called reliable must also be right:
    its interval covers the truth at :data:`BAR` of the steps it is called reliable at."""
    got = shares(_rows(case))
    assert got["reliable"] > 0, "never called reliable"
    assert got["reliable_covered"] >= BAR, f"covered at {got['reliable_covered']:.0%} of the reliable steps"


@pytest.mark.slow
def test_under_reshuffling_the_allowed_excess_is_what_lets_the_intervals_cover():
    """The MLP's sampler reshuffles every epoch: with the epoch order's excess δ_R allowed (estimate.py, rule 6) a
    B_simple called reliable is covered at :data:`BAR` of its steps; the same fit without it (the same trajectory:
    δ_R changes no decision) is not, and ‖G‖²'s interval covers less often."""
    allowed, not_allowed = shares(_rows("mlp-1")), shares(_rows("mlp-1-no-excess"))
    assert allowed["steps"] == not_allowed["steps"] >= 20
    assert allowed["reliable_covered"] >= BAR > not_allowed["reliable_covered"]
    assert allowed["grad_sq_norm_covered"] > not_allowed["grad_sq_norm_covered"]
    assert allowed["grad_sq_norm_ratio"] == not_allowed["grad_sq_norm_ratio"]  # the points are the same
