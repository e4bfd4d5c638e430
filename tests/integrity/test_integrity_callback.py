"""GraphIntegrityCallback: each check builds its fault in a few lines and has a clean control."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from _models import GAN, free_port
from conftest import RecordingLogger, trainer_kwargs
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from trainvitals.integrity import callback as graph_integrity
from trainvitals.integrity.callback import FindingKind, GraphIntegrityCallback, GraphIntegrityError
from trainvitals.integrity.checks import finding_kinds
from trainvitals.integrity.graph import walk_graph

K = SimpleNamespace(**{kind.value.upper(): kind for kind in finding_kinds()})
"""The registered finding kinds by name: ``K.UNUSED_PARAMS``."""


def data(n: int = 32, d: int = 4, batch_size: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(n, d, generator=g), torch.randint(0, 3, (n,), generator=g))
    return DataLoader(ds, batch_size=batch_size)


class Net(pl.LightningModule):
    """body → relu → head; the fault tests override one piece each."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(model: pl.LightningModule, cb: GraphIntegrityCallback, steps: int = 3, **kwargs) -> list[str]:
    """Fit for ``steps`` optimizer steps; returns the warning messages."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pl.Trainer(**trainer_kwargs(max_steps=steps, callbacks=[cb], **kwargs)).fit(model, data())
    return [str(w.message) for w in caught]


def every_step(**kwargs) -> GraphIntegrityCallback:
    return GraphIntegrityCallback(check_every_n_steps=1, dead_after_steps=1, **kwargs)


def kinds(cb: GraphIntegrityCallback) -> set[FindingKind]:
    return {f.kind for f in cb.findings}


def finding(cb: GraphIntegrityCallback, kind: FindingKind):
    return next(f for f in cb.findings if f.kind is kind)


def fit_fails(model: pl.LightningModule, cb: GraphIntegrityCallback, match: str, steps: int = 3) -> BaseException:
    with pytest.raises(RuntimeError, match=match) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(**trainer_kwargs(max_steps=steps, callbacks=[cb])).fit(model, data())
    return info.value


# ------------------------------------------------------------------------------------------ arguments


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"check_every_n_steps": 0}, "check_every_n_steps"),
        ({"dead_after_steps": 0}, "dead_after_steps"),
        ({"check_every_n_steps": 2, "dead_after_steps": 3}, "dead_after_steps"),
        ({"detect_anomaly_steps": -1}, "detect_anomaly_steps"),
        ({"detect_anomaly_steps": 1.5}, "detect_anomaly_steps"),
    ],
)
def test_constructor_names_the_bad_argument(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        GraphIntegrityCallback(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"strict": 1}, "strict"),
        ({"check_batch_independence": "yes"}, "check_batch_independence"),
        ({"batch_input": 3}, "batch_input"),
    ],
)
def test_constructor_names_the_argument_of_the_wrong_type(kwargs, name):
    with pytest.raises(TypeError, match=f"`{name}`"):
        GraphIntegrityCallback(**kwargs)


# ------------------------------------------------------------------------------- the clean control


def test_clean_model_gets_a_clean_bill_of_health(recording_logger: RecordingLogger):
    cb = every_step(check_batch_independence=True, detect_anomaly_steps=1)
    caught = fit(Net(), cb, logger=recording_logger)
    assert cb.findings == []
    assert not [m for m in caught if "GraphIntegrityCallback" in m]
    assert "clean bill of health" in cb.summary_markdown()
    for counter in (
        "unused_params",
        "dead_params",
        "nonfinite_losses",
        "leaked_graphs",
        "unregistered_params",
        "unoptimized_params",
    ):
        assert recording_logger.values(f"graph/{counter}") == [0.0, 0.0, 0.0]  # one window per step
    assert not torch.is_anomaly_enabled()


class ScaledOnTransfer(Net):
    """A learnable input scale applied in ``on_after_batch_transfer``, which Lightning runs before
    ``on_train_batch_start``: part of this step's graph, not an earlier one's."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def on_after_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        return x * self.scale, y


def test_graph_built_in_the_batch_transfer_hooks_is_this_steps():
    cb = every_step()
    fit(ScaledOnTransfer(), cb)
    assert cb.findings == []


# ------------------------------------------------------------------------------------- loss checks


class DetachedLoss(Net):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y).detach()


class ItemLoss(Net):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.tensor(F.cross_entropy(self(x), y).item())


class NoGradLoss(Net):
    def training_step(self, batch, batch_idx):
        x, y = batch
        with torch.no_grad():
            logits = self(x)
        return F.cross_entropy(logits, y)


@pytest.mark.parametrize(
    ("model", "culprit", "words"),
    [
        (DetachedLoss, "detach", "`.detach()`"),
        (ItemLoss, "item", "`.item()`"),
        (NoGradLoss, "linear", "torch.no_grad()"),
    ],
)
def test_loss_without_grad_fn_says_where_the_graph_was_cut(model, culprit, words):
    cb = GraphIntegrityCallback()
    err = fit_fails(model(), cb, "element 0 of tensors does not require grad")
    f = finding(cb, K.LOSS_NO_GRAD)
    assert f.names[0] == culprit and words in f.message
    # The last name is the line in training_step that cut the graph (for no_grad: where it was entered).
    assert f.names[-1].startswith("test_integrity_callback.py:") and f.names[-1].endswith(" in training_step")
    if model is NoGradLoss:
        assert f.names[1] == "head"  # the module whose op ran without grad, closest to the loss
    # The autograd error itself carries the diagnosis and propagates unchanged.
    assert K.NO_GRAD_ERROR in kinds(cb)
    assert any(words in note for note in err.__notes__)


def test_a_wholly_frozen_model_is_named_as_the_cause():
    model = Net().requires_grad_(False)
    cb = GraphIntegrityCallback()
    fit_fails(model, cb, "element 0 of tensors does not require grad")
    f = finding(cb, K.LOSS_NO_GRAD)
    assert (
        f.names == ("every parameter frozen",) and "every parameter of the model has requires_grad=False" in f.message
    )


class NoGradClosureSGD(torch.optim.SGD):
    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            closure()  # the bug: no torch.enable_grad() around the closure


class ManualNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class ClosureInNoGrad(ManualNet):
    def training_step(self, batch, batch_idx):
        opt = self.optimizers()

        def closure():
            loss = F.cross_entropy(self(batch[0]), batch[1])
            opt.zero_grad()
            self.manual_backward(loss)
            return loss

        opt.step(closure=closure)

    def configure_optimizers(self):
        return NoGradClosureSGD(self.parameters(), lr=0.1)


def test_grad_mode_off_in_the_optimizer_closure_is_named():
    cb = GraphIntegrityCallback()
    fit_fails(ClosureInNoGrad(), cb, "element 0 of tensors")
    f = finding(cb, K.LOSS_NO_GRAD)
    assert "grad mode off" in f.names and "NoGradClosureSGD" in f.names
    assert "grad mode was off while training_step ran" in f.message


