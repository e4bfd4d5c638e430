"""Per-example gradient statistics computed in the same backward pass, without per-example gradients.

Notation as in :mod:`trainvitals.core.noise` and docs/science.md §3: per-example gradient g_i = ∇ℓ_i of
each example's own (un-averaged) loss, B examples, batch gradient ḡ = (1/B) Σ_i g_i.

For a layer y = W a (+ b), g_i's weight block is Σ_t δ_{i,t} a_{i,t}ᵀ, where a_{i,t} is the layer input
and δ_{i,t} = ∂L/∂y_{i,t} the output gradient at position t of example i (T = 1 for a plain 2-D input).
Its squared norm needs no per-example gradient (Goodfellow 2015, "Efficient Per-Example Gradient
Computations"; the sequence case: Li et al. 2022, "ghost clipping"; Gray et al. 2023–2024 and
CerebrasResearch/nanoGNS for the gradient noise scale):

    ‖Σ_t δ_t a_tᵀ‖²_F = Σ_{t,s} (a_t·a_s)(δ_t·δ_s) = ⟨A Aᵀ, Δ Δᵀ⟩_F            (the "ghost norm")

which costs O(T²(I + O)) per example against O(T·I·O) for materialising the I×O block; the cheaper
of the two is used per layer (ghost when 2T² ≤ I·O). Conv1d/Conv2d reduce to the same form with a_t
the receptive field of output position t (T = output positions, I = C_in·kernel size); their blocks
are then one batched matmul with the FLOPs of the layer's own weight gradient (the im2col view of
Rochette et al. 2019, "Efficient Per-Example Gradient Computations in Convolutional Neural Networks";
on a CPU 3× faster than their batch-grouped convolution). Embedding reduces to a segment sum
over repeated tokens, LayerNorm to (B, D) per-example vectors (as small as one activation row).

Per-coordinate sums Σ_i g_{i,d} and Σ_i g_{i,d}² (the mean and variance of each coordinate) are cheap
for 2-D Linear inputs, ΔᵀA and (Δ²)ᵀ(A²); for the other layer types they come from the layer's
per-example gradients, formed one chunk of examples at a time. Both come from the same operands, so
that the variance is not the rounding difference between them and a differently rounded ``.grad``.

Layers without an identity fall back to :func:`vmap_per_example_grads`: ``torch.func`` per-example
vector-Jacobian products of the module's own forward, seeded with the captured output gradients.

Units: the hooks see the gradient of whatever loss was back-propagated (divided by the accumulation
steps, multiplied by an AMP scale, averaged over the batch or not); :class:`PerExampleGradients` takes
a per-micro-batch factor that converts them to the example's own loss. :func:`detect_loss_reduction`
finds whether the batch loss was a mean or a sum over examples.

Everything here stays on the device; nothing syncs with the host. No Lightning import.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle

PER_EXAMPLE_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding, nn.LayerNorm)

_SCALAR_OPS = frozenset({
    "MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1", "AddBackward0", "SubBackward0",
    "NegBackward0", "ToCopyBackward0", "CloneBackward0", "AliasBackward0", "ViewBackward0",
    "SqueezeBackward0", "SqueezeBackward1", "UnsqueezeBackward0",
})
_MEAN_OPS = frozenset({"MeanBackward0", "MeanBackward1"})
_SUM_OPS = frozenset({"SumBackward0", "SumBackward1"})
_REDUCTION_CODES = {1: "mean", 2: "sum"}  # at::Reduction, as saved by the loss nodes (NllLoss, MseLoss, ...)
_MAX_GRAPH_NODES = 64


def _accumulation_dtype(t: Tensor) -> torch.dtype:
    # fp16/bf16 squared norms overflow or underflow (docs/science.md §2); float64 stays float64.
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def unsupported_reason(module: nn.Module) -> str | None:
    """Why ``module``'s parameters have no same-backward per-example identity here; ``None`` if they have."""
    if not isinstance(module, PER_EXAMPLE_LAYERS):
        return f"{type(module).__name__} has no per-example identity"
    if isinstance(module, (nn.Conv1d, nn.Conv2d)) and module.groups != 1:
        return "grouped convolution"
    if isinstance(module, nn.Embedding) and (module.scale_grad_by_freq or module.sparse):
        return "Embedding with scale_grad_by_freq couples the examples" if module.scale_grad_by_freq else "sparse Embedding"
    return None


def _padded_input(module: nn.Conv1d | nn.Conv2d, inputs: Tensor, dtype: torch.dtype) -> Tensor:
    """The convolution's input with its padding (any ``padding_mode``, also ``"same"``) applied."""
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(inputs.to(dtype), module._reversed_padding_repeated_twice, mode=mode)


