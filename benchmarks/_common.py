"""Shared pieces of the benchmarks: a 6M-parameter MLP, a quiet Trainer and a fit, a per-step timer, shadow
stops, statistics and tables.

Benchmarks are scripts, never timed tests: they print markdown tables and can write JSON. Run them as
``python benchmarks/<script>.py``; the script's folder is then on ``sys.path`` and ``import _common``
works. Timings on a shared CPU are noisy: time the variants interleaved in one process, repeat, and
report medians of per-repetition ratios to the bare run.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, EarlyStopping
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

# 49 Linear(350 → 350) layers with biases: 49 · (350² + 350) = 6,019,650 parameters in 98 tensors.
MLP_DEPTH = 49
MLP_WIDTH = 350


class WideMLP(pl.LightningModule):
    """``depth`` Linear(width → width) layers with ReLU between, MSE to a target; for overhead benchmarks.

    He-normal weights and zero biases keep the activations of order 1 through all layers, so the
    float32 values never turn denormal (which would make CPU steps many times slower and the ratios
    meaningless). Logs ``train/loss`` every step like an ordinary module.

    Args:
        depth: number of Linear layers (2 tensors each).
        width: features in and out of every layer.
        lr: learning rate of plain SGD (cheap step: the measured overhead ratio is not flattered by
            an expensive optimizer).
    """

    def __init__(self, depth: int = MLP_DEPTH, width: int = MLP_WIDTH, lr: float = 1e-4) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(depth):
            linear = nn.Linear(width, width)
            nn.init.kaiming_normal_(linear.weight, nonlinearity="relu")
            nn.init.zeros_(linear.bias)
            layers.append(linear)
            if i < depth - 1:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def random_regression_loader(batches: int, batch_size: int = 64, width: int = MLP_WIDTH, seed: int = 0) -> DataLoader:
    """``batches`` fixed batches of ``(batch_size, width)`` standard-normal inputs and targets, in order."""
    g = torch.Generator().manual_seed(seed)
    n = batches * batch_size
    data = TensorDataset(torch.randn(n, width, generator=g), torch.randn(n, width, generator=g))
    return DataLoader(data, batch_size=batch_size, shuffle=False)


class StepTimer(Callback):
    """Wall and CPU time of each training iteration: from one ``on_train_batch_start`` to the next.

    The interval holds everything a step costs: fetching the batch, forward, backward, every
    callback's hooks, the optimizer step and the logger write that Lightning does after
    ``on_train_batch_end``. Intervals that cross an epoch boundary (end-of-epoch work, a new
    DataLoader iterator) and the first ``warmup`` iterations of a fit are not kept. Put it first in
    the callback list.

    CPU time (``time.process_time``: all threads of this process, including a logger's writer
    thread) leaves out the time the process waits while other processes hold the cores, so on a
    shared machine it is the steadier measure; wall time is what a user waits.

    Attributes:
        seconds: the kept wall-clock intervals, in seconds, one per training batch.
        cpu_seconds: the same intervals in process CPU seconds.
        steps: ``trainer.global_step`` at the start of each kept interval (the optimizer step it ends).
    """

    def __init__(self, warmup: int = 10) -> None:
        if warmup < 0:
            raise ValueError(f"`warmup` must be >= 0, got {warmup}")
        self.warmup = warmup
        self.seconds: list[float] = []
        self.cpu_seconds: list[float] = []
        self.steps: list[int] = []
        self._batches = 0
        self._last: tuple[int, int, float, float] | None = None  # (epoch, step, wall, cpu) of the previous batch start

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", *_: Any) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        epoch = trainer.current_epoch
        if self._last is not None and self._last[0] == epoch and self._batches > self.warmup:
            self.steps.append(self._last[1])
            self.seconds.append(wall - self._last[2])
            self.cpu_seconds.append(cpu - self._last[3])
        self._last = (epoch, trainer.global_step, wall, cpu)
        self._batches += 1


def stopped(callback: Callback) -> bool:
    """Whether a stopper (GradNormEarlyStopping or Lightning's EarlyStopping) has asked to stop."""
    from trainvitals import GradNormEarlyStopping

    if isinstance(callback, GradNormEarlyStopping):
        return callback.stopped_step is not None
    if isinstance(callback, EarlyStopping):
        return callback.stopped_epoch > 0
    raise TypeError(f"unknown stopper {type(callback).__name__}")


class ShadowStops(Callback):
    """Records each stopper's first stop, then clears ``trainer.should_stop`` so the run goes on.

    One fixed-budget fit then serves every stopper attached to it: none of them changes the training,
    so each recorded stop is the one a fit with that stopper alone would make, as long as ``evaluate``
    draws nothing from the global RNG (compute on validation tensors, not through a DataLoader, whose
    iterator draws a seed). Must come after the stoppers in the callback list (hooks run in list order).
    A Lightning ``EarlyStopping`` must decide in ``on_validation_end`` (``check_on_train_epoch_end=False``):
    Lightning calls its ``on_train_epoch_end`` after every other callback's, where this guard cannot see it.

    Args:
        stoppers: the stoppers by name.
        evaluate: the validation numbers of the module's current weights, e.g. ``{"val_loss": ...}``.

    Attributes:
        stops: name -> ``{"step": optimizer steps run, "epoch": ..., **evaluate(module)}`` at its first stop.
        epochs: after each training epoch, ``{"step": ..., **evaluate(module)}``.
    """

    def __init__(
        self, stoppers: dict[str, Callback], evaluate: Callable[[pl.LightningModule], dict[str, float]]
    ) -> None:
        self.stoppers = stoppers
        self.evaluate = evaluate
        self.stops: dict[str, dict[str, float]] = {}
        self.epochs: list[dict[str, float]] = []

    def _collect(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not trainer.should_stop:
            return
        for name, cb in self.stoppers.items():
            if name not in self.stops and stopped(cb):
                self.stops[name] = {
                    "step": trainer.global_step,
                    "epoch": trainer.current_epoch,
                    **self.evaluate(pl_module),
                }
        trainer.should_stop = False

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *_: Any) -> None:
        self._collect(trainer, pl_module)

    @override
    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.epochs.append({"step": trainer.global_step, **self.evaluate(pl_module)})
        self._collect(trainer, pl_module)

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._collect(trainer, pl_module)


def time_hook(callback: Callback, hook: str) -> list[float]:
    """Wrap ``callback.<hook>`` so that each call's CPU time (this thread, seconds) is appended to the list returned.

    Thread CPU time does not count the time other processes hold the core, so it isolates a
    callback's own cost even on a busy machine; work the callback hands to other threads or to a
    later hook (a logger's writer thread, Lightning's ``self.log`` bookkeeping) is not in it.
    """
    seconds: list[float] = []
    inner = getattr(callback, hook)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds.append(time.thread_time() - start)

    setattr(callback, hook, timed)  # Lightning looks hooks up on the instance
    return seconds


def add_timing_arguments(
    parser: argparse.ArgumentParser, repetitions: int = 7, mlp_steps: int = 60, cnn_steps: int = 200
) -> None:
    """The options every overhead benchmark shares; apply them with :func:`apply_timing_arguments`.

    ``--repetitions``, ``--warmup``, ``--mlp-steps``, ``--cnn-steps``, ``--models``, ``--threads``, ``--out``.
    """
    parser.add_argument("--repetitions", type=int, default=repetitions, help="fits per variant (>= 5 for a report)")
    parser.add_argument("--warmup", type=int, default=10, help="iterations of each fit not timed")
    parser.add_argument("--mlp-steps", type=int, default=mlp_steps, help="timed steps per MLP fit")
    parser.add_argument("--cnn-steps", type=int, default=cnn_steps, help="timed steps per CNN fit")
    parser.add_argument("--models", nargs="+", choices=("mlp", "cnn"), default=["mlp", "cnn"])
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads; 0 keeps torch's default (multi-threaded steps are erratic on a shared CPU)",
    )
    parser.add_argument("--out", help="write the results as JSON here")