class NonFiniteLoss(Net):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if self.global_step == 1 else loss


def test_non_finite_loss_is_counted(recording_logger: RecordingLogger):
    cb = GraphIntegrityCallback(check_every_n_steps=2, dead_after_steps=2)
    fit(NonFiniteLoss(), cb, steps=2, logger=recording_logger)
    assert finding(cb, K.LOSS_NOT_FINITE).message.startswith("1 loss value(s) were NaN or inf")
    assert recording_logger.values("graph/nonfinite_losses") == [1.0]


def test_a_non_finite_loss_after_the_last_check_window_is_still_logged(recording_logger: RecordingLogger):
    """The window of step 0 has closed when the loss turns inf: the end of training logs the count, which
    ``trainvitals report`` reads as critical."""
    cb = GraphIntegrityCallback(check_every_n_steps=50, dead_after_steps=1)
    fit(NonFiniteLoss(), cb, steps=3, logger=recording_logger)
    assert K.LOSS_NOT_FINITE in kinds(cb)
    # Steps 1 and 2: the inf loss of step 1 leaves NaN weights behind.
    assert recording_logger.series["graph/nonfinite_losses"][-1] == (2, 2.0)  # logged at the last optimizer step, 2


class NeverUsedHead(Net):
    def __init__(self) -> None:
        super().__init__()
        self.never = nn.Linear(8, 3)


@pytest.mark.parametrize("steps", [9, 10])
def test_a_window_the_run_cuts_short_logs_no_unused_verdict(recording_logger: RecordingLogger, steps: int):
    """Windows at steps 0 and 4 see the head unused for 3 checks; the one at step 8 gets 1 or 2 before the
    run ends. Its 0 would read as "every parameter trains" to the report's last-window rule."""
    cb = GraphIntegrityCallback(check_every_n_steps=4, dead_after_steps=3)
    fit(NeverUsedHead(), cb, steps=steps, logger=recording_logger)
    assert [v for _, v in recording_logger.series["graph/unused_params"]] == [2.0, 2.0]
    # The last window logged, at the run's last optimizer step.
    assert [s for s, _ in recording_logger.series["graph/nonfinite_losses"]][-1] == steps - 1


class VectorLoss(Net):
    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1], reduction="none")


def test_non_scalar_loss_is_found_before_backward_fails():
    cb = GraphIntegrityCallback()
    fit_fails(VectorLoss(), cb, "grad can be implicitly created only for scalar outputs")
    assert "shape (8,)" in finding(cb, K.LOSS_NOT_SCALAR).message


# ------------------------------------------------------------------------------------ graph walk


class UnreachableBranches(Net):
    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(8, 3)
        self.cut = nn.Linear(8, 3)
        self.frozen_branch = nn.Linear(8, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.relu(self.body(x))
        with torch.no_grad():
            side = self.frozen_branch(h)
        logits = self.head(h) + self.cut(h).detach() + side
        return F.cross_entropy(logits, y)


def test_unreachable_parameters_are_named_with_the_reason():
    cb = every_step()
    fit(UnreachableBranches(), cb, steps=1)
    f = finding(cb, K.UNREACHABLE_PARAMS)
    expected = {f"{m}.{p}" for m in ("unused", "cut", "frozen_branch") for p in ("weight", "bias")}
    assert set(f.names) == expected
    assert "`unused` never ran in forward" in f.message
    assert "`cut` ran, but its output was detached" in f.message
    assert "`frozen_branch` ran only with grad mode off" in f.message


class PlainListLayers(Net):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = [nn.Linear(8, 8)]  # not registered: parameters() misses it

    def forward(self, x):
        return self.head(self.blocks[0](torch.relu(self.body(x))))


class HeadLeftOut(Net):
    def configure_optimizers(self):
        return torch.optim.SGD(self.body.parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("model", "names", "words"),
    [
        (PlainListLayers, ("blocks[0].weight", "blocks[0].bias"), "nn.ModuleList"),
        (HeadLeftOut, ("head.weight", "head.bias"), "configure_optimizers left them out"),
    ],
)
def test_leaves_outside_every_optimizer_are_named(model, names, words, recording_logger: RecordingLogger):
    cb = every_step()
    fit(model(), cb, steps=1, logger=recording_logger)
    f = finding(cb, K.UNOPTIMIZED_LEAVES)
    assert set(f.names) == set(names) and words in f.message
    assert all(f.message.count(f"`{name}`") == 1 for name in names)  # each named once
    assert recording_logger.values("graph/unoptimized_params") == [2.0]
    assert recording_logger.values("graph/unregistered_params") == [2.0 if model is PlainListLayers else 0.0]


class FrozenInOptimizer(Net):
    def __init__(self, filter_frozen: bool) -> None:
        super().__init__()
        self.filter_frozen = filter_frozen
        self.body.requires_grad_(False)

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad or not self.filter_frozen]
        return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("filter_frozen", [False, True])
def test_frozen_parameters_in_an_optimizer(filter_frozen):
    cb = every_step()
    fit(FrozenInOptimizer(filter_frozen), cb, steps=1)
    if filter_frozen:
        assert cb.findings == []
    else:
        assert set(finding(cb, K.FROZEN_IN_OPTIMIZER).names) == {"body.weight", "body.bias"}


class CarriedState(Net):
    """Keeps a recurrent hidden state (or a running total) across steps."""

    def __init__(self, detach: bool, total: bool = False) -> None:
        super().__init__()
        self.detach, self.total = detach, total
        self.hidden = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.total:  # a running total of the loss, back-propagated
            loss = F.cross_entropy(self(x), y)
            self.hidden = loss if self.hidden is None else self.hidden + loss
            return self.hidden
        h = torch.relu(self.body(x))
        if self.hidden is not None:
            h = h + torch.tanh(self.hidden)
        self.hidden = h.detach() if self.detach else h
        return F.cross_entropy(self.head(h), y)


def test_hidden_state_carried_across_steps_is_named_before_backward():
    cb = every_step()
    err = fit_fails(CarriedState(detach=False), cb, "Trying to backward through the graph a second time")
    assert finding(cb, K.STALE_GRAPH).names == ("hidden",)
    assert "`self.hidden = hidden.detach()`" in finding(cb, K.STALE_GRAPH).message
    assert finding(cb, K.SECOND_BACKWARD).names == ("hidden",)
    assert any("hidden" in note for note in err.__notes__)


class CarriedStateRetained(Net):
    """A recurrence carried across steps, with the usual "fix" of "backward through the graph a second time":
    retain_graph=True. The recurrent weight is saved by every step's graph."""

    def __init__(self) -> None:
        super().__init__()
        self.recurrent = nn.Linear(8, 8)
        self.hidden = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.relu(self.body(x))
        if self.hidden is not None:
            h = h + torch.tanh(self.recurrent(self.hidden))
        self.hidden = h
        return F.cross_entropy(self.head(h), y)

    def backward(self, loss, *args, **kwargs):
        loss.backward(retain_graph=True)


