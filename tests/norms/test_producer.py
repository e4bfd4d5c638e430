"""The producer of a NaN: the module that made it, not the ones that carried it, against detect_anomaly."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from _models import Clamp, Log
from torch import nn

from trainvitals.norms.producer import (
    Producer,
    find_producer,
    find_producer_by_anomaly,
    nonfinite_tensors,
    optimizer_state_tensors,
)


def five_layers(clamp: bool) -> nn.Sequential:
    """Linear → ReLU → log → (clamp | Linear) → Linear: the log of a ReLU output that is 0 is -inf."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), Log(), Clamp() if clamp else nn.Linear(8, 8), nn.Linear(8, 1))


def _mse(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), torch.zeros(len(x), 1))


def _anomaly(model: nn.Module, x: torch.Tensor) -> tuple[str, str]:
    """``detect_anomaly``'s answer: the backward node it stopped at, and the forward traceback it printed."""
    with warnings.catch_warnings(record=True) as caught, torch.autograd.detect_anomaly():
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="returned nan values") as error:
            _mse(model, x).backward()
    node = str(error.value).split("'")[1]
    return node, "\n".join(str(w.message) for w in caught)


def test_the_log_layer_is_named_not_the_layers_after_it():
    model = five_layers(clamp=False)
    x = torch.randn(16, 4)
    producer = find_producer(model, lambda: _mse(model, x))
    assert producer.where == "forward" and producer.module == "2" and producer.op == "LogBackward0"
    assert producer.value == "-inf" and producer.input_range[0] == 0.0  # its input reached 0
    assert "`2`" in producer.describe() and "`3`" not in producer.describe()


def test_the_answer_agrees_with_detect_anomaly_on_the_same_batch():
    model = five_layers(clamp=True)
    x = torch.randn(16, 4)
    assert torch.isfinite(_mse(model, x))  # the clamp hides the -inf from the loss; the gradient is NaN
    producer = find_producer(model, lambda: _mse(model, x))
    node, traceback = _anomaly(model, x)
    assert node == producer.op == "LogBackward0"
    assert "torch.log(x)" in traceback and producer.module == "2"


class NanBackward(torch.autograd.Function):
    """Identity forward; a NaN gradient backward (a finite forward that goes wrong only in backward)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class BadBackward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return NanBackward.apply(x)


def test_a_nan_made_in_backward_names_the_module_whose_input_gradient_turned():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Sequential(BadBackward()), nn.Linear(8, 8), nn.Linear(8, 1))
    x = torch.randn(16, 4)
    producer = find_producer(model, lambda: _mse(model, x))
    assert producer.where == "backward" and producer.module == "2.0" and producer.value == "nan"
    assert all(p.grad is None for p in model.parameters())  # the search leaves .grad alone
    node, _ = _anomaly(model, x)
    assert node == "NanBackwardBackward" and producer.op == node


def test_a_loss_that_turns_alone_and_a_clean_step():
    model = nn.Sequential(nn.Linear(4, 1))
    x = torch.randn(8, 4)
    assert find_producer(model, lambda: torch.log(model(x).sum() * 0.0)) == Producer("loss", "")
    assert find_producer(model, lambda: _mse(model, x)) is None
    # A finite loss whose own backward turns: sqrt(0) is 0, its derivative 1/(2√0) inf, made outside every module.
    made = find_producer(model, lambda: torch.sqrt((model(x) * 0.0).pow(2).sum()))
    assert (made.where, made.op, made.value) == ("loss", "SqrtBackward0", "inf") and "SqrtBackward0" in made.describe()


def test_a_module_run_under_no_grad_does_not_stop_the_search():
    """A frozen module called under ``torch.no_grad`` (a teacher, a target network): its call is bracketed too."""

    class WithTeacher(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.teacher = nn.Linear(4, 4)
            self.student = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Sequential(BadBackward()), nn.Linear(8, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                target = self.teacher(x)
            return self.student(x) + target.sum(1, keepdim=True) * 0.0

    model = WithTeacher()
    x = torch.randn(16, 4)
    producer = find_producer(model, lambda: _mse(model, x))
    assert (producer.where, producer.module, producer.op) == ("backward", "student.2.0", "NanBackwardBackward")


def test_nothing_stays_installed_even_when_the_forward_fails():
    model = five_layers(clamp=False)

    def fails():
        model(torch.randn(2, 4))
        raise ValueError("boom")

    with pytest.raises(ValueError):
        find_producer(model, fails)
    find_producer(model, lambda: _mse(model, torch.randn(2, 4)))
    assert all(not m._forward_hooks for m in model.modules())


def test_the_anomaly_search_agrees_with_the_flags_and_with_detect_anomaly_itself():
    model = five_layers(clamp=True)
    x = torch.randn(16, 4)
    flags = find_producer(model, lambda: _mse(model, x))
    anomaly = find_producer_by_anomaly(model, lambda: _mse(model, x))
    assert all(p.grad is None for p in model.parameters())  # the search leaves .grad alone
    node, traceback = _anomaly(model, x)
    assert (anomaly.module, anomaly.op, anomaly.input_range) == (flags.module, flags.op, flags.input_range)
    assert anomaly.where == "backward" and anomaly.value == "nan" and anomaly.found_by == "anomaly"
    assert node == anomaly.op and "torch.log(x)" in traceback
    assert "`2`" in anomaly.describe() and "detect_anomaly" in anomaly.describe()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_the_anomaly_search_tells_two_instances_of_one_layer_apart():
    """Two identical log layers called from one line of Sequential.forward (the same forward traceback): the
    second one's input reaches 0, and the search names it, not the first."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Softplus(), Log(), nn.ReLU(), Log(), Clamp(), nn.Linear(8, 1))
    x = torch.randn(16, 4)
    assert find_producer(model, lambda: _mse(model, x)).module == "4"
    assert find_producer_by_anomaly(model, lambda: _mse(model, x)).module == "4"


def test_the_anomaly_search_names_a_backward_nan_and_the_loss_and_sees_only_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Sequential(BadBackward()), nn.Linear(8, 8), nn.Linear(8, 1))
    x = torch.randn(16, 4)
    found = find_producer_by_anomaly(model, lambda: _mse(model, x))
    assert (found.where, found.module, found.op) == ("backward", "2.0", "NanBackwardBackward")
    clean = nn.Sequential(nn.Linear(4, 1))
    assert find_producer_by_anomaly(clean, lambda: _mse(clean, x)) is None
    nan_loss = find_producer_by_anomaly(clean, lambda: _mse(clean, x) * float("nan"))
    assert (nan_loss.where, nan_loss.op) == ("loss", "MulBackward0")
    # A forward -inf that reaches the loss: anomaly mode checks gradients, so it stops at the loss's node,
    # where the flags search names the log.
    model = five_layers(clamp=False)
    assert find_producer(model, lambda: _mse(model, x)).module == "2"
    assert find_producer_by_anomaly(model, lambda: _mse(model, x)).where == "loss"


def test_nonfinite_parameters_and_optimizer_state_are_named():
    model = nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 2)).sum().backward()
    opt.step()
    names = {p: n for n, p in model.named_parameters()}
    opt.state[model.bias]["exp_avg_sq"].fill_(float("nan"))
    assert nonfinite_tensors(model.named_parameters()) == []
    assert nonfinite_tensors(optimizer_state_tensors(opt, names)) == ["bias exp_avg_sq"]
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    assert nonfinite_tensors(model.named_parameters()) == ["weight"]
