"""MemoryTopologyProfiler in real fits against hand counts, a running-loss leak and real checkpointing."""

from __future__ import annotations

import csv
import re
import sys
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from _models import ReleaseProcessGroup
from conftest import RecordingLogger, trainer_kwargs
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from trainvitals.memory import OUTSIDE, categories, checkpoint_savings
from trainvitals.memory.categories import MemoryCategory
from trainvitals.memory.profiler import MemoryTopologyProfiler
from trainvitals.tags import MEMORY_BYTES
from trainvitals.tensorboard.layout import TRAINVITALS_LAYOUT
from trainvitals.text.terminal import inline, markdown_to_text

B, D, H, C = 8, 6, 16, 3  # batch, inputs, hidden units, classes
F32, I64 = 4, 8


def classification_loader(n: int = 64, batch_size: int = B) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, D, generator=g), torch.randint(0, C, (n,), generator=g))
    return DataLoader(data, batch_size=batch_size, shuffle=False)


class Classifier(pl.LightningModule):
    """Linear(D→H) → Tanh → Linear(H→C), cross-entropy.

    Saved per batch of ``b``, by hand: Tanh its output (b·H floats; the second Linear saves the same
    storage again); outside any module, log_softmax its output (b·C floats, saved again by nll_loss)
    and nll_loss a 0-d total weight. The first Linear saves only the batch; weights are parameters.
    """

    def __init__(self, optimizer: str = "adam", body: nn.Module | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D, H), body or nn.Tanh(), nn.Linear(H, C))
        self.optimizer = optimizer

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.Adam(self.parameters(), lr=1e-3)


PARAM_BYTES = F32 * (D * H + H + H * C + C)
ACTIVATION_BYTES = F32 * (B * H + B * C + 1)


def fit(model, profiler, logger=None, loader=None, extra_callbacks=(), **overrides):
    trainer = Trainer(**trainer_kwargs(callbacks=[profiler, *extra_callbacks], logger=logger or False, **overrides))
    trainer.fit(model, loader or classification_loader())
    return trainer


def test_logged_bytes_match_the_hand_count():
    logger = RecordingLogger()
    fit(Classifier(), MemoryTopologyProfiler(measure_every_n_steps=100, first_steps=1), logger, max_steps=2)
    assert all([step for step, _ in values] == [0] for values in logger.series.values())
    first = {tag: values[0][1] for tag, values in logger.series.items()}
    assert first == {
        "memory/parameters_bytes": PARAM_BYTES,
        "memory/gradients_bytes": PARAM_BYTES,
        # Adam after its first step: two moments and a 0-d float32 step counter per parameter tensor.
        "memory/optimizer_state_bytes": 2 * PARAM_BYTES + 4 * F32,
        "memory/buffers_bytes": 0,
        "memory/inputs_bytes": F32 * B * D + I64 * B,
        "memory/activations_bytes": ACTIVATION_BYTES,
        "memory/parameter_copies_bytes": 0,
        "memory/activations/net.1": F32 * B * H,
        f"memory/activations/{OUTSIDE}": F32 * (B * C + 1),
        "memory/held_saved_bytes": 0,
    }


def test_a_compiled_model_is_profiled_without_compiling_the_profilers_hooks():
    """Dynamo traced the profiler's module hooks inside a compiled model, guarded on the module name each
    handled, and recompiled them per module until its limit (with a warning each time). The hooks run as
    plain Python, and twice the profiled steps compile nothing more."""
    import torch._dynamo

    frames = []
    for steps in (8, 16):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        logger = RecordingLogger()
        trainer = Trainer(
            **trainer_kwargs(
                callbacks=[MemoryTopologyProfiler(measure_every_n_steps=2)], logger=logger, max_steps=steps
            )
        )
        trainer.fit(torch.compile(Classifier(), backend="eager"), classification_loader())
        frames.append(torch._dynamo.utils.counters["frames"]["total"])
        resumed = " ".join(torch._dynamo.utils.counters["resumes"])
        assert not any(hook in resumed for hook in ("_enter_module", "_leave_module", "_pack"))
        profiled = logger.values("memory/activations_bytes")
        assert len(profiled) >= steps // 2 and set(profiled) == {ACTIVATION_BYTES}  # as eager
    assert frames[1] == frames[0]


