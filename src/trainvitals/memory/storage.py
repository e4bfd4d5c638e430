"""Bytes by storage: what a tensor keeps alive, the batch's own elements, the model state, and units.

All counts are by untyped storage, so that views and tied weights count once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

StorageKey = tuple[str, int]
"""``(device, data_ptr)`` of an untyped storage: equal for all views of one storage."""


def storage_key(tensor: Tensor) -> StorageKey | None:
    """The storage ``tensor`` is a view of, or ``None`` for tensors without one (sparse, wrapper subclasses)."""
    try:
        return str(tensor.device), tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def storage_nbytes(tensor: Tensor) -> int:
    """Bytes of the whole storage ``tensor`` views: what keeping the view alive keeps alive."""
    return tensor.untyped_storage().nbytes()


def tensors_in(obj: Any) -> Iterator[Tensor]:
    """Every tensor in ``obj``: a tensor or nested mappings, lists, tuples and dataclass instances."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensors_in(value)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, f.name))


def storage_keys(tensors: Iterable[Tensor]) -> set[StorageKey]:
    """The storages of ``tensors`` (tensors without a storage are skipped)."""
    return {key for key in map(storage_key, tensors) if key is not None}


def unique_storage_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors``; a storage viewed many times counts once."""
    sizes: dict[StorageKey, int] = {}
    for t in tensors:
        key = storage_key(t)
        if key is not None and key not in sizes:
            sizes[key] = storage_nbytes(t)
    return sum(sizes.values())


def element_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the elements ``tensors`` hold: a batch sliced from a dataset held on the device is the
    slice (its rows, columns or strided picks), not the dataset's storage; an expanded view holds the
    elements it repeats once. Views of one storage add up to at most the storage (a language model's
    inputs and labels, ``seq[:, :-1]`` and ``seq[:, 1:]``, are one sequence batch)."""
    held: dict[StorageKey | None, dict[tuple[int, tuple[int, ...], tuple[int, ...]], int]] = {}
    caps: dict[StorageKey, int] = {}
    for t in tensors:
        if t.numel() == 0:
            continue
        key = storage_key(t)
        # An expanded dimension (stride 0) repeats what the others hold.
        elements = math.prod(n for n, stride in zip(t.shape, t.stride()) if stride != 0)
        views = held.setdefault(key, {})
        views.setdefault((t.storage_offset(), tuple(t.shape), t.stride()), elements * t.element_size())
        if key is not None:
            caps[key] = storage_nbytes(t)
    total = 0
    for key, views in held.items():
        nbytes = sum(views.values())
        total += nbytes if key is None else min(nbytes, caps[key])
    return total


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of the model state that does not scale with the batch.

    Attributes:
        parameters: distinct parameter storages.
        gradients: distinct ``.grad`` storages (0 before the first backward or after ``zero_grad``).
        optimizer_state: distinct storages of every tensor in ``optimizer.state``; Adam keeps two
            moments (2 × parameter bytes) plus a 4-byte ``step`` tensor per parameter, SGD with
            momentum one buffer (1 ×), plain SGD nothing.
        buffers: distinct buffer storages not shared with a parameter (BatchNorm statistics, masks).
        frozen_parameters: of :attr:`parameters`, the storages no parameter with ``requires_grad`` views (a
            frozen backbone, a LoRA base): no gradient, no optimizer state; not in :attr:`total` again.
    """

    parameters: int
    gradients: int
    optimizer_state: int
    buffers: int = 0
    frozen_parameters: int = 0

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.buffers


def model_state_bytes(
    parameters: Iterable[Tensor], optimizers: Sequence[torch.optim.Optimizer] = (), buffers: Iterable[Tensor] = ()
) -> ModelStateBytes:
    """Parameter, gradient, optimizer-state and buffer bytes (see :class:`ModelStateBytes`)."""
    params = list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    state = [t for opt in optimizers for per_param in opt.state.values() for t in tensors_in(per_param)]
    param_keys = storage_keys(params)
    own_buffers = [b for b in buffers if storage_key(b) not in param_keys]
    trainable_keys = storage_keys(p for p in params if p.requires_grad)
    frozen = [p for p in params if not p.requires_grad and storage_key(p) not in trainable_keys]
    return ModelStateBytes(
        unique_storage_bytes(params),
        unique_storage_bytes(grads),
        unique_storage_bytes(state),
        unique_storage_bytes(own_buffers),
        unique_storage_bytes(frozen),
    )


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def byte_unit(n: float) -> tuple[int, str]:
    """The binary unit to show ``n`` bytes in: ``(bytes per unit, name)``, e.g. ``(1048576, "MiB")``."""
    exponent = 0
    while abs(n) >= 1024 ** (exponent + 1) and exponent < len(_UNITS) - 1:
        exponent += 1
    return 1024**exponent, _UNITS[exponent]


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``"1.50 MiB"``; exact below 1 KiB."""
    scale, unit = byte_unit(n)
    return f"{n:.0f} B" if scale == 1 else f"{n / scale:.2f} {unit}"
