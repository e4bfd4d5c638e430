"""``trainvitals demo``: train the digits CNN with trainvitals attached, stop by the noise band, summarise."""

from __future__ import annotations

import argparse
import logging
import math
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from trainvitals.activations.monitor import ActivationMonitor
from trainvitals.demo.data import DigitsDataModule
from trainvitals.demo.model import DigitsCNN
from trainvitals.integrity.callback import GraphIntegrityCallback
from trainvitals.lr_scaling.advisor import LRScalingAdvisor
from trainvitals.memory.profiler import MemoryTopologyProfiler
from trainvitals.noise.probe import BatchVarianceProbe
from trainvitals.noise.stopper import GradNormEarlyStopping
from trainvitals.norms.monitor import GradNormMonitor
from trainvitals.schedule.callback import BandSchedule
from trainvitals.tensorboard.dashboard import TrainvitalsDashboard, diagnoses
from trainvitals.text.terminal import markdown_to_text
from trainvitals.updates.monitor import UpdateMonitor


@dataclass
class DemoResult:
    """What a demo run ends with: optimizer steps, the stop, the last norms and accuracy, the log folder."""

    steps: int
    epochs: int
    stop_reason: str
    grad_norm: float | None
    noise_floor: float | None  # the noise level sqrt(tr Σ/B): the RMS norm of a batch gradient of pure noise
    smoothed_ratio: float | None  # sqrt(1 + EMA‖G‖² / (EMA tr Σ / B)): what the stop was decided on
    band_edge: float  # sqrt(1 + margin)
    val_acc: float | None
    log_dir: str
    seconds: float
    threads: int
    diagnoses: dict[str, str]
    expected_norm: float | None = None  # sqrt(‖G‖² + tr Σ/B), the batch gradient's expected RMS norm; None: unmeasured


def build_callbacks(args: argparse.Namespace) -> list[pl.Callback]:
    """The trainvitals callbacks the demo attaches, in the order their hooks must run.

    The probe measures every 10th optimizer step: on this small CNN a per-example measurement costs
    about half a bare step on CPU (benchmarks/bench_batch_variance_probe.py). The stopper takes its
    noise from the micro-batches when ``--accumulate`` ≥ 2, else from the probe; the advisor reads
    the noise scale of either. With ``--schedule`` a BandSchedule takes the stopper's place: it cuts the lr at
    the band and stops after its last cut. On CPU the memory budget for the largest-batch advice is an argument.
    """
    return [
        GraphIntegrityCallback(check_batch_independence=True, detect_anomaly_steps=1, verbose=False),
        GradNormMonitor(histogram_every_n_steps=50),
        BatchVarianceProbe(measure_every_n_steps=10, histogram_every_n_steps=50),
        BandSchedule(min_steps=args.min_steps)
        if args.schedule
        else GradNormEarlyStopping(mode="noise_band", min_steps=args.min_steps),
        LRScalingAdvisor(verbose=False),
        MemoryTopologyProfiler(memory_budget_bytes=256 * 2**20, verbose=False),
        UpdateMonitor(),
        ActivationMonitor(measure_every_n_steps=50),
        TrainvitalsDashboard(),
    ]