def test_a_retained_graph_carried_across_steps_explains_the_inplace_error():
    """The old graph is kept, but the last optimizer step changed the weights it saved: autograd's in-place
    error, explained by the state that carries the graph over, not by a generic note."""
    cb = every_step()
    err = fit_fails(CarriedStateRetained(), cb, "modified by an inplace operation")
    f = finding(cb, K.INPLACE_MODIFIED)
    assert f.names == ("hidden",)
    assert "carried across steps in `hidden`" in f.message and "retain_graph=True" in f.message
    assert any("`self.hidden = hidden.detach()`" in note for note in err.__notes__)


def test_detached_hidden_state_is_clean():
    cb = every_step()
    fit(CarriedState(detach=True), cb)
    assert cb.findings == []


# --------------------------------------------------------------------------------- after backward


class UnusedAndDead(Net):
    def __init__(self) -> None:
        super().__init__()
        self.aux = nn.Linear(8, 3)  # never used
        self.blocked = nn.Linear(8, 3)  # used behind a relu that is always zero

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.relu(self.body(x))
        return F.cross_entropy(self.head(h) + torch.relu(self.blocked(h) - 1e4), y)


@pytest.mark.parametrize(
    ("dead_after_steps", "said"), [(1, "1 optimizer step in a row"), (2, "2 optimizer steps in a row")]
)
def test_the_streak_messages_count_their_steps_in_words(dead_after_steps, said):
    cb = GraphIntegrityCallback(check_every_n_steps=2, dead_after_steps=dead_after_steps, verbose=False)
    fit(UnusedAndDead(), cb, steps=2)
    assert f"at {said}:" in finding(cb, K.UNUSED_PARAMS).message
    assert f"at {said}:" in finding(cb, K.DEAD_PARAMS).message


class SparseAndComplex(Net):
    """A sparse embedding gradient and a complex parameter's gradient, which aminmax cannot reduce."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 8, sparse=True)
        self.phase = nn.Parameter(torch.randn(3, dtype=torch.complex64))

    def forward(self, x):
        h = torch.relu(self.body(x)) + self.embed(x.abs().long().clamp(max=4)).mean(1)
        return self.head(h) * self.phase.abs()


def test_sparse_and_complex_gradients_are_checked_without_killing_the_fit():
    model = SparseAndComplex()
    cb = every_step(verbose=False)
    fit(model, cb, steps=3)
    assert cb.counts == {} and model.embed.weight.grad.is_sparse


def test_unused_and_dead_parameters_are_told_apart(recording_logger: RecordingLogger):
    cb = GraphIntegrityCallback(check_every_n_steps=3, dead_after_steps=2)
    fit(UnusedAndDead(), cb, steps=2, logger=recording_logger)
    assert set(finding(cb, K.UNUSED_PARAMS).names) == {"aux.weight", "aux.bias"}
    assert set(finding(cb, K.DEAD_PARAMS).names) == {"blocked.weight", "blocked.bias"}
    assert recording_logger.values("graph/unused_params") == [2.0]
    assert recording_logger.values("graph/dead_params") == [2.0]
    ddp = finding(cb, K.DDP_UNUSED)
    assert set(ddp.names) == {"aux.weight", "aux.bias"}
    assert "ddp_find_unused_parameters_true" in ddp.message and "find_unused_parameters=True" in ddp.message


class AuxEveryOtherStep(Net):
    """A healthy model whose auxiliary head joins the loss on odd steps only (as an MoE expert that gets
    no tokens in some batches)."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = nn.Linear(8, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.relu(self.body(x))
        logits = self.head(h) + (self.aux(h) if self.global_step % 2 else 0.0)
        return F.cross_entropy(logits, y)


class ReentrantCheckpoint(Net):
    """A block under ``torch.utils.checkpoint(use_reentrant=True)``: its graph exists only in backward."""

    def __init__(self, run: str) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.run = run  # what the region re-runs: the module, its forward, or any other function (opaque)

    def forward(self, x):
        run = {"module": self.block, "forward": self.block.forward, "function": lambda h: self.block(h)}[self.run]
        return self.head(checkpoint(run, torch.relu(self.body(x)), use_reentrant=True))


@pytest.mark.parametrize(
    "make",
    [AuxEveryOtherStep, lambda: ReentrantCheckpoint("module"), lambda: ReentrantCheckpoint("function")],
    ids=["aux-every-other-step", "checkpointed-module", "checkpointed-function"],
)
def test_parameters_the_first_walk_misses_but_that_train_are_not_reported(make):
    """One walk decides nothing: a parameter it misses is reported only after a window of steps without
    a gradient. strict=True would end these healthy runs otherwise."""
    cb = GraphIntegrityCallback(check_every_n_steps=4, dead_after_steps=3, strict=True)
    fit(make(), cb, steps=4)
    assert cb.findings == []


def test_a_reentrant_checkpoint_of_a_module_is_walked_through():
    x = torch.randn(8, 4)
    for run in ("module", "forward"):
        model = ReentrantCheckpoint(run)
        model.block[0].weight.requires_grad_(False)  # frozen inside the region: no gradient comes to it
        walk = walk_graph(model(x).sum())
        leaves = {id(t) for t in walk.leaves}
        assert id(model.block[0].bias) in leaves and id(model.block[0].weight) not in leaves and not walk.opaque
    assert walk_graph(ReentrantCheckpoint("function")(x).sum()).opaque  # it may use any parameter


def test_one_zero_step_is_not_a_dead_streak():
    cb = GraphIntegrityCallback(check_every_n_steps=3, dead_after_steps=2)
    fit(UnusedAndDead(), cb, steps=1)  # the window closes at fit end after one step
    # Nor is one step without a gradient: the walk's unreachable parameters wait for their streak.
    assert kinds(cb) == set()


class ZeroAtFirst(Net):
    def training_step(self, batch, batch_idx):
        x, y = batch
        gate = 0.0 if self.global_step == 0 else 1.0  # the head's gradient is zero at step 0 only
        return F.cross_entropy(gate * self.head(torch.relu(self.body(x))), y)


def test_a_gradient_zero_at_one_step_only_is_not_dead():
    cb = GraphIntegrityCallback(check_every_n_steps=3, dead_after_steps=2)
    fit(ZeroAtFirst(), cb, steps=3)
    assert cb.findings == []


class FreezeMidway(Net):
    def __init__(self, set_to_none: bool) -> None:
        super().__init__()
        self.set_to_none = set_to_none

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == 1:
            self.body.requires_grad_(False)

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad(set_to_none=self.set_to_none)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1, weight_decay=0.1)


@pytest.mark.parametrize("set_to_none", [False, True])
def test_frozen_parameter_that_still_changes_is_named_with_the_cause(set_to_none):
    cb = every_step()
    model = FreezeMidway(set_to_none)
    before = model.body.weight.detach().clone()
    fit(model, cb, steps=3)
    if set_to_none:
        assert cb.findings == []
        return
    f = next(f for f in cb.findings if f.kind is K.FROZEN_CHANGED and f.names == ("body.weight",))
    assert "still holds a `.grad`" in f.message and "exp_avg" in f.message and "weight decay 0.1" in f.message
    assert not torch.equal(before, model.body.weight)


