"""UpdateMonitor and ActivationMonitor in a real run's event files: the dashboard layout, the diagnosis panels,
and ``trainvitals report`` in text, markdown, json and html."""

from __future__ import annotations

import json
import re

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from _models import loader, regression_data
from conftest import trainer_kwargs
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from trainvitals import ActivationMonitor, TrainvitalsDashboard, UpdateMonitor
from trainvitals.report.command import main
from trainvitals.tensorboard.layout import TRAINVITALS_LAYOUT


class DeadAndFrozen(pl.LightningModule):
    """A ReLU whose input is always negative (bias −100) and a head in a param group with lr 0."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.act = nn.ReLU()
        self.side = nn.Linear(6, 8)
        self.head = nn.Linear(8, 1)
        with torch.no_grad():
            self.body.bias.fill_(-100.0)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.head(self.act(self.body(x)) + self.side(x)), y)

    def configure_optimizers(self):
        moving = [*self.body.parameters(), *self.side.parameters()]
        return torch.optim.SGD([{"params": moving, "lr": 0.01}, {"params": self.head.parameters(), "lr": 0.0}])


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("runs")
    callbacks = [UpdateMonitor(log_every_n_steps=2), ActivationMonitor(measure_every_n_steps=2), TrainvitalsDashboard()]
    trainer = pl.Trainer(
        **trainer_kwargs(callbacks=callbacks, logger=TensorBoardLogger(str(folder), name="dead"), max_steps=6)
    )
    trainer.fit(DeadAndFrozen(), loader(regression_data(64), 8))
    return folder


def test_every_logged_tag_has_a_chart_in_the_layout():
    charts = [tag for category in TRAINVITALS_LAYOUT.values() for _, tags in category.values() for tag in tags]
    logged = [
        "update/ratio/body",
        "update/total_ratio",
        "update/norm/head",
        "update/grad_cosine/side",
        "update/unit_step_norm/body",
        "update/optimizer_1/ratio/disc.0",
        "activation/rms/act",
        "activation/abs_max/act",
        "activation/kurtosis/body",
        "activation/dead_fraction/act",
        "activation/inactive_fraction/act",
    ]
    assert all(any(re.match(regex, tag) for regex in charts) for tag in logged)


def test_the_report_names_the_frozen_layer_and_the_dead_relu(logdir, capsys):
    assert main([str(logdir), "--format", "json"]) == 0  # warnings, nothing critical
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    updates = {row["label"]: row["value"] for row in run["sections"]["weight updates"]}
    assert updates["‖Δθ‖/‖θ‖ of head"] == 0.0 and updates["‖Δθ‖/‖θ‖ of side"] > 0.0
    activations = {row["label"]: row["value"] for row in run["sections"]["activations"]}
    assert activations["dead units in act"] == 1.0
    messages = [f["message"] for f in run["findings"]]
    assert any("never moved" in m and "head" in m and "side" not in m for m in messages)
    assert any("dead units" in m and "act (100%)" in m for m in messages)
    assert "head" in run["panels"]["update findings"] and "act" in run["panels"]["activation findings"]
    for fmt in ("text", "markdown", "html"):
        main([str(logdir), "--format", fmt])
        out = capsys.readouterr().out
        assert "never moved" in out and "dead units" in out, fmt


class InactiveSiLU(DeadAndFrozen):
    """DeadAndFrozen with a SiLU, which passes a gradient below 0: its units ≤ 0 are inactive, not dead."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.SiLU()


def test_the_report_calls_units_of_a_silu_inactive_as_the_monitor_does(tmp_path, capsys):
    """A fresh user's UNet: the report listed "dead units in net.time_mlp.1 3.1%" for an nn.SiLU, which
    ActivationMonitor calls inactive (it passes gradient). Its row, finding and panel use the monitor's word."""
    monitor = ActivationMonitor(measure_every_n_steps=2)
    callbacks = [monitor, TrainvitalsDashboard()]
    trainer = pl.Trainer(
        **trainer_kwargs(callbacks=callbacks, logger=TensorBoardLogger(str(tmp_path), name="silu"), max_steps=4)
    )
    trainer.fit(InactiveSiLU(), loader(regression_data(64), 8))
    assert main([str(tmp_path), "--format", "json"]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    activations = {row["label"]: row["value"] for row in run["sections"]["activations"]}
    assert activations["inactive units in act"] == monitor._last["act"]["dead_fraction"] == 1.0
    assert not any(label.startswith("dead units") for label in activations)
    messages = [f["message"] for f in run["findings"] if f["section"] == "activations"]
    assert any(m.startswith("inactive units above 50%: act (100%)") for m in messages), messages
    assert not any("dead" in m or "no gradient flows" in m for m in messages)
    panel = run["panels"]["activation findings"].splitlines()
    (row,) = [line for line in panel if line.startswith("| act |")]
    assert panel[2].endswith("| dead | inactive |") and row.endswith("| | 1 |"), panel
