"""core.memory against hand counts, the Korthikanti et al. transformer count and real checkpointing."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

from trainvitals.memory import (
    OUTSIDE,
    ROOT,
    GraphLeakFinding,
    HeldGraphTracker,
    ModelStateBytes,
    SavedTensorRecorder,
    StepMemory,
    byte_unit,
    categories,
    checkpoint_peak,
    checkpoint_savings,
    element_bytes,
    format_bytes,
    graph_holders,
    largest_batch,
    mixed_precision_savings,
    model_state_bytes,
    rank_remedies,
    remedies,
    tensors_in,
    transformer_layer_activation_bytes,
    unique_storage_bytes,
    whole_forward_modules,
)
from trainvitals.memory.categories import AllocatorStats, MemoryCategory, category_markdown, category_metrics
from trainvitals.memory.recorder import SavedTensorReport, compiled_modules
from trainvitals.memory.remedies import Remedy
from trainvitals.plumbing.extra_forward import extra_forward
from trainvitals.tags import MEMORY_BYTES

F32 = 4  # bytes per float32 element


def record(module, *inputs, exclude=(), loss_fn=None):
    """One forward of ``module`` under a recorder; returns the report and the loss (not yet backpropagated)."""
    with SavedTensorRecorder(module, exclude=exclude) as rec:
        out = module(*inputs)
        loss = loss_fn(out) if loss_fn is not None else out.sum()
    return rec, rec.report(), loss


def test_mlp_saved_bytes_per_module_match_the_hand_count():
    B, D, H, C = 5, 3, 7, 4
    mlp = nn.Sequential(nn.Linear(D, H), nn.LayerNorm(H), nn.Tanh(), nn.Dropout(0.5), nn.Linear(H, C))
    x, y = torch.randn(B, D), torch.randint(0, C, (B,))
    _, report, _ = record(mlp, x, exclude=[x, y], loss_fn=lambda out: F.cross_entropy(out, y))
    assert report.by_module == {
        # LayerNorm: its input, and the per-row mean and reciprocal std; weight and bias are parameters.
        "1": F32 * (B * H + 2 * B),
        "2": F32 * B * H,  # Tanh: its output
        "3": F32 * B * H,  # dropout on CPU multiplies by a float mask and saves the mask
        "4": F32 * B * H,  # Linear: its input (the dropout output); weight.t() is a parameter view
        # log_softmax saves its output, nll_loss the same storage again (counted once) and a 0-d total
        # weight; the target is the batch.
        OUTSIDE: F32 * (B * C + 1),
    }
    # The first Linear saved the batch and weight.t() only: nothing of its own.
    assert "0" not in report.by_module
    assert report.total_bytes == sum(report.by_module.values())
    log_probs = next(s for s in report.storages.values() if s.nbytes == F32 * B * C)
    assert log_probs.savers == (OUTSIDE, OUTSIDE)


def test_a_forward_of_trainvitals_own_inside_a_recorded_step_is_not_recorded():
    """The batch-independence check calls the model with grad, the lr advisor on the batch twice over, both
    perhaps inside the profiled step: inside ``extra_forward`` their saves and modules are not the step's."""
    B, D, H, C = 5, 3, 7, 4
    mlp = nn.Sequential(nn.Linear(D, H), nn.LayerNorm(H), nn.Tanh(), nn.Linear(H, C))
    x, y = torch.randn(B, D), torch.randint(0, C, (B,))
    _, alone, _ = record(mlp, x, exclude=[x, y], loss_fn=lambda out: F.cross_entropy(out, y))
    with SavedTensorRecorder(mlp, exclude=[x, y]) as rec:
        with extra_forward():
            F.cross_entropy(mlp(torch.cat([x, x])), torch.cat([y, y])).backward()
        loss = F.cross_entropy(mlp(x), y)
    report = rec.report()
    del loss
    assert report.by_module == alone.by_module and report.total_bytes == alone.total_bytes > 0
    assert {m: len(keys) for m, keys in report.module_inputs.items()} == {
        m: len(keys) for m, keys in alone.module_inputs.items()
    }


def test_buffers_parameters_and_tied_weights_are_not_activations():
    B, H = 6, 5
    bn = nn.BatchNorm1d(H)
    x = torch.randn(B, H, requires_grad=True)
    _, report, _ = record(bn, x)
    # Input, save_mean, save_invstd; weight, running_mean, running_var are a parameter and buffers.
    assert report.by_module == {ROOT: F32 * (B * H + 2 * H)}

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.out = nn.Linear(4, 10, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, i):
            return self.out(self.emb(i))

    tied = Tied()
    assert unique_storage_bytes(tied.parameters()) == F32 * 10 * 4  # one storage, counted once
    i = torch.randint(0, 10, (3,))
    _, report, _ = record(tied, i, exclude=[i])
    assert report.by_module == {"out": F32 * 3 * 4}  # the embedding saved only the indices (the batch)


def test_innermost_module_owns_the_bytes_and_views_share_a_storage():
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(4, 8), nn.Sigmoid())

        def forward(self, x):
            h = self.inner(x)
            return (h[:, :3] * h[:, 3:6]).sum()  # two views of the sigmoid output, saved by mul

    x = torch.randn(2, 4)
    _, report, _ = record(Outer(), x, exclude=[x], loss_fn=lambda out: out)
    assert report.by_module == {"inner.1": F32 * 2 * 8}
    (storage,) = report.storages.values()
    assert storage.savers == ("inner.1", ROOT, ROOT)