def test_two_optimizers_clean():
    cb = GraphIntegrityCallback(check_every_n_steps=4, dead_after_steps=2)
    fit(GAN(), cb, steps=8)
    assert cb.findings == []


class GANBothOnAllParameters(GAN):
    """Both optimizers built from ``self.parameters()``: the generator's step also moves the discriminator."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01), torch.optim.Adam(self.parameters(), lr=1e-3)


def test_parameters_in_two_optimizers_are_named_once_and_strict_does_not_raise(recording_logger: RecordingLogger):
    cb = GraphIntegrityCallback(check_every_n_steps=4, dead_after_steps=2, strict=True)
    caught = fit(GANBothOnAllParameters(), cb, steps=4, logger=recording_logger)
    assert [f.kind for f in cb.findings if f.kind is K.SHARED_BY_OPTIMIZERS] == [K.SHARED_BY_OPTIMIZERS]
    f = finding(cb, K.SHARED_BY_OPTIMIZERS)
    assert f.names == ("gen.0.weight", "gen.0.bias", "disc.0.weight", "disc.0.bias") and f.step == 0
    assert f.message.startswith(
        "`gen.0.weight`, `gen.0.bias`, `disc.0.weight`, `disc.0.bias` are in optimizer 0 (SGD) and optimizer 1 (Adam)"
    )
    assert sum("[shared_by_optimizers]" in m for m in caught) == 1
    assert recording_logger.values(K.SHARED_BY_OPTIMIZERS.counter)[-1] == 1
    assert any("| shared_by_optimizers |" in row for row in cb.summary_markdown().splitlines())


def test_optimizers_over_their_own_modules_share_nothing():
    cb = GraphIntegrityCallback(check_every_n_steps=4, dead_after_steps=2)
    fit(GAN(), cb, steps=4)
    assert K.SHARED_BY_OPTIMIZERS not in cb.counts


def test_gradient_left_over_from_another_loss_is_a_leak():
    cb = GraphIntegrityCallback(check_every_n_steps=4, dead_after_steps=2)
    fit(GAN(zero_disc=False), cb, steps=8)
    f = finding(cb, K.GRAD_LEAK)
    assert f.names == ("disc.0.weight", "disc.0.bias")
    assert f.message.startswith("Optimizer 1 (SGD")


class StepBeforeBackward(ManualNet):
    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        opt.step()  # every .grad is None here: the step does nothing
        self.manual_backward(F.cross_entropy(self(batch[0]), batch[1]))


def test_an_optimizer_step_before_its_backward_is_named_not_called_unused():
    """Each .grad is None at the step and set by the backward after it: the model never trains, and the
    parameters are in the graph (no unused finding, no DDP prediction)."""
    model, cb = StepBeforeBackward(), GraphIntegrityCallback(check_every_n_steps=4, dead_after_steps=2)
    before = [p.detach().clone() for p in model.parameters()]
    fit(model, cb, steps=4)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # it really did not train
    assert kinds(cb) == {K.STEP_BEFORE_BACKWARD}
    f = finding(cb, K.STEP_BEFORE_BACKWARD)
    assert f.names == ("body.weight", "body.bias", "head.weight", "head.bias")
    assert f.message.startswith("Optimizer 0 (SGD) stepped before the backward") and "manual_backward" in f.message


class StepBeforeBackwardTwicePerBatch(ManualNet):
    """The bug in a loop of two chunks per batch: a check window of dead_after_steps optimizer steps holds
    fewer batches than that, so the streak of batches runs across windows."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        for _ in range(2):
            opt.zero_grad()
            opt.step()
            self.manual_backward(F.cross_entropy(self(batch[0]), batch[1]))


def test_the_bug_in_a_loop_of_several_steps_per_batch_is_found():
    cb = GraphIntegrityCallback(check_every_n_steps=4, dead_after_steps=2)
    fit(StepBeforeBackwardTwicePerBatch(), cb, steps=16)
    assert K.STEP_BEFORE_BACKWARD in kinds(cb)


class RareGeneratorStepFirst(ManualNet):
    """Optimizer 0 steps every batch, correctly; optimizer 1 every third batch, before its backward."""

    def configure_optimizers(self):
        return [torch.optim.SGD(self.body.parameters(), lr=0.1), torch.optim.SGD(self.head.parameters(), lr=0.1)]

    def training_step(self, batch, batch_idx):
        x, y = batch
        body_opt, head_opt = self.optimizers()
        body_opt.zero_grad()
        self.manual_backward(self.body(x).square().mean())
        body_opt.step()
        if batch_idx % 3 == 0:
            head_opt.zero_grad()
            head_opt.step()
            self.manual_backward(F.cross_entropy(self.head(torch.relu(self.body(x).detach())), y))


def test_an_optimizer_stepping_in_few_batches_is_judged_on_its_own_batches():
    """Its stepping batches are far apart, beyond any check window: the order is followed on every batch."""
    cb = GraphIntegrityCallback(check_every_n_steps=10, dead_after_steps=3)
    fit(RareGeneratorStepFirst(), cb, steps=40, max_epochs=-1)
    assert finding(cb, K.STEP_BEFORE_BACKWARD).names == ("head.weight", "head.bias")


class ChunkedWithBranch(ManualNet):
    """Two optimizer steps per batch, each after its own backward; a layer only the second chunk uses."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(8, 8)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        for chunk in range(2):
            opt.zero_grad()
            h = torch.relu(self.body(x))
            self.manual_backward(F.cross_entropy(self.head(self.extra(h) if chunk else h), y))
            opt.step()


class StepFirstAccumulation(ManualNet):
    """Accumulation by hand that steps the previous window's gradients at the start of a batch."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        if batch_idx % 2 == 0:
            opt.step()
            opt.zero_grad()
        self.manual_backward(F.cross_entropy(self(batch[0]), batch[1]) / 2)


