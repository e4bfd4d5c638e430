"""Running a LightningModule's code once more, for a measurement or a diagnosis, without leaving a trace."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.seed import isolate_rng
from torch import Tensor

from trainvitals.plumbing.extra_forward import extra_forward


@contextmanager
def rerun_quietly(pl_module: "pl.LightningModule") -> Iterator[None]:
    """Around an extra ``training_step`` (or forward) that a callback runs: inside, ``self.log`` and
    ``self.log_dict`` do nothing, and the hooks that observe the user's steps and ``torch.compile`` do not see it
    (:func:`~trainvitals.plumbing.extra_forward.extra_forward`); on the way out the random streams (Python's, NumPy's, torch's on the
    CPU and on the module's device: dropout, data augmentation), the buffers (BatchNorm's running
    statistics) and every module's train/eval mode are as they were.
    """
    device = pl_module.device
    buffers = [(b, b.detach().clone()) for b in pl_module.buffers()]
    modes = [(m, m.training) for m in pl_module.modules()]
    device_rng = (
        nullcontext() if device.type == "cpu" else torch.random.fork_rng(devices=[device], device_type=device.type)
    )
    pl_module.log = pl_module.log_dict = _ignore  # type: ignore[method-assign]
    try:
        with isolate_rng(include_cuda=False), device_rng, extra_forward():
            yield
    finally:
        del pl_module.log, pl_module.log_dict
        for module, training in modes:
            module.train(training)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


RngState = tuple[Tensor, Tensor | None]
"""torch's random state on the CPU and, on a CUDA device, on that device."""


def rng_state(device: torch.device) -> RngState:
    """The random state a ``training_step`` on ``device`` draws from now (dropout, augmentation)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def training_step_loss(
    trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int, rng: RngState
) -> Tensor | None:
    """The loss of one more ``training_step(batch, batch_idx)`` from the random state ``rng`` (as the step drew
    it), in the precision plugin's step context; ``None`` when the step returned none. Run it inside
    :func:`rerun_quietly`, which puts the random state back."""
    torch.set_rng_state(rng[0])
    if rng[1] is not None:
        torch.cuda.set_rng_state(rng[1], pl_module.device)
    with trainer.precision_plugin.train_step_context():
        out = pl_module.training_step(batch, batch_idx)
    return out.get("loss") if isinstance(out, dict) else out


def _ignore(*_: Any, **__: Any) -> None:
    """Stands in for ``self.log`` while the module's code runs again."""