def _ghost_is_cheaper(positions: int, fan_in: int, fan_out: int) -> bool:
    """Ghost Gram matrices, O(T²(I + O)), against the per-example I×O block, O(T·I·O): 2T² ≤ I·O."""
    return 2 * positions * positions <= fan_in * fan_out


class Workspace:
    """Buffers that the per-example computations of every layer and step reuse for their largest
    temporaries (a convolution's patches, per-example blocks, ghost Gram matrices): one per role, each
    at most ``_SCRATCH_BYTES`` (or one example's worth, if that is more), kept between steps.

    On a CPU, glibc's malloc hands blocks of this size back to the operating system when they are
    freed, so fresh ones page-fault on every step: in the demo CNN ~860 faults, half of the probe's
    time in its second convolution. The layers of one backward on one device run one after another,
    so one buffer per role, device and dtype serves them all (autograd runs each device's part of a
    backward in its own thread).
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.device, torch.dtype], Tensor] = {}

    def take(self, role: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """An uninitialised ``shape`` tensor of ``like``'s dtype and device, valid until ``role`` is taken
        again on that device."""
        numel, key = math.prod(shape), (role, like.device, like.dtype)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[key] = like.new_empty(numel)
        return buffer[:numel].view(shape)


def _conv_patches(module: nn.Conv1d | nn.Conv2d, inputs: Tensor, dtype: torch.dtype,
                  workspace: Workspace | None = None) -> Tensor:
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


def _as_weight(module: nn.Module, block: Tensor) -> Tensor:
    """A ``(*, O, I)`` block of :func:`_outer_chunks`'s operands in the shape of ``module.weight``."""
    return block.reshape(*block.shape[:-2], *module.weight.shape)


_SCRATCH_BYTES = 16 * 2**20  # the largest temporary of a chunk of examples: patches, blocks or Gram matrix


