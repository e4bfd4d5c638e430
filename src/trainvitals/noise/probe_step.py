"""One measured optimizer step of BatchVarianceProbe, top to bottom: its micro-batches, what keeps it from being
used, its sums over the ranks, the units of its ``.grad``, and its estimate of ‖G‖² and tr(Σ), each source's over
its own parameters (McCandlish et al. 2018, Eq. A.2); then what it logs.

:class:`ProbeStep` is opened at a measured step's first micro-batch, fed by each micro-batch's hooks, and finished
by one call in ``on_before_optimizer_step`` (:meth:`ProbeStep.finish`); the probe logs what it leaves at
``on_train_batch_end``, once every source of the run's estimate has taken the step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from trainvitals.noise.estimators import (
    per_example_estimates,
    sub_batch_estimates,
    sub_batch_mean_sq_norm,
    two_batch_size_estimates,
)
from trainvitals.noise.gsnr import ModuleCoordinates, StepCoordinates
from trainvitals.noise.outliers import Outliers, largest_examples
from trainvitals.noise.probe_sources import BATCHNORM_MIN_VALUES, COUPLED, SOURCES, ProbeSources
from trainvitals.per_example import PerExampleStep, SourcePlan
from trainvitals.plumbing.amp import loss_scale, scale_left_in_grads
from trainvitals.plumbing.batch import batch_size, dataset_rows, loss_divisor
from trainvitals.plumbing.sharing import StepGradNorms
from trainvitals.plumbing.state import reduce_packed
from trainvitals.plumbing.writers import log_histogram, log_text
from trainvitals.text.prose import by_reason, grouped

if TYPE_CHECKING:
    from trainvitals.noise.probe import BatchVarianceProbe

PER_EXAMPLE_NORMS, OUTLIERS = "grad_noise/per_example_grad_norm", "grad_noise/outliers"


@dataclass
class StepSums:
    """An optimizer step's sums over the examples of every rank."""

    sq_norm_sum: Tensor  # () Σ_i ‖g_i‖² of the per-example-norm layers, own-loss units
    micro_sum: Tensor  # () Σ_j ‖g_j‖² of the micro-batch gradients, as back-propagated
    examples: int
    valid: Tensor | bool  # every rank measured all its examples
    failed: set[str]  # layers to exclude from now on
    aside: Tensor | None = None  # (layers,) bool: those this step is measured without, the same on every rank


@dataclass
class Finished:
    """What a finished step leaves for the probe's ``on_train_batch_end``: its log (at a logging step) and the
    layers to move out of the per-example sources."""

    result: PerExampleStep
    valid: Tensor | bool
    examples: int  # over all ranks
    measured: bool  # the estimate was updated from it
    failed: set[str]  # layers to exclude from now on
    aside: set[str]  # of those, the ones this step was measured without