def apply_timing_arguments(args: argparse.Namespace) -> None:
    """Set torch's thread count, ``args.steps = {"mlp": ..., "cnn": ...}``, and silence Lightning."""
    if args.threads:
        torch.set_num_threads(args.threads)
    args.steps = {"mlp": args.mlp_steps, "cnn": args.cnn_steps}
    quiet_lightning()


def overhead_models(args: argparse.Namespace) -> dict[str, tuple[Callable[[], pl.LightningModule], Callable[[], Any]]]:
    """``{"mlp": (make_model, make_data), "cnn": ...}``: :class:`WideMLP` on enough random batches for
    ``--warmup`` + ``--mlp-steps`` in one epoch, and the demo's DigitsCNN on the digits (batch 64)."""
    from trainvitals.demo.data import DigitsDataModule
    from trainvitals.demo.model import DigitsCNN

    return {
        "mlp": (lambda: WideMLP(), lambda: random_regression_loader(args.warmup + args.mlp_steps + 2)),
        "cnn": (lambda: DigitsCNN(lr=1e-3), lambda: DigitsDataModule(batch_size=64)),
    }


def interleaved(variants: dict[str, Callable[[], Any]], repetitions: int) -> dict[str, list[Any]]:
    """Call every variant once per repetition, in the given order (a, b, c, a, b, c, ...).

    Interleaving spreads slow phases of a shared machine over all variants instead of one.
    Returns each variant's results, one per repetition.
    """
    results: dict[str, list[Any]] = {name: [] for name in variants}
    for _ in range(repetitions):
        for name, run in variants.items():
            results[name].append(run())
    return results