class SavedByTheCompiledGraph(Callback):
    """Bytes of the tensors a compiled step saved, read by walking its graph from the loss before backward
    (no saved-tensor hooks): the saved tensors of the compiled graphs' autograd Functions, parameters and
    the batch left out, by storage. (The eager nodes after them hold Lightning's loss scaling.)"""

    def __init__(self) -> None:
        self.bytes: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._batch = [t.untyped_storage().data_ptr() for t in batch]

    def on_before_backward(self, trainer, pl_module, loss):
        excluded = {p.untyped_storage().data_ptr() for p in pl_module.parameters()} | set(self._batch)
        sizes, nodes, seen = {}, [loss.grad_fn], set()
        while nodes:
            node = nodes.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            for t in getattr(node, "saved_tensors", ()):
                if t.untyped_storage().data_ptr() not in excluded:
                    sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            nodes += [next_node for next_node, _ in node.next_functions]
        self.bytes.append(sum(sizes.values()))


def test_a_compiled_model_keeps_its_graphs_and_its_saved_bytes_under_the_profiler(caplog):
    """A hook inside a compiled region, even one Dynamo may not trace, breaks the graph there; the broken
    graphs stay cached after fit and save other tensors. The profiler hooks nothing inside a compiled
    model and says so once: the same graphs and breaks as without it, and the saved bytes of the graph
    that runs without it."""
    import torch._dynamo

    def compiled_fit(*callbacks):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        torch.manual_seed(0)
        walk = SavedByTheCompiledGraph()
        trainer = Trainer(**trainer_kwargs(callbacks=[*callbacks, walk], max_steps=3))
        trainer.fit(torch.compile(Classifier(), backend="aot_eager"), classification_loader())
        counters = torch._dynamo.utils.counters
        return trainer, walk.bytes, (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))

    _, plain_bytes, plain_graphs = compiled_fit()
    profiler = MemoryTopologyProfiler(measure_every_n_steps=1, verbose=False)
    with caplog.at_level("INFO"):
        trainer, walked, graphs = compiled_fit(profiler)
    assert graphs == plain_graphs and plain_graphs[0] >= 1
    assert walked == plain_bytes and profiler.last_metrics["memory/activations_bytes"] == plain_bytes[-1] > 0
    assert profiler.last.activations.by_module == {"(root)": plain_bytes[-1]}
    assert caplog.text.count("the training step runs under torch.compile; the profiler steps aside") == 1
    # Nothing of the profiler is left on the model.
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in trainer.lightning_module.modules())


class CompiledHelper(Classifier):
    """The network run by a compiled method that is not ``forward``."""

    @torch.compile(backend="aot_eager")
    def encode(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.encode(x), y)


class CompiledFunction(Classifier):
    """The network run by a compiled function that calls the submodules."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = torch.compile(lambda x: self.net(x), backend="aot_eager")

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.encode(x), y)


@pytest.mark.parametrize("model", [CompiledHelper, CompiledFunction])
@pytest.mark.parametrize("measure_every_n_steps", [1, 2])
def test_a_compiled_helper_keeps_its_graphs_under_the_profiler(model, measure_every_n_steps):
    """A compiled method or function that calls submodules is not seen as a compiled module: the profiler's
    hooks on those submodules broke its graph at each call (a disabled function) and the fit ran
    uncompiled. The hooks step aside while Dynamo traces: no break, the graph without the profiler (and
    one more, cached, for the steps without hooks), its saved bytes as one block outside every hooked
    module, with the loss's (log_softmax's output and nll_loss's total weight)."""
    import torch._dynamo

    def compiled_fit(*callbacks):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        torch.manual_seed(0)
        walk = SavedByTheCompiledGraph()
        Trainer(**trainer_kwargs(callbacks=[*callbacks, walk], max_steps=4)).fit(model(), classification_loader())
        counters = torch._dynamo.utils.counters
        return walk.bytes, counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())

    plain_bytes, plain_graphs, plain_breaks = compiled_fit()
    profiler = MemoryTopologyProfiler(first_steps=1, measure_every_n_steps=measure_every_n_steps, verbose=False)
    walked, graphs, breaks = compiled_fit(profiler)
    assert plain_graphs == 1 and breaks == plain_breaks == 0
    assert graphs == (1 if measure_every_n_steps == 1 else 2)
    assert walked == plain_bytes and plain_bytes[-1] > 0
    total = plain_bytes[-1] + B * C * F32 + F32
    assert profiler.last.activations.by_module == {OUTSIDE: total}