def test_transformer_block_matches_korthikanti_within_ten_percent():
    # Korthikanti et al. 2022, §4.1: s·b·h·(34 + 5as/h) bytes in fp16 (masks 1 byte).
    assert transformer_layer_activation_bytes(8, 2, 16, 4) == 8 * 2 * 16 * (34 + 5 * 4 * 8 / 16)

    class Block(nn.Module):
        """Pre-LN block with explicit softmax attention and dropout where Megatron has it."""

        def __init__(self, h, a, p=0.1):
            super().__init__()
            self.a = a
            self.ln1, self.qkv, self.proj = nn.LayerNorm(h), nn.Linear(h, 3 * h), nn.Linear(h, h)
            self.drop_attn, self.drop1, self.drop2 = nn.Dropout(p), nn.Dropout(p), nn.Dropout(p)
            self.ln2, self.fc1, self.act = nn.LayerNorm(h), nn.Linear(h, 4 * h), nn.GELU()
            self.fc2 = nn.Linear(4 * h, h)

        def forward(self, x):
            s, b, h = x.shape
            heads = lambda t: t.reshape(s, b * self.a, h // self.a).transpose(0, 1)  # noqa: E731
            q, k, v = map(heads, self.qkv(self.ln1(x)).chunk(3, dim=-1))
            probs = self.drop_attn(torch.softmax(q @ k.transpose(1, 2) / math.sqrt(h // self.a), dim=-1))
            x = x + self.drop1(self.proj((probs @ v).transpose(0, 1).reshape(s, b, h)))
            return x + self.drop2(self.fc2(self.act(self.fc1(self.ln2(x)))))

    s, b, h, a = 32, 4, 64, 4
    x = torch.randn(s, b, h, requires_grad=True)  # the block input is an activation, not the batch
    _, report, _ = record(Block(h, a), x)
    # fp32 (4-byte floats) and CPU dropout, which saves a float mask: 4 bytes per mask element.
    expected = transformer_layer_activation_bytes(s, b, h, a, float_bytes=F32, mask_bytes=F32)
    assert report.total_bytes == pytest.approx(expected, rel=0.10)
    # The attention-score terms, a·s²·b elements each: the dropout owns its mask; the softmax output
    # and the dropout output are saved by ops in the block's own forward.
    assert report.by_module["drop_attn"] == F32 * a * s * s * b


def test_optimizer_state_bytes_after_the_first_step():
    def stepped(make_optimizer):
        model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))
        opt = make_optimizer(model.parameters())
        model(torch.randn(3, 6)).sum().backward()
        opt.step()
        return model, opt

    param_bytes = F32 * (6 * 5 + 5 + 5 * 2 + 2)
    model, adam = stepped(lambda p: torch.optim.Adam(p, lr=1e-3))
    n_tensors = len(list(model.parameters()))
    # exp_avg and exp_avg_sq per parameter, plus a 0-d float32 `step` per parameter.
    assert model_state_bytes(model.parameters(), [adam]) == ModelStateBytes(
        param_bytes, param_bytes, 2 * param_bytes + F32 * n_tensors
    )
    model, sgd_momentum = stepped(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    assert model_state_bytes(model.parameters(), [sgd_momentum]).optimizer_state == param_bytes
    model, sgd = stepped(lambda p: torch.optim.SGD(p, lr=0.1))
    assert model_state_bytes(model.parameters(), [sgd]).optimizer_state == 0
    model.zero_grad(set_to_none=True)
    assert model_state_bytes(model.parameters()).gradients == 0


def test_recorder_holds_no_reference_after_backward():
    mlp = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    outputs = []
    for m in mlp:
        m.register_forward_hook(lambda _m, _i, out: outputs.append(StorageWeakRef(out.untyped_storage())))
    x = torch.randn(8, 4)
    rec, report, loss = record(mlp, x, exclude=[x])
    assert report.total_bytes > 0 and rec.held()  # the graph holds its saved tensors until backward
    refs = [r for refs in rec._refs.values() for r in refs]
    loss.backward()
    del loss
    # No gc.collect(): reference counting alone frees them, so there is no cycle through the recorder.
    assert all(r() is None for r in refs)
    assert all(r.expired() for r in outputs)
    assert rec.held() == {}


def test_recorder_removes_its_hooks_and_survives_a_failing_forward():
    class Fails(nn.Module):
        def forward(self, x):
            raise ValueError("boom")

    model = nn.Sequential(nn.Linear(2, 2), Fails())
    rec = SavedTensorRecorder(model)
    with pytest.raises(ValueError, match="boom"), rec:
        model(torch.randn(1, 2))
    assert not rec.active and rec._stack == []
    assert not nn.modules.module._global_forward_pre_hooks and not nn.modules.module._global_forward_hooks
    before = rec.report().total_bytes
    model[0](torch.randn(1, 2, requires_grad=True)).sum()  # saves its input, but not through the recorder
    assert rec.report().total_bytes == before


def test_a_forward_that_raises_inside_the_step_leaves_the_module_stack_right():
    """Module hooks are per module without ``always_call`` (Dynamo recompiles on those): a child whose
    forward raised, caught by its parent, is dropped when the parent's call ends; later saves go to the
    module that makes them."""

    class Fails(nn.Module):
        def forward(self, x):
            raise ValueError("boom")

    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.fails, self.act = Fails(), nn.Tanh()

        def forward(self, x):
            try:
                self.fails(x)
            except ValueError:
                pass
            return self.act(x)

    model = nn.Sequential(Parent(), nn.Sigmoid())
    x = torch.randn(3, 5, requires_grad=True)
    with SavedTensorRecorder(model) as rec:
        y = model(x * 2)  # noqa: F841 (the graph keeps the saves)
    assert rec._stack == []
    assert rec.report().by_module == {"0.act": 3 * 5 * 4, "1": 3 * 5 * 4}
    assert set(rec.report().module_calls) == {"(root)", "0", "0.act", "1"}


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_savings_match_real_checkpointing(use_reentrant):
    class Checkpointed(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=use_reentrant)

    def make():
        torch.manual_seed(0)
        body = nn.Sequential(nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.GELU())
        return nn.Sequential(nn.Linear(16, 64), body, nn.Linear(64, 4))

    x = torch.randn(32, 16)
    _, plain, _ = record(make(), x, exclude=[x])
    model = make()
    model[1] = Checkpointed(model[1])
    _, checkpointed, _ = record(model, x, exclude=[x])
    predicted = checkpoint_savings(plain)["1"]
    # Inside `1`: the Tanh outputs (two) and the GELU input are freed; its input (the first Linear's
    # output) is now saved by the checkpoint instead of by the Tanh: 3 − 1 saved (32, 64) tensors.
    assert predicted == 2 * F32 * 32 * 64
    assert plain.total_bytes - checkpointed.total_bytes == predicted
    # Checkpointing an element-wise op alone costs memory: its input becomes saved too.
    assert checkpoint_savings(plain)["1.0"] == -F32 * 32 * 64


def running_loss_steps(keep_graph: bool, steps: int):
    """A loop that adds each loss to ``self.running_loss`` and backpropagates with retain_graph=True."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
            self.running_loss = torch.zeros(())

    model, tracker, observations = Model(), HeldGraphTracker(), []
    for step in range(steps):
        x = torch.randn(8, 4)
        with SavedTensorRecorder(model, exclude=[x]) as rec:
            loss = model.net(x).pow(2).mean()
        per_step = rec.report().total_bytes
        model.running_loss = model.running_loss + (loss if keep_graph else loss.item())
        loss.backward(retain_graph=True)  # the usual "fix" for backpropagating through running_loss twice
        del loss
        observations.append(tracker.update(step, rec.held()))
    return model, per_step, observations


def test_running_loss_keeps_every_step_graph_alive():
    steps = 5
    model, per_step, seen = running_loss_steps(keep_graph=True, steps=steps)
    assert seen[-1].held_bytes == pytest.approx(steps * per_step, rel=0.10)
    assert [o.leaking for o in seen] == [False] + [True] * (steps - 1)
    assert seen[-1].carried_bytes == (steps - 1) * seen[-1].step_bytes and seen[-1].first_step == 0
    assert graph_holders(model) == ["self.running_loss"]
    finding = GraphLeakFinding(seen[-1].step, seen[-1].held_bytes, seen[-1].step_bytes, 0, ("self.running_loss",))
    assert finding.estimated_bytes == seen[-1].held_bytes
    assert "`self.running_loss`" in finding.message and ".item()" in finding.message


def test_running_loss_as_a_float_stays_flat():
    model, _, seen = running_loss_steps(keep_graph=False, steps=5)
    assert all(o.held_bytes == 0 and not o.leaking for o in seen)
    assert graph_holders(model) == []


def test_graph_holders_search_containers_and_submodules():
    model = nn.Sequential(nn.Linear(2, 2))
    w = torch.ones(2, requires_grad=True)
    model[0].history = [torch.zeros(1), {"last": w * 2}]
    model.fine = (w * 2).detach()
    assert graph_holders(model, prefix="model") == ["model.0.history"]


def live_saved_peak(step, exclude: list[torch.Tensor]) -> int:
    """The most bytes of saved-for-backward storages held at once while ``step`` runs forward and backward,
    from saved-tensor hooks of its own: a storage is held from its first save until the last node that
    saved it releases it (in backward). Checkpoints here are reentrant: the non-reentrant kind keeps its
    recompute's saves away from outer hooks, for the same memory."""
    import weakref

    skip = {t.untyped_storage().data_ptr() for t in exclude}
    held: dict[int, list[int]] = {}  # storage -> [saves alive, bytes]
    current = peak = 0

    def release(key: int) -> None:
        nonlocal current
        held[key][0] -= 1
        if held[key][0] == 0:
            current -= held[key][1]

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal current, peak
        alias, key = t.detach(), t.untyped_storage().data_ptr()
        if key in skip:
            return alias
        entry = held.setdefault(key, [0, t.untyped_storage().nbytes()])
        if entry[0] == 0:
            current += entry[1]
            peak = max(peak, current)
        entry[0] += 1
        weakref.finalize(alias, release, key)
        return alias

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda alias: alias):
        step()
    return peak


@pytest.mark.parametrize("block", [0, 1])
def test_the_peak_of_a_checkpointed_module_is_the_one_measured_with_real_checkpointing(block):
    """Checkpointing a block frees its saved tensors after forward, but backward recomputes it with them
    all held again, next to what was saved before it: checkpointing the first block, which saves most,
    hardly lowers the step's peak."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh()),
        nn.Sequential(nn.Linear(64, 16), nn.Tanh()),
        nn.Linear(16, 2),
    )
    x = torch.randn(16, 8, requires_grad=True)  # reentrant checkpointing recomputes only for inputs that need grad
    excluded = [x, *model.parameters()]
    _, report, _ = record(model, x, exclude=[x])
    name = str(block)
    peak, freed = checkpoint_peak(report, name), checkpoint_savings(report)[name]

    def plain() -> None:
        model(x).sum().backward()

    def checkpointed() -> None:
        h = x
        for i, layer in enumerate(model):
            h = checkpoint(layer, h, use_reentrant=True) if i == block else layer(h)
        h.sum().backward()

    assert live_saved_peak(plain, excluded) == report.total_bytes
    assert live_saved_peak(checkpointed, excluded) == max(peak, report.total_bytes - freed)
    if block == 0:
        assert peak > report.total_bytes - freed


class SharedBlock(nn.Module):
    """One block applied twice (weight sharing, a universal transformer): checkpointing recomputes each
    call on its own, with the other call's saves dropped."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.inp = nn.Sequential(nn.Linear(8, 64), nn.Tanh())
        self.block = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64), nn.Tanh())
        self.head = nn.Linear(64, 2)
        self.checkpointed = checkpointed

    def forward(self, x):
        h = self.inp(x)
        for _ in range(2):
            h = checkpoint(self.block, h, use_reentrant=True) if self.checkpointed else self.block(h)
        return self.head(h)


