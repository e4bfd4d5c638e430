"""BatchVarianceProbe: how noisy the mini-batch gradient is, and what that says about the batch size.

Measures tr(Σ) and ‖G‖² (McCandlish et al. 2018, App. A.1; docs/science.md §3) every ``measure_every_n_steps``
optimizer steps, feeds them into the run's one :class:`~trainvitals.noise.estimate.GradientNoise` (read by
the noise-band stopper and the learning-rate advisor), and logs the simple noise scale B_simple, the noise
floor, the variance of the batch gradient at the micro-batch and at the full batch (Var ∝ 1/B),
per-layer gradient signal-to-noise ratios and the evidence-based criterion (Mahsereci et al. 2017),
and histograms of per-example gradient norms with the outlying examples.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from torch import Tensor
from typing_extensions import override

from trainvitals._validation import check_bool, check_choice, check_float, check_int
from trainvitals.noise.estimate import INDEPENDENT, SOURCES_CHECK, GradientNoise, NoiseSource
from trainvitals.noise.estimators import NoiseScaleEMA, NoiseScaleError
from trainvitals.noise.gsnr import EB_CRITERION, GSNR_TAG, ModuleCoordinates, StepCoordinates
from trainvitals.noise.probe_sources import ProbeSources
from trainvitals.noise.probe_step import Finished, ProbeStep, coordinate_stats, log_per_example_norms
from trainvitals.norms.nonfinite import NonfiniteCounter
from trainvitals.per_example import Layouts, PerExampleStep, SourcePlan, detect_loss_reduction
from trainvitals.per_example.loss_reduction import reduced_rows
from trainvitals.plumbing.amp import loss_scale
from trainvitals.plumbing.base import TrainvitalsCallback
from trainvitals.plumbing.batch import loss_divisor
from trainvitals.plumbing.cadence import is_logging_step, logging_every
from trainvitals.plumbing.sharing import (
    GRAD_SQ_NORMS,
    GRADIENT_NOISE,
    NOISE_PROBE,
    NOISE_TAGS,
    NONFINITE_STEPS,
    SUMMARY,
)
from trainvitals.plumbing.writers import log_scalars, log_text
from trainvitals.text.markdown import markdown_table

LOSS_REDUCTIONS = ("auto", "mean", "sum")
COORDINATE_BUDGET = 2**20  # per-coordinate sums per logging step: 16 MiB of float64 Σg and Σg²
SUMS_CHECK_EVERY = 10  # the sums check: at the first measured step, then every this many logging steps


class BatchVarianceProbe(TrainvitalsCallback):
    r"""Gradient noise of the mini-batch gradient: tr(Σ), ‖G‖², B_simple, the noise level, GSNR, EB criterion.

    Measures each example's own-loss gradient (a mean- and a sum-reduced loss give the same numbers) from,
    per parameter: per-example norms in the same backward (:mod:`trainvitals.per_example` rules), else the
    micro-batches of accumulation and the DDP ranks, else ``torch.func`` on a sub-batch; the sources line
    at fit start names which. The estimate feeds the run's one
    :class:`~trainvitals.noise.estimate.GradientNoise` (:attr:`gradient_noise`, shared with the stopper
    and the lr advisor), whose tags it logs (``grad_noise/*``, ``grad_norm/noise_floor``) with per-layer
    GSNR, the EB criterion and per-example norm histograms. Under BatchNorm in training mode per-example
    gradients are not independent draws: the estimate is then taken from micro-batches and ranks, or
    marked invalid. tr(Σ) is in squared gradient units per example, B_simple in examples.

    Args:
        measure_every_n_steps: measure every this many optimizer steps (≥ 1).
        log_every_n_steps: log every this many optimizer steps (rounded up to a multiple of
            ``measure_every_n_steps``); ``None``: the Trainer's.
        histogram_every_n_steps: per-example norm histograms and outliers every this many steps; 0: never.
        ema_beta: EMA decay per measurement, in [0, 1): about (1 + β)/(1 − β) measurements (≈ 99 at 0.98) at
            any cadence, fewer while the quantities move (shorter windows then take over: estimate.py, rule 7;
            ``grad_noise/effective_measurements``).
        loss_reduction: ``"auto"`` (read from the loss's graph), ``"mean"`` or ``"sum"`` over a micro-batch.
        per_coordinate: log GSNR and the EB criterion on logging steps.
        coordinate_budget: coordinates whose per-coordinate sums one logging step collects (≥ 1; 16 bytes
            each); a larger model is covered over successive logging steps.
        fallback: allow ``torch.func`` per-example gradients.
        fallback_sub_batch: examples per step for them (≥ 2).
        max_rel_err: B_simple's relative standard error above which it gives no noise-aware advice (> 0).
        top_k: outlying examples reported per histogram (≥ 0).
        sequence_first: whether inputs with the batch on both first dimensions (T = B) are ``(T, B, ...)``;
            ``None``: from the evidence (:mod:`trainvitals.per_example.batch_dim`), else batch-first.
        strict: raise instead of warning when the probe cannot measure.

    Raises:
        TypeError: for an argument of the wrong type, ValueError for one out of range, naming it.
        RuntimeError: with ``strict``, when a step cannot be measured.
    """

    provides = (GRADIENT_NOISE, NOISE_TAGS, NOISE_PROBE, SUMMARY)
    reads = (GRAD_SQ_NORMS, NONFINITE_STEPS)

    def __init__(
        self,
        measure_every_n_steps: int = 1,
        log_every_n_steps: int | None = None,
        histogram_every_n_steps: int = 100,
        ema_beta: float = 0.98,
        loss_reduction: str = "auto",
        per_coordinate: bool = True,
        coordinate_budget: int = COORDINATE_BUDGET,
        fallback: bool = True,
        fallback_sub_batch: int = 16,
        max_rel_err: float = 0.5,
        top_k: int = 5,
        sequence_first: bool | None = None,
        strict: bool = False,
    ) -> None:
        super().__init__()
        self.measure_every_n_steps = check_int("measure_every_n_steps", measure_every_n_steps, 1)
        self.log_every_n_steps = check_int("log_every_n_steps", log_every_n_steps, 1, none_ok=True)
        self.histogram_every_n_steps = check_int("histogram_every_n_steps", histogram_every_n_steps, 0)
        self.ema_beta = check_float("ema_beta", ema_beta, 0.0, 1.0, high_open=True)
        self.loss_reduction = check_choice("loss_reduction", loss_reduction, LOSS_REDUCTIONS)
        self.per_coordinate = check_bool("per_coordinate", per_coordinate)
        self.coordinate_budget = check_int("coordinate_budget", coordinate_budget, 1)
        self.fallback = check_bool("fallback", fallback)
        self.fallback_sub_batch = check_int("fallback_sub_batch", fallback_sub_batch, 2)
        self.max_rel_err = check_float("max_rel_err", max_rel_err, 0.0, low_open=True)
        self.top_k = check_int("top_k", top_k, 0)
        self.sequence_first = check_bool("sequence_first", sequence_first, none_ok=True)
        self.strict = check_bool("strict", strict)
        self.key_state_by(measure_every_n_steps=self.measure_every_n_steps, ema_beta=self.ema_beta)
        self.gradient_noise = GradientNoise(max_rel_err=max_rel_err)
        """The run's one noise estimate, shared with GradNormEarlyStopping."""

        # The state of a fit that has not started: no plan, no estimate, no step open, no layer excluded.
        self._sources: ProbeSources | None  # the plan's, and their hooks (removed before a reset)
        self.add_state("_sources", None, persistent=False)
        self.sources: str
        """The plan's sources, in words."""
        self.add_state("sources", "", persistent=False)
        self.add_state(
            "_coordinates", functools.partial(ModuleCoordinates, {}, {}, self.coordinate_budget), persistent=False
        )
        self.add_state("_log_every", 1, persistent=False)
        self.add_state("_histogram_every", None, persistent=False)
        self.add_state("_batch_size", 0, persistent=False)  # the micro-batch's examples
        self.add_state("_unit", 1.0, persistent=False)  # its per-example gradient units
        self.add_state("_reduction", "mean", persistent=False)
        source = functools.partial(NoiseSource, "probe", self.ema_beta, steps_per_update=self.measure_every_n_steps)
        self.add_state("noise_source", source, key="source")
        """This probe's source of :attr:`gradient_noise`, in the units of each example's own loss."""
        self.add_state("nonfinite", NonfiniteCounter, key="nonfinite_steps")
        """Measured steps whose gradient was non-finite: logged when no GradNormMonitor logs such steps."""
        self.add_state("last_outliers", [], persistent=False)
        """(dataset row, or position in the batch without :attr:`outlier_rows`, and ‖g_i‖) of the last outliers."""
        self.add_state("outlier_rows", False, persistent=False)
        self.add_state("outlier_coverage", "", persistent=False)  # which parameters their norms are over
        self.add_state("outlier_step", None, persistent=False)  # the optimizer step of their histogram
        self.add_state("_enabled", False, persistent=False)
        self.add_state("_disabled", "", persistent=False)  # why this fit measures nothing, if it does not
        self.add_state("_left_out", "", persistent=False)  # why the last step left out was, for the end line
        self.add_state("_excluded", set(), persistent=False)
        self.add_state(
            "_failed", {}, persistent=False
        )  # failed here, not yet excluded (DDP: until a logging step): why
        self.add_state("_open_step", -1, persistent=False)
        self.add_state("_step", None, persistent=False)  # the measured step open, if the open one is measured
        self.add_state("_finalized_step", -1, persistent=False)
        self.add_state("_finished", None, persistent=False)  # what that step left for on_train_batch_end
        self.add_state("_coordinate_cursor", 0, key="coordinate_cursor")  # the next logging step's first coordinate
        self.add_state("_logging_steps", 0, persistent=False)  # measured logging steps so far, for the sums check's
        self.add_state("_gsnr_partial", {}, key="gsnr_partial")  # per GSNR key: Σ GSNR and coordinates of the pass
        self.add_state("_stated_reduction", "", persistent=False)
        # Which dimension holds the examples where T = B: what the fit's calls showed, kept over its plans.
        self.add_state("_layouts", functools.partial(Layouts, sequence_first=self.sequence_first), persistent=False)
        self.gradient_noise.attach(self.noise_source)

    @property
    def noise(self) -> NoiseScaleEMA:
        """The probe's smoothed ‖G‖² and tr(Σ) for independent draws, in each example's own-loss units (the logged
        ``gradient_noise.estimate()`` also corrects for drawing without replacement from a known N)."""
        return self.noise_source.ema

    @property
    def noise_error(self) -> NoiseScaleError:
        """The sampling variance of :attr:`noise`."""
        return self.noise_source.error

    @property
    def effective_batch_size(self) -> int | None:
        """Examples per optimizer step over all ranks, once measured (the source's)."""
        return self.noise_source.effective_batch_size

    @effective_batch_size.setter
    def effective_batch_size(self, value: int | None) -> None:
        self.noise_source.effective_batch_size = value

    @property
    def grad_scale(self) -> float:
        """``.grad`` over the mean of the step's per-example gradients (the source's unit factor)."""
        return self.noise_source.unit_scale

    @grad_scale.setter
    def grad_scale(self, value: float) -> None:
        self.noise_source.unit_scale = value

    @override
    def reset(self) -> None:
        """Also removes the hooks: a fit that failed on its first step leaves none of its own behind."""
        self._detach_hooks()
        super().reset()

    def _detach_hooks(self) -> None:
        if self._sources is not None:
            self._sources.detach()

    def offers(self, name: str) -> bool:
        """Whether it provides ``name`` now: the estimate's tags only while it measures (else the stopper logs them)."""
        return name != NOISE_TAGS or self._enabled

    @property
    def _plan(self) -> SourcePlan | None:
        return None if self._sources is None else self._sources.plan

    # ------------------------------------------------------------------ setup

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.info(self.summary_line())

    def summary_line(self) -> str:
        """One line for the end of fit: the run's noise scale (:attr:`gradient_noise`), or why there is none."""
        count = int(self.noise.count)
        if count == 0:
            why = self._disabled or self.noise_source.invalid or self._left_out
            return f"no measurement: {why}." if why else f"no step measured (planned sources: {self.sources})."
        summary = self.gradient_noise.host_summary()
        # The estimate's batch is its valid sources'; with none valid, the probe's own.
        batch = summary["batch_size"] or self.effective_batch_size
        at = f" at an effective batch of {batch}" if batch else ""
        scale = (
            f"B_simple = {summary['b_simple']:.4g} examples (relative error {summary['b_simple_rel_err']:.2f})"
            if summary["reliable"]
            else "no reliable B_simple"
        )
        why = "" if summary["reliable"] else ": " + summary["why"].removeprefix("B_simple unreliable: ")
        # n_eff is an EMA-weighted mean over the sources of each one's 1/Σw² ≤ its count: it is stated against the
        # most-measured source's count, which may exceed the probe's own (a micro-batch source measures every step).
        n_eff, most = summary["effective_measurements"], int(summary["count"])
        distinct = self.noise_source.distinct_batches
        effective = (
            ""
            if not most
            else f" ({n_eff:.3g} effective: a fixed epoch order revisits the same {distinct} batches, and their errors;"
            " it takes each for a random draw, which batches of sorted or grouped rows are not, and ‖G‖² is then biased"
            " either way: shuffle=True makes them one)"
            if most == count and distinct is not None and n_eff >= distinct - 1e-6
            else f" ({n_eff:.3g} effective, as the EMAs weight them)"
            if most == count
            else f" (the estimate: {n_eff:.3g} effective of the {most} measurements its most-measured source made, "
            "as the EMAs weight them)"
        )
        return f"{scale}{at} from {count} measured optimizer steps{effective}{why}."

    def summary_markdown(self) -> str:
        """End-of-run markdown: where the noise was measured and the smoothed estimates (McCandlish et al. 2018)."""
        rows = [("sources", self.sources or "not set up"), ("measurements", f"{int(self.noise.count)} optimizer steps")]
        if self.noise_source.invalid:
            rows.append(("probe's estimate", f"invalid: {self.noise_source.invalid}"))
        elif self.gradient_noise.shadowed(self.noise_source):
            rows.append(
                (
                    "probe's estimate",
                    f"the same micro-batch estimator as the {INDEPENDENT} source (GradNormEarlyStopping's), "
                    "counted once, as that source",
                )
            )
        rows += self.gradient_noise.summary_rows()
        if self.last_outliers:
            which = "dataset row" if self.outlier_rows else "position in batch"
            largest = ", ".join(f"{i}: {v:.3g}" for i, v in self.last_outliers[:3])
            at = f"at optimizer step {self.outlier_step}"  # their histogram's step, not the table's
            rows.append(
                (f"largest per-example gradients ({which}: ‖g_i‖)", f"{largest} {at} ({self.outlier_coverage})")
            )
        return "\n".join(markdown_table(("", ""), rows))

    @override
    def setup_fit(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.gradient_noise = self.vitals.shared(GRADIENT_NOISE, GradientNoise)
        self.gradient_noise.max_rel_err = self.max_rel_err
        if not isinstance(trainer.strategy, (SingleDeviceStrategy, DDPStrategy)):
            self._disable(f"strategy {type(trainer.strategy).__name__} is not supported (single device and DDP are)")
            return
        self._enabled = True
        self.gradient_noise.attach(self.noise_source)
        every = logging_every(trainer, self.log_every_n_steps)
        self._log_every = self._round_up(every) if every else None
        self._histogram_every = self._round_up(self.histogram_every_n_steps) if self.histogram_every_n_steps else None
        self._make_plan(trainer, pl_module)
        note = self._sources.notes(self.per_coordinate, self._histogram_every is not None) if self._sources else ""
        self.info(
            f"planned sources (a layer found not measurable per example is moved at its first step, and said): "
            f"{self.sources}" + (f"; {note}" if note else "")
        )

    def _round_up(self, every: int) -> int:
        return math.ceil(every / self.measure_every_n_steps) * self.measure_every_n_steps

    def _groups_per_step(self, trainer: "pl.Trainer") -> int:
        return trainer.accumulate_grad_batches * trainer.world_size

    def _make_plan(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._detach_hooks()
        self._sources = sources = ProbeSources(
            pl_module,
            self._groups_per_step(trainer) >= 2,
            self.fallback,
            self._excluded,
            self.fallback_sub_batch,
            self._layouts,
            self._step.batch_size if self._step is not None else 0,  # once known, the micro-batch's examples
        )
        self.sources, self.noise_source.param_share = sources.description, sources.param_share
        # Every parameter from micro-batches and ranks (BatchNorm under accumulation): the stopper's estimator.
        only_micro = sources.plan.micro_batch and not (sources.plan.per_example or sources.plan.vmap)
        self.noise_source.same_as = INDEPENDENT if only_micro else None
        self._coordinate_cursor, self._gsnr_partial = 0, {}
        self._coordinates = ModuleCoordinates(
            sources.plan.parameters("per_example"), sources.plan.parameters("vmap"), self.coordinate_budget
        )
        if self.per_coordinate and self._coordinates.budget_note():
            self.info(self._coordinates.budget_note())
        if not sources.measures:
            self._cannot_measure(sources.unmeasured_reason())

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # Optimizers exist from here on, not in ``setup``.
        if self._enabled and len(trainer.optimizers) > 1:
            self.gradient_noise.detach(self.noise_source.name)
            self._disable(
                f"the run has {len(trainer.optimizers)} optimizers, and the probe measures the "
                "gradient of one optimizer's step (a GAN's generator and discriminator step on "
                "different losses)"
            )

    def _disable(self, why: str) -> None:
        """Measure nothing in this fit, and say why now and at its end."""
        self._enabled, self._disabled = False, why
        self.cannot_measure(f"cannot measure: {why}; it measures nothing in this fit.")

    def _cannot_measure(self, why: str) -> None:
        self._left_out = why
        self.cannot_measure(f"cannot measure: {why}. Such steps are left out.")

    # ------------------------------------------------------------------ per micro-batch

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int = 0, *_: Any
    ) -> None:
        if not self._enabled:
            return
        step = trainer.global_step
        if step != self._open_step:
            self._begin_step(step)
        if self._step is not None:
            self._step.begin_micro_batch(trainer, batch, batch_idx, self.sequence_first)

    def _begin_step(self, step: int) -> None:
        """Open ``step``'s measurement (its hooks attached), if it is measured."""
        self._open_step = step
        sources = self._sources
        assert sources is not None
        self._detach_hooks()
        self._step = None
        if step % self.measure_every_n_steps != 0 or not sources.measures:
            return
        selection: dict[str, slice] = {}
        logging = is_logging_step(step, self._log_every)
        # The sums check at the fit's first measured step, then every SUMS_CHECK_EVERY-th logging step (which
        # reads on the host anyway); GSNR's sums at every logging step with per_coordinate.
        first = self._logging_steps == 0
        check = (logging or first) and self._logging_steps % SUMS_CHECK_EVERY == 0
        if logging or first:
            self._logging_steps += 1
        coordinates = logging and self.per_coordinate
        if coordinates or check:
            selection, cursor = self._coordinates.select(self._coordinate_cursor)
            if coordinates or not self.per_coordinate:  # GSNR's passes advance on logging steps only
                self._coordinate_cursor = cursor
        keep_norms = self._histogram_every is not None and step % self._histogram_every == 0
        self._step = ProbeStep(
            step, sources, selection, keep_norms, logging, logging or self._log_every is None, check_sums=check
        )

    @override
    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Tensor) -> None:
        # An empty batch leaves its step out (`ProbeStep._problem`); a loss without a graph reaches no layer, and
        # its backward fails on its own (GraphIntegrityCallback says why): no reduction to read.
        step = self._step
        if step is None or not step.batch_size or loss.grad_fn is None:
            return
        step.sources.collector.before_backward(loss)  # where a position table's output meets the batch
        reduction, how = self.loss_reduction, "as told"
        if reduction == "auto":
            divisor = loss_divisor(trainer, pl_module)
            found = detect_loss_reduction(loss, step.batch_size, divisor, loss_scale(trainer))
            if found is not None:
                reduction, how = found.kind, "read from the loss's graph"
                if found.kind == "scaled":  # the window's loss: each micro-batch's over Lightning's divisor
                    how = f"divided by {divisor * float(found.count):g} over the optimizer step, {how}"
            elif (rows := reduced_rows(loss, step.batch_size)) is not None and rows % step.batch_size:
                step.misbatched = True  # the loss's rows are not the batch's examples: no per-example number holds
                return
            else:  # the same loss as the graphs this fit read, or said to be assumed a mean: said once, either way
                if not self._stated_reduction:
                    self.warn(
                        "could not tell from the loss's graph whether it is a mean or a sum over examples; "
                        "assuming a mean. Pass `loss_reduction=` to say which: B_simple does not depend on it, "
                        "tr(Σ), ‖G‖² and the noise level sqrt(tr Σ/B) do.",
                        once=True,
                    )
                    self._stated_reduction = "mean"
                reduction = self._stated_reduction
        if reduction != self._stated_reduction:
            self._stated_reduction = reduction
            self.info(_reduction_said(reduction, how))
        step.set_unit(trainer, pl_module, reduction)

    @override
    def on_after_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._step is not None:
            self._step.end_micro_batch()

    # ------------------------------------------------------------------ per optimizer step

    @override
    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: torch.optim.Optimizer
    ) -> None:
        step = self._step
        if step is None or self._finalized_step == trainer.global_step:
            return
        self._finalized_step = trainer.global_step
        self._finished = step.finish(self, trainer, pl_module, optimizer)

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *_: Any) -> None:
        # Every source updated the estimate in on_before_optimizer_step: logged now, it is the same estimate
        # whatever the callbacks' order, computed once for all who read it at this step. Failed layers are
        # moved after the log, which is over the plan the step was measured with.
        done, step, self._finished = self._finished, self._step, None
        if done is None or step is None:
            return
        if done.measured and step.logging:
            self._log(trainer, step, done)
            log_scalars(trainer, self.nonfinite.metrics(trainer, self), step.step)
        if done.measured and done.result.sq_norms:
            self._log_norms(trainer, step, done.result)
        if done.failed:
            # The step's kept norms (histogram, outliers) lack the failed layers: said with their cause, once.
            lost = done.measured and bool(done.result.sq_norms) and bool(done.result.failed)
            self._move_failed(trainer, pl_module, done.failed, done.aside, step.step if lost else None)

    def _move_failed(
        self,
        trainer: "pl.Trainer",
        pl_module: "pl.LightningModule",
        failed: set[str],
        aside: set[str],
        norms_lost_at: int | None = None,
    ) -> None:
        """Exclude the layers that failed per example, plan again, and say in one message why, what became of
        the steps they failed in (``aside``: the layers this one was measured without; ``norms_lost_at``: the
        optimizer step whose per-example norms are not logged), where each goes and the coverage."""
        reasons = {name: self._failed.pop(name, "it failed on another rank") for name in sorted(failed)}
        self._excluded.update(failed)
        self._make_plan(trainer, pl_module)
        assert self._sources is not None
        message = self._sources.moved(reasons, aside, trainer.world_size)
        if norms_lost_at is not None:
            message += (
                f" Optimizer step {norms_lost_at} logs no per-example gradient norms (histogram, "
                "outliers panel): they would lack the failed layers; the next steps' cover the layers left."
            )
        self.cannot_measure(message)

    # ------------------------------------------------------------------ logging

    def _log(self, trainer: "pl.Trainer", step: ProbeStep, done: Finished) -> None:
        """The EMAs at the run's batch (:attr:`effective_batch_size`), the per-coordinate statistics of the step's
        examples over the layers that did not fail."""
        batch = self.effective_batch_size or done.examples
        estimate = self.gradient_noise.estimate()
        metrics: dict[str, Tensor] = {
            **self.gradient_noise.metrics(estimate),
            "grad_noise/batch_grad_var/micro_batch": estimate.trace_cov / step.size,
            "grad_noise/batch_grad_var/full_batch": estimate.trace_cov / (estimate.batch_size or batch),
        }
        coordinates: StepCoordinates = {}
        if self.per_coordinate:
            snr_sums, coordinates = coordinate_stats(
                trainer,
                self._coordinates,
                step.selection,
                done.result,
                done.examples,
                step.sources.params_of(done.failed),
            )
            metrics.update(snr_sums)
        keys = list(metrics)
        device = self.noise.count.device
        host = (
            torch.stack(
                [metrics[k].detach().double().reshape(()).to(device) for k in keys]
                + [estimate.count.double().to(device), torch.as_tensor(done.valid, dtype=torch.float64).to(device)]
            )
            .cpu()
            .tolist()
        )
        values, (count, valid_now) = dict(zip(keys, host[:-2])), host[-2:]
        if count == 0:
            return
        valid_now = valid_now and not self.noise_source.invalid  # GSNR and EB are per-example statistics
        values = {k: v for k, v in values.items() if valid_now or not k.startswith((GSNR_TAG, EB_CRITERION))}
        values, self._gsnr_partial = self._coordinates.complete_passes(values, coordinates, self._gsnr_partial)
        # The charts skip an undefined or unbounded value; callback_metrics get it as such (log_scalars).
        log_scalars(trainer, values, step.step, finite_only=True)
        disagreement = self.gradient_noise.disagreement()
        if disagreement:
            self.warn(f"{disagreement}.")
            log_text(trainer, SOURCES_CHECK, disagreement, step.step)

    def _log_norms(self, trainer: "pl.Trainer", step: ProbeStep, result: PerExampleStep) -> None:
        """The step's per-example norm histogram and outliers panel, or why they are not the examples' norms."""
        sources = step.sources
        if result.failed:
            return  # said after its cause, where the failed layers are moved (`_move_failed`)
        if why := sources.norms_invalid():
            self.warn(f"no per-example gradient norms (histogram, outliers panel) at steps where {why}.", once=True)
        elif outliers := log_per_example_norms(
            trainer, result.sq_norms, step.rows, self.top_k, sources.norm_coverage, step.step
        ):
            self.outlier_rows, self.outlier_coverage = outliers.by_row, outliers.coverage
            self.last_outliers, self.outlier_step = list(zip(outliers.ids, outliers.norms)), step.step

    # ------------------------------------------------------------------ teardown and state

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._detach_hooks()

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        # Lightning does not call teardown after a failure: the hooks would stay on the model, and grow.
        self._detach_hooks()
        self._step = None


def _reduction_said(reduction: str, how: str) -> str:
    """What the probe takes each example's gradient to be, for a loss of kind ``reduction``
    (:class:`~trainvitals.per_example.LossReduction`); ``how``: where that was read."""
    if reduction == "scaled":
        return (
            f"the loss is a sum of its terms {how}: neither a mean nor a sum over the examples; per-example "
            "gradients are B × each example's share of the step's loss, B its examples (the gradient of the sum "
            "of the example's terms, scaled by B over that divisor)"
        )
    return f"the loss is a {reduction} over the examples ({how}); per-example gradients are those of " + (
        "each example's own loss" + (", B × its share of the batch mean" if reduction == "mean" else "")
    )