def ratio_row(
    runs: dict[str, list[dict[str, float]]],
    variant: str,
    key: str = "{clock}_s",
    clocks: Sequence[str] = ("wall", "cpu"),
    baseline: str = "bare",
) -> dict[str, Any]:
    """One variant's repetitions summarised against the baseline's, repetition by repetition.

    ``runs[name]`` holds one dict per repetition (from :func:`interleaved`) with a step time in
    seconds under ``key.format(clock=c)`` for each clock and the number of timed steps under ``"n"``.
    Returns ``variant``, ``steps_timed`` and, per clock, ``<clock>_ms_per_step`` (median over
    repetitions), ``<clock>_ratio`` (median of the per-repetition ratios to the baseline) and
    ``<clock>_ratio_range`` (their min and max); :func:`ratio_cells` formats a clock's three.
    """
    row: dict[str, Any] = {"variant": variant, "steps_timed": runs[variant][0]["n"]}
    for clock in clocks:
        k = key.format(clock=clock)
        ratios = [r[k] / b[k] for r, b in zip(runs[variant], runs[baseline])]
        row[f"{clock}_ms_per_step"] = 1e3 * median([r[k] for r in runs[variant]])
        row[f"{clock}_ratio"] = median(ratios)
        row[f"{clock}_ratio_range"] = (min(ratios), max(ratios))
    return row


def ratio_cells(row: dict[str, Any], clock: str) -> list[str]:
    """``[ms/step, ratio, "low–high"]`` of one clock of a :func:`ratio_row`, for a markdown table."""
    low, high = row[f"{clock}_ratio_range"]
    return [f"{row[f'{clock}_ms_per_step']:.2f}", f"{row[f'{clock}_ratio']:.3f}", f"{low:.3f}–{high:.3f}"]


def quiet_lightning() -> None:
    """Silence Lightning's banner lines and the warnings a benchmark run triggers on purpose."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; floats as given (format them before)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def machine_line() -> str:
    """torch version and CPU threads, for the heading of a results table."""
    return f"torch {torch.__version__}, lightning {pl.__version__}, CPU, torch threads {torch.get_num_threads()}"


def run_overhead(
    args: argparse.Namespace,
    models: dict[str, tuple[Any, ...]],
    bench_model: Callable[..., dict[str, Any]],
    format_rows: Callable[[dict[str, Any]], str],
    after: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run ``bench_model(label, *models[label], args)`` for each of ``args.models`` and print its ratio table."""
    results = []
    for label in args.models:
        result = bench_model(label, *models[label], args)
        results.append(result)
        print(f"\n## {label}: ratio = per-repetition step time / bare, median over repetitions\n")
        print(format_rows(result), flush=True)
        if after is not None:
            after(result)
    return results


def quiet_trainer(**kwargs: Any) -> pl.Trainer:
    """A one-CPU Trainer with no logger, checkpoint, progress bar, model summary or sanity validation;
    ``kwargs`` add to those (``max_steps``, ``callbacks``, ...) or replace them."""
    quiet = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "num_sanity_val_steps": 0,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return pl.Trainer(**{**quiet, **kwargs})


def fit_once(
    model: pl.LightningModule,
    data: pl.LightningDataModule | DataLoader,
    callbacks: Sequence[Callback],
    max_steps: int,
    logdir: str | None = None,
    name: str = "",
    log_every_n_steps: int = 1,
) -> None:
    """Fit ``model`` on ``data`` (a DataModule or a training loader) for ``max_steps`` optimizer steps,
    no validation, in a :func:`quiet_trainer`: an overhead benchmark's timed fit.

    With ``logdir``, to a ``TensorBoardLogger`` at ``logdir/name`` (the logger writes of a logging step are
    part of its cost); without, to no logger. Garbage is collected just before, so that an earlier fit's
    objects are not collected inside this one's timed steps.
    """
    logger = TensorBoardLogger(logdir, name=name, default_hp_metric=False) if logdir is not None else False
    trainer = quiet_trainer(
        max_steps=max_steps,
        logger=logger,
        callbacks=list(callbacks),
        log_every_n_steps=log_every_n_steps,
        limit_val_batches=0,
    )
    gc.collect()
    if isinstance(data, pl.LightningDataModule):
        trainer.fit(model, datamodule=data)
    else:
        trainer.fit(model, train_dataloaders=data)


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` (indent 2) when a path is given."""
    if path:
        Path(path).write_text(json.dumps(payload, indent=2))
        print(f"\nwrote {path}")
