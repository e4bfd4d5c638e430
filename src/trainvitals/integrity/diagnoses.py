"""What the graph checks conclude, in plain words: the analysis behind each finding and diagnosis.

:mod:`trainvitals.integrity.graph` walks and traces the autograd graph; this module turns what it sees into
answers: which parameters went a run of optimizer steps without a gradient or with an exactly zero one
(:class:`GradientStreaks`), why a parameter is out of the loss's reach (:func:`unreached_reasons`), why
a frozen parameter still changed (:func:`frozen_change_causes`), what carries a graph across steps
(:func:`describe_stale_graph`), and why a loss has no ``grad_fn`` (:func:`why_no_grad`). The three
``diagnose_*`` functions explain autograd's classic errors (:class:`~trainvitals.integrity.graph.AutogradError`)
by naming the tensor, module and operation behind them; :func:`stepped_parameter` finds the parameter
an optimizer step changed under a saved tensor. :func:`~trainvitals.text.prose.listed` spells out the first few names.

Names are the model's (``tensor_names``); messages are written for the person who wrote the training
step, and end with the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import Node

from trainvitals.compiled import ROOT
from trainvitals.integrity.graph import (
    AutogradError,
    InplaceInfo,
    all_zero,
    anomaly_location,
    attributes_reaching,
    created_before,
    nearest_leaves,
    owner_module,
    parse_inplace_error,
    saved_tensor_errors,
    walk_graph,
)
from trainvitals.integrity.tracer import GraphTracer, describe_cut
from trainvitals.text.prose import listed

# Re-runs the failing training step under a GraphTracer; returns the tracer and the loss the step returned.
Rerun = Callable[[], tuple[GraphTracer, Any]]


def _node_types(nodes: Sequence[Node]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(type(n).__name__ for n in nodes))


# ------------------------------------------------------------------------------- gradient streaks


class GradientStreaks:
    """Per parameter, the checked optimizer steps in a row without a gradient or with an exactly zero one.

    One batch may skip a parameter (an auxiliary head used every other step, an expert that got no
    tokens); a streak of checks says it is not used (``.grad`` is None) or dead (the gradient is
    blocked). Parameters are counted by name; each check is one optimizer's step over its parameters.

    Attributes:
        unused: name -> consecutive checks at which the parameter was trainable and its ``.grad`` None.
        dead: name -> consecutive checks at which its ``.grad`` was exactly zero.
    """

    def __init__(self) -> None:
        self.unused: dict[str, int] = {}
        self.dead: dict[str, int] = {}
        # Per optimizer, the parameters whose gradient was zero at every check since the last clear (None:
        # not checked yet): only they can still extend a dead streak, so only their gradients are read again.
        self._zero_so_far: dict[int, set[str]] = {}

    def clear(self) -> None:
        """Start every streak again from zero."""
        self.unused.clear()
        self.dead.clear()
        self._zero_so_far.clear()

    def update(self, optimizer: int, params: Sequence[tuple[str, Tensor]]) -> None:
        """Count one check: optimizer number ``optimizer`` is about to step its named ``params``.

        Reads the gradients once (one host sync, when there is one to read): all of them at the first
        check since :meth:`clear`, afterwards only those that were zero at every check so far.
        """
        zero_so_far = self._zero_so_far.get(optimizer)
        present = []
        for name, p in params:
            unused = p.requires_grad and p.grad is None
            self.unused[name] = self.unused.get(name, 0) + 1 if unused else 0
            if zero_so_far is not None and name not in zero_so_far:
                continue  # non-zero at an earlier check: its dead streak stays 0 until the next clear
            if p.requires_grad and p.grad is not None:
                present.append((name, p.grad))
            else:
                self.dead[name] = 0
        flags = all_zero([g for _, g in present]).tolist() if present else []
        for (name, _), is_zero in zip(present, flags):
            self.dead[name] = self.dead.get(name, 0) + 1 if is_zero else 0
        self._zero_so_far[optimizer] = {name for (name, _), is_zero in zip(present, flags) if is_zero}

    def got_gradient(self, names: Sequence[str]) -> None:
        """These parameters got a gradient after their check (a backward after the step): not unused."""
        for name in names:
            self.unused[name] = 0

    def at_least(self, steps: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The names whose unused streak, and those whose dead streak, reached ``steps`` checks."""
        return (
            tuple(name for name, s in self.unused.items() if s >= steps),
            tuple(name for name, s in self.dead.items() if s >= steps),
        )

    def state_dict(self) -> dict[str, Any]:
        return {"unused_streak": dict(self.unused), "dead_streak": dict(self.dead)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Which gradients were zero so far is not saved: the next check reads them all again.
        self.clear()
        self.unused.update(state.get("unused_streak", {}))
        self.dead.update(state.get("dead_streak", {}))


# ------------------------------------------------------------------------- parameters and modules


def unreached_reasons(
    root: nn.Module, unreached: Sequence[str], ran: Mapping[int, bool], compiled: Collection[str] = ()
) -> dict[str, str]:
    """Why each parameter the loss cannot reach is out of its reach, said of the module that owns it.

    Args:
        root: the model the names are relative to.
        unreached: names (``tensor_names``) of the trainable parameters the loss's graph does not reach.
        ran: ``id(module) -> whether it ran at least once with grad mode on``, for every module whose
            forward ran (module forward hooks); no hook runs inside a ``torch.compile``'d region, so its
            modules are judged by name.
        compiled: the modules whose calls run compiled (qualified names, :data:`~trainvitals.compiled.ROOT` for
            ``root``: :func:`~trainvitals.compiled.compiled_modules`), besides those under a ``_orig_mod``.

    Returns:
        name -> a clause (no final period), the same for every parameter of one module.
    """
    by_module: dict[str, list[str]] = {}
    for name in unreached:
        by_module.setdefault(owner_module(name), []).append(name)
    reasons = {}
    for mod_name, names in by_module.items():
        try:
            module = root.get_submodule(mod_name)
        except AttributeError:  # kept in a plain list or dict: ``layers[0]``
            module = None
        if module is None or module is root:
            why = f"{listed(names)} are not used by the loss"
        elif "_orig_mod" in mod_name.split(".") or any(
            c == ROOT or mod_name == c or mod_name.startswith(f"{c}.") for c in compiled
        ):
            why = f"module `{mod_name}`, inside a torch.compile'd module, did not reach the loss"
        elif id(module) not in ran:
            why = f"module `{mod_name}` never ran in forward (an unused head or branch?)"
        elif not ran[id(module)]:
            why = f"module `{mod_name}` ran only with grad mode off (inside `torch.no_grad()`)"
        else:
            why = f"module `{mod_name}` ran, but its output was detached or did not reach the loss"
        reasons.update(dict.fromkeys(names, why))
    return reasons


def frozen_change_causes(param: Tensor, optimizer: torch.optim.Optimizer) -> list[str]:
    """Why ``optimizer`` changed ``param`` although it has ``requires_grad=False``.

    Returns:
        One clause per cause found (a ``.grad`` the optimizer does not skip, optimizer state such as
        momentum, weight decay), or a single clause saying the optimizer ignores ``requires_grad``.
    """
    causes = []
    if param.grad is not None:
        causes.append(
            "it still holds a `.grad` (left from before it was frozen, or kept as zeros by "
            "`zero_grad(set_to_none=False)`), so the optimizer does not skip it"
        )
    state = [key for key in optimizer.state.get(param, {}) if key != "step"]
    if state:
        causes.append(f"its optimizer state ({', '.join(state)}) keeps moving it")
    group = next((g for g in optimizer.param_groups if any(q is param for q in g["params"])), {})
    decay = group.get("weight_decay", 0)
    if decay:
        causes.append(f"weight decay {decay} shrinks it")
    return causes or ["the optimizer updates parameters regardless of requires_grad"]


def describe_stale_graph(root: nn.Module, stale: Sequence[Node], before: int | None) -> tuple[tuple[str, ...], str]:
    """What carries a graph across steps, from the stale nodes of :func:`~trainvitals.integrity.graph.walk_graph`.

    Args:
        root: the model whose plain attributes may hold the carried tensor.
        stale: the nodes created before the step's mark that the loss reaches.
        before: the step's :func:`~trainvitals.integrity.graph.sequence_mark`.

    Returns:
        The module attributes that carry the graph over (else the stale nodes' types), and a message
        with the fix.
    """
    names, carried, fix = _carried_state(root, stale, before)
    return names, (
        f"The loss reaches {len(stale)} autograd node(s) created in an earlier step "
        f"({listed(_node_types(stale))}): {carried}. The earlier backward freed their saved tensors "
        f'("backward through the graph a second time"), or the graph grows every step. Detach the state '
        f"when carrying it over ({fix})."
    )


def _carried_state(root: nn.Module, stale: Sequence[Node], before: int | None) -> tuple[tuple[str, ...], str, str]:
    """(names, "it is carried across steps in ...", the fix) for a graph reaching ``stale`` nodes."""
    attrs = attributes_reaching(root, set(stale), before)
    carried = (
        f"it is carried across steps in {listed(attrs)}"
        if attrs
        else "it is carried across steps outside the module's attributes"
    )
    fix = f"`self.{attrs[0]} = {attrs[0].rpartition('.')[2]}.detach()`" if attrs else "`.detach()`"
    return tuple(attrs) or _node_types(stale), carried, fix


# ------------------------------------------------------------------------------ autograd's errors


def why_no_grad(
    loss: Tensor, root: nn.Module, optimizers: Sequence[torch.optim.Optimizer], rerun: Rerun | None = None
) -> tuple[tuple[str, ...], str]:
    """Why ``loss``, a tensor without ``grad_fn``, is cut from the graph.

    Tries the cheap explanations first: a leaf built from a value, grad mode off now (so call this
    where the loss was computed), a model with every parameter frozen; then ``rerun``, whose trace
    names the operation and line that cut the graph (:func:`~trainvitals.integrity.tracer.describe_cut`).

    Args:
        loss: the tensor without ``grad_fn``.
        root: the model.
        optimizers: named when grad mode is off (an optimizer's ``step`` may run the closure without grad).
        rerun: re-runs the step under a tracer; ``None`` where that is not possible.

    Returns:
        The names (culprit op, module, location) and a clause to follow "The loss has no grad_fn: ".
    """
    if loss.requires_grad:
        return ("leaf loss",), (
            "it is a leaf tensor that requires grad, built from a value (e.g. "
            "`torch.tensor(loss.item(), requires_grad=True)`); return the loss tensor itself"
        )
    if not torch.is_grad_enabled():
        names = tuple(type(o).__name__ for o in optimizers)
        return ("grad mode off", *names), (
            "grad mode was off while training_step ran. Lightning calls the step inside "
            "`optimizer.step(closure)`; an optimizer whose step() runs the closure under `torch.no_grad()` "
            f"without `torch.enable_grad()` does this (optimizers: {', '.join(names) or 'none'}), as does "
            "a `torch.set_grad_enabled(False)` left on"
        )
    if not any(p.requires_grad for p in root.parameters()):
        return ("every parameter frozen",), (
            "every parameter of the model has requires_grad=False, so the loss depends on nothing that "
            "can learn: unfreeze what should train (`module.requires_grad_(True)`)"
        )
    if rerun is not None:
        try:
            tracer, rerun_loss = rerun()
        except Exception as err:  # a diagnosis must never replace the user's error
            return (), f"the re-run to locate the cut failed ({type(err).__name__}: {err})"
        return describe_cut(tracer, tracer.cuts_behind(rerun_loss))
    return (), (
        "it was rebuilt from `.item()`/`.detach()` or computed inside `torch.no_grad()` (on one device with "
        "automatic optimization the callback re-runs the step and names the line)"
    )


def diagnose_no_grad(
    loss: Tensor | None, root: nn.Module, optimizers: Sequence[torch.optim.Optimizer], rerun: Rerun | None = None
) -> tuple[tuple[str, ...], str]:
    """Explain ``AutogradError.NO_GRAD`` ("element 0 of tensors does not require grad").

    Args:
        loss: the last loss handed to backward through the training loop's hooks, if any.
        root, optimizers, rerun: as for :func:`why_no_grad`.

    Returns:
        The names it points at and the message.
    """
    if loss is None or loss.grad_fn is not None:
        return (), "backward was called on a tensor without grad_fn outside Lightning's backward hooks."
    names, why = why_no_grad(loss, root, optimizers, rerun)
    return names, f"The loss has no grad_fn: {why}."


def diagnose_second_backward(
    loss: Tensor | None,
    earlier: Sequence[Node],
    root: nn.Module,
    names: Mapping[int, str],
    before: int | None,
) -> tuple[tuple[str, ...], str]:
    """Explain ``AutogradError.SECOND_BACKWARD`` ("backward through the graph a second time").

    In order: the loss reaches an earlier step's graph (state carried over), the same loss went
    through backward twice, or it shares nodes with a loss back-propagated earlier in the step (a GAN
    whose discriminator loss does not detach the generator's output), named by the module where the
    shared part enters.

    Args:
        loss: the last loss handed to backward, if any.
        earlier: the ``grad_fn`` of the losses back-propagated before it in this step.
        root: the model; ``names``: its ``id(tensor) -> name`` (``tensor_names``).
        before: the step's :func:`~trainvitals.integrity.graph.sequence_mark`.

    Returns:
        The names it points at (attributes or modules) and the message.
    """
    if loss is None:
        return (), "a backward outside Lightning's hooks went through a graph whose saved tensors were freed."
    walk = walk_graph(loss, before)
    if walk.stale:
        return describe_stale_graph(root, walk.stale, before)
    if loss.grad_fn is not None and loss.grad_fn in earlier:
        return (), (
            "The same loss was back-propagated twice in this step: the first backward freed its saved "
            "tensors. Remove the second backward, or pass retain_graph=True to the first if both are meant."
        )
    seen_before: set[Node] = set()
    for fn in earlier:
        seen_before |= walk_graph(fn).nodes
    shared = {n for n in walk.nodes & seen_before if type(n).__name__ != "AccumulateGrad"}
    if not shared:
        return (), (
            "The graph was freed by a backward outside Lightning's hooks: a `loss.backward()` inside "
            "training_step? Under automatic optimization Lightning runs backward itself: remove that call. If "
            "two backward passes through one graph are meant, pass retain_graph=True to the first."
        )
    entry_nodes = list(dict.fromkeys(c for n in walk.nodes - shared for c, _ in n.next_functions if c in shared)) or [
        loss.grad_fn
    ]
    modules = tuple(
        dict.fromkeys(owner_module(names.get(id(t), "?")) or "<root>" for n in entry_nodes for t in nearest_leaves(n))
    )
    return modules, (
        f"This loss shares {len(shared)} autograd node(s) with a loss back-propagated earlier in this step "
        f"(they enter at {listed(_node_types(entry_nodes))}, near module {listed(modules)}); that backward "
        "freed their saved tensors. Detach the shared tensor in one of the two losses (e.g. `fake.detach()` "
        "in the discriminator's loss), or pass retain_graph=True to the first backward."
    )


def stepped_parameter(
    info: InplaceInfo | None, near: Sequence[Tensor], stepped: Sequence[tuple[Tensor, str]]
) -> tuple[Tensor, str] | None:
    """The parameter behind an in-place error that an optimizer step changed, if the error fits one.

    A parameter is saved through a view of it, at its version then; the error gives the saved tensor's
    shape (or its transpose: ``Linear`` saves ``weight.t()``) and its version now.

    Args:
        info: the parsed error (:func:`~trainvitals.integrity.graph.parse_inplace_error`).
        near: tensors to try first (the leaves nearest the node whose saved tensor changed).
        stepped: ``(parameter, label of its optimizer)`` for every parameter an optimizer step of this
            batch changed, in the model's order.

    Returns:
        ``(parameter, label)`` of the first fit, or ``None``.
    """
    if info is None or not info.may_be_parameter:
        return None
    label = {id(p): opt for p, opt in stepped}
    for p in [*near, *(p for p, _ in stepped)]:
        if id(p) in label and p._version == info.version and tuple(p.shape) in (info.shape, info.shape[::-1]):
            return p, label[id(p)]
    return None


def diagnose_inplace(
    error: BaseException,
    loss: Tensor | None,
    root: nn.Module,
    names: Mapping[int, str],
    before: int | None,
    stepped: Sequence[tuple[Tensor, str]],
    rerun: Rerun | None = None,
) -> tuple[tuple[str, ...], str]:
    """Explain ``AutogradError.INPLACE`` ("modified by an inplace operation").

    In order: the changed saved tensor belongs to an earlier step's graph, kept by ``retain_graph=True``
    and carried over by state the loss reaches, and an optimizer step has changed it since; the saved
    tensor is a parameter an optimizer step of this batch changed (:func:`stepped_parameter`); ``rerun``'s trace
    pairs a saved tensor with the in-place op that changed it later; otherwise the node whose saved
    tensor changed, with its module and (under anomaly mode) its forward line.

    Args:
        error: the exception; its message gives the tensor's shape and versions.
        loss: the last loss handed to backward, if any: its graph is searched for the node.
        root: the model; ``names``: its ``id(tensor) -> name`` (``tensor_names``).
        before: the step's :func:`~trainvitals.integrity.graph.sequence_mark`.
        stepped: as for :func:`stepped_parameter`; labels read like ``"optimizer 0 (SGD)"``.
        rerun: re-runs the step under a tracer; ``None`` where that is not possible.

    Returns:
        The names it points at (parameter, attributes, or modules and ops) and the message.
    """
    info = parse_inplace_error(str(error))
    errors = [e for e in saved_tensor_errors(loss) if e.kind is AutogradError.INPLACE] if loss is not None else []
    if errors and created_before(errors[0].node, before) and (stale := walk_graph(loss, before).stale):
        names, carried, fix = _carried_state(root, stale, before)
        return names, (
            f"The tensor that {type(errors[0].node).__name__} saved as `{errors[0].saved}` belongs to a graph made "
            f"in an earlier step and kept (retain_graph=True): {carried}, and what it saved was changed in place "
            f"since (by an optimizer step, or an in-place op on the state). Detach the state when carrying it over "
            f"({fix})."
        )
    saver, near = "", []
    if errors:
        node = errors[0].node
        near = nearest_leaves(node)
        modules = listed(tuple(dict.fromkeys(owner_module(names.get(id(t), "?")) for t in near)))
        at = anomaly_location(node)
        saver = (
            f"The tensor that {type(node).__name__} saved as `{errors[0].saved}` (near module {modules}"
            f"{f', forward at {at}' if at else ''})"
        )
    found = stepped_parameter(info, near, stepped)
    if found is not None:
        param, optimizer = found
        name = names.get(id(param), "?")
        return (name,), (
            f"{saver or 'A saved tensor'} is parameter `{name}`: {optimizer}.step() updated it in place after the "
            "forward that saved it and before this backward. Run every backward that needs this forward before "
            "optimizer.step(), or recompute the forward after the step."
        )
    if rerun is not None:
        try:
            tracer, _ = rerun()
        except Exception as err:  # a diagnosis must never replace the user's error
            return (), f"{saver or 'A saved tensor'} was modified in place (re-run failed: {err})."
        pairs = tracer.inplace_after_save(info.shape if info else None)
        if info is not None:
            pairs = sorted(pairs, key=lambda pair: pair[0].version != info.expected)
        if pairs:
            rec, event = pairs[0]
            saved_by = f"`{rec.op}`" + (f" in module `{rec.module}`" if rec.module else "")
            saved_by += f" at {rec.location}" if rec.location else ""
            culprits = tuple(dict.fromkeys(n for n in (rec.module, rec.op, event.module, event.op) if n))
            return culprits, (
                f"A tensor of shape {list(rec.shape)} saved for backward by {saved_by} was then modified in "
                f"place by {event.where()}. Use the out-of-place form (`x = x * 2` rather than `x.mul_(2)`, "
                "`inplace=False`) or `.clone()` the tensor before changing it."
            )
    return (), (
        f"{saver or 'A tensor saved for backward'} was modified in place after the forward saved it. Set "
        "detect_anomaly_steps=1 to see the forward operation, and look for in-place ops (`x += ...`, `.mul_()`, "
        "`inplace=True`) or an optimizer.step() between the forward and this backward."
    )
