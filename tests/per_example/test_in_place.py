"""An op that changes a layer's output in place (timm's ``LayerScale(inplace=True)``: ``x.mul_(gamma)`` on the
attention's ``proj`` output; ``nn.ReLU(inplace=True)``, ``clamp_``, a residual ``add_``): the layer is measured
exactly, against a brute-force loop over the examples and ALL trainable parameters in float64; a parameter that
cannot be measured is named with the in-place op that keeps it out, and the fix.

A Linear on ``(B, T, D)`` inputs returns a view of its ``(B·T, D)`` result, and an in-place op on a view drops the
view's autograd node, and the hook on it, from the graph: the layer's gradient used to go unseen."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainvitals.per_example import PerExampleGradients, plan_sources

B, N, P, D, C = 4, 5, 6, 8, 3


class LayerScale(nn.Module):
    """timm's layer-scale: in place where ``inplace``."""

    def __init__(self, dim: int, inplace: bool) -> None:
        super().__init__()
        self.inplace, self.gamma = inplace, nn.Parameter(0.5 + torch.rand(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(self.gamma) if self.inplace else x * self.gamma


class Attention(nn.Module):
    """timm's attention: one Linear for q, k, v, scaled dot-product attention, an output Linear ``proj``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, 2, c // 2).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))


class Block(nn.Module):
    """timm's pre-LN block, each residual branch scaled by a LayerScale."""

    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.norm1, self.attn, self.ls1 = nn.LayerNorm(D), Attention(), LayerScale(D, inplace)
        self.norm2, self.ls2 = nn.LayerNorm(D), LayerScale(D, inplace)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.ls1(self.attn(self.norm1(x)))
        return x + self.ls2(self.mlp(self.norm2(x)))


class ViT(nn.Module):
    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.patch_embed = nn.Linear(P, D)
        self.blocks = nn.Sequential(Block(inplace), Block(inplace))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.patch_embed(x))).mean(1))


