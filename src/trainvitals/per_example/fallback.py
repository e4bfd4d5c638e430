"""The general fallback: per-example gradients of a module's parameters by ``torch.func``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from trainvitals.per_example.tensor_ops import _accumulation_dtype, _trainable

#: Why a module whose forward draws random numbers has no torch.func per-example gradients.
RANDOM_FORWARD = (
    "its forward draws random numbers (F.dropout inside it?), which torch.func cannot draw per example "
    "as the batch's forward drew them; dropout as an nn.Dropout module outside it would leave it exact"
)

#: Why a module whose forward changes its input in place has no torch.func per-example gradients ({node}: the op's
#: autograd node, where the input is no view that hides it).
CHANGED_INPUT = (
    "its forward changes its input in place{node}, as `x.mul_(gamma)` or an `inplace=True` op does: torch.func would "
    "re-run it on the changed values, not the ones it read; with inplace=False (timm's LayerScale default) it is "
    "measured"
)


def changed_input(args: tuple[Any, ...], versions: list[int | None]) -> str | None:
    """:data:`CHANGED_INPUT` where a tensor of ``args`` was changed in place since its version was ``versions``
    (read before the forward); else ``None``."""
    for a, before in zip(args, versions):
        if isinstance(a, Tensor) and before is not None and a._version != before:
            node = type(a.grad_fn).__name__ if a.grad_fn is not None and a._base is None else None
            return CHANGED_INPUT.format(node=f" ({node})" if node else "")
    return None


def vmap_per_example_grads(
    module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], grad_output: Tensor
) -> dict[str, Tensor]:
    """Per-example gradients of ``module``'s own trainable parameters by ``torch.func`` (the general fallback).

    Each example's gradient is the vector-Jacobian product of the module's forward on that example
    alone, ``vmap(vjp)`` over the batch, seeded with that example's output gradient: exact for any
    layer that treats the examples of a batch independently (not BatchNorm in training mode) and is
    deterministic (no dropout inside). Costs one more forward and backward of the module and
    memory of B × its parameter count.

    Args:
        module: the layer; called as ``module(*args, **kwargs)``.
        args: its positional inputs; tensors whose first dimension has the batch size B are split
            into examples, everything else is passed whole.
        kwargs: keyword inputs, passed whole.
        grad_output: ``(B, *out_shape)``, the gradient w.r.t. the module's output.

    Returns:
        ``{local parameter name: (B, *parameter shape)}``.

    Raises:
        RuntimeError: :data:`RANDOM_FORWARD` for a forward that draws random numbers; torch.func's own otherwise.
    """
    params = {n: p.detach() for n, p in _trainable(module).items()}
    args = tuple(a.detach() if isinstance(a, Tensor) else a for a in args)  # no graph back into the forward's
    kwargs = {k: v.detach() if isinstance(v, Tensor) else v for k, v in kwargs.items()}
    batch = grad_output.shape[0]
    in_dims = tuple(0 if isinstance(a, Tensor) and a.dim() > 0 and a.shape[0] == batch else None for a in args)

    def one_example(*example_args: Any) -> dict[str, Tensor]:
        *inputs, grad = example_args
        batched = tuple(x.unsqueeze(0) if d == 0 else x for x, d in zip(inputs, in_dims))
        _, pullback = torch.func.vjp(lambda q: torch.func.functional_call(module, q, batched, dict(kwargs)), params)
        return pullback(grad.unsqueeze(0))[0]

    try:
        return torch.func.vmap(one_example, in_dims=(*in_dims, 0))(*args, grad_output)
    except RuntimeError as err:
        if "randomness" in str(err):
            raise RuntimeError(RANDOM_FORWARD) from err
        raise


def batch_slice(args: tuple[Any, ...], batch: int, start: int, stop: int) -> tuple[Any, ...]:
    """``args`` with the examples ``start:stop`` of each tensor whose first dimension is the ``batch``."""
    return tuple(a[start:stop] if isinstance(a, Tensor) and a.dim() and a.shape[0] == batch else a for a in args)


def vmap_sq_norms(
    module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], grad_output: Tensor, sub: int
) -> Tensor:
    """``(B - sub,)`` ‖g_i‖² over ``module``'s own trainable parameters of the examples past the first ``sub``
    (the sub-batch measured already) of the ``(B, *)`` ``grad_output``'s batch, by
    :func:`vmap_per_example_grads` on ``sub`` examples at a time (memory of ``sub`` × its parameter count),
    in float32 or float64."""
    batch, parts = grad_output.shape[0], []
    for lo in range(sub, batch, sub):
        hi = min(lo + sub, batch)
        grads = vmap_per_example_grads(module, batch_slice(args, batch, lo, hi), kwargs, grad_output[lo:hi])
        parts.append(
            sum(
                (g.to(_accumulation_dtype(g)).flatten(1).square().sum(1) for g in grads.values()),
                torch.zeros(hi - lo, dtype=_accumulation_dtype(grad_output), device=grad_output.device),
            )
        )
    return torch.cat(parts) if parts else grad_output.new_zeros(0, dtype=_accumulation_dtype(grad_output))
