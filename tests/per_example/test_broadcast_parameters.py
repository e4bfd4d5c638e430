"""A module's own bare parameters that its forward broadcasts over the batch (a ViT's ``pos_embed`` and ``cls_token``,
a ConvNeXt block's layer-scale ``gamma``): measured per example at the nodes that read them, against a brute-force
loop over the examples and ALL trainable parameters; a parameter read by anything else is named as not measured, the
rest exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import HostReads
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainvitals.per_example import PerExampleGradients, plan_sources

B, N, P, D, C = 4, 5, 6, 8, 3


class Block(nn.Module):
    """timm's pre-LN block: attention and an MLP, each residual scaled by a bare layer-scale ``gamma`` (ConvNeXt's
    ``self.gamma * x``) beside the Linear children."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.gamma_1, self.gamma_2 = nn.Parameter(torch.rand(D)), nn.Parameter(torch.rand(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.gamma_1 * self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x)) * self.gamma_2


class ViT(nn.Module):
    """A ViT as timm and torchvision write it: patches embedded by a Linear, a class token expanded over the batch and
    concatenated, a position table ``(1, N + 1, D)`` added; ``use`` varies how the bare parameters are read."""

    def __init__(self, use: str = "timm") -> None:
        super().__init__()
        self.use = use
        self.patch_embed = nn.Linear(P, D)
        self.cls_token = nn.Parameter(0.1 * torch.randn(1, 1, D))
        shape = (N + 1, D) if use in ("(N, D)", "[None]") else (1, N + 3 if use in ("longer", "tail") else N + 1, D)
        self.pos_embed = nn.Parameter(0.1 * torch.randn(*shape))
        self.pos_drop = nn.Dropout(0.2)
        if use.startswith("rezero"):  # 0-d scales (ReZero, SkipInit)
            self.alpha, self.beta = nn.Parameter(torch.tensor(0.7)), nn.Parameter(torch.tensor(1.3))
        self.register_buffer("weights", torch.linspace(0.5, 1.5, D))
        self.blocks = nn.Sequential(Block(), Block())
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        cls, use = self.cls_token.expand(x.shape[0], -1, -1), self.use
        if use in ("timm", "(N, D)"):
            x = self.pos_drop(torch.cat([cls, x], 1) + self.pos_embed)
        elif use == "pos first":  # torchvision's order of operands: the table on the left
            x = self.pos_embed + torch.cat([cls, x], 1)
        elif use == "alpha":
            x = torch.add(torch.cat([cls, x], 1), self.pos_embed, alpha=0.5)
        elif use == "subtracted":
            x = torch.cat([cls, x], 1) - self.pos_embed
        elif use == "sliced":  # MAE's: the patches' rows of the table, the class token's own position apart
            x = torch.cat([cls + self.pos_embed[:, :1], x + self.pos_embed[:, 1:]], 1)
        elif use == "longer":  # lucidrains' vit-pytorch: a table longer than the sequence, cut to it, added in place
            x = torch.cat([cls, x], 1)
            x += self.pos_embed[:, : N + 1]
        elif use == "tail":  # the last rows, counted from the end
            x = torch.cat([cls, x], 1) + self.pos_embed[:, -(N + 1) :][:, ::1]
        elif use == "aliased":  # a slice as long as the table: an alias
            x = torch.cat([cls, x], 1) + self.pos_embed[:, : N + 1]
        elif use == "[None]":
            x = torch.cat([cls, x], 1) + self.pos_embed[None]
        elif use == "mae":  # MAE's class token: its position added before the expansion over the batch
            cls = (self.cls_token + self.pos_embed[:, :1]).expand(x.shape[0], -1, -1)
            x = torch.cat([cls, x + self.pos_embed[:, 1:]], 1)
        elif use == "scaled":  # arithmetic with numbers and buffers before the add
            x = torch.cat([cls, x], 1) + (-(0.5 * self.pos_embed) / 2.0) * self.weights
        elif use == "reshaped":
            x = torch.cat([cls, x], 1) + self.pos_embed.view(N + 1, D)
        elif use == "rezero":
            x = (torch.cat([cls, x], 1) + self.pos_embed) * self.alpha
        elif use == "rezero product":
            x = (torch.cat([cls, x], 1) + self.pos_embed) * (self.alpha * self.beta)
        elif use == "unused":  # the loss does not reach it: its gradient is 0
            x = torch.cat([cls, x], 1)
        elif use == "every block":  # added again before each block: the nodes' gradients summed
            x = torch.cat([cls, x], 1)
            for block in self.blocks:
                x = block(x + self.pos_embed)
            return self.head(self.norm(x)[:, 0])
        # what no exact rule reads here
        elif use == "squashed":
            x = torch.cat([cls, x], 1) + self.pos_embed.tanh()
        elif use == "reentrant":  # reentrant checkpointing hides what it computes from the loss's graph
            x = checkpoint(lambda t: t + self.pos_embed, torch.cat([cls, x], 1), use_reentrant=True)
        x = self.blocks(x)
        return self.head(self.norm(x)[:, 0])


