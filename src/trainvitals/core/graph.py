"""The autograd graph behind a loss, and what went wrong in it.

A loss's ``grad_fn`` is the root of a graph of autograd nodes; ``next_functions`` lead from each node to
the nodes of its inputs, and the graph ends in ``AccumulateGrad`` leaves, one per tensor that receives
a ``.grad`` (normally a parameter). :func:`walk_graph` visits that graph once, O(nodes), in Python, with
no kernel launch and no host sync. Autograd numbers every node it creates in a thread-local sequence
(``torch.autograd._get_sequence_nr``); a node numbered below a mark taken at the start of a training
step was created before that step, which is how state carried across steps (a hidden state not
detached, a running total kept as a tensor) shows up.

Under ``torch.compile`` a compiled region is one ``CompiledFunctionBackward`` node: the walk still
reaches every parameter the region uses, and nodes from earlier steps fed into it, but not the
operations inside it.

The rest gathers the evidence behind autograd's classic errors: which node's saved tensors were freed
or modified in place (:func:`saved_tensor_errors`), and :class:`GraphTracer`, which re-runs a step under
a ``TorchFunctionMode`` to record where a value left the graph (``.item()``, ``.detach()``,
``torch.no_grad()``) and which in-place operation changed a tensor autograd had saved.
:mod:`trainvitals.core.integrity` turns that evidence into diagnoses.
"""

from __future__ import annotations

import enum
import functools
import os
import re
import sys
import sysconfig
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import Node
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

_ACCUMULATE_GRAD = "AccumulateGrad"
# Frames in these folders are library code; a diagnosis points at the first frame outside them.
_LIBRARY_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
_STDLIB = sysconfig.get_paths()["stdlib"]


def _is_library(filename: str, skip_dirs: tuple[str, ...] = ()) -> bool:
    """torch, this module, ``skip_dirs``, and the standard library (``contextlib`` under ``no_grad``),
    but not the packages installed beside it."""
    if filename.startswith(_LIBRARY_DIRS + skip_dirs) or filename.startswith("<"):
        return True
    return filename.startswith(_STDLIB) and "-packages" + os.sep not in filename


def sequence_mark() -> int | None:
    """The number autograd will give the next node created in this thread; ``None`` if torch hides it."""
    get = getattr(torch.autograd, "_get_sequence_nr", None)
    return None if get is None else int(get())


def _is_leaf_node(node: Node) -> bool:
    return type(node).__name__ == _ACCUMULATE_GRAD


def _sequence_nr(node: Node) -> int | None:
    get = getattr(node, "_sequence_nr", None)
    return None if get is None else int(get())


def created_before(node: Node, mark: int | None) -> bool:
    """Whether autograd created ``node`` before :func:`sequence_mark` returned ``mark`` (False if either is
    unknown)."""
    number = _sequence_nr(node)
    return mark is not None and number is not None and number < mark


@dataclass(frozen=True)
class GraphWalk:
    """What a loss's graph reaches.

    Attributes:
        leaves: the tensors of the ``AccumulateGrad`` leaves (the tensors that will get a ``.grad``), and
            the parameters of reentrant checkpoint regions.
        stale: nodes created before the mark, where the walk entered them (it does not go further).
        nodes: every node visited, leaves and stale nodes included.
        opaque: a reentrant checkpoint region re-runs a function that is not a module's: the
            parameters it uses cannot be known before backward.
    """

    leaves: tuple[Tensor, ...]
    stale: tuple[Node, ...]
    nodes: frozenset[Node]
    opaque: bool = False


