"""Memory of the computation graph: saved tensors per module, model-state bytes, graphs held across
steps, and the arithmetic of the remedies (docs/science.md §5).

Categories, all in bytes and all counted by storage, so that views and tied weights count once:

- parameters, buffers, gradients and optimizer state (every tensor in ``optimizer.state``);
- inputs: the tensors of the batch, their own elements (a batch sliced from a dataset that lives on
  the device is the slice, not the dataset);
- saved activations: what autograd keeps for backward, seen through
  ``torch.autograd.graph.saved_tensors_hooks``. Each saved tensor is attributed to the innermost module
  whose forward is running (module forward pre/post hooks keep the stack), deduplicated by storage
  (``untyped_storage().data_ptr()``, ``nbytes()``), and left out when its storage belongs to a
  parameter, a buffer or the batch: ``Linear`` saves ``weight.t()``, a view of a parameter, and the
  first layer saves the batch, but neither is an activation. A storage whose every saving node was
  freed before the recorder closes (a metric computed with grad on, then dropped) is not counted:
  nothing holds it at backward. This works on any device;
- parameter copies: saved casts of parameters, of slices of them (a packed weight's chunks) or of
  whole frozen parameters (recognised by shape and value: autograd does not link them to the
  parameter) — autocast's 16-bit weights above all. Their size does not depend on the batch:
  fixed bytes, not activations. Autocast caches the casts of trainable parameters until its region
  ends, so checkpointing does not free those.

A graph kept alive across steps (``total = total + loss`` with ``retain_graph=True``, a hidden state
that is never detached) shows as saved tensors that are still referenced after backward and whose
bytes grow step by step. The recorder keeps only weak references to what it saw, so it never keeps a
graph alive itself.

Nothing here imports Lightning; nothing here syncs with the device except
:meth:`SavedTensorRecorder.report` when it times modules on CUDA.
"""

from __future__ import annotations

import dataclasses
import math
import time
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from trainvitals.core.graph import is_view_op

ROOT = "(root)"
"""Label of the root module's own forward (ops not inside any child module)."""
OUTSIDE = "(outside)"
"""Label of tensors saved while no module's forward runs (a loss computed in ``training_step``)."""

StorageKey = tuple[str, int]
"""``(device, data_ptr)`` of an untyped storage: equal for all views of one storage."""


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """A hook that runs inside a ``torch.compile``'d model as plain Python: Dynamo would otherwise trace it,
    guard on the module name it handles and recompile it per module until its limit, warning each time."""
    return torch.compiler.disable(hook, recursive=True)


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
    """

    parameters: int
    gradients: int
    optimizer_state: int
    buffers: int = 0

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
    return ModelStateBytes(unique_storage_bytes(params), unique_storage_bytes(grads), unique_storage_bytes(state),
                           unique_storage_bytes(own_buffers))


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
    return packed


class SavedTensorRecorder:
    """Context manager that records, per module, what autograd saves for backward while it is active.

    Enter it before the forward and leave it before the backward. Nothing it keeps references a
    tensor: the graph owns what is saved (a detached alias of each saved tensor), the recorder only
    weak references, storage keys and sizes. (The graph does keep the hooks, and so the recorder.)
    Inside a nested ``saved_tensors_hooks`` context (non-reentrant activation checkpointing,
    ``save_on_cpu``) the inner hooks take the saves: what they keep elsewhere is not counted, which
    for checkpointing is the point; the checkpoint's saved inputs are.

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
        self._outside_autocast = False  # autocast around the saves outside every module (a loss after the model)
        first_parameter = next(module.parameters(), None)
        self._model_device_type = first_parameter.device.type if first_parameter is not None else ""
        self._handles: list[RemovableHandle] = []
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def __enter__(self) -> SavedTensorRecorder:
        if self._hooks is not None:
            raise RuntimeError("this SavedTensorRecorder is already active")
        # Two process-wide hooks, filtered to the model's modules, cost the same for any model size.
        self._handles = [nn.modules.module.register_module_forward_pre_hook(self._enter_module),
                         nn.modules.module.register_module_forward_hook(self._leave_module, always_call=True)]
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
            for key in [key for key, refs in self._refs.items() if not _alive(refs)]:
                del self._saved[key], self._refs[key]
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def active(self) -> bool:
        return self._hooks is not None

    @_eager
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

    @_eager
    def _leave_module(self, module: nn.Module, *_: Any) -> None:
        if id(module) not in self._names:
            return
        name = self._stack.pop()
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
        key = storage_key(tensor)
        if key is None:
            self._uncounted += 1
            return packed
        if key in self._exclude:
            return packed
        if self._copies_parameter(tensor):
            self._copies.setdefault(key, storage_nbytes(tensor))
            return packed
        saver = self._stack[-1] if self._stack else OUTSIDE
        seen = self._saved.get(key)
        if seen is None or not _alive(self._refs[key]):  # new, or a freed storage's address reused
            under = self._autocast[-1][1] if self._autocast else self._outside_autocast
            self._saved[key] = SavedStorage(storage_nbytes(tensor), tensor.dtype, (saver,), (self._save_index,), under)
            self._refs[key] = []
        else:
            self._saved[key] = dataclasses.replace(seen, savers=seen.savers + (saver,),
                                                   saves=seen.saves + (self._save_index,))
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
        return {key: (self._saved[key].nbytes, refs) for key, refs in self._refs.items() if _alive(refs)}


