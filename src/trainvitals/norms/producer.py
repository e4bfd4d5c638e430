"""The producer of a NaN: which module first made an inf/NaN from finite inputs, or whether the optimizer did.
Torch-only.

:func:`find_producer` re-runs one forward (and backward) of the step that went non-finite with forward
hooks on every module, which record on the device whether each module's tensor inputs and outputs are
finite; the flags are read back in one transfer after the forward. The producer is the first module,
in the order the modules finished, whose inputs were all finite and whose output was not — the
modules after it only carried the value. When the forward stays finite and the gradient does not, the
backward producer is the module through whose backward the gradient turned non-finite: finite with
respect to its output, not with respect to its input (the node ``torch.autograd.detect_anomaly`` stops
at, at a fraction of its cost). The hooks are removed before it returns, whatever happens.

:func:`nonfinite_tensors` tells the other producer apart: the optimizer step itself, when the gradients
were finite and the parameters (or the optimizer's state) are not after the step.

:func:`find_producer_by_anomaly` is the other way to the same answer: the forward and backward run under
``torch.autograd.detect_anomaly``, which stops at the first backward node that returns NaN and prints the
forward traceback of that node; each node is tagged with the module whose forward made it, so its answer
reads as a :class:`Producer` too. Anomaly mode checks gradients for NaN only: a forward inf/NaN that reaches
the loss is met at the loss's own backward node, and an inf gradient is seen only where it turns NaN.
"""

