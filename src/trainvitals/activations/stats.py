"""Statistics of one layer output, reduced on its device: scale, extremes, tails, dead units, non-finite entries.

Torch only. :func:`output_moments` turns an output tensor into a ``(len(MOMENTS),)`` float64 row of
sufficient statistics (count, mean and central sums about it, max |x|) and a ``(units,)`` mask of the
units that were positive for some example, without reading anything on the host; rows of several ranks
combine exactly (:func:`combine_moments`, Pébay 2008, eqs. 3.1–3.3, the pairwise update of central
sums); :func:`finish` turns rows into the logged :data:`STATS`. Transient memory: two float32 copies of
the output (the centred values and their squares).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

MOMENTS = ("count", "mean", "m2", "m3", "m4", "abs_max", "nonfinite")
"""A row of :func:`output_moments`: n, μ, Σ(x−μ)², Σ(x−μ)³, Σ(x−μ)⁴, max |x|, 1.0 if inf/NaN were found."""

_CONSTANT_REL = 1e-6  # a standard deviation below this share of max |x| is float32 rounding: a constant output

STATS = ("rms", "abs_max", "mean", "kurtosis", "dead_fraction")
"""What :func:`finish` gives per output (``dead_fraction`` NaN where not an activation of :data:`DEAD_TYPES`)."""

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
whose output is ≤ 0 for every example of a batch gets no gradient through the positive branch. For
:data:`ZERO_GRADIENT_TYPES` that is no gradient at all (dead); the others pass the small gradient of their
negative branch (inactive)."""

ZERO_GRADIENT_TYPES: tuple[type[nn.Module], ...] = (nn.ReLU, nn.ReLU6)
"""Of :data:`DEAD_TYPES`, those whose gradient is exactly 0 where their input is ≤ 0."""


def output_moments(output: Tensor, dead: bool = False) -> tuple[Tensor, Tensor | None]:
    """``(7,)`` float64 row of :data:`MOMENTS` for ``output`` (any shape, dim 0 the batch), on its device,
    and with ``dead`` (an output of at least 2 dims) the ``(output[0].numel(),)`` bool mask of the units
    positive for at least one example; ``None`` otherwise.

    One pass for the mean, one for the extremes (``aminmax``: max |x|, whose non-finiteness is the flag,
    and the scale of the centred values), then the centred values scaled by their largest magnitude
    and their squares, reduced by three dot products (Σc², Σc³, Σc⁴): the fourth powers of float32 (or
    float16) values neither overflow nor underflow; the sums are scaled back in float64.
    """
    x = output.detach()
    x = x.float() if x.dtype not in (torch.float32, torch.float64) else x
    mean = x.mean()
    low, high = torch.aminmax(x)
    abs_max = torch.maximum(high, -low)  # NaN when any entry is NaN, inf when one is infinite
    scale = torch.maximum(high - mean, mean - low)
    centred = (x - mean).div_(torch.where(scale > 0, scale, torch.ones_like(scale))).reshape(-1)
    squares = centred.square()
    s = scale.double()
    row = torch.stack(
        [
            torch.full((), float(x.numel()), dtype=torch.float64, device=x.device),  # a fill: no host-to-device copy
            mean.double(),
            torch.dot(centred, centred).double() * s**2,
            torch.dot(squares, centred).double() * s**3,
            torch.dot(squares, squares).double() * s**4,
            abs_max.double(),
            (~torch.isfinite(abs_max)).double(),
        ]
    )
    # A unit is dead where it is ≤ 0 for every example; NaN is not ≤ 0, so a non-finite unit is not called dead.
    alive = ~(x.flatten(1) <= 0).all(0) if dead and x.dim() >= 2 else None
    return row, alive


