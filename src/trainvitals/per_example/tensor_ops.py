"""Tensor helpers the per-example rules share: accumulation dtype, reused buffers, squared norms and the
sums of outer products Σ_t δ_t a_tᵀ that Linear, convolutions and attention projections reduce to; the
running sums the hooks keep."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

_SCRATCH_BYTES = 16 * 2**20  # the largest temporary of a chunk of examples: patches, blocks or Gram matrix
_ROW_IN_PLACE = 2**13  # elements of a row that :func:`_moments` adds in place on a CPU, not from a float64 copy


def _accumulation_dtype(t: Tensor) -> torch.dtype:
    # fp16/bf16 squared norms overflow or underflow (docs/science.md §2); float64 stays float64.
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _trainable(module: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}


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
        self._views: dict[tuple[str, torch.device, torch.dtype], dict[tuple[int, ...], Tensor]] = {}

    def take(self, role: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """An uninitialised ``shape`` tensor of ``like``'s dtype and device, valid until ``role`` is taken
        again on that device. The same shape again is the same view (no operations on the step's path)."""
        key = (role, like.device, like.dtype)
        views = self._views.setdefault(key, {})
        view = views.get(shape)
        if view is not None:
            return view
        numel, buffer = math.prod(shape), self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[key] = like.new_empty(numel)
            views.clear()
        elif len(views) >= 64:  # shapes that keep changing (sequence lengths): a bounded cache
            views.clear()
        view = views[tuple(shape)] = buffer[:numel].view(shape)
        return view


def gram_is_cheaper(positions: int, fan_in: int, fan_out: int, gram_speed: float = 1.0) -> bool:
    """Whether ‖Σ_t δ_t a_tᵀ‖²_F costs fewer multiply-adds per example from the ghost Gram matrices, T²·(I + O)
    for A Aᵀ and Δ Δᵀ and T² for their dot product, than from the per-example block, T·I·O and I·O for its
    squared norm (T positions, I input and O output features); the Gram side's counted at 1/``gram_speed``,
    how much faster its matmuls run per multiply-add in the caller's layouts."""
    t, i, o = positions, fan_in, fan_out
    return t * t * (i + o + 1) <= gram_speed * (t + 1) * i * o


def _bmm(x: Tensor, y: Tensor, workspace: Workspace | None, role: str) -> Tensor:
    """``torch.bmm(x, y)``, into the workspace's ``role`` buffer when there is one."""
    out = None if workspace is None else workspace.take(role, (x.shape[0], x.shape[1], y.shape[2]), x)
    return torch.bmm(x, y, out=out)


def _sq_norms(x: Tensor) -> Tensor:
    """Squared norm of each example's slice, ``(B, *)`` → ``(B,)``."""
    return torch.linalg.vector_norm(x.flatten(1) if x.dim() > 1 else x[:, None], dim=1).square()  # (B,): a 0-d's


def _by_position(t: Tensor) -> Tensor:
    """A Linear layer's ``(B, *, F)`` input or output gradient as ``(B, T, F)`` (T = 1 for 2-D)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:-1]), t.shape[-1])


def _outer_sq_norms(a: Tensor, g: Tensor, workspace: Workspace | None = None, gram: bool | None = None) -> Tensor:
    """‖Σ_t g_t a_tᵀ‖²_F per example, ``(B, T, I)``, ``(B, T, O)`` → ``(B,)``: from the ghost Gram matrices
    where ``gram`` (``None``: where they cost fewer multiply-adds, :func:`gram_is_cheaper`), else from the
    per-example blocks."""
    # Reductions straight from the operands (vecdot, vector_norm): no squared temporary of the size of
    # the Gram matrices or blocks, whose allocation per step costs more than the arithmetic on a CPU.
    t, i, o = a.shape[1], a.shape[2], g.shape[2]
    if t == 1:
        return _sq_norms(a) * _sq_norms(g)
    if gram_is_cheaper(t, i, o) if gram is None else gram:
        return torch.linalg.vecdot(
            _bmm(a, a.transpose(1, 2), workspace, "gram_a").flatten(1),
            _bmm(g, g.transpose(1, 2), workspace, "gram_g").flatten(1),
        )
    return _sq_norms(_bmm(g.transpose(1, 2), a, workspace, "blocks"))


def _moments(values: Tensor, index: Tensor | None = None, size: int = 0) -> tuple[Tensor, Tensor]:
    """Σ_i v_i and Σ_i v_i², elementwise over dimension 0 of ``values`` ``(N, *)``, in float64; with ``index``
    ``(N,)``, each v_i added into row ``index[i]`` of two ``(size, *)``.

    The square of a float32 value is exact in float64 and a sum of them nearly so: the variance
    (Σv² − (Σv)²/N)/(N − 1) of nearly equal values is then that of the values themselves, where float32
    sums leave rounding noise of their size. In chunks of rows whose float64 copy stays within
    ``_SCRATCH_BYTES``; on a CPU, rows of ``_ROW_IN_PLACE`` elements or more are added in place one at a
    time instead (cast on the fly, exactly): a fresh float64 copy of them costs more than the sums (page
    faults, as :class:`Workspace` says), 4–5× on a per-example block of a 256→1024 Linear."""
    row = values.shape[1:]
    total = values.new_zeros(row if index is None else (size, *row), dtype=torch.float64)
    total_sq = torch.zeros_like(total)
    if index is None and values.device.type == "cpu" and math.prod(row) >= _ROW_IN_PLACE:
        for v in values:
            total.add_(v)
            total_sq.addcmul_(v, v)
        return total, total_sq
    chunk = max(1, _SCRATCH_BYTES // (8 * max(1, math.prod(row))))
    for start in range(0, values.shape[0], chunk):
        wide = values[start : start + chunk].to(torch.float64, copy=True)
        if index is None:
            total += wide.sum(0)
            total_sq += wide.square_().sum(0)
        else:
            rows = index[start : start + chunk]
            total.index_add_(0, rows, wide)
            total_sq.index_add_(0, rows, wide.square_())
    return total, total_sq


def _outer_sums(a: Tensor, g: Tensor, workspace: Workspace | None = None) -> tuple[Tensor, Tensor]:
    """Σ_i and Σ_i (·)², elementwise, of the per-example blocks Σ_t g_t a_tᵀ, ``(b, T, I)``, ``(b, T, O)``
    → two float64 ``(O, I)`` (:func:`_moments`): ΔᵀA and (Δ²)ᵀ(A²) in float64 when T = 1, the exact
    products of the operands; otherwise the blocks, formed in the operands' dtype."""
    if a.shape[1] == 1:
        a, g = a[:, 0].double(), g[:, 0].double()
        return g.t() @ a, g.square().t() @ a.square()
    return _moments(_bmm(g.transpose(1, 2), a, workspace, "blocks"))


def _add(into: dict[str, Tensor], name: str, value: Tensor) -> None:
    """``into[name] += value``, in place after the first: a running sum of a large layer is never copied."""
    if name in into:
        into[name].add_(value)
    else:
        into[name] = value
