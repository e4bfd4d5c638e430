"""ActivationMonitor against outputs recorded by the model itself: cadence, dead ReLUs, tuples, findings."""

from __future__ import annotations

import copy
import json

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from _models import ReleaseProcessGroup, loader, regression_data
from conftest import HostReads, RecordingLogger, trainer_kwargs
from torch import nn

from trainvitals import ActivationMonitor, LRScalingAdvisor
from trainvitals.activations import monitor as activation_monitor


class Split(nn.Module):
    """A leaf module with a tuple output: the two halves of its input's features."""

    def forward(self, x):
        return x[:, :3], x[:, 3:] * 2.0


class Net(pl.LightningModule):
    """Linear → ReLU (bias ``relu_bias``) → Split → Linear head; records each step's first-forward outputs."""

    def __init__(self, d=6, relu_bias=0.0, inf_at_step=None, grow=False):
        super().__init__()
        self.body = nn.Linear(d, 8)
        with torch.no_grad():
            self.body.bias.fill_(relu_bias)
        self.act = nn.ReLU()
        self.split = Split()
        self.head = nn.Linear(3, 1)
        self.inf_at_step, self.grow = inf_at_step, grow
        self.outputs: dict[int, dict[str, torch.Tensor]] = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.body(x)
        if self.grow:
            h = h * 3.0**self.global_step
        if self.inf_at_step == self.global_step:
            h = h * float("inf")
        a = self.act(h)
        left, right = self.split(a[:, :6])
        out = self.head(left + right)
        self.outputs.setdefault(
            self.global_step,
            {"body": h.detach(), "act": a.detach(), "split[0]": left.detach(), "split[1]": right.detach()},
        )
        return F.mse_loss(out, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(model, monitor, *, batch_size=8, n=64, **overrides):
    logger = RecordingLogger()
    trainer = pl.Trainer(**trainer_kwargs(callbacks=[monitor], logger=logger, **overrides))
    trainer.fit(model, loader(regression_data(n), batch_size))
    return trainer, logger


def test_statistics_of_every_leaf_output_on_the_measured_steps_only():
    model = Net()
    _, logger = fit(model, ActivationMonitor(measure_every_n_steps=3), max_steps=7)
    assert [s for s, _ in logger.series["activation/rms/body"]] == [0, 3, 6]
    for step in (0, 3, 6):
        for key in ("body", "act", "split[0]", "split[1]", "head"):
            if key == "head":
                continue  # not recorded by the model
            x = model.outputs[step][key].double()
            c = x - x.mean()
            assert dict(logger.series[f"activation/rms/{key}"])[step] == pytest.approx(x.square().mean().sqrt().item())
            assert dict(logger.series[f"activation/abs_max/{key}"])[step] == pytest.approx(x.abs().max().item())
            assert dict(logger.series[f"activation/mean/{key}"])[step] == pytest.approx(x.mean().item(), abs=1e-7)
            kurtosis = (c**4).mean().item() / (c**2).mean().item() ** 2
            assert dict(logger.series[f"activation/kurtosis/{key}"])[step] == pytest.approx(kurtosis, rel=1e-4)
    dead = 1.0 - (model.outputs[6]["act"] > 0).any(0).double().mean().item()
    assert dict(logger.series["activation/dead_fraction/act"])[6] == pytest.approx(dead)
    assert "activation/dead_fraction/body" not in logger.series  # a Linear is not an activation
    assert "activation/rms/split" not in logger.series  # a tuple's parts are logged, not the tuple


def test_a_relu_whose_input_is_always_negative_is_all_dead_and_a_finding():
    monitor = ActivationMonitor(measure_every_n_steps=1)
    _, logger = fit(Net(relu_bias=-100.0), monitor, max_steps=2)
    assert logger.values("activation/dead_fraction/act") == [1.0, 1.0]
    found = [f for f in monitor.findings() if "dead" in f]
    assert len(found) == 1 and "`act` 100%" in found[0] and "no gradient" in found[0]
    assert "act" in monitor.summary_markdown()


def test_a_gelu_whose_input_is_always_negative_is_inactive_not_dead():
    """GELU passes a gradient below 0 (GELU'(-100) ≈ 0, GELU'(-2) ≈ -0.09): ≤ 0 for every example is named
    inactive, never "no gradient flows"."""
    model = Net(relu_bias=-2.0)
    model.act = nn.GELU()
    monitor = ActivationMonitor(measure_every_n_steps=1, dead_share=0.5)
    _, logger = fit(model, monitor, max_steps=2)
    assert logger.values("activation/inactive_fraction/act")[0] > 0.5  # tagged with the monitor's word
    assert "activation/dead_fraction/act" not in logger.series
    found = monitor.findings()
    assert any("inactive" in f and "`act`" in f for f in found)
    assert not any("no gradient flows" in f for f in found)


def test_a_healthy_relu_is_no_finding():
    monitor = ActivationMonitor(measure_every_n_steps=1)
    fit(Net(relu_bias=0.5), monitor, max_steps=3)
    assert monitor.findings() == []


def test_hooks_are_installed_for_the_measured_forward_only(monkeypatch):
    calls = []
    original = activation_monitor.output_moments
    monkeypatch.setattr(activation_monitor, "output_moments", lambda x, dead: calls.append(1) or original(x, dead))
    model = Net()
    hooked = []

    class Spy(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *_):
            hooked.append(len(model.body._forward_hooks))

    monitor = ActivationMonitor(measure_every_n_steps=4)
    trainer = pl.Trainer(**trainer_kwargs(callbacks=[Spy(), monitor], logger=RecordingLogger(), max_steps=9))
    trainer.fit(model, loader(regression_data(), 8))
    assert hooked == [1 if s in (0, 4, 8) else 0 for s in range(9)]  # our hook, during those forwards only
    assert len(calls) == 3 * 5  # body, act, split[0], split[1], head
    assert not model.body._forward_hooks


class Dropped(Net):
    """Net with dropout before its head: the step's outputs differ from an eval-mode forward's."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.head(self.drop(self.act(self.body(x)))[:, :3]), y)


def test_the_lr_advisors_forwards_are_not_the_steps():
    """LRScalingAdvisor runs the first batch in eval mode, then twice over, while the monitor's hooks are on:
    trainvitals' own forwards, not recorded. The step's statistics are those of the fit without the advisor."""
    model = Dropped()
    torch.manual_seed(1)
    _, alone = fit(copy.deepcopy(model), ActivationMonitor(), max_steps=2)
    torch.manual_seed(1)  # the same dropout masks
    logger = RecordingLogger()
    trainer = pl.Trainer(
        **trainer_kwargs(callbacks=[ActivationMonitor(), LRScalingAdvisor()], logger=logger, max_steps=2)
    )
    trainer.fit(model, loader(regression_data(64), 8))
    tags = [t for t in alone.series if t.startswith("activation/")]
    assert "activation/rms/head" in tags
    for tag in tags:
        assert [s for s, _ in logger.series[tag]] == [s for s, _ in alone.series[tag]], tag
        assert logger.values(tag) == pytest.approx(alone.values(tag), rel=1e-6), tag


def test_one_host_transfer_per_measured_step(monkeypatch):
    monitor = ActivationMonitor(measure_every_n_steps=2)
    reads = HostReads(monkeypatch)
    reads.watch(monitor, ("on_train_batch_start", "on_train_batch_end"))
    fit(Net(), monitor, max_steps=5)
    # Read at the batch's end, when global_step already counts the step: measured steps 0, 2, 4.
    assert reads.reads == [(1, "tolist"), (3, "tolist"), (5, "tolist")]


def test_the_first_module_with_a_non_finite_output_is_named_and_said_once(caplog, recwarn):
    monitor = ActivationMonitor(measure_every_n_steps=1)
    with caplog.at_level("INFO"):
        _, logger = fit(Net(inf_at_step=1), monitor, max_steps=3)
    found = [f for f in monitor.findings() if "non-finite" in f]
    # The model multiplies body's output by inf after the module: act (next in forward order) is the first.
    assert len(found) == 1 and "step 1" in found[0] and "`act`" in found[0]
    assert 1 not in dict(logger.series["activation/rms/act"])  # not drawn
    # Warned at its step, not again at the fit's end (log records and warnings alike); listed in the summary.
    said = [r.getMessage() for r in caplog.records] + [str(w.message) for w in recwarn]
    assert [line for line in said if "non-finite" in line] == [monitor.message(found[0])]
    assert "1 findings" in monitor.summary_line() and f"- {found[0]}" in monitor.summary_markdown()


def test_growing_activations_are_a_finding():
    monitor = ActivationMonitor(measure_every_n_steps=1, modules=lambda name, _: name in ("body", "act"))
    _, logger = fit(Net(grow=True, relu_bias=1.0), monitor, max_steps=4)
    assert set(monitor._last) == {"body", "act"}
    found = [f for f in monitor.findings() if "growing" in f]
    assert len(found) == 1 and "`act`" in found[0] and "`body`" not in found[0]  # body's output is scaled after it


def test_type_filter_and_accumulation_measure_the_first_micro_batch():
    model = Net()
    monitor = ActivationMonitor(measure_every_n_steps=1, modules=lambda _, module: isinstance(module, nn.ReLU))
    _, logger = fit(model, monitor, max_steps=3, accumulate_grad_batches=2)
    assert [k for k in logger.series if k.startswith("activation/rms/")] == ["activation/rms/act"]
    assert [s for s, _ in logger.series["activation/rms/act"]] == [0, 1, 2]
    rms = [model.outputs[s]["act"].double().square().mean().sqrt().item() for s in range(3)]
    assert logger.values("activation/rms/act") == pytest.approx(rms)


def test_state_survives_a_requeued_fit(tmp_path):
    monitor = ActivationMonitor(measure_every_n_steps=2)
    trainer, _ = fit(Net(relu_bias=-100.0), monitor, max_steps=3)
    state = json.loads(json.dumps(monitor.state_dict()))
    assert state["steps"] == 3 and state["last"]["act"]["dead_fraction"] == 1.0
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    requeued = ActivationMonitor(measure_every_n_steps=2)
    trainer = pl.Trainer(**trainer_kwargs(callbacks=[requeued], logger=RecordingLogger(), max_steps=3))
    trainer.fit(Net(relu_bias=-100.0), loader(regression_data(), 8), ckpt_path=tmp_path / "last.ckpt")  # no step
    saved = json.dumps(requeued.state_dict(), sort_keys=True)  # as text: a NaN kurtosis equals itself there
    assert saved == json.dumps(monitor.state_dict(), sort_keys=True) and requeued.findings() == monitor.findings()


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"measure_every_n_steps": 0}, ValueError, "measure_every_n_steps"),
        ({"modules": "act"}, TypeError, "modules"),
        ({"dead_share": 1.0}, ValueError, "dead_share"),
        ({"growth_factor": 1.0}, ValueError, "growth_factor"),
        ({"growth_steps": 0}, ValueError, "growth_steps"),
    ],
)
def test_bad_arguments(kwargs, error, name):
    with pytest.raises(error, match=name):
        ActivationMonitor(**kwargs)


class _RecordPerRank(pl.Callback):
    """Writes each rank's logged activation statistics and its first batch's inputs to ``<dir>/rank<k>.json``."""

    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.inputs = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.inputs is None:
            self.inputs = batch[0].tolist()

    def on_train_end(self, trainer, pl_module):
        logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("activation/")}
        with open(f"{self.out_dir}/rank{trainer.global_rank}.json", "w") as f:
            json.dump({"logged": logged, "inputs": self.inputs}, f)


@pytest.mark.slow
def test_ddp_ranks_log_the_statistics_of_the_global_batch(tmp_path):
    """Each rank sees 8 of the step's 16 examples; both log the moments of all 16, combined exactly."""
    model = Net(relu_bias=-1.0)  # 3 of its 8 units dead over the 16 examples
    body = copy.deepcopy(model.body)  # ddp_spawn loads the trained weights back into ``model``
    callbacks = [ActivationMonitor(measure_every_n_steps=1), _RecordPerRank(str(tmp_path)), ReleaseProcessGroup()]
    trainer = pl.Trainer(**trainer_kwargs(strategy="ddp_spawn", devices=2, callbacks=callbacks, max_steps=1))
    trainer.fit(model, loader(regression_data(64), 8))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["logged"] == pytest.approx(ranks[1]["logged"], rel=1e-12, nan_ok=True)  # NaN: not a ReLU
    x = torch.tensor(ranks[0]["inputs"] + ranks[1]["inputs"])
    assert x.shape == (16, 6)
    with torch.no_grad():
        body = body(x).double()
    c = body - body.mean()
    logged = ranks[0]["logged"]
    assert logged["activation/rms/body"] == pytest.approx(body.square().mean().sqrt().item(), rel=1e-5)
    assert logged["activation/kurtosis/body"] == pytest.approx(((c**4).mean() / (c**2).mean() ** 2).item(), rel=1e-4)
    dead = 1.0 - (body > 0).any(0).double().mean().item()
    assert logged["activation/dead_fraction/act"] == pytest.approx(dead) and 0.0 < dead < 1.0