def test_the_peak_of_a_checkpointed_module_called_twice_is_that_of_its_costlier_call():
    torch.manual_seed(0)
    model, x = SharedBlock(), torch.randn(16, 8, requires_grad=True)
    excluded = [x, *model.parameters()]
    _, report, _ = record(model, x, exclude=[x])
    peak, freed = checkpoint_peak(report, "block"), checkpoint_savings(report)["block"]
    model.checkpointed = True
    measured = live_saved_peak(lambda: model(x).sum().backward(), excluded)
    assert measured == max(peak, report.total_bytes - freed) < report.total_bytes


class UpDown(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 1024), nn.Linear(1024, 64)

    def forward(self, h):
        mid = torch.tanh(self.up(h))
        return torch.tanh(self.down(mid)), mid


class ReusedIntermediate(nn.Module):
    """A block called three times whose first call's intermediate is used again after the third: saved
    outside the block then, but released by the time backward recomputes the later calls."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.block = nn.Sequential(nn.Linear(8, 64), nn.Tanh()), UpDown()
        self.proj, self.head = nn.Linear(1024, 64), nn.Linear(64, 2)
        self.checkpointed = False

    def forward(self, x):
        h = self.inp(x)
        mids = []
        for _ in range(3):
            h, mid = checkpoint(self.block, h, use_reentrant=True) if self.checkpointed else self.block(h)
            mids.append(mid)
        return self.head(h).sum() + self.proj(mids[0]).sum()


def test_the_peak_of_a_call_counts_outside_saves_made_before_it_only():
    torch.manual_seed(0)
    model, x = ReusedIntermediate(), torch.randn(16, 8, requires_grad=True)
    _, report, _ = record(model, x, exclude=[x], loss_fn=lambda out: out)
    model.checkpointed = True
    measured = live_saved_peak(lambda: model(x).backward(), [x, *model.parameters()])
    assert measured == max(checkpoint_peak(report, "block"), report.total_bytes - checkpoint_savings(report)["block"])


def test_largest_batch_and_remedies_closed_form():
    assert largest_batch(1000, 200, 80, 4) == 40  # 800 bytes free at 20 bytes per example
    assert largest_batch(100, 200, 80, 4) == 0
    with pytest.raises(ValueError, match="scaling_bytes"):
        largest_batch(1000, 0, 0, 4)

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            block = nn.Sequential(nn.GELU(), nn.Linear(32, 32), nn.GELU())
            self.net = nn.Sequential(nn.Linear(8, 32), block, nn.Linear(32, 2))

        def forward(self, x):
            return self.net(x)

    B, act = 16, F32 * 16 * 32  # bytes of one (B, 32) float32 activation
    x = torch.randn(B, 8)
    _, report, _ = record(Wrapped(), x, exclude=[x])
    # Each GELU saves its input, the middle and last Linear theirs (the last one's is the block output).
    assert report.total_bytes == 4 * act
    assert mixed_precision_savings(report) == 2 * act
    # Inside net.1: three of them; its input (the first) stays saved by the checkpoint.
    assert checkpoint_savings(report)["net.1"] == 2 * act
    assert whole_forward_modules(report) == {"net"}  # checkpointing it is checkpointing the model

    state = ModelStateBytes(parameters=1000, gradients=1000, optimizer_state=2000)
    memory = StepMemory(state, inputs_bytes=F32 * B * 8, activations=report, batch_size=B, budget_bytes=10**6)
    per_example = (4 * act + F32 * B * 8) / B
    assert memory.largest_batch() == int((10**6 - 4000) / per_example)
    assert dataclasses.replace(memory, batch_size=0).largest_batch() is None  # no batch dimension seen
    assert dataclasses.replace(memory, budget_bytes=None).largest_batch() is None
    remedies = rank_remedies(memory, top_k=2)
    # Checkpointing net.1 frees 2 act after forward, but holds 3 of the 4 again in backward: the peak falls by 1.
    assert [(r.kind, r.target, r.bytes_freed) for r in remedies] == [
        ("mixed precision", "", 2 * act),
        ("activation checkpointing", "net.1", act),
        ("optimizer state", "", 2000),
    ]
    # After forward 2 act stay saved (net.1's input, the last Linear's); but when backward reaches net.1,
    # the last Linear's is freed and net.1's forward runs again: its input and its two saves, 3 act, the peak.
    assert checkpoint_peak(report, "net.1") == 3 * act
    assert remedies[1].largest_batch == int((10**6 - 4000) / (per_example - act / B))
    assert "frees 4.00 KiB after forward" in remedies[1].note and "holding 6.00 KiB" in remedies[1].note
    assert "use_reentrant=False" in remedies[1].note  # the reentrant one recomputes nothing for a batch input
    assert remedies[2].largest_batch == int((10**6 - 2000) / per_example)
    with pytest.raises(ValueError, match="top_k"):
        rank_remedies(memory, top_k=-1)

    # Under accumulation the step time covers every micro-batch's forward, each recomputing net.1 once.
    timed = dataclasses.replace(report, forward_seconds={"net.1": 0.01})
    for micro_batches in (1, 4):
        memory = StepMemory(state, 0, timed, B, step_seconds=0.05 * micro_batches, micro_batches=micro_batches)
        (checkpointing,) = [r for r in rank_remedies(memory, top_k=1) if r.kind == "activation checkpointing"]
        assert checkpointing.extra_compute == pytest.approx(0.2)


def test_for_equal_bytes_the_cheaper_checkpoint_ranks_first():
    class Nested(nn.Module):  # net.1 adds nothing saved to net.1.1: checkpointing either frees the same bytes
        def __init__(self):
            super().__init__()
            inner = nn.Sequential(nn.GELU(), nn.Linear(32, 32), nn.GELU())
            self.net = nn.Sequential(nn.Linear(8, 32), nn.Sequential(nn.Identity(), inner), nn.Linear(32, 2))

        def forward(self, x):
            return self.net(x)

    x = torch.randn(16, 8)
    _, report, _ = record(Nested(), x, exclude=[x])
    assert checkpoint_savings(report)["net.1"] == checkpoint_savings(report)["net.1.1"] > 0
    assert checkpoint_peak(report, "net.1") == checkpoint_peak(report, "net.1.1")
    # The outer module's forward takes 4× the inner one's: 80% of a 0.05 s step against 20%.
    timed = dataclasses.replace(report, forward_seconds={"net.1": 0.04, "net.1.1": 0.01})
    state = ModelStateBytes(parameters=1000, gradients=1000, optimizer_state=0)
    memory = StepMemory(state, 0, timed, 16, step_seconds=0.05)
    ranked = [
        (r.target, r.extra_compute) for r in rank_remedies(memory, top_k=2) if r.kind == "activation checkpointing"
    ]
    assert ranked == [("net.1.1", pytest.approx(0.2)), ("net.1", pytest.approx(0.8))]
    (only,) = [r.target for r in rank_remedies(memory, top_k=1) if r.kind == "activation checkpointing"]
    assert only == "net.1.1"


def test_helpers():
    t = torch.zeros(3)
    assert list(tensors_in({"a": [t, (t, 1)], "b": "x"})) == [t, t]
    assert unique_storage_bytes([t, t[1:], torch.zeros(2)]) == F32 * 5
    assert format_bytes(512) == "512 B" and format_bytes(1536) == "1.50 KiB" and format_bytes(3 * 2**30) == "3.00 GiB"
    assert byte_unit(1023) == (1, "B") and byte_unit(2**20) == (2**20, "MiB") and byte_unit(2**60) == (2**40, "TiB")
    with pytest.raises(ValueError, match="max_steps"):
        HeldGraphTracker(max_steps=0)

    data = torch.zeros(1000, 16)
    assert element_bytes([data[100:132], data[100:132]]) == F32 * 32 * 16  # a batch sliced from a dataset: the slice
    assert element_bytes([data[:64, :3], data[::10][:64]]) == F32 * 64 * (3 + 16)  # columns, strided rows
    assert element_bytes([data[:4].t(), torch.zeros(2)]) == F32 * (4 * 16 + 2)
    assert element_bytes([data[:0]]) == 0
    assert element_bytes([torch.zeros(1, 16).expand(64, 16)]) == F32 * 16  # what the view holds, not repeats
    assert element_bytes([data[:1].expand(50, 16)]) == F32 * 16
    assert element_bytes([data[:, :1].expand(-1, 16)]) == F32 * 1000  # strided and expanded: one column
    seq = torch.zeros(8, 33, dtype=torch.long)
    assert element_bytes([seq[:, :-1], seq[:, 1:]]) == 8 * 8 * 33  # inputs and labels of one sequence batch


def test_buffers_are_model_state_unless_they_share_a_parameter_storage():
    model = nn.BatchNorm1d(8)
    model.register_buffer("mask", torch.ones(100, 100))
    model.register_buffer("alias", model.weight.detach()[:4])
    state = model_state_bytes(model.parameters(), buffers=model.buffers())
    # running mean and var (8 floats each), the int64 batch counter, the mask; the alias is the weight's.
    assert state.buffers == F32 * (2 * 8 + 100 * 100) + 8
    assert state.total == state.parameters + state.buffers == F32 * 2 * 8 + state.buffers


def test_a_saved_tensor_freed_before_backward_is_not_an_activation():
    """A metric computed with grad on saves a softmax output, then drops its graph: backward never holds
    it. With 10 classes the freed storage's address is reused by log_softmax's output, which must be
    counted as its own storage."""
    B, D, H = 256, 32, 64
    for C in (1000, 10):
        model = nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, C))
        x, y = torch.randn(B, D), torch.randint(0, C, (B,))
        with SavedTensorRecorder(model, exclude=[x, y]) as rec:
            logits = model(x)
            accuracy = (logits.softmax(-1).argmax(-1) == y).float().mean()
            loss = F.cross_entropy(logits, y)
        # Tanh's output (also the last Linear's input), log_softmax's output and nll_loss's 0-d total weight.
        assert rec.report().total_bytes == F32 * (B * H + B * C + 1), C
        assert sum(nbytes for nbytes, _ in rec.held().values()) == F32 * (B * H + B * C + 1)
        loss.backward()
        del accuracy


class PackedProjection(nn.Module):
    """One packed (3H, H) weight split into three projections, as nn.MultiheadAttention's in_proj."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3 * hidden, hidden) / hidden**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.weight.chunk(3)
        return F.linear(x, q) + F.linear(x, k) * F.linear(x, v)