def _alive(refs: list[weakref.ref]) -> bool:
    return any(r() is not None for r in refs)


def _enclosing(name: str) -> list[str]:
    """``name`` and the modules around it, innermost first, ending with :data:`ROOT`."""
    if name in (ROOT, OUTSIDE):
        return [name]
    parts = name.split(".")
    return [".".join(parts[:k]) for k in range(len(parts), 0, -1)] + [ROOT]


def _innermost_common(savers: tuple[str, ...]) -> str:
    """The innermost module whose forward contains every saver (:data:`OUTSIDE` if one ran outside all)."""
    if OUTSIDE in savers:
        return OUTSIDE
    common = set(_enclosing(savers[0]))
    for saver in savers[1:]:
        common.intersection_update(_enclosing(saver))
    # The enclosing modules form a chain; the innermost is the deepest (ROOT, always common, the outermost).
    return max(common, key=lambda n: -1 if n == ROOT else n.count("."))


def checkpoint_savings(report: SavedTensorReport) -> dict[str, int]:
    """Bytes that activation checkpointing of each module would free, from one recorded forward.

    Checkpointing a module keeps its tensor arguments and recomputes everything saved inside it. A
    storage is freed when every op that saved it ran inside the module; one also saved outside (the
    module's output saved again by the next layer) stays. So, per module ``M``:

        savings(M) = bytes(saved only inside M) − bytes(M's inputs that were saved only inside M)
                     − bytes(M's inputs that were not saved at all)

    It is negative when the module is cheap to keep and its input is not otherwise saved
    (checkpointing an element-wise op alone). Excluded storages (batch, parameters) never count.

    Returns:
        Every module that ran a forward (qualified name, or :data:`ROOT`) → bytes freed.
    """
    owner = {key: _innermost_common(s.savers) for key, s in report.storages.items()}
    inside: dict[str, int] = {}
    for key, s in report.storages.items():
        if owner[key] != OUTSIDE:
            for name in _enclosing(owner[key]):
                inside[name] = inside.get(name, 0) + s.nbytes
    savings = {}
    for name, inputs in report.module_inputs.items():
        freed = inside.get(name, 0)
        for key in inputs:
            if key not in report.storages:
                freed -= report.input_nbytes[key]
            elif name in _enclosing(owner[key]):
                freed -= report.storages[key].nbytes
        savings[name] = freed
    return savings


