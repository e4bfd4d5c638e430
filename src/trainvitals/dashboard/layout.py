"""The trainvitals dashboard: a TensorBoard custom-scalars layout, end-of-run text panels, progress bar.

TensorBoard's Custom Scalars dashboard draws charts whose lines are picked by tag regexes (matched
from the start of the tag with Python's ``re.match``); the layout is a ``layout_pb2.Layout`` written
once into the event file under the ``custom_scalars__config__`` tag. :data:`TRAINVITALS_LAYOUT` is
that layout: the story of a run on one page, whichever callbacks were attached — a chart whose tags
were never logged stays empty and harmless.

The layout proto has no y-scale field: the log scale of the gradient-norm chart is the chart's own
"Toggle y-axis log scale" button (the browser test turns it on for the README screenshot).
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from trainvitals.callbacks._cadence import is_logging_step, logging_every
from trainvitals.callbacks._writers import log_text, tensorboard_writers
from trainvitals.callbacks.grad_norm_early_stopping import GradNormEarlyStopping
from trainvitals.callbacks.grad_norm_monitor import GradNormMonitor
from trainvitals.core.noise import NoiseScaleEMA
from trainvitals.dashboard.tags import MEMORY_BYTES, PER_LAYER_GRAD_NORM, grad_norm

CATEGORY = "trainvitals"

TRAINVITALS_LAYOUT: dict[str, dict[str, list[Any]]] = {
    CATEGORY: {
        "gradient norm vs noise floor (use the log-scale toggle)": [
            "Multiline",
            [grad_norm("total"), grad_norm("clipped_total"), grad_norm("noise_floor"), r"grad_noise/noise_floor$"],
        ],
        "in the noise band (1 = yes)": ["Multiline", [grad_norm("in_noise_band")]],
        "B_simple vs effective batch (examples)": [
            "Multiline",
            [grad_norm("b_simple"), r"grad_noise/b_simple$", r"lr_scaling/(?:effective_batch|b_noise)$"],
        ],
        "per-layer gradient norm": ["Multiline", [PER_LAYER_GRAD_NORM]],
        "per-layer GSNR": ["Multiline", [r"grad_noise/gsnr/.+"]],
        "gradient noise: tr(Σ), ‖G‖², evidence criterion": [
            "Multiline",
            [r"grad_noise/(?:trace_cov|grad_sq_norm|eb_criterion)$"],
        ],
        "memory by category (bytes)": ["Multiline", [MEMORY_BYTES]],
        "saved activations per module (bytes)": ["Multiline", [r"memory/activations/.+"]],
        "integrity counters": [
            "Multiline",
            [grad_norm("nonfinite_steps"), grad_norm("amp_skipped_steps"), grad_norm("spike_steps"), r"graph/.+"],
        ],
        "learning rate and its suggestion": ["Multiline", [r"lr-.+", r"lr_scaling/(?:lr|suggested_lr_[^/]+)/.+"]],
        "steps and examples over their minimum": ["Multiline", [r"lr_scaling/(?:steps|examples)_over_min$"]],
    }
}
"""``SummaryWriter.add_custom_scalars`` layout: {category: {chart title: ["Multiline", [tag regexes]]}}.

The ``lr-.+`` line is Lightning's ``LearningRateMonitor``; everything else is a trainvitals callback.
"""

DIAGNOSIS_TAG = "trainvitals/diagnosis"
"""Text panels ``trainvitals/diagnosis/<callback class>`` hold each callback's end-of-run markdown."""

class TrainvitalsDashboard(Callback):
    """Write the trainvitals layout at fit start, the callbacks' diagnoses at fit end; feed the progress bar.

    - At fit start, on global rank zero, each TensorBoardLogger gets :data:`TRAINVITALS_LAYOUT`.
    - At fit end, each trainvitals callback gets a text panel ``trainvitals/diagnosis/<class name>``
      with its end-of-run markdown (its ``summary_markdown()``).
    - On the Trainer's logging steps (``log_every_n_steps`` optimizer steps), the progress bar shows
      ``grad_norm`` (GradNormMonitor's latest total norm) and ``noise_band``: 1 when the smoothed
      ‖G‖² ≤ margin · tr(Σ)/B, with GradNormEarlyStopping's margin and noise estimate (its own, else
      a BatchVarianceProbe's), as it decides; without a stopper, margin 1 (B ≤ B_simple). The values
      are read from the device on those steps only (a few scalars), never on the others.

    Args:
        progress_bar: show the two values in the progress bar.
        diagnosis: write the end-of-run text panels.
    """

    def __init__(self, progress_bar: bool = True, diagnosis: bool = True) -> None:
        self.progress_bar = progress_bar
        self.diagnosis = diagnosis
        self._shown_at: int | None = None

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        for writer in tensorboard_writers(trainer, "the custom-scalars dashboard"):
            writer.add_custom_scalars(TRAINVITALS_LAYOUT)

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *_: Any) -> None:
        # global_step has advanced past the optimizer step this batch ran, if it ran one.
        step = trainer.global_step - 1
        if not self.progress_bar or step < 0 or self._shown_at == step or not is_logging_step(step, logging_every(trainer)):
            return
        self._shown_at = step
        for name, value in progress_bar_values(trainer).items():
            pl_module.log(name, value, prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=1)

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not self.diagnosis:
            return
        for name, markdown in diagnoses(trainer).items():
            log_text(trainer, f"{DIAGNOSIS_TAG}/{name}", markdown, trainer.global_step)


def diagnoses(trainer: "pl.Trainer") -> dict[str, str]:
    """{callback class name: its end-of-run markdown} for the Trainer's trainvitals callbacks.

    Every trainvitals callback with something to say at the end has ``summary_markdown() -> str``.
    """
    return {type(cb).__name__: cb.summary_markdown() for cb in trainer.callbacks
            if type(cb).__module__.startswith("trainvitals.") and callable(getattr(cb, "summary_markdown", None))}


def progress_bar_values(trainer: "pl.Trainer") -> dict[str, float]:
    """The latest total gradient norm and noise-band flag as host floats; empty until measured."""
    values: dict[str, float] = {}
    monitor = next((cb for cb in trainer.callbacks if isinstance(cb, GradNormMonitor)), None)
    if monitor is not None and 0 in monitor.last_total:
        values["grad_norm"] = float(monitor.last_total[0])
    stopper = next((cb for cb in trainer.callbacks if isinstance(cb, GradNormEarlyStopping)), None)
    margin = stopper.margin if stopper is not None else 1.0
    # The stopper's own estimate first: it prefers it to a probe's when it has one.
    for callback in sorted(trainer.callbacks, key=lambda cb: cb is not stopper):
        noise = getattr(callback, "noise", None)
        if isinstance(noise, NoiseScaleEMA) and int(noise.count) > 0 and callback.effective_batch_size:
            values["noise_band"] = float(noise.in_noise_band(callback.effective_batch_size, margin))
            break
    return values
