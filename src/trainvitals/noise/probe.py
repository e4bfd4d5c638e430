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
from trainvitals.noise.estimate import (
    INDEPENDENT,
    SOURCES_CHECK,
    GradientNoise,
    NoiseSource,
    find_gradient_noise,
    population_of,
)
from trainvitals.noise.estimators import NoiseScaleEMA, NoiseScaleError
from trainvitals.noise.gsnr import EB_CRITERION, GSNR_TAG, ModuleCoordinates, StepCoordinates
from trainvitals.noise.probe_sources import COUPLED, ProbeSources, layout_notes, unequal_sizes
from trainvitals.noise.probe_step import (
    MicroBatches,
    coordinate_stats,
    log_per_example_norms,
    step_estimates,
    sum_over_ranks,
)
from trainvitals.norms.nonfinite import NonfiniteCounter
from trainvitals.per_example import Layouts, PerExampleStep, SourcePlan, detect_loss_reduction
from trainvitals.plumbing.amp import loss_scale, scale_left_in_grads
from trainvitals.plumbing.base import TrainvitalsCallback
from trainvitals.plumbing.batch import batch_size, dataset_rows, loss_divisor
from trainvitals.plumbing.cadence import is_logging_step, logging_every
from trainvitals.plumbing.writers import log_scalars, log_text
from trainvitals.text.markdown import markdown_table

LOSS_REDUCTIONS = ("auto", "mean", "sum")
COORDINATE_BUDGET = 2**20  # per-coordinate sums per logging step: 16 MiB of float64 Σg and Σg²


