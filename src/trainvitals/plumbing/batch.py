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
    (:func:`~trainvitals.norms.spikes.relative_noise_weight`).

    A step's window opens at the first micro-batch that starts at a new ``trainer.global_step``; a micro-batch
    counts once per backward it runs (:meth:`backward`: none for a ``training_step`` that returned ``None``; each
    of an LBFGS closure's evaluations; each loss of a manual optimization).
    """

    def __init__(self) -> None:
        self.step: int | None = None  # the global step the window opened at
        self.sizes: dict[int, int | None] = {}  # micro-batch index → its examples
        self.ran: list[int | None] = []  # the micro-batch of each backward
        self.current: int | None = None

    def start(self, trainer: "pl.Trainer", batch: Any, batch_idx: int) -> bool:
        """Size the micro-batch ``batch_idx`` that starts; True when it is its optimizer step's first."""
        opens = self.step != trainer.global_step
        if opens:
            self.step, self.sizes, self.ran = trainer.global_step, {}, []
        self.sizes[batch_idx] = batch_size(batch)
        self.current = batch_idx
        return opens

    def backward(self) -> None:
        """The micro-batch under way runs a backward."""
        self.ran.append(self.current)

    def backward_sizes(self) -> list[int | None]:
        """The examples of the micro-batch of each backward of this step (``None`` where unsized)."""
        return [self.sizes.get(i) for i in self.ran]


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
