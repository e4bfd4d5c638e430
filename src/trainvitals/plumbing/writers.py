"""Writing to the Trainer's loggers: scalars to every logger, histograms, text and images to TensorBoard.

Callbacks measure on the device and call these only on a logging step; :func:`log_scalars` moves all
values of one step to the host in a single transfer, gives a TensorBoardLogger all of them as one
event, and puts them in ``trainer.callback_metrics`` so that Lightning's own callbacks
(``ModelCheckpoint(monitor=...)``, ``EarlyStopping(monitor=...)``) can use them. Loggers that cannot
take histograms, text or images (CSVLogger, ...) are skipped with one notice per kind, never an error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.fabric.utilities.logger import _add_prefix  # what the logger itself uses
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import WarningCache
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.plugins.histogram.metadata import create_summary_metadata
from torch import Tensor
from torch.utils.tensorboard.summary import histogram_raw

_notices = WarningCache()


def log_scalars(
    trainer: "pl.Trainer", metrics: Mapping[str, Tensor | float], step: int, finite_only: bool = False
) -> dict[str, float]:
    """Write ``metrics`` to every logger at ``step`` (optimizer steps); returns them as floats.

    Tensors are stacked and copied to the host in one transfer, whatever their number.
    ``finite_only`` leaves out NaN and ±inf: estimates that are not defined yet (a ratio over an
    estimate that is still ≤ 0), which would otherwise stretch a chart's axis to infinity.
    The values also go to ``trainer.callback_metrics`` under the same names (no logger prefix), on
    every rank, with or without loggers: :func:`feed_callback_metrics`.
    """
    tensor_keys = [k for k, v in metrics.items() if isinstance(v, Tensor)]
    values = {k: float(v) for k, v in metrics.items() if not isinstance(v, Tensor)}
    if tensor_keys:
        stacked = torch.stack([metrics[k].detach().reshape(()).to(torch.float64) for k in tensor_keys])  # type: ignore[union-attr]
        values.update(zip(tensor_keys, stacked.cpu().tolist()))
    if finite_only:
        values = {k: v for k, v in values.items() if math.isfinite(v)}
    feed_callback_metrics(trainer, values)
    for logger in trainer.loggers:
        # A subclass that overrides log_metrics (to filter, rename, ...) keeps its own way.
        if isinstance(logger, TensorBoardLogger) and type(logger).log_metrics is TensorBoardLogger.log_metrics:
            _write_tensorboard_scalars(trainer, logger, values, step)
        else:
            logger.log_metrics(values, step=step)
    return values


def feed_callback_metrics(trainer: "pl.Trainer", values: Mapping[str, float]) -> None:
    """Put ``values`` into ``trainer.callback_metrics`` as CPU float32 tensors, as ``self.log`` would.

    Written into the logger connector's dict, which ``trainer.callback_metrics`` returns and Lightning
    only adds to during a fit: ``pl_module.log`` is refused in some of the hooks that log (``on_train_end``,
    ``on_exception``) and would make each value a device tensor again, and reading the public property
    recomputes the module's own logged results (a collective for ``sync_dist`` values).
    """
    connector = getattr(trainer, "_logger_connector", None)
    if connector is not None:
        connector._callback_metrics.update({k: torch.tensor(v, dtype=torch.float32) for k, v in values.items()})


def _write_tensorboard_scalars(
    trainer: "pl.Trainer", logger: TensorBoardLogger, values: Mapping[str, float], step: int
) -> None:
    """The scalars of one step as a single event: one ``Summary`` holding every value.

    ``TensorBoardLogger.log_metrics`` writes one event per scalar, and TensorBoard's event writer
    checksums each event in pure Python; for 9 scalars one event costs ~6× less CPU time
    (docs/benchmarks.md). TensorBoard reads the values as the same scalar tags either way.
    """
    if trainer.global_rank != 0:  # as ``log_metrics``, which is rank-zero-only
        return
    values = _add_prefix(values, logger._prefix, logger.LOGGER_JOIN_CHAR)
    summary = Summary(value=[Summary.Value(tag=tag, simple_value=value) for tag, value in values.items()])
    logger.experiment._get_file_writer().add_summary(summary, step)


def note_unrecorded(trainer: "pl.Trainer", callback: object) -> None:
    """Say once per callback class that a Trainer without loggers (``logger=False``) records none of its
    metrics: a run that shows no chart should not look like a run that measured nothing."""
    if not trainer.loggers:
        _notices.info(
            f"trainvitals {type(callback).__name__}: the Trainer has no logger (logger=False), so none of "
            "its metrics are recorded (they still reach trainer.callback_metrics); pass a logger (a "
            "TensorBoardLogger for text panels and the dashboard) to keep them."
        )


def tensorboard_loggers(trainer: "pl.Trainer", what: str) -> list[TensorBoardLogger]:
    """The TensorBoardLoggers, on global rank zero only.

    When there are loggers but none is a TensorBoardLogger, says once that ``what`` is skipped.
    """
    if trainer.global_rank != 0:
        return []
    loggers = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
    if trainer.loggers and not loggers:
        _notices.info(f"trainvitals: for {what} you need a TensorBoardLogger; the loggers in use get scalars only.")
    return loggers


def tensorboard_writers(trainer: "pl.Trainer", what: str) -> list:
    """The ``SummaryWriter`` of each TensorBoardLogger, on global rank zero only (see :func:`tensorboard_loggers`)."""
    return [lg.experiment for lg in tensorboard_loggers(trainer, what)]


HISTOGRAM_BINS = 64
"""Equal-width bins between the smallest and the largest finite value of a histogram."""


def histogram_summary(values: Sequence[Tensor], bins: int = HISTOGRAM_BINS) -> dict[str, Any] | None:
    """``SummaryWriter.add_histogram_raw``'s arguments for the finite entries of ``values``, or ``None``.

    Counted on the values' device one tensor at a time (``torch.histc``), so the extra memory is that of
    the largest tensor's temporaries (a float32 copy of a 16-bit one), never a concatenation of all of
    them; three small transfers to the host. Per-tensor sums in float32, added up in float64.
    """
    parts = [v.detach().reshape(-1) for v in values if v.numel()]
    if not parts:
        return None
    finite = torch.stack([torch.isfinite(p).all() for p in parts]).tolist()
    parts = [p if ok else p[torch.isfinite(p)] for p, ok in zip(parts, finite)]
    parts = [p.float() for p in parts if p.numel()]
    if not parts:
        return None
    lo, hi = torch.stack(
        [torch.stack([p.min() for p in parts]).min(), torch.stack([p.max() for p in parts]).max()]
    ).tolist()
    width_hi = hi if hi > lo else lo + 1.0
    totals = torch.zeros(bins + 2, dtype=torch.float64, device=parts[0].device)  # the counts, Σv, Σv²: one transfer
    counts = totals[:bins]
    for p in parts:
        counts += torch.histc(p, bins=bins, min=lo, max=width_hi).double()
        totals[bins] += p.sum().double()
        totals[bins + 1] += torch.linalg.vector_norm(p).double() ** 2
    *counts_host, total, squares = totals.tolist()
    limits = np.linspace(lo, width_hi, bins + 1)[1:]
    return {
        "min": lo,
        "max": hi,
        "num": int(sum(p.numel() for p in parts)),
        "sum": total,
        "sum_squares": squares,
        "bucket_limits": limits.tolist(),
        "bucket_counts": counts_host,
    }


def log_histogram(
    trainer: "pl.Trainer", tag: str, values: Tensor | Sequence[Tensor], step: int, description: str = ""
) -> None:
    """A TensorBoard histogram of ``values`` (a tensor or several, any shapes; non-finite entries dropped),
    in bounded memory (:func:`histogram_summary`); ``description``: markdown TensorBoard shows with the tag
    (the first step's, as it keeps a tag's first metadata)."""
    writers = tensorboard_writers(trainer, "histograms")
    if not writers:
        return
    summary = histogram_summary([values] if isinstance(values, Tensor) else values)
    if summary is None:
        return
    event = histogram_raw(tag, **summary)
    if description:  # with the plugin's name, which readers of the legacy format expect beside any metadata
        event.value[0].metadata.CopyFrom(create_summary_metadata(display_name=tag, description=description))
    for w in writers:
        w._get_file_writer().add_summary(event, step)


def log_text(trainer: "pl.Trainer", tag: str, markdown: str, step: int) -> None:
    """A TensorBoard text panel (markdown)."""
    for w in tensorboard_writers(trainer, "text panels"):
        w.add_text(tag, markdown, global_step=step)


def log_image(trainer: "pl.Trainer", tag: str, image: np.ndarray, step: int) -> None:
    """A TensorBoard image from an ``(H, W, 3)`` uint8 array."""
    for w in tensorboard_writers(trainer, "images"):
        w.add_image(tag, image, global_step=step, dataformats="HWC")