def _outer_chunks(module: nn.Module, inputs: Tensor, grad_output: Tensor,
                  workspace: Workspace | None = None) -> Iterator[tuple[Tensor, Tensor]]:
    """Linear or convolution as y_t = W a_t: activations ``(b, T, I)`` and output gradients ``(b, T, O)``,
    for consecutive chunks of b examples.

    A chunk's largest temporary — a convolution's patches (T·I per example, :func:`_conv_patches`),
    the per-example blocks (O·I) or a ghost Gram matrix (T²) — stays within ``_SCRATCH_BYTES`` (a
    ResNet's first stage at 224×224 has ~7 MB of patches per example, a 768→3072 Linear 9 MB blocks).
    """
    dtype = _accumulation_dtype(grad_output)
    batch = inputs.shape[0]
    linear = isinstance(module, nn.Linear)
    # Views until a chunk is taken: a bf16 layer's operands are widened one chunk at a time.
    if linear:
        a, g = _by_position(inputs), _by_position(grad_output)
        fan_in = a.shape[2]
    else:
        assert isinstance(module, (nn.Conv1d, nn.Conv2d))
        g = grad_output.flatten(2).transpose(1, 2)
        fan_in = module.in_channels * math.prod(module.kernel_size)
    positions, fan_out = g.shape[1], g.shape[2]
    patches = 0 if linear else positions * fan_in
    largest = max(patches, fan_out * fan_in, positions * positions) if positions > 1 else 1
    chunk = max(1, _SCRATCH_BYTES // (largest * dtype.itemsize))
    for start in range(0, max(batch, 1), chunk):  # an empty batch is one empty chunk
        stop = start + chunk
        x = a[start:stop].to(dtype) if linear else _conv_patches(module, inputs[start:stop], dtype, workspace)
        yield x, g[start:stop].to(dtype)


def _outer_sq_norms(a: Tensor, g: Tensor, workspace: Workspace | None = None) -> Tensor:
    """‖Σ_t g_t a_tᵀ‖²_F per example, ``(B, T, I)``, ``(B, T, O)`` → ``(B,)``; ghost Gram when 2T² ≤ I·O."""
    # Reductions straight from the operands (vecdot, vector_norm): no squared temporary of the size of
    # the Gram matrices or blocks, whose allocation per step costs more than the arithmetic on a CPU.
    t, i, o = a.shape[1], a.shape[2], g.shape[2]
    if t == 1:
        return _sq_norms(a) * _sq_norms(g)
    if _ghost_is_cheaper(t, i, o):
        return torch.linalg.vecdot(_bmm(a, a.transpose(1, 2), workspace, "gram_a").flatten(1),
                                   _bmm(g, g.transpose(1, 2), workspace, "gram_g").flatten(1))
    return _sq_norms(_bmm(g.transpose(1, 2), a, workspace, "blocks"))


def _bmm(x: Tensor, y: Tensor, workspace: Workspace | None, role: str) -> Tensor:
    """``torch.bmm(x, y)``, into the workspace's ``role`` buffer when there is one."""
    out = None if workspace is None else workspace.take(role, (x.shape[0], x.shape[1], y.shape[2]), x)
    return torch.bmm(x, y, out=out)


def _sq_norms(x: Tensor) -> Tensor:
    """Squared norm of each example's slice, ``(B, *)`` → ``(B,)``."""
    return torch.linalg.vector_norm(x.flatten(1), dim=1).square()


def _outer_sums(a: Tensor, g: Tensor, workspace: Workspace | None = None) -> tuple[Tensor, Tensor]:
    """Σ_i and Σ_i (·)², elementwise, of the per-example blocks Σ_t g_t a_tᵀ, ``(b, T, I)``, ``(b, T, O)``
    → two ``(O, I)``: ΔᵀA and (Δ²)ᵀ(A²) when T = 1."""
    if a.shape[1] == 1:
        a, g = a[:, 0], g[:, 0]
        return g.t() @ a, g.square().t() @ a.square()
    blocks = _bmm(g.transpose(1, 2), a, workspace, "blocks")
    return blocks.sum(0), blocks.square_().sum(0)


def _by_position(t: Tensor) -> Tensor:
    """A Linear layer's ``(B, *, F)`` input or output gradient as ``(B, T, F)`` (T = 1 for 2-D)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:-1]), t.shape[-1])


def _bias_grads(module: nn.Linear | nn.Conv1d | nn.Conv2d, grad_output: Tensor) -> Tensor:
    """Per-example bias gradients ``(B, O)``: the output gradient summed over positions."""
    g = grad_output.to(_accumulation_dtype(grad_output))
    if isinstance(module, nn.Linear):
        return _by_position(g).sum(1)
    return g.flatten(2).sum(2)


def _layer_norm_grads(module: nn.LayerNorm, inputs: Tensor, grad_output: Tensor) -> dict[str, Tensor]:
    dtype = _accumulation_dtype(grad_output)
    shape = tuple(module.normalized_shape)
    dims = tuple(range(-len(shape), 0))
    x = inputs.to(dtype)
    centred = x - x.mean(dims, keepdim=True)
    # LayerNorm's biased variance, as a mean: ``Tensor.var`` warns on an empty batch.
    x_hat = centred * torch.rsqrt(centred.square().mean(dims, keepdim=True) + module.eps)
    g = grad_output.to(dtype)
    by_position = (g.shape[0], math.prod(g.shape[1:g.dim() - len(shape)]), *shape)  # (B, T, *normalized_shape)
    out = {}
    if module.weight is not None:
        out["weight"] = (g * x_hat).reshape(by_position).sum(1)
    if module.bias is not None:
        out["bias"] = g.reshape(by_position).sum(1)
    return out


def _embedding_rows(module: nn.Embedding, indices: Tensor, grad_output: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Rows of the per-example Embedding gradients, repeated tokens summed, without a host sync.

    Returns ``(rows, example, token)``: ``rows`` ``(N, D)`` with N = B·T (rows beyond the distinct
    (example, token) pairs are zero), and the example and token index of each row, ``(N,)``.
    """
    batch, vocab = indices.shape[0], module.num_embeddings
    idx = indices.reshape(batch, math.prod(indices.shape[1:]))
    g = grad_output.to(_accumulation_dtype(grad_output)).reshape(idx.numel(), module.embedding_dim)
    if module.padding_idx is not None:
        g = g * (idx.reshape(-1, 1) != module.padding_idx)
    key = (torch.arange(batch, device=idx.device).unsqueeze(1) * vocab + idx).reshape(-1)
    sorted_key, order = key.sort()
    first = torch.ones_like(sorted_key, dtype=torch.bool)
    first[1:] = sorted_key[1:] != sorted_key[:-1]
    segment = first.long().cumsum(0) - 1
    rows = g.new_zeros(g.shape).index_add_(0, segment, g[order])
    segment_key = torch.zeros_like(sorted_key).scatter_(0, segment, sorted_key)
    return rows, segment_key // vocab, segment_key % vocab


def _trainable(module: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}


def per_example_sq_norms(module: nn.Module, inputs: Tensor, grad_output: Tensor,
                         workspace: Workspace | None = None) -> Tensor:
    """Σ over ``module``'s own trainable parameters of ‖g_i‖², per example, from one backward pass.

    Args:
        module: a layer for which :func:`unsupported_reason` is ``None``.
        inputs: its input, batch first: ``(B, *, I)`` (Linear), ``(B, C, *spatial)`` (Conv),
            ``(B, *)`` indices (Embedding), ``(B, *, *normalized_shape)`` (LayerNorm).
        grad_output: the gradient of the back-propagated loss w.r.t. its output, batch first.
        workspace: buffers for the largest temporaries, kept between calls (none: fresh tensors).

    Returns:
        ``(B,)`` in float32 (float64 for float64 inputs), in the units of ``grad_output`` squared.
    """
    if isinstance(module, nn.Embedding):
        rows, example, _ = _embedding_rows(module, inputs, grad_output)
        return rows.new_zeros(inputs.shape[0]).index_add_(0, example, rows.square().sum(1))
    if isinstance(module, nn.LayerNorm):
        grads = _layer_norm_grads(module, inputs, grad_output)
        return sum(_sq_norms(grads[n]) for n in _trainable(module))  # type: ignore[return-value]
    # A layer frozen after the sources were planned still gets its (zero) entry.
    weight = module.weight.requires_grad
    bias = module.bias is not None and module.bias.requires_grad
    dtype = _accumulation_dtype(grad_output)
    if isinstance(module, nn.Linear) and inputs.dim() == 2:  # the common case, in as few kernels as possible
        g, a = grad_output.to(dtype), inputs.to(dtype)
        a_sq = torch.linalg.vecdot(a, a) if weight else 0.0
        return torch.linalg.vecdot(g, g) * (a_sq + (1.0 if bias else 0.0))
    if weight:
        sq = torch.cat([_outer_sq_norms(a, g, workspace) for a, g in _outer_chunks(module, inputs, grad_output, workspace)])
    else:
        sq = grad_output.new_zeros(grad_output.shape[0], dtype=dtype)
    return sq + _bias_grads(module, grad_output).square().sum(1) if bias else sq


def per_example_sums(module: nn.Module, inputs: Tensor, grad_output: Tensor,
                     workspace: Workspace | None = None) -> dict[str, tuple[Tensor, Tensor]]:
    """(Σ_i g_i, Σ_i g_i²), elementwise, for each of ``module``'s own trainable parameters (each of the
    parameter's shape): the per-coordinate mean and variance of the per-example gradients.

    Both sums come from the same operands, in float32 or wider: under bf16/fp16 autocast the
    ``.grad`` that autograd computes is rounded differently, and its ḡ² against these Σg² would make
    the variance of high-SNR coordinates (a difference of two nearly equal terms) rounding noise.

    The arguments as in :func:`per_example_sq_norms`. Linear with 2-D inputs: ΔᵀA and (Δ²)ᵀ(A²), no
    per-example tensor; Embedding: a segment sum; Linear with 3-D inputs, convolutions (in chunks of
    examples) and LayerNorm: the layer's per-example gradients ``(B, *shape)``, formed and summed
    here (BackPACK's BatchGrad / SumGradSquared).
    """
    trainable = _trainable(module)
    if isinstance(module, nn.Embedding):
        rows, _, token = _embedding_rows(module, inputs, grad_output)
        zeros = rows.new_zeros(module.weight.shape)
        return {"weight": (zeros.index_add(0, token, rows), zeros.index_add(0, token, rows.square()))}
    if isinstance(module, nn.LayerNorm):
        grads = _layer_norm_grads(module, inputs, grad_output)
        return {n: (grads[n].sum(0), grads[n].square().sum(0)) for n in trainable}
    out = {}
    if "weight" in trainable:
        parts = [_outer_sums(a, g, workspace) for a, g in _outer_chunks(module, inputs, grad_output, workspace)]
        out["weight"] = tuple(_as_weight(module, functools.reduce(torch.add, part)) for part in zip(*parts))
    if "bias" in trainable:
        bias = _bias_grads(module, grad_output)
        out["bias"] = (bias.sum(0), bias.square().sum(0))
    return out  # type: ignore[return-value]


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
    batch = grad_output.shape[0]
    in_dims = tuple(0 if isinstance(a, Tensor) and a.dim() > 0 and a.shape[0] == batch else None for a in args)

    def one_example(*example_args: Any) -> dict[str, Tensor]:
        *inputs, grad = example_args
        batched = tuple(x.unsqueeze(0) if d == 0 else x for x, d in zip(inputs, in_dims))
        _, pullback = torch.func.vjp(lambda q: torch.func.functional_call(module, q, batched, dict(kwargs)), params)
        return pullback(grad.unsqueeze(0))[0]

    return torch.func.vmap(one_example, in_dims=(*in_dims, 0))(*args, grad_output)


@dataclass(frozen=True)
class LossReduction:
    """How a loss reduces its terms: ``kind`` ``"mean"`` or ``"sum"``, over ``terms`` values (the examples
    of a micro-batch, times the tokens or elements of each for a per-token or per-element loss) where
    the graph says so, else ``None``. Targets an ``ignore_index`` leaves out (padding) are counted: read
    from shapes, not values, so with padding ``terms`` is an upper bound."""

    kind: str
    terms: int | None


_NLL_OPS = frozenset({"NllLossBackward0", "NllLoss2DBackward0"})  # input (N, C, *): one term per target
# Loss functions whose reduction runs over every element of their input.
_ELEMENTWISE_LOSS_OPS = frozenset({
    "MseLossBackward0", "SmoothL1LossBackward0", "HuberLossBackward0", "BinaryCrossEntropyBackward0",
    "BinaryCrossEntropyWithLogitsBackward0", "SoftMarginLossBackward0",
})


def _loss_terms(node: Any) -> int | None:
    """The values a loss function's ``reduction=`` adds up or averages, for the losses where that is known."""
    shape, name = node._saved_self.shape, type(node).__name__
    if name in _NLL_OPS:
        return math.prod(shape) // shape[1] if len(shape) >= 2 else 1
    return math.prod(shape) if name in _ELEMENTWISE_LOSS_OPS else None


def detect_loss_reduction(loss: Tensor, batch_size: int, accumulation: int = 1) -> LossReduction | None:
    """Whether ``loss`` is a mean or a sum of the examples' own losses, and over how many terms.

    Walks the autograd graph down from ``loss`` through scalar operations (multiplications, divisions,
    additions, casts) to the first reductions over a tensor whose leading dimension is a multiple of
    ``batch_size``: ``mean()``, ``sum()``, and the loss functions' ``reduction=`` argument. A ``sum()``
    divided on the way by a multiple of ``batch_size`` counts as a mean (cross-entropy with probability
    targets). One division by ``accumulation`` is skipped (Lightning divides the loss by
    ``accumulate_grad_batches``); a division by a tensor counts as one by a count of elements
    (label smoothing). Reductions over parameters only (an L2 penalty) are ignored.

    The number of terms is read from a loss function's input, or from a ``sum()``/``mean()`` of a 1-D
    tensor; of a wider one (``(B, C)`` soft-target cross-entropy terms, a ``(B, T)`` token grid) it is
    not known, nor where the loss's parts reduce different numbers of terms.

    Returns:
        The reduction, or ``None`` when the graph shows neither, or both (or the batch is empty).
    """
    if batch_size < 1:
        return None
    found: set[LossReduction] = set()
    stack: list[tuple[Any, float]] = [(loss.grad_fn, 1.0)]
    skip_division = accumulation
    visited = 0
    while stack:
        node, divisor = stack.pop()
        visited += 1
        if node is None:
            continue
        if visited > _MAX_GRAPH_NODES:
            return None
        name = type(node).__name__
        if name in _MEAN_OPS or name in _SUM_OPS:
            sizes = node._saved_self_sym_sizes
            if sizes and sizes[0] % batch_size == 0:
                is_mean = name in _MEAN_OPS or math.isinf(divisor) or (
                    divisor >= batch_size and divisor % batch_size == 0)
                found.add(LossReduction("mean" if is_mean else "sum", sizes[0] if len(sizes) == 1 else None))
            continue
        code = getattr(node, "_saved_reduction", None)
        if code is not None:
            leading = node._saved_self.shape[0] if node._saved_self.dim() else 0
            if code in _REDUCTION_CODES and leading % batch_size == 0 and leading > 0:
                found.add(LossReduction(_REDUCTION_CODES[code], _loss_terms(node)))
            elif code not in _REDUCTION_CODES:
                return None
            continue
        if name not in _SCALAR_OPS:
            return None
        other = getattr(node, "_saved_other", None) if name in ("DivBackward0", "DivBackward1") else None
        if isinstance(other, Tensor) and (other.device.type != "cpu" or other.numel() != 1):
            # By a device tensor: a count of elements (F.cross_entropy's label smoothing); reading it would sync.
            divisor = math.inf
        elif other is not None:
            # By a Python number (recorded as DivBackward0 with a CPU scalar in recent torch, as
            # DivBackward1 before): reading it is no device sync.
            value = float(other)
            if skip_division and value == skip_division:
                skip_division = 0
            else:
                divisor *= value
        stack.extend((nxt, divisor) for nxt, _ in node.next_functions)
    kinds, terms = {f.kind for f in found}, {f.terms for f in found}
    return LossReduction(kinds.pop(), terms.pop() if len(terms) == 1 else None) if len(kinds) == 1 else None


@dataclass(frozen=True)
class SourcePlan:
    """Which source measures the per-example spread of each trainable parameter.

    Attributes:
        per_example: modules (by qualified name) whose parameters get per-example norms in backward (1).
        micro_batch: parameters (qualified names) measured from micro-batches and DDP ranks (2).
        vmap: modules whose parameters get ``torch.func`` per-example gradients on a sub-batch (3).
        uncovered: parameters measured by nothing, with the reason.
        coupled: BatchNorm modules: they couple the examples of a (micro-)batch.
    """

    per_example: dict[str, nn.Module]
    micro_batch: dict[str, nn.Parameter]
    vmap: dict[str, nn.Module]
    uncovered: dict[str, str]
    coupled: tuple[str, ...]

    def parameters(self, source: str) -> dict[str, nn.Parameter]:
        """The trainable parameters of ``source`` (``"per_example"`` or ``"vmap"``), by qualified name."""
        modules = getattr(self, source)
        return {f"{m}.{n}" if m else n: p for m, mod in modules.items() for n, p in _trainable(mod).items()}

    def describe(self, model: nn.Module) -> str:
        """One line naming each source, its layers and its share of the trainable parameters."""
        total = sum(p.numel() for p in model.parameters() if p.requires_grad) or 1

        def share(params: Iterable[nn.Parameter]) -> str:
            unique = {id(p): p for p in params}  # a tied parameter appears under several names
            return f"{sum(p.numel() for p in unique.values()) / total:.1%} of parameters"

        def kinds(modules: Mapping[str, nn.Module]) -> str:
            counts = Counter(type(m).__name__ for m in modules.values())
            return ", ".join(f"{k}×{v}" for k, v in counts.items())

        named = dict(model.named_parameters(remove_duplicate=False))
        parts = []
        if self.per_example:
            parts.append(f"per-example norms in backward: {kinds(self.per_example)} "
                         f"({share(self.parameters('per_example').values())})")
        if self.micro_batch:
            parts.append(f"micro-batches/ranks: {len(self.micro_batch)} tensors ({share(self.micro_batch.values())})")
        if self.vmap:
            parts.append(f"torch.func vmap on a sub-batch: {kinds(self.vmap)} "
                         f"({share(self.parameters('vmap').values())})")
        if self.uncovered:
            reasons = sorted(set(self.uncovered.values()))
            parts.append(f"not measured: {len(self.uncovered)} tensors "
                         f"({share(named[n] for n in self.uncovered)}; {'; '.join(reasons)})")
        return "; ".join(parts) if parts else "no trainable parameters"


# nn.MultiheadAttention's functional forward uses out_proj's weight without calling out_proj, and
# returns a tuple: neither the per-example hooks nor the torch.func fallback see its parameters.
_ATTENTION_REASON = ("nn.MultiheadAttention (its forward uses out_proj's weight without calling out_proj; "
                     "attention written with nn.Linear projections gets per-example norms)")


_CONTAINER_REASON = ("a parameter of a module whose forward also runs layers with weight matrices (torch.func would "
                     "re-run them all); accumulate_grad_batches >= 2 or >= 2 devices measure it")


def plan_sources(model: nn.Module, groups_available: bool, fallback: bool, exclude: Iterable[str] = ()) -> SourcePlan:
    """Assign each trainable parameter to a source: (1) per-example norms, else (2) micro-batches/ranks
    when there are at least two gradient groups per step, else (3) ``torch.func`` when ``fallback``.

    Args:
        model: the model; each module's own parameters (``recurse=False``) are assigned together.
        groups_available: more than one micro-batch or rank per optimizer step.
        fallback: allow (3).
        exclude: module names that showed they cannot use (1) or (3) (called twice per forward,
            parameters used outside their forward); they go to (2) or are not measured.
    """
    excluded = set(exclude)
    owners: Counter[int] = Counter(id(p) for _, m in model.named_modules() for p in _trainable(m).values())
    per_example, vmap, micro, uncovered = {}, {}, {}, {}
    coupled = tuple(n for n, m in model.named_modules() if isinstance(m, _BatchNorm))
    attention = {n: m for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)}
    attention.update({f"{n}.out_proj" if n else "out_proj": m.out_proj for n, m in list(attention.items())})
    for name, module in model.named_modules():
        params = _trainable(module)
        if not params:
            continue
        qualified = {f"{name}.{n}" if name else n: p for n, p in params.items()}
        tied = any(owners[id(p)] > 1 for p in params.values())
        # What rules out torch.func as well as the identities; a layer type without an identity does not.
        barred = "tied parameter" if tied else (
            "excluded after a failed step" if name in excluded else _ATTENTION_REASON if name in attention else None)
        reason = barred or unsupported_reason(module)
        if reason is None:
            per_example[name] = module
        elif groups_available:
            known = {id(p) for p in micro.values()}
            micro.update({n: p for n, p in qualified.items() if id(p) not in known})
        elif fallback and barred is None and not isinstance(module, _BatchNorm):
            # A model's own position table, a block's layer-scale: torch.func would re-run the whole
            # subtree (the whole model, for the root) on every measured step. Weight matrices stand for
            # its compute: a LayerNorm child is cheap to re-run, a Linear or a convolution is not.
            if any(p.dim() >= 2 for child in module.children() for p in child.parameters()):
                uncovered.update(dict.fromkeys(qualified, _CONTAINER_REASON))
            else:
                vmap[name] = module
        else:
            why = reason if not isinstance(module, _BatchNorm) else "BatchNorm couples the examples"
            uncovered.update(dict.fromkeys(qualified, why if fallback else f"{why}, fallback off"))
    return SourcePlan(per_example, micro, vmap, uncovered, coupled)


