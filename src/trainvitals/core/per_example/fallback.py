"""The general fallback: per-example gradients of a module's parameters by ``torch.func``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from trainvitals.core.per_example._common import _trainable


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

    return torch.func.vmap(one_example, in_dims=(*in_dims, 0))(*args, grad_output)
