"""Optimizer steps whose gradient held inf/NaN: counted for the callbacks that see them without GradNormMonitor,
and the module that produced the first one searched for (GradNormMonitor and TrainingGuard).

GradNormMonitor owns ``grad_norm/nonfinite_steps`` (``grad_norm/amp_skipped_steps`` under a GradScaler, which
skips such steps as loss-scale calibration). Without one, the first of the callbacks that read
:data:`~trainvitals.plumbing.sharing.NONFINITE_STEPS` (GradNormEarlyStopping, BatchVarianceProbe, each holding a
:class:`NonfiniteCounter`) logs the same tags, so that a run that diverged reads as diverged in
``trainvitals report`` whichever of them watched it.

:class:`ProducerSearch` re-runs a bad step's micro-batch once with :mod:`trainvitals.norms.producer`'s search,
for TrainingGuard and, without one, GradNormMonitor: the same code, whichever callback names the producer.
"""

from __future__ import annotations

import functools
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from trainvitals.fused_norms import is_dtensor
from trainvitals.norms.producer import (
    Producer,
    find_producer,
    find_producer_by_anomaly,
    nonfinite_tensors,
    optimizer_state_tensors,
)
from trainvitals.plumbing.amp import grad_scaler
from trainvitals.plumbing.rerun import RngState, rerun_quietly, rng_state, training_step_loss
from trainvitals.plumbing.sharding import holds_shards
from trainvitals.plumbing.sharing import NONFINITE_STEPS


