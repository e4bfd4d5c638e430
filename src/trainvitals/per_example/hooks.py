"""The hooks that gather per-example gradient statistics during backward, module by module.

Units: the hooks see the gradient of whatever loss was back-propagated (divided by the accumulation
steps, multiplied by an AMP scale, averaged over the batch or not); :class:`PerExampleGradients` takes
a per-micro-batch factor that converts them to the example's own loss.

Everything here stays on the device: only :meth:`PerExampleGradients.decide` (where a lookup's ids were
compared on the device) and :meth:`PerExampleGradients.unbalanced` read on the host, once each — and a
tied lookup called with 1-D ids of B integers, whose statistics are summed with its partners', once per
call. No Lightning import.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from trainvitals.per_example.batch_dim import ONE_EXAMPLE, Layouts
from trainvitals.per_example.broadcast import (
    BROADCAST_PARAMETERS,
    CHECKPOINTED,
    Operand,
    Reader,
    broadcast_adds,
    consumers,
    parameter_grad,
    parameter_readers,
    per_example_grad,
)
from trainvitals.per_example.checkpoint_hooks import (
    AllGradsHook,
    _recomputing,
    _recomputing_task,
    _reentrant_recomputation,
    register_grad_hook,
)
from trainvitals.per_example.fallback import batch_slice, changed_input, vmap_per_example_grads, vmap_sq_norms
from trainvitals.per_example.registry import Call, Use, _output_grads, rule_for
from trainvitals.per_example.rules.embedding import POSITION_IDS, SHARED_LOOKUP, _shared_by_batch
from trainvitals.per_example.sums_check import UNBALANCED, sum_errors, tolerance
from trainvitals.per_example.tensor_ops import Workspace, _accumulation_dtype, _add, _moments, _trainable
from trainvitals.per_example.tied import measure_tied
from trainvitals.plumbing.extra_forward import in_extra_forward


@dataclass
class _SharedCall:
    """A lookup's call with ids shared by the batch (:mod:`.broadcast`), until its per-example gradient is caught.

    Attributes:
        name: the module.
        output: which output of its output's autograd node it is (the node is kept apart, in
            ``PerExampleGradients._shared``: a hook on it holding it would keep it alive).
        shape: the output's shape.
        why: what to report if the adds that broadcast it are not found.
        slot: its use's ``[ids expanded to the batch, per-example output gradient]``.
        task: the backward that recomputes it (checkpointing), as :meth:`PerExampleGradients._note_backward` takes.
        pending: the adds whose gradient has yet to arrive; -1 before they are found.
        grad: the sum of the per-example gradients caught so far, ``(B, *shape[1:])``.
        arange: for 1-D ids of B integers (T = B), a ``()`` bool on their device: whether they are ``arange(B)``.
            Such a call is measured as the examples' own lookup, or, where adds broadcast its output over the
            batch, as a position table when they are ``arange(B)`` (both computed, one chosen on the device).
    """

    name: str
    output: int
    shape: tuple[int, ...]
    why: str
    arange: Tensor | None = None
    slot: list[Any] = field(default_factory=list)
    task: int | None = None
    pending: int = -1
    grad: Tensor | None = None


@dataclass
class _ParameterCall:
    """A module's own parameters broadcast over the batch (:class:`~.broadcast.BroadcastParameters`) in one
    backward, until the gradients of the nodes that read them arrive.

    Attributes:
        name: the module.
        shapes: its parameters' shapes, by local name.
        slot: its use's ``[None, per-example gradients]``.
        pending: the reading nodes whose gradient has yet to arrive.
        grads: the sum of each parameter's per-example gradients caught so far, ``(B, *shape)``.
    """

    name: str
    shapes: dict[str, tuple[int, ...]]
    slot: list[Any]
    pending: int
    grads: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class PerExampleStep:
    """What :class:`PerExampleGradients` gathered over the micro-batches of one optimizer step, in the
    units of each example's own loss.

    Attributes:
        sq_norm_sum: ``()`` Σ_i ‖g_i‖² over the per-example-norm parameters, or ``None``.
        sq_norms: the ``(b,)`` ‖g_i‖² of each micro-batch, in order, over the per-example-norm and the ``vmap``
            parameters (only when kept: then ``vmap`` layers measure every example, not only the sub-batch's).
        grad_sum: Σ_i g_i per per-example-norm parameter (qualified name), when requested.
        sum_sq: Σ_i g_i² per per-example-norm parameter, when requested (from the same operands).
        num_sub: examples of the ``vmap`` sub-batches.
        sub_sq_norm_sum: ``()`` Σ_i ‖g_i‖² over the ``vmap`` parameters and the sub-batch examples.
        sub_grad_sum: Σ_i g_i per ``vmap`` parameter over the sub-batch.
        sub_sum_sq: Σ_i g_i² per ``vmap`` parameter over the sub-batch.
        seen: modules whose output gradient arrived.
        undecided: per lookup called with 1-D ids of B integers or ``(B, B)`` ids, a ``()`` bool tensor on its
            device: whether they were ``arange(B)`` or relative-position buckets (:mod:`.layout`), shared by the
            examples, in some call so far. Its statistics count 0 from
            that call on; :meth:`PerExampleGradients.decide` reads them and fails those that were.
        undecided_counted: per such lookup, a ``()`` bool tensor: whether some of its statistics were counted
            (a micro-batch measured before its ids were found ``arange(B)``): then, shared, it cannot be set
            aside (:meth:`PerExampleGradients.set_aside`).
        failed: modules that could not be measured this step, with the reason.
        dtypes: the dtype of each measured module's output gradients (the precision of its rule's operands).
    """

    sq_norm_sum: Tensor | None = None
    sq_norms: list[Tensor] = field(default_factory=list)
    grad_sum: dict[str, Tensor] = field(default_factory=dict)
    sum_sq: dict[str, Tensor] = field(default_factory=dict)
    num_sub: int = 0
    sub_sq_norm_sum: Tensor | None = None
    sub_grad_sum: dict[str, Tensor] = field(default_factory=dict)
    sub_sum_sq: dict[str, Tensor] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)
    undecided: dict[str, Tensor] = field(default_factory=dict)
    undecided_counted: dict[str, Tensor] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)


class PerExampleGradients:
    """Module hooks that gather per-example gradient statistics during backward.

    For each module of ``per_example``, a forward hook keeps a reference to the input (autograd saves
    it anyway) and puts a hook on the output; when the output gradients of all the module's calls in
    the forward (its *uses*) have arrived, its rule (:mod:`.registry`) adds the per-example squared
    norms (and, if requested, the per-coordinate sums of squares) into running device tensors, and the
    references go. A ``whole_call`` rule with a :meth:`~.registry.PerExampleRule.capture` is entered in a
    forward pre-hook and gets, in place of the call's outputs, the tensors it kept from inside the forward.
    A module called several times is measured from all its uses together: its
    per-example gradient is their sum. Modules that share a parameter (an embedding tied to the output
    layer) are measured together (:mod:`.tied`). A
    module recomputed in backward by ``torch.utils.checkpoint`` is measured once: from its first run,
    or from the recomputation where the first run had no graph (reentrant checkpointing); one whose
    reentrant recomputation comes after it was measured (several segments) is reported as not measured.
    A forward trainvitals runs for its own purpose (:func:`~trainvitals.plumbing.extra_forward.extra_forward`:
    the lr advisor's probe of the loss, a diagnosis's re-run) is neither measured nor read as layout evidence.

    Modules of ``vmap`` keep the first ``sub_batch`` examples of their inputs and output gradients
    until :meth:`end_micro_batch`, which computes their per-example gradients with
    :func:`vmap_per_example_grads`.

    A lookup with ids shared by the batch (a position table) is measured from the gradient of the adds that
    broadcast its output against the examples, which :meth:`before_backward` finds in the loss's graph
    (:mod:`.broadcast`); so is a module without a rule, whose own parameters its forward broadcasts over the
    batch (a ViT's ``pos_embed``), from the nodes that read them.

    Use: :meth:`attach`, then per micro-batch :meth:`begin_micro_batch`, forward, :meth:`before_backward`, backward
    and :meth:`end_micro_batch` with the factor that converts the back-propagated gradient to the examples'
    own losses; :meth:`pop` at the optimizer step; :meth:`detach`. A ``vmap`` module that runs more than
    once in a forward, or a call whose examples' dimension :meth:`~.layout.Layouts.examples` cannot settle,
    is reported in :attr:`PerExampleStep.failed`.

    Args:
        per_example: ``{name: module}`` with :func:`unsupported_reason` ``None``.
        vmap: ``{name: module}`` for the ``torch.func`` fallback.
        sub_batch: examples per micro-batch for the fallback, ≥ 2.
        layouts: which dimension holds the examples of an input with the batch on both of its first two
            (:class:`~.layout.Layouts`, kept over a fit's collectors); ``None``: a fresh one, without the model's.
    """

    def __init__(
        self,
        per_example: Mapping[str, nn.Module],
        vmap: Mapping[str, nn.Module],
        sub_batch: int,
        layouts: Layouts | None = None,
    ) -> None:
        if sub_batch < 2:
            raise ValueError(f"`sub_batch` must be >= 2, got {sub_batch}")
        self.per_example, self.vmap, self.sub_batch = dict(per_example), dict(vmap), sub_batch
        self.layouts = Layouts() if layouts is None else layouts
        self._rules = {name: rule_for(module) or BROADCAST_PARAMETERS for name, module in self.per_example.items()}
        self._names, self._groups = self._parameter_names()
        # Each module's measured parameters, local name: qualified name (a step's lookups without a rebuilt dict).
        self._locals = {
            name: {local: self._names[id(p)] for local, p in self._rules[name].parameters(module).items()}
            for name, module in self.per_example.items()
        }
        self._handles: list[RemovableHandle] = []
        self._captures: dict[str, list[Any]] = {}  # per module, the captures of its calls still running
        self._versions: dict[str, list[int | None]] = {}  # per vmap module, its running call's inputs' versions
        self._workspace = Workspace()  # the conv patches and blocks of every layer and step
        self._coordinates: dict[str, slice] = {}  # qualified parameter name: its rows to sum
        self._keep_norms = False
        self._replaying = False
        self._reset_micro_batch()
        self._step = PerExampleStep()

    def _parameter_names(self) -> tuple[dict[int, str], dict[str, list[str]]]:
        """Each measured parameter's qualified name (a tied one: its first owner's), and each module's
        group: the modules measured together with it (itself, and those it shares a parameter with)."""
        names: dict[int, str] = {}
        owners: dict[int, list[str]] = {}
        for name, module in self.per_example.items():
            for local, p in self._rules[name].parameters(module).items():
                names.setdefault(id(p), f"{name}.{local}" if name else local)
                owners.setdefault(id(p), []).append(name)
        parent = {name: name for name in self.per_example}  # union-find over the modules sharing a parameter

        def root(name: str) -> str:
            while parent[name] != name:
                name = parent[name]
            return name

        for members in owners.values():
            for other in members[1:]:
                parent[root(other)] = root(members[0])
        by_root: dict[str, list[str]] = {}
        for name in self.per_example:
            by_root.setdefault(root(name), []).append(name)
        groups = {}
        for members in by_root.values():
            groups.update(dict.fromkeys(members, members))
        return names, groups

    def _reset_micro_batch(self) -> None:
        self._sq: Tensor | None = None
        self._vmap_sq: Tensor | None = None  # kept norms only: (b,) ‖g_i‖² of the vmap layers, as back-propagated
        self._grad_sum: dict[str, Tensor] = {}
        self._sum_sq: dict[str, Tensor] = {}
        self._pending: list[tuple[str, nn.Module, tuple[Any, ...], dict[str, Any], Tensor]] = []
        self._calls: Counter[str] = Counter()
        self._uses: dict[str, list[list[Any]]] = {}  # per module, its calls' [inputs, output gradient or None]
        self._done: set[str] = set()  # modules whose uses were measured this micro-batch
        self._batch_size: int | None = None  # examples in this micro-batch: told, else the first layer's rows
        self._tasks: dict[int, set[str]] = {}  # per backward (graph task) reaching the hooks, the modules it reached
        self._either: dict[str, tuple[list[Any], Tensor]] = {}  # per module, the slot its adds gave, and when to use it
        self._shared: list[tuple[_SharedCall, Any]] = []  # this forward's lookups with ids shared by the batch, and
        # their outputs' autograd nodes
        self._creating: set[int] = set()  # those run with create_graph=True
        self._call_hooks: list[AllGradsHook] = []  # this micro-batch's whole calls' hooks, kept here, not by the graph
        self._parameter_calls: list[_ParameterCall] = []  # this backward's broadcast parameters, by module
        self._looked = False  # whether before_backward looked for them

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self, coordinates: bool | Mapping[str, slice] = False, keep_norms: bool = False) -> None:
        """Install the hooks; ``coordinates``: also Σ_i g_i and Σ_i g_i², of every measured parameter
        (``True``) or of the rows ``coordinates[name]`` along dimension 0 of the parameters it names
        (qualified names, as in :attr:`PerExampleStep.grad_sum`); ``keep_norms``: keep each ‖g_i‖²."""
        self.detach()
        if coordinates is True:
            coordinates = dict.fromkeys(self._names.values(), slice(None))
        self._coordinates, self._keep_norms = dict(coordinates or {}), keep_norms
        for name, module in self.per_example.items():
            if self._rules[name] is BROADCAST_PARAMETERS:
                continue  # measured from the loss's graph (before_backward), not from its calls
            whole_call = self._rules[name].whole_call  # a capture is left also when the forward raises
            if whole_call:
                pre_hook = functools.partial(self._enter_capture, name)
                self._handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
            hook = functools.partial(self._forward, name)
            self._handles.append(module.register_forward_hook(hook, with_kwargs=True, always_call=whole_call))
        for name, module in self.vmap.items():
            pre_hook = functools.partial(self._enter_vmap, name)
            self._handles.append(module.register_forward_pre_hook(pre_hook))
            hook = functools.partial(self._forward_vmap, name)
            self._handles.append(module.register_forward_hook(hook, with_kwargs=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def begin_micro_batch(self) -> None:
        """Start a micro-batch: what a forward without backward left (a training step that returned no
        loss, a skipped batch) is dropped, so that the next forward's calls are not taken for more uses."""
        self._reset_micro_batch()

    def expect_batch(self, size: int, batch: Any = None) -> None:
        """The coming micro-batch holds ``size`` examples: a layer whose input has another first dimension
        (a position embedding called with ``arange(T)``, inputs flattened to ``(B·T, D)``) is reported in
        :attr:`PerExampleStep.failed`, not measured. Untold, the first measured layer's rows count. ``batch``:
        its tensors, whose views show a layer's layout (:mod:`.layout`)."""
        self._batch_size = size
        self.layouts.see_batch(batch, size)

    def _check_batch(self, name: str, batch: int) -> bool:
        if self._batch_size is None:
            self._batch_size = batch
        if batch != self._batch_size:
            self._step.failed[name] = f"first dimension {batch} is not the batch ({self._batch_size})"
            return False
        return True

    def _check_call(self, name: str, output: Any, batch: int) -> bool:
        if self._replaying or in_extra_forward() or (_recomputing() and self._calls[name]):
            return False
        if not isinstance(output, Tensor):
            if any(isinstance(t, Tensor) and t.requires_grad for t in tree_leaves(output)):
                self._step.failed[name] = (
                    f"its output is a {type(output).__name__}, not the one tensor the "
                    "torch.func fallback differentiates"
                )
            return False
        if not output.requires_grad:
            return False
        self._calls[name] += 1
        if self._calls[name] > 1:
            self._step.failed[name] = "runs more than once per forward"
            return False
        return self._check_batch(name, batch)

    def _enter_capture(self, name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Enter the rule's :meth:`~.registry.PerExampleRule.capture` of this call, if it has one and the call
        may be measured; one entry per call (``None`` for none), left by :meth:`_forward`."""
        if torch.compiler.is_compiling():
            return
        capture = None
        if not (
            self._replaying
            or in_extra_forward()
            or name in self._step.failed
            or not torch.is_grad_enabled()
            or (_recomputing() and not _reentrant_recomputation())
        ):
            capture = self._rules[name].capture(module, Call(args, kwargs))
        if capture is not None:
            capture.__enter__()
        self._captures.setdefault(name, []).append(capture)

    def _forward(
        self, name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        if torch.compiler.is_compiling():
            return  # a hook's work inside a compiled function would break its graph: the call goes unseen
        rule = self._rules[name]
        capture = self._captures[name].pop() if rule.whole_call and self._captures.get(name) else None
        if capture is not None:
            capture.__exit__(None, None, None)
        if self._replaying or in_extra_forward() or name in self._step.failed:
            return  # a forward of trainvitals' own (the lr advisor's probe, a diagnosis) is not the step's
        if _recomputing() and not _reentrant_recomputation():
            return  # non-reentrant checkpointing's recomputation of a call measured from its first run
        shared_call = None
        if rule.whole_call:
            leaves = [
                t if isinstance(t, Tensor) and t.requires_grad else None
                for t in (tree_leaves(output) if capture is None or capture.tensors is None else capture.tensors)
            ]
            tensors = [t for t in leaves if t is not None]
            if not tensors:
                return
            call = Call(args, kwargs)
            inputs: Any = capture.inputs if capture is not None and capture.inputs is not None else call
            batch = rule.batch_size(module, call)
            if batch < 0:
                self._step.failed[name] = "its input holds no batch of examples its rule can read (an unbatched input?)"
                return
        else:
            if not args or not isinstance(args[0], Tensor):
                self._step.failed[name] = "its input was not passed positionally (e.g. `layer(input=x)`)"
                return
            if not isinstance(output, Tensor):
                self._step.failed[name] = f"its output is a {type(output).__name__}, not the tensor its rule needs"
                return
            if not output.requires_grad:
                return
            inputs, batch = args[0], args[0].shape[0] if args[0].dim() else -1
            if self.layouts.one_example(name, inputs):
                self._step.failed[name] = ONE_EXAMPLE.format(batch=self._batch_size)
                return
            shared = rule.broadcast_batch and _shared_by_batch(inputs, self._batch_size)
            if isinstance(shared, Tensor):
                if len(self._groups[name]) > 1:
                    shared = bool(shared)  # a tied lookup's statistics are summed with its partners': one sync
                else:  # ids arange(B) or the examples' own: which the adds reading its output may tell
                    shared_call = _SharedCall(name, output.output_nr, tuple(output.shape), SHARED_LOOKUP, shared)
                    shared = False
            why = SHARED_LOOKUP if shared else None
            if (
                rule.broadcast_batch
                and inputs.dim() == 1
                and not inputs.is_floating_point()
                and self._batch_size is not None
                and batch != self._batch_size
            ):
                why = POSITION_IDS.format(ids=batch, batch=self._batch_size)
            if why is not None:  # measured where its output meets the batch (before_backward), if it is found
                if len(self._groups[name]) > 1 or output.grad_fn is None:
                    self._step.failed[name] = why
                    return
                shared_call = _SharedCall(name, output.output_nr, tuple(output.shape), why)
                inputs, batch = inputs.reshape(1, -1).expand(self._batch_size, -1), self._batch_size
            features, moved = rule.feature_dims(module), False
            if (
                shared_call is None
                and features is not None
                and self._batch_size is not None
                and inputs.dim() - features >= 2
            ):
                examples = self.layouts.examples(
                    name, inputs, features, self._batch_size, rule.broadcast_batch, tied=len(self._groups[name]) > 1
                )
                if examples.failed:
                    self._step.failed[name] = examples.failed
                    return
                if examples.relative is not None:  # (B, B) ids, perhaps relative-position buckets
                    self._undecided(name, examples.relative)
                moved = examples.dim == 1
            if moved:  # sequence-first (T, B, *): the positions lead, the examples are dimension 1
                inputs, batch = inputs.movedim(1, 0), self._batch_size
        if name in self._done:
            self._step.failed[name] = (
                "measured before reentrant checkpointing recomputed another of its calls: it "
                "runs in several checkpointed segments, or inside one and after it"
            )
            return
        self._calls[name] += 1
        if not self._check_batch(name, batch):
            return
        slot = [inputs, None]
        self._uses.setdefault(name, []).append(slot)
        task = _recomputing_task()
        if rule.whole_call:
            hook = functools.partial(self._backward_call, name, slot, task, [t is not None for t in leaves])
            self._call_hooks.append(AllGradsHook(tensors, hook))
        elif shared_call is not None and shared_call.arange is not None:  # the use as it is, or the adds'
            ids = inputs.reshape(1, -1).expand(batch, -1)
            shared_call.slot, shared_call.task = [ids, None], task
            self._shared.append((shared_call, output.grad_fn))
            register_grad_hook(output, functools.partial(self._backward_either, shared_call, slot))
        elif shared_call is not None:
            shared_call.slot, shared_call.task = slot, task
            self._shared.append((shared_call, output.grad_fn))
            register_grad_hook(output, functools.partial(self._backward_summed, shared_call))
        else:
            register_grad_hook(output, functools.partial(self._backward_output, name, slot, task, moved))

    def before_backward(self, loss: Tensor) -> None:
        """Before ``loss``'s backward: find where the outputs of this forward's lookups with ids shared by the batch
        are added to the examples' tensors (:mod:`.broadcast`), and hook those adds, whose output gradient is the
        per-example one. A lookup whose output something else reads is reported in :attr:`PerExampleStep.failed`
        (1-D ids of B integers: measured as the examples' own, or decided as shared in :meth:`decide`). Not called
        (a backward of another loss), those lookups are reported so at their gradient. The modules measured from
        their broadcast parameters are hooked at the nodes that read those (:meth:`_hook_parameters`). Host-side
        only: one walk of the graph, in a forward that has such lookups or modules."""
        self._looked = True
        calls = [(c, node) for c, node in self._shared if c.pending < 0 and c.name not in self._step.failed]
        accumulators = {
            name: {local: get_gradient_edge(p).node for local, p in _trainable(module).items()}
            for name, module in self.per_example.items()
            if self._rules[name] is BROADCAST_PARAMETERS
            and name not in self._step.failed
            and name not in self._done
            and name not in self._uses
        }
        if not (calls or accumulators) or loss.grad_fn is None:
            return
        readers = consumers(loss.grad_fn)
        checkpointed = any(type(node).__name__ == CHECKPOINTED for node in readers)
        for name, nodes in accumulators.items():
            self._hook_parameters(name, nodes, readers, checkpointed)
        for call, node in calls:
            adds = broadcast_adds(node, call.output, call.shape, readers)
            if call.arange is not None and (
                isinstance(adds, str) or not adds or len(self._uses.get(call.name, [])) > 1
            ):
                continue  # the examples' own lookup, read as any other (or with other calls: as before)
            if isinstance(adds, str):
                self._fail_shared(call, adds)
                continue
            call.pending = len(adds)
            for add, operand in adds:
                add.register_prehook(functools.partial(self._backward_shared, call, operand))

    def _hook_parameters(
        self, name: str, accumulators: dict[str, Any], readers: dict[Any, list[Any]], checkpointed: bool
    ) -> None:
        """Hook the nodes of the loss's graph that broadcast ``name``'s own parameters over the batch
        (``accumulators``: their ``AccumulateGrad`` nodes, by local name), or fail it: a parameter read otherwise.
        One the graph does not reach is unused (its gradient 0), but where reentrant checkpointing
        (``checkpointed``) hides what it computes."""
        shapes = {local: tuple(p.shape) for local, p in _trainable(self.per_example[name]).items()}
        found: list[tuple[Any, str, Reader]] = []
        for local, node in accumulators.items():
            if not readers.get(node) and checkpointed:
                self._step.failed[name] = (
                    f"`{local}` is not reached from the loss's graph: inside reentrant checkpointing?"
                )
                return
            hows = parameter_readers(node, readers, shapes[local], self._batch_size or 0)
            if isinstance(hows, str):
                self._step.failed[name] = f"`{local}` {hows}"
                return
            found += [(reader, local, how) for reader, how in hows]
        if not found:
            return  # the loss uses none of them: no contribution
        call = _ParameterCall(name, shapes, [None, None], len(found))
        self._uses[name], self._calls[name] = [call.slot], self._calls[name] + 1
        self._parameter_calls.append(call)
        for reader, local, how in found:
            other = [getattr(reader, how.other)] if how.other else []  # let go when the hook has used it
            reader.register_prehook(functools.partial(self._backward_parameter, call, local, how, other))

    @torch.no_grad()
    def _backward_parameter(
        self, call: _ParameterCall, local: str, reader: Reader, other: list[Tensor], grad_outputs: tuple[Any, ...]
    ) -> None:
        """A reading node's prehook: its part of ``call``'s per-example gradient of ``local``."""
        self._note_backward(call.name, None)
        saved = other.pop() if other else None
        if call.name in self._step.failed or call.name in self._done or call.pending <= 0:
            return
        if grad_outputs[0] is not None:
            try:
                per = parameter_grad(grad_outputs[0], call.shapes[local], self._batch_size or 0, reader, saved)
            except Exception as err:  # noqa: BLE001 - raised into the user's backward, it would end the run
                per = f"failed per example: {type(err).__name__}: {err}"
            if isinstance(per, str):
                self._step.failed[call.name] = f"`{local}` {per}"
                self._uses.pop(call.name, None)
                return
            call.grads[local] = per if local not in call.grads else call.grads[local] + per
        call.pending -= 1
        if call.pending == 0:
            self._finish_parameters(call)

    def _finish_parameters(self, call: _ParameterCall) -> None:
        """Measure ``call`` from the gradients caught (a parameter none reached: 0)."""
        call.pending = 0
        if not call.grads:  # the loss reached none of the reading nodes: no contribution
            self._uses.pop(call.name, None)
            return
        like = next(iter(call.grads.values()))
        grads = tuple(
            call.grads[local] if local in call.grads else like.new_zeros(like.shape[0], *shape)
            for local, shape in call.shapes.items()
        )
        self._backward(call.name, call.slot, grads)

    def _fail_shared(self, call: _SharedCall, why: str) -> None:
        self._step.failed[call.name] = f"{call.why}; {why}"
        self._uses.pop(call.name, None)

    @torch.no_grad()
    def _backward_shared(self, call: _SharedCall, operand: Operand, grad_outputs: tuple[Tensor | None, ...]) -> None:
        """An add's prehook: ``call``'s per-example gradient from the gradient of the add's result."""
        self._note_backward(call.name, call.task)
        if call.name in self._step.failed or call.name in self._done or call.pending < 0:
            return
        if grad_outputs[0] is not None:
            per = per_example_grad(grad_outputs[0], operand, self._batch_size or 0)
            if isinstance(per, str):
                if call.arange is not None:  # not broadcast: the examples' own lookup
                    call.pending = -1
                else:
                    self._fail_shared(call, per)
                return
            call.grad = per if call.grad is None else call.grad + per
        call.pending -= 1
        if call.pending == 0 and call.grad is not None:
            if call.arange is not None:
                call.slot[1] = call.grad  # chosen from at its output's gradient (_backward_either)
            else:
                self._backward(call.name, call.slot, call.grad)

    def _backward_either(self, call: _SharedCall, slot: list[Any], grad_output: Tensor) -> None:
        """The output's gradient of a call of 1-D ids of B integers: measured as the examples' own lookup, or where
        its adds broadcast it, from theirs when the ids are ``arange(B)`` (:meth:`_measure`)."""
        if call.pending == 0 and call.slot[1] is not None:
            self._either[call.name] = (call.slot, call.arange)
        else:  # arange(B) but not broadcast by adds: shared, not measured (decide)
            self._undecided(call.name, call.arange)
        self._backward_output(call.name, slot, call.task, False, grad_output)

    def _backward_summed(self, call: _SharedCall, grad_output: Tensor) -> None:
        """The gradient at ``call``'s output, summed over the examples: measured from its adds' instead, if found."""
        self._note_backward(call.name, call.task)
        if call.pending < 0 and call.name not in self._step.failed:
            self._fail_shared(call, "where its output meets the batch was not looked for (no before_backward)")

    def _undecided(self, name: str, shared: Tensor) -> None:
        """Whether ``name``'s ids are shared by the batch, compared on the device: read in :meth:`decide`."""
        prior = self._step.undecided.get(name)
        self._step.undecided[name] = shared if prior is None else prior | shared

    def _note_backward(self, name: str, task: int | None) -> None:
        """Record which backward reached ``name``: ``task``, the backward that recomputes a checkpointed
        call (its reentrant backward is part of that one), else the running one."""
        task = torch._C._current_graph_task_id() if task is None else task
        self._tasks.setdefault(task, set()).add(name)
        if torch.is_grad_enabled():  # hooks run in grad mode only under create_graph=True
            self._creating.add(task)

    def _check_backwards(self) -> None:
        """Fail the modules that a backward before the micro-batch's last one reached (a
        ``torch.autograd.grad`` inside the training step): the rules measured that backward's gradients, and a
        gradient penalty's term reaches the weights through double-backward nodes that no hook sees."""
        for task, names in list(self._tasks.items())[:-1]:
            why = (
                "the training step differentiates its own gradients (create_graph=True: a gradient penalty?): "
                "per-example norms do not see that term"
                if task in self._creating
                else "its output was differentiated by a backward before the loss's (torch.autograd.grad in the "
                "training step?)"
            )
            for name in names:
                self._step.failed.setdefault(name, why)

    def _backward_output(self, name: str, slot: list[Any], task: int | None, moved: bool, grad_output: Tensor) -> None:
        self._note_backward(name, task)
        self._backward(name, slot, grad_output.movedim(1, 0) if moved else grad_output)

    def _backward_call(self, name: str, slot: list[Any], task: int | None, present: list[bool], grads: Any) -> None:
        self._note_backward(name, task)
        if all(g is None for g in grads):  # the loss uses none of the call's outputs: no contribution
            self._uses[name].remove(slot)
            self._calls[name] -= 1
            return
        it = iter(grads)
        self._backward(name, slot, tuple(next(it) if p else None for p in present))

    def _flush(self) -> None:
        """Measure the groups with uses left at the end of a backward: calls whose outputs the loss did
        not use (their gradient is 0), a tied module this forward did not call, broadcast parameters some of whose
        reading nodes the backward did not reach."""
        for call in self._parameter_calls:
            if call.pending > 0 and call.name not in self._step.failed and call.name not in self._done:
                self._finish_parameters(call)
        if self._tasks and not self._looked:  # a backward ran, its graph not shown: their gradients went unseen
            for name, rule in self._rules.items():
                if rule is BROADCAST_PARAMETERS:
                    self._step.failed.setdefault(
                        name, "where its parameters meet the batch was not looked for (no before_backward)"
                    )
        for name in list(self._uses):
            if name in self._uses and any(s[1] is not None for s in self._uses[name]):
                self._measure(self._groups[name])
        self._uses.clear()

    @torch.no_grad()  # a backward with create_graph=True runs hooks in grad mode; nothing here is differentiated
    def _backward(self, name: str, slot: list[Any], grad_output: Any) -> None:
        if name in self._step.failed or name in self._done:
            return
        slot[1] = grad_output
        group = self._groups[name]
        if all(self._calls[m] and all(s[1] is not None for s in self._uses.get(m, [])) for m in group):
            self._measure(group)

    @torch.no_grad()  # also when flushed after the backward
    def _measure(self, group: list[str]) -> None:
        """The statistics of ``group``'s uses whose output gradient arrived (the others contribute 0)."""
        uses = {m: [Use(*s) for s in self._uses.pop(m, []) if s[1] is not None] for m in group}
        self._done.update(group)
        uses = {m: u for m, u in uses.items() if u}
        if not uses:
            return
        try:
            if len(group) == 1:
                ((name, module_uses),) = uses.items()
                module, rule = self.per_example[name], self._rules[name]
                rows = {}  # the rows to sum of each parameter: none without coordinates (no name lookups)
                if self._coordinates:
                    rows = {
                        local: self._coordinates[q] for local, q in self._locals[name].items() if q in self._coordinates
                    }
                sq, local_sums = rule.measure(module, module_uses, self._workspace, rows)
                sums = {self._locals[name][local]: value for local, value in local_sums.items()}
                either = self._either.pop(name, None)
                if either is not None:  # ids arange(B), a position table: from its adds' gradients
                    alt_slot, arange = either
                    alt = [Use(*alt_slot)]
                    sq = torch.where(arange, rule.sq_norms(module, alt, self._workspace), sq)
                    alt_sums = rule.sums(module, alt, self._workspace, rows) if rows else {}
                    sums = {
                        q: (torch.where(arange, a, total), torch.where(arange, a_sq, total_sq))
                        for (q, (total, total_sq)), (a, a_sq) in zip(sums.items(), alt_sums.values())
                    }
                shared = self._step.undecided.get(name)
                if shared is not None:  # ids arange(B) in some call so far: nothing counts (see decide)
                    counted = self._step.undecided_counted.get(name)
                    self._step.undecided_counted[name] = ~shared if counted is None else counted | ~shared
                    sq = torch.where(shared, 0.0, sq)
                    sums = {
                        q: (torch.where(shared, 0.0, total), torch.where(shared, 0.0, total_sq))
                        for q, (total, total_sq) in sums.items()
                    }
            else:
                wanted = any(q in self._coordinates for m in uses for q in self._locals[m].values())
                sq, sums = measure_tied(
                    {m: (self.per_example[m], self._rules[m], u) for m, u in uses.items()},
                    self._names,
                    wanted,
                    self._workspace,
                )
                sums = {
                    q: (total[self._coordinates[q]].clone(), total_sq[self._coordinates[q]].clone())
                    for q, (total, total_sq) in sums.items()
                    if q in self._coordinates
                }
        except Exception as err:  # noqa: BLE001 - raised into the user's backward, it would end the run
            for name in uses:
                self._step.failed[name] = f"per-example norms failed: {type(err).__name__}: {err}"
            return
        self._sq = sq if self._sq is None else self._sq + sq
        for name, module_uses in uses.items():
            grads = [g for use in module_uses for g in _output_grads(use) if g is not None]
            self._step.dtypes.setdefault(name, grads[0].dtype if grads else sq.dtype)
        for qualified, (total, total_sq) in sums.items():
            _add(self._grad_sum, qualified, total)
            _add(self._sum_sq, qualified, total_sq)
        self._step.seen.update(group)  # a tied member this forward did not call has its gradient here

    def unbalanced(self, step: PerExampleStep, to_grad: Tensor | float) -> dict[str, str]:
        """The modules whose per-example gradients do not add up to their parameters' ``.grad``, with why:
        the strongest check that a rule saw the whole gradient. Needs the sums (``attach(coordinates=True)``)
        of a step whose backwards all ran with the hooks; ``to_grad``: ``.grad`` over Σ_i g_i (e.g. the
        gradient units over the examples, for a mean loss 1/B). Only the rows summed (``attach``'s
        ``coordinates``) are compared, and the layers with some. Non-finite gradients (an AMP step that
        overflowed) are not judged. One host sync."""
        checked = [
            n
            for n in self.per_example
            if n in step.seen
            and n not in step.failed
            and n in step.dtypes
            and any(q in self._coordinates for q in self._qualified_parameters(n))
        ]
        if not step.grad_sum or not checked:
            return {}
        measured = set(self._names.values())
        params = {
            q: p
            for n in checked
            for q, p in self._qualified_parameters(n).items()
            if q in self._coordinates or q not in measured
        }  # Σ_i g_i of a parameter the rule skips: 0
        err, ref = sum_errors(params, self._coordinates, step.grad_sum, to_grad)
        # The loosest over the step: under autocast a layer's weight gradient may come partly from another's
        # half-precision operands (a tied output layer, a recurrent layer's casts).
        device = next(iter(params.values())).device
        bound = max(tolerance(dtype, device) for dtype in step.dtypes.values())
        out = {}
        for name in checked:
            local = [q for q in self._qualified_parameters(name) if q in params]
            e = math.sqrt(sum(err[q] ** 2 for q in local))
            r = math.sqrt(sum(ref[q] ** 2 for q in local))
            if local and math.isfinite(e) and math.isfinite(r) and e > bound * r:
                out[name] = UNBALANCED.format(error=e / r)
        return out

    def _qualified_parameters(self, name: str) -> dict[str, nn.Parameter]:
        """``name``'s trainable parameters by their qualified names; the ones its rule does not measure
        under their own names (their Σ_i g_i is 0)."""
        module = self.per_example[name]
        measured = self._rules[name].parameters(module)
        out = {self._names[id(p)]: p for p in measured.values()}
        for local, p in _trainable(module).items():
            if id(p) not in self._names:
                out[f"{name}.{local}" if name else local] = p
        return out

    def _enter_vmap(self, name: str, module: nn.Module, args: tuple[Any, ...]) -> None:
        """The versions of a ``vmap`` call's inputs before its forward: one that changes them in place cannot be
        re-run on them (:data:`~.fallback.CHANGED_INPUT`)."""
        if not torch.compiler.is_compiling():
            self._versions[name] = [a._version if isinstance(a, Tensor) else None for a in args]

    def _forward_vmap(
        self, name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        if torch.compiler.is_compiling():
            return
        versions = self._versions.pop(name, [])
        batch = next((a.shape[0] for a in args if isinstance(a, Tensor) and a.dim()), -1)
        if not self._check_call(name, output, batch):
            return
        if why := changed_input(args, versions):
            self._step.failed[name] = why
            return
        sub = min(self.sub_batch, batch)
        kept = args if self._keep_norms else batch_slice(args, batch, 0, sub)
        task = _recomputing_task()
        register_grad_hook(output, functools.partial(self._backward_vmap, name, module, kept, kwargs, sub, task))

    def _backward_vmap(
        self,
        name: str,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        sub: int,
        task: int | None,
        grad_output: Tensor,
    ) -> None:
        self._note_backward(name, task)
        if self._calls[name] <= 1 and all(p[0] != name for p in self._pending):
            self._pending.append((name, module, args, kwargs, grad_output if self._keep_norms else grad_output[:sub]))

    def _add_vmap_sq(self, start: int, sq: Tensor) -> None:
        if self._vmap_sq is None:
            self._vmap_sq = sq.new_zeros(self._batch_size or start + sq.shape[0])
        self._vmap_sq[start : start + sq.shape[0]] += sq

    def end_micro_batch(self, unit: Tensor | float) -> None:
        """Close a micro-batch: run the fallback, convert to own-loss units and add to the step.

        Args:
            unit: ``()`` tensor or float u with g_i = u × (the back-propagated per-example gradient),
                e.g. (accumulation steps × batch size for a mean loss) / AMP loss scale.
        """
        self._flush()
        self._check_backwards()
        step = self._step
        unit_sq = unit * unit
        wide = unit.double() if isinstance(unit, Tensor) else unit  # u² of the float64 sums: not rounded to float32
        self._run_vmap(wide)  # first: its sub-batch adds to the kept norms
        if self._sq is not None:
            sq = self._sq * unit_sq
            step.sq_norm_sum = sq.sum() if step.sq_norm_sum is None else step.sq_norm_sum + sq.sum()
        kept = [t for t in (self._sq, self._vmap_sq) if t is not None]
        if self._keep_norms and kept:
            step.sq_norms.append(functools.reduce(torch.add, kept) * unit_sq)
        for name, value in self._grad_sum.items():  # in place: the micro-batch's sums are let go below
            _add(step.grad_sum, name, value.mul_(wide))
        for name, value in self._sum_sq.items():
            _add(step.sum_sq, name, value.mul_(wide * wide))
        self._reset_micro_batch()

    def _run_vmap(self, unit: Tensor | float) -> None:
        step, sub = self._step, None
        self._replaying = True
        try:
            for name, module, args, kwargs, grad_output in self._pending:
                if name in step.failed:
                    continue
                batch, n = grad_output.shape[0], min(self.sub_batch, grad_output.shape[0])
                try:
                    grads = vmap_per_example_grads(
                        module, batch_slice(args, batch, 0, n), kwargs, grad_output[:n].detach()
                    )
                    if self._keep_norms:  # every example's ‖g_i‖², the sub-batch's from `grads` below
                        self._add_vmap_sq(n, vmap_sq_norms(module, args, kwargs, grad_output.detach(), n))
                except Exception as err:  # noqa: BLE001 - any failure of torch.func means: not measurable
                    step.failed[name] = f"torch.func failed: {type(err).__name__}: {err}"
                    continue
                step.seen.add(name)
                sub = n
                for local, g in grads.items():
                    g = g.to(_accumulation_dtype(g))
                    squares = g.flatten(1).square().sum(1)
                    if self._keep_norms:
                        self._add_vmap_sq(0, squares)
                    sq = squares.sum() * (unit * unit)
                    step.sub_sq_norm_sum = sq if step.sub_sq_norm_sum is None else step.sub_sq_norm_sum + sq
                    qualified, (total, total_sq) = (f"{name}.{local}" if name else local), _moments(g)
                    _add(step.sub_grad_sum, qualified, total.mul_(unit))
                    _add(step.sub_sum_sq, qualified, total_sq.mul_(unit * unit))
        finally:
            self._replaying = False
        if sub is not None:
            step.num_sub += sub

    def decide(self, step: PerExampleStep) -> None:
        """Read ``step``'s undecided lookups (one sync, none without any): those called with ``arange(B)``
        are failed and their statistics (0 since) dropped, as if failed in their forward — unless some were
        counted before (an earlier micro-batch's other ids): those stay seen, so the step is not set aside."""
        if not step.undecided:
            return
        names, device = list(step.undecided), next(iter(step.undecided.values())).device
        false = torch.zeros((), dtype=torch.bool, device=device)
        flags = torch.stack(
            [
                torch.stack([step.undecided[n].to(device), step.undecided_counted.get(n, false).to(device)])
                for n in names
            ]
        ).tolist()
        step.undecided, step.undecided_counted = {}, {}
        for name, (shared, counted) in zip(names, flags):
            if not shared:
                continue
            step.failed[name] = SHARED_LOOKUP
            if not counted:
                step.seen.discard(name)
            step.dtypes.pop(name, None)
            for qualified in self._qualified_parameters(name):
                step.grad_sum.pop(qualified, None)
                step.sum_sq.pop(qualified, None)

    def set_aside(self, step: PerExampleStep) -> set[str]:
        """The failed modules that ``step`` can be measured without, with the modules they share a parameter
        with: none of the group's statistics were counted (it failed before its rule ran in every micro-batch:
        a lookup shared by the batch, an input or output its rule cannot read, a rule or torch.func that
        raised), so the sums are exactly the other modules' and its parameters count as not measured. A
        failure after some of its statistics were counted (a later micro-batch, sums that do not add up, a
        backward before the loss's, a tied partner measured without it) leaves them in the sums: not here."""
        aside: set[str] = set()
        for name in step.failed:
            group = self.group(name)
            if not step.seen.intersection(group):
                aside.update(group)
        return aside

    def group(self, name: str) -> list[str]:
        """The modules measured together with ``name``: itself and those it shares a parameter with."""
        return self._groups.get(name, [name])

    def pop(self, decide: bool = True) -> PerExampleStep:
        """The step's statistics; starts a new step. ``decide``: :meth:`decide` it (a sync where a lookup's
        ids were compared on the device); ``False`` leaves that to the caller, at a step that reads anyway."""
        step, self._step = self._step, PerExampleStep()
        self._reset_micro_batch()
        if decide:
            self.decide(step)
        return step
