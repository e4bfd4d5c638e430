"""When a ``trainer.should_stop`` set by a callback actually ends the fit.

Lightning keeps training past a stop request until ``min_epochs`` and ``min_steps`` are met (it says
"Trainer was signaled to stop but the required ... Training will continue"), and the request stays set
meanwhile; a fit can then still end at ``max_steps`` or ``max_epochs``. Read from the fit loop's own
conditions (``FitLoop.done`` in ``lightning/pytorch/loops/fit_loop.py``).
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import EarlyStopping, Timer
from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason


def can_stop_now(trainer: "pl.Trainer") -> bool:
    """Whether a stop requested now ends the fit after this batch: ``min_epochs`` and ``min_steps`` are met."""
    return bool(getattr(trainer.fit_loop, "_can_stop_early", True))


def stopped_early(trainer: "pl.Trainer") -> bool:
    """Whether the fit ended on a stop request (a stopping callback, a time limit), not at ``max_steps`` or
    ``max_epochs``. Meaningful in ``on_train_end``."""
    loop = trainer.fit_loop
    batches = loop.epoch_loop.batch_progress
    # An epoch cut short still counts as processed: the last one must also have run out of batches.
    epoch_done = batches.is_last_batch or batches.current.ready >= trainer.num_training_batches
    ran_out = _at_max_steps(trainer) or (_at_max_epochs(trainer) and epoch_done)
    return trainer.should_stop and can_stop_now(trainer) and not ran_out


def _at_max_steps(trainer: "pl.Trainer") -> bool:
    loop = trainer.fit_loop
    return loop.max_steps != -1 and trainer.global_step >= loop.max_steps


def _at_max_epochs(trainer: "pl.Trainer") -> bool:
    loop = trainer.fit_loop
    return loop.max_epochs not in (None, -1) and loop.epoch_progress.current.processed >= loop.max_epochs


def ended_by(trainer: "pl.Trainer") -> str:
    """What ended a fit that ran to its end, as a fit-end line names it: "max_steps=400", "max_epochs=3",
    "max_time (Timer)", "EarlyStopping on val_loss"; "" where none of these (another callback's stop request):
    the bounds a band that ends no fit leaves the fit to. Meaningful in ``on_train_end``."""
    loop = trainer.fit_loop
    if _at_max_steps(trainer):
        return f"max_steps={loop.max_steps}"
    if not stopped_early(trainer):
        return f"max_epochs={loop.max_epochs}" if _at_max_epochs(trainer) else ""
    for callback in trainer.callbacks:
        remaining = callback.time_remaining() if isinstance(callback, Timer) else None  # None: no duration set
        if remaining is not None and remaining <= 0:
            return "max_time (Timer)"
        if isinstance(callback, EarlyStopping) and callback.stopping_reason is not EarlyStoppingReason.NOT_STOPPED:
            return f"EarlyStopping on {callback.monitor}"
    return ""
