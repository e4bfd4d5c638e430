"""The float a state kept on the device accumulates in: float64 where the device has it, else float32.

Apple's MPS backend has no float64 (a float64 tensor there raises TypeError), so a sum or an EMA that lives on the
loss's or the gradients' device is float32 there; each user says why float32 is exact enough for what it decides.
Torch only.
"""

from __future__ import annotations

import torch

NO_FLOAT64 = frozenset({"mps"})
"""Device types without float64."""


def wide_dtype(device: torch.device | str) -> torch.dtype:
    """float64, or float32 on a device type in :data:`NO_FLOAT64`."""
    return torch.float32 if torch.device(device).type in NO_FLOAT64 else torch.float64
