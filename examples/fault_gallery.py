"""Fault gallery: classic training mistakes, each in a few lines, and what trainvitals says about them.

Every fault trains a small model on real data (the digits; Python's own source for the recurrent one)
for a few steps with all the trainvitals callbacks attached, then prints what they found — graph
findings, warnings, the exception and the note trainvitals added to it — and the critical findings of
``trainvitals report`` on the run's TensorBoard logs.

    python examples/fault_gallery.py                   # all faults
    python examples/fault_gallery.py unused_head       # one
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from _common import example_parser
from char_transformer import CharData
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainvitals
from trainvitals.activations.monitor import ActivationMonitor
from trainvitals.demo.data import DigitsDataModule
from trainvitals.guard.callback import TrainingGuard
from trainvitals.integrity.callback import GraphIntegrityCallback
from trainvitals.lr_scaling.advisor import LRScalingAdvisor
from trainvitals.memory.profiler import MemoryTopologyProfiler
from trainvitals.noise.probe import BatchVarianceProbe
from trainvitals.norms.monitor import GradNormMonitor
from trainvitals.report.command import RunReport, assess, read_runs
from trainvitals.report.schedule import SCHEDULE
from trainvitals.schedule.callback import BandSchedule
from trainvitals.updates.monitor import UpdateMonitor

TRAINVITALS_DIR = str(Path(trainvitals.__file__).parent)


# ------------------------------------------------------------------------------------------ the models
class DigitsMLP(pl.LightningModule):
    """The healthy base: 8×8 digits → 64 → 10, cross-entropy averaged over the batch, SGD."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class DetachedLoss(DigitsMLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x).detach()  # the mistake: copied from an evaluation helper
        return F.cross_entropy(logits, y)


class UnusedHead(DigitsMLP):
    def __init__(self) -> None:
        super().__init__()
        self.aux_head = nn.Linear(64, 10)  # the mistake: built, registered, never in the loss


class LayersInAList(DigitsMLP):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = [nn.Linear(64, 64) for _ in range(2)]  # the mistake: a list, not an nn.ModuleList

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        for layer in self.hidden:
            h = torch.relu(layer(h))
        return self.head(h)


class SummedLoss(DigitsMLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y, reduction="sum")  # the mistake: B× the gradient of the mean


class GraphKeptAcrossSteps(DigitsMLP):
    def __init__(self) -> None:
        super().__init__()
        self.epoch_loss = torch.zeros(())

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.epoch_loss = self.epoch_loss + loss  # the mistake: a running total kept as a tensor, graph and all
        return loss

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        loss.backward(retain_graph=True)  # ...kept alive by the "fix" for "backward through the graph a second time"


class CharGRU(pl.LightningModule):
    """A character-level GRU over windows of Python's own source; the hidden state is carried over."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.rnn = nn.GRU(16, 32, batch_first=True)
        self.head = nn.Linear(32, vocab)
        self.hidden: torch.Tensor | None = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        out, self.hidden = self.rnn(self.embed(x), self.hidden)  # the mistake: no .detach() between batches
        return F.cross_entropy(self.head(out).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


class DeadReLU(DigitsMLP):
    def __init__(self) -> None:
        super().__init__()
        nn.init.constant_(self.body[1].bias, -100.0)  # the mistake: a gate's bias init on a ReLU layer


class HeadAtLrZero(DigitsMLP):
    def configure_optimizers(self):
        groups = [{"params": self.body.parameters()}, {"params": self.head.parameters(), "lr": 0.0}]
        return torch.optim.SGD(groups, lr=self.lr)  # the mistake: the head's group kept a warm-up's lr 0


class BatchNormMLP(DigitsMLP):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU())


class CorruptBatch(DigitsMLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step == 4:
            x = x * 100.0  # the mistake: one shard's images arrive unnormalised
        return F.cross_entropy(self(x), y)


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # the mistake: "log features" of a ReLU's output, which is 0 wherever it is off


class LogOfRelu(DigitsMLP):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), Log())


class NoisyRegression(pl.LightningModule):
    """A linear model on y = x·w* + ε (16 features, ε of s.d. 1), started at w = 0, at a constant SGD lr."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.linear = nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.linear(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)  # the mistake: the lr held where steps are noise