def test_schedule_first_steps_and_every_n_and_accumulation():
    logger = RecordingLogger()
    fit(
        Classifier(optimizer="sgd"),
        MemoryTopologyProfiler(measure_every_n_steps=4, first_steps=2),
        logger,
        max_steps=10,
    )
    assert [step for step, _ in logger.series["memory/activations_bytes"]] == [0, 1, 4, 8]
    assert set(logger.values("memory/optimizer_state_bytes")) == {PARAM_BYTES}  # SGD momentum: 1 ×

    # Under accumulation the step is complete (optimizer state and all) at the second micro-batch.
    logger = RecordingLogger()
    fit(
        Classifier(),
        MemoryTopologyProfiler(measure_every_n_steps=1, first_steps=0),
        logger,
        max_steps=3,
        accumulate_grad_batches=2,
    )
    assert [step for step, _ in logger.series["memory/activations_bytes"]] == [0, 1, 2]
    assert logger.values("memory/optimizer_state_bytes")[0] == 2 * PARAM_BYTES + 4 * F32


class RunningLoss(Classifier):
    """Adds every loss to ``self.running_loss`` and backpropagates with ``retain_graph=True``, the usual
    "fix" for the error of backpropagating through it twice. ``as_float`` is the control: ``.item()``."""

    def __init__(self, as_float: bool) -> None:
        super().__init__()
        self.as_float = as_float
        self.running_loss = torch.zeros(())

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.running_loss = self.running_loss + (loss.item() if self.as_float else loss)
        return loss

    def backward(self, loss, *args, **kwargs):
        loss.backward(retain_graph=True)


def test_running_loss_leak_is_found_and_named():
    steps = 6
    logger, profiler = RecordingLogger(), MemoryTopologyProfiler(measure_every_n_steps=1)
    with pytest.warns(UserWarning, match=r"kept alive across steps.*`self\.running_loss`"):
        fit(RunningLoss(as_float=False), profiler, logger, max_steps=steps)
    held = logger.values("memory/held_saved_bytes")
    per_step = logger.values("memory/activations_bytes")[0]
    assert held[-1] == pytest.approx(steps * per_step, rel=0.10)
    assert all(b > a for a, b in zip(held, held[1:]))  # grows step over step
    (finding,) = profiler.findings
    assert finding.holders == ("self.running_loss",) and finding.since_step == 0 and finding.step == steps - 1
    assert "self.running_loss" in profiler.summary_markdown()

    fit(RunningLoss(as_float=True), profiler, max_steps=steps)  # the next fold, fixed: a clean record
    assert profiler.findings == [] and "self.running_loss" not in profiler.summary_markdown()


def test_running_loss_as_a_float_stays_flat_and_reports_nothing():
    logger, profiler = RecordingLogger(), MemoryTopologyProfiler(measure_every_n_steps=1)
    fit(RunningLoss(as_float=True), profiler, logger, max_steps=6)
    # The retained graph of each step has no holder left by the step's end: it is freed with the loss.
    assert logger.values("memory/held_saved_bytes") == [0.0] * 6
    assert profiler.findings == []


