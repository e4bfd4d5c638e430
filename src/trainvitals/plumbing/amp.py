"""What the AMP GradScaler has done to the gradients a callback sees (docs/science.md §1).

Lightning scales the loss before backward and unscales the gradients between the closure and
``on_before_optimizer_step`` — except for optimizers that unscale inside their own ``step`` (fused
Adam/AdamW/SGD), whose gradients are still scaled in that hook. These helpers read the scale as a
device tensor, never with ``GradScaler.get_scale()``, which would sync with the host.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
from torch import Tensor


def grad_scaler(trainer: "pl.Trainer") -> "torch.amp.GradScaler | None":
    """The Trainer's enabled GradScaler, or None (fp32, bf16, or no scaler)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None


def loss_scale(trainer: "pl.Trainer") -> Tensor | None:
    """The scale the loss was multiplied by before backward (0-d device tensor), or None without a scaler."""
    scaler = grad_scaler(trainer)
    if scaler is None:
        return None
    # ``_scale`` is the tensor GradScaler.unscale_ itself divides by; None only before the first scale().
    scale = getattr(scaler, "_scale", None)
    return scale if scale is not None else torch.tensor(scaler.get_scale())


def scale_left_in_grads(trainer: "pl.Trainer", optimizer: torch.optim.Optimizer) -> Tensor | None:
    """The scale still in ``p.grad`` at ``on_before_optimizer_step``: the loss scale for an optimizer
    that unscales in its own ``step`` (a fused one), else None (Lightning has already unscaled)."""
    return loss_scale(trainer) if _optimizer_handles_unscaling(optimizer) else None