def test_autocast_weight_copies_are_fixed_bytes_not_activations():
    """Under bf16 autocast a Linear saves a bf16 copy of its weight — cached for the autocast region
    (trainable), made per use (frozen: no grad_fn links it to the weight), or of a slice of a packed
    weight: the same bytes at any batch size."""
    D, H, C = 64, 256, 2
    model = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, H), nn.ReLU(), PackedProjection(H), nn.Linear(H, C))
    model[2].requires_grad_(False)  # a frozen layer inside the network still passes gradients through
    # bf16 weights saved for the input gradient: not the first layer's (its input needs none).
    copies = 2 * (H * H + 3 * H * H + H * C)
    reports = {}
    for B in (1, 16):
        x = torch.randn(B, D)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, reports[B], _ = record(model, x, exclude=[x])
        assert reports[B].parameter_copy_bytes == copies
    # The rest scales with the batch.
    assert reports[1].total_bytes > 0 and reports[16].total_bytes == 16 * reports[1].total_bytes
    state = ModelStateBytes(parameters=0, gradients=0, optimizer_state=0)
    memory = StepMemory(state, 0, reports[16], 16, budget_bytes=2**20)
    assert memory.fixed_bytes == copies
    assert memory.largest_batch() == (2**20 - copies) * 16 // reports[16].total_bytes


