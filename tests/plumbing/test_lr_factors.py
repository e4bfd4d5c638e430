"""LRFactors: owners' factors compose on top of a scheduler's lr and are put back after the optimizer's step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainvitals.plumbing.lr_factors import LRFactors, base_lr


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


def _groups(lrs: tuple[float, ...]) -> torch.optim.SGD:
    return torch.optim.SGD([{"params": [nn.Parameter(torch.ones(1))], "lr": lr} for lr in lrs])


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        # LambdaLR multiplies its base_lrs, the lrs the optimizer was made with, whatever the factor is now (0 here).
        (lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0), [0.1, 0.02]),
        (lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1), [0.1, 0.02]),
        # OneCycleLR's base_lrs are max_lr / div_factor: what a user sets is the peak.
        (lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.5, 0.3], total_steps=10), [0.5, 0.3]),
        # SequentialLR keeps no base_lrs; the initial_lr its schedulers wrote in the groups is the lr set.
        (
            lambda opt: torch.optim.lr_scheduler.SequentialLR(
                opt,
                [torch.optim.lr_scheduler.LinearLR(opt, 0.1, total_iters=2), torch.optim.lr_scheduler.StepLR(opt, 1)],
                [2],
            ),
            [0.1, 0.02],
        ),
        # ReduceLROnPlateau decays the lr in place and keeps no base lr.
        (lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt), [None, None]),
        (lambda opt: None, [None, None]),  # no scheduler: the lr in place is the one set
    ],
)
def test_base_lr_is_the_lr_a_user_sets_under_each_scheduler(make, expected):
    opt = _groups((0.1, 0.02))
    scheduler = make(opt)
    for _ in range(3):  # the lrs move; the base lr does not
        opt.step()
        if scheduler is not None:
            scheduler.step(*([1.0] if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) else []))
    assert [base_lr(g, i, scheduler) for i, g in enumerate(opt.param_groups)] == pytest.approx(expected)


def test_the_scheduled_lr_and_the_factors_a_message_names():
    opt = _groups((0.1,))
    factors = LRFactors()
    factors.own("TrainingGuard", lambda: 1.0)  # declared, scaling nothing now
    factors.own("BandSchedule", lambda: 0.1)
    factors.apply([opt])
    (group,) = opt.param_groups
    assert group["lr"] == pytest.approx(0.01) and factors.scheduled(group) == pytest.approx(0.1)
    assert factors.factors() == {"BandSchedule": 0.1}
    factors.close()
    assert factors.scheduled(group) == pytest.approx(0.1) and factors.lr(group) == pytest.approx(0.01)
