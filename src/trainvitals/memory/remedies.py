"""Ways to lower a step's memory, ranked by the bytes they take off its peak.

Each remedy is a rule in :data:`REMEDY_RULES`, added with :func:`register_remedy`: a function of the
step's :class:`~trainvitals.memory.categories.StepMemory` and ``top_k`` that returns its
:class:`Remedy` entries. :func:`rank_remedies` runs every rule and ranks what they return.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainvitals.memory.categories import StepMemory, warn_failure_once
from trainvitals.memory.checkpointing import checkpoint_peak, checkpoint_savings, whole_forward_modules
from trainvitals.memory.recorder import ROOT, SavedTensorReport
from trainvitals.memory.storage import format_bytes


def mixed_precision_savings(report: SavedTensorReport) -> int:
    """Bytes freed if every float32 activation saved outside ``torch.autocast`` were kept in 16 bits: half
    their bytes. Those saved under autocast are float32 on purpose (softmax, norms, losses).

    An upper bound: autocast keeps some ops in fp32 and adds 16-bit copies of the weights it casts.
    """
    return sum(s.nbytes // 2 for s in report.storages.values() if s.dtype == torch.float32 and not s.autocast)


@dataclass(frozen=True)
class Remedy:
    """One way to lower memory, with its numbers.

    Attributes:
        kind: what to do, named by its rule: ``"activation checkpointing"``, ``"mixed precision"``,
            ``"optimizer state"``.
        target: the module to checkpoint (qualified name), else ``""``.
        bytes_freed: predicted bytes the step's peak falls by (checkpointing: of saved activations, at the
            step's peak, :func:`checkpoint_peak`).
        largest_batch: the largest batch that fits the budget after the remedy (``None``: no budget).
        extra_compute: extra step time as a fraction of the step (checkpointing: one more forward of
            the module), ``None`` when not measured or not applicable.
        note: the cost or condition in words.
    """

    kind: str
    target: str
    bytes_freed: int
    largest_batch: int | None
    extra_compute: float | None
    note: str


RemedyRule = Callable[[StepMemory, int], list[Remedy]]
"""A remedy's rule: ``(step memory, top_k) -> remedies``."""

REMEDY_RULES: list[RemedyRule] = []
"""The rules :func:`rank_remedies` runs, in registration order."""


def register_remedy(rule: RemedyRule) -> RemedyRule:
    """Add ``rule`` to :data:`REMEDY_RULES` (usable as a decorator); again: nothing changes."""
    if rule not in REMEDY_RULES:
        REMEDY_RULES.append(rule)
    return rule


def _run(rule: RemedyRule, memory: StepMemory, top_k: int) -> list[Remedy]:
    """``rule``'s remedies; none when it raises (warned once, naming it)."""
    try:
        return list(rule(memory, top_k))
    except Exception as error:  # a user's rule: a diagnostic never kills the run
        warn_failure_once(f"remedy rule {getattr(rule, '__qualname__', repr(rule))!r}", error)
        return []


def _rank(remedy: Remedy) -> tuple[int, float]:
    """The most bytes off the peak first; for equal bytes the least extra step time (unmeasured: last)."""
    return -remedy.bytes_freed, math.inf if remedy.extra_compute is None else remedy.extra_compute


def rank_remedies(memory: StepMemory, top_k: int = 3) -> list[Remedy]:
    """Every rule's remedies, the most bytes off the step's peak first and, for equal bytes, the cheapest
    first; remedies that free nothing are left out. The built-in rules: :func:`activation_checkpointing`,
    :func:`mixed_precision`, :func:`optimizer_state`.

    Raises:
        ValueError: if ``top_k < 0``.
    """
    if top_k < 0:
        raise ValueError(f"`top_k` must be >= 0, got {top_k}")
    remedies = [remedy for rule in REMEDY_RULES for remedy in _run(rule, memory, top_k) if remedy.bytes_freed > 0]
    return sorted(remedies, key=_rank)


@register_remedy
def activation_checkpointing(memory: StepMemory, top_k: int) -> list[Remedy]:
    """Checkpointing of the ``top_k`` modules that lower the step's peak of saved activations the most, the
    cheapest first among equals (what :func:`checkpoint_savings` frees after forward, less what
    :func:`checkpoint_peak` holds again in backward; the root and :func:`whole_forward_modules` left out; for
    cost, only the ``4 · top_k`` that free the most after forward are weighed, so a better one behind many may
    be missed)."""
    report = memory.activations
    skip = whole_forward_modules(report) | {ROOT}
    # The peaks cost a pass over the storages each: only for the modules that free the most after forward.
    freeing = sorted(
        ((n, b) for n, b in checkpoint_savings(report).items() if b > 0 and n not in skip), key=lambda kv: -kv[1]
    )[: 4 * top_k]
    remedies = []
    for name, freed in freeing:
        peak = checkpoint_peak(report, name)
        reduction = report.total_bytes - max(peak, report.total_bytes - freed)
        if reduction <= 0:
            continue
        seconds = report.forward_seconds.get(name)
        extra = (
            seconds * memory.micro_batches / memory.step_seconds
            if seconds is not None and memory.step_seconds
            else None
        )
        # The reentrant variant recomputes nothing when the module's input needs no grad (the batch).
        note = (
            f"call `{name}` through `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: it frees "
            f"{format_bytes(freed)} after forward; backward runs its forward again"
        )
        if peak > report.total_bytes - freed:
            note += f", holding {format_bytes(peak)} of saved tensors then"
        remedies.append(
            Remedy(
                "activation checkpointing",
                name,
                reduction,
                memory.largest_batch(scaling_freed=freed, activations_peak=peak),
                extra,
                note,
            )
        )
    return sorted(remedies, key=_rank)[:top_k]


@register_remedy
def mixed_precision(memory: StepMemory, top_k: int) -> list[Remedy]:
    """Autocast (:func:`mixed_precision_savings`: the float32 activations saved outside autocast); not for
    a step that saves mostly 16-bit already."""
    report = memory.activations
    halved = mixed_precision_savings(report)
    sixteen_bit = sum(s.nbytes for s in report.storages.values() if s.dtype in (torch.float16, torch.bfloat16))
    if sixteen_bit >= 2 * halved:  # halved: half the float32 bytes saved outside autocast
        return []
    return [
        Remedy(
            "mixed precision",
            "",
            halved,
            memory.largest_batch(scaling_freed=halved),
            None,
            "bf16/fp16 autocast; an upper bound: some ops stay in fp32",
        )
    ]


@register_remedy
def optimizer_state(memory: StepMemory, top_k: int) -> list[Remedy]:
    """The whole optimizer state, as with a stateless or sharded optimizer."""
    state = memory.state
    ratio = state.optimizer_state / state.parameters if state.parameters else math.nan
    return [
        Remedy(
            "optimizer state",
            "",
            state.optimizer_state,
            memory.largest_batch(fixed_freed=state.optimizer_state),
            None,
            f"{ratio:.2f} × parameter bytes (Adam 2×, SGD with momentum 1×, SGD 0); sharding it over N ranks keeps 1/N",
        )
    ]