def checkpoint_peak(report: SavedTensorReport, name: str) -> int:
    """Saved bytes held while backward recomputes module ``name``, were it checkpointed.

    A checkpointed module's saved tensors come back in backward, one call at a time, when its forward
    runs again: then what layers outside it saved before the call is still held (backward has not
    reached them; what they saved after it is released by then, and what the module's own other calls
    saved, checkpointing dropped), with the inputs the checkpoint keeps and everything the call saves
    (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost", §3: the peak is the checkpoints
    plus one segment). Checkpointing the module that saves most of a model's activations in its first layers
    frees them after forward but not at this peak, so the step's peak hardly falls.

    Returns:
        Bytes at the costliest call, to compare with ``total_bytes`` − :func:`checkpoint_savings`.
    """
    inputs = report.module_inputs.get(name, frozenset())
    saves = {key: [(name in _enclosing(saver), index) for saver, index in zip(s.savers, s.saves)]
             for key, s in report.storages.items()}  # (saved inside the module, save index)

    def held(start: int, end: int) -> int:
        return sum(s.nbytes for key, s in report.storages.items()
                   if (key in inputs and s.saves[0] < start)
                   or any((not inside and index < start) or (inside and start <= index < end)
                          for inside, index in saves[key]))

    peak = max((held(start, end) for start, end in report.module_calls.get(name, ((0, 0),))), default=0)
    return peak + sum(report.input_nbytes[key] for key in inputs if key not in report.storages)


def whole_forward_modules(report: SavedTensorReport) -> set[str]:
    """Modules that run the model's whole forward: the root's only module that ran, that one's only, ...

    Checkpointing one of them is checkpointing the model: it frees nearly everything for a second
    full forward, so :func:`rank_remedies` leaves them out, like the root.
    """
    ran = set(report.module_inputs) - {ROOT}
    children: dict[str, list[str]] = {}
    for name in ran:
        parent = next((n for n in _enclosing(name)[1:] if n in ran), ROOT)
        children.setdefault(parent, []).append(name)
    chain, current = set(), ROOT
    while len(children.get(current, ())) == 1:
        current = children[current][0]
        chain.add(current)
    return chain


def transformer_layer_activation_bytes(
    seq_len: int, batch: int, hidden: int, heads: int, float_bytes: int = 2, mask_bytes: int = 1
) -> int:
    """Activation bytes one transformer layer saves for backward (Korthikanti et al. 2022, §4.1, Eq. 1).

    The paper counts, per layer with sequence ``s``, batch ``b``, hidden size ``h``, ``a`` heads: the
    attention block (QKV input, Q, K, V, softmax output, its dropout mask and output, projection
    input, dropout mask), the MLP (both linear inputs, the GELU input, dropout mask) and two
    LayerNorm inputs. With ``p`` bytes per float and ``m`` per dropout-mask element:

        s·b·h·(16p + 2m) + a·s²·b·(2p + m)  bytes

    which is the paper's ``s·b·h·(34 + 5·a·s/h)`` for fp16 (p = 2, m = 1). In fp32 on CUDA use
    p = 4, m = 1; on CPU, where dropout multiplies by a float mask, m = p. LayerNorm's per-row mean
    and reciprocal std are left out, as in the paper.
    """
    s, b, h, a = seq_len, batch, hidden, heads
    return s * b * h * (16 * float_bytes + 2 * mask_bytes) + a * s * s * b * (2 * float_bytes + mask_bytes)


@dataclass(frozen=True)
class HeldGraph:
    """Saved tensors of profiled steps that are still referenced by a graph, at the end of a step.

    Attributes:
        step: the profiled step (optimizer steps) just finished.
        held_bytes: distinct bytes still held, from all tracked steps.
        carried_bytes: the part first saved in an earlier profiled step: a graph that outlived its step.
        step_bytes: the part first saved in ``step``, still held after its backward.
        first_step: the earliest tracked step whose saved tensors are still held (``None``: none).
        growing: ``held_bytes`` exceeds the previous observation's.
    """

    step: int
    held_bytes: int
    carried_bytes: int
    step_bytes: int
    first_step: int | None
    growing: bool

    @property
    def leaking(self) -> bool:
        """A graph is kept alive across steps and grows: saved bytes that neither fall back nor stay flat."""
        return self.carried_bytes > 0 and self.growing


