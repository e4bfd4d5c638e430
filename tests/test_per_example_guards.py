"""What the per-example hooks cannot measure exactly is reported as not measured, never measured wrongly:
each case here gave wrong per-example norms while every layer counted as covered."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainvitals.core.per_example import PerExampleGradients, plan_sources

B = 4


def collect(model: nn.Module, loss_of) -> tuple[PerExampleGradients, object]:
    """One micro-batch through ``loss_of(model)`` and its backward, with every coverable layer hooked."""
    plan = plan_sources(model, groups_available=False, fallback=False)
    collector = PerExampleGradients(plan.per_example, {}, 2)
    collector.attach(coordinates=True, keep_norms=True)
    collector.begin_micro_batch()
    model.zero_grad()
    loss_of(model).backward()
    collector.end_micro_batch(float(B))
    collector.detach()
    return collector, collector.pop()


def test_a_gradient_penalty_leaves_the_layers_it_differentiates_unmeasured():
    """loss = ℓ + ‖∇_x ℓ‖² (R1, WGAN-GP): the inner autograd.grad runs the output hooks, and the penalty's
    gradient reaches the weights through double-backward nodes no rule sees."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    model = nn.ModuleDict({"head": nn.Linear(3, 3), "side": nn.Linear(3, 2), "net": net}).double()
    x, y = torch.randn(B, 3, dtype=torch.float64), torch.randint(0, 2, (B,))

    def loss_of(m):
        h = m["head"](x)
        per = F.cross_entropy(m["net"](h), y, reduction="none")
        (g,) = torch.autograd.grad(per.sum(), h, create_graph=True)
        return (per + g.square().sum(1) + m["side"](x).square().sum(1)).mean()

    _, step = collect(model, loss_of)
    assert set(step.failed) == {"head", "net.0", "net.2"}  # the inner backward reaches the head's output too
    assert "side" in step.seen
    assert all("gradient penalty" in why for why in step.failed.values())


def test_a_backward_with_create_graph_alone_stays_measured():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    x, y = torch.randn(B, 3, dtype=torch.float64), torch.randint(0, 2, (B,))
    plan = plan_sources(net, groups_available=False, fallback=False)
    collector = PerExampleGradients(plan.per_example, {}, 2)
    collector.attach()
    F.cross_entropy(net(x), y).backward(create_graph=True)
    collector.end_micro_batch(float(B))
    assert not collector.pop().failed


def test_an_autograd_grad_before_the_loss_backward_leaves_its_layers_unmeasured():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    x = torch.randn(B, 3, dtype=torch.float64, requires_grad=True)

    def loss_of(m):
        out = m(x)
        torch.autograd.grad(out.sum(), x, retain_graph=True)  # e.g. a saliency map logged in training_step
        return out.square().mean()

    _, step = collect(net, loss_of)
    assert set(step.failed) == {"0", "2"} and all("before the loss's" in why for why in step.failed.values())