class Float32Softmax(nn.Module):
    """A softmax in float32 under autocast, as CUDA autocast runs it."""

    def forward(self, x):
        with torch.autocast(x.device.type, enabled=False):
            return torch.softmax(x.float(), -1)


class PartlyAutocast(nn.Module):
    """Autocast around one layer only: the float32 saves of the others are still a remedy."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 512), nn.Linear(512, 512), nn.Linear(512, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.b(h)
        return self.c(torch.tanh(h.float()))


def test_mixed_precision_is_advised_for_the_float32_saved_outside_autocast():
    """The float32 activations autocast keeps (a softmax's, here more than the 16-bit ones) are not a remedy
    left to take; those saved outside an autocast region are."""
    model, x = nn.Sequential(nn.Linear(8, 512), Float32Softmax(), nn.Linear(512, 2)), torch.randn(16, 8)
    state = ModelStateBytes(parameters=0, gradients=0, optimizer_state=0)

    def kinds(report):
        return {r.kind for r in rank_remedies(StepMemory(state, 0, report, 16, budget_bytes=2**20))}

    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            _, report, _ = record(model, x, exclude=[x])
        assert sum(s.nbytes for s in report.storages.values() if s.dtype == torch.float32) >= 16 * 512 * 4
        assert (mixed_precision_savings(report) > 0) is (not autocast)
        assert ("mixed precision" in kinds(report)) is (not autocast)
    _, partly, _ = record(PartlyAutocast(), x, exclude=[x])
    outside = sum(s.nbytes for s in partly.storages.values() if s.dtype == torch.float32 and not s.autocast)
    assert mixed_precision_savings(partly) == outside // 2 > 0 and "mixed precision" in kinds(partly)


class LossInside(nn.Module):
    """Called with keyword arguments only, and computes its loss itself (a Hugging Face model's style)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 1000)

    def forward(self, *, inputs, labels):
        return F.cross_entropy(self.net(inputs), labels)


def test_float32_saved_by_the_loss_under_autocast_is_no_remedy():
    """cross_entropy under autocast keeps its log-softmax in float32, batch × classes: whether computed after
    the model in the training step, outside every module, or inside a model called with keywords only."""
    x, y = torch.randn(16, 8), torch.randint(0, 1000, (16,))
    state = ModelStateBytes(parameters=0, gradients=0, optimizer_state=0)
    model = nn.Sequential(nn.Linear(8, 1000))
    teacher = nn.Linear(8, 1000)  # a frozen teacher, run in float32 and without grad, last before the loss
    distill = nn.ModuleDict({"student": model, "teacher": teacher})

    def distillation_loss(out):
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            target = teacher(x).softmax(-1)
        return F.cross_entropy(out, target)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, after, _ = record(model, x, exclude=[x, y], loss_fn=lambda out: F.cross_entropy(out, y))
        with SavedTensorRecorder(LossInside(), exclude=[x, y]) as rec:
            keep = rec.module(inputs=x, labels=y)  # the loss, alive until the report
        inside = rec.report()
        with SavedTensorRecorder(distill, exclude=[x, y]) as rec:
            kept = distillation_loss(model(x))
        distilled = rec.report()
    for report in (after, inside, distilled):
        assert sum(s.nbytes for s in report.storages.values() if s.dtype == torch.float32) >= 16 * 1000 * 4
        assert mixed_precision_savings(report) == 0
        assert "mixed precision" not in {
            r.kind for r in rank_remedies(StepMemory(state, 0, report, 16, budget_bytes=2**20))
        }
    del keep, kept


def test_an_embedding_lookup_is_an_activation_not_a_parameter_copy():
    """Under autocast the Linear after an Embedding saves the bf16 cast of the lookup: derived from the
    weight, but by a computation, not a view — it grows with the batch."""
    model = nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 4))
    sizes = {}
    for B in (8, 64):
        x = torch.randint(0, 100, (B, 6))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, report, _ = record(model, x, exclude=[x])
        sizes[B] = (report.total_bytes, report.parameter_copy_bytes)
    assert sizes[64][0] == 8 * sizes[8][0] > 0
    assert sizes[8][1] == sizes[64][1]  # the Linear's bf16 weight, the same at any batch


