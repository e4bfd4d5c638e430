"""Clipping by norm, against torch's own ``clip_grad_norm_`` and against SGD and AdamW stepped by hand: the factor it
multiplies a step by, the report's reading of it from the logged norms, and what that factor does to the update."""

from __future__ import annotations

import statistics

import pytest
import torch

from trainvitals.norms.clipping import clip_coef, clips_most
from trainvitals.report.clipping import Clipped


def _clipped_norm(total: float, max_norm: float) -> float:
    """The norm torch leaves after ``clip_grad_norm_`` of a gradient of norm ``total`` (float64)."""
    g = torch.randn(50, dtype=torch.float64)
    g = g * (total / g.norm())
    p = torch.zeros(50, dtype=torch.float64, requires_grad=True)
    p.grad = g
    torch.nn.utils.clip_grad_norm_([p], max_norm)
    return float(p.grad.norm())


@pytest.mark.parametrize("total", [0.3, 0.999999, 1.0, 1.5, 40.0])
def test_the_factor_is_torchs(total: float) -> None:
    torch.manual_seed(0)
    assert _clipped_norm(total, 1.0) == pytest.approx(total * clip_coef(total, 1.0), rel=1e-12)
    assert (clip_coef(total, 1.0) < 1.0) == (total > 1.0 - 1e-6)


def test_most_is_half_of_enough_steps() -> None:
    assert clips_most(5, 10) and not clips_most(4, 10) and not clips_most(9, 9)


def test_the_logged_norms_give_the_share_threshold_and_mean_factors() -> None:
    torch.manual_seed(1)
    totals = [0.5, 0.9, 1.2, 1.5, 2.0, 3.0, 4.0, 0.7, 1.1, 2.5]
    pairs = [(t, _clipped_norm(t, 1.0)) for t in totals]
    got = Clipped.of(pairs)
    shrunk = [1.0 / t for t in totals if t > 1.0]  # threshold / norm, by hand
    assert (got.steps, got.clipped) == (10, len(shrunk))
    assert got.threshold == pytest.approx(1.0, rel=1e-5)
    assert got.median_norm == statistics.median(totals)
    assert got.shrink == pytest.approx(statistics.fmean(shrunk), rel=1e-5)
    assert got.scale == pytest.approx((sum(shrunk) + 10 - len(shrunk)) / 10, rel=1e-5)


def test_clipped_norms_that_differ_are_not_clipping_by_norm() -> None:
    torch.manual_seed(2)
    pairs = []
    for _ in range(12):
        p = torch.zeros(30, dtype=torch.float64, requires_grad=True)
        p.grad = torch.randn(30, dtype=torch.float64)
        before = float(p.grad.norm())
        torch.nn.utils.clip_grad_value_([p], 1.0)
        pairs.append((before, float(p.grad.norm())))
    got = Clipped.of(pairs)
    assert got.clipped == 12 and got.threshold is None
    assert got.scale == pytest.approx(statistics.fmean(a / b for b, a in pairs))


def _late_update_norm(optimizer: type, lr: float, clip: float | None) -> float:
    """The mean update norm over the last 300 of 1,200 steps on w ↦ ‖w‖²/2 with gradient noise of norm ~1.26."""
    torch.manual_seed(3)
    w = torch.full((1000,), 0.05, requires_grad=True)
    opt = optimizer([w], lr=lr)
    sizes = []
    for _ in range(1200):
        g = w.detach() + 0.04 * torch.randn(1000)
        if clip is not None:
            g = g * clip_coef(float(g.norm()), clip)
        w.grad = g
        before = w.detach().clone()
        opt.step()
        sizes.append(float((w.detach() - before).norm()))
    return statistics.fmean(sizes[-300:])


@pytest.mark.slow
def test_under_sgd_the_mean_factor_is_the_lr_cut_and_adamw_cancels_it() -> None:
    """Clipping at 1 a gradient whose noise alone has norm ~1.26: SGD's steps shrink by the mean factor (to ~5 %: the
    trajectory moves with them), AdamW's not at all — what the report says of each."""
    torch.manual_seed(3)
    noise = [float((0.04 * torch.randn(1000)).norm()) for _ in range(300)]
    factor = statistics.fmean(clip_coef(n, 1.0) for n in noise)
    sgd = _late_update_norm(torch.optim.SGD, 0.01, 1.0) / _late_update_norm(torch.optim.SGD, 0.01, None)
    adamw = _late_update_norm(torch.optim.AdamW, 1e-3, 1.0) / _late_update_norm(torch.optim.AdamW, 1e-3, None)
    assert sgd == pytest.approx(factor, rel=0.05) and factor < 0.85
    assert adamw == pytest.approx(1.0, abs=0.02)
