"""BatchVarianceProbe and GradNormEarlyStopping on a torch.compile'd model: the same graphs as without them,
the compiled region measured from micro-batches or named as not measured, nothing left behind."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch._dynamo
from test_probe import Classifier, brute_force_estimates, classification_data, fit, network, rel
from torch import nn

from trainvitals.integrity.callback import GraphIntegrityCallback
from trainvitals.lr_scaling.advisor import LRScalingAdvisor
from trainvitals.memory import compiled_modules
from trainvitals.noise.probe import BatchVarianceProbe
from trainvitals.noise.stopper import GradNormEarlyStopping
from trainvitals.per_example import plan_sources
from trainvitals.per_example.plan import COMPILED_REASON

STEPS_ASIDE = "runs under torch.compile: the probe puts no hook inside it"


def compiled(pattern: str, net: nn.Module) -> nn.Module:
    """``torch.compile`` of the LightningModule (Lightning then compiles its training step), or of its network."""
    if pattern == "training_step":
        return torch.compile(Classifier(net), backend="aot_eager")
    return Classifier(torch.compile(net, backend="aot_eager"))


def graphs() -> tuple[int, int]:
    """(graphs compiled, graph breaks) since the last :func:`fresh`."""
    counters = torch._dynamo.utils.counters
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def fresh() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def hooks_left(module: nn.Module) -> list[str]:
    """Modules and parameters of ``module`` that still carry a hook."""
    return [n for n, m in module.named_modules() if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks] + [
        n for n, p in module.named_parameters() if p._backward_hooks
    ]


class MicroBatchGradients(pl.Callback):
    """Each micro-batch's own gradient: what its backward added to ``.grad``."""

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] = []
        self._sum: torch.Tensor | float = 0.0

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        total = torch.cat([p.grad.flatten() for p in pl_module.parameters()]).clone()
        self.grads.append(total - self._sum)
        self._sum = total


@pytest.mark.filterwarnings("ignore:.*the stopper cannot stop before")
@pytest.mark.parametrize("pattern", ["training_step", "submodule"])
def test_a_compiled_model_keeps_its_graphs_under_the_probe_and_the_stopper(pattern, caplog):
    """A hook inside a compiled region, even one Dynamo does not trace, breaks the graph where it is called,
    and the broken graphs stay cached. The probe steps aside for the region and
    measures it from the micro-batches, whose tensor hooks on the parameters break nothing; so does the
    stopper. A further fit without them compiles nothing new."""
    data = classification_data("mlp", 16)
    fresh()
    fit(compiled(pattern, network("mlp")), data, [], batch_size=4, steps=2, accumulate=2)
    plain = graphs()
    assert plain[0] >= 1 and plain[1] == 0

    fresh()
    probe, stopper = BatchVarianceProbe(loss_reduction="mean", histogram_every_n_steps=0), GradNormEarlyStopping()
    with caplog.at_level("INFO"):
        trainer = fit(compiled(pattern, network("mlp")), data, [probe, stopper], batch_size=4, steps=2, accumulate=2)
    assert graphs() == plain
    assert caplog.text.count(STEPS_ASIDE) == 1
    assert int(probe.noise.count) == 2 and probe.noise_source.param_share == 1.0
    assert int(stopper.noise_source.ema.count) == 2  # its own micro-batch hooks measured too
    assert "micro-batches/ranks: 6 tensors (100.0% of parameters)" in probe.sources

    module = trainer.lightning_module
    assert compiled_modules(module)[0] and not hooks_left(module)
    fit(module, data, [], batch_size=4, steps=2, accumulate=2)
    assert graphs() == plain  # the compiled graphs cached are those without the callbacks


@pytest.mark.parametrize("pattern", ["training_step", "submodule"])
def test_the_advisors_and_the_integrity_callbacks_extra_forwards_compile_nothing(pattern):
    """LRScalingAdvisor runs the first batch in eval mode under no_grad, then twice over; the integrity callback
    calls the model for its batch-independence check and notes which modules each window's first batch ran.
    Compiled, each would fail a guard (mode, grad mode, batch size, hooks) and compile a graph more (4 instead
    of 1). They run eagerly and hook nothing compiled: the bare fit's graphs, and the advisor reads the same."""
    data = classification_data("mlp", 32)
    fresh()
    fit(compiled(pattern, network("mlp")), data, [], batch_size=4, steps=4, accumulate=2)
    plain = graphs()

    fresh()
    probe = BatchVarianceProbe(loss_reduction="mean", histogram_every_n_steps=0)
    advisor = LRScalingAdvisor()
    integrity = GraphIntegrityCallback(check_every_n_steps=1, dead_after_steps=1, check_batch_independence=True)
    trainer = fit(
        compiled(pattern, network("mlp")), data, [probe, advisor, integrity], batch_size=4, steps=4, accumulate=2
    )
    assert plain == (1, 0) and graphs() == plain
    assert advisor.loss_reduction == "mean" and advisor.loss_ratio == pytest.approx(1.0, abs=1e-12)
    assert int(probe.noise.count) == 4 and integrity.findings == []
    assert not hooks_left(trainer.lightning_module)
    assert not nn.modules.module._global_forward_hooks and not nn.modules.module._global_forward_pre_hooks