@pytest.mark.parametrize("pruned", ["row", "column"])
def test_a_frozen_parameter_with_a_zero_row_or_column_is_still_recognised(pruned):
    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128))
    model[2].requires_grad_(False)
    with torch.no_grad():
        (model[2].weight[0] if pruned == "row" else model[2].weight[:, 0]).zero_()  # pruned, or padding
    x = torch.randn(4, 128)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, report, _ = record(model, x, exclude=[x])
    assert report.parameter_copy_bytes == 2 * 128 * 128


class ReshapedWeights(nn.Module):
    """Weights used through a copy (``.t().contiguous()``) or an ``unfold`` view: still batch-independent."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(32, 32) / 6)
        self.b = nn.Parameter(torch.randn(32, 32) / 6)

    def forward(self, x):
        h = F.linear(x, self.a.t().contiguous())
        return F.linear(h, self.b.unfold(0, 32, 32).reshape(32, 32))


def test_casts_of_a_copy_or_an_unfold_of_a_parameter_are_parameter_copies():
    copies = {}
    for B in (4, 32):
        x = torch.randn(B, 32, requires_grad=True)  # so that both layers save their weight for the input gradient
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, report, _ = record(ReshapedWeights(), x, exclude=[x])
        copies[B] = report.parameter_copy_bytes
    assert copies[4] == copies[32] == 2 * 2 * 32 * 32


def test_a_zero_activation_is_not_taken_for_a_zero_initialised_frozen_parameter():
    """A frozen parameter is recognised by its first values, which say nothing when they are zeros."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    nn.init.zeros_(model[2].weight)
    model[2].requires_grad_(False)
    x = torch.zeros(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, report, _ = record(model, x, exclude=[x])
    x_cast = next(s for s in report.storages.values() if s.savers == ("0",))  # the first Linear's bf16 input
    assert x_cast.nbytes == 2 * 8 * 8 and x_cast.dtype == torch.bfloat16


def test_the_category_table_drives_the_cuda_rows_and_the_temporaries(monkeypatch):
    """The CUDA rows, off a CUDA device: temporaries are the allocator's peak less every footprint row,
    and grow with the batch only when positive."""
    stats = {
        "allocated_bytes.all.peak": 20_000,
        "reserved_bytes.all.peak": 32_768,
        "num_alloc_retries": 2,
        "num_ooms": 0,
        "allocated_bytes.all.current": 1,
    }
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: stats)
    assert AllocatorStats.read(torch.device("cuda", 0)) == AllocatorStats(20_000, 32_768, 2, 0)
    state = ModelStateBytes(parameters=1000, gradients=1000, optimizer_state=2000, buffers=100)
    report = SavedTensorReport(total_bytes=5000, by_module={}, storages={}, parameter_copy_bytes=300)
    memory = StepMemory(
        state,
        700,
        report,
        4,
        budget_bytes=10**5,
        held_bytes=64,
        allocator=AllocatorStats(peak_allocated_bytes=20_000, peak_reserved_bytes=32_768, alloc_retries=2, ooms=0),
    )
    fixed, scaling = 1000 + 1000 + 2000 + 100 + 300, 700 + 5000
    assert memory.temporaries_bytes == 20_000 - fixed - scaling == 9900
    assert (memory.fixed_bytes, memory.scaling_bytes) == (fixed, scaling + 9900)
    assert memory.largest_batch() == (10**5 - fixed) * 4 // (scaling + 9900)
    assert category_metrics(memory) == {
        "memory/parameters_bytes": 1000,
        "memory/buffers_bytes": 100,
        "memory/gradients_bytes": 1000,
        "memory/optimizer_state_bytes": 2000,
        "memory/inputs_bytes": 700,
        "memory/activations_bytes": 5000,
        "memory/parameter_copies_bytes": 300,
        "memory/held_saved_bytes": 64,
        "memory/peak_allocated_bytes": 20_000,
        "memory/peak_reserved_bytes": 32_768,
        "memory/temporaries_bytes": 9900,
        "memory/alloc_retries": 2,
        "memory/ooms": 0,
    }
    table = category_markdown(memory)
    assert table[0] == "| category | bytes | binary units |"  # every column named
    assert "| CUDA temporaries | 9,900 | 9.67 KiB |" in table and "| CUDA allocator retries | 2 | |" in table
    # Categories that do not all coexist at the peak: negative temporaries, which the batch does not scale.
    crowded = dataclasses.replace(memory, allocator=AllocatorStats(5000, 8192, 0, 0))
    assert crowded.temporaries_bytes == 5000 - fixed - scaling and crowded.scaling_bytes == scaling
    off_cuda = dataclasses.replace(memory, allocator=None)
    assert off_cuda.temporaries_bytes == 0 and "memory/temporaries_bytes" not in category_metrics(off_cuda)
    # The dashboard's byte chart and the report take every bytes row, and no count.
    assert all(bool(re.match(MEMORY_BYTES, c.tag)) == (c.unit == "bytes") for c in categories.MEMORY_CATEGORIES)


