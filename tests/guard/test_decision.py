"""TrainingGuard's torch-only core: the reduced reading, the event rule, the budget, the snapshot."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trainvitals.guard.decision import (
    NONFINITE,
    SPIKE,
    Budget,
    Reading,
    choose,
    classify,
    pack,
    unpack,
)
from trainvitals.guard.snapshot import Snapshot
from trainvitals.norms.spikes import SpikeDetector, UsualBatch, noise_weight


def _detectors(warmup: int = 2) -> tuple[SpikeDetector, SpikeDetector]:
    return SpikeDetector(5.0, 0.9, warmup), SpikeDetector(5.0, 0.9, warmup)


def test_rows_summed_over_ranks_give_the_mean_loss_the_common_norm_and_the_nonfinite_ranks():
    cpu = torch.device("cpu")
    sq_norm = torch.tensor(9.0)  # the same averaged gradient on every rank
    rows = [
        pack(torch.tensor(1.5), sq_norm, 0, 3, cpu),
        pack(torch.tensor(float("nan")), sq_norm, 1, 3, cpu),
        pack(torch.tensor(2.5), sq_norm, 2, 3, cpu),
    ]
    reading = unpack(torch.stack(rows).sum(0).tolist())
    assert math.isnan(reading.loss) and reading.grad_norm == pytest.approx(3.0)
    assert reading.nonfinite_ranks == (1,) and reading.has_loss and reading.world_size == 3
    finite = unpack((rows[0] + rows[2] + pack(torch.tensor(0.5), sq_norm, 1, 3, cpu)).tolist())
    assert finite.loss == pytest.approx((1.5 + 0.5 + 2.5) / 3) and finite.nonfinite_ranks == ()


def test_a_rank_without_loss_or_gradient_leaves_the_others_numbers():
    cpu = torch.device("cpu")
    row = pack(torch.tensor(4.0), torch.tensor(16.0), 0, 2, cpu) + pack(None, torch.tensor(16.0), 1, 2, cpu)
    reading = unpack(row.tolist())
    assert reading.loss == 4.0 and reading.grad_norm == pytest.approx(4.0)
    nothing = unpack(pack(None, None, 0, 1, cpu).tolist(), has_loss=False)
    assert not nothing.has_loss and nothing.grad_norm == 0.0 and math.isnan(nothing.loss)
    # A single process's row: the loss and ‖g‖² alone, the rest known on the host.
    bad = unpack(pack(torch.tensor(float("inf")), torch.tensor(4.0), 0, 1, cpu).tolist())
    assert bad.nonfinite_ranks == (0,) and bad.has_loss and bad.grad_norm == 2.0 and bad.world_size == 1


def test_nonfinite_comes_first_and_stays_out_of_the_averages():
    loss_spikes, norm_spikes = _detectors()
    for _ in range(3):
        assert classify(Reading(1.0, 2.0, ()), loss_spikes, norm_spikes) == (None, "")
    kind, seen = classify(Reading(float("nan"), 2.0, (1,), world_size=2), loss_spikes, norm_spikes)
    assert kind == NONFINITE and "loss" in seen and "rank(s) 1" in seen
    assert "rank" not in classify(Reading(float("nan"), 2.0, (0,)), loss_spikes, norm_spikes)[1]  # one process
    kind, seen = classify(Reading(1.0, float("inf"), ()), loss_spikes, norm_spikes)
    assert kind == NONFINITE and "gradient" in seen
    assert loss_spikes.count == norm_spikes.count == 3  # the non-finite values never entered an EMA


def test_a_spike_in_the_loss_or_in_the_norm_is_one_event():
    loss_spikes, norm_spikes = _detectors()
    for _ in range(5):
        classify(Reading(1.0, 2.0, ()), loss_spikes, norm_spikes)
    kind, seen = classify(Reading(6.0, 2.0, ()), loss_spikes, norm_spikes)
    assert kind == SPIKE and "loss 6" in seen and "‖g‖" not in seen
    kind, seen = classify(Reading(1.0, 20.0, ()), loss_spikes, norm_spikes)
    assert kind == SPIKE and "‖g‖ 20" in seen
    # Below the factor: none (5 × an average just above 1 after the winsorized spike).
    assert classify(Reading(4.0, 2.0, ()), loss_spikes, norm_spikes)[0] is None


def test_a_step_without_loss_is_judged_by_its_gradient_alone():
    loss_spikes, norm_spikes = _detectors()
    reading = Reading(float("nan"), 2.0, (), has_loss=False)
    assert classify(reading, loss_spikes, norm_spikes) == (None, "") and loss_spikes.count == 0


def test_rows_summed_over_ranks_give_the_steps_effective_batch():
    """Two ranks' means averaged: Var = (σ²/b₀ + σ²/b₁) / 4, the variance of one mean over 4 / (1/b₀ + 1/b₁) rows."""
    cpu, sq_norm = torch.device("cpu"), torch.tensor(1.0)
    for b0, b1 in ((8, 8), (8, 2)):
        row = sum(pack(torch.tensor(1.0), sq_norm, r, 2, cpu, noise_weight([b], 1)) for r, b in enumerate((b0, b1)))
        assert unpack(row.tolist()).batch == pytest.approx(4 / (1 / b0 + 1 / b1))  # 16 examples: their count
    unknown = pack(torch.tensor(1.0), sq_norm, 0, 2, cpu, noise_weight([8], 1)) + pack(None, sq_norm, 1, 2, cpu)
    assert math.isnan(unpack(unknown.tolist()).batch)  # a rank that could not size its batch: none known
    assert unpack(pack(torch.tensor(1.0), sq_norm, 0, 1, cpu).tolist(), noise=1 / 8).batch == 8.0  # one process


