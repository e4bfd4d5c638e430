"""extra_forward: trainvitals' own forwards, marked for the hooks that observe the user's steps and run eagerly."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from _models import Regressor
from torch import nn

from trainvitals.plumbing.extra_forward import extra_forward, in_extra_forward
from trainvitals.plumbing.rerun import rerun_quietly


def test_the_mark_nests_and_is_cleared_on_the_way_out_of_an_error():
    assert not in_extra_forward()
    with extra_forward():
        with extra_forward():
            assert in_extra_forward()
        assert in_extra_forward()
    assert not in_extra_forward()
    with pytest.raises(ValueError), extra_forward():
        raise ValueError("a step that fails inside")
    assert not in_extra_forward()


def test_rerun_quietly_runs_its_code_as_an_extra_forward():
    module = Regressor()
    with rerun_quietly(module):
        assert in_extra_forward()
    assert not in_extra_forward()


def test_a_compiled_model_runs_eagerly_inside_and_compiles_nothing():
    """Another batch size, eval mode and no_grad: each would fail a guard of the graph compiled for the step and
    compile one more. Inside, none is compiled; the step's own call then compiles its one graph, and reuses it."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    model = torch.compile(eager, backend="aot_eager")
    x = torch.randn(5, 3)
    with extra_forward(), torch.no_grad():
        model.eval()
        doubled = model(torch.cat([x, x]))
        model.train()
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] == 0
    assert torch.equal(doubled, torch.cat([eager(x), eager(x)]).detach())
    model(x).sum().backward()
    model(x)
    assert counters["stats"]["unique_graphs"] == 1
