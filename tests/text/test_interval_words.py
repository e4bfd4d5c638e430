"""The band ratio in words: the point never outside the interval it is quoted with, one wording everywhere."""

from __future__ import annotations

import math
import re
from dataclasses import asdict

import pytest
import torch

from trainvitals import BandSchedule, GradNormEarlyStopping
from trainvitals.schedule.decision import Action, Cut
from trainvitals.text.intervals import band_ratio_said

NUMBER = r"-?[\d.]+(?:e[+-]?\d+)?"


def test_a_quoted_point_lies_in_its_interval_and_every_end_said_is_at_least_0():
    """Over a grid of points and ends (negative points and ends, an interval {0}, no upper end): every number said
    is ≥ 0; a point said with its interval lies in it, as printed; a negative point is not said, the upper end is,
    as a bound; a point outside its interval otherwise is left out."""
    values = [-8.7, -0.3, 0.0, 0.004, 0.095, 0.5, 1.0, 1.7, 3.0, math.inf]
    for ratio in values[:-1]:
        for low in values[:-1]:
            for high in (h for h in values if h >= low):
                said = band_ratio_said(ratio, low, high)
                assert all(float(n) >= 0 for n in re.findall(NUMBER, said)), said
                top = max(high, 0.0)
                if ratio < 0:
                    bound = re.match(rf"≤ ({NUMBER}) \(90 %; ‖G‖² ", said)
                    assert (float(bound[1]) == top) if math.isfinite(high) else said.startswith("unbounded"), said
                    continue
                point = re.match(rf"({NUMBER}) \(90 %: (?:≥ )?({NUMBER})(?:–({NUMBER}))?", said)
                if point is None:  # left out: outside its interval
                    assert not max(low, 0.0) <= ratio <= top and said.startswith(("in ", "≥ ")), said
                    continue
                assert float(point[1]) == pytest.approx(ratio, rel=0.05), said
                assert float(point[2]) <= float(point[1]) and (point[3] is None) == math.isinf(high), said
                assert point[3] is None or float(point[1]) <= float(point[3]), said


def test_the_fresh_users_fit_end_numbers_in_every_place_that_quotes_a_band_ratio(monkeypatch):
    """A fresh user's BandSchedule ended with "the band ratio was -8.7 (90 %: 0–0)": ‖G‖² = −0.40 ± 0.19, its
    whole interval below 0, so the ratio's interval is {0}. The cut line, BandSchedule's fit-end line and the
    stopper's say it in one wording, and BandSchedule's names the next step."""
    below = band_ratio_said(-8.7, 0.0, 0.0)
    assert below == "≤ 0 (90 %; ‖G‖² below 0 beyond its error)"
    assert f"band ratio {below} →" in Cut(1500, -8.7, 0.0, 0.0, 0.01).line()

    schedule = BandSchedule(verbose=False)
    schedule.cuts, schedule.lr_scale, schedule.margin = [asdict(Cut(1059, 0.095, 0.0, 1.1, 0.1))], 0.1, 0.02
    schedule._done, schedule._streak = torch.tensor(True), torch.tensor(90)
    schedule._held_back = (Action.CUT, -8.7, 0.0, 0.0, 12.9)
    line = schedule.summary_line()
    assert f"the band ratio (‖G‖² over the edge 0.02·tr(Σ)/B) was {below}; its point below 0 kept it" in line, line
    assert "bound it by steps or by a validation-loss EarlyStopping" in line and "(90 %: 0–0)" not in line

    stopper = GradNormEarlyStopping(margin=0.2)
    stopper._source, stopper.steps = "hooks", 500
    summary = {"decisive": True, "trace_cov": 146.6, "batch_size": 64, "grad_sq_norm": -0.3977}
    summary |= {"grad_sq_norm_se": 0.19, "band_grad_sq_norm": -0.3977, "band_ratio_low": 0.0, "band_ratio_high": 0.0}
    monkeypatch.setattr(stopper.gradient_noise, "host_summary", lambda *_: summary)
    line = stopper.summary_line()
    said = (
        "puts the band ratio (‖G‖² over the band's edge 0.2·tr(Σ)/B, its interval from ‖G‖²'s and tr(Σ)'s errors) at "
    )
    assert f"{said}{below}; that interval lies inside the band" in line, line
