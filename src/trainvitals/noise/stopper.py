r"""GradNormEarlyStopping: stop when the gradient norm has entered its noise band.

A mini-batch gradient never goes to zero: E‖ḡ_B‖² = ‖G‖² + tr(Σ)/B (McCandlish et al. 2018, Eq. A.1),
so as the true gradient G vanishes, the RMS of ‖ḡ_B‖ settles on the noise level sqrt(tr(Σ)/B) — the RMS
norm of pure noise, not a lower bound: single steps fall below it often — and wanders in a band around
it. A fixed threshold such as "‖g‖ < 1e-3" ignores that level (and the loss reduction, loss scale and
parametrisation that set the norm's size); the noise band does not.

This is its own callback rather than a mode of :class:`GradNormMonitor` because it needs what the
monitor does not: a noise source (hooks on the parameters, or a BatchVarianceProbe) and the power to
stop the run. The two can be used together or apart.
"""

from __future__ import annotations

import math
import operator
from enum import Enum
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from trainvitals._validation import check_bool, check_choice, check_float, check_int
from trainvitals.noise.estimate import (
    MIN_MEASUREMENTS,
    SOURCES_CHECK,
    GradientNoise,
    NoiseSource,
    b_simple_interval,
    band_ratio,
)
from trainvitals.noise.estimators import BiasCorrectedEMA, MicroBatchSquaredNorms, two_batch_size_estimates
from trainvitals.norms.nonfinite import NonfiniteCounter
from trainvitals.plumbing.amp import loss_scale
from trainvitals.plumbing.base import TrainvitalsCallback
from trainvitals.plumbing.batch import batch_size, loss_divisor
from trainvitals.plumbing.cadence import is_logging_step, logging_every
from trainvitals.plumbing.loss_progress import NOISE_Z, START_STEPS, LossProgress, plateau_advice
from trainvitals.plumbing.sharing import (
    GRAD_SQ_NORMS,
    GRADIENT_NOISE,
    NOISE_BAND,
    NOISE_PROBE,
    NOISE_TAGS,
    NONFINITE_STEPS,
    RESTORED_SUMMARY,
    SUMMARY,
)
from trainvitals.plumbing.state import reduce_packed
from trainvitals.plumbing.stopping import can_stop_now
from trainvitals.plumbing.writers import feed_callback_metrics, log_scalars, log_text
from trainvitals.text.intervals import band_ratio_said
from trainvitals.text.markdown import markdown_table

MODES = ("noise_band", "threshold", "relative")
BAND_RATIO = "grad_norm/band_ratio"
CURRENT_BAND_RATIO = "grad_noise/band_ratio"
"""The smoothed ‖G‖² over the band's edge margin·tr(Σ)/B (≤ 1: in the band); +inf in ``callback_metrics`` while
the estimate cannot decide."""
HELD_FROM_START = "grad_norm/held_from_start"
"""1 while a full streak is held: the run was never out of its band (noise from the start, no stop); else 0."""
LOSS_DROP = "grad_norm/loss_drop"
"""The fraction the training loss has fallen by since its first steps (:class:`LossProgress`; below ``min_loss_drop``:
a plateau the run has not left, no stop)."""

# Chosen from benchmarks/stopping_tasks.py (docs/benchmarks.md; 7 tasks, 28 runs):
# margin 0.2 with a patience of 10 optimizer steps is within tolerance of the best epoch in 24 runs and
# within tolerance while saving steps in 17, as often as EarlyStopping on the validation loss (22, 17);
# patience 30 gave 21 and 14. Margins 0.5 and 1 save steps more often but are within tolerance in 15–20,
# and on the digits CNN (stopping_comparison.py) they stop Adam 1.2–39 points below its best on average;
# 0.1 never stops Adam there.
DEFAULT_MARGIN = 0.2
DEFAULT_PATIENCE = 10
# At initialisation a network can already sit in its noise band (the digits CNN has B_simple ≈ 140–220
# at step 0, above its batch of 64): the first steps must not count.
DEFAULT_MIN_STEPS = 100
# The host reads the on-device streak every this many steps: one sync per 10 steps, a stop at most 9 late.
DEFAULT_CHECK_EVERY_N_STEPS = 10
# A sigmoid MLP on the digits sits at chance on a plateau in its band, its loss 2-4 % below its start; the stops of
# the demo and of benchmarks/stopping_tasks.py came with the loss 22-99.9 % below its start (noise-band-stopping.md).
DEFAULT_MIN_LOSS_DROP = 0.1
MANUAL = (
    "the noise band needs automatic optimization (this LightningModule steps its optimizers itself, "
    "automatic_optimization=False)"
)


def measurable_by(module: Any, probe: bool, say_probe: bool = True) -> str:
    """ "measurable with …": what would make the noise of ``module``'s run measurable, BatchNorm and a probe named
    only where they apply (``probe``: one is attached); with ``say_probe``, after why an attached probe does not
    measure it (BatchNorm)."""
    parts = [
        "accumulate_grad_batches >= 2 or >= 2 devices (micro-batches and ranks are independent draws "
        "whatever the layers)"
    ]
    batchnorm = module is not None and any(
        isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training for m in module.modules()
    )
    if batchnorm:
        parts.append("GroupNorm or LayerNorm instead of BatchNorm")
    if not probe:
        parts.append("a BatchVarianceProbe on a model whose layers do not mix the examples")
    options = "measurable with " + (parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + ", or " + parts[-1])
    if say_probe and probe and batchnorm:
        return f"the attached BatchVarianceProbe's per-example source is invalid here (BatchNorm in training mode); {options}"
    return options


class StopReason(Enum):
    NOT_STOPPED = "not stopped"
    NOISE_BAND = "gradient norm in its noise band"
    THRESHOLD = "gradient norm below the threshold"
    RELATIVE = "gradient norm below a fraction of its early value"