class NonfiniteCounter:
    """Steps seen with a non-finite gradient norm, counted on the device (no host sync)."""

    def __init__(self) -> None:
        self.count = torch.zeros((), dtype=torch.long)

    def add(self, finite: Tensor) -> None:
        """One step seen; ``finite`` (``()`` bool) whether its gradient norm was finite."""
        self.count = self.count.to(finite.device) + (~finite).long()

    def state_dict(self) -> dict[str, Any]:
        return {"count": int(self.count)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = torch.tensor(int(state["count"]))

    def metrics(self, trainer: "pl.Trainer", owner: Any) -> dict[str, Tensor]:
        """The counter under the monitor's tag, when ``owner`` is the callback that logs it (its hub's
        :meth:`~trainvitals.plumbing.sharing.Vitals.speaker`), else empty."""
        if owner.vitals.speaker(NONFINITE_STEPS) is not owner:
            return {}
        name = "amp_skipped_steps" if grad_scaler(trainer) is not None else "nonfinite_steps"
        return {f"grad_norm/{name}": self.count}


class ProducerSearch:
    """The search for the producer of a fit's first inf/NaN, run once per fit.

    The micro-batches of the optimizer step under watch are kept by reference with the random state each drew
    from (no copy; the previous step's are let go at the next step's first :meth:`keep`); :meth:`search`
    first asks whether the optimizer step before made the weights non-finite, then re-runs those micro-batches
    in turn, quietly (:func:`~trainvitals.plumbing.rerun.rerun_quietly`), with ``method``'s search (one of
    :data:`~trainvitals.norms.producer.SEARCHES`) until one names a producer.

    Attributes:
        searched: whether this fit's search ran.
        producer: what it found, the same on every rank (the first rank's that found one).
        rerun: the batch indices it re-ran, in order.
    """

    def __init__(self, method: str = "flags") -> None:
        self.method = method
        self.searched = False
        self.producer: Producer | None = None
        self.rerun: list[int] = []
        self._step: int | None = None
        self._runs: dict[int, tuple[Any, RngState]] = {}

    @property
    def batches(self) -> list[int]:
        """The batch indices kept for the step under watch, in the order they ran."""
        return list(self._runs)

    def keep(self, step: int, pl_module: "pl.LightningModule", batch: Any, batch_idx: int) -> None:
        """At the start of a micro-batch of optimizer step ``step``: ``batch`` by reference and the random state
        on the module's device. Nothing once the search has run, nor under manual optimization, whose
        ``training_step`` steps the optimizers itself and is not run again."""
        if self.searched or not pl_module.automatic_optimization:
            return
        if step != self._step:
            self._step, self._runs = step, {}
        self._runs[batch_idx] = (batch, rng_state(pl_module.device))

    def let_go(self) -> None:
        """Drop the batches kept (a step that will not be searched)."""
        self._step, self._runs = None, {}

    def give_up(self) -> None:
        """No search in this fit: its first non-finite step can no longer be re-run (its update was applied)."""
        self.searched = True
        self.let_go()

    def search(
        self,
        trainer: "pl.Trainer",
        pl_module: "pl.LightningModule",
        optimizer: torch.optim.Optimizer,
        batches: list[int],
        after_applied_step: bool,
        owner: Any,
    ) -> Producer | None:
        """The producer of this step's inf/NaN, agreed over ranks (each rank searches its own batches, then one
        gather; every rank must call it at the same step).

        Args:
            batches: the kept micro-batches to re-run, in that order.
            after_applied_step: the previous optimizer step had finite gradients and was applied, so non-finite
                weights now are that step's doing.
            owner: the callback searching: a failure is its ``cannot_measure`` (a diagnostic never ends the run).
        """
        self.searched = True
        runs, self._runs = self._runs, {}  # searched once: the batches are not kept any longer
        found = None
        # The optimizer first, agreed over ranks (sharded weights are checked shard by shard), so that every
        # rank re-runs or none does: the re-run's forward takes the strategy's collectives (FSDP's all-gathers).
        if after_applied_step:
            found = self._agreed(trainer, self._guarded(owner, self._optimizer_made_it, pl_module, optimizer))
        if found is None:
            found = self._rerun(trainer, pl_module, runs, batches, owner)
        self.producer = found
        return found

    @staticmethod
    def _guarded(owner: Any, search: Any, *args: Any) -> Producer | None:
        """``search(*args)``; a failure is ``owner``'s ``cannot_measure`` and finds nothing."""
        try:
            return search(*args)
        except Exception as error:
            owner.cannot_measure(f"could not search for the producer of the inf/NaN: {type(error).__name__}: {error}")
            return None

    @staticmethod
    def _agreed(trainer: "pl.Trainer", found: Producer | None) -> Producer | None:
        """The first rank's finding, on every rank (one gather); ``found`` itself on a single process."""
        if trainer.world_size == 1 or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return found
        gathered: list[Any] = [None] * trainer.world_size
        torch.distributed.all_gather_object(gathered, found)
        return next((f for f in gathered if f is not None), None)

    @staticmethod
    def _optimizer_made_it(pl_module: "pl.LightningModule", optimizer: torch.optim.Optimizer) -> Producer | None:
        """The optimizer step, when the weights or the optimizer's state hold an inf/NaN (on this rank's shards)."""
        names = {p: n for n, p in pl_module.named_parameters()}
        bad = nonfinite_tensors(pl_module.named_parameters())
        bad += nonfinite_tensors(optimizer_state_tensors(optimizer, names))
        if not bad:
            return None
        shown = ", ".join(f"`{n}`" for n in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        return Producer("optimizer", shown)

    def _rerun(
        self,
        trainer: "pl.Trainer",
        pl_module: "pl.LightningModule",
        runs: dict[int, tuple[Any, RngState]],
        batches: list[int],
        owner: Any,
    ) -> Producer | None:
        """Re-run ``batches`` in turn with :attr:`method`'s search until one names a producer on some rank.

        When the model's forward and backward hold collectives (sharded by FSDP), every rank takes the same
        path: the flags search with its backward always taken (detect_anomaly would stop each rank's backward
        at a node of its own), and one agreement per batch."""
        lockstep = trainer.world_size > 1 and (
            holds_shards(trainer) or any(is_dtensor(p) for p in pl_module.parameters())
        )
        if lockstep and self.method == "anomaly":
            owner.warn(
                "the model is sharded: the producer is searched with finiteness flags, not detect_anomaly, which "
                "would stop each rank's backward at a node of its own (the ranks' collectives would not match)",
                once=True,
            )
        if self.method == "anomaly" and not lockstep:
            find: Any = find_producer_by_anomaly
        else:
            find = functools.partial(find_producer, lockstep=lockstep)
        found = None
        for batch_idx in batches:
            if batch_idx not in runs:
                continue
            batch, rng = runs[batch_idx]
            self.rerun.append(batch_idx)
            run = functools.partial(training_step_loss, trainer, pl_module, batch, batch_idx, rng)
            with rerun_quietly(pl_module):
                found = self._guarded(owner, find, pl_module, run)
            if lockstep:
                found = self._agreed(trainer, found)
            if found is not None:
                break
        return found if lockstep else self._agreed(trainer, found)
