"""Writing to the Trainer's loggers: scalars to every logger; histograms, text and the fit-end report each
logger its own way.

Callbacks measure on the device and call these only on a logging step; :func:`log_scalars` moves all
values of one step to the host in a single transfer, gives a TensorBoardLogger all of them as one
event, and puts them in ``trainer.callback_metrics`` so that Lightning's own callbacks
(``ModelCheckpoint(monitor=...)``, ``EarlyStopping(monitor=...)``) can use them.

What each logger gets beyond scalars (wandb and mlflow are imported only when such a logger is in use):

======================  ====================  ===================================  ================================
logger                  histograms            text panels                          fit-end report (:func:`hand_report`)
======================  ====================  ===================================  ================================
TensorBoardLogger       histogram events      Text tab (``add_text``)              files in its ``log_dir``
WandbLogger             ``wandb.Histogram``   ``wandb.Html``                       ``wandb.Html`` + ``wandb.Table``,
                                                                                   files in its run's ``files/``
MLFlowLogger            skipped               ``log_text``: ``<tag>/step_<n>.md``  artifacts (``log_artifact``)
CSVLogger, others       skipped               skipped                              files in its ``log_dir`` (CSV)
======================  ====================  ===================================  ================================

A logger that cannot take a kind is skipped with one notice per kind when none of the loggers can, never an
error. Keys keep their ``/`` sections (W&B's panels, MLflow's folders); for MLflow every character outside
``A-Z a-z 0-9 _ - . / space`` becomes ``_`` (:func:`mlflow_key`): Lightning's MLFlowLogger would drop it, with a
warning on every call. On global rank zero, a fit whose TrainvitalsDashboard asked for it (:func:`keep_record`)
also keeps a :class:`RunRecord` of every scalar and text panel written here, for its fit-end report.
"""

from __future__ import annotations

import math
import tempfile
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.fabric.utilities.logger import _add_prefix  # what the logger itself uses
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities.rank_zero import WarningCache
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.plugins.histogram.metadata import create_summary_metadata
from torch import Tensor
from torch.utils.tensorboard.summary import histogram_raw

from trainvitals.tags import REPORT_HTML, REPORT_JSON, mlflow_key
from trainvitals.text.markdown import markdown_to_html

_notices = WarningCache()


class RunRecord:
    """What the callbacks wrote in one fit, on global rank zero, for the fit-end report.

    ``texts``: ``{tag: [(step, markdown)]}``; the scalars as :meth:`series`. Memory is bounded: the scalars go,
    as they come, to an unnamed temporary file (12 bytes a logged value: the tag's number, the step as int32,
    the value as float32, as an event file holds it), read back once at fit end; memory keeps only the tags
    and the text panels. :meth:`close` deletes the file. ``TrainvitalsDashboard(report=False)`` keeps none.
    """

    _ROW = np.dtype([("tag", "<i4"), ("step", "<i4"), ("value", "<f4")])

    def __init__(self) -> None:
        self._tags: dict[str, int] = {}
        self._file = tempfile.TemporaryFile()
        self.texts: dict[str, list[tuple[int, str]]] = {}

    def add_scalars(self, values: Mapping[str, float], step: int) -> None:
        rows = np.empty(len(values), self._ROW)
        rows["tag"] = [self._tags.setdefault(key, len(self._tags)) for key in values]
        rows["step"] = step
        rows["value"] = list(values.values())
        self._file.write(rows.tobytes())

    def add_text(self, tag: str, markdown: str, step: int) -> None:
        self.texts.setdefault(tag, []).append((step, markdown))

    def series(self) -> dict[str, list[tuple[int, float]]]:
        """``{tag: [(step, value)]}`` in the order logged, as ``trainvitals report`` reads a run's scalars."""
        self._file.seek(0)
        rows = np.frombuffer(self._file.read(), self._ROW)
        self._file.seek(0, 2)  # later writes append
        order = np.argsort(rows["tag"], kind="stable")
        starts = np.searchsorted(rows["tag"][order], np.arange(len(self._tags)))
        chunks = np.split(rows[order], starts[1:])
        return {
            key: list(zip(chunk["step"].tolist(), chunk["value"].tolist())) for key, chunk in zip(self._tags, chunks)
        }

    def close(self) -> None:
        self._file.close()


_records: weakref.WeakKeyDictionary[Any, RunRecord] = weakref.WeakKeyDictionary()


def keep_record(trainer: "pl.Trainer") -> RunRecord | None:
    """Start this fit's :class:`RunRecord` of ``trainer`` (a new one each call), on global rank zero; ``None``
    on the other ranks, which keep none."""
    if trainer.global_rank != 0:
        return None
    record = _records[trainer] = RunRecord()
    return record