class HeldGraphTracker:
    """Follows, by weak reference, what profiled steps saved and is still held after their backward.

    Args:
        max_steps: how many profiled steps with held tensors to follow; older ones are dropped.

    Raises:
        ValueError: if ``max_steps < 1``.
    """

    def __init__(self, max_steps: int = 256) -> None:
        if max_steps < 1:
            raise ValueError(f"`max_steps` must be >= 1, got {max_steps}")
        self.max_steps = max_steps
        self._steps: dict[int, dict[StorageKey, tuple[int, list[weakref.ref]]]] = {}
        self._previous_bytes = 0

    def update(self, step: int, held: dict[StorageKey, tuple[int, list[weakref.ref]]]) -> HeldGraph:
        """Add ``held`` (from :meth:`SavedTensorRecorder.held`, after backward) and measure what is alive."""
        if held:
            self._steps[step] = held
        alive: dict[StorageKey, tuple[int, int]] = {}
        for s in sorted(self._steps):
            live = {key: v for key, v in self._steps[s].items() if _alive(v[1])}
            if live:
                self._steps[s] = live
                for key, (nbytes, _) in live.items():
                    alive.setdefault(key, (s, nbytes))
            else:
                del self._steps[s]
        while len(self._steps) > self.max_steps:
            del self._steps[min(self._steps)]
        held_bytes = sum(nbytes for _, nbytes in alive.values())
        carried = sum(nbytes for s, nbytes in alive.values() if s < step)
        observation = HeldGraph(
            step=step, held_bytes=held_bytes, carried_bytes=carried, step_bytes=held_bytes - carried,
            first_step=min(self._steps) if self._steps else None, growing=held_bytes > self._previous_bytes,
        )
        self._previous_bytes = held_bytes
        return observation


@dataclass(frozen=True)
class GraphLeakFinding:
    """A graph kept alive across steps: saved bytes that do not fall back after backward and grow.

    Attributes:
        step: the profiled step (optimizer steps) it was seen at.
        held_bytes: saved bytes of profiled steps still held then.
        bytes_per_step: saved bytes the step kept after its backward.
        since_step: the earliest profiled step whose saved tensors are still held.
        holders: module attributes holding a graph (:func:`graph_holders`), may be empty.
    """

    step: int
    held_bytes: int
    bytes_per_step: int
    since_step: int
    holders: tuple[str, ...]

    @property
    def estimated_bytes(self) -> int:
        """Bytes held if every step since ``since_step`` kept as much as this one (profiled or not)."""
        return self.bytes_per_step * (self.step - self.since_step + 1)

    @property
    def message(self) -> str:
        held_by = (f"held by {', '.join(f'`{h}`' for h in self.holders)}: keep a float (`.item()`) or "
                   "`.detach()` it" if self.holders else
                   "no module attribute holds a graph: look for a list or variable outside the model, or "
                   "`backward(retain_graph=True)`")
        return (f"a graph is kept alive across steps: {format_bytes(self.bytes_per_step)} of saved tensors per "
                f"step are still held after backward, held since step {self.since_step} "
                f"(≈ {format_bytes(self.estimated_bytes)} by step {self.step}); {held_by}")


def graph_holders(module: nn.Module, prefix: str = "self") -> list[str]:
    """Attributes of ``module`` and its submodules that hold a tensor attached to an autograd graph.

    Between steps no attribute should: one that does (``self.running_loss = self.running_loss + loss``)
    keeps that step's graph alive. Lists, tuples and dicts in attributes are searched too.

    Returns:
        Names such as ``"self.running_loss"`` or ``"self.encoder.cache"``.
    """
    internal = {"_parameters", "_buffers", "_modules"}
    found = []
    for name, m in module.named_modules():
        base = f"{prefix}.{name}" if name else prefix
        for attr, value in vars(m).items():
            if attr in internal or isinstance(value, nn.Module):
                continue
            if any(t.grad_fn is not None for t in tensors_in(value)):
                found.append(f"{base}.{attr}")
    return found