def _all_callbacks(reverse: bool) -> list[Callback]:
    """Every trainvitals callback, the profiler measuring each step, in one order or its reverse."""
    from trainvitals import (
        BatchVarianceProbe,
        GradNormEarlyStopping,
        GradNormMonitor,
        GraphIntegrityCallback,
        LRScalingAdvisor,
        TrainingGuard,
        TrainvitalsDashboard,
    )

    callbacks = [
        GraphIntegrityCallback(check_every_n_steps=2, dead_after_steps=1),
        GradNormMonitor(),
        BatchVarianceProbe(measure_every_n_steps=1),
        GradNormEarlyStopping(verbose=False),
        LRScalingAdvisor(),
        MemoryTopologyProfiler(measure_every_n_steps=1),
        TrainvitalsDashboard(progress_bar=False),
        TrainingGuard(),
    ]
    return callbacks[::-1] if reverse else callbacks


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reversed"])
def test_what_another_callback_reads_from_the_graph_is_not_held_in_either_order(reverse):
    """Under accumulation, GraphIntegrityCallback's micro-batch check keeps the divisor cross-entropy saved
    (nll_loss's 0-d total weight, B = 8) until its window closes: its own read of the graph, not the graph.
    Nothing is held after any step, whichever the callbacks' order; the running-loss leak still is."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the stopper's min_steps outlasts the fit: meant
        logger = RecordingLogger()
        callbacks = _all_callbacks(reverse)
        fit(Classifier(), callbacks[0], logger, extra_callbacks=callbacks[1:], max_steps=4, accumulate_grad_batches=2)
    assert logger.values("memory/held_saved_bytes") == [0.0] * 4
    assert logger.values("memory/activations_bytes") == [ACTIVATION_BYTES] * 4

    callbacks = _all_callbacks(reverse)
    profiler = next(cb for cb in callbacks if isinstance(cb, MemoryTopologyProfiler))
    leaking = RecordingLogger()
    with pytest.warns(UserWarning, match=r"kept alive across steps.*`self\.running_loss`"):
        fit(RunningLoss(as_float=False), callbacks[0], leaking, extra_callbacks=callbacks[1:], max_steps=4)
    held = leaking.values("memory/held_saved_bytes")
    assert held[-1] == pytest.approx(4 * ACTIVATION_BYTES, rel=0.10) and all(b > a for a, b in zip(held, held[1:]))
    assert profiler.findings[0].holders == ("self.running_loss",)


class _OutputsMustDie(Callback):
    """Weak references to every module output of a profiled step; all dead at the step's end."""

    def __init__(self) -> None:
        self.refs: list[StorageWeakRef] = []
        self.checked = 0

    def on_train_batch_start(self, trainer, pl_module, *_):
        self.refs.clear()

        def keep(_module, _args, out):
            self.refs.append(StorageWeakRef(out.untyped_storage()))

        self.handles = [m.register_forward_hook(keep) for m in pl_module.modules()]

    def on_train_batch_end(self, trainer, pl_module, *_):
        for h in self.handles:
            h.remove()
        assert self.refs and all(r.expired() for r in self.refs)
        self.checked += 1


def test_profiler_holds_no_reference_after_a_step():
    probe, profiler = _OutputsMustDie(), MemoryTopologyProfiler(measure_every_n_steps=1)
    fit(Classifier(), profiler, extra_callbacks=[probe], max_steps=3)
    assert probe.checked == 3
    assert profiler._tracker._steps == {}  # nothing held, so not even weak references are kept


class _Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False)


def _body() -> nn.Module:
    return nn.Sequential(nn.GELU(), nn.Linear(H, H), nn.GELU(), nn.Linear(H, H), nn.GELU())


def test_checkpointing_the_advised_module_frees_the_predicted_bytes():
    logger, profiler = RecordingLogger(), MemoryTopologyProfiler(first_steps=1, memory_budget_bytes=2**20)
    fit(Classifier(body=_body()), profiler, logger, max_steps=1)
    top = next(r for r in profiler.remedies if r.kind == "activation checkpointing")
    assert top.target == "net.1"  # `net` is the whole forward
    assert 0 < top.extra_compute < 1
    before = logger.values("memory/activations_bytes")[0]

    model = Classifier(body=_body())
    model.net[1] = _Checkpointed(model.net[1])
    logger = RecordingLogger()
    fit(model, MemoryTopologyProfiler(first_steps=1), logger, max_steps=1)
    after = logger.values("memory/activations_bytes")[0]
    assert before - after == pytest.approx(checkpoint_savings(profiler.last.activations)["net.1"], rel=0.05)
    assert 0 < top.bytes_freed <= before - after  # at the step's peak, where backward recomputes it


