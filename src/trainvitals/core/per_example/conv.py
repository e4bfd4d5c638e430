"""Convolutions: y_t = W a_t + b with a_t the receptive field of output position t.

T = output positions, I = C_in · kernel size; the blocks are then one batched matmul with the FLOPs of
the layer's own weight gradient (the im2col view of Rochette et al. 2019, "Efficient Per-Example
Gradient Computations in Convolutional Neural Networks"; on a CPU 3× faster than their batch-grouped
convolution).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainvitals.core.per_example._common import Workspace
from trainvitals.core.per_example.linear import OuterProductRule
from trainvitals.core.per_example.registry import register_per_example_rule

_ConvNd = nn.Conv1d | nn.Conv2d


def _padded_input(module: _ConvNd, inputs: Tensor, dtype: torch.dtype) -> Tensor:
    """The convolution's input with its padding (any ``padding_mode``, also ``"same"``) applied."""
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(inputs.to(dtype), module._reversed_padding_repeated_twice, mode=mode)


def _conv_patches(module: _ConvNd, inputs: Tensor, dtype: torch.dtype, workspace: Workspace | None = None) -> Tensor:
    """The receptive field of each output position, ``(B, T, I)`` with I = C_in · kernel size in the
    order of the weight's dimensions (a transposed view of a contiguous ``(B, I, T)``, im2col's layout).

    One copy from a strided window view: 2–3× faster on a CPU than ``F.unfold``.
    """
    x = _padded_input(module, inputs, dtype)
    for dim, (size, dilation, stride) in enumerate(zip(module.kernel_size, module.dilation, module.stride), 2):
        x = x.unfold(dim, dilation * (size - 1) + 1, stride)[..., ::dilation]  # a window dimension appended
    kernel_dims = len(module.kernel_size)
    x = x.movedim(tuple(range(2, 2 + kernel_dims)), tuple(range(-kernel_dims, 0)))  # (B, C_in, *kernel, *positions)
    x = x.contiguous() if workspace is None else workspace.take("patches", x.shape, x).copy_(x)
    return x.view(x.shape[0], math.prod(x.shape[1:-kernel_dims]), math.prod(x.shape[-kernel_dims:])).transpose(1, 2)


@register_per_example_rule(nn.Conv1d, nn.Conv2d)
class ConvRule(OuterProductRule):
    """nn.Conv1d/2d without groups, any padding mode."""

    def unsupported(self, module: nn.Module) -> str | None:
        return "grouped convolution" if module.groups != 1 else None

    def _gradients(self, module: nn.Module, grad_output: Tensor) -> Tensor:
        return grad_output.flatten(2).transpose(1, 2)

    def _activations(self, module: nn.Module, inputs: Tensor, dtype: torch.dtype,
                     workspace: Workspace | None) -> Tensor:
        return _conv_patches(module, inputs, dtype, workspace)

    def _fan_in(self, module: nn.Module, inputs: Tensor) -> int:
        return module.in_channels * math.prod(module.kernel_size)

    def _copies_activations(self, module: nn.Module) -> bool:
        return True