class SharedByTwoOptimizers(ManualNet):
    """Optimizer 0 holds every parameter, optimizer 1 the auxiliary head, whose loss comes second."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = nn.Linear(8, 3)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.SGD(self.aux.parameters(), lr=0.1)

    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        x, y = batch
        first.zero_grad()
        self.manual_backward(F.cross_entropy(self(x), y))
        first.step()
        second.zero_grad()
        self.manual_backward(F.cross_entropy(self.aux(torch.relu(self.body(x)).detach()), y))
        second.step()


class DelayedStepAlternatingHeads(ManualNet):
    """Steps the previous batch's gradients first, and uses one of two heads by turns: each head's gradient
    is late on every other batch only, never on batches in a row."""

    def __init__(self) -> None:
        super().__init__()
        self.head2 = nn.Linear(8, 3)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.step()
        opt.zero_grad()
        head = self.head if self.global_step % 2 == 0 else self.head2
        self.manual_backward(F.cross_entropy(head(torch.relu(self.body(batch[0]))), batch[1]))


@pytest.mark.parametrize(
    "model", [ChunkedWithBranch, StepFirstAccumulation, SharedByTwoOptimizers, DelayedStepAlternatingHeads]
)
@pytest.mark.parametrize("every", [3, 8])
def test_manual_loops_whose_every_gradient_is_stepped_are_not_accused(model, every):
    cb = GraphIntegrityCallback(check_every_n_steps=every, dead_after_steps=2)
    fit(model(), cb, steps=16)
    assert K.STEP_BEFORE_BACKWARD not in kinds(cb)


# ------------------------------------------------------------------------------------ learning rate


class ZeroLrBody(Net):
    """The body's param group at ``body_lr`` (the head's at 0.1); ``schedule`` scales the body's by step."""

    def __init__(self, body_lr: float = 0.0, schedule=None) -> None:
        super().__init__()
        self.body_lr, self.schedule = body_lr, schedule

    def configure_optimizers(self):
        groups = [{"params": self.body.parameters(), "lr": self.body_lr}, {"params": self.head.parameters()}]
        opt = torch.optim.SGD(groups, lr=0.1)
        if self.schedule is None:
            return opt
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, [self.schedule, lambda step: 1.0])
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_a_param_group_at_lr_zero_is_named_with_its_modules_after_ten_steps_at_zero():
    """Judged on the lr read at the optimizer steps, never at fit start: a group at exactly 0 for
    max(dead_after_steps, 10) steps in a row is reported when a complete window closes (that of step 10,
    the first with ten steps at 0 behind it), then at each later window."""
    model = ZeroLrBody()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cb = GraphIntegrityCallback(check_every_n_steps=2, dead_after_steps=1, verbose=False)
    caught = fit(model, cb, steps=14)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {"head.weight", "head.bias"}  # what the finding claims: the body's group never moves
    f = finding(cb, K.ZERO_LR)
    assert f.names == ("optimizer 0 param group 0", "body") and f.step == 10
    assert "lr exactly 0 at each of its last 11 optimizer steps" in f.message
    assert "warm-up" in f.message and "requires_grad=False" in f.message
    assert cb.counts[K.ZERO_LR] == 2  # the windows of steps 10 and 12
    assert sum("[zero_lr]" in m and "module `body`" in m for m in caught) == 1
    assert any("| zero_lr | `optimizer 0 param group 0`, `body` |" in row for row in cb.summary_markdown().splitlines())


class ZeroLrBodyHeadLeftOut(ZeroLrBody):
    def configure_optimizers(self):
        return torch.optim.SGD(self.body.parameters(), lr=0.0)


def test_the_fit_end_line_states_the_headline_finding():
    cb = GraphIntegrityCallback(check_every_n_steps=2, dead_after_steps=1, verbose=False)
    fit(ZeroLrBody(), cb, steps=14)
    message = finding(cb, K.ZERO_LR).message
    what, _, fix = message.partition(" did not change. ")
    assert fix.startswith("A warm-up")  # the message's second sentence: the line leaves it to the table
    line = cb.summary_line()
    assert line.startswith("1 finding(s) in ") and line.endswith(
        f"(zero_lr); first of them, at step 10 [zero_lr]: {what} did not change. The full table: the Text tab's "
        "graph/findings, or trainvitals report."
    )

    # A body at lr 0 and a head in no optimizer: the head's finding breaks the run, so it is the headline.
    cb = GraphIntegrityCallback(check_every_n_steps=2, dead_after_steps=1, verbose=False)
    fit(ZeroLrBodyHeadLeftOut(), cb, steps=14)
    leaves = finding(cb, K.UNOPTIMIZED_LEAVES)
    assert {K.ZERO_LR, K.UNOPTIMIZED_LEAVES} <= kinds(cb)
    line = cb.summary_line()
    assert f"; first breaking the run, at step {leaves.step} [unoptimized_leaves]: " in line
    assert "`head.weight`" in line and "[zero_lr]" not in line


@pytest.mark.parametrize(
    ("schedule", "found_at"),
    [
        (lambda step: 1.0 if step < 4 else 0.0, 13),  # 0 from step 4 on: ten steps at 0 by step 13
        (lambda step: min(1.0, step / 2), None),  # a warm-up from 0: at 0 for one step only
    ],
)
def test_a_scheduled_lr_is_judged_over_whole_windows_at_zero(schedule, found_at):
    cb = GraphIntegrityCallback(check_every_n_steps=2, dead_after_steps=2, verbose=False)
    fit(ZeroLrBody(body_lr=0.1, schedule=schedule), cb, steps=16)
    found = [(f.names, f.step) for f in cb.findings if f.kind is K.ZERO_LR]
    assert found == ([] if found_at is None else [(("optimizer 0 param group 0", "body"), found_at)])
    assert cb.counts.get(K.ZERO_LR, 0) == (0 if found_at is None else 2)  # the windows of steps 12-13 and 14-15


class WarmsUpFromZero(Net):
    """Built at lr 0, its lr set before each step by the model (nanoGPT's get_lr), no Lightning scheduler;
    ``steps_at_zero``: the warm-up's first steps at exactly 0."""

    def __init__(self, steps_at_zero: int = 1) -> None:
        super().__init__()
        self.steps_at_zero = steps_at_zero

    def on_train_batch_start(self, batch, batch_idx):
        for group in self.trainer.optimizers[0].param_groups:
            group["lr"] = 0.1 * min(1.0, max(0, self.trainer.global_step - self.steps_at_zero + 1) / 4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize("strict", [False, True])
def test_a_warm_up_from_zero_set_by_hand_is_not_reported_and_strict_does_not_raise_on_lr_zero(strict):
    """An optimizer built at lr 0 whose lr a hook sets was reported at fit start ("no lr scheduler
    changes it"), and strict=True raised there. Only what was read at the steps counts; lr 0 (also a way
    to keep a group fixed) is never fatal under strict."""
    cb = GraphIntegrityCallback(check_every_n_steps=1, dead_after_steps=1, strict=strict, verbose=False)
    fit(WarmsUpFromZero(), cb, steps=12)
    assert K.ZERO_LR not in cb.counts
    # A warm-up that stays at exactly 0 for twelve steps spends them: reported, and still not raised.
    cb = GraphIntegrityCallback(check_every_n_steps=1, dead_after_steps=1, strict=strict, verbose=False)
    fit(WarmsUpFromZero(steps_at_zero=12), cb, steps=14)
    f = finding(cb, K.ZERO_LR)
    assert (f.step, cb.counts[K.ZERO_LR]) == (9, 3)  # steps 9, 10 and 11 close a window with ten or more at 0
    assert f.names[:2] == ("optimizer 0 param group 0", "body")


@pytest.mark.parametrize("schedule", [dict(interval="epoch"), dict(interval="step", frequency=4)])
def test_a_warm_up_from_zero_stepped_every_few_steps_is_not_reported(schedule):
    """A LambdaLR warm-up from 0 stepped per epoch (4 steps) or every 4 steps was reported at step 2."""

    class Warm(ZeroLrBody):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, k / 2))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, **schedule}}

    cb = GraphIntegrityCallback(check_every_n_steps=2, dead_after_steps=2, verbose=False)
    fit(Warm(), cb, steps=14)
    assert K.ZERO_LR not in cb.counts


