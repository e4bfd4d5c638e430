"""core.graph on plain modules and tensors: walks, names, saved-tensor errors, the tracer, batch mixing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainvitals.integrity.graph import (
    AutogradError,
    all_zero,
    anomaly_location,
    attributes_reaching,
    batch_mixing,
    batchnorm_in_eval,
    classify_autograd_error,
    module_names,
    nearest_leaves,
    owner_module,
    parse_inplace_error,
    saved_tensor_errors,
    sequence_mark,
    tensor_names,
    user_location,
    walk_graph,
)
from trainvitals.integrity.tracer import Cut, GraphTracer, describe_cut


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 4), nn.Sigmoid(), nn.Linear(4, 2))


X = torch.randn(5, 3)


def names_of(tensors, names) -> set[str]:
    return {names[id(t)] for t in tensors}


# -------------------------------------------------------------------------------------------- walk


def test_walk_reaches_every_parameter_the_loss_uses_and_only_those():
    both = nn.ModuleDict({"used": mlp(), "unused": nn.Linear(3, 1)})
    walk = walk_graph(both["used"](X).sum())
    assert names_of(walk.leaves, tensor_names(both)) == {"used.0.weight", "used.0.bias", "used.2.weight", "used.2.bias"}
    assert walk.stale == ()


def test_walk_of_a_tensor_without_graph_is_empty():
    walk = walk_graph(torch.ones(()))
    assert walk.leaves == () and walk.stale == () and walk.nodes == frozenset()


def test_walk_stops_at_nodes_older_than_the_mark():
    model = mlp()
    hidden = torch.tanh(model[0](X))  # "the previous step"
    mark = sequence_mark()
    loss = (model[2](torch.sigmoid(model[0](X))) + hidden.sum()).sum()
    walk = walk_graph(loss, before=mark)
    assert [type(n).__name__ for n in walk.stale] == ["TanhBackward0"]
    # The leaves behind the stale node are not entered (model[0] is reached anyway, through this step).
    assert names_of(walk.leaves, tensor_names(model)) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert walk_graph(loss).stale == ()  # without a mark nothing is stale


def test_walk_sees_through_custom_functions():
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    lin = nn.Linear(3, 1)
    mark = sequence_mark()
    walk = walk_graph(Double.apply(lin(X)).sum(), before=mark)
    assert names_of(walk.leaves, tensor_names(lin)) == {"weight", "bias"} and walk.stale == ()


def test_nearest_leaves_and_owner_module():
    model = mlp()
    names = tensor_names(model)
    out = model(X)
    assert names_of(nearest_leaves(out.grad_fn), names) == {"2.bias"}
    assert owner_module("net.0.weight") == "net.0" and owner_module("scale") == ""


# ------------------------------------------------------------------------------------------ naming


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.registered = nn.Linear(2, 2)
        self.layers = [nn.Linear(2, 2)]
        self.table = {"proj": nn.Linear(2, 2)}
        self.raw = torch.zeros(2, requires_grad=True)
        self.state = None


def test_names_cover_plain_lists_dicts_and_attributes():
    h = Holder()
    names = tensor_names(h)
    assert names[id(h.registered.weight)] == "registered.weight"
    assert names[id(h.layers[0].weight)] == "layers[0].weight"
    assert names[id(h.table["proj"].bias)] == "table['proj'].bias"
    assert names[id(h.raw)] == "raw"
    assert module_names(h)[id(h.layers[0])] == "layers[0]"


def test_attributes_reaching_names_the_carried_state():
    h = Holder()
    h.state = torch.tanh(h.registered(torch.randn(1, 2)))  # last step's value
    mark = sequence_mark()
    new = h.registered(torch.randn(1, 2)) + h.state
    stale = set(walk_graph(new.sum(), before=mark).stale)
    h.state = new  # carried over, not detached
    assert attributes_reaching(h, stale, mark) == ["state"]
    h.state = new.detach()
    assert attributes_reaching(h, stale, mark) == []


# ------------------------------------------------------------------------------ saved-tensor errors


def test_freed_saved_tensors_are_found_and_a_fresh_graph_has_none():
    out = mlp()(X).sum()
    assert saved_tensor_errors(out) == []
    out.backward()
    errors = saved_tensor_errors(out)
    assert errors and {e.kind for e in errors} == {AutogradError.SECOND_BACKWARD}
    assert "result" in {e.saved for e in errors if type(e.node).__name__ == "SigmoidBackward0"}


def test_inplace_modified_saved_tensor_is_found_and_the_message_parsed():
    model = mlp()
    out = model(X).sum()
    with torch.no_grad():
        model[2].weight.add_(1)
    with pytest.raises(RuntimeError) as info:
        out.backward()
    assert classify_autograd_error(info.value) is AutogradError.INPLACE
    parsed = parse_inplace_error(str(info.value))
    assert parsed is not None and parsed.shape == (4, 2) and parsed.version == parsed.expected + 1
    assert parsed.producer == "AsStrided" and parsed.may_be_parameter  # Linear saves weight.t()
    h = torch.sigmoid(X.clone().requires_grad_())
    with pytest.raises(RuntimeError) as info:
        h.mul_(2).sum().backward()  # Sigmoid's output: computed, not a parameter
    assert not parse_inplace_error(str(info.value)).may_be_parameter
    (error,) = saved_tensor_errors(out)
    assert (type(error.node).__name__, error.saved, error.kind) == ("AddmmBackward0", "mat2", AutogradError.INPLACE)


def test_classify_ignores_other_errors():
    assert classify_autograd_error(ValueError(AutogradError.NO_GRAD.value)) is None
    assert classify_autograd_error(RuntimeError("CUDA out of memory")) is None
    assert parse_inplace_error("something else") is None


def test_anomaly_mode_records_the_forward_line():
    with torch.autograd.set_detect_anomaly(True, check_nan=False):
        out = torch.sigmoid(torch.randn(3, requires_grad=True))
    assert anomaly_location(out.grad_fn).startswith("test_graph.py:")
    assert anomaly_location(torch.sigmoid(torch.randn(3, requires_grad=True)).grad_fn) is None


def test_user_location_is_the_caller_outside_libraries():
    here = user_location()
    assert here.startswith("test_graph.py:")
    assert here.endswith(" in test_user_location_is_the_caller_outside_libraries")


# ------------------------------------------------------------------------------------------ tracer


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)

    def forward(self, x):
        return self.lin(x)


def traced(step):
    model = Tiny()
    with GraphTracer(model) as tracer:
        loss = step(model)
    return tracer, loss


@pytest.mark.parametrize(
    ("step", "cut", "op", "words"),
    [
        (lambda m: m(X).sum().detach() * 2, Cut.DETACH, "detach", "rebuilt from `.detach()`"),
        (lambda m: torch.tensor(m(X).sum().item()), Cut.ITEM, "item", "rebuilt from `.item()`"),
        (lambda m: m(X).argmax().float(), Cut.NON_DIFFERENTIABLE, "argmax", "non-differentiable op"),
    ],
)
def test_tracer_finds_the_cut_behind_the_loss(step, cut, op, words):
    tracer, loss = traced(step)
    cuts = tracer.cuts_behind(loss)
    assert cut in {e.cut for e in cuts}
    names, text = describe_cut(tracer, cuts)
    assert names[0] == op and words in text and names[-1].startswith("test_graph.py:")


def test_tracer_names_the_module_run_under_no_grad_and_where_no_grad_began():
    def step(model):
        with torch.no_grad():
            y = model(X)
        return F.mse_loss(y, torch.zeros_like(y))

    tracer, loss = traced(step)
    names, text = describe_cut(tracer, tracer.cuts_behind(loss))
    assert names[:2] == ("linear", "lin") and "torch.no_grad()" in text
    assert "entered at test_graph.py:" in text


def test_tracer_control_a_connected_loss_has_no_cut():
    tracer, loss = traced(lambda m: m(X).sum())
    assert loss.grad_fn is not None and tracer.cuts_behind(loss) == []
    assert tracer.inplace_after_save() == []


def test_tracer_pairs_a_saved_tensor_with_the_inplace_op_that_changed_it():
    model = nn.Sequential(nn.Linear(3, 4), nn.Sigmoid(), nn.ReLU(inplace=True))
    with GraphTracer(model) as tracer:
        model(X)
    ((saved, event),) = tracer.inplace_after_save((5, 4))
    assert (saved.op, saved.module, event.op, event.module, event.cut) == ("sigmoid", "1", "relu", "2", Cut.INPLACE)


def test_tracer_leaves_no_hooks_behind():
    model = Tiny()
    with GraphTracer(model):
        pass
    assert not nn.modules.module._global_forward_hooks and not nn.modules.module._global_forward_pre_hooks
    assert torch.overrides._get_current_function_mode() is None


# ------------------------------------------------------------------------------ batch independence


def test_batch_mixing_control_and_fault():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2), nn.Softmax(-1))
    assert batch_mixing(model, X) == {0: [], 4: []}
    mixed = batch_mixing(lambda t: model(t.t().reshape(5, 3)), X)
    assert mixed[0] and mixed[4]


def test_batchnorm_mixes_in_training_mode_and_is_switched_to_eval_for_the_check():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    assert batch_mixing(model, X)[0] == [1, 2, 3, 4]
    with batchnorm_in_eval(model) as switched:
        assert switched == ["1"] and batch_mixing(model, X) == {0: [], 4: []}
    assert model[1].training


@pytest.mark.parametrize(
    ("x", "forward", "match"),
    [
        (torch.arange(6).reshape(3, 2), lambda t: t, "floating point"),
        (torch.randn(1, 3), lambda t: t, "at least 2"),
        (torch.randn(4, 3), lambda t: t.sum(), "first dimension"),
    ],
)
def test_batch_mixing_rejects_what_it_cannot_check(x, forward, match):
    with pytest.raises(ValueError, match=match):
        batch_mixing(forward, x)


def test_all_zero_per_tensor_without_underflow():
    half, bf16 = torch.zeros(2, dtype=torch.half), torch.ones(1, dtype=torch.bfloat16)
    tensors = [torch.zeros(3), torch.full((2,), 1e-30), half, bf16]
    assert all_zero(tensors).tolist() == [True, False, True, False]
    assert all_zero([]).numel() == 0


def test_all_zero_reads_sparse_complex_and_empty_tensors():
    """aminmax has no sparse or complex kernel: a sparse or complex gradient crashed the fit."""
    cancelling = torch.sparse_coo_tensor([[0, 0]], [1.0, -1.0], (4,))  # duplicates that sum to zero
    sparse = [
        torch.zeros(4).to_sparse(),
        torch.tensor([0.0, 2.0, 0.0]).to_sparse(),
        cancelling,
        torch.eye(3).to_sparse_csr(),
        torch.zeros(2, 2).to_sparse_csr(),
    ]
    assert (
        all_zero(sparse).tolist()
        == [t.to_dense().eq(0).all().item() for t in sparse]
        == [True, False, True, False, True]
    )
    complex_ = [
        torch.zeros(3, dtype=torch.complex64),
        torch.tensor([0j, 1e-30j], dtype=torch.complex64),
        torch.tensor([0j, 2 + 0j]),
    ]
    assert all_zero(complex_).tolist() == [True, False, False]
    assert all_zero([torch.zeros(0), torch.ones(0, 3), torch.ones(1)]).tolist() == [True, True, False]
