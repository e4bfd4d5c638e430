"""What the per-example hooks keep after a step: nothing of its inputs or activations, without gc's help.

A hook that holds autograd nodes it is registered on is a cycle through C++ objects that Python's gc cannot
see: the step's graph and the tensors it reaches stay for good (nn.MultiheadAttention, the recurrent layers:
every measured step's token ids did). A cycle gc can see would still grow memory between collections, so the
steps here run with gc disabled.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from conftest import RecordingLogger, trainer_kwargs
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.data import DataLoader, TensorDataset
from zoo import ZOO

from trainvitals.noise.probe import BatchVarianceProbe
from trainvitals.per_example import PerExampleGradients
from trainvitals.per_example.checkpoint_hooks import AllGradsHook
from trainvitals.per_example.plan import plan_sources

B, T, D, VOCAB = 4, 5, 8, 11


class Tokens(nn.Module):
    """Token ids ``(B, T)`` through an embedding, ``body`` and a linear head: ``(B, 3)`` logits."""

    def __init__(self, body: Callable[[torch.Tensor], torch.Tensor], *modules: nn.Module) -> None:
        super().__init__()
        self.embed, self.layers, self.head = nn.Embedding(VOCAB, D), nn.ModuleList(modules), nn.Linear(D, 3)
        self.body = body

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)).mean(1))


def _attention(batch_first: bool) -> Tokens:
    attn = nn.MultiheadAttention(D, 2, batch_first=batch_first, dropout=0.1)

    def body(x: torch.Tensor) -> torch.Tensor:
        x = x if batch_first else x.transpose(0, 1)
        out = attn(x, x, x, need_weights=False)[0]
        return out if batch_first else out.transpose(0, 1)

    return Tokens(body, attn)


def _layer(module: nn.Module) -> Tokens:
    return Tokens(lambda x: module(x)[0] if isinstance(module, nn.RNNBase) else module(x), module)


MODELS: dict[str, Callable[[], Tokens]] = {
    "mlp": lambda: _layer(nn.Sequential(nn.Linear(D, D), nn.Tanh())),
    "attention": lambda: _attention(batch_first=True),
    "attention-sequence-first": lambda: _attention(batch_first=False),
    "encoder-layer": lambda: _layer(nn.TransformerEncoderLayer(D, 2, 16, batch_first=True)),
    "lstm": lambda: _layer(nn.LSTM(D, D, 2, batch_first=True)),
    "gru-dropout": lambda: _layer(nn.GRU(D, D, 2, batch_first=True, dropout=0.2)),  # the rule's capture
    "rnn": lambda: _layer(nn.RNN(D, D, batch_first=True)),
}


@contextmanager
def gc_disabled() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def live_tensors() -> int:
    """Tensors Python still holds, reachable or cyclic garbage gc has not collected (gc tracks every tensor)."""
    return sum(issubclass(type(o), torch.Tensor) for o in gc.get_objects())


def measured_steps(
    model: nn.Module, batch: Callable[[], tuple[Any, Any]], loss: Callable[[Any, Any], torch.Tensor], steps: int
) -> tuple[list[weakref.ref], list[int]]:
    """``steps`` steps measured by a collector (every layer per example, sums too), gc disabled: weak references
    to each step's inputs and every module's outputs (its activations), and the live tensors after each step."""
    plan = plan_sources(model, groups_available=False, fallback=False)
    assert not plan.uncovered
    collector = PerExampleGradients(plan.per_example, {}, 2)
    collector.attach(coordinates=True, keep_norms=True)
    refs: list[weakref.ref] = []

    def keep(module: nn.Module, args: Any, output: Any) -> None:
        refs.extend(weakref.ref(t) for t in tree_leaves(output) if isinstance(t, torch.Tensor))

    handles = [m.register_forward_hook(keep) for m in model.modules()]
    counts = []
    with gc_disabled():
        for _ in range(steps):
            x, y = batch()
            collector.begin_micro_batch()
            collector.expect_batch(B, x)
            value = loss(model(x), y)
            collector.before_backward(value)
            value.backward()
            collector.end_micro_batch(1.0)
            step = collector.pop()
            assert not step.failed and step.sq_norms[0].shape == (B,)
            refs.append(weakref.ref(x))
            del x, y, value, step
            counts.append(live_tensors())
    for handle in handles:
        handle.remove()
    collector.detach()
    return refs, counts


@pytest.mark.parametrize("name", list(MODELS))
def test_measured_steps_keep_none_of_their_tensors_without_gc(name):
    """10 steps: none of their ids or activations outlive them, and the live tensors do not grow with the steps."""
    torch.manual_seed(0)
    batch = lambda: (torch.randint(0, VOCAB, (B, T)), None)  # noqa: E731
    refs, counts = measured_steps(MODELS[name]().train(), batch, lambda out, _: out.square().sum(), steps=10)
    assert [r for r in refs if r() is not None] == []
    assert counts[-1] == counts[1], counts  # the first step creates the collector's lasting state (workspace)


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_steps_keep_none_of_their_tensors_without_gc(name):
    """Every path of the hooks: position tables, tied and packed layers, convolutions, dropout in training."""
    torch.manual_seed(0)
    entry = ZOO[name]
    refs, counts = measured_steps(entry.make(), lambda: entry.batch(B), entry.loss, steps=5)
    assert [r for r in refs if r() is not None] == []
    assert counts[-1] == counts[1], counts


def test_a_dropped_all_grads_hook_fires_no_more_and_the_graph_holds_nothing_of_it():
    x = torch.randn(3, requires_grad=True)
    a, b = x * 2, x * 3
    got: list[list[Any]] = []
    fn = got.append
    hook = AllGradsHook([a, b], fn)
    (a.sum() + b.sum()).backward(retain_graph=True)
    assert len(got) == 1
    torch.testing.assert_close(got[0][0], torch.ones(3))
    assert got[0][1] is not None
    owner = weakref.ref(hook)
    del hook
    assert owner() is None  # the tensors' hooks hold it weakly: no cycle through the nodes
    (a.sum() + b.sum()).backward()
    assert len(got) == 1


class Classifier(pl.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, y = batch
        return F.cross_entropy(self.net(ids), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class LiveTensors(pl.Callback):
    """The live tensors at each batch's end, after a collection (a leak is what survives it)."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_batch_end(self, *_: Any) -> None:
        gc.collect()
        self.counts.append(live_tensors())


@pytest.mark.parametrize("name", ["attention", "encoder-layer", "lstm"])
def test_the_probe_measuring_every_step_holds_no_more_tensors_as_the_steps_go(name):
    """A fit measuring each of 12 steps: over its last 4 steps the live tensors stay as they are (the probe's own
    state is filled by then; before the fix each step kept its ids and its attention's or recurrent layer's
    activations)."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randint(0, VOCAB, (96, T)), torch.randint(0, 3, (96,)))
    probe, counter, logger = BatchVarianceProbe(measure_every_n_steps=1), LiveTensors(), RecordingLogger()
    trainer = pl.Trainer(**trainer_kwargs(max_steps=12, callbacks=[probe, counter], logger=logger, log_every_n_steps=1))
    trainer.fit(Classifier(MODELS[name]()), DataLoader(data, batch_size=8))
    assert len(logger.values("grad_noise/trace_cov")) == 12 and not probe._excluded
    assert len(set(counter.counts[-4:])) == 1, counter.counts  # before the fix: 7 to 10 tensors more a step
