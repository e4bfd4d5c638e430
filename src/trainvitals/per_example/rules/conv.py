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
less for the layer's shapes (I and O per group; both need the patches A): their multiply-adds, the Gram
matrices' counted at 1/1.2 (:func:`~trainvitals.per_example.tensor_ops.gram_is_cheaper` with
``_GRAM_SPEED``). Over 343 shapes (T 4–256, I 9–1152, O 8–512, in a convolution's layouts, one CPU
thread) the form it picks is on average 2.0 % slower than the faster of the two (2.5 % with the
multiply-adds alone, as the Linear rule counts them; 6.0 % for 2T² ≤ I·O, the Linear rule's choice before:
2026-12-02, a loaded machine). The digits CNN's second convolution (T 64, I 144, O 32) takes the blocks
(the Gram form has 2.4× their FLOPs); a late ResNet stage, few positions and wide channels (T 16, I 576,
O 128), the Gram matrices (6.5× fewer). A zero-padded stride-1 "same" convolution (most of a CNN's) forms its blocks without the
patches, from strided reads of a few shifted copies of its input (:func:`_shifted_block_sq_norms`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainvitals.per_example import tensor_ops
from trainvitals.per_example.registry import Use, register_per_example_rule
from trainvitals.per_example.rules.linear import OuterProductRule
from trainvitals.per_example.tensor_ops import Workspace, _accumulation_dtype, _moments, _trainable, gram_is_cheaper


class _Shifted(NamedTuple):
    """The input of a "same"-width convolution laid out for shifted reads (:func:`_shifted_source`)."""

    source: Tensor  # (B, C, K', L): one copy of the flattened input per offset of the trailing kernel dimensions
    base: int  # where output position 0 reads for a total shift of 0
    leading: list[int]  # the shift of each offset of the first kernel dimension, in flat input positions
    positions: int  # T


def _shifted_source(
    module: nn.modules.conv._ConvNd, inputs: Tensor, dtype: torch.dtype, workspace: Workspace | None
) -> _Shifted | None:
    """For a zero-padded stride-1 convolution whose output keeps the input's sizes but the first spatial
    one ("same" padding), the input laid out so that every receptive field is a strided read; ``None``
    for other convolutions.

    Then output position t (flattened) of kernel offset o reads the input at flat position t + s(o). Copy q,
    one per offset of the trailing kernel dimensions, holds the flattened input moved back by that offset's
    shift σ_q, so the read lands at ``base + s_0(o_0) + t`` of every copy: the copies side by side per
    channel, (channel, copy) is one dimension of stride L. The reads that leave the input are zero: past
    either end of the flattened input (zeros around each copy), or, in the trailing dimensions, wrapped into
    the next or previous row (in each copy the columns such reads land in zeroed).
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
    shifts = [[(d * o - p) * st for o in range(k)] for d, p, k, st in zip(dilation, padding, kernel, strides)]
    sigma = [sum(offsets) for offsets in itertools.product(*shifts[1:])]  # per copy, in copy order
    size, positions = math.prod(spatial), math.prod(out)
    base = max(0, -min(shifts[0]), max(sigma))
    length = max(base - min(sigma) + size, base + max(shifts[0]) + positions)
    shape = (b, c, len(sigma), length)
    like = inputs if inputs.dtype == dtype else inputs.new_empty(0, dtype=dtype)
    source = like.new_zeros(shape) if workspace is None else workspace.take("shifted", shape, like).zero_()
    per_copy = [math.prod(kernel[j + 1 :]) for j in range(1, n)]  # copy index = Σ_j offset_j · per_copy_j
    steps = [per_copy[j - 1] * length - dilation[j] * strides[j] for j in range(1, n)]  # > 0: L ≥ the shifts' span
    bodies = source.as_strided(
        (b, c, *kernel[1:], size), (c * len(sigma) * length, len(sigma) * length, *steps, 1), base - sigma[0]
    )
    bodies.copy_(inputs.reshape(b, c, *[1] * (n - 1), size).expand(bodies.shape))
    grid = bodies.view(b, c, *kernel[1:], *spatial)
    for dim in range(1, n):
        for o in range(kernel[dim]):
            s = shifts[dim][o] // strides[dim]  # reads of columns s.. (s > 0) or ..s (s < 0) past the row's end
            if s:  # wrap into these
                index: list[int | slice] = [slice(None)] * (2 * n + 1)  # (B, C, *trailing kernel, *spatial)
                index[1 + dim] = o
                index[n + 1 + dim] = slice(0, s) if s > 0 else slice(max(spatial[dim] + s, 0), None)
                grid[tuple(index)].zero_()
    return _Shifted(source, base, shifts[0], positions)


def _shifted_patches(
    module: nn.modules.conv._ConvNd, inputs: Tensor, dtype: torch.dtype, workspace: Workspace | None
) -> Tensor | None:
    """The patches of :func:`_conv_patches`, ``(B, C, *kernel, T)``, from :func:`_shifted_source`: each
    patch row is a contiguous run of T, not T/W runs of W as from the window view, copied once; ``None``
    where there is no shifted source."""
    shifted = _shifted_source(module, inputs, dtype, workspace)
    if shifted is None:
        return None
    source, kernel = shifted.source, module.kernel_size
    b, c, copies, length = source.shape
    per_copy = [math.prod(kernel[j + 1 :]) * length for j in range(1, len(kernel))]
    step = shifted.leading[1] - shifted.leading[0] if len(shifted.leading) > 1 else 0
    view = source.as_strided(
        (b, c, *kernel, shifted.positions),
        (c * copies * length, copies * length, step, *per_copy, 1),
        shifted.base + shifted.leading[0],
    )
    return view.contiguous() if workspace is None else workspace.take("patches", view.shape, view).copy_(view)


def _shifted_blocks(
    module: nn.modules.conv._ConvNd, inputs: Tensor, grad_output: Tensor, workspace: Workspace | None
) -> Iterator[Tensor] | None:
    """The per-example blocks Σ_t δ_t a_tᵀ of an ungrouped convolution with a :func:`_shifted_source`, without
    the patches: the block's columns of offset o_0 of the first kernel dimension are δᵀ X_{o_0}, X_{o_0} the
    ``(T, C·K')`` strided read of the source, one batched matmul each (k_0 of them, same FLOPs as one over
    the patches); ``None`` for a grouped convolution or where there is no shifted source. In chunks of
    examples whose source and blocks stay within ``_SCRATCH_BYTES``, each ``(k_0, b, O, C·K')`` (valid until
    the next is taken)."""
    if module.groups != 1:
        return None
    dtype = _accumulation_dtype(grad_output)
    batch, fan_out = grad_output.shape[:2]
    kernel = module.kernel_size
    source = 2 * math.prod(inputs.shape[1:]) * math.prod(kernel[1:])  # K' copies, their margins within 2×
    blocks = fan_out * inputs.shape[1] * math.prod(kernel)
    chunk = max(1, tensor_ops._SCRATCH_BYTES // ((source + blocks) * dtype.itemsize))
    whole = chunk >= batch

    def shifted_at(start: int) -> _Shifted | None:
        return _shifted_source(module, inputs if whole else inputs[start : start + chunk], dtype, workspace)

    first = shifted_at(0)
    if first is None:
        return None

    def each_chunk() -> Iterator[Tensor]:
        for start in range(0, max(batch, 1), chunk):
            shifted = first if start == 0 else shifted_at(start)
            assert shifted is not None, "a chunk of the same convolution and input sizes"
            b, c, copies, length = shifted.source.shape
            g = (grad_output if whole else grad_output[start : start + chunk]).to(dtype).flatten(2)  # (b, O, T)
            shape = (kernel[0], b, fan_out, c * copies)
            out = shifted.source.new_empty(shape) if workspace is None else workspace.take("blocks", shape, g)
            for o, shift in enumerate(shifted.leading):
                rows = shifted.source.as_strided(
                    (b, shifted.positions, c * copies), (c * copies * length, 1, length), shifted.base + shift
                )
                torch.bmm(g, rows, out=out[o])
            yield out

    return each_chunk()


def _shifted_block_sq_norms(
    module: nn.modules.conv._ConvNd, inputs: Tensor, grad_output: Tensor, workspace: Workspace | None
) -> Tensor | None:
    """‖Σ_t δ_t a_tᵀ‖²_F per example from :func:`_shifted_blocks`; ``None`` where there are none."""
    blocks = _shifted_blocks(module, inputs, grad_output, workspace)
    if blocks is None:
        return None
    parts = [torch.linalg.vector_norm(out, dim=(0, 2, 3)).square() for out in blocks]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


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
# The fewest columns C·K' of the strided reads worth k_0 matmuls instead of one over the patches: an image
# model's first layer (C = 1, 3×3: 3 columns) is 1.3× slower so, C = 3 (9) 0.76×, conv 2 of the digits CNN
# (48) 0.90× (CPU, one thread, paired).
_ROW_COLUMNS = 8


# In a convolution's layouts (transposed views of the patches and the output gradient) the Gram matrices'
# multiply-adds run this much faster than the blocks' (inner dimensions I and O against T, on a CPU):
# fitted on the 343 shapes of ``bench_per_example_rules.py --only forms`` (1.1–1.2 equally good there).
_GRAM_SPEED = 1.2


@register_per_example_rule(nn.Conv1d, nn.Conv2d, nn.Conv3d)
class ConvRule(OuterProductRule):
    """nn.Conv1d/2d/3d, any padding mode and groups (depthwise too).

    Args:
        form: how the weight's squared norms are computed: ``"cost"`` (the default) the cheaper form by
            :func:`~trainvitals.per_example.tensor_ops.gram_is_cheaper`, ``"blocks"`` always from the per-example blocks, ``"gram"`` always
            from the ghost Gram matrices (register an instance to force one:
            ``register_per_example_rule(nn.Conv2d)(ConvRule(form="gram"))``). Exact either way.

    Raises:
        ValueError: for another ``form``.
    """

    def __init__(self, form: str = "cost") -> None:
        if form not in FORMS:
            raise ValueError(f"`form` must be one of {FORMS}, got {form!r}")
        self.form = form
        self._decided: dict[tuple[int, torch.Size], bool] = {}

    def _gram(self, positions: int, fan_in: int, fan_out: int) -> bool:
        # Two integer products: no cache needed to keep the step's Python cost at a dict lookup's.
        return gram_is_cheaper(positions, fan_in, fan_out, _GRAM_SPEED) if self.form == "cost" else self.form == "gram"

    def _shapes(self, module: nn.Module, input_shape: Sequence[int]) -> tuple[int, int, int]:
        """T, I and O of one group of ``module`` on an input of ``input_shape``, ``(B, C, *spatial)``."""
        spatial, n, pad = input_shape[2:], len(input_shape) - 2, module._reversed_padding_repeated_twice
        out = [
            (s + pad[2 * (n - 1 - j)] + pad[2 * (n - 1 - j) + 1] - d * (k - 1) - 1) // st + 1
            for j, (s, d, k, st) in enumerate(zip(spatial, module.dilation, module.kernel_size, module.stride))
        ]
        kernel = math.prod(module.kernel_size)
        return math.prod(out), module.in_channels // module.groups * kernel, module.out_channels // module.groups

    def sq_norms(self, module: nn.Module, uses: Sequence[Use], workspace: Workspace | None = None) -> Tensor:
        # One call of an ungrouped "same"-width convolution in the blocks form: without the patches.
        trainable = _trainable(module)
        if len(uses) == 1 and "weight" in trainable and self._rows(module, uses[0].inputs.shape):
            inputs, grad_output = uses[0]
            sq = _shifted_block_sq_norms(module, inputs, grad_output, workspace)
            if sq is not None:
                return sq + self._bias_grads(module, uses).square().sum(1) if "bias" in trainable else sq
        return super().sq_norms(module, uses, workspace)

    def measure(
        self, module: nn.Module, uses: Sequence[Use], workspace: Workspace | None, rows: Mapping[str, slice]
    ) -> tuple[Tensor, dict[str, tuple[Tensor, Tensor]]]:
        """A call that :meth:`sq_norms` measures from shifted reads: the weight's norms and sums of the blocks
        formed once, from those reads (no patches); other calls as :class:`OuterProductRule` measures them."""
        trainable = _trainable(module)
        if "weight" in rows and len(uses) == 1 and "weight" in trainable and self._rows(module, uses[0].inputs.shape):
            inputs, grad_output = uses[0]
            blocks = _shifted_blocks(module, inputs, grad_output, workspace)
            if blocks is not None:
                r, parts, total = rows["weight"], [], None
                for out in blocks:  # (k_0, b, O, C·K'): the weight's (O, C, k_0, *K') with k_0 first
                    parts.append(torch.linalg.vector_norm(out, dim=(0, 2, 3)).square())
                    part = _moments(out[:, :, r].transpose(0, 1))
                    total = part if total is None else (total[0].add_(part[0]), total[1].add_(part[1]))
                assert total is not None, "an empty batch is one empty chunk"
                k0, channels = module.kernel_size[0], inputs.shape[1]
                weight = tuple(
                    t.view(k0, t.shape[1], channels, *module.kernel_size[1:]).movedim(0, 2).contiguous() for t in total
                )
                sq = parts[0] if len(parts) == 1 else torch.cat(parts)
                return self._with_bias(module, uses, rows, sq, {"weight": weight})  # type: ignore[dict-item]
        return super().measure(module, uses, workspace, rows)

    def _norms_from_blocks(self) -> bool:
        return self.form != "gram"

    def _rows(self, module: nn.Module, input_shape: torch.Size) -> bool:
        """Whether a call on ``input_shape`` may take the blocks form without patches
        (:func:`_shifted_block_sq_norms`), decided once per module and input shape (the step's Python cost
        a dict lookup). An entry of a module whose id a new one took costs speed, not exactness: the path
        checks what it needs (ungrouped, a shifted source) itself."""
        key = (id(module), input_shape)
        rows = self._decided.get(key)
        if rows is None:
            if len(self._decided) >= 256:  # shapes that keep changing: a bounded cache
                self._decided.clear()
            rows = self._decided[key] = (
                not module.transposed
                and module.groups == 1
                and module.in_channels * math.prod(module.kernel_size[1:]) >= _ROW_COLUMNS
                and self.form_for(module, input_shape) == "blocks"
            )
        return rows

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
