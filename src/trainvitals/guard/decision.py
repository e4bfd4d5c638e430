"""TrainingGuard's decision: what a step's loss and gradient norm say, and what to do about it. Torch-only.

One optimizer step is read as a ``(4 + world_size,)`` float64 vector that every rank fills with its own
numbers and that one all-reduce (sum) makes identical on all ranks (:func:`pack`, :func:`unpack`): the
loss summed over micro-batches, the total ‖g‖₂² (already the ranks' common gradient), a count of ranks
that had a loss, the rank's gradient noise weight (:func:`~trainvitals.norms.spikes.relative_noise_weight`, from its
batches' sizes: what the spike rule allows a short batch), and one slot per rank set when that rank's own loss was
non-finite. A single process reads ``(loss, ‖g‖₂²)`` alone: whether it had a loss and its batches' sizes it knows,
and whether the loss was finite it reads from the number (fewer device operations on the step that every step
pays). Everything after runs on the host over those identical numbers — :func:`classify` with the spike rule of
:mod:`trainvitals.norms.spikes` (the winsorized EMA of :class:`~trainvitals.norms.spikes.SpikeDetector`, a short
batch's allowance), :func:`choose` with a :class:`Budget` — so every rank takes the same decision without a second
collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from trainvitals.norms.spikes import SHORT_BATCH_HINT, SpikeDetector, UsualBatch, effective_batch, norm_spike

ACTIONS = ("warn", "skip", "rollback", "stop")
"""What the guard can do about an event, mildest first: the budget escalates along this ladder."""
NONFINITE, SPIKE = "nonfinite", "spike"
KINDS = (NONFINITE, SPIKE)
"""Kinds of event: an inf/NaN loss or gradient; a loss or gradient norm far above its running average."""


@dataclass(frozen=True)
class Reading:
    """One optimizer step's numbers, the same on every rank.

    Attributes:
        loss: the step's loss (summed over micro-batches, as Lightning normalises them), averaged over the
            ranks that had one; NaN when none had.
        grad_norm: the total ‖g‖₂ of the optimizer's parameters (the averaged gradient; NaN if not finite).
        nonfinite_ranks: the ranks whose own loss was inf/NaN.
        has_loss: whether any rank had a loss this step (a ``training_step`` may return ``None``).
        world_size: the number of ranks.
        batch: the step's effective batch, in examples: the size of one batch whose mean gradient is as noisy as
            the step's (:func:`~trainvitals.norms.spikes.effective_batch`; its examples when its micro-batches are of
            one size); NaN where a batch could not be sized.
    """

    loss: float
    grad_norm: float
    nonfinite_ranks: tuple[int, ...]
    has_loss: bool = True
    world_size: int = 1
    batch: float = math.nan


def pack(
    loss: Tensor | None,
    sq_norm: Tensor | None,
    rank: int,
    world_size: int,
    device: torch.device,
    noise: float = math.nan,
) -> Tensor:
    """This rank's ``(4 + world_size,)`` float64 row (module docstring): sum it over ranks, then :func:`unpack`;
    ``(2,)`` for a single process (whose ``noise`` :func:`unpack` takes from the host).

    ``loss``: the rank's ``()`` loss or ``None`` (no backward this step); ``sq_norm``: ``()`` ‖g‖₂² or
    ``None`` (no gradient); ``noise``: its :func:`~trainvitals.norms.spikes.relative_noise_weight`. Built on ``device``
    without a host sync (the weight is a fill, not a copy).
    """
    f64 = torch.float64
    zero = torch.zeros((), dtype=f64, device=device) if loss is None or sq_norm is None else None
    if world_size == 1:
        return torch.stack([zero if t is None else t.detach().reshape(()).to(f64) for t in (loss, sq_norm)])
    if loss is None:
        loss = has = bad = zero
    else:
        loss = loss.detach().reshape(()).to(f64)
        has, bad = torch.ones_like(loss), torch.isfinite(loss).logical_not_().to(f64)
    # ‖g‖² is the same on every rank: the sum of the shares is it.
    sq = zero if sq_norm is None else sq_norm.detach().reshape(()).to(f64) / world_size
    flags = torch.zeros(world_size, dtype=f64, device=device)
    flags[rank] = bad
    weight = torch.full((), noise, dtype=f64, device=device)
    return torch.cat([torch.stack([loss, sq, has, weight]), flags])


def unpack(summed: list[float], has_loss: bool = True, noise: float = math.nan) -> Reading:
    """The :class:`Reading` of a summed :func:`pack` row, read back to the host; ``has_loss`` and ``noise``: a single
    process's, whose ``(2,)`` row holds neither (a longer row counts its ranks' own)."""
    if len(summed) == 2:
        loss, sq_norm = summed
        bad = float(has_loss and not math.isfinite(loss))
        summed = [loss if has_loss else 0.0, sq_norm, float(has_loss), noise, bad]
    loss_sum, sq_norm, with_loss, weight, *flags = summed
    return Reading(
        loss=loss_sum / with_loss if with_loss else math.nan,
        grad_norm=math.sqrt(sq_norm) if sq_norm >= 0 else math.nan,
        nonfinite_ranks=tuple(r for r, flag in enumerate(flags) if flag),
        has_loss=bool(with_loss),
        world_size=len(flags),
        batch=effective_batch(weight, len(flags)),
    )


def classify(
    reading: Reading, loss_spikes: SpikeDetector, norm_spikes: SpikeDetector, usual: UsualBatch | None = None
) -> tuple[str | None, str]:
    """The kind of event at this step (:data:`KINDS`) or ``None``, and what was seen, in words.

    Non-finite first: an inf/NaN loss (when the step had one) or gradient norm; such a
    value does not enter the detectors. Otherwise both values go through their spike detectors (a loss
    spike needs a positive loss: the rule is a ratio to its average) and a spike in either is one. For a
    batch of b below ``usual``'s B the norm's threshold is raised √(B/b) and the loss's B/b: a mean of b
    non-negative losses is at most B/b times that of any batch of B holding them, so a short batch's loss is a
    spike only where every usual batch it could have been part of would be one.
    """
    has_loss = reading.has_loss
    loss_ok = math.isfinite(reading.loss) or not has_loss
    if not (loss_ok and math.isfinite(reading.grad_norm)):
        what = "loss" if not loss_ok else "gradient"
        shown = reading.nonfinite_ranks and reading.world_size > 1
        ranks = f" (on rank(s) {', '.join(map(str, reading.nonfinite_ranks))})" if shown else ""
        return NONFINITE, f"non-finite {what}{ranks}: loss {reading.loss:.4g}, ‖g‖ {reading.grad_norm:.4g}"
    spikes = []
    shorter = usual.ratio(reading.batch) if usual is not None else 1.0  # before the norm counts the batch
    average = loss_spikes.average
    limit = loss_spikes.threshold(shorter) / average if average > 0.0 else math.inf
    if has_loss and (ratio := loss_spikes.update(reading.loss, shorter)) is not None:
        allowed = (
            f" (a batch of {reading.batch:.4g} examples against the usual {reading.batch * shorter:.4g}: beyond "
            f"the {limit:.3g}× its examples allow; {SHORT_BATCH_HINT})"
            if shorter > 1.0
            else ""
        )
        spikes.append(
            f"loss {reading.loss:.4g} is {ratio:.1f}× its running average{loss_spikes.spread_words()}{allowed}"
        )
    if (found := norm_spike(reading.grad_norm, reading.batch, norm_spikes, usual)) is not None:
        ratio, short = found
        spikes.append(
            f"‖g‖ {reading.grad_norm:.4g} is {ratio:.1f}× its running average{norm_spikes.spread_words()}{short}"
        )
    return (SPIKE, "spike: " + "; ".join(spikes)) if spikes else (None, "")


class Budget:
    """How many skips and rollbacks a window of optimizer steps allows before the guard escalates.

    After ``events`` actions at or above a level (skip, then rollback) within the last ``window`` steps,
    the next event gets the next action of :data:`ACTIONS`: a skip becomes a rollback, a rollback a
    stop. Warnings and stops are not spent. Bounded: at most ``events`` steps kept per level.
    """

    def __init__(self, events: int, window: int) -> None:
        self.events, self.window = events, window
        self.spent: list[tuple[int, str]] = []  # (optimizer step, action), oldest first

    def _recent(self, step: int) -> list[tuple[int, str]]:
        return [(s, a) for s, a in self.spent if step - s < self.window]

    def escalate(self, action: str, step: int) -> str:
        """``action`` raised one level for every level whose budget is spent at ``step``."""
        recent = self._recent(step)
        level = ACTIONS.index(action)
        while 0 < level < len(ACTIONS) - 1:
            if sum(ACTIONS.index(a) >= level for _, a in recent) < self.events:
                break
            level += 1
        return ACTIONS[level]

    def spend(self, action: str, step: int) -> None:
        """Record a skip or rollback taken at ``step`` (others are not spent)."""
        if action in ("skip", "rollback"):
            kept = self._recent(step) + [(step, action)]
            # ``events`` per level suffice to decide; older ones can go.
            self.spent = [e for i, e in enumerate(kept) if sum(a == e[1] for _, a in kept[i:]) <= self.events]

    def state_dict(self) -> dict[str, Any]:
        return {"spent": [[s, a] for s, a in self.spent]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.spent = [(int(s), str(a)) for s, a in state.get("spent", [])]


def choose(kind: str, actions: dict[str, str], budget: Budget, step: int, has_snapshot: bool) -> str:
    """The action for an event of ``kind`` at ``step``: the configured one, escalated by the budget, then
    spent. Without a snapshot yet (the first steps went wrong) a rollback is a skip, and one escalated
    from spent skips a stop: there is nothing to roll back to."""
    action = budget.escalate(actions[kind], step)
    if action == "rollback" and not has_snapshot:
        action = "skip" if actions[kind] == "rollback" else "stop"
    budget.spend(action, step)
    return action