@dataclass
class PerExampleStep:
    """What :class:`PerExampleGradients` gathered over the micro-batches of one optimizer step, in the
    units of each example's own loss.

    Attributes:
        sq_norm_sum: ``()`` Σ_i ‖g_i‖² over the per-example-norm parameters, or ``None``.
        sq_norms: the ``(b,)`` ‖g_i‖² of each micro-batch, in order (only when kept).
        grad_sum: Σ_i g_i per per-example-norm parameter (qualified name), when requested.
        sum_sq: Σ_i g_i² per per-example-norm parameter, when requested (from the same operands).
        num_sub: examples of the ``vmap`` sub-batches.
        sub_sq_norm_sum: ``()`` Σ_i ‖g_i‖² over the ``vmap`` parameters and the sub-batch examples.
        sub_grad_sum: Σ_i g_i per ``vmap`` parameter over the sub-batch.
        sub_sum_sq: Σ_i g_i² per ``vmap`` parameter over the sub-batch.
        seen: modules whose output gradient arrived.
        failed: modules that could not be measured this step, with the reason.
    """

    sq_norm_sum: Tensor | None = None
    sq_norms: list[Tensor] = field(default_factory=list)
    grad_sum: dict[str, Tensor] = field(default_factory=dict)
    sum_sq: dict[str, Tensor] = field(default_factory=dict)
    num_sub: int = 0
    sub_sq_norm_sum: Tensor | None = None
    sub_grad_sum: dict[str, Tensor] = field(default_factory=dict)
    sub_sum_sq: dict[str, Tensor] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)


