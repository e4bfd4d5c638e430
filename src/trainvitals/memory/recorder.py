"""The saved-tensor recorder: what autograd keeps for backward, per module, by weak reference."""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from trainvitals.compiled import ROOT, compiled_modules
from trainvitals.integrity.graph import is_view_op
from trainvitals.memory.storage import StorageKey, storage_key, storage_keys, storage_nbytes, tensors_in
from trainvitals.plumbing.extra_forward import in_extra_forward

OUTSIDE = "(outside)"
"""Label of tensors saved while no module's forward runs (a loss computed in ``training_step``)."""


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """A hook that runs inside a ``torch.compile``'d model as plain Python: Dynamo would otherwise trace it,
    guard on the module name it handles and recompile it per module until its limit, warning each time."""
    return torch.compiler.disable(hook, recursive=True)


def _module_hook(hook: Callable[..., Any]) -> Callable[..., Any]:
    """A module hook that does nothing while Dynamo traces (a constant branch: no graph break, whatever
    is compiled, a helper method or a function calling submodules included) and otherwise runs eagerly:
    a compiled region's saves then go to the hooked module around it. Nothing either in trainvitals' own
    forwards (:func:`~trainvitals.plumbing.extra_forward.extra_forward`), which are not the step's."""
    eager = _eager(hook)

    @functools.wraps(hook)
    def run(*args: Any, **kwargs: Any) -> None:
        if torch.compiler.is_compiling() or in_extra_forward():
            return None
        return eager(*args, **kwargs)

    return run


@dataclass(frozen=True)
class SavedStorage:
    """One storage that autograd saved for backward.

    Attributes:
        nbytes: bytes of the storage.
        dtype: dtype of the first saved view.
        savers: the innermost module running at each save, in order; the first one owns the bytes.
        saves: the index of each of those saves among all the forward's saves (the save order).
        autocast: first saved in a module call that began under ``torch.autocast``.
    """

    nbytes: int
    dtype: torch.dtype
    savers: tuple[str, ...]
    saves: tuple[int, ...] = ()
    autocast: bool = False