def test_a_registered_remedy_rule_is_ranked_with_the_built_in_ones(monkeypatch):
    state = ModelStateBytes(parameters=1000, gradients=1000, optimizer_state=2000)
    report = SavedTensorReport(total_bytes=0, by_module={}, storages={})
    memory = StepMemory(state, 100, report, 4, budget_bytes=10**4)

    def offload_gradients(memory, top_k):
        freed = memory.state.gradients
        return [
            Remedy("gradient offload", "", freed, memory.largest_batch(fixed_freed=freed), None, "to the host"),
            Remedy("nothing", "", 0, None, None, "frees nothing: left out"),
        ]

    monkeypatch.setattr(remedies, "REMEDY_RULES", list(remedies.REMEDY_RULES))
    assert remedies.register_remedy(offload_gradients) is offload_gradients
    ranked = rank_remedies(memory)
    assert [(r.kind, r.bytes_freed) for r in ranked] == [("optimizer state", 2000), ("gradient offload", 1000)]
    assert ranked[1].largest_batch == (10**4 - 3000) * 4 // 100


def test_a_failing_rule_or_category_is_warned_once_and_left_out_and_registering_is_guarded(monkeypatch):
    """A registered rule or a category measure that raised killed the fit; a rule registered twice was
    listed twice; a category with a built-in's key silently replaced its tag."""
    state = ModelStateBytes(parameters=1000, gradients=1000, optimizer_state=2000)
    memory = StepMemory(state, 100, SavedTensorReport(total_bytes=0, by_module={}, storages={}), 4)
    monkeypatch.setattr(remedies, "REMEDY_RULES", list(remedies.REMEDY_RULES))
    monkeypatch.setattr(categories, "MEMORY_CATEGORIES", list(categories.MEMORY_CATEGORIES))
    monkeypatch.setattr(categories, "_FAILED", set())
    expected = [(r.kind, r.bytes_freed) for r in rank_remedies(memory)]
    plain = category_metrics(memory)

    def extra(memory, top_k):
        return [Remedy("extra", "", 10, None, None, "")]

    def broken(memory, top_k):
        return [Remedy("broken", "", memory.state.nonexistent, None, None, "")]

    for rule in (extra, extra, broken):
        remedies.register_remedy(rule)
    assert remedies.REMEDY_RULES.count(extra) == 1
    row = MemoryCategory("scratch", "scratch", lambda m: 1 / 0, "fixed")
    assert categories.register_category(row) is categories.register_category(row)
    assert categories.MEMORY_CATEGORIES.count(row) == 1
    with pytest.raises(ValueError, match="'activations' exists"):
        categories.register_category(MemoryCategory("activations", "again", lambda m: 5, "batch"))
    with pytest.warns(RuntimeWarning) as caught:
        for _ in range(2):
            assert [(r.kind, r.bytes_freed) for r in rank_remedies(memory)] == [*expected, ("extra", 10)]
            assert category_metrics(memory) == plain and memory.fixed_bytes == 4000
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert "remedy rule" in messages[0] and "broken" in messages[0] and "AttributeError" in messages[0]
    assert "memory category 'scratch'" in messages[1] and "ZeroDivisionError" in messages[1]


