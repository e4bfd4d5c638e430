r"""LRScalingAdvisor: which learning rate fits this run's batch size, measured on the run itself.

A step is lr × gradient, and the right lr depends on how noisy the gradient is. Changing the batch
(more devices, accumulation, a bigger GPU) while keeping the lr, or scaling it by a rule that does
not fit the optimizer, is a common silent mistake. The advisor reads the effective batch, each
param group's lr and optimizer family, and (when a noise-measuring callback runs alongside) the
gradient noise scale B̂, and says what lr other batch sizes need (docs/science.md §4,
:mod:`trainvitals.lr_scaling.rules`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from typing_extensions import override

from trainvitals._validation import check_bool, check_int
from trainvitals.lr_scaling.groups import GroupLR, group_lrs
from trainvitals.lr_scaling.rules import (
    LRAdvice,
    advice_table,
    advise,
    check_positive,
    check_positive_int,
    classify_loss_reduction,
    doubling_bounds,
    effective_batch_size,
    examples_over_min,
    loss_reduction_note,
    lr_ratio,
    rule_for,
    steps_over_min,
    validate_batch_sizes,
    validate_noise_scale,
)
from trainvitals.noise.estimate import b_simple_interval
from trainvitals.per_example import detect_loss_reduction
from trainvitals.plumbing.amp import loss_scale
from trainvitals.plumbing.base import TrainvitalsCallback
from trainvitals.plumbing.batch import batch_size, loss_divisor
from trainvitals.plumbing.cadence import is_logging_step, logging_every
from trainvitals.plumbing.rerun import rerun_quietly
from trainvitals.plumbing.sharing import GRADIENT_NOISE, LR_FACTORS, NOISE_BAND, SUMMARY
from trainvitals.plumbing.writers import log_scalars, log_text
from trainvitals.text.terminal import markdown_to_text

REFERENCE_TOLERANCE = 0.05  # an lr within 5% of the suggestion counts as rescaled


class LRScalingAdvisor(TrainvitalsCallback):
    r"""Report the effective batch, each lr's family and the lr other batch sizes need.

    Reports at fit start (the first training batch), before every ``log_every_n_steps``-th optimizer
    step and at the end of training. Each report covers:

    - the effective batch = per-device batch × devices × nodes × ``accumulate_grad_batches``
      (data-parallel replicas as the strategy shards the data: 1 on a single device, all processes
      under DDP/FSDP/DeepSpeed);
    - for each optimizer and param group: its base lr, the one you set and the advice scales — where an lr
      scheduler drives it (``trainer.lr_scheduler_configs``), the scheduler's base lr (OneCycleLR's ``max_lr``,
      :func:`~trainvitals.plumbing.lr_factors.base_lr`), so a decayed or warming-up lr (a cosine down to 0) still
      gets its advice; the lr its step runs at now as context (the scheduler's, × BandSchedule's cuts and
      TrainingGuard's factor, :class:`~trainvitals.plumbing.lr_factors.LRFactors`, which stay out of the base lr:
      in a run at another batch they act on top of it again); and its family (SGD-like, Adam-like, or ``unsure``
      for a class no rule is known for);
    - with a noise scale B̂ (examples): S/S_min = 1 + B̂/B, E/E_min = 1 + B/B̂, the balanced batch
      ≈ B̂, and the suggested lr at ×½, ×2, ×4, ×8 the batch and at ``target_batch_sizes`` by the
      noise-aware rule η_new/η_old = (1 + B̂/B_old)/(1 + B̂/B_new) (SGD-like; McCandlish et al. 2018,
      Eq. 2.6) or its square root (Adam-like; Malladi et al. 2022); without B̂, the classic linear
      and square-root rules, labelled so;
    - the loss reduction: on the first batch ``training_step`` runs twice more, under ``no_grad``
      and in eval mode, on the batch and on the batch concatenated with itself (``self.log`` muted;
      random state, buffers and train/eval modes restored). A mean loss stays the same, a sum
      doubles. A loss summed over N terms has N× the gradient of their mean, i.e. N× SGD's lr and ε/N
      for Adam: N = b, the per-device micro-batch, for a per-example loss, b × tokens for a per-token one
      (read from the graphs of the first optimizer step's backwards, :attr:`summed_terms`); one also divided
      by d (a token sum over the step's tokens, transformers' ``num_items_in_batch``) has N/d× the gradient
      (:attr:`loss_divided_by`). Where the graph does not say, no scale is said. Not run under manual
      optimization or with ``detect_loss_reduction=False``.

    B̂ is ``noise_scale`` if given, else B_simple of the run's one noise estimate
    (:class:`~trainvitals.noise.estimate.GradientNoise`, attribute ``gradient_noise`` of
    GradNormEarlyStopping and BatchVarianceProbe), used only when it is decisive (it covers ≥ 90% of
    ‖ḡ‖²) and reliable (its Fieller interval's relative error ≤ the estimate's ``max_rel_err``,
    BatchVarianceProbe's argument, 0.5 by default). Otherwise the classic rules, with the reason. A measured B̂
    comes with the estimate's own 90% interval (Fieller's, as the probe quotes it) and the range of each
    suggested lr over it.

    With ``reference=(batch, lr)``, the effective batch and lr the lr was tuned at, a run whose
    effective batch differs and whose lr is not within 5% of the suggested one gets one warning at
    fit start with the suggested lr. ``lr`` may be a mapping from group name (as in the metrics) to lr.

    Logged (every logger) once per optimizer step at most, before the step the advice is for runs
    (``trainer.global_step``), as LearningRateMonitor logs the lr that step uses; B̂ is then the one
    measured up to the step before:
    ``lr_scaling/effective_batch`` (examples); with
    B̂, ``lr_scaling/b_noise`` (examples; only a given ``noise_scale``: a measured B̂ is the run's
    ``grad_noise/b_simple``), ``lr_scaling/steps_over_min``,
    ``lr_scaling/examples_over_min``; per param group ``<name>`` (``SGD``, ``Adam/pg2``, named as by
    ``LearningRateMonitor``), ``lr_scaling/lr/<name>`` (the lr the step runs at), ``lr_scaling/base_lr/<name>``
    (the one advised on) and ``lr_scaling/suggested_lr_<key>/<name>`` (a base lr) with key ``x0.5``, ``x2``,
    ``x4``, ``x8`` or ``b<size>`` for a listed size (not for an unsure family). TensorBoard text
    ``lr_scaling/advice`` at fit start and at the end (at the last step that ran, with the latest B̂; no scalars
    there), kept as :meth:`summary_markdown`; the terminal gets one line at fit end, and the report too with
    ``verbose=True``. Where the run stopped in its noise band, or BandSchedule acted on it, the end report and
    line say what the batch advice then means (:meth:`GradNormEarlyStopping.band_entries
    <trainvitals.noise.stopper.GradNormEarlyStopping.band_entries>`).

    The host reads B̂ and the lrs on reporting steps only; other steps cost one integer comparison.

    Args:
        log_every_n_steps: report cadence in optimizer steps, ≥ 1; ``None`` for the Trainer's
            ``log_every_n_steps``.
        target_batch_sizes: effective batch sizes (examples) to advise on besides ×½, ×2, ×4, ×8.
        reference: ``(effective_batch, lr)`` the lr was tuned at; ``lr`` a number or a mapping from
            group name to number.
        noise_scale: a known B̂ in examples, used instead of any measured one.
        batch_size: per-device micro-batch in examples; default: inferred from the first batch.
        detect_loss_reduction: run the duplicated-batch probe on the first batch.
        verbose: also print the end report at the end of training (by default the terminal gets the one
            line at fit end; the report goes to TensorBoard and ``trainvitals report``).

    Raises:
        TypeError: naming an argument of the wrong type (a string for a number, a bool for a count).
        ValueError: naming ``log_every_n_steps``, ``target_batch_sizes``, ``reference``,
            ``noise_scale`` or ``batch_size`` when out of range (a non-positive number, a zero
            target, a malformed reference).
    """

    provides = (SUMMARY,)
    reads = (GRADIENT_NOISE, LR_FACTORS, NOISE_BAND)

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        target_batch_sizes: Sequence[int] = (),
        reference: tuple[int, float | Mapping[str, float]] | None = None,
        noise_scale: float | None = None,
        batch_size: int | None = None,
        detect_loss_reduction: bool = True,
        verbose: bool = False,
    ) -> None:
        super().__init__()
        self.log_every_n_steps = check_int("log_every_n_steps", log_every_n_steps, 1, none_ok=True)
        self.target_batch_sizes = validate_batch_sizes("target_batch_sizes", target_batch_sizes)
        self.reference = None if reference is None else _validate_reference(reference)
        self.noise_scale = validate_noise_scale(noise_scale)
        self.batch_size = check_int("batch_size", batch_size, 1, none_ok=True)
        self.detect_loss_reduction = check_bool("detect_loss_reduction", detect_loss_reduction)
        self.verbose = check_bool("verbose", verbose)

        # Nothing is saved (the advice is rebuilt from the run's noise estimate and lrs); each fit starts afresh.
        self.per_device_batch: int | None
        """Examples in one device's micro-batch, once seen."""
        self.add_state("per_device_batch", None, persistent=False)
        self.effective_batch: int | None
        """Examples per optimizer step over all replicas and accumulated micro-batches, once seen."""
        self.add_state("effective_batch", None, persistent=False)
        self.loss_reduction: str | None
        """``"mean"``, ``"sum"`` or ``"unsure"`` once probed; ``None`` when not probed."""
        self.add_state("loss_reduction", None, persistent=False)
        self.loss_ratio: float | None
        """Loss on the batch twice over / loss on the batch, once probed: 1 for a mean, 2 for a sum."""
        self.add_state("loss_ratio", None, persistent=False)
        self.summed_terms: float | None
        """For a summed loss, the values a micro-batch's adds up (examples × tokens for a per-token loss), on
        average over the first optimizer step's micro-batches, read from their graphs; ``None`` until then or
        where a graph does not tell."""
        self.add_state("summed_terms", None, persistent=False)
        self.loss_divided_by: float | None
        """For a summed loss divided by a number (a sum over tokens by the step's tokens, times
        ``accumulate_grad_batches``), that number as each micro-batch's loss has it; ``None`` when none."""
        self.add_state("loss_divided_by", None, persistent=False)
        self.add_state("_graph_reads", [], persistent=False)  # (terms, divisor) per backward of the first step
        self.advices: dict[str, LRAdvice | None]
        """The latest advice per param group name, on its base lr; ``None`` for a group whose base lr is 0."""
        self.add_state("advices", {}, persistent=False)
        self._lrs: dict[str, GroupLR]  # per advised group: its lrs, as the advice says them
        self.add_state("_lrs", {}, persistent=False)
        self.add_state("_band_said", "", persistent=False)  # at fit end: what a stop on the noise band means for it
        self.add_state("_report", "", persistent=False)
        self.add_state("_interval", None, persistent=False)  # the last summary whose B_simple interval advises
        self.add_state("_started", False, persistent=False)
        self.add_state("_graph_read", False, persistent=False)
        self.add_state("_logged_step", -1, persistent=False)  # the optimizer step the scalars were last logged at
        self.add_state("_reference_problems", [], persistent=False)
        self.add_state("_reference_unmatched", "", persistent=False)  # a reference mapping naming no param group

    # ------------------------------------------------------------------ hooks
    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        # Before the step runs: its lr is the one the scheduler set for it (LearningRateMonitor's point).
        step = trainer.global_step
        if self._started:
            if (
                step != self._logged_step
                and self.per_device_batch is not None
                and is_logging_step(step, logging_every(trainer, self.log_every_n_steps))
            ):
                self._report = self._advise(trainer, step)
            return
        self._started = True
        self.per_device_batch = self.batch_size or self._infer_batch_size(batch)
        if self.per_device_batch is None:
            return
        if self.detect_loss_reduction and pl_module.automatic_optimization:
            self._probe_loss_reduction(trainer, pl_module, batch, batch_idx)
        self._report = self._advise(trainer, step)
        log_text(trainer, "lr_scaling/advice", self._report, step)
        if self._reference_unmatched:
            self.warn(f"{self._reference_unmatched}.")
        if self.reference is not None and self._reference_problems:
            self.warn(
                f"the effective batch is {self.effective_batch} but the lr was tuned at batch "
                f"{self.reference[0]}; " + "; ".join(self._reference_problems) + "."
            )

    @override
    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Tensor) -> None:
        # The first step's graphs: how many terms a summed loss adds up, and what it divides them by (the
        # duplicated batch cannot tell). About 10 µs a backward, no host sync.
        if self._graph_read or self.loss_reduction != "sum" or self.per_device_batch is None:
            return
        found = detect_loss_reduction(
            loss, self.per_device_batch, loss_divisor(trainer, pl_module), loss_scale(trainer)
        )
        summed = found is not None and found.kind in ("sum", "scaled") and found.terms is not None
        self._graph_reads.append((found.terms, found.count if found.kind == "scaled" else None) if summed else None)

    @override
    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *_: Any) -> None:
        if self._graph_read or not self._graph_reads:
            return
        # One optimizer step's micro-batches: their gradients add up to the step's.
        self._graph_read, reads, self._graph_reads = True, self._graph_reads, []
        divisors = {read[1] if read is not None else -1.0 for read in reads}
        if None in reads or len(divisors) != 1:
            return  # a graph that did not say, or micro-batches that divide by different numbers: no one scale
        self.summed_terms = sum(terms for terms, _ in reads) / len(reads)
        self.loss_divided_by = divisors.pop()

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.per_device_batch is None:
            return
        # The report with the latest B̂, at the last step that ran; no scalars: the lrs are now those of a
        # step that will not run.
        self._report = self._advise(trainer, None)
        log_text(trainer, "lr_scaling/advice", self._report, max(trainer.global_step - 1, 0))
        if self.verbose:
            self.info(f"advice after {trainer.global_step} optimizer steps\n{markdown_to_text(self._report)}")

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.info(self.summary_line())

    def summary_line(self) -> str:
        """One line for the end of fit: the first optimizer's advice in words, then where the full table is."""
        if not self._started:
            return "no advice: this fit ran no batch."
        if not self._report:
            return "no advice: the per-device batch size is unknown (pass batch_size=)."
        named = [(name, adv) for name, adv in self.advices.items() if adv is not None]
        if not named:
            return (
                f"no lr advice at an effective batch of {self.effective_batch}: the base lr is 0 for every "
                "parameter group (nothing to scale)."
            )
        name, adv = named[0]
        if adv.noise_scale is None and self._interval is not None:
            scale = f"no reliable noise scale, {b_simple_interval(self._interval)}: classic rules, and the interval's advice"
        elif adv.noise_scale is None:
            scale = "no usable noise scale: classic rules"
        else:
            side = "above it: more batch buys little" if adv.batch_size > adv.noise_scale else "below it"
            scale = f"noise scale B̂ = {adv.noise_scale:.4g}, {side}"
        more = f" (and {len(named) - 1} more group(s))" if len(named) > 1 else ""
        band = f" {self._band_said[0].upper()}{self._band_said[1:]}." if self._band_said else ""
        return (
            f"at an effective batch of {self.effective_batch} ({scale}): {name}{more} "
            f"{_headline(adv, self._lrs[name])}; the full table is the Text tab's lr_scaling/advice, or "
            f"trainvitals report.{band}"
        )

    def summary_markdown(self) -> str:
        """The latest report as markdown (the end-of-training table after ``fit``); ``""`` before any.

        Under ``ddp_spawn`` the report lives in the worker processes, not in the launching one.
        """
        return self._report

    # ------------------------------------------------------------------ measurement
    def _infer_batch_size(self, batch: Any) -> int | None:
        size = batch_size(batch)
        if size is None:
            self.warn("cannot infer the per-device batch size; pass `batch_size=`. No advice this run.")
        return size

    def _probe_loss_reduction(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        """Loss on the batch and on the batch twice over; gradients, RNG, buffers and modes stay as they were.

        Eval mode makes every example's loss its own (dropout off, BatchNorm on running statistics),
        so the duplicated batch gives exactly the same mean or exactly twice the sum. The calls go
        through ``trainer.strategy.training_step`` so wrappers (DDP, FSDP) and the precision context
        apply as in the real step; every rank runs it, so any collective inside matches. Both are trainvitals'
        own forwards (:func:`~trainvitals.plumbing.extra_forward.extra_forward`): no callback takes them for the
        step's (the probe's layout evidence), and under ``torch.compile`` they run eagerly, compiling nothing.
        """
        try:
            with rerun_quietly(pl_module), torch.no_grad():
                pl_module.eval()
                single = _loss_of(trainer.strategy.training_step(batch, batch_idx))
                doubled = _loss_of(trainer.strategy.training_step(_doubled(batch), batch_idx))
            loss, loss_doubled = torch.stack([single.double(), doubled.double()]).cpu().tolist()
        except Exception as err:  # user code run speculatively must not break the run
            self.warn(
                "could not tell whether the loss is a mean or a sum over the batch: the first training step, "
                f"re-run on the batch twice over, failed ({type(err).__name__}: {err}), as a step that expects "
                "its batch's shape (a recurrent hidden state carried over) does; the advice goes without the "
                "reduction. LRScalingAdvisor(detect_loss_reduction=False) skips the re-run."
            )
            return
        self.loss_reduction = classify_loss_reduction(loss, loss_doubled)
        self.loss_ratio = loss_doubled / loss if loss else math.nan

    def _measured_noise_scale(self, latest: bool) -> tuple[float | None, str, tuple[float, float] | None]:
        """(B̂ in examples, where it came from or why there is none, its 90% interval: the estimate's own, Fieller's,
        so that the advice and the probe quote one interval; None for a given B̂); ``latest``:
        from the estimate the others logged at their last logging step (a reporting step), else a fresh one."""
        if self.noise_scale is not None:
            return self.noise_scale, "given", None
        noise = self.vitals.shared(GRADIENT_NOISE)
        if noise is None:
            return None, "not measured: no GradNormEarlyStopping or BatchVarianceProbe", None
        summary = noise.host_summary(noise.latest() if latest else None)  # reporting steps only: one transfer
        # Decisive but not reliable: B_simple's 90% interval may still bound the trade-off (_interval_line).
        self._interval = summary if summary["decisive"] and summary["b_simple_low"] > 0 else None
        if not summary["reliable"]:
            return None, summary["why"], None
        interval = (summary["b_simple_low"], summary["b_simple_high"])
        return summary["b_simple"], "measured: " + ", ".join(summary["sources"]), interval

    def _batch_breakdown(self, trainer: "pl.Trainer") -> tuple[int, str]:
        """(effective batch, how it is made up) for the strategy in use."""
        sampler_kwargs = trainer.distributed_sampler_kwargs
        replicas = int(sampler_kwargs["num_replicas"]) if sampler_kwargs else 1
        nodes = trainer.num_nodes if replicas % trainer.num_nodes == 0 else 1
        devices = replicas // nodes
        # An epoch shorter than the accumulation (limit_train_batches, overfit_batches) steps on fewer.
        accumulate = int(min(trainer.accumulate_grad_batches, trainer.num_training_batches))
        assert self.per_device_batch is not None
        batch = effective_batch_size(self.per_device_batch, devices, nodes, accumulate)
        how = (
            f"{self.per_device_batch} (per device) × {devices} (devices) × {nodes} (nodes) × {accumulate} "
            f"(accumulate_grad_batches), {type(trainer.strategy).__name__}"
        )
        return batch, how

    # ------------------------------------------------------------------ reporting
    def _advise(self, trainer: "pl.Trainer", step: int | None) -> str:
        """Recompute the advice, log its scalars at optimizer step ``step`` (``None``: none), and return the
        report text."""
        batch, how = self._batch_breakdown(trainer)
        self.effective_batch = batch
        noise_scale, source, interval = self._measured_noise_scale(latest=step is not None)
        groups = group_lrs(trainer, self.vitals.shared(LR_FACTORS))
        metrics: dict[str, float] = {"lr_scaling/effective_batch": float(batch)}
        lines = [f"**effective batch** {batch} = {how}"]
        if noise_scale is None:
            lines.append(
                f"**noise scale** not used ({source}): classic rules, linear for SGD-like and square root for Adam-like"
            )
            if self._interval is not None and self.noise_scale is None:
                base = any(group.term == "base lr" for group in groups)
                lines.append(self._interval_line(batch, self._interval, base))
        else:
            steps, examples = steps_over_min(batch, noise_scale), examples_over_min(batch, noise_scale)
            # One B_simple per run: a measured B̂ is the estimate's own, logged as grad_noise/b_simple.
            given = {"lr_scaling/b_noise": noise_scale} if source == "given" else {}
            metrics.update({**given, "lr_scaling/steps_over_min": steps, "lr_scaling/examples_over_min": examples})
            spread = "" if interval is None else f", 90% range {interval[0]:.4g}–{interval[1]:.4g}"
            lines.append(
                f"**noise scale** B̂ = {noise_scale:.4g} examples{spread} ({source}): balanced batch ≈ "
                f"{noise_scale:.4g}; now steps S/S_min = {steps:.3g}, examples E/E_min = {examples:.3g}"
            )

        self.advices, self._lrs = {}, {}
        for group in groups:
            name, lr = group.name, group.base
            if not lr > 0:
                self.advices[name] = None  # a group set to lr 0 (frozen), or no scheduler and a warmup at 0
                continue
            adv = self._advice(batch, lr, group, noise_scale)
            self.advices[name], self._lrs[name] = adv, group
            if group.moves:
                lines.append(f"**{group.term}** {name}: {group.base_said()}")
            if noise_scale is not None and interval is not None:
                lines.append(self._range_line(name, adv, batch, lr, group, interval))
            metrics.update({f"lr_scaling/lr/{name}": group.now, f"lr_scaling/base_lr/{name}": lr})
            metrics.update(
                {f"lr_scaling/suggested_lr_{s.key}/{name}": s.lr for s in adv.suggestions if s.lr is not None}
            )
        if any(group.moves for group in self._lrs.values()):
            lines.append(
                "**the suggestions are base lrs**: set one where you set this run's lr; the scheduler, BandSchedule's "
                "cuts and TrainingGuard's factor act on top of it there as they did here"
            )
        idle = [name for name, adv in self.advices.items() if adv is None]
        if idle:
            lines.append(f"base lr is 0 for {', '.join(idle)}: nothing to scale")
        if step is None:  # fit end: the stop is known
            self._band_said = self._band_line(batch)
            lines += [f"**batch advice and the band**: {self._band_said}"] if self._band_said else []
        lines += self._reduction_lines(groups)
        lines += self._reference_lines(groups, batch, noise_scale)
        if step is not None:
            log_scalars(trainer, metrics, step)
            self._logged_step = step
        table = advice_table({name: adv for name, adv in self.advices.items() if adv is not None})
        return "\n".join(f"- {line}" for line in lines) + "\n\n" + table

    @staticmethod
    def _interval_line(batch: int, summary: dict[str, Any], base: bool) -> str:
        """Noise-aware advice from B_simple's 90% interval alone, each bound on its safe side
        (:func:`~trainvitals.lr_scaling.rules.doubling_bounds`): what doubling the batch costs and saves at most
        and at least, and the lr gain it allows at least (``base``: on the base lr, which a scheduler or a factor
        moves from)."""
        low, high = summary["b_simple_low"], summary["b_simple_high"]
        extra, saved, gain = doubling_bounds(batch, low, high)
        side = (
            f"B = {batch} is below B_simple's lower end: steps are noise-dominated"
            if batch < low
            else f"B = {batch} is not shown to be below B_simple"
        )
        return (
            f"**noise-aware, from the interval** {b_simple_interval(summary)}: {side}; doubling the batch to "
            f"{2 * batch} costs at most {100 * extra:.3g}% more examples per unit of progress and saves at least "
            f"{100 * saved:.3g}% of the optimizer steps (McCandlish et al. 2018, S = S_min(1 + B̂/B), "
            f"E = E_min(1 + B/B̂), at B̂ = {low:.3g}); its {'base lr' if base else 'lr'}: at least ×{gain:.3g} "
            f"(SGD-like), ×{math.sqrt(gain):.3g} (Adam-like), up to ×2 and ×{math.sqrt(2):.3g} as B̂ grows"
        )

    def _advice(self, batch: int, lr: float, group: GroupLR, noise_scale: float | None) -> LRAdvice:
        """:func:`~trainvitals.lr_scaling.rules.advise` for ``group`` at base lr ``lr``, with Adam's β and ε."""
        adam = group.family == "adam"
        return advise(
            batch,
            lr,
            group.family,
            noise_scale,
            self.target_batch_sizes,
            betas=_betas(group.group) if adam else None,
            eps=_eps(group.group) if adam else None,
        )

    def _band_line(self, batch: int) -> str:
        """What a batch below B_simple means once the run stopped in its noise band or BandSchedule acted on it (the
        last such act; ``""`` for none). In the band ‖G‖² ≤ δ·tr(Σ)/B, i.e. B_simple ≥ B/δ: near a minimum ‖G‖² → 0
        and B_simple grows without bound, so the batch advice says what a larger batch would buy, not that this one
        should have trained on (docs/science.md §3, §7: the stationary ‖G‖² ∝ η/B)."""
        entries = [entry for cb in self.vitals.providers(NOISE_BAND) for entry in cb.band_entries()]
        if not entries:
            return ""
        step, act, margin = max(entries)
        where = {
            "stop": f"the run stopped in its noise band at optimizer step {step}",
            "cut": f"BandSchedule cut the lr in its noise band at optimizer step {step}",
            "growth": f"BandSchedule grew the batch in its noise band at optimizer step {step}",
        }[act]
        at = "" if act == "growth" else f" = {batch / margin:.4g}"  # a growth's B is the one before it
        bound = (
            f"where its point estimate read ‖G‖² ≤ {margin:g}·tr(Σ)/B, B_simple ≥ B/{margin:g}{at}"
            if margin > 0
            else "where its point estimate read ‖G‖² ≤ 0, B_simple without an upper bound"
        )
        lr = next(iter(self._lrs.values()), None)  # the first advised group's, as the fit-end line names it
        what = "lr" if lr is None else lr.term
        same = f"the same {what}" if lr is None else f"the same {what}, {lr.name}'s {lr.base_said()}"
        return (
            f"{where} ({bound}): a batch below B_simple is what the band means, not a sign the run should have gone "
            f"on at this batch; to go further, take a larger batch at {same}, or a lower {what}"
        )

    def _range_line(
        self, name: str, adv: LRAdvice, batch: int, lr: float, group: GroupLR, interval: tuple[float, float]
    ) -> str:
        """Each suggested lr of ``name`` over B̂'s 90% interval (the estimate's own, ``(low, high)``)."""
        ends = [self._advice(batch, lr, group, max(end, 1e-9)) for end in interval]
        spans = [
            f"{s.label} {min(a.lr, b.lr):.3g}–{max(a.lr, b.lr):.3g}"
            for s, a, b in zip(adv.suggestions, ends[0].suggestions, ends[1].suggestions)
            if s.lr is not None and a.lr is not None and b.lr is not None
        ]
        return f"{name}: over B̂'s 90% range the suggested {group.term} spans " + (", ".join(spans) or "nothing")

    def _reduction_lines(self, groups: list[GroupLR]) -> list[str]:
        if self.loss_reduction is None or self.per_device_batch is None:
            return []
        notes: dict[str, list[str]] = {}
        for group in groups:
            note = loss_reduction_note(
                self.loss_reduction,
                group.family,
                self.per_device_batch,
                group.base,
                _eps(group.group),
                terms=self.summed_terms,
                divisor=self.loss_divided_by,
                lr_said=group.term,
            )
            notes.setdefault(note, []).append(group.name)
        divided = "" if self.loss_divided_by is None else f", each micro-batch's divided by {self.loss_divided_by:.4g}"
        head = (
            f"**loss reduction** {self.loss_reduction}{divided} (the first batch twice over gives "
            f"{self.loss_ratio:.3g}× its loss)"
        )
        return [head] + [f"{', '.join(names)}: {note}" for note, names in notes.items()]

    def _reference_lines(self, groups: list[GroupLR], batch: int, noise_scale: float | None) -> list[str]:
        """Each group's lr against the one suggested from ``reference``; the mismatches go to
        ``_reference_problems`` for the fit-start warning, a mapping naming no group to ``_reference_unmatched``."""
        self._reference_problems = []
        if self.reference is None:
            return []
        ref_batch, ref_lr = self.reference
        names = [group.name for group in groups]
        if isinstance(ref_lr, Mapping) and not set(ref_lr) & set(names):
            self._reference_unmatched = (
                f"`reference` gives the lr of {', '.join(map(repr, ref_lr))}, none of the "
                f"optimizers' parameter groups ({', '.join(map(repr, names))}): no advice "
                "from it; name the groups as the advice lists them"
            )
            return [f"**reference**: {self._reference_unmatched}."]
        lines = []
        for group in groups:
            name, family = group.name, group.family
            tuned_lr = ref_lr.get(name) if isinstance(ref_lr, Mapping) else ref_lr
            ratio = lr_ratio(ref_batch, batch, family, noise_scale)
            if tuned_lr is None or ratio is None:
                continue
            lr = group.base  # the lr the run was configured with: its scheduler's base lr
            suggested, rule = tuned_lr * ratio, rule_for(family, noise_scale)
            lines.append(
                f"**reference** {name}: tuned at batch {ref_batch} with lr {tuned_lr:.3g}; at batch {batch} "
                f"the {rule} rule suggests {suggested:.3g} (this run's {group.term} {group.base_said()})"
            )
            if batch != ref_batch and abs(lr / suggested - 1.0) > REFERENCE_TOLERANCE:
                state = "was not rescaled" if math.isclose(lr, tuned_lr, rel_tol=1e-9) else f"is {lr:.3g}"
                what = f"{group.term} ({group.set_as})" if group.moves else group.term
                self._reference_problems.append(f"{name}'s {what} {state}: the {rule} rule suggests {suggested:.3g}")
        return lines


def _validate_reference(reference: Any) -> tuple[int, float | dict[str, float]]:
    """``(batch, lr)`` checked: batch an integer ≥ 1, lr (or each value of a mapping) finite and > 0.

    TypeError for a value that is not such a pair (or holds a non-number), ValueError for one out of range.
    """
    message = (
        f"`reference` must be (effective_batch >= 1, lr > 0 or a non-empty mapping of group name (str) to "
        f"lr > 0), "
        f"got {reference!r}"
    )
    if isinstance(reference, (str, bytes)) or not isinstance(reference, Sequence) or len(reference) != 2:
        raise TypeError(message)
    batch, lr = reference
    try:
        batch = check_positive_int("reference", batch)
        if isinstance(lr, Mapping):
            if not lr:
                raise ValueError("empty mapping")
            if not all(isinstance(name, str) for name in lr):
                raise TypeError("a group name that is not a str")
            return batch, {name: check_positive("reference", value) for name, value in lr.items()}
        return batch, check_positive("reference", lr)
    except (TypeError, ValueError) as err:
        raise type(err)(message) from None


def _betas(group: Mapping[str, Any]) -> tuple[float, float] | None:
    betas = group.get("betas")
    return None if betas is None or len(betas) != 2 else (float(betas[0]), float(betas[1]))


def _eps(group: Mapping[str, Any]) -> float | None:
    eps = group.get("eps")
    return None if eps is None else float(eps)


def _loss_of(output: Any) -> Tensor:
    """The loss tensor of a ``training_step`` output (a tensor, or a mapping with ``"loss"``)."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, Tensor):
        raise TypeError(f"training_step returned {type(output).__name__}, not a loss")
    return loss.detach().reshape(())


def _doubled(batch: Any) -> Any:
    """The batch concatenated with itself along the first dimension (0-d tensors kept)."""
    return apply_to_collection(batch, Tensor, lambda t: torch.cat([t, t]) if t.dim() > 0 else t)


def _headline(adv: LRAdvice, group: GroupLR) -> str:
    """An optimizer's advice in a few words: its rule and the lr it suggests at the first larger batch, for the
    lr ``group`` is set at; under a scheduler or a factor its base lr, what that is and the lr now beside it."""
    lr = f"{group.term} {group.base_said()}"
    if adv.rule == "none":
        return f"{lr}: no scaling rule for its family (unsure); keep the {group.term} and sweep it"
    larger = [s for s in adv.suggestions if s.lr is not None and s.batch_size > adv.batch_size]
    pick = (larger or [s for s in adv.suggestions if s.lr is not None])[:1]
    if not pick:
        return f"{lr}, {adv.rule} rule"
    return f"{lr} → {pick[0].lr:.3g} at batch {pick[0].batch_size:.4g} ({adv.rule} rule)"