from __future__ import annotations

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
        where: ``"forward"``, ``"backward"``, ``"loss"`` (every module's output finite, the loss not) or
            ``"optimizer"`` (finite gradients, non-finite parameters after the step).
        module: the module's path in the model (``""``: the root), or the non-finite tensors' names for
            ``"optimizer"``.
        op: the autograd operation that made the module's output, e.g. ``"LogBackward0"``, when known.
        input_range: ``(min, max)`` over the module's floating-point inputs, when there were any.
        value: what the output (forward) or the input's gradient (backward) held: ``"inf"``, ``"-inf"``, ``"nan"``.
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
        if self.where == "loss" and self.found_by == "anomaly":
            return (
                f"the loss computation in training_step: detect_anomaly stopped at its node {self.op or ''}, made "
                "outside every module (a forward inf/NaN that reaches the loss is met there; the flags search "
                "names its module)"
            )
        if self.where == "loss":
            return "the loss computation in training_step: every module's output was finite, the loss was not"
        name = f"`{self.module}`" if self.module else "the model's root module"
        op = f" ({self.op})" if self.op else ""
        held = f" {self.value}" if self.value else " inf/NaN"
        span = f" in [{self.input_range[0]:.4g}, {self.input_range[1]:.4g}]" if self.input_range else ""
        if self.where == "forward":
            return f"module {name}{op} in forward: its inputs were finite{span}, its output held{held}"
        by = ", where detect_anomaly stopped" if self.found_by == "anomaly" else ""
        return (
            f"module {name}{op} in backward{by}: the gradient was finite with respect to its output and held{held} "
            f"with respect to its input (inputs in forward{span})"
        )


@dataclass
class _Call:
    name: str
    inputs: list[Tensor]
    outputs: list[Tensor]


def find_producer(model: nn.Module, run: Callable[[], Tensor | None], lockstep: bool = False) -> Producer | None:
    """Run ``run()`` (one forward of ``model`` to the loss, in the step's context) with finiteness hooks on every
    module of ``model``, and name the :class:`Producer` of the first inf/NaN; ``None`` when forward and
    backward stayed finite (the value came from elsewhere: another micro-batch, a rank of its own).

    The backward is taken with ``torch.autograd.grad`` with respect to the modules' own outputs and inputs:
    no parameter's ``.grad`` is touched. Costs one forward and one backward, once. ``lockstep``: take the
    backward whatever the forward found, so that ranks whose forward and backward hold collectives (FSDP's
    all-gathers) all run the same ones.
    """
    calls: list[_Call] = []
    flags: list[Tensor] = []  # per call: inputs finite, outputs finite

    def record(name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        inputs, outputs = _floating([args, kwargs]), _floating(output)
        device = (inputs or outputs)[0].device if inputs or outputs else torch.device("cpu")
        calls.append(_Call(name, inputs, outputs))
        flags.append(torch.stack([_all_finite(inputs, device), _all_finite(outputs, device)]))

    handles: list[RemovableHandle] = []
    try:
        for name, module in model.named_modules():
            handles.append(module.register_forward_hook(_bind(record, name), with_kwargs=True))
        loss = run()
        for handle in handles:
            handle.remove()
        handles = []
        if loss is None:
            return None
        loss_finite = torch.isfinite(loss.detach()).reshape(1)
        host = torch.cat([*(f.to(loss.device) for f in flags), loss_finite]).tolist()  # one transfer
        pairs, loss_finite = list(zip(host[:-1:2], host[1:-1:2])), host[-1]
        made = next((call for call, (inputs_ok, outputs_ok) in zip(calls, pairs) if inputs_ok and not outputs_ok), None)
        found = None
        if made is not None:
            found = Producer("forward", made.name, _op(made.outputs), _range(made.inputs), _held(made.outputs))
        elif not loss_finite:
            found = Producer("loss", "")
        if found is not None and not lockstep:
            return found
        backward = _backward_producer(loss, calls)
        return found or backward
    finally:
        for handle in handles:
            handle.remove()


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
    calls: list[_Call] = []
    open_spans: list[list[int]] = []  # the forwards running, outermost first: [sequence number at start, -]
    spans: list[list[int]] = []  # per call: the sequence numbers just before and just after its forward

    def begin(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        open_spans.append([_sequence_number(), -1])

    def end(name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        span = open_spans.pop()  # calls finish innermost first
        span[1] = _sequence_number()
        calls.append(_Call(name, _floating([args, kwargs]), _floating(output)))
        spans.append(span)

    handles: list[RemovableHandle] = []
    with warnings.catch_warnings(record=True) as said, torch.autograd.detect_anomaly(check_nan=True):
        warnings.simplefilter("always")
        try:
            for name, module in model.named_modules():
                handles.append(module.register_forward_pre_hook(begin, with_kwargs=True))
                handles.append(module.register_forward_hook(_bind(end, name), with_kwargs=True))
            loss = run()
        finally:
            for handle in handles:
                handle.remove()
        if loss is None or not loss.requires_grad:
            return (
                None if loss is None or bool(torch.isfinite(loss).all()) else Producer("loss", "", found_by="anomaly")
            )
        for node in _graph_nodes(loss.grad_fn):
            inner = _innermost(node._sequence_nr(), spans)
            if inner is not None and isinstance(node.metadata.get(_TRACEBACK), list):
                node.metadata[_TRACEBACK] = [*node.metadata[_TRACEBACK], f"{_MARK}{inner}]\n"]
        # The whole backward that loss.backward() would run (the parameters' gradients too), into no .grad.
        every = (*(t for c in calls for t in (*c.inputs, *c.outputs)), *model.parameters())
        tracked = list({id(t): t for t in every if t.requires_grad}.values())
        try:
            torch.autograd.grad(loss, tracked or [loss], allow_unused=True)
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
    """The next autograd sequence number of this thread (a throwaway node's)."""
    return torch.zeros((), requires_grad=True).add(0.0).grad_fn._sequence_nr()


def _graph_nodes(root: Any) -> list[Any]:
    """Every node of the autograd graph below ``root``."""
    seen, nodes = {id(root)}, [root] if root is not None else []
    for node in nodes:
        for child, _ in node.next_functions:
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                nodes.append(child)
    return nodes


def _innermost(sequence: int, spans: list[list[int]]) -> int | None:
    """The index of the narrowest span ``(start, end)`` holding ``sequence``, or ``None``."""
    holding = [(end - start, i) for i, (start, end) in enumerate(spans) if start < sequence < end]
    return min(holding)[1] if holding else None


def _backward_producer(loss: Tensor, calls: list[_Call]) -> Producer | None:
    """The module through whose backward the gradient of a finite loss turned non-finite (module docstring)."""
    tracked: dict[int, Tensor] = {}
    for call in calls:
        for t in (*call.inputs, *call.outputs):
            if t.requires_grad:
                tracked.setdefault(id(t), t)
    if not tracked or not loss.requires_grad:
        return None
    keys = list(tracked)
    grads = torch.autograd.grad(loss, [tracked[k] for k in keys], allow_unused=True)
    present = [(k, g) for k, g in zip(keys, grads) if g is not None]
    if not present:
        return None
    finite = dict(zip((k for k, _ in present), torch.stack([torch.isfinite(g).all() for _, g in present]).tolist()))
    grad_of = dict(present)
    candidates = []
    for order, call in enumerate(calls):
        outs_ok = all(finite.get(id(t), True) for t in call.outputs)
        bad_inputs = [t for t in call.inputs if not finite.get(id(t), True)]
        if outs_ok and bad_inputs:
            candidates.append((order, call, grad_of[id(bad_inputs[0])]))
    # The innermost module: a container is a candidate along with its child that did it.
    names = [c.name for _, c, _ in candidates]
    inner = [c for c in candidates if not any(n != c[1].name and _inside(n, c[1].name) for n in names)]
    if not inner:
        return None
    _, call, grad = max(inner, key=lambda c: c[0])  # the last to run forward: the first reached in backward
    return Producer("backward", call.name, _op(call.outputs), _range(call.inputs), _held([grad]))


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


def _inside(child: str, parent: str) -> bool:
    return parent == "" or child.startswith(parent + ".")


def _floating(tree: Any) -> list[Tensor]:
    if isinstance(tree, Tensor):
        return [tree] if tree.is_floating_point() or tree.is_complex() else []
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _floating(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _floating(v)]
    return []


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
