"""Per-module gradient signal-to-noise ratios and the EB criterion, within a coordinate budget.

A module's GSNR is the mean over its coordinates d of ḡ_d²/σ̂_d² (Liu et al. 2020), from the
per-coordinate sums Σ_i g_i and Σ_i g_i² (:func:`~trainvitals.noise.estimators.gradient_snr_sum`). Those sums
are float64 (the variance of nearly equal float32 gradients cancels in float32 sums) and cost 16 bytes a
coordinate: a logging step collects them for at most ``budget`` coordinates of the
per-example-norm parameters, whole rows of dimension 0, and successive logging steps take successive
rows in the parameters' order (a *pass* over a module spans the logging steps from its first row to its
last). A sub-batch's parameters (torch.func) have their sums at every logging step. The EB criterion
(Mahsereci et al. 2017, Eq. 7) is one step's sum over every measured coordinate: only when a step has
them all. Nothing here syncs with the host but :meth:`ModuleCoordinates.complete_passes`, on host floats.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from trainvitals.noise.estimators import eb_criterion_of_snr_sums, gradient_snr_sum

EB_CRITERION = "grad_noise/eb_criterion"
GSNR_TAG = "grad_noise/gsnr/"  # + the module's qualified name

# Per GSNR key, what one step's sums hold: (coordinates, whether they start the module's pass, whether they end it).
StepCoordinates = dict[str, tuple[int, bool, bool]]


def _precision(parameter: Tensor) -> torch.dtype:
    """The dtype a parameter's per-example gradients are formed in (float32 under half-precision autocast
    too): its eps floors their variance, whatever the dtype of their sums."""
    return torch.float64 if parameter.dtype == torch.float64 else torch.float32


def gsnr_key(parameter: str) -> str:
    """The GSNR tag of a parameter's module (qualified names)."""
    return GSNR_TAG + (parameter.rpartition(".")[0] or "(root)")


