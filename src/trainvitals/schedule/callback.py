"""BandSchedule: when the gradient norm enters its noise band, cut the learning rate; stop only at the end.

GradNormEarlyStopping stops where the steps have become noise at this lr and batch. The practitioner's answer to
"progress has stalled into noise" is usually a smaller lr (step schedules, ReduceLROnPlateau), and SASA (Lang,
Xiao & Zhang 2019) cuts the lr when a statistical stationarity test fires. This callback is the stopper with that
answer: the same band, estimate, streak and reduced decision (it is a GradNormEarlyStopping), acted on by a cut.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from trainvitals._validation import check_bool, check_float, check_int
from trainvitals.noise.estimate import band_ratio
from trainvitals.noise.stopper import (
    DEFAULT_CHECK_EVERY_N_STEPS,
    DEFAULT_MARGIN,
    DEFAULT_MIN_LOSS_DROP,
    DEFAULT_MIN_STEPS,
    DEFAULT_PATIENCE,
    GradNormEarlyStopping,
    StopReason,
)
from trainvitals.plumbing.amp import grad_scaler
from trainvitals.plumbing.lr_factors import LRFactors, monitors_after
from trainvitals.plumbing.sharing import LR_FACTORS, NOISE_BAND
from trainvitals.plumbing.stopping import can_stop_now, ended_by
from trainvitals.plumbing.writers import log_scalars, log_text
from trainvitals.schedule.decision import (
    Action,
    Cut,
    batch_growth,
    checks_needed,
    decide,
    measurements_to_show,
    scaled_margin,
    shown_in,
)
from trainvitals.schedule.warmup import scheduler_warmup
from trainvitals.text.intervals import band_ratio_said
from trainvitals.text.markdown import markdown_table

# benchmarks/schedule_comparison.py (docs/benchmarks.md): 0.1 beat 0.3 on the 4 diabetes runs by 0.3-1.1 points of
# 100·R² and was within ±0.4 point on the logistic regression; on the other tasks the band or the metric moved little.
DEFAULT_FACTOR = 0.1
DEFAULT_MAX_CUTS = 2
LR_SCALE = "schedule/lr_scale"
CUTS = "schedule/cuts"
ACCUMULATE = "schedule/accumulate_grad_batches"
CUT_RECORD = "schedule/cut_record"
"""Text panel: a line per cut (step, band ratio and its 90 % interval, the lr scale after)."""


class BandSchedule(GradNormEarlyStopping):
    r"""Cut every param group's lr by ``factor`` when the gradient norm enters its noise band; stop after the last.

    The band test is GradNormEarlyStopping's (``mode="noise_band"``): a decisive estimate, ‖G‖² ≤ margin·tr(Σ)/B
    for ``patience`` counted steps, read every ``check_every_n_steps`` steps and reduced over ranks
    (``reduce_boolean_decision``), so every rank cuts at the same step. After a cut, the next act (cut, growth or
    stop) needs more: on a check step with the streak complete, the band ratio's 90 % upper end ≤ 1 — the whole
    interval inside the band, rank 0's estimate broadcast — else it waits, checking again every
    ``check_every_n_steps`` steps: a young estimate whose interval spans the edge does not act
    (:mod:`trainvitals.schedule.decision`). At a cut:

    - the lr scale s (in this callback's state) is multiplied by ``factor``: at each optimizer step every param
      group's lr is the lr a user's scheduler set × s, put back after the step so the scheduler keeps shaping it
      (:class:`~trainvitals.plumbing.lr_factors.LRFactors`);
    - the streak and the noise estimate's window restart (every source of the run's GradientNoise forgets its
      updates): the next decision is on steps at the new lr;
    - the band's edge becomes margin·s·tr(Σ)/B (:mod:`trainvitals.schedule.decision`): the stationary ‖G‖² is
      proportional to the lr, so the next cut waits until the run has settled at the lower one.

    With ``grow_batch=True`` a band entry grows the effective batch instead: ``accumulate_grad_batches`` × k,
    k = round(1/``factor``) (the same stationary loss as the lr cut: ∝ η/B on a noisy quadratic), capped so the
    batch stays within B_simple — the run's one estimate, which LRScalingAdvisor reads too — when that is reliable
    (beyond it each unit of progress costs more examples: E/E_min = 1 + B/B_noise) and within half an epoch; a
    growth below 2 cuts the lr instead. The new accumulation takes effect at the first step boundary where the
    epoch's batch count is a multiple of it (no ragged window; at most k − 1 steps later; a resumed run's from its
    first step), decided on rank 0 and broadcast; the band's edge is not scaled for a growth (:mod:`trainvitals.schedule.decision`).

    The band entered after ``max_cuts`` cuts, or where a cut would take the smallest lr below ``min_lr``, stops the
    run (as the stopper would); with ``stop=False`` the run trains on at its last lr. No step counts toward the
    streak before ``min_steps`` nor before a user's scheduler has warmed up (read from LinearLR, ConstantLR,
    OneCycleLR, SequentialLR, ChainedScheduler and a LambdaLR such as transformers'
    ``get_linear_schedule_with_warmup``: :mod:`trainvitals.schedule.warmup`; another scheduler: ``min_steps``).

    Logged, besides the stopper's tags: ``schedule/lr_scale`` (the s the logged optimizer step took: a cut's s
    applies from the next step) and ``schedule/cuts`` (the number of cuts by that step's end) at the logging cadence,
    at each cut and at the first step at a cut's scale (with ``grow_batch`` also ``schedule/accumulate_grad_batches``,
    the accumulation the step took, logged too at the first step it takes effect); the text panel
    ``schedule/cut_record``, a line per cut: the step, the band ratio ‖G‖²/(margin·s·tr Σ/B) of the full estimate at
    that step and its 90 % interval from ‖G‖²'s error (the streak may have completed up to
    ``check_every_n_steps − 1`` steps before, so the ratio can exceed 1), the new scale or batch.

    Not with a GradNormEarlyStopping in noise-band mode in the same fit (they would share one estimate and both
    act on it). A step a GradScaler skips runs no optimizer post-hook: the lrs are put back at
    ``on_before_optimizer_step`` then (:meth:`LRFactors.before_step
    <trainvitals.plumbing.lr_factors.LRFactors.before_step>`), so the scheduler steps from its own lr and the next
    step's lr is the scheduler's × the scale.

    Args:
        factor: lr multiplier at each cut, in (0, 1).
        max_cuts: cuts before the band stops the run (or is ignored, ``stop=False``), ≥ 0; ``None``: no limit.
        min_lr: no lr cut that would take the smallest param group's lr below it (≥ 0; a batch growth leaves the
            lr alone and is not bounded by it); the band stops instead.
        stop: stop the run when no cut is left; ``False`` never stops.
        grow_batch: grow ``accumulate_grad_batches`` at a band entry instead of cutting the lr (not beside a
            GradientAccumulationScheduler).
        warmup_steps: optimizer steps the lr warms up for, no cut before them; ``None``: read from the fit's
            schedulers (:mod:`trainvitals.schedule.warmup`).
        margin, patience, min_steps, ema_beta, check_every_n_steps, verbose, min_loss_drop: GradNormEarlyStopping's
            (``min_loss_drop``: no cut, no stop, while the training loss has fallen by less than this fraction of
            its start: a plateau the run has not left).

    Raises:
        TypeError: on an argument of the wrong type, ValueError on one out of range, naming it.
    """

    waits_out_the_start = False  # a cut (a smaller lr) is the remedy for a band held from step 0, not a false stop

    def __init__(
        self,
        factor: float = DEFAULT_FACTOR,
        max_cuts: int | None = DEFAULT_MAX_CUTS,
        min_lr: float = 0.0,
        stop: bool = True,
        grow_batch: bool = False,
        warmup_steps: int | None = None,
        margin: float = DEFAULT_MARGIN,
        patience: int = DEFAULT_PATIENCE,
        min_steps: int = DEFAULT_MIN_STEPS,
        ema_beta: float = 0.98,
        check_every_n_steps: int = DEFAULT_CHECK_EVERY_N_STEPS,
        verbose: bool = True,
        min_loss_drop: float | None = DEFAULT_MIN_LOSS_DROP,
    ) -> None:
        check_float("margin", margin, 0.0, low_open=True)  # the band's edge scales with the lr: no margin 0
        super().__init__(
            margin=margin,
            patience=patience,
            min_steps=min_steps,
            ema_beta=ema_beta,
            check_every_n_steps=check_every_n_steps,
            verbose=verbose,
            min_loss_drop=min_loss_drop,
        )
        self.factor = check_float("factor", factor, 0.0, 1.0, low_open=True, high_open=True)
        self.max_cuts = check_int("max_cuts", max_cuts, 0, none_ok=True)
        self.min_lr = check_float("min_lr", min_lr, 0.0)
        self.stop = check_bool("stop", stop)
        self.grow_batch = check_bool("grow_batch", grow_batch)
        self.requested_warmup = check_int("warmup_steps", warmup_steps, 0, none_ok=True)
        self.base_margin = self.margin
        self.requested_min_steps = self.min_steps
        self.key_state_by(
            margin=self.margin,
            patience=self.patience,
            min_steps=self.min_steps,
            ema_beta=self.ema_beta,
            factor=self.factor,
            max_cuts=self.max_cuts,
            min_lr=self.min_lr,
            stop=self.stop,
            grow_batch=self.grow_batch,
            warmup_steps=self.requested_warmup,
        )
        self.lr_scale: float
        """The product of the cuts so far: every param group's lr is its scheduler's × this."""
        self.add_state("lr_scale", 1.0)
        self.cuts: list[dict[str, float]]
        """Every cut (:class:`~trainvitals.schedule.decision.Cut` as a dict), in order."""
        self.add_state("cuts", [])
        self.accumulate: int | None
        """The ``accumulate_grad_batches`` the batch growths set (``None``: the Trainer's own), applied at a step
        boundary it divides."""
        self.add_state("accumulate", None)
        self.warmup_steps: int | None
        """Optimizer steps the user's schedulers warm up for (``None``: unknown or none), read at train start."""
        self.add_state("warmup_steps", None, persistent=False)
        self._warmup_from: str
        """Where :attr:`warmup_steps` came from: "read from LambdaLR", or "given as warmup_steps" (the argument)."""
        self.add_state("_warmup_from", "", persistent=False)
        self.add_state("_scaled_step", None, persistent=False)  # the optimizer step the scale was applied to
        self._step_scale: float
        """The lr scale the current optimizer step takes (a cut applies from the next): what ``schedule/lr_scale``
        logs."""
        self.add_state("_step_scale", 1.0, persistent=False)
        self._announce_at: int | None
        """The optimizer step that is the first at a new lr scale or accumulation: logged then, on any step."""
        self.add_state("_announce_at", None, persistent=False)
        self._ended_by: str
        """What ended the fit where the band did not (:func:`~trainvitals.plumbing.stopping.ended_by`), read at
        train end: what its fit-end line names."""
        self.add_state("_ended_by", "", persistent=False)
        self._held_back: tuple[Action, float, float, float, float] | None
        """At the last check: the act a full streak after a cut waits to make, the band ratio and its 90 % interval
        (point, low, high) that kept it and the estimate's effective measurements (``None``: none waiting)."""
        self.add_state("_held_back", None, persistent=False)
        self._shown: int
        """Consecutive checks, with the streak complete, that showed the run inside the band (decision.py's
        :func:`~trainvitals.schedule.decision.shown_in`); restarted at a cut."""
        self.add_state("_shown", 0)
        self.add_state("_said_unbounded", False, persistent=False)

    # ------------------------------------------------------------------ hooks
    @override
    def setup_fit(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        super().setup_fit(trainer, pl_module)
        others = [
            cb for cb in self.vitals.providers(NOISE_BAND) if cb is not self and getattr(cb, "mode", "") == "noise_band"
        ]
        if others:
            raise MisconfigurationException(
                f"BandSchedule cannot share a fit with {type(others[0]).__name__}(mode='noise_band'): both would act "
                "on the one noise band (BandSchedule stops the run itself after its last cut)."
            )
        if self.grow_batch and any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):
            raise MisconfigurationException(
                "BandSchedule(grow_batch=True) sets accumulate_grad_batches itself: it cannot share a fit with a "
                "GradientAccumulationScheduler."
            )
        monitors_after(trainer, self)  # LearningRateMonitor reads the lr after this callback has scaled it

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        super().on_fit_start(trainer, pl_module)
        self.margin = scaled_margin(self.base_margin, self.lr_scale)  # a resumed run's scale came with its state
        self._step_scale = self.lr_scale
        # Declared for the fit: the lr a step runs at is its scheduler's × the scale (LRScalingAdvisor reads it).
        self.vitals.shared(LR_FACTORS, LRFactors).own("BandSchedule", lambda: self.lr_scale)

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.requested_warmup is None:
            self.warmup_steps = self._read_warmup(trainer)
        else:
            self.warmup_steps, self._warmup_from = self.requested_warmup, "given as warmup_steps"
        self.min_steps = max(self.requested_min_steps, self.warmup_steps or 0)
        super().on_train_start(trainer, pl_module)
        if self.cuts:  # a resumed run's cuts, in its own log too: its report has a row per cut
            log_text(trainer, CUT_RECORD, self.cut_record(), trainer.global_step)

    @override
    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.vitals.shared(LR_FACTORS).epoch_start(trainer)  # the epoch's first lr, as LearningRateMonitor logs it

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int, *_: Any
    ) -> None:
        self._set_accumulation(trainer)  # before the stopper picks its source: it reads the accumulation
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if self._scaled_step != trainer.global_step:  # a step's first micro-batch: the scale it steps at
            self._scaled_step, self._step_scale = trainer.global_step, self.lr_scale
            if self.lr_scale != 1.0:
                self.vitals.shared(LR_FACTORS).apply(trainer.optimizers)

    @override
    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: torch.optim.Optimizer
    ) -> None:
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        factors = self.vitals.shared(LR_FACTORS)
        if factors is not None:  # a step the GradScaler skips: the scheduler steps from its own lr
            factors.before_step(optimizer, grad_scaler(trainer))

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *args: Any) -> None:
        step = self._pending[0] if self._pending is not None else None
        if step is not None:  # a step's last micro-batch; one that ran no optimizer step has its lrs put back here
            self._put_back()
        super().on_train_batch_end(trainer, pl_module, *args)
        if step is not None and step == self._announce_at:  # the first step at a cut's scale, unless _log logged it
            self._announce_at = None
            log_scalars(trainer, self._scalars(trainer), step)

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._put_back(close=True)
        self._ended_by = ended_by(trainer)
        super().on_train_end(trainer, pl_module)

    @override
    def on_save_checkpoint(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", checkpoint: dict[str, Any]
    ) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        factors = self.vitals.shared(LR_FACTORS)
        if factors is not None:  # saved between a step's micro-batches: the scheduler's lrs, not the cut ones
            factors.unscaled_checkpoint(trainer, checkpoint)

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._put_back(close=True)
        super().on_exception(trainer, pl_module, exception)

    # ------------------------------------------------------------------ the decision
    @override
    def _check(self, trainer: "pl.Trainer", step: int) -> bool:
        """Grow the batch, cut the lr, or stop (the stopper's own stop) when neither is left; returns whether it
        stopped the run now. A growth is weighed first: ``min_lr`` bounds only a cut of the lr."""
        if self.stop_reason is not StopReason.NOT_STOPPED:
            return False
        if not trainer.strategy.reduce_boolean_decision(bool(self._done), all=False):
            self._shown = 0  # no full streak: the checks showing the run inside the band start again
            return False
        summary = self.gradient_noise.host_summary()  # one host read, on a check step in the band only
        growth = 1
        if self.grow_batch:
            b_simple = summary["b_simple"] if summary["reliable"] else None
            growth = batch_growth(self.factor, summary["batch_size"], b_simple, self.gradient_noise.population)
        # After a cut an act waits for the run shown inside the band at checks_needed checks in a row; the first cut
        # for an estimate that bounds the ratio (decision.py). Rank 0's, with its growth: one decision for all ranks.
        grad, trace, batch = summary["grad_sq_norm"], summary["trace_cov"], summary["batch_size"]
        ratio = float(band_ratio(grad, trace, batch, self.margin)) if trace > 0 and batch else math.nan
        low, high = (summary.get(f"band_ratio_{end}", math.nan) / self.margin for end in ("low", "high"))
        bounded = math.isfinite(high) and summary.get("trace_cov_low", 0.0) > 0
        growth, ratio, high, bounded = trainer.strategy.broadcast(
            (int(growth), float(ratio), float(high), bool(bounded)), src=0
        )
        self._shown = self._shown + 1 if shown_in(ratio, high) else 0
        shown = self._shown >= checks_needed(self.patience, self.check_every_n_steps)
        lrs = [g["lr"] for opt in trainer.optimizers for g in opt.param_groups if g["lr"] > 0]
        lr = self.lr_scale * float(min(lrs)) if lrs else 0.0
        args = (True, len(self.cuts), lr, self.factor, self.max_cuts, self.min_lr, self.stop)
        action, wanted = decide(*args, shown, bounded, growth), decide(*args, True, True, growth)
        waiting = action is Action.NONE and wanted is not Action.NONE
        self._held_back = (wanted, ratio, low, high, summary["effective_measurements"]) if waiting else None
        if self._held_back is not None and not self.cuts and not self._said_unbounded:
            self._said_unbounded = True
            self._say_unbounded(summary)
        if action is Action.STOP:
            return can_stop_now(trainer) and super()._check(trainer, step)
        if action is not Action.NONE:
            self._cut(trainer, step, summary, growth if action is Action.GROW else 1)
        return False

    def _cut(self, trainer: "pl.Trainer", step: int, summary: dict[str, Any], growth: int) -> None:
        """The batch × ``growth`` (≥ 2), else the lr scale × ``factor``; the band restarted, the cut recorded from
        the estimate's ``summary`` at this step."""
        grad, trace, batch = summary["grad_sq_norm"], summary["trace_cov"], summary["batch_size"]
        measured = trace > 0 and bool(batch)
        ratio = float(band_ratio(grad, trace, batch, self.margin)) if measured else math.nan
        # The estimate's own 90 % interval of the ratio (at margin 1), the one the stopper's summary quotes.
        low, high = (summary.get(f"band_ratio_{end}", math.nan) / self.margin for end in ("low", "high"))
        if growth > 1:
            self.accumulate = trainer.accumulate_grad_batches * growth
            cut = Cut(step, ratio, low, high, self.lr_scale, batch * growth)
        else:
            self.lr_scale *= self.factor
            self.margin = scaled_margin(self.base_margin, self.lr_scale)
            self._announce_at = step + 1
            cut = Cut(step, ratio, low, high, self.lr_scale)
        self.cuts.append(asdict(cut))
        self._streak = torch.zeros_like(self._streak)
        self._done = torch.zeros_like(self._done)
        self._shown = 0
        for source in self.gradient_noise.sources.values():
            source.restart()
        log_scalars(trainer, self._scalars(trainer), step)  # the cut counted; this step's scale and batch
        log_text(trainer, CUT_RECORD, self.cut_record(), step)
        if self.verbose:
            self.info(f"{'grew the batch' if cut.batch is not None else 'cut the lr'} at {cut.line()}.")

    def _say_unbounded(self, summary: dict[str, Any]) -> None:
        """Once per fit: the first cut (or growth) waits, its full streak resting on an estimate that does not
        bound the band ratio (no finite 90 % upper end, or tr(Σ) not resolved from 0), said as the one it is."""
        trace = f"tr(Σ) = {summary['trace_cov']:.3g} ± {summary['trace_cov_se']:.2g}"
        grad = f"‖G‖² = {summary['grad_sq_norm']:.3g} ± {summary['grad_sq_norm_se']:.2g}"
        why = (
            f"{trace}: within its error of 0, so the band's edge is not known"
            if not summary.get("trace_cov_low", 0.0) > 0
            else f"{grad} over {trace}: the ratio's 90 % interval has no upper end"
        )
        self.info(
            f"holds its first {'batch growth' if self._held_back[0] is Action.GROW else 'lr cut'}: the run is in its "
            f"noise band on the point estimate, but the estimate does not bound the band ratio ({why}). It cuts once "
            "the interval is bounded."
        )

    # ------------------------------------------------------------------ logging and summaries
    @override
    def _log(self, trainer: "pl.Trainer", step: int, in_condition: torch.Tensor, final: bool = False) -> None:
        super()._log(trainer, step, in_condition, final)
        log_scalars(trainer, self._scalars(trainer), step)
        if step == self._announce_at:
            self._announce_at = None

    def _scalars(self, trainer: "pl.Trainer") -> dict[str, float]:
        """What the optimizer step being logged took: its lr scale and (after a growth) its accumulation; the cuts
        made by its end."""
        scalars = {LR_SCALE: self._step_scale, CUTS: float(len(self.cuts))}
        if self.accumulate is not None:
            scalars[ACCUMULATE] = float(trainer.accumulate_grad_batches)
        return scalars

    def cut_record(self) -> str:
        """Markdown: a line per cut (:meth:`Cut.line <trainvitals.schedule.decision.Cut.line>`)."""
        return "\n".join(f"- {Cut(**c).line()}" for c in self.cuts) or "no cut"

    def _cuts_said(self) -> str:
        """ "cut the lr 2 time(s) (at step(s) 420, 910; lr × 0.01)", its batch growths said as such; "made no cut"."""
        said = []
        for grew in (False, True):
            cuts = [c for c in self.cuts if (c.get("batch") is not None) is grew]
            if cuts:
                after = f"batch {cuts[-1]['batch']}" if grew else f"lr × {self.lr_scale:g}"
                said.append(
                    f"{'grew the batch' if grew else 'cut the lr'} {len(cuts)} time(s) "
                    f"(at step(s) {', '.join(str(c['step']) for c in cuts)}; {after})"
                )
        return " and ".join(said) or "made no cut"

    @override
    def describe_stop(self) -> str:
        """The stop after the cuts, or (not stopped) "BandSchedule made no cut; did not stop the run: why"."""
        if self.stop_reason is StopReason.NOT_STOPPED:
            return f"BandSchedule {self.summary_line()}"
        if self.max_cuts is None or len(self.cuts) < self.max_cuts:  # decide() stops short of max_cuts on min_lr only
            left = f"; a further cut would take the lr below min_lr {self.min_lr:g}"
        else:
            left = f" (max_cuts {self.max_cuts})" if self.max_cuts else ""
        return f"{self._cuts_said()}{left}; {super().describe_stop()}"

    @override
    def summary_line(self) -> str:
        if self.stop_reason is not StopReason.NOT_STOPPED:
            return self.describe_stop()
        if bool(self._done) and self._held_back is not None and self._held_back[2] <= 1.0:  # a wait, not out of band
            act, ratio, low, high, measured = self._held_back
            said = {Action.CUT: "next cut", Action.GROW: "next batch growth", Action.STOP: "stop"}[act]
            if not self.cuts:
                said = "first cut" if act is Action.CUT else "first batch growth"
            last = ("a batch growth" if self.cuts[-1].get("batch") is not None else "a cut") if self.cuts else ""
            need = (
                f"after {last} it acts only once the band ratio is ≥ 0 and its 90 % interval inside the band at "
                f"{checks_needed(self.patience, self.check_every_n_steps)} checks in a row (it had {self._shown} such check(s))"
                if self.cuts
                else "its first cut needs an estimate that bounds the band ratio (a finite 90 % upper end, tr(Σ) "
                "resolved from 0)"
            )
            streak = int(self._streak)
            at_end = f"in its noise band for {streak} step(s) in a row at the end" if streak else "out of it at the end"
            blocked = (
                ""
                if not self.cuts
                else "; its upper end above the edge kept it"
                if not high <= 1.0
                else "; its point below 0 kept it"
                if ratio < 0
                else ""
            )
            return (
                f"{self._cuts_said()}; did not stop the run: its streak reached its patience ({self.patience}) at a "
                f"check ({at_end}), but {need}; at its last check the band ratio (‖G‖² over the edge "
                f"{self.margin:g}·tr(Σ)/B) was {band_ratio_said(ratio, low, high)}{blocked}: its {said} waited for "
                f"it{self._resolution_said(ratio, high, measured)}{self._next_step()}."
            )
        if bool(self._done) and not self.stop:  # the band entered again with nothing left to do
            left = (
                f"its {self.max_cuts} cut(s) made"
                if self.max_cuts is not None and len(self.cuts) >= self.max_cuts
                else "a further cut below min_lr, or the fit over before its next check"
            )
            return (
                f"{self._cuts_said()}; did not stop the run: stop=False, and in its noise band at the end with {left}; "
                f"it trained on at lr × {self.lr_scale:g}."
            )
        return f"{self._cuts_said()}; {super().summary_line().removesuffix('.')}{self._next_step()}."

    def _next_step(self) -> str:
        """What ended a fit the band did not end, or, where nothing else did either, what to do
        (docs/callbacks/band-schedule.md, "What a second act needs")."""
        if self._ended_by:
            return f"; the band did not end the fit: {self._ended_by} did"
        return "; the band did not end the fit: bound it by steps or by a validation-loss EarlyStopping"

    @override
    def summary_markdown(self) -> str:
        rows = [
            (
                "schedule",
                ("batch × round(1/factor), else " if self.grow_batch else "")
                + f"lr × {self.factor:g} at each band entry, up to {self.max_cuts} cut(s), min_lr {self.min_lr:g}, "
                f"{'then stop' if self.stop else 'never stops'}; warm-up {self.warmup_steps or 0} steps",
            ),
            ("cuts", "; ".join(Cut(**c).line() for c in self.cuts) or "no cut"),
            ("lr scale", f"{self.lr_scale:g}"),
        ]
        return "\n".join(markdown_table(("quantity", "value"), rows)) + "\n\n" + super().summary_markdown()

    def _resolution_said(self, ratio: float, high: float, measured: float) -> str:
        """What showing the run inside the scaled edge would take, where the upper end kept a wait after a cut
        (decision.py's :func:`measurements_to_show`): "; at that error, showing it inside needs at least ≈ 2.8e+03
        effective measurements of ‖G‖² (72× the 39 it had; its window holds at most 99): the edge at lr scale 0.1
        needs 100× those of the unscaled one"; "" otherwise."""
        if not self.cuts or self.lr_scale >= 1.0 or high <= 1.0 or not measured > 0:
            return ""
        need = measurements_to_show(ratio, high, measured)
        if not math.isfinite(need):
            return ""
        windows = [(1 + src.ema.beta) / (1 - src.ema.beta) for src in self.gradient_noise.valid_sources()]
        cap = f"; its window holds at most {max(windows):.0f}" if windows else ""
        return (
            f"; at that error, showing it inside needs at least ≈ {need:.2g} effective measurements of ‖G‖² ({need / measured:.2g}× "
            f"the {measured:.0f} it had{cap}): the edge at lr scale {self.lr_scale:g} needs {1 / self.lr_scale**2:.3g}× "
            "those of the unscaled one"
        )

    @override
    def band_entries(self) -> list[tuple[int, str, float]]:
        """Each cut (``"cut"``, or ``"growth"`` for a batch growth) at the margin of the lr scale before it, then the
        stop (:meth:`GradNormEarlyStopping.band_entries`)."""
        before = [1.0] + [c["lr_scale"] for c in self.cuts]
        cuts = [
            (int(c["step"]), "cut" if c.get("batch") is None else "growth", scaled_margin(self.base_margin, scale))
            for c, scale in zip(self.cuts, before)
        ]
        return cuts + super().band_entries()

    @override
    def _margin_said(self) -> str:
        """The margin passed, and after a cut the edge's margin at the lr scale: "0.2 (× lr scale 0.01: 0.002)"."""
        scaled = f" (× lr scale {self.lr_scale:g}: {self.margin:g})" if self.lr_scale != 1.0 else ""
        return f"{self.base_margin:g}{scaled}"

    @override
    def _band_acts(self) -> tuple[str, str]:
        """The stopper's messages in this callback's terms: "the schedule cannot cut the lr before …", "it will not
        grow the batch, cut the lr or stop the run" (as configured)."""
        first = "grow the batch or cut the lr" if self.grow_batch else "cut the lr"
        acts = [
            *(["grow the batch"] if self.grow_batch else []),
            "cut the lr",
            *(["stop the run"] if self.stop else []),
        ]
        return f"the schedule cannot {first}", ", ".join(acts[:-1]) + " or " + acts[-1] if len(acts) > 1 else acts[0]

    # ------------------------------------------------------------------ helpers
    def _read_warmup(self, trainer: "pl.Trainer") -> int | None:
        """The longest warm-up of the fit's lr schedulers, in optimizer steps (None: none known)."""
        longest = None
        batches = trainer.num_training_batches
        per_epoch = math.ceil(batches / max(trainer.accumulate_grad_batches, 1)) if math.isfinite(batches) else math.inf
        for config in trainer.lr_scheduler_configs:
            warm = scheduler_warmup(config.scheduler)
            if warm is None:
                self.info(
                    f"cannot tell how long {type(config.scheduler).__name__} warms up: no cut before min_steps "
                    f"({self.requested_min_steps}) only.",
                    once=True,
                )
                continue
            every = config.frequency * (1 if config.interval == "step" else per_epoch)
            if math.isfinite(every) and (longest is None or warm * every > longest):
                longest, self._warmup_from = warm * every, f"read from {type(config.scheduler).__name__}"
        return longest

    @override
    def _min_steps_said(self) -> str:
        """ "min_steps=400 (the lr scheduler's warm-up, read from LambdaLR; min_steps passed: 100)" where the
        warm-up set it."""
        if not self.warmup_steps or self.warmup_steps <= self.requested_min_steps:
            return super()._min_steps_said()
        return (
            f"{super()._min_steps_said()} (the lr scheduler's warm-up, {self._warmup_from}; min_steps passed: "
            f"{self.requested_min_steps})"
        )

    @override
    def _held_by(self) -> tuple[str, str]:
        """The scheduler's warm-up where it holds the first cut back longer than ``min_steps``."""
        if not self.warmup_steps or self.warmup_steps <= self.requested_min_steps:
            return super()._held_by()
        return (
            f"the lr scheduler's warm-up of {self.warmup_steps} steps ({self._warmup_from}; min_steps "
            f"{self.requested_min_steps})",
            "Pass BandSchedule(warmup_steps=N) where the warm-up is shorter than that, lower patience",
        )

    def _set_accumulation(self, trainer: "pl.Trainer") -> None:
        """The growths' ``accumulate_grad_batches``, from the first micro-batch that opens a window under the old
        count and the new one (the epoch's batches before it a multiple of each): Lightning steps where the epoch's
        batch count divides by the accumulation, so no window is cut short. Read at every micro-batch's start, so a
        resumed run's applies from its first step (a new epoch's count starts at 0; a mid-epoch checkpoint's
        stands at a step boundary of the accumulation it was saved under)."""
        if self.accumulate is None or trainer.accumulate_grad_batches == self.accumulate:
            return
        before = trainer.fit_loop.epoch_loop.batch_progress.current.ready - 1  # this micro-batch is counted already
        if before % self.accumulate == 0 and before % trainer.accumulate_grad_batches == 0:
            trainer.accumulate_grad_batches = self.accumulate
            self._announce_at = trainer.global_step

    def _put_back(self, close: bool = False) -> None:
        factors = self.vitals.shared(LR_FACTORS)
        if factors is not None:
            factors.close() if close else factors.put_back()
