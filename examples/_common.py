"""What the example scripts share: their command line, and a fit with every trainvitals callback attached."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import TensorBoardLogger

from trainvitals.integrity.callback import GraphIntegrityCallback
from trainvitals.lr_scaling.advisor import LRScalingAdvisor
from trainvitals.memory.profiler import MemoryTopologyProfiler
from trainvitals.noise.probe import BatchVarianceProbe
from trainvitals.noise.stopper import GradNormEarlyStopping
from trainvitals.norms.monitor import GradNormMonitor
from trainvitals.report import command as report
from trainvitals.tensorboard.dashboard import TrainvitalsDashboard


def example_parser(doc: str) -> argparse.ArgumentParser:
    """A parser with ``--logdir`` and ``--threads``, described by the first line of the example's ``doc``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--logdir", default="runs/examples", help="TensorBoard log folder (default: runs/examples)")
    # The example models are small: on two busy cores, torch's intra-op threads spent several times
    # the CPU of one thread on them (measured on the demo and the character transformer).
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1)")
    return parser


def all_callbacks(every_n_steps: int, min_steps: int, verbose: bool) -> list[pl.Callback]:
    """Every trainvitals callback, the dashboard, and Lightning's lr monitor (the dashboard's lr chart).

    Args:
        every_n_steps: optimizer steps between histograms and between memory profiles.
        min_steps: optimizer steps before GradNormEarlyStopping may stop the run.
        verbose: let the stopper say its stop when it stops (the tables are in the report printed after the fit).
    """
    return [
        GradNormMonitor(histogram_every_n_steps=every_n_steps),
        BatchVarianceProbe(histogram_every_n_steps=every_n_steps),
        GradNormEarlyStopping(min_steps=min_steps, verbose=verbose),
        LRScalingAdvisor(),
        GraphIntegrityCallback(),
        MemoryTopologyProfiler(measure_every_n_steps=every_n_steps),
        LearningRateMonitor(logging_interval="step"),
        TrainvitalsDashboard(),
    ]


def run_example(doc: str, argv: list[str] | None, train: Callable[..., str], length_flag: str, length: int) -> int:
    """An example's command line: train, then print ``trainvitals report`` on the run; returns the report's status.

    Args:
        doc: the example's module docstring (its first line describes the command).
        argv: the arguments; ``None`` for ``sys.argv``.
        train: ``train(logdir, <length>=..., quiet=False)`` returns the run's log folder.
        length_flag: the flag that sets the run's length (``--max-epochs``), passed to ``train`` by its name.
        length: its default.
    """
    parser = example_parser(doc)
    dest = parser.add_argument(length_flag, type=int, default=length).dest
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    return report.main([train(args.logdir, **{dest: getattr(args, dest)}, quiet=False)])


def fit_example(
    module: pl.LightningModule,
    data: pl.LightningDataModule,
    logdir: str,
    name: str,
    every_n_steps: int,
    min_steps: int,
    quiet: bool,
    **trainer_args: object,
) -> str:
    """Fit ``module`` on one CPU with :func:`all_callbacks`, logging to TensorBoard; returns the run's log folder.

    ``trainer_args`` (the run's length, accumulation, logging cadence) go to the Trainer.
    """
    logger = TensorBoardLogger(logdir, name=name, default_hp_metric=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=logger,
        callbacks=all_callbacks(every_n_steps, min_steps, verbose=not quiet),
        enable_checkpointing=False,
        enable_progress_bar=not quiet,
        enable_model_summary=not quiet,
        **trainer_args,
    )
    trainer.fit(module, datamodule=data)
    return logger.log_dir