@dataclass
class ModuleCoordinates:
    """The coordinates each module's GSNR is over, and how a logging step selects them.

    Attributes:
        per_example: the per-example-norm parameters by qualified name, whose sums the budget bounds.
        sub_batch: the sub-batch (torch.func) parameters, whose sums come whole at every logging step.
        budget: per-coordinate sums per logging step over ``per_example`` (≥ 1).
    """

    per_example: dict[str, Tensor]
    sub_batch: dict[str, Tensor]
    budget: int

    def __post_init__(self) -> None:
        self.coordinates: dict[str, int] = {}  # per GSNR key: its parameters' coordinates
        self.bounds: dict[str, tuple[str, str]] = {}  # per GSNR key: its first and last parameter
        for name, p in {**self.per_example, **self.sub_batch}.items():
            if p.numel():
                key = gsnr_key(name)
                self.coordinates[key] = self.coordinates.get(key, 0) + p.numel()
                self.bounds[key] = (self.bounds.get(key, (name,))[0], name)
        self.per_example_coordinates = sum(p.numel() for p in self.per_example.values())

    def budget_note(self) -> str:
        """What the budget leaves out, said once at fit start ("" within it)."""
        coordinates = self.per_example_coordinates
        if coordinates <= self.budget:
            return ""
        return (
            f"per-coordinate sums of {self.budget:,} of the {coordinates:,} coordinates per logging step: each "
            f"layer's GSNR is logged once a pass over its rows ends (a pass: {math.ceil(coordinates / self.budget)} "
            f"logging steps), the EB criterion not at all; coordinate_budget={coordinates} would log it at every "
            f"logging step, holding {32 * coordinates / 2**20:,.1f} MiB of sums while they are added up"
        )

    def select(self, cursor: int) -> tuple[dict[str, slice], int]:
        """The rows (dimension 0) of the per-example-norm parameters whose sums a logging step collects,
        and the next step's cursor: all of them within the budget; otherwise whole rows from ``cursor``
        (a coordinate) on until the budget is reached, rounded up to a whole row, back to the first
        parameter after the last."""
        params = {n: p for n, p in self.per_example.items() if p.numel()}
        if self.per_example_coordinates <= self.budget:
            return {n: slice(None) for n in params}, cursor
        cursor = cursor if cursor < self.per_example_coordinates else 0
        selection, left, offset = {}, self.budget, 0
        for name, p in params.items():
            offset += p.numel()
            if offset <= cursor:
                continue
            rows, row_size = p.shape[0], p.numel() // p.shape[0]
            first = max(cursor - (offset - p.numel()), 0) // row_size
            take = min(rows - first, -(-left // row_size))
            selection[name] = slice(first, first + take)
            left -= take * row_size
            if left <= 0:
                return selection, offset - p.numel() + (first + take) * row_size
        return selection, 0

    def selected_sums(
        self,
        selection: dict[str, slice],
        grad_sum: dict[str, Tensor],
        sum_sq: dict[str, Tensor],
        reduce: Callable[[Tensor], Tensor] | None = None,
    ) -> tuple[list[Tensor], list[Tensor]]:
        """Σ_i g_i and Σ_i g_i² of each selected parameter, in the selection's order, zeros where a step
        has none (a layer that failed: every rank must join the same collective); summed by ``reduce``
        (over ranks) in one call on their concatenation."""

        def zeros(name: str) -> Tensor:
            return torch.zeros_like(self.per_example[name][selection[name]], dtype=torch.float64)

        grad_sums = [grad_sum[n] if n in grad_sum else zeros(n) for n in selection]
        sum_sqs = [sum_sq[n] if n in sum_sq else zeros(n) for n in selection]
        if not selection or reduce is None:
            return grad_sums, sum_sqs
        parts = grad_sums + sum_sqs
        flat = reduce(torch.cat([v.flatten() for v in parts]))
        parts = [f.view_as(v) for f, v in zip(flat.split([v.numel() for v in parts]), parts)]
        return parts[: len(selection)], parts[len(selection) :]

    def snr_sums(
        self,
        selection: dict[str, slice],
        grad_sums: list[Tensor],
        sum_sqs: list[Tensor],
        examples: int,
        sub_grad_sum: dict[str, Tensor],
        sub_sum_sq: dict[str, Tensor],
        num_sub: int,
    ) -> tuple[dict[str, Tensor], StepCoordinates]:
        """Σ_d GSNR_d per module over one step's coordinates (``()`` float64 each, by GSNR key), with
        :data:`EB_CRITERION` when they are all the measured ones, and what each module's sum covers.

        ``grad_sums``/``sum_sqs``: over ``examples`` examples, of the ``selection``
        (:meth:`selected_sums`); ``sub_*``: over the ``num_sub`` examples of a sub-batch (left out below 2).
        """
        snr = [
            gradient_snr_sum(g, s, examples, _precision(self.per_example[n]))
            for n, g, s in zip(selection, grad_sums, sum_sqs)
        ]
        counts, sizes, rows = [examples] * len(snr), [g.numel() for g in grad_sums], dict(selection)
        whole = sum(sizes) == self.per_example_coordinates
        if num_sub >= 2:
            for name, value in sub_sum_sq.items():
                snr.append(gradient_snr_sum(sub_grad_sum[name], value, num_sub, _precision(self.sub_batch[name])))
                counts.append(num_sub)
                sizes.append(value.numel())
                rows[name] = slice(None)
        out: dict[str, Tensor] = {}
        step: StepCoordinates = {}
        for (name, r), snr_sum, size in zip(rows.items(), snr, sizes):
            # A module's pass starts with its first parameter's first row and ends with its last one's last.
            key = gsnr_key(name)
            head, tail = self.bounds[key]
            first = name == head and r.start in (None, 0)
            last = name == tail and (r.stop is None or r.stop >= self.per_example[name].shape[0])
            before = step.get(key)
            out[key] = snr_sum if before is None else out[key] + snr_sum
            step[key] = (size, first, last) if before is None else (before[0] + size, before[1], last)
        if whole and snr:
            out[EB_CRITERION] = eb_criterion_of_snr_sums(snr, counts, sum(sizes))
        return out, step

    def complete_passes(
        self, values: dict[str, float], step: StepCoordinates, partial: dict[str, tuple[float, int]]
    ) -> tuple[dict[str, float], dict[str, tuple[float, int]]]:
        """``values`` (host floats) with each module's GSNR sum replaced by its mean over the module at the
        step that ends the module's pass, and left out before that; and the passes still open (Σ GSNR and
        coordinates so far, from ``partial``). A pass that lost a step (a value missing or not finite) or
        that did not start in ``partial`` is not logged."""
        values, partial = dict(values), dict(partial)
        for key, (size, first, last) in step.items():
            value = values.pop(key, math.nan)
            total, count = (0.0, 0) if first else partial.pop(key, (math.nan, 0))
            total, count = total + value, count + size
            if not last:
                partial[key] = (total, count)
            elif math.isfinite(total) and count == self.coordinates[key]:
                values[key] = total / count
        return values, partial