def drop_record(trainer: "pl.Trainer") -> None:
    """Stop keeping ``trainer``'s record (the fit is over) and delete its file."""
    record = _records.pop(trainer, None)
    if record is not None:
        record.close()


def _record(trainer: "pl.Trainer") -> RunRecord | None:
    try:
        return _records.get(trainer)
    except TypeError:  # a stand-in trainer (a namespace) that takes no weak reference has none
        return None


def log_scalars(
    trainer: "pl.Trainer", metrics: Mapping[str, Tensor | float], step: int, finite_only: bool = False
) -> dict[str, float]:
    """Write ``metrics`` to every logger at ``step`` (optimizer steps); returns them as floats.

    Tensors are stacked and copied to the host in one transfer, whatever their number.
    ``finite_only`` leaves out NaN and ±inf from the loggers: estimates that are not defined yet (a ratio over
    an estimate that is still ≤ 0) or unbounded (an interval's open end), which would otherwise stretch a chart's
    axis to infinity. Every value, finite or not, also goes to ``trainer.callback_metrics`` under the same name
    (no logger prefix), on every rank, with or without loggers (:func:`feed_callback_metrics`): a tag left out
    of a chart at a step is NaN or inf there, never the last finite value logged.
    """
    tensor_keys = [k for k, v in metrics.items() if isinstance(v, Tensor)]
    values = {k: float(v) for k, v in metrics.items() if not isinstance(v, Tensor)}
    if tensor_keys:
        stacked = torch.stack([_scalar(metrics[k]) for k in tensor_keys])  # type: ignore[arg-type]
        values.update(zip(tensor_keys, stacked.cpu().tolist()))
    feed_callback_metrics(trainer, values)
    if finite_only:
        values = {k: v for k, v in values.items() if math.isfinite(v)}
    record = _record(trainer)
    if record is not None:
        record.add_scalars(values, step)
    for logger in trainer.loggers:
        # A subclass that overrides log_metrics (to filter, rename, ...) keeps its own way.
        if isinstance(logger, TensorBoardLogger) and type(logger).log_metrics is TensorBoardLogger.log_metrics:
            _write_tensorboard_scalars(trainer, logger, values, step)
        elif isinstance(logger, MLFlowLogger):
            logger.log_metrics({mlflow_key(k): v for k, v in values.items()}, step=step)
        else:
            logger.log_metrics(values, step=step)
    return values


def _scalar(value: Tensor) -> Tensor:
    """``value`` as a ``()`` float64 tensor, with no kernel for what it already is (a logging step stacks dozens)."""
    value = value.detach() if value.requires_grad else value
    value = value if value.dim() == 0 else value.reshape(())
    return value if value.dtype == torch.float64 else value.to(torch.float64)


def feed_callback_metrics(trainer: "pl.Trainer", values: Mapping[str, float]) -> None:
    """Put ``values`` into ``trainer.callback_metrics`` as CPU float32 tensors, as ``self.log`` would.

    Written into the logger connector's dict, which ``trainer.callback_metrics`` returns and Lightning
    only adds to during a fit: ``pl_module.log`` is refused in some of the hooks that log (``on_train_end``,
    ``on_exception``) and would make each value a device tensor again, and reading the public property
    recomputes the module's own logged results (a collective for ``sync_dist`` values).
    """
    connector = getattr(trainer, "_logger_connector", None)
    if connector is not None and values:  # one tensor for all, one view each
        tensors = torch.tensor(list(values.values()), dtype=torch.float32).unbind()
        connector._callback_metrics.update(zip(values, tensors))


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
        _notices.info(f"trainvitals: for {what} you need a TensorBoardLogger; the loggers in use go without.")
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
    """A histogram of ``values`` (a tensor or several, any shapes; non-finite entries dropped), in bounded memory
    (:func:`histogram_summary`), to each TensorBoardLogger and WandbLogger; ``description``: markdown TensorBoard
    shows with the tag (the first step's, as it keeps a tag's first metadata)."""
    loggers = _takers(trainer, "histograms", (TensorBoardLogger, WandbLogger))
    if not loggers:
        return
    summary = histogram_summary([values] if isinstance(values, Tensor) else values)
    if summary is None:
        return
    event = histogram_raw(tag, **summary)
    if description:  # with the plugin's name, which readers of the legacy format expect beside any metadata
        event.value[0].metadata.CopyFrom(create_summary_metadata(display_name=tag, description=description))
    for logger in loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment._get_file_writer().add_summary(event, step)
        else:
            import wandb

            edges = np.array([summary["min"], *summary["bucket_limits"]])
            histogram = wandb.Histogram(np_histogram=(np.array(summary["bucket_counts"]), edges))
            _wandb_log(logger, {tag: histogram}, step)