def largest_batch(budget_bytes: int, fixed_bytes: int, scaling_bytes: int, batch_size: int) -> int:
    """The largest batch that fits ``budget_bytes`` when ``scaling_bytes`` grow in proportion to the batch.

    ``floor((budget − fixed) · B / scaling)`` examples, 0 when the fixed part alone does not fit.

    Args:
        budget_bytes: the memory to fit in.
        fixed_bytes: bytes that do not depend on the batch (parameters, gradients, optimizer state).
        scaling_bytes: bytes at batch ``batch_size`` that are proportional to it (activations, inputs).
        batch_size: the batch the bytes were measured at.

    Raises:
        ValueError: if ``scaling_bytes`` or ``batch_size`` is not positive.
    """
    if scaling_bytes <= 0:
        raise ValueError(f"`scaling_bytes` must be > 0, got {scaling_bytes}")
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be >= 1, got {batch_size}")
    return max(0, (budget_bytes - fixed_bytes) * batch_size // scaling_bytes)


def mixed_precision_savings(report: SavedTensorReport) -> int:
    """Bytes freed if every float32 activation saved outside ``torch.autocast`` were kept in 16 bits: half
    their bytes. Those saved under autocast are float32 on purpose (softmax, norms, losses).

    An upper bound: autocast keeps some ops in fp32 and adds 16-bit copies of the weights it casts.
    """
    return sum(s.nbytes // 2 for s in report.storages.values() if s.dtype == torch.float32 and not s.autocast)


def _autocast_on(device_type: str) -> bool:
    """Whether ``torch.autocast`` is on for ``device_type`` now."""
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4 takes no device type: CUDA's, and CPU's apart
        return torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()
    except RuntimeError:  # a device type autocast does not know (meta, lazy)
        return False


@dataclass(frozen=True)
class Remedy:
    """One way to lower memory, with its numbers.

    Attributes:
        kind: ``"activation checkpointing"``, ``"mixed precision"`` or ``"optimizer state"``.
        target: the module to checkpoint (qualified name), else ``""``.
        bytes_freed: predicted bytes the step's peak falls by (checkpointing: of saved activations, at the
            step's peak, :func:`checkpoint_peak`).
        largest_batch: the largest batch that fits the budget after the remedy (``None``: no budget).
        extra_compute: extra step time as a fraction of the step (checkpointing: one more forward of
            the module), ``None`` when not measured or not applicable.
        note: the cost or condition in words.
    """

    kind: str
    target: str
    bytes_freed: int
    largest_batch: int | None
    extra_compute: float | None
    note: str


@dataclass(frozen=True)
class StepMemory:
    """Where the bytes of one profiled step go, and the budget they must fit.

    Attributes:
        state: parameters, buffers, gradients, optimizer state.
        inputs_bytes: the batch (one micro-batch).
        activations: the saved tensors of one micro-batch's forward.
        batch_size: examples in the batch.
        temporaries_bytes: peak minus the known categories (CUDA), counted as growing with the batch.
        budget_bytes: the memory to fit in, ``None`` for no batch advice.
        step_seconds: wall time of the profiled optimizer step, all its micro-batches, for the cost
            of checkpointing.
        micro_batches: forwards in that time (gradient accumulation): checkpointing recomputes a
            module in each.
    """

    state: ModelStateBytes
    inputs_bytes: int
    activations: SavedTensorReport
    batch_size: int
    temporaries_bytes: int = 0
    budget_bytes: int | None = None
    step_seconds: float | None = None
    micro_batches: int = 1

    @property
    def fixed_bytes(self) -> int:
        """Bytes independent of the batch: the model state and autocast's parameter copies."""
        return self.state.total + self.activations.parameter_copy_bytes

    @property
    def scaling_bytes(self) -> int:
        """Bytes proportional to the batch: activations, inputs and (non-negative) temporaries."""
        return self.activations.total_bytes + self.inputs_bytes + max(0, self.temporaries_bytes)

    def largest_batch(self, fixed_freed: int = 0, scaling_freed: int = 0, activations_peak: int = 0) -> int | None:
        """The largest batch under the budget once ``fixed_freed`` / ``scaling_freed`` bytes are freed and
        with saved activations of at least ``activations_peak`` bytes at some point of the step (a
        checkpointed module's recompute, :func:`checkpoint_peak`); ``None`` without a budget or a batch size."""
        scaling = max(self.scaling_bytes - scaling_freed,
                      self.scaling_bytes - self.activations.total_bytes + activations_peak)
        if self.budget_bytes is None or scaling <= 0 or self.batch_size < 1:
            return None
        return largest_batch(self.budget_bytes, self.fixed_bytes - fixed_freed, scaling, self.batch_size)


def rank_remedies(memory: StepMemory, top_k: int = 3) -> list[Remedy]:
    """The remedies, the most bytes off the step's peak first: checkpointing of the ``top_k`` modules that
    lower the step's peak of saved activations the most (what :func:`checkpoint_savings` frees after
    forward, less what :func:`checkpoint_peak` holds again in backward; the root and
    :func:`whole_forward_modules` left out; for cost, only the ``4 · top_k`` that free the most after
    forward are weighed, so a better one behind many may be missed), mixed precision
    (:func:`mixed_precision_savings`: the float32 activations saved outside autocast; not for a step
    that saves mostly 16-bit already) and the optimizer state (all
    of it, as with a stateless or sharded optimizer). Remedies that free nothing are left out.

    Raises:
        ValueError: if ``top_k < 0``.
    """
    if top_k < 0:
        raise ValueError(f"`top_k` must be >= 0, got {top_k}")
    report = memory.activations
    skip = whole_forward_modules(report) | {ROOT}
    # The peaks cost a pass over the storages each: only for the modules that free the most after forward.
    freeing = sorted(((n, b) for n, b in checkpoint_savings(report).items() if b > 0 and n not in skip),
                     key=lambda kv: -kv[1])[:4 * top_k]
    lowered = []
    for name, freed in freeing:
        peak = checkpoint_peak(report, name)
        lowered.append((report.total_bytes - max(peak, report.total_bytes - freed), name, freed, peak))
    remedies = []
    for reduction, name, freed, peak in sorted((c for c in lowered if c[0] > 0), key=lambda c: -c[0])[:top_k]:
        seconds = report.forward_seconds.get(name)
        extra = seconds * memory.micro_batches / memory.step_seconds if seconds is not None and memory.step_seconds \
            else None
        # The reentrant variant recomputes nothing when the module's input needs no grad (the batch).
        note = (f"call `{name}` through `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: it frees "
                f"{format_bytes(freed)} after forward; backward runs its forward again")
        if peak > report.total_bytes - freed:
            note += f", holding {format_bytes(peak)} of saved tensors then"
        remedies.append(Remedy("activation checkpointing", name, reduction,
                               memory.largest_batch(scaling_freed=freed, activations_peak=peak), extra, note))
    halved = mixed_precision_savings(report)
    sixteen_bit = sum(s.nbytes for s in report.storages.values() if s.dtype in (torch.float16, torch.bfloat16))
    if halved > 0 and sixteen_bit < 2 * halved:  # halved: half the float32 bytes saved outside autocast
        remedies.append(Remedy("mixed precision", "", halved, memory.largest_batch(scaling_freed=halved), None,
                               "bf16/fp16 autocast; an upper bound: some ops stay in fp32"))
    state = memory.state
    if state.optimizer_state > 0:
        ratio = state.optimizer_state / state.parameters if state.parameters else math.nan
        remedies.append(Remedy("optimizer state", "", state.optimizer_state,
                               memory.largest_batch(fixed_freed=state.optimizer_state), None,
                               f"{ratio:.2f} × parameter bytes (Adam 2×, SGD with momentum 1×, SGD 0); "
                               "sharding it over N ranks keeps 1/N"))
    return sorted(remedies, key=lambda r: -r.bytes_freed)


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