def walk_graph(root: Tensor | Node | None, before: int | None = None) -> GraphWalk:
    """Visit the graph from ``root`` (a tensor's ``grad_fn`` or a node) to its ``AccumulateGrad`` leaves.

    Args:
        root: the loss, or an autograd node. A tensor without ``grad_fn`` gives an empty walk.
        before: a :func:`sequence_mark`; nodes numbered below it are reported as ``stale`` and not
            entered, so a graph that grows step by step costs no more than one step's graph.

    Returns:
        The leaves, the stale entry nodes and all nodes visited. Cost O(nodes), no host sync.
    """
    start = root.grad_fn if isinstance(root, Tensor) else root
    if start is None:
        return GraphWalk((), (), frozenset())
    seen = {start}
    stack = [start]
    leaves: list[Tensor] = []
    stale: list[Node] = []
    opaque = False
    while stack:
        node = stack.pop()
        if _is_leaf_node(node):
            leaves.append(node.variable)
            continue
        if hasattr(node, "run_function"):  # torch.utils.checkpoint(use_reentrant=True)
            hidden = _checkpointed_parameters(node)
            opaque = opaque or hidden is None
            leaves.extend(hidden or ())
        if before is not None:
            nr = _sequence_nr(node)
            if nr is not None and nr < before:
                stale.append(node)
                continue
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return GraphWalk(tuple(leaves), tuple(stale), frozenset(seen), opaque)


def _checkpointed_parameters(node: Node) -> list[Tensor] | None:
    """The trainable parameters a reentrant checkpoint region uses. Its graph exists only during
    backward, so the node's ``next_functions`` lead to the region's inputs, never to the parameters
    inside; but the node (the autograd Function's ctx) keeps the function it re-runs. A module, its
    ``forward`` or a ``functools.partial`` of either names them; anything else — another method of a
    module may use any part of it — gives ``None``: unknown."""
    run = node.run_function
    while isinstance(run, functools.partial):
        run = run.func
    owner = getattr(run, "__self__", None)
    if isinstance(owner, nn.Module) and getattr(run, "__func__", None) is type(owner).forward:
        run = owner
    return [p for p in run.parameters() if p.requires_grad] if isinstance(run, nn.Module) else None


def nearest_leaves(node: Node, max_depth: int = 8) -> list[Tensor]:
    """The leaf tensors closest to ``node`` (all at the smallest depth that has any), breadth first.

    Used to say which module a node belongs to: an ``AddmmBackward0`` is one step from its bias.
    """
    frontier, seen = [node], {node}
    for _ in range(max_depth):
        found = [n.variable for n in frontier if _is_leaf_node(n)]
        if found:
            return found
        nxt = []
        for n in frontier:
            for child, _ in n.next_functions:
                if child is not None and child not in seen:
                    seen.add(child)
                    nxt.append(child)
        frontier = nxt
    return []


# ------------------------------------------------------------------------------------------- naming

_MODULE_INTERNALS = frozenset(nn.Module().__dict__)


