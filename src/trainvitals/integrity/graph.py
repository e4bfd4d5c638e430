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
or modified in place (:func:`saved_tensor_errors`), and where the user's code is (:func:`user_location`);
:mod:`trainvitals.integrity.tracer` re-runs a step to see more, and :mod:`trainvitals.integrity.diagnoses` turns
that evidence into diagnoses.
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


_VIEW_OPS = frozenset(
    {
        "AsStrided",
        "T",
        "Transpose",
        "Permute",
        "View",
        "UnsafeView",
        "Expand",
        "Slice",
        "Select",
        "Unsqueeze",
        "Squeeze",
        "Alias",
        "ReshapeAlias",
        "Split",
        "SplitWithSizes",
        "UnsafeSplit",
        "UnsafeSplitWithSizes",
        "Unbind",
        "Narrow",
        "Diagonal",
        "Unfold",
    }
)


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
    does below about 1e-23), and on CPU faster than the fused 1-norm or an fp64 2-norm. A sparse tensor
    is read from its (coalesced) stored values, a complex one from its real and imaginary parts; an
    empty one is zero.
    """
    if not tensors:
        return torch.zeros(0, dtype=torch.bool)
    values = [_real_values(t) for t in tensors]
    lows, highs = zip(*(v.aminmax() if v.numel() else (v.new_zeros(()),) * 2 for v in values))
    return torch.stack(lows).eq(0) & torch.stack(highs).eq(0)


def _real_values(t: Tensor) -> Tensor:
    """The real numbers stored in ``t``: a sparse tensor's values (duplicates summed), complex as pairs."""
    if t.layout == torch.sparse_coo:
        t = t.coalesce().values()
    elif t.layout != torch.strided:  # compressed sparse layouts (CSR, CSC, BSR, BSC)
        t = t.values()
    return torch.view_as_real(t) if t.is_complex() else t
