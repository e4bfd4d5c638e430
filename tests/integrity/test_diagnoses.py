"""core.integrity on plain modules, optimizers and autograd errors: streaks, reasons, causes, diagnoses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainvitals.integrity.diagnoses import (
    GradientStreaks,
    describe_stale_graph,
    diagnose_inplace,
    diagnose_no_grad,
    diagnose_second_backward,
    frozen_change_causes,
    listed,
    stepped_parameter,
    unreached_reasons,
    why_no_grad,
)
from trainvitals.integrity.graph import InplaceInfo, sequence_mark, tensor_names, walk_graph
from trainvitals.integrity.tracer import GraphTracer

X = torch.randn(5, 3)


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 4), nn.Sigmoid(), nn.Linear(4, 2))


def raise_boom():
    raise ValueError("boom")


def test_listed_quotes_five_names_and_counts_the_rest():
    assert listed(["a", "b"]) == "`a`, `b`"
    assert listed([str(i) for i in range(7)]) == "`0`, `1`, `2`, `3`, `4` and 2 more"
    assert listed(()) == ""


# -------------------------------------------------------------------------------- gradient streaks


def param(grad: float | None, trainable: bool = True) -> nn.Parameter:
    p = nn.Parameter(torch.ones(2), requires_grad=trainable)
    p.grad = None if grad is None else torch.full((2,), grad)
    return p


def test_streaks_tell_unused_from_dead_and_skip_frozen_and_live_parameters():
    params = [("live", param(0.5)), ("unused", param(None)), ("dead", param(0.0)), ("frozen", param(None, False))]
    streaks = GradientStreaks()
    for _ in range(3):
        streaks.update(0, params)
    assert streaks.unused == {"live": 0, "unused": 3, "dead": 0, "frozen": 0}
    assert streaks.dead == {"live": 0, "unused": 0, "dead": 3, "frozen": 0}
    assert streaks.at_least(3) == (("unused",), ("dead",))
    assert streaks.at_least(4) == ((), ())


def test_a_gradient_non_zero_once_ends_the_dead_streak_until_clear():
    p = param(1.0)
    streaks = GradientStreaks()
    streaks.update(0, [("p", p)])
    p.grad.zero_()
    streaks.update(0, [("p", p)])
    streaks.update(0, [("p", p)])
    assert streaks.dead == {"p": 0}  # zero at the last two checks, but not at every check since the clear
    streaks.clear()
    assert streaks.unused == {} and streaks.dead == {}
    for _ in range(2):
        streaks.update(0, [("p", p)])
    assert streaks.dead == {"p": 2}


def test_streaks_of_two_optimizers_are_kept_apart():
    a, b = param(1.0), param(0.0)
    streaks = GradientStreaks()
    streaks.update(0, [("a", a)])  # optimizer 0 saw a non-zero `a`
    a.grad.zero_()
    streaks.update(1, [("a", a), ("b", b)])  # optimizer 1's first check reads every gradient it holds
    assert streaks.dead == {"a": 1, "b": 1}


def test_streaks_survive_a_state_dict_and_read_every_gradient_after_a_load():
    was_live, dead = param(1.0), param(0.0)
    streaks = GradientStreaks()
    streaks.update(0, [("was_live", was_live), ("dead", dead)])
    streaks.update(0, [("was_live", was_live), ("dead", dead)])
    state = streaks.state_dict()
    assert state == {"unused_streak": {"was_live": 0, "dead": 0}, "dead_streak": {"was_live": 0, "dead": 2}}
    restored = GradientStreaks()
    restored.load_state_dict(state)
    was_live.grad.zero_()
    restored.update(0, [("was_live", was_live), ("dead", dead)])
    assert restored.dead == {"was_live": 1, "dead": 3}
    assert GradientStreaks().state_dict() == {"unused_streak": {}, "dead_streak": {}}


# ------------------------------------------------------------------------------- unreached reasons


class Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(3, 3)
        self.head = nn.Linear(3, 1)  # never called
        self.teacher = nn.Linear(3, 3)  # called under no_grad
        self.side = nn.Linear(3, 3)  # called, output detached
        self.scale = nn.Parameter(torch.ones(()))  # the root's, never used
        self.layers = [nn.Linear(3, 3)]  # a plain list: not a submodule
        self.compiled = torch.compile(nn.Linear(3, 3))  # never called

    def forward(self, x):
        with torch.no_grad():
            target = self.teacher(x)
        return self.used(x).sum() + self.side(x).detach().sum() + target.sum()


def test_unreached_reasons_say_why_of_each_module():
    model = Branches()
    ran: dict[int, bool] = {}

    def note(module, *_):
        ran[id(module)] = ran.get(id(module), False) or torch.is_grad_enabled()

    hook = nn.modules.module.register_module_forward_hook(note)
    try:
        loss = model(X)
    finally:
        hook.remove()
    names = tensor_names(model)
    reached = {id(t) for t in walk_graph(loss).leaves}
    unreached = [n for i, n in names.items() if i not in reached]
    reasons = unreached_reasons(model, unreached, ran)
    assert set(reasons) == set(unreached)
    assert reasons["head.weight"] == "module `head` never ran in forward (an unused head or branch?)"
    assert reasons["teacher.weight"] == "module `teacher` ran only with grad mode off (inside `torch.no_grad()`)"
    assert reasons["side.bias"] == "module `side` ran, but its output was detached or did not reach the loss"
    assert reasons["scale"] == "`scale` are not used by the loss"
    assert reasons["layers[0].weight"] == "`layers[0].weight`, `layers[0].bias` are not used by the loss"
    assert reasons["compiled._orig_mod.weight"] == (
        "module `compiled._orig_mod`, inside a torch.compile'd module, did not reach the loss"
    )
    assert "used.weight" not in reasons


# ------------------------------------------------------------------------------------ frozen causes


def test_frozen_change_causes_name_the_grad_the_state_and_the_decay():
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=0.01)
    p.grad = torch.ones(2)
    opt.step()
    p.requires_grad_(False)  # frozen, but it keeps its .grad and its momentum
    before = p.detach().clone()
    opt.step()
    assert not torch.equal(p, before)  # the optimizer did change it
    assert frozen_change_causes(p, opt) == [
        "it still holds a `.grad` (left from before it was frozen, or kept as zeros by "
        "`zero_grad(set_to_none=False)`), so the optimizer does not skip it",
        "its optimizer state (momentum_buffer) keeps moving it",
        "weight decay 0.01 shrinks it",
    ]


def test_frozen_change_causes_leave_out_the_step_count_and_read_the_parameters_group():
    p, other = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([{"params": [other]}, {"params": [p], "weight_decay": 0.5}])
    p.grad = torch.ones(2)
    opt.step()
    p.grad = None
    assert frozen_change_causes(p, opt) == [
        "its optimizer state (exp_avg, exp_avg_sq) keeps moving it",
        "weight decay 0.5 shrinks it",
    ]
    assert frozen_change_causes(other, opt) == ["the optimizer updates parameters regardless of requires_grad"]


# ------------------------------------------------------------------------------------- stale graph


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.Linear(2, 2)
        self.hidden = torch.zeros(1, 2)


def carried(model: Recurrent) -> tuple[tuple, int | None]:
    model.hidden = torch.tanh(model.cell(model.hidden))  # the previous step
    mark = sequence_mark()
    model.hidden = torch.tanh(model.cell(model.hidden))  # this step, built on the last one's graph
    return walk_graph(model.hidden.sum(), mark).stale, mark


def test_stale_graph_is_named_by_the_attribute_that_carries_it():
    model = Recurrent()
    stale, mark = carried(model)
    names, message = describe_stale_graph(model, stale, mark)
    assert names == ("hidden",)
    assert message.startswith("The loss reaches 1 autograd node(s) created in an earlier step (`TanhBackward0`)")
    assert "carried across steps in `hidden`" in message and "(`self.hidden = hidden.detach()`)" in message


def test_stale_graph_held_outside_the_module_is_named_by_its_nodes():
    model = Recurrent()
    stale, mark = carried(model)
    model.hidden = model.hidden.detach()  # the module no longer holds it; the caller does
    names, message = describe_stale_graph(model, stale, mark)
    assert names == ("TanhBackward0",)
    assert "outside the module's attributes" in message and message.endswith("(`.detach()`).")


# ---------------------------------------------------------------------------------- no grad_fn


def test_why_no_grad_checks_the_cheap_explanations_before_the_rerun():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    leaf = torch.tensor(model(X).sum().item(), requires_grad=True)
    assert why_no_grad(leaf, model, [opt], raise_boom)[0] == ("leaf loss",)
    with torch.no_grad():
        names, why = why_no_grad(model(X).sum(), model, [opt], raise_boom)
    assert names == ("grad mode off", "SGD") and "(optimizers: SGD)" in why
    model.requires_grad_(False)
    assert why_no_grad(model(X).sum(), model, [opt], raise_boom)[0] == ("every parameter frozen",)


def test_why_no_grad_names_the_cut_from_the_rerun():
    model = mlp()
    detached = model(X).sum().detach()

    def rerun():
        with GraphTracer(model) as tracer:
            loss = model(X).sum().detach()
        return tracer, loss

    names, why = why_no_grad(detached, model, [], rerun)
    assert names[0] == "detach" and names[-1].startswith("test_diagnoses.py:")
    assert why.startswith("it was rebuilt from `.detach()`")
    names, why = why_no_grad(detached, model, [], raise_boom)
    assert (names, why) == ((), "the re-run to locate the cut failed (ValueError: boom)")
    names, why = why_no_grad(detached, model, [])
    assert names == () and why.startswith("it was rebuilt from `.item()`/`.detach()` or computed inside")


def test_diagnose_no_grad():
    model = mlp()
    outside = "backward was called on a tensor without grad_fn outside Lightning's backward hooks."
    assert diagnose_no_grad(None, model, []) == ((), outside)
    assert diagnose_no_grad(model(X).sum(), model, []) == ((), outside)  # this loss was fine
    names, message = diagnose_no_grad(torch.tensor(1.0, requires_grad=True), model, [])
    assert names == ("leaf loss",) and message.startswith("The loss has no grad_fn: it is a leaf tensor")
    assert message.endswith(".")


# ---------------------------------------------------------------------------------- second backward


def test_a_loss_back_propagated_twice():
    model = mlp()
    loss = model(X).sum()
    loss.backward()
    names, message = diagnose_second_backward(loss, [loss.grad_fn], model, tensor_names(model), None)
    assert names == () and message.startswith("The same loss was back-propagated twice in this step")
    assert diagnose_second_backward(None, [], model, {}, None)[1].startswith("a backward outside Lightning's hooks")


@pytest.mark.parametrize("detach_fake", [False, True])
def test_a_graph_shared_with_an_earlier_loss_is_named_where_it_enters(detach_fake):
    gan = nn.ModuleDict({"gen": nn.Sequential(nn.Linear(2, 3), nn.Tanh()), "disc": nn.Linear(3, 1)})
    fake = gan["gen"](torch.randn(4, 2))
    d_loss = gan["disc"](fake.detach() if detach_fake else fake).mean()
    d_loss.backward()
    g_loss = -gan["disc"](fake).mean()
    names, message = diagnose_second_backward(g_loss, [d_loss.grad_fn], gan, tensor_names(gan), None)
    if detach_fake:  # nothing shared: this pair is not the cause
        assert names == () and message.startswith("The graph was freed by a backward outside Lightning's hooks")
        assert "remove that call" in message  # not retain_graph=True, which would double the gradients
        return
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        g_loss.backward()
    assert names == ("gen.0",)
    # The generator's tanh, its addmm and the transpose of its weight; the leaves are not counted.
    assert message.startswith("This loss shares 3 autograd node(s) with a loss back-propagated earlier")
    assert "(they enter at `TanhBackward0`, near module `gen.0`)" in message and "`fake.detach()`" in message


def test_second_backward_through_an_earlier_steps_graph_names_the_carried_state():
    model = Recurrent()
    _, mark = carried(model)
    loss = model.hidden.sum()
    names, message = diagnose_second_backward(loss, [], model, tensor_names(model), mark)
    assert names == ("hidden",) and "created in an earlier step" in message


# ------------------------------------------------------------------------------------------ in place


def test_stepped_parameter_needs_a_view_the_version_and_the_shape_and_prefers_the_nearest():
    a, b, c = (nn.Parameter(torch.ones(4, 3)) for _ in range(3))
    with torch.no_grad():
        for p in (a, b, c):
            p.add_(1)  # version 1, like one optimizer step
    stepped = [(a, "optimizer 0 (SGD)"), (b, "optimizer 1 (Adam)")]
    info = InplaceInfo((3, 4), version=1, expected=0, producer="AsStrided")
    assert stepped_parameter(info, [], stepped) == (a, "optimizer 0 (SGD)")
    assert stepped_parameter(info, [c, b], stepped) == (b, "optimizer 1 (Adam)")  # c did not step
    assert stepped_parameter(InplaceInfo((3, 4), 2, 1, "AsStrided"), [], stepped) is None
    assert stepped_parameter(InplaceInfo((5, 4), 1, 0, "AsStrided"), [], stepped) is None
    assert stepped_parameter(InplaceInfo((3, 4), 1, 0, "Sigmoid"), [], stepped) is None
    assert stepped_parameter(None, [], stepped) is None


def inplace_error(loss: torch.Tensor) -> RuntimeError:
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
        loss.backward()
    return info.value


def test_an_optimizer_step_between_forward_and_backward_is_blamed_on_the_parameter():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(X).sum()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    error = inplace_error(loss)
    stepped = [(p, "optimizer 0 (SGD)") for p in model.parameters()]
    names, message = diagnose_inplace(error, loss, model, tensor_names(model), None, stepped)
    assert names == ("2.weight",)
    assert message == (
        "The tensor that AddmmBackward0 saved as `mat2` (near module `2`) is parameter `2.weight`: optimizer 0 "
        "(SGD).step() updated it in place after the forward that saved it and before this backward. Run every "
        "backward that needs this forward before optimizer.step(), or recompute the forward after the step."
    )
    # No optimizer stepped in this batch: the node is named, the step is not blamed.
    names, message = diagnose_inplace(error, loss, model, tensor_names(model), None, [])
    assert names == ()
    assert message.startswith(
        "The tensor that AddmmBackward0 saved as `mat2` (near module `2`) was modified in place after the forward"
    )


def test_a_carried_graph_is_blamed_only_for_what_it_saved():
    """The loss reaches state carried from an earlier step, but the tensor changed in place is this step's
    sigmoid output: that is the diagnosis. When the changed tensor is one the old graph saved, the state is."""

    class Carrier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head, self.state = nn.Linear(3, 4), nn.Linear(4, 1), None

    model = Carrier()
    model.state = model.body(X).tanh()  # an earlier step's graph, kept in `state`
    before = sequence_mark()
    h = torch.sigmoid(model.body(X))
    h.mul_(2)  # this step's bug: sigmoid saved its output
    loss = (model.head(h) + model.state.sum()).sum()
    names, message = diagnose_inplace(inplace_error(loss), loss, model, tensor_names(model), before, [])
    assert names == () and message.startswith("The tensor that SigmoidBackward0 saved as `result`")

    model.state = model.head(model.body(X).tanh())  # the old graph saved head.weight
    before = sequence_mark()
    with torch.no_grad():
        model.head.weight.add_(1.0)  # an optimizer step between the two steps
    loss = (model.head(torch.relu(model.body(X))) + model.state.square().sum()).sum()
    names, message = diagnose_inplace(inplace_error(loss), loss, model, tensor_names(model), before, [])
    assert names == ("state",)
    assert "belongs to a graph made in an earlier step" in message and "`self.state = state.detach()`" in message


def test_an_inplace_op_on_a_saved_tensor_is_named_from_the_rerun():
    model = nn.Sequential(nn.Linear(3, 4), nn.Sigmoid())

    def step():
        h = model(X)
        h.mul_(2)  # sigmoid saved its output
        return h.sum()

    def rerun():
        with GraphTracer(model) as tracer:
            loss = step()
        return tracer, loss

    loss = step()
    error = inplace_error(loss)
    stepped = [(p, "optimizer 0 (SGD)") for p in model.parameters()]
    names, message = diagnose_inplace(error, loss, model, tensor_names(model), None, stepped, rerun)
    assert names == ("1", "sigmoid", "mul_")
    assert message.startswith(
        "A tensor of shape [5, 4] saved for backward by `sigmoid` in module `1` at test_diagnoses.py:"
    )
    assert "modified in place by `mul_` at test_diagnoses.py:" in message
    names, message = diagnose_inplace(error, loss, model, tensor_names(model), None, stepped, raise_boom)
    assert names == () and message.endswith("was modified in place (re-run failed: boom).")