class NoisyRegressionData(pl.LightningDataModule):
    """4,096 draws of y = x·w* + ε, x ~ N(0, I), ‖w*‖ = 0.5, ε ~ N(0, 1): at a batch of 8, noise dominates the
    gradient within a few steps."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4096, 16, generator=g)
        w = torch.randn(16, generator=g)
        y = x @ (0.5 * w / w.norm()) + torch.randn(4096, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size, shuffle=True, drop_last=True)


# ------------------------------------------------------------------------------------------ the gallery
def default_callbacks() -> list[pl.Callback]:
    """All trainvitals callbacks, checking at every step: the runs are a few steps long."""
    return [
        GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0),
        BatchVarianceProbe(log_every_n_steps=1, histogram_every_n_steps=0),
        GraphIntegrityCallback(check_every_n_steps=3, dead_after_steps=3),
        MemoryTopologyProfiler(measure_every_n_steps=1),
        UpdateMonitor(log_every_n_steps=1),
        ActivationMonitor(measure_every_n_steps=1),
        LRScalingAdvisor(verbose=False),
    ]


@dataclass
class Fault:
    """One classic mistake: the model that makes it and the Trainer settings it runs under."""

    name: str
    mistake: str
    model: Callable[[], pl.LightningModule]
    data: Callable[[], pl.LightningDataModule] = lambda: DigitsDataModule(batch_size=32)
    callbacks: Callable[[], list[pl.Callback]] = default_callbacks
    trainer: dict[str, Any] = field(default_factory=dict)
    max_steps: int = 6
    notes: tuple[str, ...] = ()
    """Report sections whose notes the gallery prints beside its critical findings (what a callback did)."""


def _char_data() -> CharData:
    return CharData(context=32, batch_size=16)


FAULTS = [
    Fault("detached_loss", "the logits are detached before the loss", DetachedLoss),
    Fault("unused_head", "a head is built and registered but never used in the loss", UnusedHead),
    Fault("layers_in_a_list", "hidden layers kept in a Python list instead of an nn.ModuleList", LayersInAList),
    Fault(
        "summed_loss_new_batch",
        "the loss is summed, not averaged, and the batch grew from 32 to 128 at the same SGD lr",
        SummedLoss,
        data=lambda: DigitsDataModule(batch_size=128),
        callbacks=lambda: [*default_callbacks()[:-1], LRScalingAdvisor(reference=(32, 0.1), verbose=False)],
    ),
    Fault(
        "graph_kept_across_steps",
        "a running loss total kept as a tensor, with backward(retain_graph=True)",
        GraphKeptAcrossSteps,
    ),
    Fault(
        "recurrent_state_not_detached",
        "a GRU's hidden state carried to the next batch without .detach()",
        lambda: CharGRU(len(_char_data().vocab)),
        data=_char_data,
    ),
    Fault("dead_relu", "a ReLU layer's bias initialised to -100, so its input is always negative", DeadReLU),
    Fault("head_at_lr_zero", "the head's param group has lr 0", HeadAtLrZero),
    Fault(
        "batchnorm_micro_batches",
        "BatchNorm with micro-batches of 2 under 32-step gradient accumulation",
        BatchNormMLP,
        data=lambda: DigitsDataModule(batch_size=2),
        trainer={"accumulate_grad_batches": 32},
    ),
    Fault(
        "loss_spike",
        "one batch arrives unnormalised (100× its inputs) and the loss jumps",
        CorruptBatch,
        callbacks=lambda: [
            *default_callbacks(),
            TrainingGuard(on_spike="rollback", spike_warmup_steps=2, snapshot_every_n_steps=1, lr_factor=0.5),
        ],
    ),
    Fault(
        "nan_from_a_log",
        "the log of a ReLU's output, which is 0 wherever the unit is off",
        LogOfRelu,
        callbacks=lambda: [*default_callbacks(), TrainingGuard(on_nonfinite="skip", budget_events=2)],
    ),
    Fault(
        "lr_held_in_the_noise_band",
        "a constant SGD lr held after the steps have become noise (a noisy regression at a batch of 8)",
        NoisyRegression,
        data=NoisyRegressionData,
        callbacks=lambda: [
            *default_callbacks(),
            BandSchedule(max_cuts=1, stop=False, min_steps=0, patience=3, check_every_n_steps=1, verbose=False),
        ],
        max_steps=60,
        notes=(SCHEDULE,),
    ),
]


@dataclass
class Outcome:
    """What trainvitals said about one fault."""

    fault: Fault
    findings: list[tuple[str, str]]
    """GraphIntegrityCallback's findings, ``(kind, message)``."""
    warnings: list[str]
    """Warnings raised by trainvitals during the run."""
    error: str | None
    """The exception that ended the run, with the notes trainvitals added to it; ``None`` if it finished."""
    loss_reduction: str | None
    """How LRScalingAdvisor found the loss reduced over the batch (``"mean"``, ``"sum"``), if it could tell."""
    report: RunReport
    """``trainvitals report`` on the run's event files."""