def _add(into: dict[str, Tensor], name: str, value: Tensor) -> None:
    into[name] = value if name not in into else into[name] + value


class PerExampleGradients:
    """Module hooks that gather per-example gradient statistics during backward.

    For each module of ``per_example``, a forward hook keeps a reference to the input (autograd saves
    it anyway) and puts a hook on the output tensor; when the output gradient arrives, the hook adds
    the per-example squared norms (and, if requested, the per-coordinate sums of squares) into running
    device tensors and lets the references go. Modules of ``vmap`` keep the first ``sub_batch``
    examples of their inputs and output gradients until :meth:`end_micro_batch`, which computes their
    per-example gradients with :func:`vmap_per_example_grads`.

    Use: :meth:`attach`, then per micro-batch forward + backward and :meth:`end_micro_batch` with the
    factor that converts the back-propagated gradient to the examples' own losses; :meth:`pop` at the
    optimizer step; :meth:`detach`. A module that runs more than once in a forward, or whose
    examples do not sit on dimension 0, is reported in :attr:`PerExampleStep.failed`.

    Args:
        per_example: ``{name: module}`` with :func:`unsupported_reason` ``None``.
        vmap: ``{name: module}`` for the ``torch.func`` fallback.
        sub_batch: examples per micro-batch for the fallback, ≥ 2.
    """

    def __init__(self, per_example: Mapping[str, nn.Module], vmap: Mapping[str, nn.Module], sub_batch: int) -> None:
        if sub_batch < 2:
            raise ValueError(f"`sub_batch` must be >= 2, got {sub_batch}")
        self.per_example, self.vmap, self.sub_batch = dict(per_example), dict(vmap), sub_batch
        self._handles: list[RemovableHandle] = []
        self._workspace = Workspace()  # the conv patches and blocks of every layer and step
        self._coordinates = False
        self._keep_norms = False
        self._replaying = False
        self._reset_micro_batch()
        self._step = PerExampleStep()

    def _reset_micro_batch(self) -> None:
        self._sq: Tensor | None = None
        self._grad_sum: dict[str, Tensor] = {}
        self._sum_sq: dict[str, Tensor] = {}
        self._pending: list[tuple[str, nn.Module, tuple[Any, ...], dict[str, Any], Tensor]] = []
        self._calls: Counter[str] = Counter()
        self._batch_size: int | None = None  # examples in this micro-batch: told, else the first layer's rows

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self, coordinates: bool = False, keep_norms: bool = False) -> None:
        """Install the hooks; ``coordinates``: also Σ_i g_i and Σ_i g_i²; ``keep_norms``: keep each ‖g_i‖²."""
        self.detach()
        self._coordinates, self._keep_norms = coordinates, keep_norms
        for name, module in self.per_example.items():
            self._handles.append(module.register_forward_hook(functools.partial(self._forward, name)))
        for name, module in self.vmap.items():
            hook = functools.partial(self._forward_vmap, name)
            self._handles.append(module.register_forward_hook(hook, with_kwargs=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def expect_batch(self, size: int) -> None:
        """The coming micro-batch holds ``size`` examples: a layer whose input has another first dimension
        (a position embedding called with ``arange(T)``, inputs flattened to ``(B·T, D)``) is reported in
        :attr:`PerExampleStep.failed`, not measured. Untold, the first measured layer's rows count."""
        self._batch_size = size

    def _check_call(self, name: str, output: Any, batch: int) -> bool:
        if self._replaying or not isinstance(output, Tensor) or not output.requires_grad:
            return False
        self._calls[name] += 1
        if self._calls[name] > 1:
            self._step.failed[name] = "runs more than once per forward"
            return False
        if self._batch_size is None:
            self._batch_size = batch
        if batch != self._batch_size:
            self._step.failed[name] = f"first dimension {batch} is not the batch ({self._batch_size})"
            return False
        return True

    def _forward(self, name: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not args or not isinstance(args[0], Tensor):
            self._step.failed[name] = "its input was not passed positionally (e.g. `layer(input=x)`)"
            return
        inputs = args[0]
        if self._check_call(name, output, inputs.shape[0] if inputs.dim() else -1):
            output.register_hook(functools.partial(self._backward, name, module, inputs))

    @torch.no_grad()  # a backward with create_graph=True runs hooks in grad mode; nothing here is differentiated
    def _backward(self, name: str, module: nn.Module, inputs: Tensor, grad_output: Tensor) -> None:
        if self._calls[name] > 1:
            return
        try:
            sq = per_example_sq_norms(module, inputs, grad_output, self._workspace)
            sums = per_example_sums(module, inputs, grad_output, self._workspace) if self._coordinates else {}
        except Exception as err:  # noqa: BLE001 - raised into the user's backward, it would end the run
            self._step.failed[name] = f"per-example norms failed: {type(err).__name__}: {err}"
            return
        self._sq = sq if self._sq is None else self._sq + sq
        for local, (total, total_sq) in sums.items():
            qualified = f"{name}.{local}" if name else local
            _add(self._grad_sum, qualified, total)
            _add(self._sum_sq, qualified, total_sq)
        self._step.seen.add(name)

    def _forward_vmap(self, name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                      output: Any) -> None:
        batch = next((a.shape[0] for a in args if isinstance(a, Tensor) and a.dim()), -1)
        if not self._check_call(name, output, batch):
            return
        sub = min(self.sub_batch, batch)
        kept = tuple(a[:sub] if isinstance(a, Tensor) and a.dim() and a.shape[0] == batch else a for a in args)
        output.register_hook(functools.partial(self._backward_vmap, name, module, kept, kwargs, sub))

    def _backward_vmap(self, name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                       sub: int, grad_output: Tensor) -> None:
        if self._calls[name] <= 1:
            self._pending.append((name, module, args, kwargs, grad_output[:sub]))

    def end_micro_batch(self, unit: Tensor | float) -> None:
        """Close a micro-batch: run the fallback, convert to own-loss units and add to the step.

        Args:
            unit: ``()`` tensor or float u with g_i = u × (the back-propagated per-example gradient),
                e.g. (accumulation steps × batch size for a mean loss) / AMP loss scale.
        """
        step = self._step
        unit_sq = unit * unit
        if self._sq is not None:
            sq = self._sq * unit_sq
            step.sq_norm_sum = sq.sum() if step.sq_norm_sum is None else step.sq_norm_sum + sq.sum()
            if self._keep_norms:
                step.sq_norms.append(sq)
        for name, value in self._grad_sum.items():
            _add(step.grad_sum, name, value * unit)
        for name, value in self._sum_sq.items():
            _add(step.sum_sq, name, value * unit_sq)
        self._run_vmap(unit)
        self._reset_micro_batch()

    def _run_vmap(self, unit: Tensor | float) -> None:
        step, sub = self._step, None
        self._replaying = True
        try:
            for name, module, args, kwargs, grad_output in self._pending:
                try:
                    grads = vmap_per_example_grads(module, args, kwargs, grad_output.detach())
                except Exception as err:  # noqa: BLE001 - any failure of torch.func means: not measurable
                    step.failed[name] = f"torch.func failed: {type(err).__name__}: {err}"
                    continue
                step.seen.add(name)
                sub = grad_output.shape[0]
                for local, g in grads.items():
                    g = g.to(_accumulation_dtype(g)) * unit
                    qualified = f"{name}.{local}" if name else local
                    sq = g.flatten(1).square().sum(1).sum()
                    step.sub_sq_norm_sum = sq if step.sub_sq_norm_sum is None else step.sub_sq_norm_sum + sq
                    _add(step.sub_grad_sum, qualified, g.sum(0))
                    _add(step.sub_sum_sq, qualified, g.square().sum(0))
        finally:
            self._replaying = False
        if sub is not None:
            step.num_sub += sub

    def pop(self) -> PerExampleStep:
        """The step's statistics; starts a new step."""
        step, self._step = self._step, PerExampleStep()
        self._reset_micro_batch()
        return step