def combine_moments(rows: Tensor) -> Tensor:
    """``(R, K, 7)`` rows of R parts (ranks) → ``(K, 7)``, as if each output's parts had been one tensor:
    counts add, means are count-weighted, central sums combine by Pébay's pairwise update (exact), the
    max |x| and the non-finite flag take the maximum. A part of count 0 changes nothing."""
    out = rows[0].clone()
    for part in rows[1:]:
        na, nb = out[:, 0], part[:, 0]
        n = na + nb
        safe = torch.where(n > 0, n, torch.ones_like(n))
        delta = part[:, 1] - out[:, 1]
        m2a, m3a, m4a = out[:, 2], out[:, 3], out[:, 4]
        m2b, m3b, m4b = part[:, 2], part[:, 3], part[:, 4]
        m2 = m2a + m2b + delta**2 * na * nb / safe
        m3 = m3a + m3b + delta**3 * na * nb * (na - nb) / safe**2 + 3 * delta * (na * m2b - nb * m2a) / safe
        m4 = (
            m4a
            + m4b
            + delta**4 * na * nb * (na**2 - na * nb + nb**2) / safe**3
            + 6 * delta**2 * (na**2 * m2b + nb**2 * m2a) / safe**2
            + 4 * delta * (na * m3b - nb * m3a) / safe
        )
        mean = out[:, 1] + delta * nb / safe
        out = torch.stack(
            [n, mean, m2, m3, m4, torch.maximum(out[:, 5], part[:, 5]), torch.maximum(out[:, 6], part[:, 6])], dim=1
        )
    return out


def finish(rows: Tensor) -> Tensor:
    """``(K, 7)`` rows of :data:`MOMENTS` → ``(K, 4)``: rms = √(m2/n + μ²), max |x|, μ, and Pearson's kurtosis
    n·m4/m2² (3 for a Gaussian; NaN for a constant output: a variance within float32 rounding of max |x|, since
    the mean's own rounding leaves every deviation the same tiny value). The dead fraction comes from the masks."""
    n = rows[:, 0].clamp_min(1.0)
    mean, m2, m4, abs_max = rows[:, 1], rows[:, 2], rows[:, 4], rows[:, 5]
    rms = (m2 / n + mean**2).sqrt()
    varies = m2 / n > (_CONSTANT_REL * abs_max) ** 2
    kurtosis = torch.where(varies, n * m4 / m2.square(), torch.full_like(m2, math.nan))
    return torch.stack([rms, rows[:, 5], mean, kurtosis], dim=1)


def output_tensors(output: object, path: str = "") -> list[tuple[str, Tensor]]:
    """The floating-point tensors of a module's output, in order, each with its place in the output: ``""`` for
    the tensor itself, ``"[i]"`` for a tuple's or list's item, ``"[key]"`` for a dict's (nested: ``"[1][0]"``,
    an LSTM's ``h_n``), so a tensor keeps its name when its neighbours change (attention's ``(out, None)`` with
    ``need_weights=False``); integer and boolean tensors (indices, masks) left out."""
    if isinstance(output, Tensor):
        return [(path, output)] if output.is_floating_point() else []
    items = (
        output.items() if isinstance(output, dict) else enumerate(output) if isinstance(output, (tuple, list)) else ()
    )
    return [found for key, item in items for found in output_tensors(item, f"{path}[{key}]")]


DEAD_WHY = (
    "these units are ≤ 0 for every example, so no gradient flows through them: lower the lr, check the "
    "initialisation and the biases, or use a leaky activation"
)
INACTIVE_WHY = (
    "their input is ≤ 0 for every example, where this activation passes only the small gradient of its negative "
    "branch: check the initialisation and the biases before it"
)
"""What a share of units ≤ 0 for every example means, by the activation's word (:func:`units_word`)."""


def units_word(zero_gradient: bool) -> str:
    """What units ≤ 0 for every example are called: "dead" under an activation with no gradient there (ReLU,
    ReLU6: :data:`ZERO_GRADIENT_TYPES`), else "inactive" (GELU, SiLU, ELU, ...)."""
    return "dead" if zero_gradient else "inactive"
