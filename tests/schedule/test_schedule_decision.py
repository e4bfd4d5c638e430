"""The schedule's pure parts: the decision, the band's margin at the lr scale, a cut's line, the warm-ups."""

from __future__ import annotations

import math

import pytest
import torch
from torch.optim import lr_scheduler

from trainvitals.schedule.decision import Action, Cut, decide, scaled_margin
from trainvitals.schedule.warmup import scheduler_warmup


@pytest.mark.parametrize(
    ("in_band", "cuts", "lr", "max_cuts", "min_lr", "stop", "action"),
    [
        (False, 0, 0.1, 2, 0.0, True, Action.NONE),
        (True, 0, 0.1, 2, 0.0, True, Action.CUT),
        (True, 1, 0.01, 2, 0.0, True, Action.CUT),
        (True, 2, 0.001, 2, 0.0, True, Action.STOP),  # the band entered after the last cut
        (True, 2, 0.001, 2, 0.0, False, Action.NONE),  # stop=False never stops
        (True, 5, 0.1, None, 0.0, True, Action.CUT),  # no limit on the cuts
        (True, 0, 0.1, 2, 0.02, True, Action.STOP),  # 0.1 × 0.1 = 0.01 < min_lr
        (True, 0, 0.1, 2, 0.01, True, Action.CUT),  # exactly min_lr is allowed
        (True, 0, 0.1, 0, 0.0, True, Action.STOP),  # max_cuts=0: the band stop
    ],
)
def test_the_decision(in_band, cuts, lr, max_cuts, min_lr, stop, action):
    assert decide(in_band, cuts, lr, 0.1, max_cuts, min_lr, stop, ratio_high=0.5) is action


@pytest.mark.parametrize("cuts", [1, 2])
@pytest.mark.parametrize("high", [1.01, 2.9, math.inf, math.nan])
def test_after_a_cut_no_act_until_the_whole_interval_is_in_the_band(cuts, high):
    # The band ratio's 90 % interval reaching past the (scaled) edge: after a cut the completed streak does not
    # cut, grow or stop; the first cut rests on the streak alone, as the stopper's stop does.
    for growth, stop in ((1, True), (4, True), (1, False)):
        assert decide(True, cuts, 0.01, 0.1, 3, 0.0, stop, high, growth) is Action.NONE
    assert decide(True, 2, 0.01, 0.1, 2, 0.0, True, high) is Action.NONE  # the stop after the last cut waits too
    assert decide(True, 0, 0.1, 0.1, 2, 0.0, True, high) is Action.CUT
    assert decide(True, 0, 0.1, 0.1, 0, 0.0, True, high) is Action.STOP  # max_cuts=0 is the band stop, unchanged
    assert decide(True, cuts, 0.01, 0.1, 3, 0.0, True, 1.0) is Action.CUT  # the upper end at the edge: in the band
    assert decide(True, cuts, 0.01, 0.1, 3, 0.0, True, 0.3, growth=4) is Action.GROW
    assert decide(True, 3, 0.01, 0.1, 3, 0.0, True, 0.3) is Action.STOP


def test_a_batch_growth_comes_first_and_min_lr_bounds_only_an_lr_cut():
    # 0.1 × 0.1 = 0.01 < min_lr 0.02: an lr cut is refused, a growth (which leaves the lr alone) is not.
    assert decide(True, 0, 0.1, 0.1, 2, 0.02, True, 0.5, growth=10) is Action.GROW
    assert decide(True, 0, 0.1, 0.1, 2, 0.02, True, 0.5, growth=1) is Action.STOP
    assert decide(True, 0, 0.1, 0.1, 2, 0.02, False, 0.5, growth=1) is Action.NONE
    assert decide(True, 1, 0.1, 0.1, 2, 0.0, True, 0.5, growth=4) is Action.GROW  # before a cut the lr allows
    assert decide(True, 2, 0.1, 0.1, 2, 0.0, True, 0.5, growth=4) is Action.STOP  # growths count toward max_cuts
    assert decide(False, 0, 0.1, 0.1, 2, 0.02, True, 0.5, growth=4) is Action.NONE


def test_the_band_edge_follows_the_lr_scale():
    assert scaled_margin(0.2, 1.0) == 0.2
    assert scaled_margin(0.2, 0.01) == pytest.approx(0.002)


def test_a_cut_line_names_the_step_the_ratio_its_interval_and_the_scale():
    line = Cut(420, 0.81, 0.42, 1.2, 0.1).line()
    assert "420" in line and "0.81" in line and "0.42" in line and "1.2" in line and "0.1" in line
    assert "90 %" not in Cut(7, 0.5, -math.inf, math.inf, 0.1).line()  # no interval without an error


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)


def test_warmups_read_from_the_schedulers():
    opt = _optimizer()
    assert scheduler_warmup(lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=50)) == 50
    assert scheduler_warmup(lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.1, total_iters=50)) == 0
    assert scheduler_warmup(lr_scheduler.ConstantLR(opt, factor=0.5, total_iters=30)) == 30
    one_cycle = lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=1000, pct_start=0.3)
    assert scheduler_warmup(one_cycle) == 300
    warm, decay = lr_scheduler.LinearLR(opt, 0.01, total_iters=80), lr_scheduler.CosineAnnealingLR(opt, 900)
    assert scheduler_warmup(lr_scheduler.SequentialLR(opt, [warm, decay], milestones=[100])) == 80
    assert scheduler_warmup(lr_scheduler.StepLR(opt, 10)) == 0
    assert scheduler_warmup(lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 25))) == 24
    assert scheduler_warmup(lr_scheduler.LambdaLR(opt, lambda i: 0.99**i)) == 0
    assert scheduler_warmup(object()) is None


def test_the_warmup_of_transformers_linear_schedule():
    transformers = pytest.importorskip("transformers")
    opt = _optimizer()
    sched = transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=40, num_training_steps=400)
    assert scheduler_warmup(sched) == 40
    sched = transformers.get_cosine_schedule_with_warmup(opt, num_warmup_steps=15, num_training_steps=400)
    assert scheduler_warmup(sched) == 15


def test_the_batch_growth_stops_at_b_simple_and_half_an_epoch():
    from trainvitals.schedule.decision import batch_growth

    assert batch_growth(0.1, 64, None, None) == 10  # as the lr cut: the stationary loss ∝ η/B
    assert batch_growth(0.1, 64, 300.0, None) == 4  # 4·64 = 256 ≤ B_simple = 300 < 5·64
    assert batch_growth(0.1, 64, None, 500) == 3  # 3·64 ≤ 250, half the epoch
    assert batch_growth(0.5, 64, 100.0, None) == 1  # past B_simple already: cut the lr instead
    assert batch_growth(0.1, None, None, None) == 1
    assert batch_growth(0.3, 16, math.inf, None) == 3


def test_a_cut_line_states_what_its_interval_shows():
    # ‖G‖² within its error of 0: the interval's low end is 0 and the point may be negative; the line gives the
    # upper bound alone, never a point outside its own interval.
    near_zero = Cut(step=439, band_ratio=-0.33, ratio_low=0.0, ratio_high=2.9, lr_scale=0.01).line()
    assert "≤ 2.9" in near_zero and "-0.33" not in near_zero and "lr × 0.01" in near_zero
    clear = Cut(step=420, band_ratio=0.81, ratio_low=0.42, ratio_high=1.2, lr_scale=0.1).line()
    assert "0.81" in clear and "0.42" in clear and "1.2" in clear
