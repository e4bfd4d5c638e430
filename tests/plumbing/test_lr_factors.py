"""LRFactors: owners' factors compose on top of a scheduler's lr and are put back after the optimizer's step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainvitals.plumbing.lr_factors import LRFactors


def test_two_owners_compose_and_the_scheduler_sees_only_its_own_lr():
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([{"params": [w]}, {"params": [nn.Parameter(torch.ones(1))], "lr": 0.5}], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)  # chainable: reads group["lr"]
    factors = LRFactors()
    factors.own("guard", lambda: 0.5)
    factors.own("schedule", lambda: 0.1)
    seen = []
    for step in range(3):
        factors.apply([opt])
        factors.apply([opt])  # again in the same step: applied anew, not compounded
        seen.append([g["lr"] for g in opt.param_groups])
        assert [factors.lr(g) for g in opt.param_groups] == pytest.approx(seen[-1])
        w.grad = torch.ones(2)
        opt.step()  # the post-hook puts the scheduler's lrs back
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.9**step, 0.5 * 0.9**step])
        sched.step()
    assert sum(seen, []) == pytest.approx(sum(([0.05 * 0.9**s, 0.025 * 0.9**s] for s in range(3)), []))
    factors.close()
    factors.put_back()  # nothing saved: a no-op
    assert not opt._optimizer_step_post_hooks
    # Between steps the scheduler's lr is in place, and lr() is the one the next step takes.
    assert [factors.lr(g) for g in opt.param_groups] == pytest.approx([0.05 * 0.9**3, 0.025 * 0.9**3])


def test_a_step_the_grad_scaler_skips_puts_the_scheduler_lr_back_before_the_scheduler_steps():
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    scaler, factors = torch.amp.GradScaler("cpu", init_scale=4.0), LRFactors()
    factors.own("schedule", lambda: 0.1)
    for step, grad in enumerate((1.0, float("inf"), 1.0)):
        factors.apply([opt])
        scaler.scale((w * grad).sum()).backward()
        scaler.unscale_(opt)  # as Lightning does before on_before_optimizer_step
        factors.before_step(opt, scaler)
        # A finite step keeps the scaled lr for the update; the skipped one has the scheduler's back already.
        assert opt.param_groups[0]["lr"] == pytest.approx(0.9**step * (1.0 if step == 1 else 0.1))
        scaler.step(opt)
        scaler.update()
        assert opt.param_groups[0]["lr"] == pytest.approx(0.9**step)  # put back by the post-hook or before_step
        sched.step()
        opt.zero_grad()
    assert scaler.get_scale() == 2.0 and w.detach().tolist() == pytest.approx([1 - 0.1 - 0.081] * 2)
    factors.before_step(opt, None)  # nothing applied, no scaler: a no-op
    factors.close()
