"""A position table looked up with ids shared by the batch (``wpe(arange(T))``, HF's ``(1, T)`` position ids) and
added to the token embeddings: measured per example where the add broadcasts it, against a brute-force loop over the
examples and ALL trainable parameters; where anything else reads its output, named as not measured, the rest exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import HostReads
from torch import nn

from trainvitals.per_example import PerExampleGradients, plan_sources

B, T, V, D = 4, 6, 11, 8


class Block(nn.Module):
    """Pre-LN: causal self-attention and an MLP, each a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class PositionLM(nn.Module):
    """A GPT-2-style LM, its output layer tied to the token table; ``use`` says how the position table is looked up
    and what reads its output."""

    def __init__(self, use: str) -> None:
        super().__init__()
        self.use = use
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.drop = nn.Dropout(0.2)
        self.h = nn.ModuleList(Block() for _ in range(2))
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        tok, ids = self.wte(idx), torch.arange(t)
        use = self.use
        if use == "(T,)":
            x = tok + self.wpe(ids)
        elif use == "nanoGPT":  # dropout after the sum: each example's mask its own, in the add's gradient
            x = self.drop(tok + self.wpe(torch.arange(0, t, dtype=torch.long)))
        elif use == "(1, T)":  # HF GPT-2
            x = tok + self.wpe(ids.unsqueeze(0))
        elif use == "[None]":
            x = self.wpe(ids)[None] + tok
        elif use == "repeated ids":  # a period of 3: repeated rows, summed within each example
            x = tok + self.wpe((ids % 3).unsqueeze(0))
        elif use == "alpha":
            x = torch.add(tok, self.wpe(ids), alpha=0.5)
        elif use == "every block":  # added again before each block: two adds, their gradients summed
            pos = self.wpe(ids)
            x = tok
            for block in self.h:
                x = block(x + pos)
            return self.lm_head(self.ln_f(x))
        # what no exact rule reads here
        elif use == "view":
            x = tok + self.wpe(ids.unsqueeze(0)).view(t, D)
        elif use == "repeat":
            x = tok + self.wpe(ids.unsqueeze(0)).repeat(b, 1, 1)
        elif use == "scaled":
            x = tok + 2.0 * self.wpe(ids)
        elif use == "in-place":
            x = tok + self.wpe(ids.unsqueeze(0)).mul_(2.0)
        elif use == "sequence-first":  # positions broadcast over dimension 1 of a (T, B, D) sum
            x = (tok.transpose(0, 1) + self.wpe(ids).unsqueeze(1)).transpose(0, 1)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def brute_force(model: nn.Module, idx: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each example's gradient of its own loss (the mean over its tokens), ``{name: (B, *shape)}``, every parameter:
    differentiated alone through one forward of the batch, whose dropout masks :func:`measure`'s forward draws
    again from the same seed."""
    params = dict(model.named_parameters())
    torch.manual_seed(1)
    out = model(idx)
    grads = [
        torch.autograd.grad(F.cross_entropy(out[i], y[i]), list(params.values()), retain_graph=True)
        for i in range(len(idx))
    ]
    return {n: torch.stack([g[k] for g in grads]) for k, n in enumerate(params)}


def measure(model: nn.Module, idx: torch.Tensor, y: torch.Tensor, told: bool = True):
    """One micro-batch with every layer hooked, the loss shown to the collector (``told``) before its backward."""
    plan = plan_sources(model, groups_available=False, fallback=False)
    collector = PerExampleGradients(plan.per_example, {}, 2)
    collector.attach(coordinates=True, keep_norms=True)
    collector.begin_micro_batch()
    collector.expect_batch(len(idx))
    model.zero_grad()
    torch.manual_seed(1)
    loss = F.cross_entropy(model(idx).flatten(0, 1), y.flatten())
    if told:
        collector.before_backward(loss)
    loss.backward()
    collector.end_micro_batch(float(len(idx)))
    collector.detach()
    return collector, collector.pop()


@pytest.mark.parametrize("use", ["(T,)", "nanoGPT", "(1, T)", "[None]", "repeated ids", "alpha", "every block"])
def test_a_position_table_added_to_the_batch_is_measured_per_example_exactly(use):
    torch.manual_seed(0)
    model = PositionLM(use).double()
    idx, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    truth = brute_force(model, idx, y)
    collector, step = measure(model, idx, y)
    assert step.failed == {} and "wpe" in step.seen
    flat = torch.cat([g.flatten(1) for g in truth.values()], 1)
    torch.testing.assert_close(step.sq_norms[0], flat.square().sum(1), rtol=1e-9, atol=0)
    torch.testing.assert_close(step.sq_norm_sum, flat.square().sum(), rtol=1e-9, atol=0)
    wpe = truth["wpe.weight"]
    assert float(wpe.square().sum()) > 1e-3 * float(flat.square().sum())  # a share the check would see
    torch.testing.assert_close(step.grad_sum["wpe.weight"], wpe.sum(0), rtol=1e-9, atol=1e-15)
    torch.testing.assert_close(step.sum_sq["wpe.weight"], wpe.square().sum(0), rtol=1e-9, atol=1e-15)
    assert collector.unbalanced(step, 1.0 / B) == {}


def test_finding_the_add_reads_nothing_on_the_host():
    """``before_backward`` walks the graph on the host; the hooks on the adds stay on the device."""
    torch.manual_seed(0)
    model = PositionLM("(T,)").double()
    idx, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    plan = plan_sources(model, groups_available=False, fallback=False)
    collector = PerExampleGradients(plan.per_example, {}, 2)
    collector.attach(keep_norms=True)
    collector.begin_micro_batch()
    collector.expect_batch(B)
    with pytest.MonkeyPatch.context() as patch:
        host = HostReads(patch)
        host.watching = "collector"
        loss = F.cross_entropy(model(idx).flatten(0, 1), y.flatten())
        collector.before_backward(loss)
        loss.backward()
        collector.end_micro_batch(float(B))
        step = collector.pop(decide=False)
    assert host.reads == [] and step.failed == {}


@pytest.mark.parametrize(
    ("use", "read_by"),
    [
        ("view", "ViewBackward0"),
        ("repeat", "RepeatBackward0"),
        ("scaled", "MulBackward0"),
        ("in-place", "MulBackward0"),
        ("sequence-first", "UnsqueezeBackward0"),
    ],
)
def test_a_position_table_read_by_anything_else_is_named_and_the_rest_is_exact(use, read_by):
    """The output of the lookup meets the batch through something with no exact per-example rule here: the table
    is not measured (as when its gradient arrives summed), the model's output is as without the hooks."""
    torch.manual_seed(0)
    model = PositionLM(use).double()
    idx, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    expected = model(idx)
    truth = brute_force(model, idx, y)
    collector, step = measure(model, idx, y)
    torch.testing.assert_close(model(idx), expected, rtol=0, atol=0)
    assert set(step.failed) == {"wpe"} and "shared by" in step.failed["wpe"]
    assert read_by in step.failed["wpe"] and "wpe" not in step.seen and collector.set_aside(step) == {"wpe"}
    flat = torch.cat([g.flatten(1) for n, g in truth.items() if n != "wpe.weight"], 1)
    torch.testing.assert_close(step.sq_norms[0], flat.square().sum(1), rtol=1e-9, atol=0)
    assert "wpe.weight" not in step.grad_sum and collector.unbalanced(step, 1.0 / B) == {}


def test_a_position_table_is_left_unmeasured_when_the_loss_is_not_shown():
    torch.manual_seed(0)
    model = PositionLM("(1, T)").double()
    idx, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    collector, step = measure(model, idx, y, told=False)
    assert set(step.failed) == {"wpe"} and "before_backward" in step.failed["wpe"]
    assert collector.set_aside(step) == {"wpe"}


@pytest.mark.parametrize("use", ["(T,)", "nanoGPT"])
def test_at_t_equal_b_arange_ids_broadcast_by_the_add_are_measured_without_a_host_read(use):
    """1-D ids of B integers (T = B) are the examples' own ids or arange(T): where adds broadcast the lookup's output
    over the batch, both readings are computed and the one the ids make true chosen on the device."""
    torch.manual_seed(0)
    model = PositionLM(use).double()
    idx, y = torch.randint(0, V, (B, B)), torch.randint(0, V, (B, B))
    truth = brute_force(model, idx, y)
    with pytest.MonkeyPatch.context() as patch:
        host = HostReads(patch)
        host.watching = "collector"
        collector, step = measure(model, idx, y)
    assert host.reads == [] and not step.undecided
    collector.decide(step)
    assert step.failed == {} and "wpe" in step.seen
    flat = torch.cat([g.flatten(1) for g in truth.values()], 1)
    torch.testing.assert_close(step.sq_norms[0], flat.square().sum(1), rtol=1e-9, atol=0)
    torch.testing.assert_close(step.sum_sq["wpe.weight"], truth["wpe.weight"].square().sum(0), rtol=1e-9, atol=1e-15)
    assert collector.unbalanced(step, 1.0 / B) == {}


class Recommender(nn.Module):
    """One item id per example, ``(B,)``, its row added to the example's user row: an add that broadcasts nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.items, self.users, self.head = nn.Embedding(9, 3), nn.Embedding(5, 3), nn.Linear(3, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.items(ids[:, 0]) + self.users(ids[:, 1])))


def test_per_example_ids_read_by_an_add_that_broadcasts_nothing_stay_the_examples_own():
    torch.manual_seed(0)
    model = Recommender().double()
    ids = torch.stack([torch.tensor([3, 7, 3, 1]), torch.tensor([0, 4, 2, 2])], 1)
    plan = plan_sources(model, groups_available=False, fallback=False)
    collector = PerExampleGradients(plan.per_example, {}, 2)
    collector.attach(keep_norms=True)
    collector.begin_micro_batch()
    collector.expect_batch(B)
    loss = model(ids).square().mean()
    collector.before_backward(loss)
    loss.backward()
    collector.end_micro_batch(float(B))
    step = collector.pop()
    assert step.failed == {} and step.seen == {"items", "users", "head"}
    truth = []
    for i in range(B):  # each example's own loss out_i²
        model.zero_grad()
        model(ids[i : i + 1]).square().sum().backward()
        truth.append(sum(p.grad.square().sum() for p in model.parameters()))
    torch.testing.assert_close(step.sq_norms[0], torch.stack(truth), rtol=1e-9, atol=0)
