"""Statistics of one layer output, reduced on its device: scale, extremes, tails, dead units, non-finite entries.

Torch only. :func:`activation_stats` turns an output tensor into one ``(len(STATS),)`` float32 row on
the output's device, without reading anything on the host; a caller stacks the rows of a step and
reads them back once. Its transient memory is one float32 copy of the output (the centred values).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

STATS = ("rms", "abs_max", "mean", "kurtosis", "dead_fraction", "nonfinite")
"""The row's entries, in order (``nonfinite``: 1.0 if the output holds inf/NaN, else 0.0)."""

DEAD_TYPES: tuple[type[nn.Module], ...] = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.PReLU,
    nn.RReLU,
    nn.ELU,
    nn.CELU,
    nn.SELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Hardswish,
)
"""Modules whose output is ≤ 0 exactly where their input is ≤ 0 (ReLU family, GELU, SiLU, ...): a unit
whose output is ≤ 0 for every example of a batch gets no gradient through the positive branch: dead."""


def activation_stats(output: Tensor, dead: bool = False) -> Tensor:
    """``(6,)`` float32 row of :data:`STATS` for ``output`` (any shape, dim 0 the batch), on its device.

    - ``rms`` = √(mean x²), ``abs_max`` = max |x|, ``mean``;
    - ``kurtosis`` = E[(x − μ)⁴] / E[(x − μ)²]² over all entries (Pearson's, 3 for a Gaussian), from
      the centred values scaled by their largest magnitude, so that the fourth powers of float32 values
      neither overflow nor underflow; NaN for a constant output;
    - ``dead_fraction`` (only with ``dead``, for an output of at least 2 dims; else NaN): the share of
      units — the entries of one example, ``output[0].numel()`` of them — that are ≤ 0 for every
      example of the batch;
    - ``nonfinite``: whether any entry is inf/NaN (the other entries are then NaN or inf).
    """
    x = output.detach()
    x = x.float() if x.dtype not in (torch.float32, torch.float64) else x
    n = max(x.numel(), 1)
    rms = torch.linalg.vector_norm(x) / math.sqrt(n)
    abs_max = torch.linalg.vector_norm(x, math.inf)
    mean = x.mean()
    centred = x - mean
    scale = torch.linalg.vector_norm(centred, math.inf)
    centred.div_(scale)
    m2 = torch.linalg.vector_norm(centred).square() / n
    m4 = torch.linalg.vector_norm(centred, 4.0).pow(4) / n
    kurtosis = m4 / m2.square()
    if dead and x.dim() >= 2:
        dead_fraction = 1.0 - (x > 0).flatten(1).any(0).float().mean()
    else:
        dead_fraction = torch.full((), math.nan, device=x.device)
    nonfinite = (~torch.isfinite(x)).any()
    return torch.stack([v.float() for v in (rms, abs_max, mean, kurtosis, dead_fraction, nonfinite)])


def output_tensors(output: object) -> list[Tensor]:
    """The floating-point tensors of a module's output, in order: the tensor itself, or those of a
    (nested) tuple, list or dict's values; integer and boolean tensors (indices, masks) left out."""
    if isinstance(output, Tensor):
        return [output] if output.is_floating_point() else []
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in output_tensors(item)]
    return []