def log_text(trainer: "pl.Trainer", tag: str, markdown: str, step: int) -> None:
    """A text panel (markdown): TensorBoard's Text tab, a ``wandb.Html``, an MLflow text artifact
    ``<tag>/step_<step>.md``; kept in the fit's :class:`RunRecord` if there is one."""
    record = _record(trainer)
    if record is not None:
        record.add_text(tag, markdown, step)
    for logger in _takers(trainer, "text panels", (TensorBoardLogger, WandbLogger, MLFlowLogger)):
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_text(tag, markdown, global_step=step)
        elif isinstance(logger, WandbLogger):
            import wandb

            _wandb_log(logger, {tag: wandb.Html(markdown_to_html(markdown), inject=False)}, step)
        else:
            logger.experiment.log_text(logger.run_id, markdown, f"{mlflow_key(tag)}/step_{step}.md")


def log_image(trainer: "pl.Trainer", tag: str, image: np.ndarray, step: int) -> None:
    """A TensorBoard image from an ``(H, W, 3)`` uint8 array."""
    for w in tensorboard_writers(trainer, "images"):
        w.add_image(tag, image, global_step=step, dataformats="HWC")


def hand_report(
    trainer: "pl.Trainer", html: str | None, json_text: str, findings: Sequence[tuple[str, str, str]]
) -> list[Path]:
    """The fit-end report to every logger, on global rank zero; returns the files written.

    The page ``html`` (``None``: none) and ``json_text`` go as :data:`~trainvitals.tags.REPORT_HTML` and
    :data:`~trainvitals.tags.REPORT_JSON` into each logger's run folder (:func:`report_folders`); a WandbLogger
    also gets the page as ``wandb.Html`` and ``findings`` (severity, section, message) as a ``wandb.Table``, under
    ``trainvitals/report`` and ``trainvitals/findings``; an MLFlowLogger the files as artifacts of its run
    (``log_artifact``, copied from a temporary folder when no other logger has a folder).
    """
    if trainer.global_rank != 0 or not trainer.loggers:
        return []
    files = {REPORT_JSON: json_text} if html is None else {REPORT_HTML: html, REPORT_JSON: json_text}
    written = []
    for folder in report_folders(trainer):
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (folder / name).write_text(text, encoding="utf-8")
            written.append(folder / name)
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            import wandb

            table = wandb.Table(columns=["severity", "section", "message"], data=[list(f) for f in findings])
            shown = {"trainvitals/findings": table}
            if html is not None:
                shown["trainvitals/report"] = wandb.Html(html, inject=False)
            _wandb_log(logger, shown, trainer.global_step)
        elif isinstance(logger, MLFlowLogger):
            if written:
                for path in written[: len(files)]:
                    logger.experiment.log_artifact(logger.run_id, str(path))
                continue
            with tempfile.TemporaryDirectory() as folder:
                for name, text in files.items():
                    (Path(folder) / name).write_text(text, encoding="utf-8")
                    logger.experiment.log_artifact(logger.run_id, str(Path(folder) / name))
    return written


def report_folders(trainer: "pl.Trainer") -> list[Path]:
    """Where the fit-end report goes, each folder once: every TensorBoardLogger's and CSVLogger's ``log_dir``,
    every WandbLogger's run ``files/`` folder (``experiment.dir``: W&B uploads what is there with the run).
    An MLFlowLogger's artifacts are its store's, written through its client (:func:`hand_report`)."""
    folders: dict[Path, None] = {}
    for logger in trainer.loggers:
        if isinstance(logger, (TensorBoardLogger, CSVLogger)):
            folders[Path(logger.log_dir).resolve()] = None
        elif isinstance(logger, WandbLogger):
            folders[Path(logger.experiment.dir).resolve()] = None
    return list(folders)


def _takers(trainer: "pl.Trainer", what: str, kinds: tuple[type[Logger], ...]) -> list[Logger]:
    """The loggers of ``kinds`` (those that take ``what``), on global rank zero only; when there are loggers but
    none of them, says once that ``what`` is skipped."""
    if trainer.global_rank != 0:
        return []
    loggers = [lg for lg in trainer.loggers if isinstance(lg, kinds)]
    if trainer.loggers and not loggers:
        names = " or ".join(kind.__name__ for kind in kinds)
        _notices.info(f"trainvitals: for {what} you need a {names}; the loggers in use go without.")
    return loggers


def _wandb_log(logger: WandbLogger, values: Mapping[str, Any], step: int) -> None:
    """``values`` (W&B media) at optimizer step ``step``, as WandbLogger's ``log_metrics`` puts its scalars:
    the logger's prefix on each key, the step as ``trainer/global_step`` (its x axis)."""
    logger.experiment.log(
        {**_add_prefix(dict(values), logger._prefix, logger.LOGGER_JOIN_CHAR), "trainer/global_step": step}
    )