def _plain_attributes(module: nn.Module, prefix: str, depth: int = 3) -> Iterator[tuple[str, Any]]:
    """Tensors and modules kept in ``module``'s plain attributes and in lists, tuples and dicts there."""
    todo = deque((f"{prefix}{k}", v, 0) for k, v in vars(module).items() if k not in _MODULE_INTERNALS)
    while todo:
        name, value, level = todo.popleft()
        if isinstance(value, (Tensor, nn.Module)):
            yield name, value
        elif level < depth and isinstance(value, (list, tuple)):
            todo.extend((f"{name}[{i}]", v, level + 1) for i, v in enumerate(value))
        elif level < depth and isinstance(value, dict):
            todo.extend((f"{name}[{k!r}]", v, level + 1) for k, v in value.items() if isinstance(k, (str, int)))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _named_modules_all(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Registered submodules, and modules kept in plain lists/dicts (named ``layers[0]``), recursively."""
    seen: set[int] = set()
    todo: deque[tuple[str, nn.Module]] = deque([("", root)])
    while todo:
        base, mod = todo.popleft()
        for name, sub in mod.named_modules(prefix=base):
            if id(sub) in seen:
                continue
            seen.add(id(sub))
            yield name, sub
            for attr, value in _plain_attributes(sub, _join(name, "")):
                if isinstance(value, nn.Module) and id(value) not in seen:
                    todo.append((attr, value))


def module_names(root: nn.Module) -> dict[int, str]:
    """``id(module) -> name`` for every module under ``root`` (the root itself is ``""``)."""
    return {id(m): name for name, m in _named_modules_all(root)}


def tensor_names(root: nn.Module) -> dict[int, str]:
    """``id(tensor) -> name`` for parameters, buffers and tensors in plain attributes under ``root``.

    Registered names win; a layer kept in a plain Python list is named ``layers[0].weight``.
    """
    names: dict[int, str] = {}
    for mod_name, mod in _named_modules_all(root):
        for name, t in mod.named_parameters(prefix=mod_name, recurse=False):
            names.setdefault(id(t), name)
        for name, t in mod.named_buffers(prefix=mod_name, recurse=False):
            names.setdefault(id(t), name)
    for mod_name, mod in _named_modules_all(root):
        for name, value in _plain_attributes(mod, _join(mod_name, "")):
            if isinstance(value, Tensor):
                names.setdefault(id(value), name)
    return names


def owner_module(tensor_name: str) -> str:
    """``"net.0.weight" -> "net.0"``; a tensor of the root module belongs to ``""``."""
    return tensor_name.rpartition(".")[0]


def attributes_reaching(root: nn.Module, targets: set[Node] | frozenset[Node], before: int | None) -> list[str]:
    """Names of tensors in plain module attributes whose graph reaches one of ``targets``.

    Finds the attribute behind a stale graph: ``self.hidden`` built this step from last step's value
    reaches last step's nodes. ``before`` stops each walk at nodes older than the mark, as in
    :func:`walk_graph`.
    """
    found = []
    for mod_name, mod in _named_modules_all(root):
        for name, value in _plain_attributes(mod, _join(mod_name, "")):
            if isinstance(value, Tensor) and value.grad_fn is not None:
                walk = walk_graph(value, before)
                if value.grad_fn in targets or not targets.isdisjoint(walk.nodes):
                    found.append(name)
    return found


# ------------------------------------------------------------------------------- saved tensors, errors


class AutogradError(enum.Enum):
    """Autograd's classic errors, recognised by their message."""

    NO_GRAD = "element 0 of tensors does not require grad and does not have a grad_fn"
    SECOND_BACKWARD = "Trying to backward through the graph a second time"
    INPLACE = "one of the variables needed for gradient computation has been modified by an inplace operation"


def classify_autograd_error(exc: BaseException) -> AutogradError | None:
    """Which classic autograd error ``exc`` is, or ``None``."""
    if not isinstance(exc, RuntimeError):
        return None
    text = str(exc)
    return next((kind for kind in AutogradError if kind.value in text), None)


@dataclass(frozen=True)
class InplaceInfo:
    """What autograd's in-place error says: the saved tensor's shape, its version now and when saved,
    and the autograd node whose output it is."""

    shape: tuple[int, ...]
    version: int
    expected: int
    producer: str = ""

    @property
    def may_be_parameter(self) -> bool:
        """A parameter is saved through a view of it (``Linear``'s ``weight.t()`` is "output 0 of
        AsStrided"): an output of a computation ("output 0 of Sigmoid") is not one."""
        return is_view_op(self.producer)


_VIEW_OPS = frozenset({"AsStrided", "T", "Transpose", "Permute", "View", "UnsafeView", "Expand", "Slice",
                       "Select", "Unsqueeze", "Squeeze", "Alias", "ReshapeAlias", "Split", "SplitWithSizes",
                       "UnsafeSplit", "UnsafeSplitWithSizes", "Unbind", "Narrow", "Diagonal", "Unfold"})


def is_view_op(name: str) -> bool:
    """Whether an operation or autograd node name (``"T"``, ``"SplitBackward0"``) is a view: its output
    shares its input's storage (so a parameter's view is still the parameter's data)."""
    return re.sub(r"Backward\d*$", "", name) in _VIEW_OPS
_INPLACE_RE = re.compile(
    r"\[[\w.]+ \[([\d, ]*)\]\], which is output \d+ of (\w+), is at version (\d+); expected version (\d+)"
)


def parse_inplace_error(message: str) -> InplaceInfo | None:
    """Parse ``"[torch.FloatTensor [8, 4]], which is output 0 of TBackward0, is at version 1; expected
    version 0"``; ``None`` when the message has another form."""
    m = _INPLACE_RE.search(message)
    if m is None:
        return None
    shape = tuple(int(s) for s in m.group(1).split(",") if s.strip())
    return InplaceInfo(shape, int(m.group(3)), int(m.group(4)), m.group(2))


@dataclass(frozen=True)
class SavedTensorError:
    """A node whose saved tensor can no longer be unpacked.

    Attributes:
        node: the autograd node.
        saved: the name autograd saved it under (``"mat2"``, ``"result"``).
        kind: ``SECOND_BACKWARD`` (freed by an earlier backward) or ``INPLACE`` (modified since saved).
    """

    node: Node
    saved: str
    kind: AutogradError


def saved_tensor_errors(root: Tensor | Node | None) -> list[SavedTensorError]:
    """Unpack every saved tensor of every node under ``root`` and report the ones that fail.

    Reads saved tensors through the nodes' ``_saved_*`` attributes, so it costs one unpack per saved
    tensor: meant for a diagnosis, not for every step.
    """
    errors = []
    for node in walk_graph(root).nodes:
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            try:
                getattr(node, attr)
            except RuntimeError as err:
                kind = classify_autograd_error(err)
                if kind is not None:
                    errors.append(SavedTensorError(node, attr.removeprefix("_saved_"), kind))
    return errors


def anomaly_location(node: Node) -> str | None:
    """Where anomaly mode saw ``node``'s forward op run (its last frame outside libraries), if recorded."""
    trace = node.metadata.get("traceback_") if hasattr(node, "metadata") else None
    if not trace:
        return None
    lines = [ln for ln in trace if ln.lstrip().startswith("File ")]
    for line in reversed(lines):
        m = re.search(r'File "([^"]+)", line (\d+), in (\S+)', line)
        if m and not _is_library(m.group(1)):
            return f"{os.path.basename(m.group(1))}:{m.group(2)} in {m.group(3)}"
    return None


def user_location(skip_dirs: Sequence[str] = ()) -> str | None:
    """``"file.py:42 in training_step"``: the innermost caller outside torch, the stdlib and ``skip_dirs``."""
    skip = tuple(skip_dirs)
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _is_library(filename, skip):
            return f"{os.path.basename(filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return None


# ------------------------------------------------------------------------------------- the tracer


class Cut(enum.Enum):
    """How a value left the autograd graph, or a fact the tracer recorded."""

    ITEM = "read as a Python number"  # .item(), .tolist(), float(t)
    DETACH = "detached"  # .detach(), .data
    NO_GRAD = "computed with grad mode off"
    NON_DIFFERENTIABLE = "output of a non-differentiable op"
    FACTORY = "a new tensor built from Python values"
    GRAD_OFF = "grad mode switched off"
    INPLACE = "modified in place"


_ITEM_OPS = frozenset({"item", "tolist", "numpy", "__float__", "__int__"})
_DETACH_OPS = frozenset({"detach", "detach_", "data"})


@dataclass(frozen=True)
class TraceEvent:
    """One recorded call. ``index`` orders events and saves; ``storage`` is set for in-place events."""

    index: int
    op: str
    cut: Cut
    module: str | None
    location: str | None
    storage: int | None = None

    def where(self) -> str:
        """``"`sigmoid` in module `net.1` at model.py:12 in forward"``."""
        text = f"`{self.op}`"
        if self.module is not None:
            text += f" in module `{self.module}`" if self.module else " in the LightningModule's forward"
        return text + (f" at {self.location}" if self.location else "")


@dataclass(frozen=True)
class SavedRecord:
    """A tensor autograd saved for backward: by which op and module, and its version at that time."""

    index: int
    op: str
    module: str | None
    location: str | None
    storage: int
    version: int
    shape: tuple[int, ...]


def _op_name(func: Callable) -> str:
    name = getattr(func, "__name__", repr(func))
    if name == "__get__":  # a property such as Tensor.data
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _storage_ptr(t: Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta, some subclasses)
        return None


class GraphTracer(TorchFunctionMode):
    """Records, while active, where values leave the graph and which in-place ops hit saved tensors.

    Use as ``with GraphTracer(model) as tracer: ...``. It sees every torch call made in Python (a
    ``TorchFunctionMode``), the module running at that time (global forward hooks), and every tensor
    autograd saves (``saved_tensors_hooks``). Slow (a stack walk per event): for re-running one step
    to explain an error, never for training.

    Args:
        root: the model, to name modules; ``None`` names them by type.
        skip_dirs: folders whose frames are not the culprit's location (besides torch and the stdlib).

    Attributes:
        events: cuts, grad-mode switches and in-place modifications, in call order.
        saved: the tensors autograd saved, in order.
        grad_enabled_at_start: grad mode when the tracer was entered.
    """

    def __init__(self, root: nn.Module | None = None, skip_dirs: Sequence[str] = ()) -> None:
        super().__init__()
        self.skip_dirs = tuple(skip_dirs)
        self.events: list[TraceEvent] = []
        self.saved: list[SavedRecord] = []
        self.grad_enabled_at_start = True
        self._names = module_names(root) if root is not None else {}
        self._modules: list[str] = []
        self._ops: list[str] = []
        self._counter = 0
        # Lineage: id of a value -> ids of the values it was computed from, and the event it came with.
        # The values are kept alive in _keep so that their ids stay unique while tracing.
        self._parents: dict[int, tuple[int, ...]] = {}
        self._event_of: dict[int, TraceEvent] = {}
        self._keep: list[Any] = []
        self._exits: list[Callable[[], Any]] = []

    def __enter__(self) -> GraphTracer:
        self.grad_enabled_at_start = torch.is_grad_enabled()
        pre = nn.modules.module.register_module_forward_pre_hook(self._push_module)
        post = nn.modules.module.register_module_forward_hook(self._pop_module, always_call=True)
        saving = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        saving.__enter__()
        self._exits = [pre.remove, post.remove, lambda: saving.__exit__(None, None, None)]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for undo in reversed(self._exits):
            undo()
        self._exits = []

    def _push_module(self, module: nn.Module, _args: Any) -> None:
        self._modules.append(self._names.get(id(module), f"<{type(module).__name__}>"))

    def _pop_module(self, *_: Any) -> None:
        if self._modules:
            self._modules.pop()

    def _here(self) -> tuple[str | None, str | None]:
        return (self._modules[-1] if self._modules else None), user_location(self.skip_dirs)

    def _pack(self, t: Tensor) -> Tensor:
        ptr = _storage_ptr(t)
        if ptr is not None:
            module, location = self._here()
            op = self._ops[-1] if self._ops else "?"
            self.saved.append(SavedRecord(self._counter, op, module, location, ptr, t._version, tuple(t.shape)))
        return t

    def _event(self, op: str, cut: Cut, storage: int | None = None) -> TraceEvent:
        module, location = self._here()
        event = TraceEvent(self._counter, op, cut, module, location, storage)
        self.events.append(event)
        return event

    def __torch_function__(self, func: Callable, types: Any, args: Sequence = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        op = _op_name(func)
        inputs = tree_flatten((args, kwargs))[0]
        tensors = [a for a in inputs if isinstance(a, Tensor)]
        versions = [t._version for t in tensors]
        grad_on = torch.is_grad_enabled()
        self._counter += 1
        self._ops.append(op)
        try:
            out = func(*args, **kwargs)
        finally:
            self._ops.pop()
        if op == "_set_grad_enabled" and args and not args[0]:
            self._event(op, Cut.GRAD_OFF)
        for t, v in zip(tensors, versions):
            if t._version != v:
                self._event(op, Cut.INPLACE, _storage_ptr(t))
        self._link(op, inputs, tensors, out, grad_on)
        return out

    def _link(self, op: str, inputs: list, tensors: list[Tensor], out: Any, grad_on: bool) -> None:
        needs_grad = any(t.requires_grad for t in tensors)
        flat_out = tree_flatten(out)[0]
        cut: Cut | None = None
        if needs_grad and op in _ITEM_OPS:
            cut = Cut.ITEM
            # Follow the number itself, so that torch.tensor(loss.item()) links back to the loss.
            outputs = [o for o in flat_out if isinstance(o, float)]
        else:
            outputs = [o for o in flat_out if isinstance(o, Tensor)]
            if needs_grad and op in _DETACH_OPS:
                cut = Cut.DETACH
            elif needs_grad and any(not o.requires_grad for o in outputs):
                cut = Cut.NON_DIFFERENTIABLE if grad_on else Cut.NO_GRAD
            elif not tensors and outputs:
                cut = Cut.FACTORY
        if not outputs:
            return
        event = self._event(op, cut) if cut is not None else None
        parents = tuple(id(a) for a in inputs if isinstance(a, Tensor) or id(a) in self._parents)
        self._keep.extend(inputs)
        for o in outputs:
            if id(o) not in self._parents:
                self._keep.append(o)
                self._parents[id(o)] = parents
                if event is not None:
                    self._event_of[id(o)] = event

    def cuts_behind(self, value: Any) -> list[TraceEvent]:
        """The cut events among the ancestors of ``value`` (a tensor the traced code returned), in order.

        Follows the recorded lineage back from ``value``. A number read with ``.item()`` and passed
        straight to ``torch.tensor`` is followed; arithmetic on Python numbers is not, so when the
        lineage ends in a factory call the ``.item()`` calls of the trace are the suspects.
        """
        seen, todo, found = set(), [id(value)], []
        while todo:
            key = todo.pop()
            if key in seen:
                continue
            seen.add(key)
            event = self._event_of.get(key)
            if event is not None and event.cut is not Cut.INPLACE:
                found.append(event)
            todo.extend(self._parents.get(key, ()))
        return sorted(set(found), key=lambda e: e.index)

    def grad_off_before(self, event: TraceEvent) -> TraceEvent | None:
        """The last grad-mode switch-off recorded before ``event`` (where ``torch.no_grad()`` was entered)."""
        offs = [e for e in self.events if e.cut is Cut.GRAD_OFF and e.index <= event.index]
        return offs[-1] if offs else None

    def inplace_after_save(self, shape: tuple[int, ...] | None = None) -> list[tuple[SavedRecord, TraceEvent]]:
        """Pairs (saved tensor, in-place op) where the op changed the saved tensor's storage later.

        Args:
            shape: keep only saved tensors of this shape (from the error message), when given.
        """
        pairs = []
        for event in self.events:
            if event.cut is not Cut.INPLACE:
                continue
            for rec in self.saved:
                if rec.storage == event.storage and rec.index < event.index and (shape is None or rec.shape == shape):
                    pairs.append((rec, event))
        return pairs


def describe_cut(tracer: GraphTracer, cuts: Sequence[TraceEvent]) -> tuple[tuple[str, ...], str]:
    """Why the traced loss has no ``grad_fn``, from :meth:`GraphTracer.cuts_behind`.

    Returns:
        The names (op, module, location of the culprit) and a sentence that starts with "it".
    """
    if not tracer.grad_enabled_at_start:
        return ("grad mode off",), "grad mode was off when the step started"
    real = [e for e in cuts if e.cut is not Cut.FACTORY]
    items = [e for e in tracer.events if e.cut is Cut.ITEM]
    if real:
        culprit = real[-1]  # the cut closest to the loss
    elif items and cuts:  # the lineage ends in a tensor built from numbers: suspect the last .item()
        culprit = items[-1]
    else:
        return (), "it does not depend on any tensor that requires grad (no parameter was used)"
    names = tuple(n for n in (culprit.op, culprit.module, culprit.location) if n)
    if culprit.cut is Cut.NO_GRAD:
        off = tracer.grad_off_before(culprit)
        if off is not None and off.location:
            names += (off.location,)
        entered = f" (entered at {off.location})" if off is not None and off.location else ""
        return names, f"it was computed inside `torch.no_grad()`{entered}, e.g. {culprit.where()}"
    if culprit.cut in (Cut.ITEM, Cut.DETACH):
        return names, f"it was rebuilt from `.{culprit.op}()`: {culprit.where()}"
    return names, f"it comes from a non-differentiable op: {culprit.where()}"


# ---------------------------------------------------------------------------- batch independence


@contextmanager
def batchnorm_in_eval(module: nn.Module) -> Iterator[list[str]]:
    """Put the BatchNorm layers of ``module`` that are in training mode into eval mode for a while.

    Yields their names; restores their modes on exit. In training mode BatchNorm normalises with the
    batch's statistics, so every output depends on every example by design.
    """
    switched = [(n, m) for n, m in module.named_modules() if isinstance(m, _BatchNorm) and m.training]
    for _, m in switched:
        m.eval()
    try:
        yield [n for n, _ in switched]
    finally:
        for _, m in switched:
            m.train()


def first_tensor(value: Any) -> Tensor | None:
    """The first tensor in a batch or output (a tensor, or nested tuples, lists and dicts)."""
    return next((v for v in tree_flatten(value)[0] if isinstance(v, Tensor)), None)


def batch_mixing(
    forward: Callable[[Tensor], Any], x: Tensor, rows: Sequence[int] = (0, -1), seed: int = 0
) -> dict[int, list[int]]:
    """Which other examples each chosen output row depends on.

    For each row i in ``rows``, back-propagates a random projection of output i to the input and
    lists the examples j ≠ i whose gradient is non-zero. A model that treats examples independently
    gives an empty list for every row; a ``view``/``permute`` that mixes the batch dimension does not.
    (A random projection, not a sum: a softmax output sums to one and would hide the mixing.)

    Args:
        forward: maps a floating-point batch ``(B, ...)`` to an output ``(B, ...)`` (or a structure
            whose first tensor is).
        x: the input batch, ``B >= 2``.
        rows: output rows to test (negative indices allowed).
        seed: seed of the projection.

    Returns:
        ``{i: [j, ...]}`` with non-negative row indices.

    Raises:
        ValueError: if ``x`` is not floating point, has fewer than 2 examples, or the output's first
            dimension is not the batch.
    """
    if not x.is_floating_point():
        raise ValueError(f"the input must be floating point to take its gradient, got {x.dtype}")
    batch = x.shape[0] if x.dim() else 0
    if batch < 2:
        raise ValueError(f"the input needs at least 2 examples, got shape {tuple(x.shape)}")
    x = x.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        out = first_tensor(forward(x))
    if out is None or out.dim() == 0 or out.shape[0] != batch:
        shape = None if out is None else tuple(out.shape)
        raise ValueError(f"the output's first dimension must be the batch ({batch}), got shape {shape}")
    gen = torch.Generator().manual_seed(seed)
    result = {}
    for i in sorted({r % batch for r in rows}):
        weight = torch.zeros(out.shape, dtype=out.dtype)
        weight[i] = torch.randn(out.shape[1:], generator=gen, dtype=out.dtype)
        (grad,) = torch.autograd.grad(out, x, weight.to(out.device), retain_graph=True, allow_unused=True)
        if grad is None:
            result[i] = []
            continue
        touched = grad.detach().reshape(batch, -1).ne(0).any(dim=1).cpu().tolist()
        result[i] = [j for j, hit in enumerate(touched) if hit and j != i]
    return result


def all_zero(tensors: Sequence[Tensor]) -> Tensor:
    """``(P,)`` bool on the tensors' device: whether each tensor is exactly zero (NaN is not), no host sync.

    One ``aminmax`` per tensor: exact, where a norm could underflow to zero (a float32 sum of squares
    does below about 1e-23), and on CPU faster than the fused 1-norm or an fp64 2-norm.
    """
    if not tensors:
        return torch.zeros(0, dtype=torch.bool)
    lows, highs = zip(*(t.aminmax() for t in tensors))
    return torch.stack(lows).eq(0) & torch.stack(highs).eq(0)