def test_largest_batch_with_a_budget():
    budget = 100_000
    logger = RecordingLogger()
    fit(
        Classifier(optimizer="sgd"),
        MemoryTopologyProfiler(first_steps=1, memory_budget_bytes=budget),
        logger,
        max_steps=1,
    )
    fixed = 3 * PARAM_BYTES  # parameters, gradients, momentum
    per_example = (ACTIVATION_BYTES + F32 * B * D + I64 * B) / B
    assert logger.values("memory/largest_batch") == [int((budget - fixed) / per_example)]


def test_a_new_category_row_reaches_the_scalars_the_table_the_tags_and_the_budget(monkeypatch):
    """Adding a memory category is one row of MEMORY_CATEGORIES: here a fixed 1000-byte workspace."""
    budget = 100_000
    plain = MemoryTopologyProfiler(first_steps=1, memory_budget_bytes=budget, verbose=False)
    fit(Classifier(optimizer="sgd"), plain, max_steps=1)
    row = MemoryCategory("workspace", "workspace (reserved)", lambda m: 1000, footprint="fixed")
    monkeypatch.setattr(categories, "MEMORY_CATEGORIES", [*categories.MEMORY_CATEGORIES, row])
    logger, profiler = (
        RecordingLogger(),
        MemoryTopologyProfiler(first_steps=1, memory_budget_bytes=budget, verbose=False),
    )
    fit(Classifier(optimizer="sgd"), profiler, logger, max_steps=1)
    fixed = 3 * PARAM_BYTES + 1000  # parameters, gradients, momentum, the workspace
    per_example = (ACTIVATION_BYTES + F32 * B * D + I64 * B) / B
    assert logger.values("memory/workspace_bytes") == [1000]
    assert profiler.last_metrics == {
        **plain.last_metrics,
        "memory/workspace_bytes": 1000,
        "memory/largest_batch": int((budget - fixed) / per_example),
    }
    assert "| workspace (reserved) | 1,000 | 1000 B |" in profiler.summary_markdown().splitlines()
    # The report's memory rows and a dashboard chart take it by its tag.
    assert re.match(MEMORY_BYTES, row.tag)
    assert any(
        re.match(regex, row.tag)
        for charts in TRAINVITALS_LAYOUT.values()
        for _, regexes in charts.values()
        for regex in regexes
    )


class KeptKeysAndValues(Classifier):
    """Keeps its last batch's hidden keys and values, detached, for the next step (a Transformer-XL memory, a
    KV cache): 2 · B · H floats that are no parameter, buffer, gradient or saved activation."""

    def forward(self, x):
        h = self.net[1](self.net[0](x))
        self.kv_cache = (h.detach(), h.detach() * 2)
        return self.net[2](h)


@pytest.fixture
def registered_categories():
    """The categories registered in a test are taken back after it (the list itself: its readers hold it)."""
    kept = list(categories.MEMORY_CATEGORIES)
    yield
    categories.MEMORY_CATEGORIES[:] = kept


def test_a_kv_cache_category_is_one_registration_read_from_the_model(registered_categories):
    """A category the step record does not hold is one file's register_category call: its measure reads the
    profiled model (``StepMemory.model``); it reaches the scalars, the table (where it asked to be), the
    largest-batch advice as bytes that grow with the batch, and the report's words."""
    from trainvitals.memory import register_category, unique_storage_bytes
    from trainvitals.report.assess import memory_label

    kv_cache = register_category(
        MemoryCategory(
            "kv_cache", "KV cache", lambda m: unique_storage_bytes(getattr(m.model, "kv_cache", ())), footprint="batch"
        ),
        before="held_saved",
    )
    keys = [c.key for c in categories.MEMORY_CATEGORIES]
    assert keys.index("kv_cache") == keys.index("held_saved") - 1
    budget = 100_000
    logger, profiler = RecordingLogger(), MemoryTopologyProfiler(first_steps=1, memory_budget_bytes=budget)
    fit(KeptKeysAndValues(optimizer="sgd"), profiler, logger, max_steps=1)
    kv_bytes = 2 * F32 * B * H  # by hand: keys and values, (B, H) floats each
    assert logger.values("memory/kv_cache_bytes") == [kv_bytes]
    fixed = 3 * PARAM_BYTES  # parameters, gradients, momentum
    per_example = (ACTIVATION_BYTES + F32 * B * D + I64 * B + kv_bytes) / B
    assert logger.values("memory/largest_batch") == [int((budget - fixed) / per_example)]
    table = profiler.summary_markdown().splitlines()
    row = next(i for i, line in enumerate(table) if line.startswith("| KV cache |"))
    assert table[row] == f"| KV cache | {kv_bytes:,} | {kv_bytes / 1024:.2f} KiB |"
    assert table[row + 1].startswith("| held after backward |")
    assert memory_label("kv_cache") == "KV cache"
    with pytest.raises(ValueError, match="`before`"):
        register_category(MemoryCategory("other", "other", lambda m: 0), before="no_such_key")
    assert kv_cache in categories.MEMORY_CATEGORIES