def run_demo(args: argparse.Namespace) -> DemoResult:
    """Train with ``args.threads`` torch threads, log to ``args.logdir`` with TensorBoard, return the summary numbers."""
    torch.set_num_threads(args.threads)
    pl.seed_everything(args.seed, workers=True, verbose=False)
    logger = TensorBoardLogger(args.logdir, name="digits", default_hp_metric=False)
    callbacks = build_callbacks(args)
    trainer = pl.Trainer(
        max_epochs=args.max_epochs,
        accumulate_grad_batches=args.accumulate,
        accelerator="cpu",
        devices=1,
        logger=logger,
        callbacks=callbacks,
        log_every_n_steps=args.log_every_n_steps,
        enable_checkpointing=False,
        enable_progress_bar=not args.quiet,
        enable_model_summary=not args.quiet,
        deterministic=True,
    )
    model = DigitsCNN(lr=args.lr, optimizer=args.optimizer)
    start = time.perf_counter()
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=args.batch_size))
    seconds = time.perf_counter() - start
    stopper = next(cb for cb in callbacks if isinstance(cb, GradNormEarlyStopping))
    monitor = next(cb for cb in callbacks if isinstance(cb, GradNormMonitor))
    metrics = trainer.callback_metrics
    noise = stopper.gradient_noise.host_summary()  # the run's one estimate, as logged and reported
    batch = noise["batch_size"]
    floor = noise["noise_floor"] if batch and noise["count"] else None
    trace = noise["trace_cov"] if floor else 0.0
    smoothed = math.sqrt(max(0.0, 1.0 + noise["grad_sq_norm"] * batch / trace)) if batch and trace > 0 else None
    total = monitor.last_total.get(0)
    return DemoResult(
        steps=trainer.global_step,
        epochs=trainer.current_epoch,
        stop_reason=stopper.describe_stop()
        if stopper.stopped_step is not None
        else f"reached max_epochs={args.max_epochs}",
        grad_norm=float(total) if total is not None else None,
        noise_floor=floor,
        expected_norm=noise["expected_norm"] if floor else None,
        smoothed_ratio=smoothed,
        band_edge=math.sqrt(1.0 + stopper.margin),
        val_acc=float(metrics["val/acc"]) if "val/acc" in metrics else None,
        log_dir=str(Path(logger.log_dir)),
        seconds=seconds,
        threads=torch.get_num_threads(),
        diagnoses=diagnoses(stopper.vitals),
    )


def format_summary(result: DemoResult, logdir: str, details: bool = True) -> str:
    """The short summary; with ``details``, each callback's diagnosis before it, as aligned plain text: the
    summary ends the output, where the eye is when the run is over."""

    def num(x: float | None, fmt: str) -> str:
        return "n/a" if x is None else format(x, fmt)

    ratio = (
        f" ({result.grad_norm / result.expected_norm:.2f}× the expected)"
        if result.grad_norm is not None and result.expected_norm
        else ""
    )
    threads = f"{result.threads} torch thread{'s' if result.threads != 1 else ''}, --threads"
    summary = "\n".join(
        [
            "trainvitals demo — digits CNN",
            f"  optimizer steps:   {result.steps} ({result.epochs} epochs, {result.seconds:.0f} s on {threads})",
            f"  why it stopped:    {result.stop_reason}",
            f"  final grad norm:   {num(result.grad_norm, '.4f')} at the last step vs expected "
            f"{num(result.expected_norm, '.4f')}{ratio}, the RMS sqrt(‖G‖² + tr Σ/B) single steps scatter about",
            f"  smoothed:          E‖ḡ‖ ≈ {num(result.smoothed_ratio, '.2f')}× the noise level sqrt(tr Σ/B) = "
            f"{num(result.noise_floor, '.4f')}, the RMS norm of pure noise (EMAs, what the stop is decided on; the band "
            f"ends at {result.band_edge:.2f}×)",
            f"  val accuracy:      {num(result.val_acc, '.4f')}",
            f"  logs:              {result.log_dir}",
            f"  look at it:        tensorboard --logdir {logdir}   or   trainvitals report {logdir} --format html "
            "--output report.html",
        ]
    )
    if not details:
        return summary
    sections = [
        f"{name}\n{'=' * len(name)}\n{markdown_to_text(markdown)}" for name, markdown in result.diagnoses.items()
    ]
    return "\n\n".join(
        ["Diagnoses (also the first panels of TensorBoard's Text tab, diagnosis/...)", *sections, summary]
    )


def main(args: argparse.Namespace) -> int:
    for name in ("max_epochs", "batch_size", "accumulate", "log_every_n_steps", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    with _quiet_lightning(args.quiet):
        result = run_demo(args)
    print(format_summary(result, args.logdir, details=not args.quiet))
    return 0


@contextmanager
def _quiet_lightning(quiet: bool) -> Iterator[None]:
    """With ``--quiet``, Lightning's and the callbacks' info lines stay off the console (warnings stay)."""
    with warnings.catch_warnings():
        # Lightning 2.6 under torch 2.13 warns about torch's own LeafSpec deprecation; nothing to act on.
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
        if not quiet:
            yield
            return
        lightning_logger = logging.getLogger("lightning.pytorch")
        level = lightning_logger.level
        lightning_logger.setLevel(logging.WARNING)
        try:
            yield
        finally:
            lightning_logger.setLevel(level)