class GradNormEarlyStopping(TrainvitalsCallback):
    r"""Stop training when the gradient norm stays in its noise band (or below a threshold).

    Modes:

    - ``"noise_band"`` (default): with smoothed estimates of ‖G‖² and tr(Σ), the run is in the band
      when ‖G‖² ≤ ``margin`` · tr(Σ)/B, i.e. the RMS sqrt(E‖ḡ_B‖²) ≤ sqrt(1 + margin) × the noise level
      sqrt(tr Σ/B). ``margin = 1``
      is B ≤ B_simple (the gradient noise scale); with Cockpit's norm test θ² = tr Σ/(B‖G‖² + tr Σ)
      the band is θ ≥ 1/sqrt(1 + margin), so B ≤ B_simple is θ ≥ 1/√2. The estimate is the run's one
      :class:`~trainvitals.noise.estimate.GradientNoise` (:attr:`gradient_noise`), shared with a
      BatchVarianceProbe: the micro-batches of gradient accumulation and the DDP ranks (a tensor hook
      reads each micro-batch's gradient before it is summed into ``.grad``) feed it, and so do the
      probe's per-example norms, each source with its own sampling variance. A source that does not
      estimate sampling noise (per-example gradients through BatchNorm in training mode) never counts;
      with no valid source, or one covering less than 90% of ‖ḡ‖² (a model partly measured), it says
      once why and what would make the run measurable, and never stops on the band. The source is
      chosen at the start of each epoch (so a GradientAccumulationScheduler or parameters unfrozen
      later are followed); an epoch's ragged last accumulation window is left out of the estimate.
      A training step that also takes ``torch.autograd.grad`` with respect to the parameters
      (gradient penalties, SAM) biases the micro-batch estimate.
    - ``"threshold"``: ‖ḡ‖ < ``threshold`` — the naive rule: the norm's RMS stays above the noise level
      sqrt(tr Σ/B), which may lie above any fixed threshold, and its scale changes with loss reduction (sum vs mean),
      loss scaling and parametrisation.
    - ``"relative"``: ‖ḡ‖ < ``fraction`` × its EMA over the first ``reference_steps`` steps.

    ‖ḡ‖ is the L2 norm of the whole accumulated, unscaled, pre-clip gradient, from the step's one pass over
    the gradients that a GradNormMonitor (p = 2) and a BatchVarianceProbe read too.

    The condition must hold for ``patience`` consecutive optimizer steps, not before ``min_steps``;
    steps with non-finite gradients (including those a GradScaler skips) neither count nor reset.
    In ``"noise_band"`` mode the band only counts once the run has been out of it (from the estimate's first
    decisive step, ``min_steps`` or not, on a logging or check step, the band ratio's 90 % interval above 1: out
    beyond the estimate's error): a batch
    far below B_simple makes every step noise from step 0, which calls for a larger batch or a smaller lr,
    not a stop. Such a run is said once (a warning and the ``grad_norm/stop_reason`` text), with the batch
    to use — B_simple's 90 % lower end — and watched on: it stops if it leaves the band and comes back for
    ``patience`` steps. Where the training loss has not fallen by ``min_loss_drop`` either, the run may as well have
    started at its minimum (fine-tuning a converged model), which the gradient's statistics cannot tell apart: both
    readings are said, each with what to do; ``hold_from_start=False`` lets the band stop such a run. The band is
    judged on the estimate's smoothed quantities (each from the window of least variance + lag², ‖G‖² the slow
    EMA's: estimate.py, rule 7), the same the margin
    chart draws. A plateau is in its band as a minimum is (G ≈ 0 on a saddle too): in noise-band mode a full
    streak stops the run only once the training loss has fallen by ``min_loss_drop`` of its start and beyond its
    own noise (:class:`~trainvitals.plumbing.loss_progress.LossProgress`: the mean of the first 10 steps against an
    EMA, β = ``ema_beta``, the ranks' mean under DDP, their difference past 1.645 standard errors), judged on
    logging and check steps; held back, it says so once.
    The streak is kept on the device; the host looks at it every ``check_every_n_steps`` optimizer
    steps, so a stop lands at most ``check_every_n_steps - 1`` steps after the streak completes. The decision is reduced across ranks
    (``reduce_boolean_decision``): all ranks stop at the same step.

    Logged at the Trainer's logging cadence and at the stopping step (step = optimizer step):
    ``grad_norm/in_noise_band`` (0/1, while the estimate is decisive), ``grad_norm/band_streak`` (steps),
    ``grad_norm/held_from_start`` (noise-band mode, 1 while a full streak is held: never out of the band),
    ``grad_norm/loss_drop`` (with ``min_loss_drop``: the fraction the training loss has fallen by since its start),
    ``grad_norm/band_norm`` (the smoothed norm sqrt(‖G‖² + tr Σ/B) the band is judged on), ``grad_norm/band_floor``
    (the noise level sqrt(tr Σ/B), the RMS norm of pure noise) and ``grad_norm/band_edge`` (sqrt(1 + margin) ×
    the noise level: where the band ends); ``grad_norm/band_ratio`` (margin > 0), the smoothed ‖G‖² over the band's
    edge margin·tr(Σ)/B, ≤ 1 in the band: it does not tie from save to save as the streak does outside the band,
    so ``ModelCheckpoint(monitor="grad_norm/band_ratio", mode="min")`` keeps the checkpoint deepest into the band
    (+inf in ``trainer.callback_metrics``, not logged, while the estimate cannot decide), and its 90 % interval
    ``grad_norm/band_ratio_low`` and ``_high`` from the band windows' sampling errors (the high end left out where
    infinite); ``grad_noise/band_ratio`` and its ``_low``/``_high``, the current estimate's ratio (each quantity's
    chosen window, the lag in its error: what covers the ratio at this step, and what the cut records quote);
    without a GradNormMonitor, ``grad_norm/nonfinite_steps`` (``amp_skipped_steps`` under a GradScaler) as the
    monitor counts them (:class:`~trainvitals.norms.nonfinite.NonfiniteCounter`);
    without a BatchVarianceProbe also the estimate's own tags (:meth:`GradientNoise.metrics
    <trainvitals.noise.estimate.GradientNoise.metrics>`: ``grad_norm/noise_floor`` in the units of
    ``.grad`` beside the monitor's ``grad_norm/total``, ``grad_noise/b_simple`` and its
    ``grad_noise/b_simple_rel_err``, ``grad_noise/coverage`` …); on stopping, the text panel
    ``grad_norm/stop_reason``; once, a text ``grad_noise/caveat`` saying why the estimate cannot decide.

    Args:
        mode: ``"noise_band"``, ``"threshold"`` or ``"relative"``.
        margin: δ ≥ 0 of the noise band.
        patience: consecutive in-condition optimizer steps needed, ≥ 1.
        min_steps: optimizer steps that never count toward the streak (a network can start inside
            its noise band).
        threshold: absolute norm for ``"threshold"``, > 0.
        fraction: for ``"relative"``, in (0, 1).
        reference_steps: steps whose norm EMA is the ``"relative"`` reference, ≥ 1.
        ema_beta: decay of the EMAs of ‖G‖² and tr(Σ) per optimizer step, in [0, 1). The default
            0.98 (a memory of ~50 steps) keeps the estimates within 10% of the truth on the closed-form
            test; 0.95 let them stray by up to 15%.
        check_every_n_steps: how often the host reads the streak, in optimizer steps, ≥ 1.
        verbose: print the stop reason.
        min_loss_drop: noise-band mode: no stop while the training loss has fallen by less than this fraction of
            its start, or by no more than its noise, in [0, 1) (a plateau the run has not left); ``None`` or 0: off
            (a run that starts at its minimum, a fine-tuning). A start loss ≤ 0 leaves it out, said once.
        hold_from_start: noise-band mode: no stop on a band the run was in from the start, never shown out of it
            (noise from step 0, or a run that starts at its minimum); ``False``: the band stops it as any other
            (fine-tuning a converged model: with ``min_loss_drop=None``), the stop saying it was in its band from
            the start.

    Raises:
        TypeError: on an argument of the wrong type, ValueError on one out of range, naming it.
    """

    provides = (GRADIENT_NOISE, NOISE_BAND, SUMMARY, RESTORED_SUMMARY)
    reads = (GRAD_SQ_NORMS, NONFINITE_STEPS, NOISE_TAGS, NOISE_PROBE)
    waits_out_the_start = True
    """Whether a band held from the start acts only once the run has been out of it (a stop on noise from step 0
    would not be convergence); a subclass whose action is the remedy for that noise (a smaller lr) sets False."""

    def __init__(
        self,
        mode: str = "noise_band",
        margin: float = DEFAULT_MARGIN,
        patience: int = DEFAULT_PATIENCE,
        min_steps: int = DEFAULT_MIN_STEPS,
        threshold: float = 1e-3,
        fraction: float = 0.01,
        reference_steps: int = 50,
        ema_beta: float = 0.98,
        check_every_n_steps: int = DEFAULT_CHECK_EVERY_N_STEPS,
        verbose: bool = True,
        min_loss_drop: float | None = DEFAULT_MIN_LOSS_DROP,
        hold_from_start: bool = True,
    ) -> None:
        super().__init__()
        self.mode = check_choice("mode", mode, MODES)
        self.margin = check_float("margin", margin, 0.0)
        self.patience = check_int("patience", patience, 1)
        self.min_steps = check_int("min_steps", min_steps, 0)
        self.threshold = check_float("threshold", threshold, 0.0, low_open=True)
        self.fraction = check_float("fraction", fraction, 0.0, 1.0, low_open=True, high_open=True)
        self.reference_steps = check_int("reference_steps", reference_steps, 1)
        self.ema_beta = check_float("ema_beta", ema_beta, 0.0, 1.0, high_open=True)
        self.check_every_n_steps = check_int("check_every_n_steps", check_every_n_steps, 1)
        self.verbose = check_bool("verbose", verbose)
        self.min_loss_drop = check_float("min_loss_drop", min_loss_drop, 0.0, 1.0, high_open=True, none_ok=True)
        self.hold_from_start = check_bool("hold_from_start", hold_from_start)
        self.key_state_by(  # not by min_loss_drop nor hold_from_start: the state means the same under any of them
            mode=self.mode,
            margin=self.margin,
            patience=self.patience,
            min_steps=self.min_steps,
            threshold=self.threshold,
            fraction=self.fraction,
            reference_steps=self.reference_steps,
            ema_beta=self.ema_beta,
        )

        self._micro = MicroBatchSquaredNorms()  # the tensor hooks on the parameters, attached per epoch
        self.gradient_noise = GradientNoise()
        """The run's one noise estimate, shared with a BatchVarianceProbe; the band is decided on it."""

        # The state of a run that has not taken a step yet; this fit's, not saved:
        self._source: Any  # "hooks", a probe callback, or None
        self.add_state("_source", None, persistent=False)
        self._hooked: list[torch.nn.Parameter]  # the parameters the hooks are on
        self.add_state("_hooked", [], persistent=False)
        self._micro_sizes: list[int | None]  # None: a batch Lightning cannot size
        self.add_state("_micro_sizes", [], persistent=False)
        self._params: list[torch.nn.Parameter]
        self.add_state("_params", [], persistent=False)
        self._pending: tuple[int, Tensor, Tensor] | None  # (step, total norm, step valid)
        self.add_state("_pending", None, persistent=False)
        self._shape: tuple[Any, tuple[Tensor, Tensor]] | None  # see _step_shape
        self.add_state("_shape", None, persistent=False)
        self.add_state("_warned_no_source", False, persistent=False)
        self.add_state("_logs_estimate", True, persistent=False)
        # This callback's source of :attr:`gradient_noise`: micro-batches and ranks.
        self.add_state("noise_source", partial(NoiseSource, "micro_batch", self.ema_beta), key="source")
        self.add_state("_reference", partial(BiasCorrectedEMA, self.ema_beta), key="reference")
        self.add_state("_streak", torch.zeros((), dtype=torch.long), key="streak")
        self.add_state("nonfinite", NonfiniteCounter, key="nonfinite_steps")
        """Steps with non-finite gradients, which the streak skips: logged when no GradNormMonitor logs them."""
        self.add_state("_measurable_by", partial(measurable_by, None, False), persistent=False)
        # Whether a counted, decided step was out of the condition: a band that holds from the first counted step
        # says the batch is noise-dominated, not that the run converged, and in noise_band mode the streak only
        # stops the run once the run has been out of the band.
        self.add_state("_left", torch.zeros((), dtype=torch.bool), key="left")
        # Whether a full streak was reached before the run had been out of the band (said once, at a check step).
        self.add_state("_held", torch.zeros((), dtype=torch.bool), key="held_from_start")
        self.add_state("from_start", "")
        """The sentence saying that the band held from the start (no stop on it); "" otherwise."""
        # Set once the streak has reached the patience: a streak that completes and breaks between two
        # host checks must still stop the run.
        self.add_state("_done", torch.zeros((), dtype=torch.bool), key="done")
        self.add_state("steps", 0)
        self.add_state("stop_reason", StopReason.NOT_STOPPED)
        self.add_state("stopped_step", None)
        self.stopped_streak: int | None
        """The streak at the stop: the counted optimizer steps in a row in the condition, ≥ ``patience`` (read
        every ``check_every_n_steps``), what ``grad_norm/band_streak`` logs at the stopping step."""
        self.add_state("stopped_streak", None)
        self.add_state("_said_caveat", False, persistent=False)
        # Examples per optimizer step over all ranks, once seen.
        self.add_state("effective_batch_size", None, persistent=False)
        # ``trainer.global_step`` at which a fit resumed from a checkpoint written after the stop was stopped.
        self.add_state("stopped_again_step", None, persistent=False)
        self.add_state("_manual", False, persistent=False)  # noise_band under manual optimization: cannot stop
        self.loss_progress: LossProgress
        """The training loss's start and current mean: no band decision while it has fallen by less than
        ``min_loss_drop`` of its start (a plateau the run has not left)."""
        self.add_state("loss_progress", partial(LossProgress, self.ema_beta), key="loss_progress")
        # Whether the loss's progress allows a decision, as of the last logging or check step (all ranks alike).
        self.add_state("_loss_allows", torch.zeros((), dtype=torch.bool), persistent=False)
        # A full streak held because the loss had not fallen: said once; its first optimizer step, kept.
        self.add_state("_on_plateau", torch.zeros((), dtype=torch.bool), persistent=False)
        self.add_state("plateau_step", None)
        self.add_state("_said_start", False, persistent=False)  # a non-positive start loss, said once

    def _band_acts(self) -> tuple[str, str]:
        """How this callback's messages name what the noise band makes it do: (its first act, as in "the stopper
        cannot stop before step 110"; all it does, as in "it will not stop the run"). BandSchedule names its cuts."""
        return "the stopper cannot stop", "stop the run"

    @property
    def noise(self) -> BiasCorrectedEMA:
        """Smoothed ‖G‖² and tr(Σ) of the micro-batches and ranks alone, in ``.grad`` units."""
        return self.noise_source.ema

    # ------------------------------------------------------------------ hooks
    @override
    def setup_fit(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.gradient_noise = self.vitals.shared(GRADIENT_NOISE, GradientNoise)

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._micro.detach()  # hooks an earlier fit that failed left behind
        # Chosen again at the first batch (an epoch-start hook may change the accumulation); chosen here too, so
        # that a fit that runs no step (a requeued job with nothing left) estimates with the sources it restored.
        self._choose_source(trainer, pl_module, say=False)
        self._manual = self.mode == "noise_band" and not pl_module.automatic_optimization
        if self._manual:
            self.warn(f"{MANUAL}; it will not {self._band_acts()[1]}.")

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # ``setup`` reset the state, so a stop known here comes from the checkpoint this fit resumed from
        # (same arguments: the state_key holds them). The run was over: it stops again before its first
        # step, as Lightning's EarlyStopping stops again at its first check.
        if not trainer.strategy.reduce_boolean_decision(self.stop_reason is not StopReason.NOT_STOPPED, all=False):
            if not self._manual:  # that it will not stop this run is said already, with its one cause
                self._warn_if_it_cannot_fire(trainer)
            return
        trainer.should_stop = True
        self.stopped_again_step = trainer.global_step
        if self.verbose:
            self.info(
                f"resumed from a checkpoint written after its stop at optimizer step {self.stopped_step}; "
                "stopping again. To train on, change its arguments (a new patience or margin starts afresh) "
                "or leave it out."
            )

    def _warn_if_it_cannot_fire(self, trainer: "pl.Trainer") -> None:
        """Say once when the fit ends before the first step the stopper could stop at: ``min_steps`` (and, in
        ``relative`` mode, ``reference_steps``) uncounted, then ``patience`` steps, read at a multiple of
        ``check_every_n_steps`` (steps counted from the start of the run, a resumed one included)."""
        uncounted = max(self.min_steps, self.reference_steps) if self.mode == "relative" else self.min_steps
        earliest = -(-(uncounted + self.patience) // self.check_every_n_steps) * self.check_every_n_steps
        total = trainer.estimated_stepping_batches  # max_steps, or max_epochs × steps per epoch
        if total < earliest:
            held, fix = self._held_by()
            self.warn(
                f"this fit ends after {total:g} optimizer steps, but {self._band_acts()[0]} before {earliest} "
                f"({held}"
                + (f", reference_steps {self.reference_steps}" if self.mode == "relative" else "")
                + f", then patience {self.patience}, read every {self.check_every_n_steps} steps): it "
                f"will not {self._band_acts()[1]} in this fit. {fix}, or train longer."
            )

    def _min_steps_said(self) -> str:
        """``min_steps`` as the fit-end line names it: "min_steps=100"; BandSchedule labels a warm-up that set it."""
        return f"min_steps={self.min_steps}"

    def _held_by(self) -> tuple[str, str]:
        """What keeps the first steps from counting, and how to shorten it, as the fit-too-short warning says them:
        ("min_steps 100", "Lower min_steps or patience"). BandSchedule names a scheduler's warm-up."""
        return f"min_steps {self.min_steps}", "Lower min_steps or patience"

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._detach()
        if self.stop_reason is StopReason.NOT_STOPPED or not self.verbose:  # a verbose stop has said it when it stopped
            self.info(self.summary_line())

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._detach()

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int, *_: Any
    ) -> None:
        if batch_idx == 0 or not self._params:
            # Decided per epoch (and on a mid-epoch resume), after every epoch-start hook has run:
            # GradientAccumulationScheduler sets accumulate_grad_batches there, BackboneFinetuning
            # adds and unfreezes parameters.
            self._choose_source(trainer, pl_module)
        if self._source == "hooks":
            self._micro_sizes.append(batch_size(batch))

    @override
    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Tensor) -> None:
        if self._loss_rule:  # the micro-batch's own loss: Lightning's division and the GradScaler's scale undone
            scale = loss_scale(trainer)
            loss = loss if scale is None else loss / scale.to(loss)
            self.loss_progress.add(loss, loss_divisor(trainer, pl_module))

    @override
    def on_after_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._micro.end_micro_batch()

    @override
    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: torch.optim.Optimizer
    ) -> None:
        if self._pending is not None and self._pending[0] == trainer.global_step:
            return  # a closure evaluated again in the same step (LBFGS): the first counts, as the monitor's
        sq_norm = self.vitals.grad_norms.sq_norm(trainer, optimizer, self._params)
        if sq_norm is None:
            return
        total = sq_norm.sqrt()
        valid = torch.isfinite(total)
        if self._source == "hooks":
            self._update_from_micro_batches(trainer, total, valid)
        self._micro_sizes = []
        self._pending = (trainer.global_step, total, valid)

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *_: Any) -> None:
        if self._pending is None:
            return  # an accumulation micro-batch: no optimizer step yet
        step, total, valid = self._pending
        self._pending = None
        if self._loss_rule:
            self.loss_progress.step()
        if self._source is not None and self._source != "hooks":
            self.effective_batch_size = getattr(self._source, "effective_batch_size", None)
        every = logging_every(trainer)
        logged = is_logging_step(step, every)
        # On a logging step the band is judged on the full estimate the others log too (one for all of them).
        in_condition = self._update_condition(total, valid, logged)
        counts = valid if self.steps >= self.min_steps else torch.zeros_like(valid)
        self._streak = self._streak.to(total.device)
        self._streak = torch.where(counts, torch.where(in_condition, self._streak + 1, 0), self._streak)
        judged = logged or (self.steps + 1) % self.check_every_n_steps == 0  # a full estimate is read: log or check
        if self.mode == "noise_band" and judged:
            self._streak = torch.where(self._reads_out().to(self._streak.device), 0, self._streak)
        full = self._streak >= self.patience
        if self._holds_from_start:  # noise from step 0 is not convergence: no stop
            self._held = self._held.to(total.device) | (full & ~self._left.to(total.device))
            full = full & self._left.to(total.device)
        if self._loss_rule:  # a plateau the loss never left is in its band as a minimum is: no decision on it
            if judged:  # ranks alike: their mean loss, on steps that read the host anyway
                if trainer.world_size > 1:
                    self.loss_progress.reduce_states(trainer)
                self._loss_allows = self.loss_progress.allows(self.min_loss_drop)
            self._loss_allows = self._loss_allows.to(total.device)  # once: a copy at every step would sync
            self._on_plateau = self._on_plateau.to(total.device) | (full & ~self._loss_allows)
            full = full & self._loss_allows
        if self.mode == "noise_band":  # out of the band beyond the band ratio's error, on a check or logging step
            shown = self._shown_out(judged)
            # Seen out from the first decisive step: min_steps holds back a stop, not the sight of a run that starts
            # far from its band and enters it before min_steps. Between those steps nothing is seen out: no kernel.
            decisive = self.gradient_noise.band_decisive
            measured = valid if decisive is None else valid & decisive.to(total.device)
            out = None if shown is None else measured & ~in_condition & shown.to(measured.device)
        else:
            out = counts & valid & ~in_condition
        if out is not None:
            self._left = self._left.to(total.device) | (out.to(total.device) & ~self._done.to(total.device))
        self._done = self._done.to(total.device) | full
        self.nonfinite.add(valid)
        self.steps += 1
        if logged:
            self._log(trainer, step, in_condition)
        if self.steps % self.check_every_n_steps == 0 and self.mode == "noise_band" and self._source is not None:
            self._say_caveat(trainer, step)
            self._say_from_start(trainer, step)
            self._say_plateau(trainer, step)
        if self.steps % self.check_every_n_steps == 0 and self._check(trainer, step) and every and not logged:
            self._log(trainer, step, in_condition, final=True)  # the chart ends where the run stopped

    # ------------------------------------------------------------------ helpers
    @property
    def _holds_from_start(self) -> bool:
        """Whether a band held from the start stops nothing until the run has been out of it (noise-band mode,
        :attr:`waits_out_the_start`, ``hold_from_start``)."""
        return self.mode == "noise_band" and self.waits_out_the_start and self.hold_from_start

    @property
    def _loss_rule(self) -> bool:
        """Whether ``min_loss_drop`` holds the noise band's decisions back (noise-band mode, not 0 or None)."""
        return self.mode == "noise_band" and bool(self.min_loss_drop)

    def _choose_source(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", say: bool = True) -> None:
        """Where this epoch's noise comes from: micro-batches/ranks (hooks), a probe, or nowhere (said once, with
        ``say``)."""
        self._params = [p for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]]
        self._logs_estimate = self.vitals.speaker(NOISE_TAGS) is self
        if self.mode != "noise_band" or not pl_module.automatic_optimization:
            return
        if trainer.accumulate_grad_batches >= 2 or trainer.world_size >= 2:
            trainable = [p for p in self._params if p.requires_grad]
            if len(trainable) != len(self._hooked) or not all(map(operator.is_, trainable, self._hooked)):
                self._micro.attach(trainable)
                self._hooked = trainable
            self._source = "hooks"
            self.gradient_noise.attach(self.noise_source)
            return
        self._detach()
        self.gradient_noise.detach(self.noise_source.name)
        self._source = next(
            (
                cb
                for cb in self.vitals.providers(GRADIENT_NOISE)
                if cb is not self and getattr(cb, "noise_source", None) in self.gradient_noise.sources.values()
            ),
            None,
        )
        self._measurable_by = self._what_measures(trainer)
        if self._source is None and say and not self._warned_no_source:
            self._warned_no_source = True
            self.warn(
                f"no noise source for the noise band: {self._measurable_by}. It will not {self._band_acts()[1]} on "
                "the band while that lasts."
            )

    def _what_measures(self, trainer: "pl.Trainer", say_probe: bool = True) -> str:
        probe = self.vitals.provider(NOISE_PROBE) is not None
        return measurable_by(getattr(trainer, "lightning_module", None), probe, say_probe)

    def _warn_unsized(self) -> None:
        self.warn(
            "cannot tell how many examples a micro-batch holds (Lightning's extract_batch_size fails on it, or "
            "it holds a list of tensors of differing lengths with no tensor of a row per example beside it): "
            "no noise estimate from such steps.",
            once=True,
        )

    def _detach(self) -> None:
        self._micro.detach()
        self._hooked = []

    def _update_from_micro_batches(self, trainer: "pl.Trainer", total: Tensor, valid: Tensor) -> None:
        """One (‖G‖², tr Σ) estimate from this step's micro-batch gradients against their mean.

        Under DDP every rank joins the one collective whatever it saw (a rank that returned early would
        hang the others); a step that some rank cannot use (a batch it cannot size, micro-batches of
        unequal sizes, as in an epoch's ragged last window) is left out on all of them.
        """
        sum_sq, n_local = self._micro.pop()
        sizes = self._micro_sizes
        if None in sizes:
            self._warn_unsized()
        usable = sum_sq is not None and n_local > 0 and bool(sizes) and None not in sizes and len(set(sizes)) == 1
        micro_batch_size = sizes[0] if usable else 0
        world = trainer.world_size
        if world == 1 and (not usable or n_local < 2):
            return
        # The hooks saw the raw backward: each micro-batch loss divided by accumulate_grad_batches (A)
        # and multiplied by the AMP loss scale s. A micro-batch's mean gradient is therefore seen·A/s.
        accumulate = trainer.accumulate_grad_batches
        scale = loss_scale(trainer)
        mean_sq = (
            sum_sq.to(total.device) / n_local * accumulate**2
            if usable
            else torch.zeros((), dtype=torch.float64, device=total.device)
        )
        if scale is not None:
            mean_sq = mean_sq / scale.to(mean_sq.device).double() ** 2
        if world > 1:  # the mean over ranks, and whether every rank had the same usable micro-batches
            shape, shape_sq = self._step_shape((float(usable), float(n_local), float(micro_batch_size)), mean_sq.device)
            summed, shapes, squares = reduce_packed(trainer, [mean_sq, shape, shape_sq])
            mean_sq = summed / world
            # Σx = W·x and Σx² = W·x² on every rank hold only when all ranks have the same x.
            valid = valid & (shapes == world * shape).all() & (squares == world * shape_sq).all()
        if not usable:
            return
        # An epoch's last window can hold fewer than A micro-batches; Lightning still divides by A.
        batch_sq = total.square() * (accumulate / n_local) ** 2
        n = n_local * world
        grad_sq, trace = two_batch_size_estimates(mean_sq, batch_sq, n, micro_batch_size)
        self.noise_source.update(grad_sq, trace, valid)
        self.noise_source.read_sampler(  # estimate.py, rules 6 and 9
            trainer.train_dataloader, trainer.num_training_batches, trainer.accumulate_grad_batches, trainer.world_size
        )
        # The band is judged at a whole step's batch: an epoch's short last window does not change it.
        if n_local == accumulate or self.effective_batch_size is None:
            self.effective_batch_size = self.noise_source.effective_batch_size = n * micro_batch_size

    def _step_shape(self, values: tuple[float, ...], device: torch.device) -> tuple[Tensor, Tensor]:
        """``values`` and their squares as float64 tensors on ``device``: copied from the host only when they
        change (an epoch's short last window, and back), not at every step."""
        if self._shape is None or self._shape[0] != (values, device):
            shape = torch.tensor(values, dtype=torch.float64, device=device)
            self._shape = ((values, device), (shape, shape.square()))
        return self._shape[1]

    def _update_condition(self, total: Tensor, valid: Tensor, full: bool) -> Tensor:
        """Whether this step is in the stop condition (``()`` bool); in ``relative`` mode also feeds the
        early-training reference EMA. ``full``: the band from the full estimate, not the cached weights'."""
        if self.mode == "threshold":
            return total < self.threshold
        if self.mode == "relative":
            reference = self._reference.value
            early = self._reference.count < self.reference_steps
            self._reference.update(total, valid & early)
            return ~early & (total < self.fraction * reference)
        if self._source is None:
            return torch.zeros((), dtype=torch.bool, device=total.device)
        estimate = self.gradient_noise.estimate() if full else None
        return self.gradient_noise.in_noise_band(self.margin, estimate, device=total.device).to(total.device)

    def _reads_out(self) -> Tensor:
        """``()`` bool on the device: the current estimate's ‖G‖² (its chosen windows, lag in the error: rule 7) is
        beyond the band's edge. Leaving a plateau the band window lags the rise and can read inside the band while
        the steps are not; a streak then does not count (read from the full estimate: logging and check steps)."""
        est = self.gradient_noise.estimate()
        edge = self.margin * est.trace_cov / est.batch_size if est.batch_size else est.trace_cov * math.inf
        return self.gradient_noise.decisive(est) & (est.grad_sq_norm > edge)

    def _shown_out(self, now: bool) -> Tensor | None:
        """``()`` bool on the device: the band ratio's 90% lower end over the slowest windows is above 1 (estimate.py,
        rules 7–8) — the run has been out of its band beyond the estimate's error, not by a fluctuation, at some step
        of the stretch they span; read from the full estimate, so only on logging and check steps (``now``; else
        None)."""
        if not now:
            return None
        est = self.gradient_noise.estimate()
        return self.gradient_noise.decisive(est) & (est.window_band_ratio_low > self.margin)

    def noise_floor(self) -> Tensor:
        """The noise level sqrt(tr Σ / B) of :attr:`gradient_noise` in the units of ``.grad`` (those of
        GradNormMonitor's ``grad_norm/total``), ``()`` float64; 0 before the first estimate."""
        return self.gradient_noise.estimate().noise_floor

    def _log(self, trainer: "pl.Trainer", step: int, in_condition: Tensor, final: bool = False) -> None:
        metrics: dict[str, Tensor] = {"grad_norm/band_streak": self._streak, **self.nonfinite.metrics(trainer, self)}
        if self._holds_from_start:  # a scalar: a logger that keeps no text shows it
            metrics[HELD_FROM_START] = (self._held & ~self._left.to(self._held.device)).double()
        if self._loss_rule:  # NaN, left out, until the start is known
            metrics[LOSS_DROP] = self.loss_progress.drop.to(self._streak.device)
        if self.mode == "noise_band" and self._source is not None:
            estimate = self.gradient_noise.estimate()
            if self._logs_estimate or final:  # at the stop, whoever logs it otherwise has not logged this step
                metrics.update(self.gradient_noise.metrics(estimate))
            # NaN (left out) while the estimate cannot decide: the band is then not measured, not "out".
            decisive = self.gradient_noise.decisive(estimate).to(in_condition.device)
            metrics["grad_norm/in_noise_band"] = torch.where(decisive, in_condition.double(), float("nan"))
            # The margin chart's three series, logged together (TensorBoard draws it only where their steps
            # agree): the smoothed norm the band is judged on, sqrt(‖G‖² + tr Σ/B), the noise level and where
            # the band ends, ‖G‖² ≤ margin·tr Σ/B ⇔ sqrt(‖G‖² + tr Σ/B) ≤ sqrt(1 + margin)·sqrt(tr Σ/B): the
            # line is inside the shade when the step is in the band. The step's own norm scatters
            # about it (below the noise level often). All left out while the estimate cannot decide.
            floor = estimate.noise_floor.to(in_condition.device)
            nan = torch.full_like(floor, float("nan"))
            smoothed = (estimate.band_grad_sq_norm.to(floor) + floor.square()).clamp_min(0.0).sqrt()
            metrics["grad_norm/band_norm"] = torch.where(decisive, smoothed, nan)
            metrics["grad_norm/band_floor"] = torch.where(decisive, floor, nan)
            metrics["grad_norm/band_edge"] = torch.where(decisive, floor * math.sqrt(1.0 + self.margin), nan)
            if self.margin > 0 and estimate.batch_size:  # how deep into the band: a checkpoint's monitor
                edge = self.margin * estimate.trace_cov.to(floor) / estimate.batch_size
                ratio = estimate.band_grad_sq_norm.to(floor) / edge.clamp_min(1e-300)
                metrics[BAND_RATIO] = torch.where(decisive & (edge > 0), ratio, nan)
                # The decision's ratio with its band windows' sampling interval (estimate.py, rule 7); the current
                # estimate's ratio (chosen windows, lag in the error: rule 8's interval) apart, under grad_noise/.
                # An infinite high end is left out (finite_only).
                current = estimate.grad_sq_norm.to(floor) / edge.clamp_min(1e-300)
                metrics[CURRENT_BAND_RATIO] = torch.where(decisive & (edge > 0), current, nan)
                ends = (estimate.window_band_ratio_low, estimate.window_band_ratio_high)
                for tag, pair in ((BAND_RATIO, ends), (CURRENT_BAND_RATIO, estimate.intervals["band_ratio"])):
                    for end, value in zip(("low", "high"), pair):
                        metrics[f"{tag}_{end}"] = torch.where(decisive, value.to(floor) / self.margin, nan)
        logged = log_scalars(trainer, metrics, step, finite_only=True)  # B_simple is inf while EMA(‖G‖²) ≤ 0
        if self.mode == "noise_band" and self.margin > 0 and BAND_RATIO not in logged:
            # Not measured yet, or not measurable: the worst value for ModelCheckpoint(mode="min"), which
            # needs the key at every save (a missing one fails the fit once validation has run).
            feed_callback_metrics(trainer, {BAND_RATIO: math.inf})

    def _say_from_start(self, trainer: "pl.Trainer", step: int) -> None:
        """Once per fit, when a full streak came before the run was ever out of the band: every step has been
        noise-dominated from the start, which calls for a larger batch (named from B_simple's 90% interval) or a
        smaller lr, not a stop. Where the loss has not fallen by ``min_loss_drop`` (or is not tracked), a run that
        started at its minimum reads the same: both readings are said. On check steps only; the decision itself
        stays on the device."""
        if self.from_start or not bool(self._held):
            return
        h = self.gradient_noise.host_summary()
        batch = self.effective_batch_size or h["batch_size"]
        suggest = self._batch_suggested(h)
        never_out = (
            f"it was never shown out of the band from its {MIN_MEASUREMENTS}th measurement, when the estimate could "
            f"first judge it{self._first_judged(h)}"
        )
        watching = "It keeps watching: the band counts once the run has been out of it."
        if self._loss_rule and bool(self._loss_allows):  # the loss fell: not a run that started at its minimum
            self.from_start = (
                f"in its noise band from the start (optimizer step {step}): the batch ({batch}) is below B_simple "
                f"({b_simple_interval(h)}), and {never_out}: every step it judged was noise-dominated — that is not "
                f"convergence, and it does not stop on it. {suggest[0].upper()}{suggest[1:]} — or a smaller learning "
                f"rate. {watching}"
            )
        else:
            switches = (
                "hold_from_start=False and min_loss_drop=None let" if self._loss_rule else "hold_from_start=False lets"
            )
            self.from_start = (
                f"in its noise band from the start (optimizer step {step}): {never_out}, and {self._loss_said()}. "
                "The gradient's statistics cannot tell two readings apart, and it does not stop on either: either the "
                f"batch ({batch}) is far below B_simple ({b_simple_interval(h)}) and every step is noise, not "
                f"convergence — {suggest}, or a smaller learning rate makes the steps count; or the run started at "
                f"its minimum (e.g. fine-tuning a converged model) — then {switches} the band "
                f"{self._band_acts()[1]}. {watching}"
            )
        self.warn(self.from_start)
        log_text(trainer, "grad_norm/stop_reason", self.message(self.from_start), step)

    def _batch_suggested(self, h: dict[str, Any]) -> str:
        """The batch a run noise-dominated from its start is told to take: B_simple's 90 % lower end, else its point
        estimate said as one (no lower end yet), and where that is beyond the training set, full-batch steps."""
        low, point = h["b_simple_low"], h["b_simple"]
        if low > 0 and math.isfinite(low):
            target, said = low, "B_simple's 90 % lower end"
        elif point > 0 and math.isfinite(point):
            target, said = point, "B_simple's point estimate; its interval has no lower end yet"
        else:
            return "a larger batch lowers the noise per step"
        population = self.gradient_noise.population
        if population is not None and target >= population:
            return (
                f"a batch of {target:.0f} ({said}) is beyond the training set's {population} examples: full-batch "
                f"steps ({population}) have no sampling noise"
            )
        return f"a batch of at least {target:.0f} ({said}) balances steps against examples"

    def _first_judged(self, h: dict[str, Any]) -> str:
        """Where the estimate measures less often than every step (a probe's ``measure_every_n_steps``), when it
        could first judge and that the steps before were not seen: "from the start" is as far as it saw."""
        measured = h["count"]
        every = round(self.steps / measured) if measured > 0 else 0
        if every <= 1:
            return ""
        return (
            f" (at about optimizer step {MIN_MEASUREMENTS * every}, measuring every {every} steps: the steps before "
            "were not seen, and the run may have been out of the band then; measure_every_n_steps=1 on "
            f"BatchVarianceProbe lets it judge from step {MIN_MEASUREMENTS})"
        )

    def _say_plateau(self, trainer: "pl.Trainer", step: int) -> None:
        """On check steps: once the start loss is known, that a non-positive one leaves the rule out (said once);
        the first full streak the loss's progress held back, said once (a host read on a step that reads anyway)."""
        if not self._loss_rule:
            return
        if not self._said_start:
            progress = self.loss_progress.summary()
            self._said_start = progress["known"]
            if progress["known"] and not progress["start"] > 0:
                self.warn(
                    f"the training loss's mean over its first {START_STEPS} steps is {progress['start']:.4g}, not "
                    "positive: min_loss_drop, a fraction of it, cannot apply. It decides on the noise band alone."
                )
        if self.plateau_step is None and bool(self._on_plateau):
            self.plateau_step = step
            said = (
                f"{self._plateau_said()}. It will not {self._band_acts()[1]} on the band until the loss has fallen "
                f"by {self.min_loss_drop:.0%} of its start (min_loss_drop) and beyond its noise, and keeps watching."
            )
            self.info(said)
            log_text(trainer, "grad_norm/stop_reason", self.message(said), step)

    def _plateau_said(self) -> str:
        """What held the decision back (a host read): "in its noise band for a full streak at optimizer step 249, but
        the training loss fell 2% since the start (2.35 → 2.30), below min_loss_drop 10%: a plateau the run has not
        left, not a minimum …"."""
        return (
            f"in its noise band for a full streak at optimizer step {self.plateau_step}, but {self._loss_said()}: a "
            "plateau the run has not left, not a minimum it reached (the gradient's statistics cannot tell the two apart)"
        )

    def _loss_said(self) -> str:
        """The loss's progress (a host read): "the training loss fell 2% since the start (2.35 → 2.30), below
        min_loss_drop 10%"; without the loss rule, that it is not tracked."""
        if not self._loss_rule:
            return "the training loss's fall is not tracked (min_loss_drop off)"
        progress = self.loss_progress.summary()
        if not progress["known"]:
            return f"the training loss's start (its first {START_STEPS} steps' mean) is not known yet"
        fell = progress["drop"] >= 0
        moved = f"fell {progress['drop']:.0%}" if fell else f"rose {-progress['drop']:.0%}"
        said = f"the training loss {moved} since the start ({progress['start']:.4g} → {progress['current']:.4g}), "
        if fell and progress["drop"] >= self.min_loss_drop:  # held by its noise, not by min_loss_drop
            return (
                f"{said}within its own noise: a fall below {progress['noise']:.0%} ({NOISE_Z} standard errors of "
                "its first steps' mean and its EMA) is not told from chance"
            )
        return f"{said}{'below' if fell else 'not the fall of'} min_loss_drop {self.min_loss_drop:.0%}"

    def _say_caveat(self, trainer: "pl.Trainer", step: int) -> None:
        """Once per fit: why the estimate cannot stop the run (no valid source, partial coverage), and two
        sources that disagree beyond their errors. On check steps only, which read the host anyway."""
        why = "" if self._said_caveat else self.gradient_noise.host_summary()["why"]
        if why and not why.startswith(("not measured", "B_simple unreliable")):
            self._said_caveat = True
            caveat = (
                f"the noise estimate cannot decide: {why}. It will not {self._band_acts()[1]} on the noise band "
                f"while that lasts; {self._what_measures(trainer, say_probe=False)}."
            )
            self.warn(caveat)
            log_text(trainer, "grad_noise/caveat", self.message(caveat), step)
        disagreement = self.gradient_noise.disagreement()
        if disagreement:
            self.warn(f"{disagreement}.")
            log_text(trainer, SOURCES_CHECK, disagreement, step)

    def _check(self, trainer: "pl.Trainer", step: int) -> bool:
        """Stop the run when every rank agrees; returns whether it stopped it now.

        Not before the Trainer's ``min_epochs`` and ``min_steps`` allow it: Lightning would train on,
        and the run would not have stopped where this callback says (the streak stays complete).
        """
        if self.stop_reason is not StopReason.NOT_STOPPED or not can_stop_now(trainer):
            return False
        stop = trainer.strategy.reduce_boolean_decision(bool(self._done), all=False)
        if not stop:
            return False
        trainer.should_stop = True
        self.stopped_step, self.stopped_streak = step, int(self._streak)  # a host read at the stop alone
        self.stop_reason = {
            "noise_band": StopReason.NOISE_BAND,
            "threshold": StopReason.THRESHOLD,
            "relative": StopReason.RELATIVE,
        }[self.mode]
        message = self.describe_stop()
        if self.verbose:
            self.info(message)
        log_text(trainer, "grad_norm/stop_reason", message, step)
        return True

    def describe_stop(self) -> str:
        """A one-line, human-readable reason for the stop, or why there was none (:meth:`summary_line`)."""
        if self.stop_reason is StopReason.NOT_STOPPED:
            return f"GradNormEarlyStopping {self.summary_line()}"
        detail = {
            StopReason.NOISE_BAND: f"‖G‖² ≤ {self.margin:g}·tr(Σ)/B",
            StopReason.THRESHOLD: f"‖g‖ < {self.threshold:g}",
            StopReason.RELATIVE: f"‖g‖ < {self.fraction:g} × its early value",
        }[self.stop_reason]
        assert self.stopped_step is not None
        again = (
            ""
            if self.stopped_again_step is None
            else f" A fit resumed from a checkpoint written after that stop was stopped again at its start "
            f"(optimizer step {self.stopped_again_step})."
        )
        after = ""
        if self.stop_reason is StopReason.NOISE_BAND:
            after = (
                ", after it had been out of the band"
                if bool(self._left)
                else ", in its band from the start (never shown out of it"
                + ("; hold_from_start=False lets it stop there)" if self.waits_out_the_start else ")")
            )
        return (
            f"stopped at optimizer step {self.stopped_step} (after {self.stopped_step + 1} steps): "
            f"{self.stop_reason.value} ({detail}) {self._streak_said()}{after}.{again}"
        )

    def _streak_said(self) -> str:
        """The stop's streak as ``grad_norm/band_streak`` logs it: counted optimizer steps in a row in the condition,
        read every ``check_every_n_steps``, so at the stop it may be past ``patience``, or (a streak completed and
        broken between two checks) below it. An older checkpoint's stop has no streak: its patience is said."""
        streak, read = self.stopped_streak, f"the streak read every {self.check_every_n_steps} steps"
        if streak is None:
            return f"for {self.patience} consecutive optimizer steps"
        if streak >= self.patience:
            return (
                f"for its last {streak} counted optimizer steps in a row (grad_norm/band_streak; its patience "
                f"{self.patience}, {read})"
            )
        return (
            f"for its patience of {self.patience} counted optimizer steps in a row, a streak broken before the check "
            f"that stopped it (grad_norm/band_streak {streak} at the stop; {read})"
        )

    def band_entries(self) -> list[tuple[int, str, float]]:
        """Each act on the noise band, in order: (optimizer step, ``"stop"``, the margin δ it was judged at) for a
        stop on the band; BandSchedule adds its cuts (``"cut"``, ``"growth"``). In the band ‖G‖² ≤ δ·tr(Σ)/B, i.e.
        B_simple ≥ B/δ: what LRScalingAdvisor's fit-end advice squares its batch advice with."""
        if self.stop_reason is not StopReason.NOISE_BAND or self.stopped_step is None:
            return []
        return [(self.stopped_step, "stop", self.margin)]

    def summary_line(self) -> str:
        """One line for the end of fit: the stop, or why there was none (no noise source, an estimate that
        cannot decide, too few steps, or how far from the band's edge the run ended)."""
        if self.stop_reason is not StopReason.NOT_STOPPED:
            return self.describe_stop()
        streak = int(self._streak)
        why = f"{streak} step(s) in a row in the condition at the end, of the {self.patience} it needs"
        # Held at the end by the loss rule (the loss not fallen) or the from-start rule (never out of the band).
        on_plateau = (
            self._loss_rule
            and self.plateau_step is not None
            and not bool(self.loss_progress.allows(self.min_loss_drop))
        )
        from_start = bool(self.from_start) and not bool(self._left)  # once shown out, the band counts
        if streak >= self.patience and (on_plateau or from_start):
            rule = "min_loss_drop" if on_plateau else "the from-start rule"
            why = (
                f"its streak full at the end ({streak} step(s) in a row, of the {self.patience} it needs) and held "
                f"by {rule}"
            )
        if self._manual:  # the one cause: min_steps and the noise sources do not matter then
            return f"did not stop the run: {MANUAL}."
        if self.mode == "noise_band":
            summary = self.gradient_noise.host_summary()
            if self._source is None:
                why = f"no noise estimate, so no noise band: {self._measurable_by}"
            elif not summary["decisive"]:
                why = f"the noise estimate cannot decide: {summary['why']}; " + why
            elif self.margin > 0 and summary["trace_cov"] > 0 and summary["batch_size"]:
                grad, se = summary["grad_sq_norm"], summary["grad_sq_norm_se"]
                ratio = band_ratio(grad, summary["trace_cov"], summary["batch_size"], self.margin)
                low, high = (summary[f"band_ratio_{end}"] / self.margin for end in ("low", "high"))
                excess = " and a reshuffled epoch's excess" if self.gradient_noise.reshuffled else ""
                reaches = (
                    "; that interval lies inside the band"
                    if high <= 1.0
                    else "; that interval reaches into the band: not shown to be outside it"
                    if low <= 1.0
                    else ""
                )
                # The current estimate (grad_noise/band_ratio, its lag in its error); the decision's own ratio is
                # the band window's (grad_norm/band_ratio), which lags it.
                why += (
                    f"; at the end the current estimate ‖G‖² = {grad:.3g} ± {se:.2g} puts the band ratio (‖G‖² over "
                    f"the band's edge {self.margin:g}·tr(Σ)/B, its interval from ‖G‖²'s and tr(Σ)'s errors{excess}) "
                    f"at {band_ratio_said(ratio, low, high)}{reaches}"
                )
                band = band_ratio(
                    summary["band_grad_sq_norm"], summary["trace_cov"], summary["batch_size"], self.margin
                )
                if (band > 1.0) != (ratio > 1.0):  # the two read the run on either side of the edge
                    why += (
                        f"; the streak counts on the band window's ‖G‖², {band:.2f}× the edge, a mean over the last "
                        "stretch that lags a falling ‖G‖²"
                        if band > 1.0
                        else f"; the band window's ‖G‖² reads {band:.2f}× the edge, but it lags a rising ‖G‖²: no "
                        "streak counts while the current estimate reads out of the band"
                    )
        if on_plateau:  # ended on it: what gets a run off a plateau, and the switch for a start at its minimum
            why = f"{self._plateau_said()}; {why}; {plateau_advice(self._band_acts()[1])}"
        if from_start:
            why = f"{self.from_start.removesuffix('.')}; " + why
        if self.steps < self.min_steps:
            why = f"the run ended after {self.steps} optimizer steps, before {self._min_steps_said()}; " + why
        return f"did not stop the run: {why}."

    def _margin_said(self) -> str:
        """The margin as the end-of-run rule row says it; BandSchedule says the one passed and its scaled edge."""
        return f"{self.margin:g}"

    def summary_markdown(self) -> str:
        """End-of-run markdown: the rule, the stop, and the noise estimates it decided on."""
        streak = int(self._streak)
        rows = [
            (
                "rule",
                {
                    "noise_band": f"noise band, margin {self._margin_said()}",
                    "threshold": f"‖g‖ < {self.threshold:g}",
                    "relative": f"‖g‖ < {self.fraction:g} × early value",
                }[self.mode]
                + f", patience {self.patience} steps, min_steps {self.min_steps}",
            ),
            ("stop", self.describe_stop()),
            ("optimizer steps seen", str(self.steps)),
            (
                "in-condition streak",
                f"{streak} of {self.patience} steps"
                if streak <= self.patience
                else f"reached {self.patience} ({streak} steps in a row)",
            ),
        ]
        if self.mode == "noise_band":  # the run's one estimate, with the sources it combines
            rows += self.gradient_noise.summary_rows()
        return "\n".join(markdown_table(("quantity", "value"), rows))
