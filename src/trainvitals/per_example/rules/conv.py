"""Convolutions: y_t = W a_t + b with a_t the receptive field of output position t.

T = output positions, I = C_in · kernel size; the blocks are then one batched matmul with the FLOPs of
the layer's own weight gradient (the im2col view of Rochette et al. 2019, "Efficient Per-Example
Gradient Computations in Convolutional Neural Networks"; on a CPU 3× faster than their batch-grouped
convolution).

A transposed convolution y = Cᵀ_W x is the adjoint of the convolution C_W (same weight, stride,
padding, dilation) from y's channels to x's: ⟨δ, Cᵀ_W x⟩ = ⟨C_W δ, x⟩, so its weight gradient is that
of C_W run on the output gradient δ with x as the gradient of C_W's output — the same outer products,
with the receptive fields taken of δ and the input x in the role of the output gradient.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainvitals.per_example.registry import Use, register_per_example_rule
from trainvitals.per_example.rules.linear import OuterProductRule
from trainvitals.per_example.tensor_ops import Workspace, _accumulation_dtype


def _shifted_patches(
    module: nn.modules.conv._ConvNd, inputs: Tensor, dtype: torch.dtype, workspace: Workspace | None
) -> Tensor | None:
    """The patches of :func:`_conv_patches`, ``(B, C, *kernel, T)``, for a zero-padded stride-1 convolution
    whose output keeps the input's sizes but the first spatial one ("same" padding); ``None`` for others.

    Then output position t (flattened) of kernel offset o reads the input at flat position t + s(o), one
    shift per offset: each patch row is a contiguous run of T, not T/W runs of W as from the window view.
    The shifted reads that leave the input are zero: past either end of the flattened input (a source
    buffer with zeros there), or, in the trailing dimensions, wrapped into the next or previous row (per
    offset of those dimensions a copy of the input with the columns such reads land in zeroed). The patches
    are then one strided view of that buffer, copied once.
    """
    spatial, kernel, dilation = inputs.shape[2:], module.kernel_size, module.dilation
    n = len(spatial)
    padding = [module._reversed_padding_repeated_twice[2 * (n - 1 - j)] for j in range(n)]  # the leading side
    out = [
        s + sum(module._reversed_padding_repeated_twice[2 * (n - 1 - j) : 2 * (n - j)]) - d * (k - 1)
        for j, (s, d, k) in enumerate(zip(spatial, dilation, kernel))
    ]
    if (
        module.transposed
        or module.padding_mode != "zeros"
        or any(s != 1 for s in module.stride)
        or list(spatial[1:]) != out[1:]
        or out[0] < 1
    ):
        return None
    b, c = inputs.shape[:2]
    strides = [math.prod(spatial[j + 1 :]) for j in range(n)]  # of the flattened input
    shifts = [[d * o - p for o in range(k)] for d, p, k in zip(dilation, padding, kernel)]
    size, positions = math.prod(spatial), math.prod(out)
    lowest, highest = (sum(f(s) * st for s, st in zip(shifts, strides)) for f in (min, max))
    before = max(0, -lowest)  # zeros before and after the flattened input, for the reads past its ends
    length = before + size + max(0, positions + highest - size)
    copies = math.prod(kernel[1:])  # one per offset of the trailing dimensions
    shape = (copies, b, c, length)
    like = inputs if inputs.dtype == dtype else inputs.new_empty(0, dtype=dtype)
    if workspace is None:
        source = like.new_zeros(shape)
    else:  # the body is copied over below: only the reads past either end need zeros
        source = workspace.take("shifted", shape, like)
        source[..., :before].zero_()
        source[..., before + size :].zero_()
    body = source[..., before : before + size]
    body.copy_(inputs.reshape(1, b, c, size).expand(copies, b, c, size))
    grid = body.view(copies, b, c, *spatial)
    for index, offsets in enumerate(itertools.product(*(range(k) for k in kernel[1:]))):
        for dim, o in enumerate(offsets, 1):
            s = shifts[dim][o]  # reads of columns s.. (s > 0) or ..s (s < 0) past the row's end wrap into these
            if s:
                wrapped = [slice(None)] * n
                wrapped[dim] = slice(0, s) if s > 0 else slice(max(spatial[dim] + s, 0), None)
                grid[(index, slice(None), slice(None), *wrapped)].zero_()
    per_copy = [math.prod(kernel[j + 1 :]) for j in range(1, n)]  # copy index = Σ_j offset_j · per_copy_j
    view = source.as_strided(
        (b, c, *kernel, positions),
        (
            c * length,
            length,
            dilation[0] * strides[0],
            *(dilation[j] * strides[j] + per_copy[j - 1] * b * c * length for j in range(1, n)),
            1,
        ),
        before - sum(p * st for p, st in zip(padding, strides)),
    )
    return view.contiguous() if workspace is None else workspace.take("patches", view.shape, view).copy_(view)


def _conv_patches(
    module: nn.modules.conv._ConvNd, inputs: Tensor, dtype: torch.dtype, workspace: Workspace | None = None
) -> Tensor:
    """The receptive field of each output position of the convolution ``module`` describes (its kernel,
    stride, dilation and padding; for a transposed convolution, of the convolution it is the adjoint
    of) on ``inputs``, ``(B, T, I)`` with I = channels · kernel size in the order of the weight's
    dimensions (a transposed view of a contiguous ``(B, I, T)``, im2col's layout).

    A "same" stride-1 convolution: :func:`_shifted_patches`; others: one copy from a strided window view,
    2–3× faster on a CPU than ``F.unfold``.
    """
    kernel_dims = len(module.kernel_size)
    x = _shifted_patches(module, inputs, dtype, workspace)
    if x is None:
        if module.transposed:
            pad = tuple(p for p in reversed(module.padding) for _ in range(2))
            x = F.pad(inputs.to(dtype), pad)
        else:  # any ``padding_mode``, also ``"same"``
            mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
            x = F.pad(inputs.to(dtype), module._reversed_padding_repeated_twice, mode=mode)
        for dim, (size, dilation, stride) in enumerate(zip(module.kernel_size, module.dilation, module.stride), 2):
            x = x.unfold(dim, dilation * (size - 1) + 1, stride)[..., ::dilation]  # a window dimension appended
        x = x.movedim(tuple(range(2, 2 + kernel_dims)), tuple(range(-kernel_dims, 0)))  # (B, C, *kernel, *positions)
        x = x.contiguous() if workspace is None else workspace.take("patches", x.shape, x).copy_(x)
    split = 2 + kernel_dims
    return x.view(x.shape[0], math.prod(x.shape[1:split]), math.prod(x.shape[split:])).transpose(1, 2)


@register_per_example_rule(nn.Conv1d, nn.Conv2d, nn.Conv3d)
class ConvRule(OuterProductRule):
    """nn.Conv1d/2d/3d, any padding mode and groups (depthwise too)."""

    def _gradients(self, module: nn.Module, use: Use) -> Tensor:
        return use.grad_output.flatten(2).transpose(1, 2)

    def _activations(
        self, module: nn.Module, use: Use, start: int, stop: int, dtype: torch.dtype, workspace: Workspace | None
    ) -> Tensor:
        return _conv_patches(
            module, use.inputs if start == 0 and stop >= len(use.inputs) else use.inputs[start:stop], dtype, workspace
        )

    def _fan_in(self, module: nn.Module, use: Use) -> int:
        return module.in_channels * math.prod(module.kernel_size)

    def _copies_activations(self, module: nn.Module) -> bool:
        return True


@register_per_example_rule(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
class ConvTransposeRule(ConvRule):
    """nn.ConvTranspose1d/2d/3d (any stride, padding, output padding, dilation, groups): the adjoint
    convolution's outer products, receptive fields of the output gradient against the input."""

    def _gradients(self, module: nn.Module, use: Use) -> Tensor:
        return use.inputs.flatten(2).transpose(1, 2)

    def _activations(
        self, module: nn.Module, use: Use, start: int, stop: int, dtype: torch.dtype, workspace: Workspace | None
    ) -> Tensor:
        return _conv_patches(module, use.grad_output[start:stop], dtype, workspace)

    def _fan_in(self, module: nn.Module, use: Use) -> int:
        return module.out_channels * math.prod(module.kernel_size)

    def _bias_grads(self, module: nn.Module, uses: Sequence[Use]) -> Tensor:
        dtype = _accumulation_dtype(uses[0].grad_output)
        return sum(u.grad_output.to(dtype).flatten(2).sum(2) for u in uses)  # type: ignore[return-value]