class FrozenFirstLayer(Classifier):
    """The first Linear frozen (a pretrained feature layer), left out of the optimizer."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd")
        self.net[0].requires_grad_(False)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


def test_frozen_parameters_are_a_row_of_their_own_inside_the_parameters():
    logger, profiler = RecordingLogger(), MemoryTopologyProfiler(first_steps=1, memory_budget_bytes=100_000)
    fit(FrozenFirstLayer(), profiler, logger, max_steps=1)
    frozen, trainable = F32 * (D * H + H), F32 * (H * C + C)
    assert logger.values("memory/frozen_parameters_bytes") == [frozen]
    assert logger.values("memory/parameters_bytes") == [frozen + trainable]
    # No gradient and no momentum for the frozen layer; the fixed footprint counts its bytes once.
    assert logger.values("memory/gradients_bytes") == logger.values("memory/optimizer_state_bytes") == [trainable]
    assert profiler.last.fixed_bytes == frozen + 3 * trainable
    assert f"| of which frozen (no gradient, no optimizer state) | {frozen:,} | {frozen} B |" in (
        profiler.summary_markdown().splitlines()
    )
    assert re.match(MEMORY_BYTES, "memory/frozen_parameters_bytes")
    # A model without frozen parameters logs no such row (test_logged_bytes_match_the_hand_count).


class Masked(Classifier):
    """A 40,000-byte buffer: model state, the same at any batch size."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd")
        self.register_buffer("mask", torch.ones(100, 100))