# ---------------------------------------------------------------------------------- in-place errors


class StepBetweenForwardAndBackward(ManualNet):
    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        logits = self(batch[0])
        opt.zero_grad()
        self.manual_backward(F.cross_entropy(logits, batch[1]), retain_graph=True)
        opt.step()  # updates head.weight in place; the second backward still needs the old one
        self.manual_backward(logits.square().mean())


class InplaceOnSaved(Net):
    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.sigmoid(self.body(x))
        h.mul_(2)  # sigmoid saved its output for backward
        return F.cross_entropy(self.head(h), y)


class InplaceModule(Net):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Sigmoid(), nn.ReLU(inplace=True), nn.Linear(8, 3))

    def forward(self, x):
        return self.net(x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=0.1)


class TwiceSameLoss(ManualNet):
    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch[0]), batch[1])
        self.manual_backward(loss)
        self.manual_backward(loss)


class InplaceAfterAStep(ManualNet):
    """A step, then an in-place op on a computed tensor of the shape of a parameter the step changed
    (``mix.weight``, (8, 8), at version 2 like the sigmoid output): the op is the culprit, not the step."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(8, 8)

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(F.cross_entropy(self.head(self.mix(self.body(x))), y))
        opt.step()
        h = torch.sigmoid(self.body(x))  # (8, 8): the batch is 8 examples
        h.mul_(2).add_(1)
        self.manual_backward(F.cross_entropy(self.head(h), y))


@pytest.mark.parametrize(
    ("make", "kind", "names", "words"),
    [
        # The default schedule walks at step 0 only: the running total is named from the error alone.
        (lambda: CarriedState(detach=False, total=True), K.SECOND_BACKWARD, ("hidden",), "created in an earlier step"),
        (lambda: GAN(detach_fake=False), K.SECOND_BACKWARD, ("gen.0",), "`fake.detach()`"),
        (
            StepBetweenForwardAndBackward,
            K.INPLACE_MODIFIED,
            ("head.weight",),
            "optimizer 0 (SGD).step() updated it in place after the forward",
        ),
        (
            InplaceOnSaved,
            K.INPLACE_MODIFIED,
            ("sigmoid", "mul_"),
            "saved for backward by `sigmoid` at test_integrity_callback.py",
        ),
        (
            InplaceModule,
            K.INPLACE_MODIFIED,
            ("net.1", "sigmoid", "net.2", "relu"),
            "by `sigmoid` in module `net.1` at test_integrity_callback.py:",
        ),
        (TwiceSameLoss, K.SECOND_BACKWARD, (), "The same loss was back-propagated twice"),
        # Manual optimization: no re-run to name the op, but the step is not blamed.
        (InplaceAfterAStep, K.INPLACE_MODIFIED, (), "The tensor that SigmoidBackward0 saved as `result`"),
    ],
    ids=[
        "running-total",
        "shared-graph",
        "optimizer-step",
        "inplace-op",
        "inplace-module",
        "same-loss-twice",
        "inplace-after-a-step",
    ],
)
def test_autograd_error_is_diagnosed_on_the_exception(make, kind, names, words):
    cb = GraphIntegrityCallback()
    err = fit_fails(make(), cb, "backward through the graph a second time|modified by an inplace operation")
    f = finding(cb, kind)
    assert f.names == names and words in f.message
    assert err.__notes__ == [f"trainvitals GraphIntegrityCallback [{kind.value}]: {f.message}"]


# ------------------------------------------------------------------------------------------ options


class RecordsAnomalyMode(Net):
    def __init__(self) -> None:
        super().__init__()
        self.modes: list[bool] = []

    def training_step(self, batch, batch_idx):
        self.modes.append(torch.is_anomaly_enabled())
        return super().training_step(batch, batch_idx)


def test_detect_anomaly_covers_the_first_steps_only():
    model = RecordsAnomalyMode()
    fit(model, GraphIntegrityCallback(detect_anomaly_steps=2), steps=4)
    assert model.modes == [True, True, False, False]
    assert not torch.is_anomaly_enabled()


class MixesBatch(Net):
    def forward(self, x):
        h = torch.relu(self.body(x))  # (B, 8)
        return self.head(h.t().reshape(h.shape))  # the bug: transposes examples into features


class WithBatchNorm(Net):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x):
        return self.head(self.norm(torch.relu(self.body(x))))


def test_batch_mixing_is_found():
    cb = GraphIntegrityCallback(check_batch_independence=True)
    fit(MixesBatch(), cb, steps=1)
    f = finding(cb, K.BATCH_MIXING)
    assert f.names == ("output[0]", "output[7]") and "depends on inputs" in f.message


def test_batchnorm_runs_in_eval_mode_for_the_independence_check(caplog):
    model = WithBatchNorm()
    cb = GraphIntegrityCallback(check_batch_independence=True)
    with caplog.at_level("INFO"):
        fit(model, cb, steps=1)
    assert cb.findings == []
    assert "1 BatchNorm layer(s) in eval mode (`norm`)" in caplog.text
    assert "trainvitals GraphIntegrityCallback: the batch-independence check ran 1 BatchNorm" in caplog.text
    assert model.norm.training and int(model.norm.num_batches_tracked) == 1  # the check did not update it


def test_batch_independence_that_cannot_run_says_so_and_carries_on():
    cb = GraphIntegrityCallback(check_batch_independence=True, batch_input=lambda batch: batch[1])  # the labels
    caught = fit(Net(), cb, steps=1)
    assert cb.findings == []
    assert any("could not check batch independence: ValueError: the input must be floating point" in m for m in caught)
    assert any(m.startswith("trainvitals GraphIntegrityCallback: could not check") for m in caught)


def test_strict_raises_at_the_first_finding():
    with pytest.raises(GraphIntegrityError, match="unreachable_params"):
        fit(UnusedAndDead(), every_step(strict=True), steps=3)


def test_warns_once_per_kind_and_counts_every_time():
    cb = every_step()
    caught = fit(UnusedAndDead(), cb, steps=3)
    assert sum("[unused_params]" in m for m in caught) == 1
    assert cb.counts[K.UNUSED_PARAMS] == 3


def test_findings_table_is_logged_at_fit_end(monkeypatch):
    logged = []
    monkeypatch.setattr(graph_integrity, "log_text", lambda trainer, tag, text, step: logged.append((tag, text)))
    cb = every_step()
    fit(UnusedAndDead(), cb, steps=1)
    assert logged == [("graph/findings", cb.summary_markdown())]
    table = cb.summary_markdown().splitlines()
    assert table[0] == "| step | kind | names | finding |"
    assert any("| unused_params | `aux.weight`, `aux.bias` |" in row for row in table)


def test_a_new_fit_starts_with_a_clean_record():
    cb = every_step()
    fit(UnusedAndDead(), cb, steps=2)
    assert cb.findings
    fit(Net(), cb, steps=2)  # another model, the same callback: the first one's findings are not its
    assert cb.findings == [] and cb.counts == {} and "clean bill of health" in cb.summary_markdown()


def test_nothing_checked_is_no_clean_bill_of_health():
    """Before any walk or gradient check (a fit that ended before its first step) there is no verdict."""
    from trainvitals.integrity.findings import NOTHING_CHECKED

    cb = GraphIntegrityCallback()
    assert cb.summary_markdown() == NOTHING_CHECKED and "clean" not in cb.summary_markdown()
    assert cb.summary_line().startswith("nothing checked: no graph walk and no gradient check ran")


def test_state_survives_a_checkpoint(tmp_path: Path):
    cb = GraphIntegrityCallback(check_every_n_steps=4, dead_after_steps=3)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="mid")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(**trainer_kwargs(max_steps=3, callbacks=[cb, saver], enable_checkpointing=True)).fit(
            UnusedAndDead(), data()
        )
    # Saved after two of the window's three steps: the resumed run needs one more for the streaks.
    resumed = GraphIntegrityCallback(check_every_n_steps=4, dead_after_steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(**trainer_kwargs(max_steps=3, callbacks=[resumed])).fit(
            UnusedAndDead(), data(), ckpt_path=tmp_path / "mid.ckpt"
        )
    # The walk of step 0 is restored and confirmed by the window's last step: found once, not walked again.
    assert resumed.counts[K.UNREACHABLE_PARAMS] == 1
    assert set(finding(resumed, K.UNUSED_PARAMS).names) == {"aux.weight", "aux.bias"}
    assert set(finding(resumed, K.DEAD_PARAMS).names) == {"blocked.weight", "blocked.bias"}
    assert resumed.state_dict()["fit"]["findings"] == json.loads(json.dumps(resumed.state_dict()["fit"]["findings"]))


def test_a_resumed_fit_counts_lr_zero_as_the_uninterrupted_one(tmp_path: Path):
    """The lr 0 check filed a fit-start finding again at each resumed fit; its streak of steps at 0 now
    goes through the checkpoint, so the resumed fit finds what the uninterrupted one does."""

    def run(steps, *callbacks, **kwargs):
        cb = GraphIntegrityCallback(check_every_n_steps=2, dead_after_steps=1, verbose=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pl.Trainer(
                **trainer_kwargs(max_steps=steps, callbacks=[cb, *callbacks], enable_checkpointing=bool(callbacks))
            ).fit(ZeroLrBody(), data(), **kwargs)
        return [(f.names, f.step) for f in cb.findings], cb.counts

    uninterrupted = run(14)
    assert uninterrupted[1] == {K.ZERO_LR: 2}
    run(6, ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=6, save_top_k=-1, filename="mid"))
    assert run(14, ckpt_path=tmp_path / "mid.ckpt") == uninterrupted


@pytest.mark.parametrize(
    ("make", "kind"),
    [(lambda: FrozenInOptimizer(False), K.FROZEN_IN_OPTIMIZER), (GANBothOnAllParameters, K.SHARED_BY_OPTIMIZERS)],
)
def test_a_resumed_fit_does_not_file_a_fit_start_finding_again(tmp_path: Path, make, kind):
    def run(steps, *callbacks, **kwargs):
        cb = GraphIntegrityCallback(check_every_n_steps=2, dead_after_steps=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pl.Trainer(
                **trainer_kwargs(max_steps=steps, callbacks=[cb, *callbacks], enable_checkpointing=bool(callbacks))
            ).fit(make(), data(), **kwargs)
        return [(f.kind, f.names, f.step) for f in cb.findings], cb.counts

    uninterrupted = run(8)
    assert uninterrupted[1][kind] == 1
    run(4, ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1, filename="mid"))
    assert run(8, ckpt_path=tmp_path / "mid.ckpt") == uninterrupted


# ---------------------------------------------------------------------------------- torch.compile


class Body(nn.Module):
    def __init__(self, with_unused: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.spare = nn.Linear(8, 8) if with_unused else None  # registered, never called

    def forward(self, x):
        return self.lin(x)


class CompiledBody(Net):
    def __init__(self, with_unused: bool) -> None:
        super().__init__()
        self.body = torch.compile(Body(with_unused), backend="aot_eager")


@pytest.mark.parametrize("with_unused", [False, True])
def test_compiled_module_is_walked(with_unused):
    cb = every_step()
    fit(CompiledBody(with_unused), cb, steps=1)
    if not with_unused:
        assert cb.findings == []
        return
    spare = {"body._orig_mod.spare.weight", "body._orig_mod.spare.bias"}
    assert set(finding(cb, K.UNREACHABLE_PARAMS).names) == spare
    assert "`body._orig_mod.spare`, inside a torch.compile'd module" in finding(cb, K.UNREACHABLE_PARAMS).message
    assert set(finding(cb, K.UNUSED_PARAMS).names) == spare


def graphs_compiled(model: pl.LightningModule, callbacks: list) -> tuple[int, int]:
    """(graphs compiled, graph breaks) by a fit of ``model`` with ``callbacks``."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(**trainer_kwargs(max_steps=3, callbacks=callbacks)).fit(model, data())
    counters = torch._dynamo.utils.counters
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def test_a_compiled_training_step_compiles_no_graph_more_and_its_modules_are_said_compiled():
    """A module hook inside the compiled step would fail a guard of its graph at each window's first batch (a
    graph with it, one without); the batch-independence check's call of the model would compile another. Neither
    is there: the same graphs as the bare fit, nothing left hooked, and the unreachable modules said compiled."""
    plain = graphs_compiled(torch.compile(UnreachableBranches(), backend="aot_eager"), [])
    cb = every_step(check_batch_independence=True)
    model = UnreachableBranches()
    assert graphs_compiled(torch.compile(model, backend="aot_eager"), [cb]) == plain == (1, 0)
    f = finding(cb, K.UNREACHABLE_PARAMS)  # the compiled graph's node holds the detached branches' parameters
    assert set(f.names) == {"unused.weight", "unused.bias"}
    assert "`unused`, inside a torch.compile'd module, did not reach the loss" in f.message
    assert K.BATCH_MIXING not in kinds(cb)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert not nn.modules.module._global_forward_hooks and not nn.modules.module._global_forward_pre_hooks


