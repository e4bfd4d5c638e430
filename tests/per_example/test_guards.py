"""What the per-example hooks cannot measure exactly is reported as not measured, never measured wrongly:
each case here gave wrong per-example norms while every layer counted as covered."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune
from conftest import HostReads
from torch import nn

from trainvitals.per_example import (
    PerExampleGradients,
    plan_sources,
    register_per_example_rule,
    unregister_per_example_rule,
)

B = 4


def collect(model: nn.Module, loss_of, then=None, layers=None) -> tuple[PerExampleGradients, object]:
    """One micro-batch through ``loss_of(model)`` and its backward, with every coverable layer hooked, or
    ``layers`` (and ``then(model)`` run after the hooks are attached)."""
    plan = plan_sources(model, groups_available=False, fallback=False)
    collector = PerExampleGradients(plan.per_example if layers is None else layers, {}, 2)
    collector.attach(coordinates=True, keep_norms=True)
    if then is not None:
        then(model)
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


class DirectWeight(nn.Module):
    """``proj`` is called, and its weight also used outside its call."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.out = nn.Linear(3, 3), nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.proj(x)) + torch.tanh(x @ self.proj.weight.T))


class Standardised(nn.Conv2d):
    """Weight standardisation in ``_conv_forward``: not the convolution the Conv2d rule differentiates."""

    def _conv_forward(self, x, weight, bias):
        return super()._conv_forward(x, (weight - weight.mean((1, 2, 3), keepdim=True)), bias)


def _scale_output_grad(model: nn.Module) -> None:
    """A user's hook, after the probe's, doubles the gradient the layer's weights get."""
    model[0].register_forward_hook(lambda m, a, out: out.register_hook(lambda g: 2 * g) and None)


def _weight_norm(model: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.nn.utils.weight_norm(model[0])
    with torch.no_grad():
        model[0].weight_g.mul_(1.5)  # as after a step: g is no longer ‖v‖
    return model


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


UNBALANCED = {  # the model, its input's shape, the layer to name, what to do once the hooks are attached
    "weight used outside its call": (DirectWeight, (B, 3), "proj", None),
    "old weight_norm pre-hook": (lambda: _weight_norm(_mlp()), (B, 3), "0", None),
    "hook rescaling the output gradient": (_mlp, (B, 3), "0", _scale_output_grad),
}


@pytest.mark.parametrize("case", list(UNBALANCED))
def test_a_layer_whose_per_example_gradients_miss_part_of_its_gradient_is_named(case):
    make, shape, layer, then = UNBALANCED[case]
    torch.manual_seed(0)
    model = make().double()
    x = torch.randn(*shape, dtype=torch.float64)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}  # the plan leaves weight_norm out
    collector, step = collect(model, lambda m: m(x).square().mean(), then, layers)
    failed = {**step.failed, **collector.unbalanced(step, 1.0 / B)}
    assert set(failed) == {layer} and "do not add up" in failed[layer]


def test_a_reparametrised_layer_or_one_overriding_its_forward_path_has_no_rule():
    model = nn.ModuleDict(
        {
            "norm": _weight_norm(_mlp())[0],
            "spectral": torch.nn.utils.spectral_norm(nn.Linear(3, 3)),
            "pruned": torch.nn.utils.prune.l1_unstructured(nn.Linear(3, 3), "weight", 0.5),
            "standardised": Standardised(2, 3, 3),
            "plain": nn.Conv2d(2, 3, 3),
        }
    )
    plan = plan_sources(model, groups_available=False, fallback=False)
    assert set(plan.per_example) == {"plain"}
    assert (
        "weight_norm" in plan.uncovered["norm.weight_g"] and "spectral_norm" in plan.uncovered["spectral.weight_orig"]
    )
    assert "pruning" in plan.uncovered["pruned.weight_orig"]
    assert "no per-example identity" in plan.uncovered["standardised.weight"]