@pytest.mark.parametrize("pattern", ["training_step", "submodule"])
def test_a_compiled_model_is_measured_from_its_micro_batches(pattern):
    """Under compile, the probe's estimate is McCandlish's two-batch-size estimate (Eq. A.2) from the
    micro-batch gradients, read here from what each backward added to ``.grad``."""
    accumulate, b = 4, 4
    data = classification_data("mlp", accumulate * b)
    probe, micro = (
        BatchVarianceProbe(loss_reduction="mean", ema_beta=0.0, histogram_every_n_steps=0),
        MicroBatchGradients(),
    )
    fresh()
    fit(compiled(pattern, network("mlp")), data, [probe, micro], batch_size=b, steps=1, accumulate=accumulate)
    assert graphs()[1] == 0
    group = torch.stack(micro.grads) * accumulate  # Lightning divides each micro-batch's loss by accumulate
    n = len(group)
    m, batch = group.square().sum(1).mean(), group.mean(0).square().sum()
    assert rel(float(probe.noise.trace_cov), float(n * b * (m - batch) / (n - 1))) < 1e-9
    assert rel(float(probe.noise.grad_sq_norm), float((n * batch - m) / (n - 1))) < 1e-9


def test_a_compiled_region_without_micro_batches_is_named_not_measured(caplog):
    """One micro-batch per step: the eager layers are measured per example (against one backward per
    example), the compiled block is not, and the coverage says so."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Tanh(), nn.Linear(7, 7), nn.Tanh())
    eager = nn.Sequential(nn.Linear(5, 7), block, nn.Linear(7, 3)).double()
    net = copy.deepcopy(eager)
    net[1] = torch.compile(net[1], backend="aot_eager")
    data = classification_data("mlp", 16)
    fresh()
    fit(Classifier(copy.deepcopy(net)), data, [], batch_size=16, steps=1)
    plain = graphs()

    fresh()
    probe = BatchVarianceProbe(ema_beta=0.0, histogram_every_n_steps=0)
    with caplog.at_level("INFO"):
        trainer = fit(Classifier(net), data, [probe], batch_size=16, steps=1)
    assert graphs() == plain and plain[1] == 0
    assert caplog.text.count("`net.1` " + STEPS_ASIDE) == 1
    assert "not measured: 2 tensors" in probe.sources and "torch.compile" in probe.sources
    measured = sum(p.numel() for p in (*eager[0].parameters(), *eager[2].parameters()))
    assert probe.noise_source.param_share == pytest.approx(measured / sum(p.numel() for p in eager.parameters()))

    x, y = data.tensors
    per_example = brute_force_estimates(eager, x, y)[2]
    flat = torch.cat([g.flatten(1) for name, g in per_example.items() if not name.startswith("1.")], 1)
    trace = (flat - flat.mean(0)).square().sum() / (len(x) - 1)
    assert rel(float(probe.noise.trace_cov), float(trace)) < 1e-9
    assert rel(float(probe.noise.grad_sq_norm), float(flat.mean(0).square().sum() - trace / len(x))) < 1e-9
    assert not hooks_left(trainer.lightning_module)


def test_plan_sources_leaves_a_compiled_region_to_micro_batches_or_names_it():
    model = nn.Sequential(nn.Linear(5, 7), nn.Sequential(nn.Tanh(), nn.Linear(7, 7)), nn.Linear(7, 3))
    alone = plan_sources(model, groups_available=False, fallback=True, compiled=["1"])
    assert list(alone.per_example) == ["0", "2"] and not alone.vmap and not alone.micro_batch
    assert alone.uncovered == dict.fromkeys(["1.1.weight", "1.1.bias"], COMPILED_REASON)
    grouped = plan_sources(model, groups_available=True, fallback=True, compiled=["1"])
    assert list(grouped.per_example) == ["0", "2"] and list(grouped.micro_batch) == ["1.1.weight", "1.1.bias"]
    whole = plan_sources(model, groups_available=False, fallback=True, compiled=[""])  # a compiled training step
    assert not whole.per_example and len(whole.uncovered) == 6


def test_a_compiled_training_step_without_micro_batches_is_not_measured_and_says_why():
    """Nothing is left for a source: the probe warns once, why and what would measure it, and estimates nothing."""
    data = classification_data("mlp", 16)
    fresh()
    fit(compiled("training_step", network("mlp")), data, [], batch_size=4, steps=2)
    plain = graphs()
    fresh()
    probe = BatchVarianceProbe(loss_reduction="mean", histogram_every_n_steps=0)
    with pytest.warns(UserWarning, match="cannot measure") as record:
        fit(compiled("training_step", network("mlp")), data, [probe], batch_size=4, steps=2)
    warned = [str(w.message) for w in record if "BatchVarianceProbe" in str(w.message)]
    assert len(warned) == 1 and COMPILED_REASON in warned[0]
    assert graphs() == plain and int(probe.noise.count) == 0 and probe.noise_source.param_share == 0.0


class CompiledHelper(Classifier):
    """The network run by a compiled method that is not ``forward``: no compiled module to step aside for."""

    @torch.compile(backend="aot_eager")
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.encode(x), y)


def test_a_compiled_helper_keeps_its_graphs_under_the_probe() -> None:
    """The probe's module hooks return at once while Dynamo traces: the helper's graph stays whole, and the
    layers it runs are named as not seen (measured from micro-batches here) instead of breaking it."""
    data = classification_data("mlp", 48)

    def compiled_fit(*callbacks):
        fresh()
        fit(CompiledHelper(network("mlp")), data, list(callbacks), batch_size=8, steps=3, accumulate=2)
        return graphs()

    plain = compiled_fit()
    probe = BatchVarianceProbe(measure_every_n_steps=1, loss_reduction="mean")
    with pytest.warns(UserWarning, match="torch.compile'd function"):
        probed = compiled_fit(probe, GradNormEarlyStopping(min_steps=0, verbose=False))
    assert plain == (1, 0)
    assert probed[1] == 0 and probed[0] <= 2  # hooks present or not: at most one more cached graph
