"""core.gsnr: the coordinate budget's passes over the rows, and per-module GSNR against a brute-force mean."""

from __future__ import annotations

import math

import torch

from trainvitals.noise.gsnr import EB_CRITERION, ModuleCoordinates, gsnr_key


def _examples(shapes: dict[str, tuple[int, ...]], n: int = 6) -> dict[str, torch.Tensor]:
    """``n`` per-example gradients of each parameter, float64: ``(n, *shape)``."""
    torch.manual_seed(0)
    return {name: torch.randn(n, *shape, dtype=torch.float64) + 0.5 for name, shape in shapes.items()}


def _brute_gsnr(g: torch.Tensor) -> torch.Tensor:
    """ḡ_d² / unbiased σ̂_d² of each coordinate, from the examples themselves."""
    return g.mean(0).square() / g.var(0, unbiased=True)


SHAPES = {"a.weight": (3, 4), "a.bias": (3,), "b.weight": (5, 2)}


def test_a_pass_takes_every_coordinate_once_in_whole_rows():
    params = {n: torch.zeros(s) for n, s in SHAPES.items()}
    coordinates = ModuleCoordinates(params, {}, budget=5)
    seen = {n: torch.zeros(p.shape[0], dtype=torch.long) for n, p in params.items()}
    cursor, steps = 0, 0
    while not steps or 0 < cursor < 25:  # a pass ends at the last coordinate (or back at the first)
        selection, cursor = coordinates.select(cursor)
        taken = sum(params[n][r].numel() for n, r in selection.items())
        assert taken < 5 + 4 and (taken >= 5 or cursor in (0, 25))  # the budget rounded up to a row, but at the end
        for name, rows in selection.items():
            seen[name][rows] += 1
        steps += 1
    assert steps <= math.ceil(25 / 5) and "(a pass: 5 logging steps)" in coordinates.budget_note()
    assert all(bool((count == 1).all()) for count in seen.values())
    within = ModuleCoordinates(params, {}, budget=25)
    assert within.select(0) == ({n: slice(None) for n in params}, 0) and within.budget_note() == ""


def test_module_gsnr_over_a_pass_of_several_steps_is_the_brute_force_mean():
    grads = _examples(SHAPES)
    n = 6
    coordinates = ModuleCoordinates({k: v[0] for k, v in grads.items()}, {}, budget=7)
    cursor, partial, logged = 0, {}, {}
    for _ in range(math.ceil(25 / 7)):  # a pass: 4 logging steps
        selection, cursor = coordinates.select(cursor)
        grad_sum = {k: grads[k][:, r].sum(0) for k, r in selection.items()}
        sum_sq = {k: grads[k][:, r].square().sum(0) for k, r in selection.items()}
        sums = coordinates.selected_sums(selection, grad_sum, sum_sq)
        snr, step = coordinates.snr_sums(selection, *sums, n, {}, {}, 0)
        assert EB_CRITERION not in snr  # a step with part of the coordinates
        values, partial = coordinates.complete_passes({k: float(v) for k, v in snr.items()}, step, partial)
        logged.update(values)
    assert not partial
    expected = {
        "a": torch.cat([_brute_gsnr(grads["a.weight"]).flatten(), _brute_gsnr(grads["a.bias"])]).mean(),
        "b": _brute_gsnr(grads["b.weight"]).mean(),
    }
    assert logged.keys() == {gsnr_key("a.weight"), gsnr_key("b.weight")}
    for module, value in expected.items():
        assert math.isclose(logged[gsnr_key(f"{module}.weight")], float(value), rel_tol=1e-9)


def test_a_whole_step_gives_the_eb_criterion_and_a_lost_step_no_gsnr():
    grads = _examples(SHAPES)
    sub = _examples({"c.weight": (2, 2)}, n=4)
    n = 6
    coordinates = ModuleCoordinates({k: v[0] for k, v in grads.items()}, {"c.weight": sub["c.weight"][0]}, budget=100)
    selection, _ = coordinates.select(0)
    sums = coordinates.selected_sums(
        selection, {k: g.sum(0) for k, g in grads.items()}, {k: g.square().sum(0) for k, g in grads.items()}
    )
    snr, step = coordinates.snr_sums(
        selection, *sums, n, {"c.weight": sub["c.weight"].sum(0)}, {"c.weight": sub["c.weight"].square().sum(0)}, 4
    )
    snr_all = torch.cat(
        [*(_brute_gsnr(g).flatten() * n for g in grads.values()), _brute_gsnr(sub["c.weight"]).flatten() * 4]
    )
    assert math.isclose(float(snr[EB_CRITERION]), float(1 - snr_all.sum() / snr_all.numel()), rel_tol=1e-9)
    values, _ = coordinates.complete_passes({k: float(v) for k, v in snr.items()}, step, {})
    assert math.isclose(values[gsnr_key("c.weight")], float(_brute_gsnr(sub["c.weight"]).mean()), rel_tol=1e-9)

    # A pass of two steps whose first was not logged (left out of the values) is not logged at its end.
    split = ModuleCoordinates({k: v[0] for k, v in grads.items()}, {}, budget=8)  # module a over two steps
    first, cursor = split.select(0)
    _, step = split.snr_sums(first, *split.selected_sums(first, {}, {}), n, {}, {}, 0)
    values, partial = split.complete_passes({}, step, {})
    second, _ = split.select(cursor)
    snr, step = split.snr_sums(
        second,
        *split.selected_sums(
            second,
            {k: grads[k][:, r].sum(0) for k, r in second.items()},
            {k: grads[k][:, r].square().sum(0) for k, r in second.items()},
        ),
        n,
        {},
        {},
        0,
    )
    values, partial = split.complete_passes({k: float(v) for k, v in snr.items()}, step, partial)
    assert gsnr_key("a.weight") not in values and gsnr_key("a.weight") not in partial