class CallsUnusedHead(pl.Callback):
    """Calls the model's unused head at each batch start, as trainvitals does its own forwards, or not."""

    def __init__(self, quietly: bool) -> None:
        self.quietly = quietly

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from trainvitals.plumbing.rerun import rerun_quietly

        with rerun_quietly(pl_module) if self.quietly else contextlib.nullcontext():
            pl_module.unused(torch.zeros(1, 8))


@pytest.mark.parametrize("quietly", [True, False])
def test_an_extra_forward_is_not_counted_as_the_steps(quietly):
    """The reachability check notes which modules the step ran; a forward that trainvitals runs for itself (inside
    rerun_quietly) is not the step's: ``unused`` still never ran. Called plainly, it did run."""
    cb = every_step()
    pl.Trainer(**trainer_kwargs(max_steps=1, callbacks=[cb, CallsUnusedHead(quietly)])).fit(
        UnreachableBranches(), data()
    )
    said = finding(cb, K.UNREACHABLE_PARAMS).message
    assert ("`unused` never ran in forward" in said) is quietly
    assert ("`unused` ran, but its output was detached" in said) is not quietly


# ------------------------------------------------------------------------------------------- DDP


class NanOnRankOne(UnusedAndDead):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_rank == 1 and self.global_step == 1 else loss


