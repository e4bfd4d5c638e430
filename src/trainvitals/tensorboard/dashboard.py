"""TrainvitalsDashboard: the trainvitals layout in TensorBoard, the callbacks' diagnoses, the fit-end report for
every logger, the progress bar."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from typing_extensions import override

from trainvitals._validation import check_bool
from trainvitals.noise.estimate import band_ratio
from trainvitals.plumbing.base import TrainvitalsCallback
from trainvitals.plumbing.cadence import is_logging_step, logging_every
from trainvitals.plumbing.sharing import GRAD_NORM, GRADIENT_NOISE, NOISE_BAND, RESTORED_SUMMARY, SUMMARY, Vitals
from trainvitals.plumbing.writers import RunRecord, drop_record, hand_report, keep_record, log_text, tensorboard_loggers
from trainvitals.report.record import fit_end_report
from trainvitals.tags import DIAGNOSIS_TAG, FIT_END_TAG, FIT_ENDED, FIT_RAISED, REPORT_HTML, REPORT_JSON
from trainvitals.tensorboard.layout import layer_groups, trainvitals_layout


class TrainvitalsDashboard(TrainvitalsCallback):
    """Write the trainvitals layout at fit start, the callbacks' diagnoses at fit end; feed the progress bar.

    - At fit start, on global rank zero, each TensorBoardLogger gets the layout of
      :func:`~trainvitals.tensorboard.layout.trainvitals_layout`: one per-layer chart per top-level module, the
      tags behind the logger's ``prefix`` (``TensorBoardLogger(prefix="train")`` writes ``train-grad_norm/...``).
    - At fit end, each trainvitals callback gets a text panel ``diagnosis/<class name>`` (the Text tab's first group)
      with its end-of-run markdown (its ``summary_markdown()``). A fit that ran no optimizer step (a relaunch
      from a checkpoint with no step left) writes only those made from the restored state
      (:data:`~trainvitals.plumbing.sharing.RESTORED_SUMMARY`): the others would describe this empty fit, and,
      written into the same folder at the same step, would replace the run's diagnoses in ``trainvitals report``.
    - How the fit ended, in the text panel ``trainvitals/fit_end`` (:data:`~trainvitals.tags.FIT_END_TAG`): at fit
      end, or from ``on_exception`` with the exception's type. ``trainvitals report`` reads it to tell a finished
      fit from a crashed one, and one with the layout but neither line from one killed or still running.
    - Then, on global rank zero, the run's report (``report=True``): the page ``trainvitals report --format html``
      writes (:data:`~trainvitals.tags.REPORT_HTML`, when matplotlib is installed) and its JSON
      (:data:`~trainvitals.tags.REPORT_JSON`, with the run's text panels), made from every trainvitals scalar and
      text panel of this fit as the shared writer kept them (``RunRecord``: on a temporary file, 12 bytes a logged value), into each
      logger's run folder — a TensorBoardLogger's or CSVLogger's ``log_dir``, a WandbLogger's run ``files/`` —, to
      W&B also as ``wandb.Html`` and a ``wandb.Table`` of the findings, to MLflow as artifacts of its run
      (:func:`~trainvitals.plumbing.writers.hand_report`). From ``on_exception`` too, so that a crashed fit's
      folder says so without event files. Not after a fit that ran no optimizer step (its report would replace
      the run's with an empty one), nor with ``logger=False``. A run without the dashboard gets none: the dashboard
      is what records the fit's end, which the report's status needs.
    - On the Trainer's logging steps (``log_every_n_steps`` optimizer steps), the progress bar shows
      ``grad_norm`` (GradNormMonitor's latest total norm) and ``band_ratio``: the smoothed ‖G‖² over the
      noise band's edge margin · tr(Σ)/B, with GradNormEarlyStopping's margin and noise estimate (its own,
      else a BatchVarianceProbe's), while the estimate can decide; ≤ 1 is in the band. Without a stopper,
      margin 1 (≤ 1: B ≤ B_simple). A number rather than the 0/1 band flag, which Lightning's progress
      bar would show as a float (``0.000``). The values are read from the device on those steps only
      (a few scalars), never on the others. The bar's ``v_num`` is the progress bar's own (its
      ``get_metrics``), not this callback's.

    Args:
        progress_bar: show the two values in the progress bar.
        diagnosis: write the end-of-run text panels.
        report: write the run's report at fit end.

    Raises:
        TypeError: if an argument is not a bool, naming it.
    """

    reads = (GRAD_NORM, NOISE_BAND, GRADIENT_NOISE, SUMMARY, RESTORED_SUMMARY)

    def __init__(self, progress_bar: bool = True, diagnosis: bool = True, report: bool = True) -> None:
        super().__init__()
        self.progress_bar = check_bool("progress_bar", progress_bar)
        self.diagnosis = check_bool("diagnosis", diagnosis)
        self.report = check_bool("report", report)
        # Nothing is saved: the panels and the progress bar are this fit's.
        self._shown_at: int | None  # the optimizer step the progress bar last showed
        self.add_state("_shown_at", None, persistent=False)
        self.add_state("_panels", 0, persistent=False)
        self._trained_from: int | None  # global_step at train start (restored by then); None: training never started
        self.add_state("_trained_from", None, persistent=False)
        self._record: RunRecord | None  # this fit's scalars and text panels, on global rank zero (report=True)
        self.add_state("_record", None, persistent=False)
        self._report_files: list[Path]  # where this fit's report went
        self.add_state("_report_files", list, persistent=False)

    @override
    def setup_fit(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.report:
            self._record = keep_record(trainer)

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._forget_record(trainer)

    def _forget_record(self, trainer: "pl.Trainer") -> None:
        drop_record(trainer)
        self._record = None

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        groups = layer_groups([name for name, _ in pl_module.named_parameters()])
        for logger in tensorboard_loggers(trainer, "the custom-scalars dashboard"):
            logger.experiment.add_custom_scalars(trainvitals_layout(logger._prefix, logger.LOGGER_JOIN_CHAR, groups))

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._trained_from = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *_: Any) -> None:
        # global_step has advanced past the optimizer step this batch ran, if it ran one.
        step = trainer.global_step - 1
        if (
            not self.progress_bar
            or step < 0
            or self._shown_at == step
            or not is_logging_step(step, logging_every(trainer))
        ):
            return
        self._shown_at = step
        for name, value in progress_bar_values(self.vitals).items():
            pl_module.log(name, value, prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=1)

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        stepped = self.ran_a_step(trainer)
        if self.diagnosis:
            for name, markdown in diagnoses(self.vitals, restored_only=not stepped).items():
                log_text(trainer, f"{DIAGNOSIS_TAG}/{name}", markdown, trainer.global_step)
                self._panels += 1
        none = "" if stepped else "; this fit ran none (resumed with no step left)"
        log_text(
            trainer,
            FIT_END_TAG,
            f"{FIT_ENDED} after {trainer.global_step} optimizer step(s){none}.",
            trainer.global_step,
        )
        if stepped:
            self._write_report(trainer)
        self._forget_record(trainer)
        self.info(self.summary_line(trainer))

    def ran_a_step(self, trainer: "pl.Trainer") -> bool:
        """Whether this fit ran an optimizer step (``global_step`` moved since train start)."""
        return self._trained_from is not None and trainer.global_step > self._trained_from

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        said = str(exception).strip().splitlines()
        what = type(exception).__name__ + (f": {said[0][:200]}" if said else "")
        log_text(
            trainer, FIT_END_TAG, f"{FIT_RAISED} {what} (at optimizer step {trainer.global_step}).", trainer.global_step
        )
        if self.ran_a_step(trainer):
            self._write_report(trainer)
        self._forget_record(trainer)

    def _write_report(self, trainer: "pl.Trainer") -> None:
        """The run's report from this fit's record, to every logger (class docstring); a failure is a warning."""
        if self._record is None or not trainer.loggers:
            return
        try:
            report, page, document = fit_end_report(_run_name(trainer), self._record.series(), self._record.texts)
            findings = [(f.severity, f.section, f.message) for f in report.findings]
            self._report_files = hand_report(trainer, page, document, findings)
        except Exception as err:  # the fit is over: a report that cannot be written must not fail it
            self.warn(f"the fit-end report could not be written ({type(err).__name__}: {err}).")

    def summary_line(self, trainer: "pl.Trainer") -> str:
        """One line for the end of fit: where the dashboard, the diagnoses and the report went (every run folder's
        copy: the page, or its JSON where there is no page)."""
        logdirs = [lg.log_dir for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        pages = [str(p) for p in self._report_files if p.name == REPORT_HTML] or [
            str(p) for p in self._report_files if p.name == REPORT_JSON
        ]
        report = f"; the report: {', '.join(pages)}" if pages else ""
        if not logdirs:
            return f"no TensorBoardLogger, so no custom-scalars dashboard{report}."
        if not self.diagnosis:
            panels = "no diagnosis panels (diagnosis=False)"
        elif not self.ran_a_step(trainer):
            panels = (
                f"this fit ran no optimizer step: {self._panels} diagnosis panel(s) from the restored state, the "
                f"others those of the fit before, first in the Text tab ({DIAGNOSIS_TAG}/...)"
            )
        else:
            panels = f"{self._panels} diagnosis panel(s) first in the Text tab ({DIAGNOSIS_TAG}/...)"
        return f"{panels}, the charts in Custom Scalars: {tensorboard_command(logdirs)}{report}"


def tensorboard_command(folders: list[str]) -> str:
    """The ``tensorboard`` command that opens every folder of ``folders`` (the TensorBoardLoggers' ``log_dir``):
    ``--logdir`` the one folder, or the folders' common parent, which TensorBoard walks for runs; where that is
    the filesystem's root (or there is none: other drives), each folder named by ``--logdir_spec``."""
    unique = {os.path.abspath(f): f for f in folders}
    if len(unique) == 1:
        return f"tensorboard --logdir {folders[0]}"
    try:
        parent = os.path.commonpath(list(unique))
    except ValueError:  # on different drives
        parent = ""
    if parent and os.path.dirname(parent) != parent:
        return f"tensorboard --logdir {parent}"
    return f"tensorboard --logdir_spec {','.join(unique)}"


def _run_name(trainer: "pl.Trainer") -> str:
    """The report's name of the run, as ``trainvitals report`` names it: its first TensorBoardLogger's or
    CSVLogger's folder (``version_0``), else its first logger's version (a W&B or MLflow run id)."""
    folders = [lg.log_dir for lg in trainer.loggers if isinstance(lg, (TensorBoardLogger, CSVLogger))]
    return Path(folders[0]).name if folders else str(trainer.loggers[0].version)


def diagnoses(vitals: Vitals, restored_only: bool = False) -> dict[str, str]:
    """{callback class name: its end-of-run markdown (``summary_markdown()``)} for the callbacks providing
    :data:`~trainvitals.plumbing.sharing.SUMMARY` (``restored_only``: those providing
    :data:`~trainvitals.plumbing.sharing.RESTORED_SUMMARY`, for a fit that ran no step)."""
    return {
        type(cb).__name__: cb.summary_markdown()
        for cb in vitals.providers(RESTORED_SUMMARY if restored_only else SUMMARY)
    }


def progress_bar_values(vitals: Vitals) -> dict[str, float]:
    """The latest total gradient norm and the smoothed ‖G‖² over the band's edge margin · tr(Σ)/B, as host
    floats; each left out until measured (the ratio: while the estimate can decide, with tr(Σ) > 0)."""
    values: dict[str, float] = {}
    monitor = vitals.provider(GRAD_NORM)
    if monitor is not None and 0 in monitor.last_total:
        values["grad_norm"] = float(monitor.last_total[0])
    stopper = vitals.provider(NOISE_BAND)
    margin = stopper.margin if stopper is not None else 1.0
    noise = vitals.shared(GRADIENT_NOISE)
    if noise is not None and margin > 0:  # the run's one estimate, shown only while it can decide
        estimate = noise.estimate()
        if estimate.batch_size and bool(noise.decisive(estimate) & (estimate.trace_cov > 0)):
            values["band_ratio"] = float(
                band_ratio(estimate.band_grad_sq_norm, estimate.trace_cov, estimate.batch_size, margin)
            )
    return values