def test_a_short_batch_is_judged_with_its_threshold_raised_by_its_allowance():
    """The usual batch 16: a batch of 1 may have a norm 4× the usual from noise, so 5 × 4 × the average is its
    threshold; above it, still a spike, and the detail says why it was allowed more. A usual batch is allowed 5×."""
    loss_spikes, norm_spikes = _detectors()
    usual = UsualBatch(span=50)

    def kind(times: float, batch: float) -> tuple[str | None, str]:
        return classify(Reading(1.0, times * norm_spikes.average, (), batch=batch), loss_spikes, norm_spikes, usual)

    for _ in range(5):
        assert classify(Reading(1.0, 2.0, (), batch=16.0), loss_spikes, norm_spikes, usual) == (None, "")
    assert kind(0.99 * 20, 1.0)[0] is None
    assert kind(1.01 * 5, 16.0)[0] == SPIKE
    found, seen = kind(1.01 * 20, 1.0)
    assert found == SPIKE and "a batch of 1 examples against the usual 16" in seen and "beyond the 20×" in seen


def test_the_budget_escalates_skip_to_rollback_to_stop_within_its_window():
    budget = Budget(events=2, window=10)
    actions = {NONFINITE: "skip", SPIKE: "warn"}
    assert [choose(NONFINITE, actions, budget, s, True) for s in (0, 1, 2, 3, 4)] == [
        "skip",
        "skip",
        "rollback",  # two skips in the window
        "rollback",
        "stop",  # two rollbacks in the window
    ]
    # 10 steps after the last one the window is empty again.
    assert choose(NONFINITE, actions, budget, 14, True) == "skip"
    # A warning is never escalated nor spent.
    assert [choose(SPIKE, actions, budget, s, True) for s in (15, 16, 17)] == ["warn"] * 3


def test_without_a_snapshot_a_rollback_is_a_skip_and_an_escalated_one_a_stop():
    budget = Budget(events=2, window=10)
    actions = {NONFINITE: "skip", SPIKE: "rollback"}
    assert choose(SPIKE, actions, budget, 0, False) == "skip"
    assert budget.spent == [(0, "skip")]
    # A second skip spends the budget; the rollback it escalates to has no target: a stop.
    assert [choose(NONFINITE, actions, budget, s, False) for s in (1, 2)] == ["skip", "stop"]


def test_the_budget_keeps_few_steps_and_round_trips():
    budget = Budget(events=2, window=1000)
    for s in range(50):
        budget.spend("skip", s)
    assert len(budget.spent) == 2
    copy = Budget(events=2, window=1000)
    copy.load_state_dict(budget.state_dict())
    assert copy.spent == budget.spent and copy.escalate("skip", 50) == "rollback"


def _model_and_adam() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    return model, opt


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 3)).square().mean().backward()
        opt.step()


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]
    return tensors + [v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("where", ["cpu", "device"])
def test_a_restored_snapshot_equals_the_state_it_took_and_stays_apart_from_it(where):
    model, opt = _model_and_adam()
    _train(model, opt, 3)
    snapshot = Snapshot(where)
    snapshot.take(3, model, [opt])
    taken = _state(model, opt)
    _train(model, opt, 4)
    opt.param_groups[0]["lr"] = 0.01  # a scheduler moved on
    snapshot.restore(model, [opt])
    assert all(torch.equal(a, b) for a, b in zip(_state(model, opt), taken))
    assert opt.param_groups[0]["lr"] == 0.01  # hyperparameters are the current ones
    _train(model, opt, 2)  # training on does not write into the snapshot
    snapshot.restore(model, [opt])
    assert all(torch.equal(a, b) for a, b in zip(_state(model, opt), taken))
    assert snapshot.nbytes == sum(t.numel() * t.element_size() for t in taken)  # weights, BatchNorm, Adam


def test_a_later_snapshot_copies_into_the_first_ones_tensors():
    model, opt = _model_and_adam()
    _train(model, opt, 1)
    snapshot = Snapshot("cpu")
    snapshot.take(1, model, [opt])
    held = [t.data_ptr() for t in snapshot._module]
    _train(model, opt, 1)
    snapshot.take(2, model, [opt])
    assert [t.data_ptr() for t in snapshot._module] == held and snapshot.step == 2
    assert torch.equal(snapshot._module[0], model[0].weight)


def test_a_snapshot_round_trips_through_its_state_dict():
    model, opt = _model_and_adam()
    _train(model, opt, 2)
    snapshot = Snapshot("cpu")
    snapshot.take(2, model, [opt])
    taken = _state(model, opt)
    loaded = Snapshot("cpu")
    loaded.load_state_dict(snapshot.state_dict())
    _train(model, opt, 3)
    loaded.restore(model, [opt])
    assert loaded.step == 2 and all(torch.equal(a, b) for a, b in zip(_state(model, opt), taken))


def test_restoring_without_a_snapshot_raises():
    model, opt = _model_and_adam()
    with pytest.raises(RuntimeError, match="no snapshot"):
        Snapshot().restore(model, [opt])
