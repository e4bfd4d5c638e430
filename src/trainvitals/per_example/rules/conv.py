"""Convolutions: y_t = W a_t + b with a_t the receptive field of output position t.

T = output positions, I = C_in · kernel size; the blocks are then one batched matmul with the FLOPs of
the layer's own weight gradient (the im2col view of Rochette et al. 2019, "Efficient Per-Example
Gradient Computations in Convolutional Neural Networks"; on a CPU 3× faster than their batch-grouped
convolution).

A transposed convolution y = Cᵀ_W x is the adjoint of the convolution C_W (same weight, stride,
padding, dilation) from y's channels to x's: ⟨δ, Cᵀ_W x⟩ = ⟨C_W δ, x⟩, so its weight gradient is that
of C_W run on the output gradient δ with x as the gradient of C_W's output — the same outer products,
with the receptive fields taken of δ and the input x in the role of the output gradient.

The weight's squared norms come from the per-example blocks Σ_t δ_t a_tᵀ (B·T·I·O multiply-adds) or
from the ghost Gram matrices ⟨A Aᵀ, Δ Δᵀ⟩ (B·T²·(I + O); the ghost clipping of Li et al. 2022, "Large
Language Models Can Be Strong Differentially Private Learners", there for sequences), whichever costs
fewer FLOPs for the layer's shapes (I and O per group): both need the patches A, so the FLOPs decide.
Over 343 shapes (T 4–256, I 9–1152, O 8–512, one CPU thread) the form it picks is on average 3 % slower
than the faster of the two, against 16 % for the Linear rule's smaller-temporaries choice (2T² ≤ I·O).
The digits CNN's second convolution (T 64, I 144, O 32) takes the blocks (the Gram form has 2.4× their
FLOPs); a late ResNet stage, few positions and wide channels (T 16, I 576, O 128), the Gram matrices
(6.5× fewer).
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


FORMS = ("cost", "blocks", "gram")


def gram_is_cheaper(positions: int, fan_in: int, fan_out: int) -> bool:
    """The cost model: the ghost Gram matrices' T²·(I + O) multiply-adds per example against the
    per-example block's T·I·O, for T output positions, I input and O output features of one group."""
    return positions * (fan_in + fan_out) <= fan_in * fan_out


@register_per_example_rule(nn.Conv1d, nn.Conv2d, nn.Conv3d)
class ConvRule(OuterProductRule):
    """nn.Conv1d/2d/3d, any padding mode and groups (depthwise too).

    Args:
        form: how the weight's squared norms are computed: ``"cost"`` (the default) the cheaper form by
            :func:`gram_is_cheaper`, ``"blocks"`` always from the per-example blocks, ``"gram"`` always
            from the ghost Gram matrices (register an instance to force one:
            ``register_per_example_rule(nn.Conv2d)(ConvRule(form="gram"))``). Exact either way.

    Raises:
        ValueError: for another ``form``.
    """

    def __init__(self, form: str = "cost") -> None:
        if form not in FORMS:
            raise ValueError(f"`form` must be one of {FORMS}, got {form!r}")
        self.form = form

    def _gram(self, positions: int, fan_in: int, fan_out: int) -> bool:
        # Two integer products: no cache needed to keep the step's Python cost at a dict lookup's.
        return gram_is_cheaper(positions, fan_in, fan_out) if self.form == "cost" else self.form == "gram"

    def _shapes(self, module: nn.Module, input_shape: Sequence[int]) -> tuple[int, int, int]:
        """T, I and O of one group of ``module`` on an input of ``input_shape``, ``(B, C, *spatial)``."""
        spatial, n, pad = input_shape[2:], len(input_shape) - 2, module._reversed_padding_repeated_twice
        out = [
            (s + pad[2 * (n - 1 - j)] + pad[2 * (n - 1 - j) + 1] - d * (k - 1) - 1) // st + 1
            for j, (s, d, k, st) in enumerate(zip(spatial, module.dilation, module.kernel_size, module.stride))
        ]
        kernel = math.prod(module.kernel_size)
        return math.prod(out), module.in_channels // module.groups * kernel, module.out_channels // module.groups

    def form_for(self, module: nn.Module, input_shape: Sequence[int]) -> str:
        """``"blocks"`` or ``"gram"``: the form :meth:`sq_norms` takes ``module``'s weight norms in for a
        call on an input of ``input_shape`` (one call; several have the positions of all). One position
        is ‖a‖²·‖δ‖², the 1×1 Gram matrices, in either form."""
        positions, fan_in, fan_out = self._shapes(module, input_shape)
        return "gram" if positions == 1 or self._gram(positions, fan_in, fan_out) else "blocks"

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

    def _shapes(self, module: nn.Module, input_shape: Sequence[int]) -> tuple[int, int, int]:
        kernel = math.prod(module.kernel_size)
        fan_in, fan_out = module.out_channels // module.groups * kernel, module.in_channels // module.groups
        return math.prod(input_shape[2:]), fan_in, fan_out

    def _bias_grads(self, module: nn.Module, uses: Sequence[Use]) -> Tensor:
        dtype = _accumulation_dtype(uses[0].grad_output)
        return sum(u.grad_output.to(dtype).flatten(2).sum(2) for u in uses)  # type: ignore[return-value]