class ProbeStep:
    """One measured optimizer step, read top to bottom: opened at its first micro-batch (the plan's hooks
    attached), fed by each micro-batch (:meth:`begin_micro_batch`, :meth:`set_unit`, :meth:`end_micro_batch`),
    finished by one call in ``on_before_optimizer_step`` (:meth:`finish`).

    Args:
        step: the optimizer step.
        sources: the plan's sources and their hooks.
        selection: the coordinates whose per-coordinate sums it collects (GSNR, the sums check).
        keep_norms: keep each example's ‖g_i‖² (a histogram step), and the micro-batches' dataset rows.
        logging: a logging step.
        decide: decide 1-D ids on the host at this step (a step that syncs anyway).
        check_sums: check that the per-example gradients of the ``selection`` add up to ``.grad``.
    """

    def __init__(
        self,
        step: int,
        sources: ProbeSources,
        selection: dict[str, slice],
        keep_norms: bool,
        logging: bool,
        decide: bool,
        check_sums: bool = False,
    ) -> None:
        self.step, self.sources, self.selection = step, sources, selection
        self.keep_norms, self.logging, self.decide, self.check_sums = keep_norms, logging, decide, check_sums
        self.sizes: list[int] = []  # the examples of each micro-batch that ran backward
        self.unsized = False  # one of them Lightning cannot size
        self.misbatched = False  # one whose loss reduces rows that are not its examples as Lightning counts them
        self.rows: list[Tensor | None] = []  # their dataset rows, on the steps that keep norms
        self.batch_size = 0  # the current micro-batch's examples (0: unsized or empty)
        self.unit: Tensor | float = 1.0  # its back-propagated gradient over the mean of its examples' own-loss ones
        self.reduction = "mean"
        sources.attach(selection, keep_norms=keep_norms)

    @property
    def size(self) -> int:
        """The first micro-batch's examples; 1 for an empty one, in a step left out anyway."""
        return self.sizes[0] or 1

    # ------------------------------------------------------------------ each micro-batch
    def begin_micro_batch(self, trainer: "pl.Trainer", batch: Any, batch_idx: int, sequence_first: bool | None) -> None:
        collector = self.sources.collector
        collector.begin_micro_batch()  # a batch skipped before (training_step returned None) left its forward
        size = batch_size(batch, sequence_first)
        self.unsized |= size is None
        self.batch_size = size or 0
        if size:
            collector.expect_batch(size, batch)
        if self.keep_norms:
            self.rows.append(dataset_rows(trainer, batch, batch_idx, size) if size else None)

    def set_unit(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", reduction: str) -> None:
        """The micro-batch's loss is a ``reduction`` over its examples: per-example gradients are those of each
        example's own loss, B × its share of a mean, or of a ``"scaled"`` sum (a sum over a count that is not B:
        as a mean, so that they average to the step's gradient); Lightning's division by the accumulation and the
        AMP loss scale undone."""
        self.reduction = reduction
        scale = loss_scale(trainer)
        per_loss = 1 if reduction == "sum" else self.batch_size
        self.unit = loss_divisor(trainer, pl_module) * per_loss / (1.0 if scale is None else scale)

    def end_micro_batch(self) -> None:
        self.sources.collector.end_micro_batch(self.unit)
        self.sources.micro.end_micro_batch()
        self.sizes.append(self.batch_size)

    # ------------------------------------------------------------------ the step
    def finish(
        self,
        probe: BatchVarianceProbe,
        trainer: "pl.Trainer",
        pl_module: "pl.LightningModule",
        optimizer: torch.optim.Optimizer,
    ) -> Finished:
        """Close the step, update ``probe``'s noise source from it, say what is wrong with it (once each), and
        return what the probe logs and moves at ``on_train_batch_end``.

        Measured even when this rank saw a problem: every rank must join the same all-reduce, which also says
        which layers failed on any rank, so that every rank excludes the same ones. A layer set aside is measured
        as the next plan will: its parameters among those not measured per example.
        """
        sources, source = self.sources, probe.noise_source
        result = sources.collector.pop(decide=False)
        notes, refuted = sources.collector.layouts.notes()
        if refuted:  # the layout earlier steps were measured with was wrong: the estimate restarts without them
            source.restart()
        for note in notes:
            probe.warn(note + ".", once=True)
        if self.decide or result.sq_norms:
            # 1-D ids compared with arange(B) on the device, read at a step that syncs anyway (else: `sum_over_ranks`)
            sources.collector.decide(result)
        micro_sum, _ = sources.micro.pop()
        sources.detach()
        self._check_sums(trainer, pl_module, result, optimizer)
        if few := self._few_batchnorm_values(trainer.accumulate_grad_batches):
            probe.warn(few, once=True)
        if coupled := sources.coupling():
            if not source.invalid:
                probe.warn(sources.coupling_warning(coupled) + ".", once=True)
            source.invalidate(COUPLED)
        problem, aside = self._problem(result)
        # An epoch's ragged last window is left out without a word, as the stopper leaves it out: no fault of
        # the run's. Failed layers are said where they are moved.
        ragged_end = trainer.is_last_batch and problem == unequal_sizes(self.sizes)
        if problem and set(result.failed) <= aside and not ragged_end:
            probe._cannot_measure(problem)
        probe._failed.update(result.failed)
        if not self.sizes:
            failed = set(probe._failed) if trainer.world_size == 1 else set()
            return Finished(result, False, 0, False, failed, set() if problem else aside)
        sums = sum_over_ranks(
            trainer,
            result,
            micro_sum,
            self.sizes,
            not problem,
            sources.layers,
            set(probe._failed),
            aside,
            read_failures=self.logging,
        )
        moved_aside = set() if problem else aside
        if sums.examples < 2:
            probe._cannot_measure("a step of 1 example has no spread to measure")
            return Finished(result, False, sums.examples, False, sums.failed, moved_aside)
        to_mean = 1 / self.grad_units(trainer, pl_module)
        parts = self._batch_sq_norms(trainer, probe.vitals.grad_norms, optimizer, sums.aside)
        batch_sq = {part: sq_norm * to_mean**2 for part, sq_norm in parts.items()}
        grad_sq_norm, trace_cov, valid, covered, total = step_estimates(
            sources.plan,
            batch_sq,
            result,
            sums,
            len(self.sizes) * trainer.world_size,
            self.size,
            self.unit,
            aside,
        )
        source.update(grad_sq_norm, trace_cov, valid, covered, total)
        probe.nonfinite.add(torch.isfinite(total))
        source.read_sampler(  # estimate.py, rules 6 and 9
            trainer.train_dataloader, trainer.num_training_batches, trainer.accumulate_grad_batches, trainer.world_size
        )
        whole = not pl_module.automatic_optimization or len(self.sizes) == trainer.accumulate_grad_batches
        # Judged at the run's regular batch, as the stopper: an epoch's short last batch does not change it.
        batch = source.effective_batch_size
        short = trainer.is_last_batch and batch is not None and sums.examples < batch
        if (whole and not short) or batch is None:
            source.effective_batch_size = sums.examples
            source.unit_scale = self.grad_units(trainer, pl_module)
        return Finished(result, valid, sums.examples, True, sums.failed, moved_aside)

    def grad_units(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> float:
        """The step's ``.grad`` over the mean of its per-example gradients: the accumulated, rank-averaged,
        unscaled ``.grad`` of n micro-batches of b is (n/A)·ḡ for a mean (or scaled) loss and (n·b/A)·ḡ for a sum."""
        per_loss = self.size if self.reduction == "sum" else 1
        return len(self.sizes) * per_loss / loss_divisor(trainer, pl_module)

    def _check_sums(
        self,
        trainer: "pl.Trainer",
        pl_module: "pl.LightningModule",
        result: PerExampleStep,
        optimizer: torch.optim.Optimizer,
    ) -> None:
        """On a step that checks its per-coordinate sums, fail the layers whose per-example gradients do not add up
        to their ``.grad``: on one device (ranks average ``.grad``), with all micro-batches measured and of one size."""
        if not self.check_sums or not result.grad_sum or not self._whole_window(trainer, pl_module):
            return
        to_grad: Tensor | float = self.grad_units(trainer, pl_module) / sum(self.sizes)
        scale = scale_left_in_grads(trainer, optimizer)
        result.failed.update(self.sources.collector.unbalanced(result, to_grad if scale is None else scale * to_grad))

    def _whole_window(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> bool:
        """Whether ``.grad`` is the mean of these micro-batches alone: all of an accumulation window, sized and
        equal, on one device (the ``.grad`` of several is averaged over ranks), under automatic optimization."""
        return (
            trainer.world_size == 1
            and not self.unsized
            and len(set(self.sizes)) == 1
            and 0 not in self.sizes
            and len(self.sizes) == trainer.accumulate_grad_batches
            and pl_module.automatic_optimization
        )

    def _few_batchnorm_values(self, accumulate: int) -> str:
        """The warning for BatchNorms that normalise over too few values at this step, or ""."""
        small = {n: v for n, v in self.sources.bn_values.items() if v < BATCHNORM_MIN_VALUES}
        if not small:
            return ""
        where = ", ".join(f"{n} ({v} values per channel)" for n, v in small.items())
        accumulation = (
            f" Under gradient accumulation BatchNorm sees one micro-batch of {self.batch_size}, "
            f"not the {self.batch_size * accumulate} examples of the step."
            if accumulate > 1
            else ""
        )
        return (
            f"BatchNorm in training mode normalises {where} over too few values for meaningful statistics: "
            "over 2 values every feature becomes ±1, over 1 it fails." + accumulation
        )

    def _problem(self, result: PerExampleStep) -> tuple[str, set[str]]:
        """Why this step's measurement is unusable ("" if it is), and the failed layers it is measured without
        (:meth:`~trainvitals.per_example.PerExampleGradients.set_aside`: their parameters count as not
        measured, as they will from the next plan on; none when nothing would be left); failed modules are
        added to ``result.failed``. A batch read on the wrong dimension
        (:meth:`~trainvitals.per_example.Layouts.misread`) is the step's problem, and no layer's: none is failed
        for it."""
        sources, sizes = self.sources, self.sizes
        if not sizes:  # no backward ran (training_step returned None): nothing to measure, no fault
            return "", set()
        if misread := sources.collector.layouts.misread():  # every layer failing so is the batch's fault
            result.failed.clear()
            return misread, set()
        if self.misbatched:  # every layer failing so is the batch's fault, as a misread one
            result.failed.clear()
            return (
                "the loss reduces a number of rows that is not a multiple of the batch's examples as Lightning counts "
                "them (the first dimension of the batch's first tensor): the examples are not that tensor's rows (a "
                "graph batch led by its nodes?), and no per-example number would be right. Put a tensor with one row "
                "per example first in the batch (the targets: `(y, x, ...)`, or first in a dict)"
            ), set()
        for name, module in {**sources.plan.per_example, **sources.plan.vmap}.items():
            if (
                name not in result.seen
                and name not in result.failed
                and any(p.grad is not None for p in module.parameters(recurse=False))
            ):
                result.failed[name] = (
                    "its parameters got gradients outside its own forward (used directly, or "
                    "called from a torch.compile'd function, where the probe puts no hook)"
                )
        aside = sources.collector.set_aside(result)
        if not sources.plan.micro_batch and aside.issuperset(sources.layers):
            aside = set()  # no layer left to measure the step
        failed = {n: why for n, why in result.failed.items() if n not in aside}
        if failed:
            named = {n or "(root)": why for n, why in failed.items()}
            return "; ".join(f"{grouped(ns, 'module')}: {why}" for why, ns in by_reason(named).items()), aside
        if self.unsized:
            return (
                "Lightning cannot tell how many examples a batch holds (extract_batch_size fails on it), or the "
                "batch holds a list of tensors of differing lengths with no tensor of a row per example beside it: "
                "put the examples on dimension 0 of the batch's tensors, or pass the list's labels with it"
            ), aside
        if 0 in sizes:
            return "an empty micro-batch", aside
        if set(sources.layers) - aside and not result.seen:
            return "the backward reached none of the measured layers (a loss without a graph?)", aside
        if len(set(sizes)) > 1:
            return unequal_sizes(sizes), aside
        return "", aside

    def _batch_sq_norms(
        self, trainer: "pl.Trainer", grad_norms: StepGradNorms, optimizer: torch.optim.Optimizer, aside: Tensor | None
    ) -> dict[str, Tensor]:
        """‖.grad‖² over each source's parameters and over the optimizer's others (``"other"``, with those of
        the layers ``aside`` marks, a ``(layers,)`` bool on the device): the accumulated, rank-averaged gradient,
        AMP scale undone (0-d float64 each), from the step's one pass over the gradients (``grad_norms``, shared
        with GradNormMonitor and the stopper), summed by source (:meth:`ProbeSources.norm_layout`)."""
        params, where, whole, layer_of = self.sources.norm_layout(optimizer)
        zero = torch.zeros((), dtype=torch.float64, device=trainer.strategy.root_device)
        if whole is not None and aside is None:  # one source measures every parameter: its part is the total
            total = grad_norms.sq_norm(trainer, optimizer, params)
            return {**dict.fromkeys((*SOURCES, "other"), zero), whole: zero if total is None else total}
        sq_norms = grad_norms.sq_norms(trainer, optimizer, params) if params else None
        parts = zero.new_zeros(len(SOURCES) + 1)
        if sq_norms is not None:
            if aside is not None:  # a layer's position len(layers) (source 2, or none) is never aside
                outside = torch.cat([aside, aside.new_zeros(1)]).to(where.device)[layer_of]
                where = torch.where(outside, len(SOURCES), where)
            parts = parts.to(sq_norms.device).index_add_(0, where.to(sq_norms.device), sq_norms)
        return dict(zip((*SOURCES, "other"), parts.unbind()))


def sum_over_ranks(
    trainer: "pl.Trainer",
    result: PerExampleStep,
    micro_sum: Tensor | None,
    sizes: list[int],
    valid_here: bool,
    layers: list[str],
    failed_here: set[str],
    aside_here: set[str],
    read_failures: bool,
) -> StepSums:
    """This step's sums: this rank's on one process; under DDP every rank's, in one collective.

    ``sizes``: the examples of this rank's micro-batches; ``layers``: the per-example and torch.func
    layers, of which ``failed_here`` failed on this rank and ``aside_here`` failed at this step without a
    trace in its sums (``valid_here`` does not count them). A layer can fail on one rank only (a branch
    taken by some ranks' data): the collective also counts each layer's failures over the ranks, read
    when ``read_failures`` (a logging step, which syncs anyway); until then a failure on any rank
    invalidates the steps, except one set aside on every rank: the step is measured without that layer.
    On one process, a failure here is excluded at once. A lookup whose ids are still compared with
    ``arange(B)`` on the device (``result.undecided``, decided at a logging step) counts as failed where
    they were, without a read, and is set aside on the device unless some of its statistics were counted.
    """
    device = trainer.strategy.root_device
    zero = torch.zeros((), dtype=torch.float64, device=device)
    sq_norm_sum = (result.sq_norm_sum if result.sq_norm_sum is not None else zero).to(device, torch.float64)
    micro_sum = (micro_sum if micro_sum is not None else zero).to(device, torch.float64)
    local_examples = sum(sizes)
    undecided = {n: shared.to(device) for n, shared in result.undecided.items() if n not in failed_here}
    counted = [undecided[n] & c.to(device) for n, c in result.undecided_counted.items() if n in undecided]
    valid: Tensor | bool = valid_here
    if counted and valid_here:
        valid = ~torch.stack(counted).any()
    aside = None
    if aside_here or undecided or trainer.world_size > 1:
        aside = torch.zeros(len(layers), dtype=torch.bool, device=device)  # filled on the device: no copy
        for i, name in enumerate(layers):
            if name in aside_here:
                aside[i] = True
            elif name in undecided:
                aside[i] = undecided[name]
    if trainer.world_size == 1:
        return StepSums(sq_norm_sum, micro_sum, local_examples, valid, set(failed_here), aside)
    flags = torch.zeros(len(layers), dtype=torch.float64, device=device)
    for i, name in enumerate(layers):
        if name in failed_here:
            flags[i] = 1.0
        elif name in undecided:
            flags[i] = undecided[name].double()
    invalid_here = (
        (~valid).double()
        if isinstance(valid, Tensor)
        else torch.full((), 0.0 if valid else 1.0, dtype=torch.float64, device=device)
    )
    sq, micro, seen, invalid, counts, asides = reduce_packed(
        trainer,
        [
            sq_norm_sum,
            micro_sum,
            torch.full((), float(local_examples), dtype=torch.float64, device=device),
            invalid_here,
            flags,
            aside.double(),
        ],
    )
    examples = local_examples * trainer.world_size
    failed = set()
    if read_failures and layers:
        failed = {n for n, count in zip(layers, counts.tolist()) if count > 0}
    everywhere = asides == trainer.world_size  # set aside on some ranks only: those ranks' sums lack what others hold
    agreed = ~((asides > 0) & ~everywhere).any()
    return StepSums(sq, micro, examples, (invalid == 0) & (seen == examples) & agreed, failed, everywhere)


def step_estimates(
    plan: SourcePlan,
    batch_sq: dict[str, Tensor],
    result: PerExampleStep,
    sums: StepSums,
    groups: int,
    group_size: int,
    unit: Tensor | float,
    aside: set[str],
) -> tuple[Tensor, Tensor, Tensor | bool, Tensor, Tensor]:
    """``(‖G‖², tr(Σ), valid, ‖ḡ‖² measured, ‖ḡ‖² all)`` of the step in per-example units.

    Each source's estimate over its own parameters, added up, since tr(Σ) and ‖G‖² are sums over
    parameters. ``batch_sq``: ‖ḡ‖² in per-example units over each source's parameters and the others'
    (:meth:`ProbeStep._batch_sq_norms`, with the layers set aside among the others); ``groups``
    micro-batches of ``group_size`` examples over all ranks, whose back-propagated gradients are ``unit`` ×
    the mean of their examples' own-loss gradients; ``aside``: the layers this step is measured without (a
    torch.func source with all of them aside has no sub-batch, and nothing to measure).
    """
    estimates, valid = [], sums.valid
    if plan.per_example:
        estimates.append(per_example_estimates(sums.sq_norm_sum, batch_sq["per_example"], sums.examples))
    if plan.micro_batch and groups < 2:  # an epoch's last accumulation window can hold one micro-batch
        valid = False
    elif plan.micro_batch:
        group_mean = sums.micro_sum * (unit / group_size) ** 2 / groups
        estimates.append(two_batch_size_estimates(group_mean, batch_sq["micro_batch"], groups, group_size))
    vmap = set(plan.vmap) - aside
    if vmap and result.num_sub < 2:
        valid = False
    elif vmap:
        sub_mean_sq = sub_batch_mean_sq_norm(list(result.sub_grad_sum.values()), result.num_sub)
        estimates.append(
            sub_batch_estimates(
                result.sub_sq_norm_sum.double(),
                sub_mean_sq,  # type: ignore[union-attr]
                result.num_sub,
                batch_sq["vmap"],
                sums.examples,
            )
        )
    covered = batch_sq["per_example"] + batch_sq["micro_batch"] + batch_sq["vmap"]
    total = covered + batch_sq["other"]
    if not estimates:
        zero = torch.zeros((), dtype=torch.float64, device=sums.sq_norm_sum.device)
        return zero, zero, valid, covered, total
    grad_sq_norm, trace_cov = (functools.reduce(torch.add, parts) for parts in zip(*estimates))
    return grad_sq_norm, trace_cov, valid, covered, total


def coordinate_stats(
    trainer: "pl.Trainer",
    coordinates: ModuleCoordinates,
    selection: dict[str, slice],
    result: PerExampleStep,
    examples: int,
    left_out: set[str],
) -> tuple[dict[str, Tensor], StepCoordinates]:
    """Σ_d GSNR_d per module over this step's ``selection`` of coordinates, :data:`~trainvitals.noise.gsnr.EB_CRITERION` when they are
    all the measured ones (:meth:`ModuleCoordinates.snr_sums`), over every rank's examples; without the
    parameters ``left_out`` (of layers failed on some rank, the same on every rank), which have no sums."""
    # Zeros where this rank has no sums (a layer failed here only): the ranks' collectives must match; the
    # step is invalid.
    selection = {q: rows for q, rows in selection.items() if q not in left_out}
    selection = selection if result.sum_sq or trainer.world_size > 1 else {}
    reduce = (lambda flat: trainer.strategy.reduce(flat, reduce_op="sum")) if trainer.world_size > 1 else None
    grad_sums, sum_sqs = coordinates.selected_sums(selection, result.grad_sum, result.sum_sq, reduce)
    return coordinates.snr_sums(
        selection, grad_sums, sum_sqs, examples, result.sub_grad_sum, result.sub_sum_sq, result.num_sub
    )


def log_per_example_norms(
    trainer: "pl.Trainer", sq_norms: list[Tensor], rows: list[Tensor | None], top_k: int, coverage: str, step: int
) -> Outliers | None:
    """The histogram :data:`PER_EXAMPLE_NORMS` of a step's ‖g_i‖ (each micro-batch's ``(b,)`` ‖g_i‖² in
    ``sq_norms``, over the parameters ``coverage`` says) and, with ``top_k`` ≥ 1, the panel :data:`OUTLIERS` of
    the largest, by ``rows`` where known; returns those."""
    norms = torch.cat(sq_norms).clamp_min(0.0).sqrt()
    log_histogram(trainer, PER_EXAMPLE_NORMS, norms, step, f"Each example's gradient norm ‖g_i‖, {coverage}.")
    if top_k == 0:
        return None
    outliers = largest_examples(norms, rows, top_k, coverage)
    log_text(trainer, OUTLIERS, outliers.markdown(step), step)
    return outliers


def unequal_sizes(sizes: list[int]) -> str:
    """The problem of a step whose micro-batches differ in size (an epoch's ragged last window, most often)."""
    return f"micro-batches of unequal sizes {sizes}"
