"""The producer of a NaN: which module first made an inf/NaN from finite inputs, or whether the optimizer did.
Torch-only.

:func:`find_producer` re-runs one forward (and backward) of the step that went non-finite with forward
hooks on every module, which record on the device whether each module's tensor inputs and outputs are
finite; the flags are read back in one transfer after the forward. The producer is the first module,
in the order the modules finished, whose inputs were all finite and whose output was not — the
modules after it only carried the value. When the forward stays finite and the gradient does not, the
backward producer is the first backward node, in the order the backward ran them, whose incoming gradient
was finite and whose outgoing one was not (the node made it; the nodes before it in backward carried finite
values): its operation, and the innermost module whose forward made that node, told from the autograd
sequence numbers that bracket each module's forward. A node's incoming gradient is the whole of it, so a
tensor that several modules consume cannot blame one for another's NaN. The flags of every node are kept on
the device and read back in one transfer. The hooks are removed before it returns, whatever happens.

:func:`nonfinite_tensors` tells the other producer apart: the optimizer step itself, when the gradients
were finite and the parameters (or the optimizer's state) are not after the step.

:func:`find_producer_by_anomaly` is the other way to the same answer: the forward and backward run under
``torch.autograd.detect_anomaly``, which stops at the first backward node that returns NaN and prints the
forward traceback of that node; each node is tagged with the module whose forward made it, so its answer
reads as a :class:`Producer` too. Anomaly mode checks gradients for NaN only: a forward inf/NaN that reaches
the loss is met at the loss's own backward node, and an inf gradient is seen only where it turns NaN.
"""

from __future__ import annotations

import functools
import math
import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from trainvitals.fused_norms import is_dtensor

SEARCHES = ("flags", "anomaly")
"""How the producer is searched: finiteness flags on every module's output (:func:`find_producer`), or a re-run
under ``torch.autograd.detect_anomaly`` (:func:`find_producer_by_anomaly`)."""


@dataclass(frozen=True)
class Producer:
    """Where an inf/NaN was made.

    Attributes:
        where: ``"forward"``, ``"backward"``, ``"loss"`` (every module's output finite, the loss not; or a backward
            node made outside every module, then named by ``op``) or ``"optimizer"`` (finite gradients,
            non-finite parameters after the step).
        module: the module's path in the model (``""``: the root), or the non-finite tensors' names for
            ``"optimizer"``.
        op: the autograd node that made the value, when known: in forward the one that made the module's output
            (e.g. ``"LogBackward0"``), in backward the one whose gradient turned (e.g. ``"SqrtBackward0"``).
        input_range: ``(min, max)`` over the module's floating-point inputs, when there were any.
        value: what the output (forward) or the node's gradient (backward) held: ``"inf"``, ``"-inf"``, ``"nan"``.
        found_by: the search that found it, one of :data:`SEARCHES`.
    """

    where: str
    module: str
    op: str | None = None
    input_range: tuple[float, float] | None = None
    value: str | None = None
    found_by: str = "flags"

    def describe(self) -> str:
        """One sentence for a message."""
        if self.where == "optimizer":
            return (
                f"the optimizer step itself: the gradients were finite, and after the step {self.module} were "
                "not (e.g. an eps or a second moment that underflows in half precision; check the optimizer's "
                "settings for this precision)"
            )
        held = f" {self.value}" if self.value else " inf/NaN"
        if self.where == "loss" and self.found_by == "anomaly":
            return (
                f"the loss computation in training_step: detect_anomaly stopped at its node {self.op or ''}, made "
                "outside every module (a forward inf/NaN that reaches the loss is met there; the flags search "
                "names its module)"
            )
        if self.where == "loss" and self.op:
            return (
                f"the loss computation in training_step, in backward: its node {self.op}, made outside every module, "
                f"got a finite gradient and returned{held}"
            )
        if self.where == "loss":
            return "the loss computation in training_step: every module's output was finite, the loss was not"
        name = f"`{self.module}`" if self.module else "the model's root module"
        op = f" ({self.op})" if self.op else ""
        span = f" in [{self.input_range[0]:.4g}, {self.input_range[1]:.4g}]" if self.input_range else ""
        if self.where == "forward":
            return f"module {name}{op} in forward: its inputs were finite{span}, its output held{held}"
        if self.found_by == "anomaly":
            return (
                f"module {name}{op} in backward, where detect_anomaly stopped: its node returned{held} "
                f"(the module's inputs in forward{span})"
            )
        return (
            f"module {name}{op} in backward: its node got a finite gradient and returned{held} "
            f"(the module's inputs in forward{span})"
        )