class RecordsFindings(GraphIntegrityCallback):
    """Writes this rank's findings and GraphIntegrityCallback warnings, or where strict raised, to a file."""

    def __init__(self, out: Path, **kwargs) -> None:
        super().__init__(**kwargs)
        self.out = out

    def _dump(self, trainer, what) -> None:
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(what))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        try:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        except GraphIntegrityError as err:
            self._dump(trainer, {"raised_at": trainer.global_step, "error": str(err)})
            raise

    def on_train_end(self, trainer, pl_module):
        super().on_train_end(trainer, pl_module)
        self._dump(trainer, [[f.kind.value, list(f.names), f.message] for f in self.findings])


def _ddp_worker(rank: int, port: int, out: str, name: str) -> None:
    """One rank of a 2-process gloo group running the ``warn`` or the ``strict`` fit."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE="2",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
    )
    strict = name == "strict"
    folder = Path(out, name)
    folder.mkdir(exist_ok=True)
    cb = RecordsFindings(folder, check_every_n_steps=2, dead_after_steps=2, strict=strict)
    strategy = DDPStrategy(find_unused_parameters=not strict, process_group_backend="gloo")
    trainer = pl.Trainer(**trainer_kwargs(max_steps=2, devices=2, strategy=strategy, callbacks=[cb]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(NanOnRankOne(), data(n=64))
        except GraphIntegrityError:
            pass
    warned = [str(w.message) for w in caught if "GraphIntegrityCallback [" in str(w.message)]
    (folder / f"warnings{rank}.json").write_text(json.dumps(warned))
    # After a fit that raised, gloo's threads can abort the interpreter's shutdown ("terminate called
    # without an active exception"); the results are written, so leave without running destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.slow
def test_ddp_ranks_agree_warn_once_and_raise_together(tmp_path: Path):
    for name in ("warn", "strict"):
        torch.multiprocessing.spawn(_ddp_worker, args=(free_port(), str(tmp_path), name), nprocs=2)

    def read(name: str) -> dict:
        return {r: json.loads((tmp_path / name / f"rank{r}.json").read_text()) for r in (0, 1)}

    warn = read("warn")
    assert warn[0] == warn[1]  # identical findings, the NaN of rank 1 included (summed over ranks)
    found = {kind: message for kind, _, message in warn[0]}
    assert {"unreachable_params", "unused_params", "dead_params", "loss_not_finite"} <= set(found)
    assert found["loss_not_finite"].startswith("1 loss value(s)")
    assert "ddp_unused" not in found  # find_unused_parameters=True copes with the unused head
    warned = [json.loads((tmp_path / "warn" / f"warnings{r}.json").read_text()) for r in (0, 1)]
    assert len(warned[0]) == len(found) and warned[1] == []  # once per kind, on rank zero only

    strict = read("strict")
    assert strict[0]["raised_at"] == strict[1]["raised_at"] == 1
    assert "unreachable_params" in strict[0]["error"] and "unreachable_params" in strict[1]["error"]
    assert "DDP (find_unused_parameters=False) waits for their gradients" in strict[0]["error"]
    assert "waits for their gradients" not in found["unreachable_params"]  # find_unused_parameters=True


@pytest.mark.parametrize("verbose", [True, False])
def test_verbose_prints_the_table_at_fit_end(verbose, caplog):
    cb = every_step(verbose=verbose)
    with caplog.at_level("INFO"):
        fit(Net(), cb)
    assert ("trainvitals GraphIntegrityCallback: findings" in caplog.text) is verbose
    assert "clean bill of health" in cb.summary_markdown()


class CompiledWithUnusedOutput(Net):
    """An auxiliary layer inside a compiled forward whose output never reaches the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = nn.Linear(8, 1)
        self.compiled_forward = torch.compile(self._forward, backend="aot_eager")
        self.last_aux = None

    def _forward(self, x):
        h = torch.relu(self.body(x))
        self.last_aux = self.aux(h)  # kept for logging, never in the loss
        return self.head(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.compiled_forward(x), y)


def test_a_compiled_region_gives_an_unused_output_zeros_and_the_finding_says_so():
    import torch._dynamo

    torch._dynamo.reset()
    cb = every_step()
    fit(CompiledWithUnusedOutput(), cb, steps=3)
    dead = finding(cb, K.DEAD_PARAMS)
    assert set(dead.names) == {"aux.weight", "aux.bias"}
    assert "In a torch.compile'd region, a parameter whose output does not reach the loss" in dead.message
    eager = every_step()
    fit(Net(), eager, steps=3)
    assert K.DEAD_PARAMS not in kinds(eager)


class LeafLoss(Net):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.tensor(F.cross_entropy(self(x), y).item(), requires_grad=True)


def test_a_loss_rebuilt_from_its_value_is_named_as_reaching_no_parameter():
    """Lightning divides the loss by accumulate_grad_batches, so a leaf rebuilt from ``.item()`` gets a
    grad_fn and backward runs: the walk finds that it reaches no parameter of the model."""
    cb = every_step()
    fit(LeafLoss(), cb, steps=2)
    f = finding(cb, K.LOSS_NO_GRAD)
    assert f.names == ("loss reaches no parameter",)
    assert "torch.tensor(loss.item(), requires_grad=True)" in f.message
    healthy = every_step()
    fit(Net(), healthy, steps=2)
    assert K.LOSS_NO_GRAD not in kinds(healthy)


class LatentFit(ManualNet):
    """An auto-decoder's inner loop: a latent code fitted by its own optimizer, the model untouched."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        z = torch.zeros(x.shape[0], 8, requires_grad=True)
        inner = torch.optim.SGD([z], lr=0.1)
        with torch.no_grad():
            features = torch.relu(self.body(x))
        inner.zero_grad()
        self.manual_backward(F.cross_entropy(self.head(features + z).detach() + z[:, :3], y))
        inner.step()
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(F.cross_entropy(self(x + z.detach()[:, :4]), y))
        opt.step()


def test_a_manual_loss_that_trains_something_else_than_the_model_is_not_accused():
    cb = every_step()
    fit(LatentFit(), cb, steps=2)
    assert K.LOSS_NO_GRAD not in kinds(cb)