def test_buffers_are_fixed_and_a_batch_sliced_from_a_resident_dataset_is_the_slice():
    """Batches cut from one tensor that holds the whole dataset (as when it lives on the GPU) are views of
    its storage: the batch is the slice, and the dataset is not a per-example cost."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, D, generator=g), torch.randint(0, C, (64,), generator=g)
    slices = [(x[i : i + B], y[i : i + B]) for i in range(0, 64, B)]
    budget, logger = 100_000, RecordingLogger()
    fit(
        Masked(),
        MemoryTopologyProfiler(first_steps=1, memory_budget_bytes=budget),
        logger,
        max_steps=1,
        loader=DataLoader(slices, batch_size=None),
    )
    assert logger.values("memory/buffers_bytes") == [F32 * 100 * 100]
    assert logger.values("memory/inputs_bytes") == [F32 * B * D + I64 * B]
    fixed = 3 * PARAM_BYTES + F32 * 100 * 100  # parameters, gradients, momentum, the buffer
    per_example = (ACTIVATION_BYTES + F32 * B * D + I64 * B) / B
    assert logger.values("memory/largest_batch") == [int((budget - fixed) / per_example)]


def test_under_accumulation_the_cost_of_checkpointing_counts_every_micro_batch():
    profiler = MemoryTopologyProfiler(first_steps=1)
    fit(Classifier(), profiler, max_steps=1, accumulate_grad_batches=3)
    assert profiler.last is not None and profiler.last.micro_batches == 3


def test_fit_end_table_and_picture_in_tensorboard(tmp_path, caplog):
    pytest.importorskip("matplotlib")
    logger = TensorBoardLogger(tmp_path, name="tb", default_hp_metric=False)
    profiler = MemoryTopologyProfiler(first_steps=1, verbose=True)
    with caplog.at_level("INFO"):
        fit(Classifier(body=_body()), profiler, logger, max_steps=2)
    table = profiler.summary_markdown()
    for heading in ("### Saved for backward, by module", "### Advice", "### Findings"):
        assert heading in table
    # No title of its own (the panel, the report and the demo name it), and no empty header cell.
    assert table.startswith("Step 0, batch of 8 ")
    lines = table.splitlines()
    headers = [line for line, below in zip(lines, lines[1:]) if below.startswith("|--") or below.startswith("| --")]
    assert len(headers) == 3 and all(cell.strip() for line in headers for cell in line.strip("|").split("|")), headers
    assert "`net.1.4`" in table and "activation checkpointing of `net.1`" in table
    assert "pass `memory_budget_bytes`" in table  # CPU without a budget: no batch advice
    # Printed as plain text with the callback's prefix, the markdown goes to TensorBoard.
    assert (
        f"trainvitals MemoryTopologyProfiler: memory at the last profiled step\n{markdown_to_text(table)}"
        in caplog.text
    )
    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0, "tensors": 0}).Reload()
    assert "memory/saved_bytes_by_module" in events.Tags()["images"]
    assert any(tag.startswith("memory/report") for tag in events.Tags()["tensors"])
    assert "memory/activations/net.1.4" in events.Tags()["scalars"]


def test_each_remedy_is_one_line_of_the_table_and_its_note_one_line_below_it():
    profiler = MemoryTopologyProfiler(first_steps=1, memory_budget_bytes=2**20, verbose=False)
    fit(Classifier(body=_body()), profiler, max_steps=1)
    assert len(profiler.remedies) >= 3 and any(len(r.note) > 60 for r in profiler.remedies)
    text = markdown_to_text(profiler.summary_markdown())
    advice = text.split("Advice, the most bytes off the step's peak first", 1)[1].split("Findings", 1)[0].splitlines()
    rows = [line for line in advice if line[:1].isdigit()]
    assert [line.split()[0] for line in rows] == [str(i) for i in range(1, len(profiler.remedies) + 1)]
    for rank, remedy in enumerate(profiler.remedies, 1):
        assert f"- {rank}: {inline(remedy.note)}" in advice  # the whole note, on one line
    assert not [line for line in advice if line.startswith(" ")]  # no row wrapped under itself


def test_without_matplotlib_the_picture_is_skipped_with_one_notice(monkeypatch, caplog):
    profiler = MemoryTopologyProfiler(first_steps=1)
    fit(Classifier(), profiler, max_steps=1)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # import fails
    with caplog.at_level("INFO"):
        assert profiler.picture() is None and profiler.picture() is None
    assert caplog.text.count("the picture needs matplotlib") == 1


def test_state_survives_a_checkpoint(tmp_path):
    profiler = MemoryTopologyProfiler(measure_every_n_steps=1)
    with pytest.warns(UserWarning, match="kept alive"):
        trainer = fit(RunningLoss(as_float=False), profiler, max_steps=3)
    path = tmp_path / "leak.ckpt"
    trainer.save_checkpoint(path)
    restored = MemoryTopologyProfiler(measure_every_n_steps=1)
    restored.load_state_dict(torch.load(path, weights_only=False)["callbacks"][restored.state_key])
    assert restored.findings == profiler.findings and restored._last_profiled_step == 2
    assert MemoryTopologyProfiler(measure_every_n_steps=2).state_key != restored.state_key
    fresh = MemoryTopologyProfiler()
    fresh.load_state_dict({})  # an older checkpoint without the keys
    assert fresh.findings == []


def test_a_resumed_fit_continues_the_schedule_and_does_not_profile_its_first_steps_again(tmp_path):
    def profiled_steps(max_steps, ckpt_path=None):
        logger = RecordingLogger()
        trainer = Trainer(
            **trainer_kwargs(
                callbacks=[MemoryTopologyProfiler(measure_every_n_steps=5, first_steps=2)],
                logger=logger,
                max_steps=max_steps,
            )
        )
        trainer.fit(Classifier(optimizer="sgd"), classification_loader(), ckpt_path=ckpt_path)
        return trainer, [step for step, _ in logger.series.get("memory/activations_bytes", [])]

    path = tmp_path / "epoch0.ckpt"  # 8 steps, one epoch
    trainer, first = profiled_steps(8)
    trainer.save_checkpoint(path)
    _, resumed = profiled_steps(16, ckpt_path=path)
    _, uninterrupted = profiled_steps(16)
    assert first == [0, 1, 5] and resumed == [10, 15] and uninterrupted == first + resumed


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"measure_every_n_steps": 0}, "measure_every_n_steps"),
        ({"first_steps": -1}, "first_steps"),
        ({"memory_budget_bytes": 0}, "memory_budget_bytes"),
        ({"top_k": -1}, "top_k"),
        ({"snapshot_steps": -1}, "snapshot_steps"),
        ({"max_modules_shown": 0}, "max_modules_shown"),
    ],
)
def test_invalid_arguments_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        MemoryTopologyProfiler(**kwargs)


class _Unbatched(Classifier):
    def training_step(self, batch, batch_idx):
        return self.net(torch.ones(1, D)).sum()


def test_unmeasurable_batch_warns_once_or_raises_when_strict():
    scalar_batches = DataLoader([torch.tensor(1.0)] * 8, batch_size=None)
    with pytest.warns(UserWarning, match="no tensor with a batch dimension"):
        fit(_Unbatched(), MemoryTopologyProfiler(measure_every_n_steps=1), max_steps=2, loader=scalar_batches)
    with pytest.raises(RuntimeError, match="no tensor with a batch dimension"):
        fit(_Unbatched(), MemoryTopologyProfiler(strict=True), max_steps=2, loader=scalar_batches)


def test_snapshot_on_cpu_is_skipped_with_a_warning(tmp_path):
    with pytest.warns(UserWarning, match="`snapshot_steps` needs CUDA"):
        fit(Classifier(), MemoryTopologyProfiler(snapshot_steps=2), max_steps=2, default_root_dir=tmp_path)
    assert not list(tmp_path.rglob("memory_snapshot*"))


class _RankRecord(Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        profiler = next(cb for cb in trainer.callbacks if isinstance(cb, MemoryTopologyProfiler))
        with open(f"{self.out_dir}/rank{trainer.global_rank}.txt", "w") as f:
            f.write(str(profiler.last_metrics["memory/activations_bytes"]))


@pytest.mark.slow
def test_ddp_per_rank_numbers_logged_from_rank_zero(tmp_path):
    logger = CSVLogger(tmp_path, name="csv")
    trainer = Trainer(
        **trainer_kwargs(
            strategy="ddp_spawn",
            devices=2,
            max_steps=3,
            logger=logger,
            callbacks=[
                MemoryTopologyProfiler(measure_every_n_steps=1),
                _RankRecord(str(tmp_path)),
                ReleaseProcessGroup(),
            ],
        )
    )
    trainer.fit(Classifier(), classification_loader(n=64))
    # Each rank measures its own batch of B (the sampler splits the data, not the batch).
    assert [float((tmp_path / f"rank{r}.txt").read_text()) for r in (0, 1)] == [ACTIVATION_BYTES] * 2
    rows = list(csv.DictReader(open(tmp_path / "csv" / "version_0" / "metrics.csv")))
    logged = [(int(r["step"]), float(r["memory/activations_bytes"])) for r in rows if r.get("memory/activations_bytes")]
    assert logged == [(0, ACTIVATION_BYTES), (1, ACTIVATION_BYTES), (2, ACTIVATION_BYTES)]


def test_verbose_false_keeps_the_table_off_the_console(caplog):
    profiler = MemoryTopologyProfiler(first_steps=1, verbose=False)
    with caplog.at_level("INFO"):
        fit(Classifier(body=_body()), profiler, max_steps=2)
    assert "### Saved for backward, by module" in profiler.summary_markdown()
    assert "Saved for backward" not in caplog.text


def test_the_budget_line_says_where_the_budget_comes_from():
    """A budget alone ("Budget 1.00 MiB") leaves a reader guessing: the line names the argument it came from."""
    profiler = MemoryTopologyProfiler(first_steps=1, memory_budget_bytes=2**20, verbose=False)
    fit(Classifier(), profiler, max_steps=1)
    (line,) = [ln for ln in profiler.summary_markdown().splitlines() if ln.startswith("Budget")]
    assert "1.00 MiB" in line and "memory_budget_bytes" in line and str(profiler.last.largest_batch()) in line