class Tokens(nn.Module):
    """Linears on ``(B, N, D)`` tokens, ``op`` changing the first one's output in place."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op
        self.fc1, self.fc2, self.head = nn.Linear(P, D), nn.Linear(D, D), nn.Linear(D, C)
        self.act = nn.ReLU(inplace=True)
        if op in ("mul_ by a parameter", "out of place"):
            self.gamma = nn.Parameter(0.5 + torch.rand(D))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, op = self.fc1(x), self.op
        if op == "F.relu(inplace=True)":
            h = F.relu(h, inplace=True)
        elif op == "nn.ReLU(inplace=True)":
            h = self.act(h)
        elif op == "clamp_":
            h.clamp_(-0.3, 0.3)
        elif op == "add_":  # a residual added in place
            h.add_(self.fc2(torch.tanh(h)))
        elif op == "mul_ by a buffer":
            h.mul_(self.scale)
        elif op == "mul_ by a parameter":  # the root's own parameter, applied in place to the view
            h.mul_(self.gamma)
        else:
            h = h * self.gamma
        return self.head(torch.tanh(self.fc2(h)).mean(1))


class Recurrent(nn.Module):
    """A batch-first LSTM, whose output is a transpose of its ``(N, B, D)`` result, masked in place."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(P, D, batch_first=True), nn.Linear(D, C)
        self.register_buffer("mask", (torch.arange(N) % 3 != 1).double()[:, None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(torch.tanh(out.mul_(self.mask)).mean(1))


class ConvScale(nn.Module):
    """A convolution's ``(B, D, N)`` output, not a view, scaled in place by the model's own ``gamma``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.head = nn.Conv1d(P, D, 3, padding=1), nn.Linear(D, C)
        self.gamma = nn.Parameter(0.5 + torch.rand(D, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.conv(x.transpose(1, 2)).mul_(self.gamma)).mean(2))


def brute_force(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each example's gradient of its own loss, ``{name: (B, *shape)}``, every trainable parameter."""
    params = dict(model.named_parameters())
    grads = [
        torch.autograd.grad(
            F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), list(params.values()), materialize_grads=True
        )
        for i in range(len(x))
    ]
    return {n: torch.stack([g[k] for g in grads]) for k, n in enumerate(params)}


def measure(model: nn.Module, x: torch.Tensor, y: torch.Tensor, fallback: bool = False):
    """One micro-batch with every planned layer hooked (the torch.func layers on all B examples)."""
    plan = plan_sources(model, groups_available=False, fallback=fallback)
    collector = PerExampleGradients(plan.per_example, plan.vmap, B)
    collector.attach(coordinates=True, keep_norms=True)
    collector.begin_micro_batch()
    collector.expect_batch(len(x))
    model.zero_grad()
    loss = F.cross_entropy(model(x), y)
    collector.before_backward(loss)
    loss.backward()
    collector.end_micro_batch(float(len(x)))
    collector.detach()
    return plan, collector, collector.pop()


def assert_exact(step, truth: dict[str, torch.Tensor], names: list[str]) -> None:
    """``step``'s ‖g_i‖² over ``names`` and their per-coordinate sums, as the brute force's."""
    flat = torch.cat([truth[n].flatten(1) for n in names], 1)
    torch.testing.assert_close(step.sq_norms[0], flat.square().sum(1), rtol=1e-9, atol=0)
    for n in names:
        grad_sum, sum_sq = step.grad_sum.get(n, step.sub_grad_sum.get(n)), step.sum_sq.get(n, step.sub_sum_sq.get(n))
        torch.testing.assert_close(grad_sum, truth[n].sum(0), rtol=1e-9, atol=1e-15)
        torch.testing.assert_close(sum_sq, truth[n].square().sum(0), rtol=1e-9, atol=1e-15)


def assert_measured_exactly(make: Callable[[], nn.Module], seen: set[str] | None = None) -> None:
    """Every parameter of ``make()``'s model measured, exact against the brute force, its sums balanced; ``seen``:
    the modules measured (default: all the plan gives the per-example source)."""
    torch.manual_seed(0)
    model, x, y = data(make())
    truth = brute_force(model, x, y)
    plan, collector, step = measure(model, x, y)
    assert not plan.uncovered and step.failed == {} and step.seen == (set(plan.per_example) if seen is None else seen)
    assert_exact(step, truth, list(truth))
    assert collector.unbalanced(step, 1.0 / B) == {}


def data(model: nn.Module) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    return model.double(), torch.randn(B, N, P, dtype=torch.float64), torch.randint(0, C, (B,))


@pytest.mark.parametrize(
    "op",
    ["F.relu(inplace=True)", "nn.ReLU(inplace=True)", "clamp_", "add_", "mul_ by a buffer", "out of place"],
)
def test_an_in_place_op_on_a_linears_output_leaves_it_measured_exactly(op):
    assert_measured_exactly(lambda: Tokens(op))


def test_an_in_place_op_on_a_batch_first_lstms_output_leaves_it_measured_exactly():
    """The LSTM's rule takes its whole call, hooked on all of its outputs: a transposed one changed in place too."""
    assert_measured_exactly(Recurrent, {"rnn", "head"})


def test_a_bare_parameter_applied_in_place_to_a_plain_tensor_is_measured_exactly():
    """``c.mul_(gamma)`` on a convolution's output: the product's node saves ``c`` as it was, read as ``c * gamma``."""
    assert_measured_exactly(ConvScale, {"", "conv", "head"})


def test_a_bare_parameter_applied_in_place_to_a_view_is_named_and_the_rest_is_exact():
    """``h.mul_(gamma)`` on a Linear's ``(B, N, D)`` output: autograd hides the product in a CopySlices node, so the
    root's ``gamma`` is named, with the fix; the Linears stay exact."""
    torch.manual_seed(0)
    model, x, y = data(Tokens("mul_ by a parameter"))
    truth = brute_force(model, x, y)
    _, collector, step = measure(model, x, y)
    assert set(step.failed) == {""} and step.failed[""].startswith("`gamma` is applied in place to a view")
    assert "out of place (`x * p`) it is measured" in step.failed[""] and collector.set_aside(step) == {""}
    assert_exact(step, truth, [n for n in truth if n != "gamma"])


@pytest.mark.parametrize("inplace", [True, False])
def test_timm_layer_scale_in_place_leaves_the_layers_before_it_exact(inplace):
    """Without the fallback the layer-scales are not measured (no rule), in place or not; every other layer is exact,
    the attention's ``proj`` and the MLP's last Linear, whose outputs ``x.mul_(gamma)`` changes, too."""
    torch.manual_seed(0)
    model, x, y = data(ViT(inplace))
    truth = brute_force(model, x, y)
    plan, collector, step = measure(model, x, y)
    gammas = {f"blocks.{b}.ls{k}.gamma" for b in (0, 1) for k in (1, 2)}
    assert set(plan.uncovered) == gammas
    assert step.failed == {} and step.seen == set(plan.per_example)
    assert {"blocks.0.attn.proj", "blocks.1.mlp.2"} <= step.seen
    assert_exact(step, truth, [n for n in truth if n not in gammas])
    assert collector.unbalanced(step, 1.0 / B) == {}


def test_timm_layer_scale_in_place_is_named_for_the_fallback_and_measured_out_of_place():
    """torch.func re-runs a layer-scale's forward on its input, which ``x.mul_(gamma)`` changed: named, with the fix,
    and set aside, the rest exact; with ``inplace=False`` every parameter, each ``gamma`` too, is exact."""
    gammas = [f"blocks.{b}.ls{k}.gamma" for b in (0, 1) for k in (1, 2)]
    torch.manual_seed(0)
    model, x, y = data(ViT(inplace=True))
    truth = brute_force(model, x, y)
    plan, collector, step = measure(model, x, y, fallback=True)
    scales = {n.rpartition(".")[0] for n in gammas}
    assert set(plan.vmap) == scales and set(step.failed) == scales
    assert all(why.startswith("its forward changes its input in place") for why in step.failed.values())
    assert all("with inplace=False (timm's LayerScale default) it is measured" in why for why in step.failed.values())
    assert collector.set_aside(step) == scales
    assert_exact(step, truth, [n for n in truth if n not in gammas])

    torch.manual_seed(0)
    model, x, y = data(ViT(inplace=False))
    truth = brute_force(model, x, y)
    _, collector, step = measure(model, x, y, fallback=True)
    assert step.failed == {}
    assert_exact(step, truth, list(truth))
    assert collector.unbalanced(step, 1.0 / B) == {}
