"""How many examples a batch holds, as Lightning counts them (a list of examples: its length), without failing
where Lightning cannot tell, and those of the micro-batches of the optimizer step under way;
what Lightning divides a micro-batch's loss by; which dataset rows a batch holds, where that is known."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor
from torch.utils.data import BatchSampler, SequentialSampler

from trainvitals.batch_structure import batch_tensors, listed_examples
from trainvitals.plumbing.sharing import STEP_BATCHES


def batch_size(batch: Any, sequence_first: bool | None = False) -> int | None:
    """The examples a batch holds: the first dimension of its first tensor
    (``lightning.pytorch.utilities.data.extract_batch_size``); ``sequence_first``: the batch is ``(T, B, ...)``,
    the second dimension of its first tensor of two or more dimensions (without one, as unset). Where its
    tensors disagree and it holds a list of examples (variable-length sequences for pack_sequence) beside
    tensors of a row each, the list's length (:func:`~trainvitals.batch_structure.listed_examples`).
    ``None`` where that cannot be told: a list of tensors of differing lengths that nothing beside it sizes
    (Lightning would count the first one's rows), a batch without a tensor Lightning can find
    (``MisconfigurationException``), one that contains itself (``RecursionError``)."""
    if sequence_first and (size := next((t.shape[1] for t in batch_tensors(batch) if t.dim() >= 2), None)):
        return size
    if not sequence_first and isinstance(batch, (list, tuple)) and batch:  # (x, y): what Lightning says, read at once
        rows = {t.shape[0] if isinstance(t, Tensor) and t.dim() else None for t in batch}
        if len(rows) == 1 and None not in rows:
            return rows.pop()
    listed = listed_examples(batch)
    if listed is not None:
        return listed[0]
    try:
        return extract_batch_size(batch)
    except Exception:  # a diagnostic must not end the run over a batch it cannot size
        return None


class StepBatches:
    """The micro-batches of the optimizer step under way and their examples (:func:`batch_size`: the tensors'
    shapes, on the host, no sync), for the noise weight of its gradient
    (:func:`~trainvitals.norms.spikes.relative_noise_weight`): one a fit, shared by the callbacks that judge a step
    by it (:meth:`of`).

    Each of them reports every micro-batch that starts (:meth:`start`) and every backward (:meth:`backward`) from its
    own hooks; the first report of each is recorded, the others find it recorded (each reporter's count of its reports
    in this window tells which), so that a micro-batch is sized once whichever callback runs first, and one alone
    still feeds it all. A window opens at the first micro-batch that starts at a new ``trainer.global_step``. A
    backward counts towards the optimizer step at whose ``global_step`` it ran: under manual optimization an
    optimizer's step moves ``global_step`` on, so a GAN's generator step counts its own backward, not the
    discriminator's before it. Read at a step's first ``on_before_optimizer_step``: under automatic optimization
    after the window's backwards (none for a ``training_step`` that returned ``None``), and for LBFGS after its
    closure's first evaluation only — the gradient measured then, zeroed by Lightning before it.
    """

    def __init__(self) -> None:
        self.step: int | None = None  # the global step the window opened at
        self.sizes: dict[int, int | None] = {}  # micro-batch index → its examples
        self.ran: list[tuple[int, int | None]] = []  # each backward's global step and micro-batch
        self.current: int | None = None
        self._reported = [0, 0]  # micro-batches and backwards recorded in this window
        self._by: dict[int, list[int]] = {}  # per reporter (by id): those it reported

    @classmethod
    def of(cls, vitals: Any) -> "StepBatches":
        """The fit's one StepBatches of the hub ``vitals`` (:data:`~trainvitals.plumbing.sharing.STEP_BATCHES`)."""
        return vitals.shared(STEP_BATCHES, cls)

    def _first(self, reporter: object, kind: int) -> bool:
        """Count a report of ``reporter``'s (0: a micro-batch, 1: a backward); True when no one reported it before."""
        counts = self._by.setdefault(id(reporter), [0, 0])
        counts[kind] += 1
        if counts[kind] <= self._reported[kind]:
            return False
        self._reported[kind] += 1
        return True

    def start(self, reporter: object, trainer: "pl.Trainer", batch: Any, batch_idx: int) -> bool:
        """``reporter`` saw the micro-batch ``batch_idx`` start: sized if no one did; True when it is its optimizer
        step's first."""
        if self.step != trainer.global_step:
            self.step, self.sizes, self.ran, self._reported, self._by = trainer.global_step, {}, [], [0, 0], {}
        if self._first(reporter, 0):
            self.sizes[batch_idx] = batch_size(batch)
            self.current = batch_idx
        return self._by[id(reporter)][0] == 1

    def backward(self, reporter: object, trainer: "pl.Trainer") -> None:
        """``reporter`` saw the micro-batch under way run a backward."""
        if self._first(reporter, 1):
            self.ran.append((trainer.global_step, self.current))

    def backward_sizes(self, trainer: "pl.Trainer") -> list[int | None]:
        """The examples of the micro-batch of each backward of this optimizer step, those that ran at this
        ``global_step`` (``None`` where unsized)."""
        step = trainer.global_step
        return [self.sizes.get(i) for at, i in self.ran if at == step]


def loss_divisor(trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> int:
    """What Lightning divides each micro-batch's loss by before backward: ``accumulate_grad_batches``
    under automatic optimization; 1 under manual optimization (``manual_backward`` divides by nothing)."""
    return trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1


INDEX_KEYS = ("index", "indices", "idx")
"""Keys of a dict batch that name each example's dataset row: a 1-D integer tensor, one per example."""


def dataset_rows(trainer: "pl.Trainer", batch: Any, batch_idx: int, size: int) -> Tensor | None:
    """The dataset row of each of the ``size`` examples of a training batch, where it can be known.

    From the batch itself (a dict with an :data:`INDEX_KEYS` entry, kept on its device: no sync), else from
    the sampler's order when that is fixed: one process, a ``SequentialSampler`` batched by a plain
    ``BatchSampler``, so that batch ``batch_idx`` holds rows ``batch_idx * batch_size`` on. ``None``
    otherwise (a shuffled or distributed sampler: the order is not recorded).
    """
    if isinstance(batch, Mapping):
        for key in INDEX_KEYS:
            rows = batch.get(key)
            if isinstance(rows, Tensor) and rows.ndim == 1 and len(rows) == size and not rows.is_floating_point():
                return rows
    if trainer.world_size != 1:
        return None
    loader = getattr(trainer, "train_dataloader", None)
    sampler = getattr(loader, "batch_sampler", None)
    if type(sampler) is BatchSampler and isinstance(sampler.sampler, SequentialSampler):
        return torch.arange(batch_idx * sampler.batch_size, batch_idx * sampler.batch_size + size)
    return None
