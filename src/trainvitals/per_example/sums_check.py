"""The check that a layer's per-example gradients add up to its parameters' ``.grad``: Σ_i g_i, scaled to the
units of ``.grad``, must equal it to rounding, or the rule did not see the whole gradient."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

#: Why a layer whose per-example gradients do not add up is not measured per example ({error}: relative).
UNBALANCED = (
    "its per-example gradients do not add up to its parameters' gradient (relative error {error:.2g}): its "
    "weight is used outside its own call (`x @ layer.weight.T`, a tied `F.linear(h, embed.weight)`), a "
    "forward pre-hook reparametrises it (weight_norm, spectral_norm, pruning), a hook rescales its output "
    "gradient, checkpointing recomputes it with other dropout masks than its forward drew "
    "(use_reentrant=False with preserve_rng_state=False), or its rule misses a parameter"
)


def sum_errors(
    params: Mapping[str, nn.Parameter],
    rows: Mapping[str, slice],
    grad_sum: Mapping[str, Tensor],
    to_grad: Tensor | float,
) -> tuple[dict[str, float], dict[str, float]]:
    """Per parameter (by qualified name), ‖Σ_i g_i · ``to_grad`` − .grad‖ over its ``rows`` (all where not given;
    Σ_i g_i is 0 for a parameter absent from ``grad_sum``), and the larger of the two norms: one host sync."""
    names = list(params)
    grads = [params[q].grad if params[q].grad is not None else torch.zeros_like(params[q]) for q in names]
    actual = [g if g.dim() == 0 else g[rows.get(q, slice(None))] for q, g in zip(names, grads)]  # 0-d: all of it
    # Compared in the gradients' precision, at least float32: the float64 sums' would double the temporaries.
    dtypes = [torch.promote_types(a.dtype, torch.float32) for a in actual]
    expected = [
        grad_sum[q].to(d) * to_grad if q in grad_sum else torch.zeros_like(a, dtype=d)
        for q, a, d in zip(names, actual, dtypes)
    ]
    actual = [a.to(d) for a, d in zip(actual, dtypes)]
    diff = torch._foreach_norm(torch._foreach_sub(expected, actual))
    scale = [torch.maximum(a, e) for a, e in zip(torch._foreach_norm(actual), torch._foreach_norm(expected))]
    values = torch.stack([*diff, *scale]).double().tolist()
    return dict(zip(names, values[: len(names)])), dict(zip(names, values[len(names) :]))


def tolerance(dtype: torch.dtype, device: torch.device) -> float:
    """How far a layer's Σ_i g_i may stray from its ``.grad`` by rounding alone (relative, in norm): the
    rule and autograd sum the same products in other orders; on CUDA float32 matmuls and convolutions may
    run in TF32."""
    if dtype == torch.float64:
        return 1e-6
    if dtype == torch.float32:
        return 1e-2 if device.type == "cuda" else 1e-3
    return 1e-1