def test_a_compiled_submodule_gets_no_hooks_and_its_saves_go_to_its_wrapper():
    """A hook inside a compiled region breaks its graph: the recorder hooks the modules outside it, one by
    one, and what the compiled graph saves is the wrapper's, whole."""
    import torch._dynamo

    def model(inner: nn.Module) -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), inner, nn.Linear(16, 2))

    x = torch.randn(4, 8)
    _, eager, _ = record(model(nn.Sequential(nn.Tanh(), nn.Linear(16, 16), nn.GELU())), x, exclude=[x])
    assert eager.by_module == {"1.0": F32 * 4 * 16, "1.2": F32 * 4 * 16, "2": F32 * 4 * 16}

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = model(torch.compile(nn.Sequential(nn.Tanh(), nn.Linear(16, 16), nn.GELU()), backend="aot_eager"))
    regions, hooked = compiled_modules(compiled)
    assert regions == ["1"] and hooked == [compiled, compiled[0], compiled[1], compiled[2]]
    rec, report, loss = record(compiled, x, exclude=[x])
    loss.backward()
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert rec.compiled == ["1"]
    assert report.by_module == {"1": eager.by_module["1.0"] + eager.by_module["1.2"], "2": eager.by_module["2"]}
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in compiled.modules())

    whole = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
    whole[1].compile(backend="aot_eager")  # its whole call, hooks and all, runs compiled
    assert compiled_modules(whole) == (["1"], [whole, whole[0]])
