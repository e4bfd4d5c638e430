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
    seen = []
    for step in range(3):
        factors.apply([opt], "guard", 0.5)
        factors.apply([opt], "schedule", 0.1)
        factors.apply([opt], "schedule", 0.1)  # again in the same step: replaced, not compounded
        seen.append([g["lr"] for g in opt.param_groups])
        w.grad = torch.ones(2)
        opt.step()  # the post-hook puts the scheduler's lrs back
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.9**step, 0.5 * 0.9**step])
        sched.step()
    assert sum(seen, []) == pytest.approx(sum(([0.05 * 0.9**s, 0.025 * 0.9**s] for s in range(3)), []))
    factors.close()
    factors.put_back()  # nothing saved: a no-op
    assert not opt._optimizer_step_post_hooks