def brute_force(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each example's gradient of its own loss, ``{name: (B, *shape)}``, every parameter: differentiated alone
    through one forward of the batch, whose dropout masks :func:`measure`'s forward draws again from the same seed."""
    params = dict(model.named_parameters())
    torch.manual_seed(1)
    out = model(x)
    grads = [
        torch.autograd.grad(
            F.cross_entropy(out[i : i + 1], y[i : i + 1]), list(params.values()), retain_graph=True, allow_unused=True
        )
        for i in range(len(x))
    ]
    return {
        n: torch.stack([torch.zeros_like(p) if g[k] is None else g[k] for g in grads])
        for k, (n, p) in enumerate(params.items())
    }


def measure(model: nn.Module, x: torch.Tensor, y: torch.Tensor, exclude: tuple[str, ...] = (), told: bool = True):
    """One micro-batch with every planned layer hooked, the loss shown to the collector (``told``) before its
    backward."""
    plan = plan_sources(model, groups_available=False, fallback=False, exclude=exclude)
    collector = PerExampleGradients(plan.per_example, {}, 2)
    collector.attach(coordinates=True, keep_norms=True)
    collector.begin_micro_batch()
    collector.expect_batch(len(x))
    model.zero_grad()
    torch.manual_seed(1)
    loss = F.cross_entropy(model(x), y)
    if told:
        collector.before_backward(loss)
    loss.backward()
    collector.end_micro_batch(float(len(x)))
    collector.detach()
    return plan, collector, collector.pop()


def data(use: str = "timm") -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return ViT(use).double(), torch.randn(B, N, P, dtype=torch.float64), torch.randint(0, C, (B,))


BARE = ("pos_embed", "cls_token", "blocks.0.gamma_1", "blocks.0.gamma_2", "blocks.1.gamma_1", "blocks.1.gamma_2")


@pytest.mark.parametrize(
    "use",
    [
        "timm", "(N, D)", "pos first", "alpha", "subtracted", "sliced", "longer", "tail", "aliased", "[None]", "mae",
        "scaled", "reshaped", "rezero", "rezero product", "unused", "every block",
    ],
)  # fmt: skip
def test_bare_parameters_broadcast_over_the_batch_are_measured_per_example_exactly(use):
    model, x, y = data(use)
    truth = brute_force(model, x, y)
    plan, collector, step = measure(model, x, y)
    assert not plan.uncovered and {"", "blocks.0", "blocks.1"} <= set(plan.per_example)
    assert step.failed == {} and {"", "blocks.0", "blocks.1"} <= step.seen
    flat = torch.cat([g.reshape(B, -1) for g in truth.values()], 1)
    torch.testing.assert_close(step.sq_norms[0], flat.square().sum(1), rtol=1e-9, atol=0)
    torch.testing.assert_close(step.sq_norm_sum, flat.square().sum(), rtol=1e-9, atol=0)
    bare = torch.cat([truth[n].reshape(B, -1) for n in BARE], 1)
    assert float(bare.square().sum()) > 1e-2 * float(flat.square().sum())  # a share the checks would see
    for name in BARE:
        torch.testing.assert_close(step.grad_sum[name], truth[name].sum(0), rtol=1e-9, atol=1e-15)
        torch.testing.assert_close(step.sum_sq[name], truth[name].square().sum(0), rtol=1e-9, atol=1e-15)
    assert collector.unbalanced(step, 1.0 / B) == {}


@pytest.mark.parametrize("use", ["timm", "mae", "scaled"])
def test_catching_the_bare_parameters_reads_nothing_on_the_host(use):
    """The graph is walked on the host (shapes, nodes); the gradients caught and the views undone stay on the device."""
    model, x, y = data(use)
    with pytest.MonkeyPatch.context() as patch:
        host = HostReads(patch)
        host.watching = "collector"
        _, _, step = measure(model, x, y)
    assert host.reads == [] and step.failed == {}


@pytest.mark.parametrize(
    ("use", "why"),
    [
        ("squashed", "`pos_embed` is read by TanhBackward0"),
    ],
)
def test_a_bare_parameter_read_otherwise_is_named_and_the_rest_is_exact(use, why):
    """The root's parameters meet the batch through something with no exact per-example rule here: they are not
    measured (the root fails, and is set aside), the blocks' layer-scales and every layer are exact; the plan then
    excludes the root and names why."""
    model, x, y = data(use)
    truth = brute_force(model, x, y)
    plan, collector, step = measure(model, x, y)
    assert set(step.failed) == {""} and step.failed[""].startswith(why), step.failed
    assert "" not in step.seen and collector.set_aside(step) == {""}
    flat = torch.cat([g.flatten(1) for n, g in truth.items() if n not in ("pos_embed", "cls_token")], 1)
    torch.testing.assert_close(step.sq_norms[0], flat.square().sum(1), rtol=1e-9, atol=0)
    assert "pos_embed" not in step.grad_sum and collector.unbalanced(step, 1.0 / B) == {}
    replanned = plan_sources(model, groups_available=False, fallback=False, exclude=[""])
    assert set(replanned.uncovered) == {"pos_embed", "cls_token"}
    assert "not measurable where the graph broadcasts it over the examples" in replanned.uncovered["cls_token"]


def test_bare_parameters_are_left_unmeasured_when_the_loss_is_not_shown():
    model, x, y = data()
    _, collector, step = measure(model, x, y, told=False)
    assert set(step.failed) == {"", "blocks.0", "blocks.1"}
    assert all("before_backward" in why for why in step.failed.values())
    assert collector.set_aside(step) == {"", "blocks.0", "blocks.1"}


def test_a_bare_parameter_inside_reentrant_checkpointing_is_named():
    """Reentrant checkpointing recomputes its function in backward, out of the loss's graph: a parameter it uses is
    not reached there, and may not be taken for unused."""
    model, x, y = data("reentrant")
    _, collector, step = measure(model, x, y)
    assert step.failed == {"": "`pos_embed` is not reached from the loss's graph: inside reentrant checkpointing?"}
    assert collector.set_aside(step) == {""}