@dataclass(frozen=True)
class SavedTensorReport:
    """What one forward saved for backward.

    Attributes:
        total_bytes: bytes of the distinct saved storages (parameters, buffers, batch excluded).
        by_module: bytes owned by each module (the first to save a storage), largest first; the
            values sum to ``total_bytes``. Keys are qualified module names, :data:`ROOT` or
            :data:`OUTSIDE`.
        storages: every counted storage, by key.
        module_inputs: storages of each module's tensor arguments (all calls, excluded storages left
            out), for :func:`checkpoint_savings`.
        input_nbytes: bytes of each storage in ``module_inputs``.
        forward_seconds: wall time of each module's forward, inclusive of its children (empty unless
            timed).
        module_calls: each module's forward calls as ``(start, end)`` in save order: the saves of index
            (:attr:`SavedStorage.saves`) in ``[start, end)`` happened during the call, those below
            ``start`` before it; for :func:`checkpoint_peak`.
        uncounted: saved tensors that have no storage (sparse, wrapper subclasses), not in any total.
        parameter_copy_bytes: distinct storages of saved casts of the module's parameters or of
            slices of them (autocast's 16-bit weights): batch-independent. Autocast caches the casts
            of trainable parameters, which checkpointing then does not free.
    """

    total_bytes: int
    by_module: dict[str, int]
    storages: dict[StorageKey, SavedStorage]
    module_inputs: dict[str, frozenset[StorageKey]] = field(default_factory=dict)
    input_nbytes: dict[StorageKey, int] = field(default_factory=dict)
    forward_seconds: dict[str, float] = field(default_factory=dict)
    module_calls: dict[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    uncounted: int = 0
    parameter_copy_bytes: int = 0


_MAX_VIEW_HOPS = 8  # views between a parameter and its cast (chunk, select, transpose, ...)
_FINGERPRINT = 64  # elements compared to recognise a frozen parameter's cast


def _unpack(packed: Tensor) -> Tensor:
    # A new alias for each reader (backward, or code reading ``grad_fn._saved_*``): the recorder's weak
    # reference follows the graph's own copy, so a reader that keeps what it read (an integrity check's
    # loss divisor) keeps no graph alive in the count.
    return packed.detach()


class SavedTensorRecorder:
    """Context manager that records, per module, what autograd saves for backward while it is active.

    Enter it before the forward and leave it before the backward. Nothing it keeps references a
    tensor: the graph owns what is saved (a detached alias of each saved tensor), the recorder only
    weak references, storage keys and sizes. (The graph does keep the hooks, and so the recorder.)
    Inside a nested ``saved_tensors_hooks`` context (non-reentrant activation checkpointing,
    ``save_on_cpu``) the inner hooks take the saves: what they keep elsewhere is not counted, which
    for checkpointing is the point; the checkpoint's saved inputs are.

    Nothing it does breaks or recompiles a ``torch.compile``'d graph, whatever is compiled (a model, a
    module's call, a helper method or a function calling submodules): its module hooks return at once
    while Dynamo traces (the broken graph would save other tensors than the one that runs without the
    recorder). What a compiled region saves is counted as a whole, owned by the innermost hooked module
    around it (the pack hook runs where the compiled code saves, which breaks nothing). A module whose
    call runs compiled (:func:`compiled_modules`, listed in :attr:`compiled`) gets no hooks inside.

    Args:
        module: the model whose modules are followed; names are ``module.named_modules()`` names.
            Other modules that run meanwhile are not: what they save goes to the model's module
            around them. Tensor arguments passed as keywords are not seen as module inputs.
        exclude: tensors whose storages are not activations even when saved: the batch. Parameters
            and buffers of ``module`` are always excluded.
        time_modules: measure the forward time of every module (``True``), of the named ones only (a
            collection of names: CUDA events cost a few microseconds each), or of none. Host time by
            ``perf_counter``; CUDA events for a module whose first argument is on CUDA, read in
            :meth:`report`, which then syncs with the device.

    Raises:
        RuntimeError: on entering a recorder that is already active.
    """

    def __init__(
        self, module: nn.Module, exclude: Iterable[Tensor] = (), time_modules: bool | Collection[str] = False
    ) -> None:
        self.module = module
        self._time_all = time_modules is True
        self._time_names = set() if isinstance(time_modules, bool) else set(time_modules)
        self._parameters = storage_keys(module.parameters())
        self._frozen: dict[tuple[int, ...], list[Tensor]] = {}
        for p in module.parameters():
            if not p.requires_grad and p.is_floating_point():
                self._frozen.setdefault(tuple(p.shape), []).append(p)
        self._exclude = storage_keys(tensors_in(list(exclude))) | self._parameters | storage_keys(module.buffers())
        self._names = {id(m): (name or ROOT) for name, m in module.named_modules()}
        # The outermost modules whose calls run compiled (ROOT: a compiled training step), and those hooked.
        self.compiled, self._hooked = compiled_modules(module)
        self._root_hooked = bool(self._hooked) and self._hooked[0] is module
        self._outside = OUTSIDE if self._root_hooked else ROOT  # a compiled training step: the model's own saves
        self._stack: list[str] = []
        self._saved: dict[StorageKey, SavedStorage] = {}
        self._save_index = 0  # saves counted so far: the save order
        self._call_starts: list[int] = []  # save order at the start of each running module's call
        self._calls: dict[str, list[tuple[int, int]]] = {}
        self._refs: dict[StorageKey, list[weakref.ref]] = {}
        self._copies: dict[StorageKey, int] = {}
        self._inputs: dict[str, set[StorageKey]] = {}
        self._input_nbytes: dict[StorageKey, int] = {}
        self._starts: list[Any] = []
        self._seconds: dict[str, float] = {}
        self._events: list[tuple[str, Any, Any]] = []
        self._uncounted = 0
        self._autocast: list[tuple[str, bool]] = []  # per running module call: device type, began under autocast
        # Autocast around the saves outside every module (a loss after the model); not readable inside a compiled
        # training step, where it is taken as on: no mixed-precision advice on what was not measured.
        self._outside_autocast = not self._root_hooked
        first_parameter = next(module.parameters(), None)
        self._model_device_type = first_parameter.device.type if first_parameter is not None else ""
        self._handles: list[RemovableHandle] = []
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def __enter__(self) -> SavedTensorRecorder:
        if self._hooks is not None:
            raise RuntimeError("this SavedTensorRecorder is already active")
        # Hooks on the model's modules, not process-wide: Dynamo guards on the process-wide hook dicts (and on
        # ``always_call`` hooks) inside any compiled region, and would recompile it at each profiled step.
        self._handles = [
            handle
            for m in self._hooked
            for handle in (m.register_forward_pre_hook(self._enter_module), m.register_forward_hook(self._leave_module))
        ]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop recording (idempotent): pop the saved-tensor hooks and remove the module hooks.

        Storages whose saving nodes were all freed by then (a graph dropped during the forward) are
        forgotten: backward will not find them.
        """
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
            for key in [key for key, refs in self._refs.items() if not any_alive(refs)]:
                del self._saved[key], self._refs[key]
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for stack in (self._stack, self._autocast, self._call_starts, self._starts):  # calls a raise left open
            stack.clear()

    @property
    def active(self) -> bool:
        return self._hooks is not None

    @_module_hook
    def _enter_module(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        name = self._names.get(id(module))
        if name is None:
            return
        self._stack.append(name)
        self._call_starts.append(self._save_index)
        inputs = self._inputs.setdefault(name, set())
        first: Tensor | None = None
        for t in tensors_in(args):
            first = first if first is not None else t
            key = storage_key(t)
            if key is not None and key not in self._exclude:
                inputs.add(key)
                self._input_nbytes.setdefault(key, storage_nbytes(t))
        # The device of the input, else of the module's parameters, else of the model's (a call with keyword
        # arguments only: a loss module).
        device = first if first is not None else next(module.parameters(), None)
        device_type = device.device.type if device is not None else self._model_device_type
        # Read here, between ops: inside one, autocast's dispatch is switched off and reads as disabled.
        self._autocast.append((device_type, bool(device_type) and _autocast_on(device_type)))
        if not (self._time_all or name in self._time_names):
            self._starts.append(None)
        elif first is not None and first.is_cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._starts.append(start)
        else:
            self._starts.append(time.perf_counter())

    @_module_hook
    def _leave_module(self, module: nn.Module, *_: Any) -> None:
        name = self._names.get(id(module))
        if name is None or name not in self._stack:
            return
        # Calls whose forward raised (caught inside the step) left no forward hook call: dropped here.
        while self._stack[-1] != name:
            for stack in (self._stack, self._autocast, self._call_starts, self._starts):
                stack.pop()
        self._stack.pop()
        device_type, _ = self._autocast.pop()
        # Back in the training step, where the loss may be computed; not after a call without grad (a frozen
        # teacher run in float32), which saves nothing.
        if not self._autocast and device_type and torch.is_grad_enabled():
            self._outside_autocast = _autocast_on(device_type)
        self._calls.setdefault(name, []).append((self._call_starts.pop(), self._save_index))
        start = self._starts.pop()
        if isinstance(start, float):
            self._seconds[name] = self._seconds.get(name, 0.0) + time.perf_counter() - start
        elif start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((name, start, end))

    @_eager
    def _pack(self, tensor: Tensor) -> Tensor:
        # A detached alias, as the saved_tensors_hooks docs ask: what the graph keeps must not lead
        # back to a grad_fn, or graph and tensor could keep each other alive.
        packed = tensor.detach()
        if in_extra_forward():
            return packed  # trainvitals' own forward (the batch-independence check's), not the step's
        key = storage_key(tensor)
        if key is None:
            self._uncounted += 1
            return packed
        if key in self._exclude:
            return packed
        if self._copies_parameter(tensor):
            self._copies.setdefault(key, storage_nbytes(tensor))
            return packed
        saver = self._stack[-1] if self._stack else self._outside
        seen = self._saved.get(key)
        if seen is None or not any_alive(self._refs[key]):  # new, or a freed storage's address reused
            under = self._autocast[-1][1] if self._autocast else self._outside_autocast
            self._saved[key] = SavedStorage(storage_nbytes(tensor), tensor.dtype, (saver,), (self._save_index,), under)
            self._refs[key] = []
        else:
            self._saved[key] = dataclasses.replace(
                seen, savers=seen.savers + (saver,), saves=seen.saves + (self._save_index,)
            )
        self._save_index += 1
        self._refs[key].append(weakref.ref(packed))
        return packed

    def _copies_parameter(self, tensor: Tensor) -> bool:
        """``tensor`` is (a view of) a dtype cast of one of the module's parameters or of a slice of one:
        ``Linear`` under autocast saves ``weight.to(bf16).t()``, ``nn.MultiheadAttention`` casts the
        chunks of its packed ``in_proj_weight``."""
        base = tensor._base if tensor._base is not None else tensor
        if base.grad_fn is None:  # a frozen parameter's cast: autograd does not link it to the parameter
            return self._casts_frozen_parameter(base)
        if base.grad_fn.name() != "ToCopyBackward0":
            return False
        node = base.grad_fn
        for _ in range(_MAX_VIEW_HOPS):  # through the views between the parameter and the cast
            if not node.next_functions or node.next_functions[0][0] is None:
                return False
            node = node.next_functions[0][0]
            source = getattr(node, "variable", None)  # AccumulateGrad's leaf
            if source is not None:
                return storage_key(source) in self._parameters
            # A view or a copy of the parameter (``w.t().contiguous()``) is the parameter's size at any
            # batch; a computation (an embedding lookup) is an activation.
            if not (is_view_op(node.name()) or node.name().startswith("CloneBackward")):
                return False
        return False

    def _casts_frozen_parameter(self, base: Tensor) -> bool:
        """A 16-bit tensor without history equal to a wider frozen parameter of its shape: compared on
        elements spread over it (a host sync, for such a tensor only), unless those are all zero (a
        zero-initialised parameter would match any zero activation)."""
        if base.dtype not in (torch.float16, torch.bfloat16) or base.requires_grad:
            return False
        for p in self._frozen.get(tuple(base.shape), ()):
            if p.dtype == base.dtype or p.device != base.device:
                continue
            stride = p.numel() // _FINGERPRINT + 1  # spread over rows and columns: a zero row or column says nothing
            sample = p.detach().reshape(-1)[::stride][:_FINGERPRINT].to(base.dtype)
            if bool(sample.any()) and torch.equal(base.reshape(-1)[::stride][:_FINGERPRINT], sample):
                return True
        return False

    def report(self) -> SavedTensorReport:
        """The totals so far; syncs with the device when CUDA forward times are pending."""
        by_module: dict[str, int] = {}
        for saved in self._saved.values():
            by_module[saved.savers[0]] = by_module.get(saved.savers[0], 0) + saved.nbytes
        if self._events:
            self._events[-1][2].synchronize()
            for name, start, end in self._events:
                self._seconds[name] = self._seconds.get(name, 0.0) + start.elapsed_time(end) / 1000.0
            self._events.clear()
        return SavedTensorReport(
            total_bytes=sum(s.nbytes for s in self._saved.values()),
            by_module=dict(sorted(by_module.items(), key=lambda kv: -kv[1])),
            storages=dict(self._saved),
            module_inputs={name: frozenset(keys) for name, keys in self._inputs.items()},
            input_nbytes=dict(self._input_nbytes),
            forward_seconds=dict(self._seconds),
            module_calls={name: tuple(calls) for name, calls in self._calls.items()},
            uncounted=self._uncounted,
            parameter_copy_bytes=sum(self._copies.values()),
        )

    def held(self) -> dict[StorageKey, tuple[int, list[weakref.ref]]]:
        """Saved storages still referenced by a graph now: key → (bytes, weak references).

        Called after backward, a non-empty result means part of the graph outlived its backward
        (``retain_graph=True``, or saved tensors of a branch that backward never reached).
        """
        return {key: (self._saved[key].nbytes, refs) for key, refs in self._refs.items() if any_alive(refs)}


def any_alive(refs: list[weakref.ref]) -> bool:
    """Whether one of the weak references still points at its tensor."""
    return any(r() is not None for r in refs)


def _autocast_on(device_type: str) -> bool:
    """Whether ``torch.autocast`` is on for ``device_type`` now."""
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4 takes no device type: CUDA's, and CPU's apart
        return torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()
    except RuntimeError:  # a device type autocast does not know (meta, lazy)
        return False