class BatchVarianceProbe(TrainvitalsCallback):
    r"""Gradient noise of the mini-batch gradient: tr(Σ), ‖G‖², B_simple, noise floor, GSNR, EB criterion.

    Per-example gradients are those of each example's own loss ℓ_i: a loss reduced by ``mean`` over
    B examples is multiplied back by B, Lightning's division by ``accumulate_grad_batches`` and the AMP
    loss scale are undone, so a mean- and a sum-reduced version of the same loss give the same numbers.
    tr(Σ) is in squared gradient units per example; B_simple in examples.

    Sources, chosen per parameter at fit start and named in one log line:

    1. per-example squared norms in the same backward, from saved activations and output gradients,
       by the rules of :mod:`trainvitals.per_example` (Linear, convolutions, Embedding, the
       normalisation layers, attention, recurrent layers, and any registered with
       ``register_per_example_rule``): the estimator with b = 1 over all examples of the step, all
       micro-batches and ranks;
    2. the micro-batches of gradient accumulation and the DDP ranks (:class:`MicroBatchSquaredNorms`,
       McCandlish Eq. A.2) for the other parameters, when a step has at least two of them;
    3. otherwise ``torch.func`` per-example gradients of those layers on the first
       ``fallback_sub_batch`` examples (when ``fallback``), except for a module whose forward runs
       layers with weight matrices (a model's own position table): the re-run would be that subtree.

    The parts add up: tr(Σ) and ‖G‖² are sums over parameters, over the measured ones only: the share
    of the parameters and of ‖ḡ‖² they cover goes with the estimate. A layer found not measurable per
    example at a step (a position table looked up with ids shared by the batch) is moved from the next
    step on; that step is measured over the other layers, its parameters not measured per example, where
    none of its statistics had entered the sums (else the step is left out). BatchNorm in training mode makes
    every example's gradient depend on the whole micro-batch: per-example gradients are then not
    independent draws (their addends of the batch gradient largely cancel), so with micro-batches or
    ranks every parameter is measured from those instead, and without them the probe's estimate is
    marked invalid and decides nothing. A micro-batch with few values per channel is warned about.

    Under ``torch.compile`` the probe puts no module hook inside a compiled region (a compiled training
    step or submodule: :func:`~trainvitals.memory.compiled_modules`), where it would break the graph,
    and says so in the sources line: the region's parameters are measured from micro-batches and ranks
    (tensor hooks on parameters break nothing), else named as not measured.

    The probe feeds its estimate into the run's one :class:`~trainvitals.noise.estimate.GradientNoise`
    (:attr:`gradient_noise`), shared with GradNormEarlyStopping's micro-batch source, and logs that
    combined estimate.

    Logged every ``log_every_n_steps`` optimizer steps (a multiple of ``measure_every_n_steps``), once a valid
    measurement exists (and from the first measured step, without GradNormMonitor, ``grad_norm/nonfinite_steps``:
    measured steps whose gradient held inf/NaN, ``amp_skipped_steps`` under a GradScaler), of the combined
    estimate in the units of ``.grad``: ``grad_noise/trace_cov``,
    ``grad_noise/grad_sq_norm`` (the EMAs) and their ``..._se`` (standard errors),
    ``grad_noise/b_simple`` (only when EMA(‖G‖²) > 0), ``grad_noise/b_simple_rel_err``,
    ``grad_noise/b_simple_unreliable`` (1 when ‖G‖² ≤ 0, the relative error exceeds ``max_rel_err`` or
    the estimate covers too little of ‖ḡ‖²), ``grad_noise/coverage`` (share of ‖ḡ‖² measured),
    ``grad_norm/noise_floor`` and ``grad_norm/noise_floor_se`` (sqrt(tr Σ / B), B examples per optimizer
    step, in the units of ``.grad``, beside GradNormMonitor's ``grad_norm/total``),
    ``grad_noise/batch_grad_var/micro_batch`` and ``.../full_batch`` (tr Σ / b and tr Σ / B), and with
    ``per_coordinate`` ``grad_noise/gsnr/<module>`` and ``grad_noise/eb_criterion`` over the parameters
    of sources 1 and 3 (those of source 1 within ``coordinate_budget``). Every ``histogram_every_n_steps``,
    except while BatchNorm trains (said once): a histogram ``grad_noise/per_example_grad_norm`` of each example's
    ‖g_i‖ over the parameters of sources 1 and 3, and a text panel ``grad_noise/outliers`` with the ``top_k``
    largest, both saying which parameters they cover; by dataset row where the batch carries it or the sampler's
    order is fixed (``callbacks._batch.dataset_rows``), else by position in this process's batch.

    Public attributes for other callbacks: :attr:`noise` (updated at most once per optimizer step, in
    ``on_before_optimizer_step``; ``noise.count`` stays 0 until a valid measurement) and
    :attr:`effective_batch_size` (examples per optimizer step, all ranks; ``None`` before the first), and
    :attr:`grad_scale`: ``.grad`` = grad_scale × the mean of the step's per-example gradients (1 for a
    loss averaged over the examples; b for one summed over micro-batches of b, since Lightning averages
    the micro-batches' gradients; × the backward calls of a step under manual optimization). Both
    describe a whole optimizer step: an epoch's shorter last accumulation window leaves them as they were.

    Args:
        measure_every_n_steps: measure every this many optimizer steps (≥ 1).
        log_every_n_steps: log every this many optimizer steps; ``None``: the Trainer's. Rounded up to a
            multiple of ``measure_every_n_steps``.
        histogram_every_n_steps: per-example norm histograms every this many steps; 0: never.
        ema_beta: EMA decay per optimizer step, in [0, 1): a measurement every n steps enters with decay
            β^n, so the estimates average over about 1/(1 − β) optimizer steps at any cadence, as
            GradNormEarlyStopping's do.
        loss_reduction: ``"auto"`` (read from the loss's autograd graph), ``"mean"`` or ``"sum"`` over the
            examples of a micro-batch.
        per_coordinate: compute GSNR and the EB criterion on logging steps. (Their sums are formed either way
            there and at a fit's first step, to check that per-example gradients add up to ``.grad``.)
        coordinate_budget: coordinates of the per-example-norm layers whose per-coordinate sums one
            logging step collects (≥ 1), rounded up to whole rows of a parameter's dimension 0. The
            sums cost 16 bytes per coordinate (float64 Σg and Σg², plus as much again while a
            micro-batch's are added in): the default 2**20 holds 16 MiB, ≤ 10 % of a bare run's peak
            memory for a 50M-parameter model; a model within the budget is covered at every logging
            step. Over it, successive logging steps take successive rows, in the plan's parameter
            order, and a layer's GSNR is logged at the logging step that completes its pass: every
            ⌈coordinates / budget⌉ logging steps, its rows from consecutive logging steps. The EB
            criterion, one step's sum over all coordinates, is then not logged (said once, with the
            budget that would log it).
        fallback: allow source 3.
        fallback_sub_batch: examples per step for source 3 (≥ 2).
        max_rel_err: relative standard error of B_simple above which it is flagged unreliable and gives
            no noise-aware advice (> 0; 0.5 keeps the advised lrs within about ×1.5).
        top_k: outlying examples reported per histogram (≥ 0).
        sequence_first: where a Linear, Embedding or norm layer's input has the batch on both of its first two
            dimensions (T = B), outside the modules whose ``batch_first`` says it: ``True``, sequence-first
            ``(T, B, ...)``, and so are the loader's batches (the batch size is their dimension 1); ``False``,
            batch-first ``(B, T, ...)``; ``None``, from the evidence of :mod:`trainvitals.per_example.batch_dim`
            (the model's ``batch_first`` modules, an input that is a view of the batch, the layer's steps with
            T ≠ B, the other layers'), else batch-first, said once.
        strict: raise instead of warning when the probe cannot measure.

    Raises:
        TypeError: for an argument of the wrong type, ValueError for one out of range, naming it.
        RuntimeError: with ``strict``, when a step cannot be measured.
    """

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
        beta = self.ema_beta**self.measure_every_n_steps
        self.add_state("noise_source", functools.partial(NoiseSource, "probe", beta), key="source")
        """This probe's source of :attr:`gradient_noise`, in the units of each example's own loss."""
        self.add_state("nonfinite", NonfiniteCounter, key="nonfinite_steps")
        """Measured steps whose gradient was non-finite: logged when no GradNormMonitor logs such steps."""
        self.add_state("last_outliers", [], persistent=False)
        """(dataset row, or position in the batch without :attr:`outlier_rows`, and ‖g_i‖) of the last outliers."""
        self.add_state("outlier_rows", False, persistent=False)
        self.add_state("outlier_coverage", "", persistent=False)  # which parameters their norms are over
        self.add_state("_enabled", False, persistent=False)
        self.add_state("_disabled", "", persistent=False)  # why this fit measures nothing, if it does not
        self.add_state("_left_out", "", persistent=False)  # why the last step left out was, for the end line
        self.add_state("_excluded", set(), persistent=False)
        self.add_state(
            "_failed", {}, persistent=False
        )  # failed here, not yet excluded (DDP: until a logging step): why
        self.add_state("_open_step", -1, persistent=False)
        self.add_state("_measuring", False, persistent=False)
        self.add_state("_finalized_step", -1, persistent=False)
        self.add_state("_coordinate_cursor", 0, key="coordinate_cursor")  # the next logging step's first coordinate
        self.add_state("_selection", {}, persistent=False)
        self.add_state("_sums_checked", False, persistent=False)  # this fit's first measured step formed the sums
        self.add_state("_gsnr_partial", {}, key="gsnr_partial")  # per GSNR key: Σ GSNR and coordinates of the pass
        self.add_state("_batches", MicroBatches, persistent=False)  # those of the step being measured
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

    @property
    def logs_noise_estimate(self) -> bool:  # this fit's probe logs the run's one estimate: the stopper does not
        return self._enabled

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
        return f"{scale}{at} from {count} measured optimizer steps{why}."

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
            rows.append((f"largest per-example gradients ({which}: ‖g_i‖)", f"{largest} ({self.outlier_coverage})"))
        return "\n".join(markdown_table(("", ""), rows))

    @override
    def setup_fit(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.gradient_noise = find_gradient_noise(trainer.callbacks)
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
            self._batch_size,
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
        if self._measuring:
            assert self._sources is not None
            self._sources.collector.begin_micro_batch()  # a batch skipped before (training_step returned None) left its forward
            size = batch_size(batch, self.sequence_first)
            self._batches.unsized |= size is None
            self._batch_size = size or 0
            if size:
                self._sources.collector.expect_batch(size, batch)
            if self._histogram_every is not None and step % self._histogram_every == 0:
                self._batches.rows.append(dataset_rows(trainer, batch, batch_idx, size) if size else None)

    def _begin_step(self, step: int) -> None:
        self._open_step = step
        sources = self._sources
        assert sources is not None
        self._measuring = step % self.measure_every_n_steps == 0 and sources.measures
        self._batches = MicroBatches()
        self._detach_hooks()
        if not self._measuring:
            return
        self._selection = {}
        logging = is_logging_step(step, self._log_every)
        if logging or not self._sums_checked:  # GSNR's sums, and the sums check's (also a fit's first step)
            self._selection, cursor = self._coordinates.select(self._coordinate_cursor)
            self._coordinate_cursor, self._sums_checked = cursor if logging else self._coordinate_cursor, True
        sources.attach(
            self._selection, keep_norms=self._histogram_every is not None and step % self._histogram_every == 0
        )

    @override
    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Tensor) -> None:
        # An empty batch leaves its step out (`ProbeSources.problem`); a loss without a graph reaches no layer, and
        # its backward fails on its own (GraphIntegrityCallback says why): no reduction to read.
        if not self._measuring or not self._batch_size or loss.grad_fn is None:
            return
        accumulation = loss_divisor(trainer, pl_module)
        reduction, how = self.loss_reduction, "as told"
        if reduction == "auto":
            found = detect_loss_reduction(loss, self._batch_size, accumulation)
            if found is not None:
                reduction, how = found.kind, "read from the loss's graph"
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
            self.info(
                f"the loss is a {reduction} over the examples ({how}); per-example gradients are those of "
                "each example's own loss" + (", B × its share of the batch mean" if reduction == "mean" else "")
            )
        self._reduction = reduction
        scale = loss_scale(trainer)
        per_loss = self._batch_size if reduction == "mean" else 1
        self._unit = accumulation * per_loss / (1.0 if scale is None else scale)

    @override
    def on_after_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not self._measuring:
            return
        assert self._sources is not None
        self._sources.collector.end_micro_batch(self._unit)
        self._sources.micro.end_micro_batch()
        self._batches.sizes.append(self._batch_size)

    # ------------------------------------------------------------------ per optimizer step

    @override
    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: torch.optim.Optimizer
    ) -> None:
        step = trainer.global_step
        if not self._measuring or self._finalized_step == step:
            return
        self._finalized_step = step
        sources = self._sources
        assert sources is not None
        result = sources.collector.pop(decide=False)
        for note in layout_notes(self._layouts, self.noise_source):
            self.warn(note + ".", once=True)
        if is_logging_step(step, self._log_every) or self._log_every is None or result.sq_norms:
            # 1-D ids compared with arange(B) on the device, read at a step that syncs anyway (else: `sum_over_ranks`)
            sources.collector.decide(result)
        micro_sum, _ = sources.micro.pop()
        self._detach_hooks()
        self._check_sums(trainer, pl_module, result, optimizer)
        few = sources.few_batchnorm_values(self._batch_size, trainer.accumulate_grad_batches)
        if few:
            self.warn(few, once=True)
        if coupled := sources.coupling():
            if not self.noise_source.invalid:
                self.warn(sources.coupling_warning(coupled) + ".", once=True)
            self.noise_source.invalidate(COUPLED)
        problem, aside = sources.problem(result, self._batches.sizes, self._batches.unsized)
        # An epoch's ragged last window is left out without a word, as the stopper leaves it out: no fault of
        # the run's. Failed layers are said where they are moved (`_move_failed`).
        ragged_end = trainer.is_last_batch and problem == unequal_sizes(self._batches.sizes)
        if problem and set(result.failed) <= aside and not ragged_end:
            self._cannot_measure(problem)
        self._failed.update(result.failed)
        # Measured even when this rank saw a problem: every rank must join the same all-reduce, which also
        # says which layers failed on any rank, so that every rank excludes the same ones. A layer set aside
        # is measured as the next plan will: its parameters among those not measured per example.
        failed = self._measure(trainer, pl_module, result, micro_sum, optimizer, not problem, aside)
        if failed:
            # The step's kept norms (histogram, outliers) lack the failed layers: said with their cause, once.
            norms_lost = bool(result.sq_norms) and bool(result.failed)
            self._move_failed(trainer, pl_module, failed, set() if problem else aside, norms_lost)

    def _move_failed(
        self,
        trainer: "pl.Trainer",
        pl_module: "pl.LightningModule",
        failed: set[str],
        aside: set[str],
        norms_lost: bool = False,
    ) -> None:
        """Exclude the layers that failed per example, plan again, and say in one message why, what became of
        the steps they failed in (``aside``: the layers this one was measured without; ``norms_lost``: this
        step's per-example norms are not logged), where each goes and the coverage."""
        reasons = {name: self._failed.pop(name, "it failed on another rank") for name in sorted(failed)}
        self._excluded.update(failed)
        self._make_plan(trainer, pl_module)
        assert self._sources is not None
        message = self._sources.moved(reasons, aside, trainer.world_size)
        if norms_lost:
            message += (
                f" This step (optimizer step {trainer.global_step}) logs no per-example gradient norms (histogram, "
                "outliers panel): they would lack the failed layers; the next steps' cover the layers left."
            )
        self.cannot_measure(message)

    def _check_sums(
        self,
        trainer: "pl.Trainer",
        pl_module: "pl.LightningModule",
        result: PerExampleStep,
        optimizer: torch.optim.Optimizer,
    ) -> None:
        """On a step with per-coordinate sums, fail the layers whose per-example gradients do not add up to their
        ``.grad``: on one device (ranks average ``.grad``), with all micro-batches measured and of one size."""
        assert self._sources is not None
        if not result.grad_sum or not self._batches.whole_window(trainer, pl_module):
            return
        to_grad: Tensor | float = self._grad_units(trainer, pl_module) / sum(self._batches.sizes)
        scale = scale_left_in_grads(trainer, optimizer)
        result.failed.update(self._sources.collector.unbalanced(result, to_grad if scale is None else scale * to_grad))

    def _measure(
        self,
        trainer: "pl.Trainer",
        pl_module: "pl.LightningModule",
        result: PerExampleStep,
        micro_sum: Tensor | None,
        optimizer: torch.optim.Optimizer,
        valid_here: bool,
        aside: set[str],
    ) -> set[str]:
        """Update the estimates (and log, at a logging step); returns the layers to exclude from now on.

        ``optimizer``: the one about to step; its parameters' ``.grad`` is the batch gradient (:meth:`ProbeSources.batch_sq_norms`).
        ``aside``: the layers that failed here without a trace in the sums, measured as not measured per example.
        """
        if not self._batches.sizes:
            return set(self._failed) if trainer.world_size == 1 else set()
        sources = self._sources
        assert sources is not None
        sums = sum_over_ranks(
            trainer,
            result,
            micro_sum,
            self._batches.sizes,
            valid_here,
            sources.layers,
            set(self._failed),
            aside,
            read_failures=is_logging_step(trainer.global_step, self._log_every),
        )
        if sums.examples < 2:
            self._cannot_measure("a step of 1 example has no spread to measure")
            return sums.failed
        to_mean = 1 / self._grad_units(trainer, pl_module)
        batch_sq = {
            part: sq_norm * to_mean**2
            for part, sq_norm in self._sources.batch_sq_norms(trainer, optimizer, sums.aside).items()
        }
        grad_sq_norm, trace_cov, valid, covered, total = step_estimates(
            sources.plan,
            batch_sq,
            result,
            sums,
            len(self._batches.sizes) * trainer.world_size,
            self._batches.size,
            self._unit,
            aside,
        )
        self.noise_source.update(grad_sq_norm, trace_cov, valid, covered, total)
        self.nonfinite.add(torch.isfinite(total))
        self.noise_source.population = population_of(trainer.train_dataloader)  # estimate.py, rule 6
        whole = not pl_module.automatic_optimization or len(self._batches.sizes) == trainer.accumulate_grad_batches
        # Judged at the run's regular batch, as the stopper: an epoch's short last batch does not change it.
        short = (
            trainer.is_last_batch
            and self.effective_batch_size is not None
            and sums.examples < self.effective_batch_size
        )
        if (whole and not short) or self.effective_batch_size is None:
            self.effective_batch_size = sums.examples
            self.grad_scale = self._grad_units(trainer, pl_module)
        step = trainer.global_step
        if is_logging_step(step, self._log_every):
            self._log(trainer, result, valid, sums.examples, step, sums.failed)
            log_scalars(trainer, self.nonfinite.metrics(trainer, self), step)
        if result.sq_norms:
            self._log_norms(trainer, self._sources, result, step)
        return sums.failed

    def _grad_units(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> float:
        return self._batches.grad_units(trainer, pl_module, self._reduction)

    # ------------------------------------------------------------------ logging

    def _log(
        self,
        trainer: "pl.Trainer",
        result: PerExampleStep,
        valid: Tensor | bool,
        examples: int,
        step: int,
        failed: set[str],
    ) -> None:
        """The EMAs at the run's batch (:attr:`effective_batch_size`), the per-coordinate statistics of this
        step's ``examples`` over the layers that did not fail (``failed``)."""
        batch = self.effective_batch_size or examples
        estimate = self.gradient_noise.estimate()
        metrics: dict[str, Tensor] = {
            **self.gradient_noise.metrics(estimate),
            "grad_noise/batch_grad_var/micro_batch": estimate.trace_cov / self._batches.size,
            "grad_noise/batch_grad_var/full_batch": estimate.trace_cov / (estimate.batch_size or batch),
        }
        coordinates: StepCoordinates = {}
        if self.per_coordinate and self._plan is not None:
            assert self._sources is not None
            snr_sums, coordinates = coordinate_stats(
                trainer, self._coordinates, self._selection, result, examples, self._sources.params_of(failed)
            )
            metrics.update(snr_sums)
        keys = list(metrics)
        device = self.noise.count.device
        host = (
            torch.stack(
                [metrics[k].detach().double().reshape(()).to(device) for k in keys]
                + [estimate.count.double().to(device), torch.as_tensor(valid, dtype=torch.float64).to(device)]
            )
            .cpu()
            .tolist()
        )
        values, (count, valid_now) = dict(zip(keys, host[:-2])), host[-2:]
        if count == 0:
            return
        valid_now = valid_now and not self.noise_source.invalid  # GSNR and EB are per-example statistics
        values = {
            k: v
            for k, v in values.items()
            if math.isfinite(v) and (valid_now or not k.startswith((GSNR_TAG, EB_CRITERION)))
        }
        values, self._gsnr_partial = self._coordinates.complete_passes(values, coordinates, self._gsnr_partial)
        log_scalars(trainer, values, step)
        disagreement = self.gradient_noise.disagreement()
        if disagreement:
            self.warn(f"{disagreement}.")
            log_text(trainer, SOURCES_CHECK, disagreement, step)

    def _log_norms(self, trainer: "pl.Trainer", sources: ProbeSources, result: PerExampleStep, step: int) -> None:
        if result.failed:
            return  # said after its cause, where the failed layers are moved (`_move_failed`)
        if why := sources.norms_invalid():
            self.warn(f"no per-example gradient norms (histogram, outliers panel) at steps where {why}.", once=True)
        elif outliers := log_per_example_norms(
            trainer, result.sq_norms, self._batches.rows, self.top_k, sources.norm_coverage, step
        ):
            self.outlier_rows, self.outlier_coverage = outliers.by_row, outliers.coverage
            self.last_outliers = list(zip(outliers.ids, outliers.norms))

    # ------------------------------------------------------------------ teardown and state

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._detach_hooks()

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        # Lightning does not call teardown after a failure: the hooks would stay on the model, and grow.
        self._detach_hooks()
        self._measuring = False