def run_fault(fault: Fault, logdir: str) -> Outcome:
    """Train ``fault`` for its ``max_steps`` optimizer steps and collect what trainvitals reports."""
    pl.seed_everything(0, verbose=False)
    logger = TensorBoardLogger(logdir, name=fault.name, default_hp_metric=False)
    callbacks = fault.callbacks()
    trainer = pl.Trainer(
        max_steps=fault.max_steps,
        accelerator="cpu",
        devices=1,
        logger=logger,
        callbacks=callbacks,
        log_every_n_steps=1,
        limit_val_batches=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **fault.trainer,
    )
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(fault.model(), datamodule=fault.data())
        except Exception as err:  # the fault may end the run: what trainvitals adds to the error is the point
            error = "\n".join([f"{type(err).__name__}: {err}", *getattr(err, "__notes__", [])])
    integrity = next(cb for cb in callbacks if isinstance(cb, GraphIntegrityCallback))
    advisor = next(cb for cb in callbacks if isinstance(cb, LRScalingAdvisor))
    ours = [str(w.message) for w in caught if w.filename.startswith(TRAINVITALS_DIR)]
    return Outcome(
        fault=fault,
        findings=[(f.kind.value, f.message) for f in integrity.findings],
        warnings=list(dict.fromkeys(ours)),
        error=error,
        loss_reduction=advisor.loss_reduction,
        report=assess(read_runs(logger.log_dir)[0]),
    )


def describe(outcome: Outcome) -> str:
    """The outcome as plain text: the mistake, then everything trainvitals said about it."""
    lines = [f"== {outcome.fault.name}: {outcome.fault.mistake}"]
    if outcome.error:
        lines.append(f"  the run failed: {outcome.error}")
    lines += [f"  graph finding [{kind}]: {message}" for kind, message in outcome.findings]
    lines += [f"  warning: {message}" for message in outcome.warnings]
    if outcome.loss_reduction == "sum":
        lines.append("  LRScalingAdvisor: the loss is a sum over the batch, so SGD's step grows with the batch")
    critical = [f.message for f in outcome.report.findings if f.severity == "critical"]
    lines += [f"  trainvitals report, critical: {message}" for message in critical]
    if not critical:
        lines.append("  trainvitals report: nothing critical")
    notes = [f for f in outcome.report.findings if f.section in outcome.fault.notes and f.severity != "critical"]
    lines += [f"  trainvitals report, {f.section}: {f.message}" for f in notes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = example_parser(__doc__)
    names = [f.name for f in FAULTS]
    parser.add_argument("faults", nargs="*", metavar="FAULT", help="faults to run (default: all): " + ", ".join(names))
    args = parser.parse_args(argv)
    unknown = set(args.faults) - set(names)
    if unknown:
        parser.error(f"unknown fault(s): {', '.join(sorted(unknown))}")
    torch.set_num_threads(args.threads)
    # The callbacks' end-of-run tables would bury the gallery's summary; they are in the TensorBoard logs.
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    for fault in FAULTS:
        if not args.faults or fault.name in args.faults:
            print(describe(run_fault(fault, str(Path(args.logdir) / "fault_gallery"))), end="\n\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
