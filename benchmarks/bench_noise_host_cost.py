"""Host cost of the noise callbacks on a small model, where their fixed per-step bookkeeping shows.

A breast-cancer MLP (scikit-learn's ``load_breast_cancer``, standardised: 30 → 64 → 64 → 2, the first layer
frozen, two lr param groups, Adam), micro-batches of 16 under ``accumulate_grad_batches=3``, a fixed number of
optimizer steps, ``log_every_n_steps=5`` (``--log-every``) to a TensorBoardLogger in a temporary folder.
Variants, timed interleaved (bare, stopper, probe_1, probe_5, bare, ...):

- ``bare``: the module alone;
- ``stopper``: + ``GradNormEarlyStopping(min_steps=0, patience=10**9)`` (the micro-batch source; the band judged
  from the first step, never a stop: the steady state of a long run);
- ``probe_1``: + ``BatchVarianceProbe()`` (per-example norms at every step);
- ``probe_5``: + ``BatchVarianceProbe(measure_every_n_steps=5)``.

A fit's cost is its process CPU time from the first optimizer step after ``--warmup`` to the end, per optimizer
step; ratios are per repetition against that repetition's bare fit (median and range over repetitions). The
model is so small that what the callbacks add is their host bookkeeping, per step and per micro-batch,
not arithmetic on the gradients.

    OMP_NUM_THREADS=1 nice python benchmarks/bench_noise_host_cost.py --repetitions 3
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from _common import interleaved, machine_line, markdown_table, median, quiet_lightning, quiet_trainer, write_json
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from trainvitals import BatchVarianceProbe, GradNormEarlyStopping


class BreastCancerMLP(pl.LightningModule):
    """30 → 64 → 64 → 2 with ReLU, cross-entropy; the first layer frozen, the other two at different lrs (Adam)."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(30, 64)
        self.hidden = nn.Linear(64, 64)
        self.head = nn.Linear(64, 2)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.hidden(F.relu(self.frozen(x)))))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(
            [{"params": self.hidden.parameters(), "lr": 1e-3}, {"params": self.head.parameters(), "lr": 3e-4}]
        )


def breast_cancer_loader(batch_size: int = 16) -> DataLoader:
    """The 569 standardised examples, shuffled each epoch (a seeded generator)."""
    from sklearn.datasets import load_breast_cancer

    bunch = load_breast_cancer()
    x = torch.tensor(bunch.data, dtype=torch.float32)
    x = (x - x.mean(0)) / x.std(0)
    y = torch.tensor(bunch.target, dtype=torch.long)
    return DataLoader(
        TensorDataset(x, y), batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(0)
    )


class FitClock(Callback):
    """Process CPU and wall time from the end of optimizer step ``warmup`` to the end of the fit."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start: tuple[float, float, int] | None = None
        self.seconds: dict[str, float] = {}

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        if self.start is None and trainer.global_step == self.warmup:
            self.start = (time.process_time(), time.perf_counter(), trainer.global_step)

    @override
    def on_train_end(self, trainer: pl.Trainer, *_: Any) -> None:
        assert self.start is not None, "the fit ended within the warm-up"
        steps = trainer.global_step - self.start[2]
        self.seconds = {
            "cpu_s": (time.process_time() - self.start[0]) / steps,
            "wall_s": (time.perf_counter() - self.start[1]) / steps,
            "n": steps,
        }


def make_callback(name: str) -> list[Callback]:
    if name == "stopper":
        return [GradNormEarlyStopping(min_steps=0, patience=10**9, verbose=False)]
    if name.startswith("probe_"):
        return [BatchVarianceProbe(measure_every_n_steps=int(name.split("_")[1]), histogram_every_n_steps=0)]
    return []


def timed_fit(name: str, steps: int, warmup: int, log_every: int = 5) -> dict[str, float]:
    pl.seed_everything(0, verbose=False)
    clock = FitClock(warmup)
    with tempfile.TemporaryDirectory() as logdir:
        trainer = quiet_trainer(
            max_steps=warmup + steps,
            logger=TensorBoardLogger(logdir, name=name, default_hp_metric=False),
            callbacks=[clock, *make_callback(name)],
            accumulate_grad_batches=3,
            log_every_n_steps=log_every,
            limit_val_batches=0,
        )
        trainer.fit(BreastCancerMLP(), train_dataloaders=breast_cancer_loader())
    return clock.seconds


VARIANTS = ("bare", "stopper", "probe_1", "probe_5")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400, help="timed optimizer steps per fit")
    parser.add_argument("--warmup", type=int, default=20, help="optimizer steps of each fit not timed")
    parser.add_argument("--log-every", type=int, default=5, help="the Trainer's log_every_n_steps")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quiet_lightning()
    warnings.filterwarnings("ignore", message=".*will not stop the run in this fit.*")
    variants: dict[str, Callable[[], Any]] = {
        name: (lambda name=name: timed_fit(name, args.steps, args.warmup, args.log_every))
        for name in ["bare", *args.variants]
    }
    runs = interleaved(variants, args.repetitions)
    rows = []
    for name in variants:
        ratios = [r["cpu_s"] / b["cpu_s"] for r, b in zip(runs[name], runs["bare"])]
        cpu = median([r["cpu_s"] for r in runs[name]])
        added = median([r["cpu_s"] - b["cpu_s"] for r, b in zip(runs[name], runs["bare"])])
        rows.append(
            [
                name,
                f"{1e3 * cpu:.2f}",
                f"{1e3 * added:+.2f}",
                f"{median(ratios):.3f}",
                f"{min(ratios):.3f}–{max(ratios):.3f}",
            ]
        )
    print(f"# Noise callbacks' host cost, breast-cancer MLP ({machine_line()}; {args.repetitions} repetitions)\n")
    print(markdown_table(["variant", "CPU ms/step", "added ms/step", "CPU ratio", "range"], rows))
    write_json(args.out, {"machine": machine_line(), "args": vars(args), "runs": runs})


if __name__ == "__main__":
    main()