def test_the_sums_of_an_exact_rule_add_up_to_the_gradient_over_micro_batches():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(7, 4), nn.LayerNorm(4), nn.Linear(4, 2), nn.Tanh(), nn.Linear(2, 1)).double()
    plan = plan_sources(model, groups_available=False, fallback=False)
    collector = PerExampleGradients(plan.per_example, {}, 2)
    collector.attach(coordinates=True)
    model.zero_grad()
    for _ in range(2):  # accumulating: .grad = ½ the batch mean of each micro-batch
        collector.begin_micro_batch()
        (model(torch.randint(0, 7, (B, 3))).square().mean() / 2).backward()
        collector.end_micro_batch(2.0 * B)
    step = collector.pop()
    assert not step.failed and collector.unbalanced(step, 1.0 / (2 * B)) == {}
    assert collector.unbalanced(step, 1.01 / (2 * B)).keys() == set(plan.per_example)


@pytest.mark.parametrize("frozen", [True, False], ids=["a frozen parameter", "a parameter missed"])
def test_a_function_rule_whose_parameters_are_not_the_modules_is_named(frozen):
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale, self.shift = nn.Parameter(torch.ones(3)), nn.Parameter(torch.zeros(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale + self.shift

    @register_per_example_rule(Scale)
    def scale_grads(module, inputs, grad_output):
        grads = {"scale": inputs * grad_output}
        return {**grads, "shift": grad_output} if frozen else grads

    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(2, 3), Scale()).double()
        if frozen:
            model[1].shift.requires_grad_(False)
        x = torch.randn(B, 2, dtype=torch.float64)
        _, step = collect(model, lambda m: m(x).square().mean())
        assert set(step.failed) == {"1"} and "trainable parameters are" in step.failed["1"]
    finally:
        unregister_per_example_rule(Scale)


class CheckpointedTwice(nn.Module):
    """``shared`` called outside a reentrant checkpoint and inside it, or one block in three segments."""

    def __init__(self, segments: bool) -> None:
        super().__init__()
        self.segments = segments
        self.norm, self.shared, self.out = nn.LayerNorm(6), nn.Linear(6, 6), nn.Linear(6, 2)

    def block(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.shared(self.norm(h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x if self.segments else torch.tanh(self.shared(x))
        for _ in range(3 if self.segments else 1):
            h = h + torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=True)
        return self.out(h.mean(1))


def per_example_sq_norms(model: nn.Module, x: torch.Tensor, loss_of) -> torch.Tensor:
    """‖g_i‖² over every trainable parameter, one backward per example."""
    rows = []
    for i in range(len(x)):
        model.zero_grad()
        loss_of(model, x[i : i + 1]).backward()
        rows.append(sum(p.grad.square().sum() for p in model.parameters()))
    return torch.stack(rows)


def test_a_layer_called_inside_and_before_a_reentrant_checkpoint_is_measured_from_both_calls():
    torch.manual_seed(0)
    model = CheckpointedTwice(segments=False).double()
    x = torch.randn(B, 5, 6, dtype=torch.float64, requires_grad=True)

    def loss_of(m, x):
        return m(x).square().sum()

    _, step = collect(model, lambda m: loss_of(m, x) / B)
    assert not step.failed
    torch.testing.assert_close(step.sq_norms[0], per_example_sq_norms(model, x, loss_of), rtol=1e-9, atol=0)


def test_a_layer_in_several_reentrant_checkpointed_segments_is_named_not_measured():
    torch.manual_seed(0)
    model = CheckpointedTwice(segments=True).double()
    x = torch.randn(B, 5, 6, dtype=torch.float64, requires_grad=True)
    _, step = collect(model, lambda m: m(x).square().mean())
    assert set(step.failed) == {"norm", "shared"} and "several checkpointed segments" in step.failed["shared"]


class Positions(nn.Module):
    """Token and position tables; ``use`` says what the forward does with the position table's output."""

    def __init__(self, use: str) -> None:
        super().__init__()
        self.use = use
        self.tok, self.pos, self.head = nn.Embedding(9, 4), nn.Embedding(B, 4), nn.Linear(4, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, t = tokens.shape
        if self.use == "arange":  # nanoGPT: wpe(torch.arange(T)), here with T = B
            pos = self.pos(torch.arange(t))
        else:
            pos = self.pos(torch.arange(t).unsqueeze(0))  # HF: (1, T) position ids
            if self.use == "view":
                pos = pos.view(t, 4)
            elif self.use == "repeat":
                pos = pos.repeat(b, 1, 1)
            elif self.use == "in-place":
                pos = pos.mul_(2.0)
        return self.head(torch.tanh(self.tok(tokens) + pos)).mean(1)


@pytest.mark.parametrize("use", ["broadcast", "view", "repeat", "in-place", "arange"])
def test_a_lookup_shared_by_the_batch_is_named_and_its_output_left_as_it_is(use):
    torch.manual_seed(0)
    model = Positions(use).double()
    tokens = torch.randint(0, 9, (B, B))
    expected = model(tokens)
    plan = plan_sources(model, groups_available=False, fallback=False)
    collector = PerExampleGradients(plan.per_example, {}, 2)
    collector.attach(coordinates=True)
    collector.expect_batch(B)
    out = model(tokens)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.square().mean().backward()
    collector.end_micro_batch(float(B))
    step = collector.pop()
    assert set(step.failed) == {"pos"} and "shared by the batch" in step.failed["pos"]
    assert step.seen == {"tok", "head"} and collector.unbalanced(step, 1.0 / B) == {}


class Lookup(nn.Module):
    """A recommender's item table, looked up with one id per example: ``(B,)`` integer ids."""

    def __init__(self) -> None:
        super().__init__()
        self.items, self.head = nn.Embedding(9, 3), nn.Linear(3, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.items(ids)))


@pytest.mark.parametrize("ids", [[3, 7, 3, 1], list(range(B))])
def test_per_example_ids_are_compared_with_arange_without_a_host_read_until_decided(monkeypatch, ids):
    """1-D ids of B integers are told from ``arange(B)`` on the device: nothing reads the host in the hooks
    or at ``pop(decide=False)``; ``decide`` then fails a lookup of ``arange(B)`` as its forward did before,
    and the statistics are the brute force's over what is measured."""
    torch.manual_seed(0)
    model, x = Lookup().double(), torch.tensor(ids)
    collector = PerExampleGradients(plan_sources(model, groups_available=False, fallback=False).per_example, {}, 2)
    collector.attach(coordinates=True, keep_norms=True)
    host = HostReads(monkeypatch)
    host.watching = "collector"
    for _ in range(2):  # two micro-batches of one step
        collector.begin_micro_batch()
        collector.expect_batch(B)
        model(x).square().mean().backward()
        collector.end_micro_batch(float(B))
    step = collector.pop(decide=False)
    monkeypatch.undo()
    assert host.reads == [] and set(step.undecided) == {"items"}

    collector.decide(step)
    shared = ids == list(range(B))
    assert not step.undecided and set(step.failed) == ({"items"} if shared else set())
    assert not shared or "shared by the batch" in step.failed["items"]
    assert step.seen == ({"head"} if shared else {"items", "head"})
    measured = {n: p for n, p in model.named_parameters() if not (shared and n.startswith("items"))}
    assert set(step.grad_sum) == set(measured)
    per_example = []
    for i in range(B):  # each example's own loss out_i²
        model.zero_grad()
        model(x[i : i + 1]).square().sum().backward()
        per_example.append(torch.cat([p.grad.flatten() for p in measured.values()]))
    flat = torch.stack(per_example)
    for sq in step.sq_norms:
        torch.testing.assert_close(sq, flat.square().sum(1), rtol=1e-9, atol=0)
    offsets = [0, *torch.tensor([p.numel() for p in measured.values()]).cumsum(0).tolist()]
    for name, start, end in zip(measured, offsets, offsets[1:]):
        torch.testing.assert_close(step.grad_sum[name].flatten(), 2 * flat[:, start:end].sum(0), rtol=1e-9, atol=1e-12)


class Gated(nn.Module):
    """``gate`` called positionally, or by keyword (which its rule cannot read), as ``keyword`` says."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.head = nn.Linear(3, 3), nn.Linear(3, 1)
        self.keyword = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.gate(input=x) if self.keyword else self.gate(x)))


@pytest.mark.parametrize(
    ("case", "aside"),
    [
        ("arange in both", {"items"}),
        ("arange in the second", set()),  # its first micro-batch counted
        ("keyword in both", {"gate"}),
        ("keyword in the second", set()),
    ],
)
def test_a_failed_layer_is_set_aside_only_when_none_of_its_statistics_were_counted(case, aside):
    """Over a step's two micro-batches: a layer that failed before its rule ran in every one leaves the sums
    exactly the other layers' (those of a per-example loop over them); one that failed after a micro-batch was
    counted cannot be taken out of them."""
    torch.manual_seed(0)
    lookup = "arange" in case
    model, failing = (Lookup(), "items") if lookup else (Gated(), "gate")
    model = model.double()
    first = torch.arange(B) if case == "arange in both" else torch.tensor([3, 7, 3, 1])
    inputs = [first, torch.arange(B)] if lookup else [torch.randn(B, 3, dtype=torch.float64)] * 2
    collector = PerExampleGradients(plan_sources(model, groups_available=False, fallback=False).per_example, {}, 2)
    collector.attach(keep_norms=True)
    for k, x in enumerate(inputs):
        model.keyword = not lookup and (case == "keyword in both" or k == 1)
        collector.begin_micro_batch()
        collector.expect_batch(B)
        model(x).square().mean().backward()
        collector.end_micro_batch(float(B))
    step = collector.pop()
    assert set(step.failed) == {failing} and collector.set_aside(step) == aside
    for x, sq in zip(inputs, step.sq_norms if aside else []):
        truth = []
        for i in range(B):  # each example's own loss out_i², over the other layers
            model.zero_grad()
            model(x[i : i + 1]).square().sum().backward()
            truth.append(sum(p.grad.square().sum() for n, p in model.named_parameters() if not n.startswith(failing)))
        torch.testing.assert_close(sq, torch.stack(truth), rtol=1e-9, atol=0)


def test_a_fallback_layer_with_a_tuple_output_is_named_for_that():
    """nn.LSTMCell in a loop: its ``(h, c)`` output was skipped unsaid, then blamed on gradients "outside
    its own forward"."""

    class Cell(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cell, self.out = nn.LSTMCell(3, 4), nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = c = x.new_zeros(x.shape[0], 4)
            for t in range(x.shape[1]):
                h, c = self.cell(x[:, t], (h, c))
            return self.out(h)

    torch.manual_seed(0)
    model = Cell().double()
    plan = plan_sources(model, groups_available=False, fallback=True)
    assert set(plan.vmap) == {"cell"}
    collector = PerExampleGradients(plan.per_example, plan.vmap, 2)
    collector.attach()
    model(torch.randn(B, 3, 3, dtype=torch.float64)).square().mean().backward()
    collector.end_micro_batch(float(B))
    step = collector.pop()
    assert set(step.failed) == {"cell"} and "its output is a tuple" in step.failed["cell"]


def test_under_bf16_autocast_a_tied_layer_is_not_taken_for_one_that_does_not_add_up():
    """The tied token table's own operands are float32 (Embedding is not autocast), its output layer's
    bf16: its .grad is rounded as the half-precision part is."""
    from zoo import GPT, VOCAB

    torch.manual_seed(0)
    model = GPT()
    tokens = torch.randint(0, VOCAB, (B, 6))
    plan = plan_sources(model, groups_available=False, fallback=False)
    collector = PerExampleGradients(plan.per_example, {}, 2)
    collector.attach(coordinates=True)
    collector.expect_batch(B)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens.roll(-1, 1).flatten())
    collector.before_backward(loss)  # the position table too, where its add broadcasts it
    loss.backward()
    collector.end_micro_batch(float(B))
    step = collector.pop()
    assert step.failed == {} and collector.unbalanced(step, 1.0 / B) == {}


def test_the_check_compares_the_rows_summed_under_a_coordinate_budget():
    torch.manual_seed(0)
    model = DirectWeight().double()
    plan = plan_sources(model, groups_available=False, fallback=False)
    collector = PerExampleGradients(plan.per_example, {}, 2)
    x = torch.randn(B, 3, dtype=torch.float64)
    for rows, expected in (({"proj.weight": slice(1, 3)}, {"proj"}), ({"out.weight": slice(0, 1)}, set())):
        collector.attach(coordinates=rows)
        model.zero_grad()
        model(x).square().mean().backward()
        collector.end_micro_batch(float(B))
        step = collector.pop()
        assert set(collector.unbalanced(step, 1.0 / B)) == expected
