"""Gradient norms over many tensors, fused and without a host sync.

The per-tensor norms come from one ``torch._foreach_norm`` call per dtype; groups (layers, blocks)
and the total are then reduced on the device with ``index_add_``/``scatter_reduce_``. Nothing here
calls ``.item()``: the caller decides when a number goes to the host.

Precision: a float16/bfloat16 gradient squared overflows or underflows, so per-tensor norms are taken
in ``float32`` (or the gradient's own dtype when wider), and per-tensor norms are combined in
``float64`` so that a total over many large float32 norms cannot overflow (docs/science.md §2).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from trainvitals._validation import check_float

try:
    from torch.distributed.tensor import DTensor
except ImportError:
    try:  # torch < 2.4
        from torch.distributed._tensor import DTensor
    except ImportError:  # a torch build without distributed support
        DTensor = None  # type: ignore[assignment,misc]

GROUPINGS = ("parameter", "module", "block")


def validate_norm_type(norm_type: float | int | str) -> float:
    """Return ``norm_type`` as a float p > 0: a number (``math.inf`` allowed) or the string ``"inf"``.

    Raises:
        TypeError: if ``norm_type`` is neither a number nor a string (a bool is not a number here).
        ValueError: if it is not > 0, NaN, or a string other than ``"inf"``.
    """
    if isinstance(norm_type, str):
        if norm_type.lower() != "inf":
            raise ValueError(f"`norm_type` must be a number > 0 or 'inf', got {norm_type!r}")
        return math.inf
    try:
        return check_float("norm_type", norm_type, 0.0, low_open=True, allow_inf=True)
    except TypeError:
        raise TypeError(f"`norm_type` must be a number > 0 or 'inf', got {norm_type!r}") from None


def group_name(param_name: str, grouping: str) -> str:
    """Map a parameter name (``"encoder.0.weight"``) to the group it is reported under.

    ``parameter`` keeps the name; ``module`` drops the last component (``"encoder.0"``); ``block``
    keeps the first component (``"encoder"``). A parameter registered on the root module is its own
    group. The wrapper ``torch.compile`` puts around a submodule (``_orig_mod``) is not a layer and is
    left out of the name.
    """
    if grouping not in GROUPINGS:
        raise ValueError(f"`grouping` must be one of {GROUPINGS}, got {grouping!r}")
    parts = [part for part in param_name.split(".") if part != "_orig_mod"]
    param_name = ".".join(parts)
    if grouping == "parameter" or len(parts) == 1:
        return param_name
    if grouping == "module":
        return ".".join(parts[:-1])
    return parts[0]


def per_tensor_norms(tensors: Sequence[Tensor], norm_type: float = 2.0) -> Tensor:
    """p-norm of each tensor, one fused kernel per dtype.

    A ``DTensor`` (FSDP2's sharded parameters, tensor parallelism) gets the norm of the whole tensor:
    each rank's norm of its shard is a partial result reduced across the device mesh (Σ of p-th
    powers by ``full_tensor()``; for p = ∞ the max over every mesh dimension, as an uneven shard can
    be empty on some rank) — one collective per dtype and mesh, which every rank must join.

    Args:
        tensors: ``P`` tensors of any shapes and float dtypes (on several devices, the norms are
            gathered on the first tensor's).
        norm_type: p > 0 or ``inf``.

    Returns:
        A ``float64`` tensor of shape ``(P,)`` on the tensors' device.
    """
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    by_kind: dict[tuple[torch.dtype, object], list[int]] = {}
    for i, t in enumerate(tensors):
        by_kind.setdefault((t.dtype, t.device_mesh if is_dtensor(t) else None), []).append(i)
    ordered: list[Tensor] = [None] * len(tensors)  # type: ignore[list-item]
    for (dtype, mesh), idx in by_kind.items():
        # Reduced-precision grads are reduced in fp32; wider ones in their own dtype.
        acc = dtype if dtype in (torch.float32, torch.float64) else torch.float32
        group = [tensors[i] for i in idx]
        if mesh is None:
            norms = torch._foreach_norm(group, norm_type, dtype=acc)
        elif math.isinf(norm_type):
            norms = _dtensor_max_norms(group, mesh, acc)
        else:
            norms = torch.stack(torch._foreach_norm(group, norm_type, dtype=acc)).full_tensor().unbind()
        for i, norm in zip(idx, norms):
            ordered[i] = norm
    device = ordered[0].device
    if any(n.device != device for n in ordered):  # a model split over devices
        ordered = [n.to(device) for n in ordered]
    # One stack (promoting mixed dtypes) and one cast; no index tensor, so no host-to-device copy.
    return torch.stack(ordered).to(dtype=torch.float64)


def is_dtensor(t: Tensor) -> bool:
    """Whether ``t`` is a ``DTensor`` (FSDP2's sharded parameters and gradients, tensor parallelism)."""
    return DTensor is not None and isinstance(t, DTensor)


def _dtensor_max_norms(tensors: Sequence[Tensor], mesh: object, dtype: torch.dtype) -> list[Tensor]:
    """∞-norms of DTensors on one mesh: each local shard's max (0 for an empty shard, which
    ``_foreach_norm`` rejects), then the max over every mesh dimension — replicas hold equal values,
    so a max over them changes nothing."""
    local = [t.to_local() for t in tensors]
    present = [i for i, x in enumerate(local) if x.numel()]
    norms = local[0].new_zeros(len(local), dtype=dtype)
    if present:
        found = torch._foreach_norm([local[i] for i in present], math.inf, dtype=dtype)
        norms[present] = torch.stack(found)
    for dim in range(mesh.ndim):  # type: ignore[attr-defined]
        torch.distributed.all_reduce(norms, op=torch.distributed.ReduceOp.MAX, group=mesh.get_group(dim))  # type: ignore[attr-defined]
    return list(norms.unbind())


def combine_norms(norms: Tensor, norm_type: float = 2.0) -> Tensor:
    """The p-norm of the concatenation, from the p-norms of the parts (shape ``(..., P)`` → ``(...)``).

    ‖x‖_p = (Σ_i ‖x_i‖_p^p)^(1/p): the p-th root is taken once, on the total.
    """
    if norms.shape[-1] == 0:
        return norms.new_zeros(norms.shape[:-1])
    return torch.linalg.vector_norm(norms, norm_type, dim=-1)


@dataclass(frozen=True)
class NormGroups:
    """A fixed assignment of ``P`` tensors to ``G`` named groups, for :func:`grouped_norms`.

    Attributes:
        names: the ``G`` group names, in first-seen order.
        index: ``(P,)`` long tensor, the group of each tensor.
    """

    names: tuple[str, ...]
    index: Tensor

    @classmethod
    def from_names(cls, param_names: Sequence[str], grouping: str = "module") -> NormGroups:
        group_of = [group_name(n, grouping) for n in param_names]
        names = tuple(dict.fromkeys(group_of))
        position = {n: i for i, n in enumerate(names)}
        return cls(names, torch.tensor([position[g] for g in group_of], dtype=torch.long))


def grouped_norms(norms: Tensor, groups: NormGroups, norm_type: float = 2.0) -> Tensor:
    """Group p-norms from per-tensor p-norms, on the device.

    Args:
        norms: ``(..., P)`` per-tensor norms (from :func:`per_tensor_norms`); leading dimensions, such as
            one row per optimizer step, are reduced independently.
        groups: which group each of the ``P`` tensors belongs to.
        norm_type: the same p the per-tensor norms were taken with.

    Returns:
        ``(..., G)`` tensor, same dtype as ``norms``; ``total² = Σ group²`` for p = 2.
    """
    index = groups.index.to(norms.device)
    out = norms.new_zeros(*norms.shape[:-1], len(groups.names))
    if math.isinf(norm_type):
        return out.scatter_reduce_(-1, index.expand_as(norms), norms, reduce="amax", include_self=False)
    return out.index_add_(-1, index, norms.pow(norm_type)).pow(1.0 / norm_type)