@dataclass
class _Call:
    name: str
    inputs: list[Tensor]
    outputs: list[Tensor]


class _Watch:
    """Forward hooks on every module of a model for one run, removed on leaving the ``with`` block.

    Each module call's floating-point inputs and outputs are kept (:attr:`calls`, in the order the calls finished),
    with the autograd sequence numbers just before and just after its forward (:attr:`spans`): a backward node
    whose sequence number falls in a span was made by that call's forward (:meth:`made`). ``then(call)`` runs at
    each call's end.
    """

    def __init__(self, model: nn.Module, then: Callable[[_Call], None] | None = None) -> None:
        self.calls: list[_Call] = []
        self.spans: list[list[int]] = []  # per call: [sequence number at start, at end]
        self._open: list[list[int]] = []  # the forwards running, outermost first
        self._then = then
        self._model = model
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> _Watch:
        try:
            for name, module in self._model.named_modules():
                self._handles.append(module.register_forward_pre_hook(self._begin, with_kwargs=True))
                self._handles.append(module.register_forward_hook(_bind(self._end, name), with_kwargs=True))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _begin(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._open.append([_sequence_number(), -1])

    def _end(self, name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        span = self._open.pop()  # calls finish innermost first
        span[1] = _sequence_number()
        call = _Call(name, _floating([args, kwargs]), _floating(output))
        self.calls.append(call)
        self.spans.append(span)
        if self._then is not None:
            self._then(call)

    def made(self, node: Any) -> int | None:
        """The index in :attr:`calls` of the innermost call whose forward made backward ``node``, or ``None``."""
        sequence = node._sequence_nr()
        holding = [(end - start, i) for i, (start, end) in enumerate(self.spans) if start < sequence < end]
        return min(holding)[1] if holding else None


def find_producer(model: nn.Module, run: Callable[[], Tensor | None], lockstep: bool = False) -> Producer | None:
    """Run ``run()`` (one forward of ``model`` to the loss, in the step's context) with finiteness hooks on every
    module of ``model``, and name the :class:`Producer` of the first inf/NaN; ``None`` when forward and
    backward stayed finite (the value came from elsewhere: another micro-batch, a rank of its own).

    The backward is the one ``loss.backward()`` would run, taken with ``torch.autograd.grad`` with respect to the
    modules' outputs and inputs and the parameters: no parameter's ``.grad`` is touched. Costs one forward and one
    backward, once. ``lockstep``: take the backward whatever the forward found, so that ranks whose forward and
    backward hold collectives (FSDP's all-gathers) all run the same ones; the parameters' own gradients are then
    not taken (a sharded parameter's belongs to the strategy's reduce-scatter), so a NaN made only in them is missed.
    """
    flags: list[Tensor] = []  # per call: inputs finite, outputs finite

    def record(call: _Call) -> None:
        inputs, outputs = call.inputs, call.outputs
        device = (inputs or outputs)[0].device if inputs or outputs else torch.device("cpu")
        flags.append(torch.stack([_all_finite(inputs, device), _all_finite(outputs, device)]))

    with _Watch(model, record) as watch:
        loss = run()
    if loss is None:
        return None
    loss_finite = torch.isfinite(loss.detach()).reshape(1)
    host = torch.cat([*(f.to(loss.device) for f in flags), loss_finite]).tolist()  # one transfer
    pairs, loss_finite = list(zip(host[:-1:2], host[1:-1:2])), host[-1]
    calls = watch.calls
    made = next((call for call, (inputs_ok, outputs_ok) in zip(calls, pairs) if inputs_ok and not outputs_ok), None)
    found = None
    if made is not None:
        found = Producer("forward", made.name, _op(made.outputs), _range(made.inputs), _held(made.outputs))
    elif not loss_finite:
        found = Producer("loss", "")
    if found is not None and not lockstep:
        return found
    backward = _backward_producer(loss, watch, [] if lockstep else list(model.parameters()))
    return found or backward


def find_producer_by_anomaly(model: nn.Module, run: Callable[[], Tensor | None]) -> Producer | None:
    """Run ``run()`` (as for :func:`find_producer`) and its backward under ``torch.autograd.detect_anomaly`` and
    name the backward node anomaly mode stopped at — the first to return NaN — as a :class:`Producer`: the
    innermost module whose forward made that node (``"loss"`` for a node made outside every module), its
    operation and the module's input range. ``None`` when no backward node returned NaN and the loss is finite.

    Each module's forward is bracketed by autograd sequence numbers (forward hooks), and every node of the loss's
    graph gets a line naming its module in the forward traceback anomaly mode keeps for it, so the traceback it
    prints names the module. The backward is taken with ``torch.autograd.grad`` with respect to the modules' own
    inputs and outputs and the parameters (the nodes ``loss.backward()`` would run): no ``.grad`` is touched.
    Costs one forward and one backward under anomaly mode (each node records its Python stack: about three
    plain passes), once.
    """
    with warnings.catch_warnings(record=True) as said, torch.autograd.detect_anomaly(check_nan=True):
        warnings.simplefilter("always")
        with _Watch(model) as watch:
            loss = run()
        if loss is None or not loss.requires_grad:
            return (
                None if loss is None or bool(torch.isfinite(loss).all()) else Producer("loss", "", found_by="anomaly")
            )
        calls = watch.calls
        for node in _graph_nodes(loss.grad_fn):
            inner = watch.made(node)
            if inner is not None and isinstance(node.metadata.get(_TRACEBACK), list):
                node.metadata[_TRACEBACK] = [*node.metadata[_TRACEBACK], f"{_MARK}{inner}]\n"]
        # The whole backward that loss.backward() would run (the parameters' gradients too), into no .grad.
        try:
            torch.autograd.grad(loss, _tracked(calls, model.parameters()) or [loss], allow_unused=True)
        except RuntimeError as error:
            stopped = re.search(r"Function '([^']+)' returned nan values", str(error))
            if stopped is None:
                raise
            op = stopped.group(1)
            printed = next((str(w.message) for w in said if f"Error detected in {op}." in str(w.message)), "")
            mark = re.search(re.escape(_MARK) + r"(\d+)\]", printed.split("Previous calculation")[0])
            if mark is None:
                return Producer("loss", "", op=op, value="nan", found_by="anomaly")
            call = calls[int(mark.group(1))]
            return Producer("backward", call.name, op, _range(call.inputs), "nan", found_by="anomaly")
    if not bool(torch.isfinite(loss.detach()).all()):
        return Producer("loss", "", found_by="anomaly")
    return None


_TRACEBACK = "traceback_"  # where anomaly mode keeps a node's forward stack (torch/csrc/autograd/python_anomaly_mode)
_MARK = "  [trainvitals: made in the forward of module call "


def _sequence_number() -> int:
    """The next autograd sequence number of this thread (a throwaway node's; under ``no_grad`` too)."""
    with torch.enable_grad():
        node = torch.zeros((), requires_grad=True).add(0.0).grad_fn
    return node._sequence_nr() if node is not None else -1  # inference mode: no node is made at all


def _graph_nodes(root: Any) -> list[Any]:
    """Every node of the autograd graph below ``root``."""
    seen, nodes = {id(root)}, [root] if root is not None else []
    for node in nodes:
        for child, _ in node.next_functions:
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                nodes.append(child)
    return nodes


def _tracked(calls: list[_Call], params: Iterable[Tensor]) -> list[Tensor]:
    """The modules' inputs and outputs and ``params`` that require a gradient, each once: the tensors to take the
    backward with respect to, so that it runs every node ``loss.backward()`` would."""
    every = (*(t for c in calls for t in (*c.inputs, *c.outputs)), *params)
    return list({id(t): t for t in every if t.requires_grad}.values())


def _backward_producer(loss: Tensor, watch: _Watch, params: list[Tensor]) -> Producer | None:
    """The backward node that first returned an inf/NaN from a finite incoming gradient, as a :class:`Producer`:
    its module (``"loss"`` when it was made outside every module) and operation (module docstring). ``None`` when
    none did. Each node's flags stay on the device until the backward's end: one transfer."""
    tracked = _tracked(watch.calls, params)
    if not tracked or not loss.requires_grad:
        return None
    device = loss.device
    ran: list[Any] = []  # the nodes, in the order the backward ran them
    rows: list[Tensor] = []  # per node run: incoming gradient finite, returned holds nan, +inf, -inf

    def check(node: Any, returned: tuple[Tensor | None, ...], incoming: tuple[Tensor | None, ...]) -> None:
        made = [_plain(g) for g in returned if g is not None]
        if not made:
            return
        kinds = torch.stack([torch.stack([g.isnan().any(), g.isposinf().any(), g.isneginf().any()]) for g in made])
        came = _all_finite([_plain(g) for g in incoming if g is not None], device)
        ran.append(node)
        rows.append(torch.cat([came.reshape(1), kinds.any(0).to(device)]))

    handles = []
    try:
        for node in _graph_nodes(loss.grad_fn):
            handles.append(node.register_hook(functools.partial(check, node)))
        torch.autograd.grad(loss, tracked, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    if not rows:
        return None
    host = torch.stack(rows).tolist()  # one transfer
    first = next((i for i, (came, *held) in enumerate(host) if came and any(held)), None)
    if first is None:
        return None
    node, (_, nan, inf, _) = ran[first], host[first]
    value = "nan" if nan else ("inf" if inf else "-inf")
    index = watch.made(node)
    if index is None:
        return Producer("loss", "", node.name(), value=value)
    call = watch.calls[index]
    return Producer("backward", call.name, node.name(), _range(call.inputs), value)


def nonfinite_tensors(named: Iterable[tuple[str, Tensor]]) -> list[str]:
    """The names of the tensors of ``named`` that hold an inf/NaN (one device-to-host transfer). Of a ``DTensor``
    (FSDP2's sharded parameters) this rank's shard is looked at: combine the ranks' answers."""
    local = [(n, t.to_local() if is_dtensor(t) else t) for n, t in named if isinstance(t, Tensor)]
    local = [(n, t) for n, t in local if t.is_floating_point() and t.numel()]
    if not local:
        return []
    finite = torch.stack([torch.isfinite(t.detach()).all().to(local[0][1].device) for _, t in local]).tolist()
    return [n for (n, _), ok in zip(local, finite) if not ok]


def optimizer_state_tensors(optimizer: torch.optim.Optimizer, names: dict[Tensor, str]) -> list[tuple[str, Tensor]]:
    """``(name, tensor)`` for each tensor of ``optimizer``'s per-parameter state, named ``<param> <key>``
    (``names`` maps parameters to their names)."""
    return [
        (f"{names.get(p, 'a parameter')} {key}", value)
        for p, state in optimizer.state.items()
        for key, value in state.items()
        if isinstance(value, Tensor)
    ]


def _bind(record: Callable[..., None], name: str) -> Callable[..., None]:
    return lambda module, args, kwargs, output: record(name, module, args, kwargs, output)


def _floating(tree: Any) -> list[Tensor]:
    if isinstance(tree, Tensor):
        return [tree] if tree.is_floating_point() or tree.is_complex() else []
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _floating(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _floating(v)]
    return []


def _plain(grad: Tensor) -> Tensor:
    """A gradient as a plain real tensor to check: a DTensor's local shard, a sparse one's values, a complex one's
    real and imaginary parts."""
    grad = grad.to_local() if is_dtensor(grad) else grad
    grad = grad.coalesce().values() if grad.is_sparse else grad
    return torch.view_as_real(grad) if grad.is_complex() else grad


def _all_finite(tensors: list[Tensor], device: torch.device) -> Tensor:
    if not tensors:
        return torch.ones((), dtype=torch.bool, device=device)
    return torch.stack([torch.isfinite(t.detach()).all().to(device) for t in tensors]).all()


def _op(outputs: list[Tensor]) -> str | None:
    fn = outputs[0].grad_fn if outputs else None
    return fn.name() if fn is not None else None


def _range(inputs: list[Tensor]) -> tuple[float, float] | None:
    values = [t.detach().reshape(-1) for t in inputs if t.numel() and not t.is_complex()]
    if not values:
        return None
    lo, hi = torch.stack([torch.stack([v.min() for v in values]).min(), torch.stack([v.max() for v in values]).max()])
    return float(lo), float(hi)


def _held(tensors: list[Tensor]) -> str | None:
    """``"nan"``, ``"inf"`` or ``"-inf"``: the first kind of non-finite value among ``tensors``."""
    for t in tensors:
        t = t.detach()
        if t.is_complex():
            continue
        nan, pos, neg = torch.stack([t.isnan().any(), (t == math.inf).any(), (t == -math.inf).any()]).tolist()
        if nan or pos or neg:
            return "nan" if nan else ("inf" if pos else "-inf")
    return None
