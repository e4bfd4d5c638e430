"""The torch-only update math against brute force over flattened float64 tensors."""

from __future__ import annotations

import pytest
import torch

from trainvitals.updates.measure import adam_unit_step_norms, descent_dots, is_adam_like, snapshot, step_change


def params_and_grads():
    params = [
        torch.nn.Parameter(torch.randn(4, 3)),
        torch.nn.Parameter(torch.randn(5)),
        torch.nn.Parameter(torch.ones(2)),
    ]
    for p in params[:2]:
        p.grad = torch.randn_like(p)
    return params


def test_step_change_gives_weight_and_update_norms_and_leaves_minus_delta():
    params = params_and_grads()
    before = snapshot(params)
    kept = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn_like(p) * 0.1)
    weight, update = step_change(before, params)
    assert weight.tolist() == pytest.approx([k.double().norm().item() for k in kept])
    assert update.tolist() == pytest.approx([(p.detach() - k).double().norm().item() for p, k in zip(params, kept)])
    assert all(torch.allclose(b, k - p.detach()) for b, k, p in zip(before, kept, params))


def test_descent_dots_are_inner_products_and_zero_without_a_gradient():
    params = params_and_grads()
    neg_delta = [torch.randn_like(p) for p in params]
    dots = descent_dots(neg_delta, [p.grad for p in params])
    expected = [(d.double() * p.grad.double()).sum().item() for d, p in zip(neg_delta[:2], params[:2])]
    assert dots.tolist() == pytest.approx([*expected, 0.0], rel=1e-5)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_unit_step_is_the_update_over_lr_and_first_moment_its_state(amsgrad):
    params = params_and_grads()
    lr = 0.01
    optimizer = torch.optim.Adam(params, lr=lr, amsgrad=amsgrad)
    assert not is_adam_like(optimizer)  # no state yet
    for _ in range(3):
        for p in params[:2]:
            p.grad = torch.randn_like(p)
        before = snapshot(params)
        optimizer.step()
        _, update = step_change(before, params)
    assert is_adam_like(optimizer)
    first, unit = adam_unit_step_norms(optimizer, params, before)
    assert first.tolist() == pytest.approx(
        [optimizer.state[p]["exp_avg"].double().norm().item() for p in params[:2]] + [0.0]
    )
    assert (lr * unit).tolist() == pytest.approx(update.tolist(), rel=1e-4)
    assert not is_adam_like(torch.optim.SGD(params, lr=0.1))
