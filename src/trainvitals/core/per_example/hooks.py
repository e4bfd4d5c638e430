"""The hooks that gather per-example gradient statistics during backward, module by module.

Units: the hooks see the gradient of whatever loss was back-propagated (divided by the accumulation
steps, multiplied by an AMP scale, averaged over the batch or not); :class:`PerExampleGradients` takes
a per-micro-batch factor that converts them to the example's own loss.

Everything here stays on the device; nothing syncs with the host. No Lightning import.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from trainvitals.core.per_example._common import Workspace, _accumulation_dtype
from trainvitals.core.per_example.fallback import vmap_per_example_grads
from trainvitals.core.per_example.registry import per_example_sq_norms, per_example_sums


@dataclass
class PerExampleStep:
    """What :class:`PerExampleGradients` gathered over the micro-batches of one optimizer step, in the
    units of each example's own loss.

    Attributes:
        sq_norm_sum: ``()`` Σ_i ‖g_i‖² over the per-example-norm parameters, or ``None``.
        sq_norms: the ``(b,)`` ‖g_i‖² of each micro-batch, in order (only when kept).
        grad_sum: Σ_i g_i per per-example-norm parameter (qualified name), when requested.
        sum_sq: Σ_i g_i² per per-example-norm parameter, when requested (from the same operands).
        num_sub: examples of the ``vmap`` sub-batches.
        sub_sq_norm_sum: ``()`` Σ_i ‖g_i‖² over the ``vmap`` parameters and the sub-batch examples.
        sub_grad_sum: Σ_i g_i per ``vmap`` parameter over the sub-batch.
        sub_sum_sq: Σ_i g_i² per ``vmap`` parameter over the sub-batch.
        seen: modules whose output gradient arrived.
        failed: modules that could not be measured this step, with the reason.
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
    failed: dict[str, str] = field(default_factory=dict)


def _add(into: dict[str, Tensor], name: str, value: Tensor) -> None:
    into[name] = value if name not in into else into[name] + value


class PerExampleGradients:
    """Module hooks that gather per-example gradient statistics during backward.

    For each module of ``per_example``, a forward hook keeps a reference to the input (autograd saves
    it anyway) and puts a hook on the output tensor; when the output gradient arrives, the hook adds
    the per-example squared norms (and, if requested, the per-coordinate sums of squares) into running
    device tensors and lets the references go. Modules of ``vmap`` keep the first ``sub_batch``
    examples of their inputs and output gradients until :meth:`end_micro_batch`, which computes their
    per-example gradients with :func:`vmap_per_example_grads`.

    Use: :meth:`attach`, then per micro-batch forward + backward and :meth:`end_micro_batch` with the
    factor that converts the back-propagated gradient to the examples' own losses; :meth:`pop` at the
    optimizer step; :meth:`detach`. A module that runs more than once in a forward, or whose
    examples do not sit on dimension 0, is reported in :attr:`PerExampleStep.failed`.

    Args:
        per_example: ``{name: module}`` with :func:`unsupported_reason` ``None``.
        vmap: ``{name: module}`` for the ``torch.func`` fallback.
        sub_batch: examples per micro-batch for the fallback, ≥ 2.
    """

    def __init__(self, per_example: Mapping[str, nn.Module], vmap: Mapping[str, nn.Module], sub_batch: int) -> None:
        if sub_batch < 2:
            raise ValueError(f"`sub_batch` must be >= 2, got {sub_batch}")
        self.per_example, self.vmap, self.sub_batch = dict(per_example), dict(vmap), sub_batch
        self._handles: list[RemovableHandle] = []
        self._workspace = Workspace()  # the conv patches and blocks of every layer and step
        self._coordinates = False
        self._keep_norms = False
        self._replaying = False
        self._reset_micro_batch()
        self._step = PerExampleStep()

    def _reset_micro_batch(self) -> None:
        self._sq: Tensor | None = None
        self._grad_sum: dict[str, Tensor] = {}
        self._sum_sq: dict[str, Tensor] = {}
        self._pending: list[tuple[str, nn.Module, tuple[Any, ...], dict[str, Any], Tensor]] = []
        self._calls: Counter[str] = Counter()
        self._batch_size: int | None = None  # examples in this micro-batch: told, else the first layer's rows

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self, coordinates: bool = False, keep_norms: bool = False) -> None:
        """Install the hooks; ``coordinates``: also Σ_i g_i and Σ_i g_i²; ``keep_norms``: keep each ‖g_i‖²."""
        self.detach()
        self._coordinates, self._keep_norms = coordinates, keep_norms
        for name, module in self.per_example.items():
            self._handles.append(module.register_forward_hook(functools.partial(self._forward, name)))
        for name, module in self.vmap.items():
            hook = functools.partial(self._forward_vmap, name)
            self._handles.append(module.register_forward_hook(hook, with_kwargs=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def expect_batch(self, size: int) -> None:
        """The coming micro-batch holds ``size`` examples: a layer whose input has another first dimension
        (a position embedding called with ``arange(T)``, inputs flattened to ``(B·T, D)``) is reported in
        :attr:`PerExampleStep.failed`, not measured. Untold, the first measured layer's rows count."""
        self._batch_size = size

    def _check_call(self, name: str, output: Any, batch: int) -> bool:
        if self._replaying or not isinstance(output, Tensor) or not output.requires_grad:
            return False
        self._calls[name] += 1
        if self._calls[name] > 1:
            self._step.failed[name] = "runs more than once per forward"
            return False
        if self._batch_size is None:
            self._batch_size = batch
        if batch != self._batch_size:
            self._step.failed[name] = f"first dimension {batch} is not the batch ({self._batch_size})"
            return False
        return True

    def _forward(self, name: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not args or not isinstance(args[0], Tensor):
            self._step.failed[name] = "its input was not passed positionally (e.g. `layer(input=x)`)"
            return
        inputs = args[0]
        if self._check_call(name, output, inputs.shape[0] if inputs.dim() else -1):
            output.register_hook(functools.partial(self._backward, name, module, inputs))

    @torch.no_grad()  # a backward with create_graph=True runs hooks in grad mode; nothing here is differentiated
    def _backward(self, name: str, module: nn.Module, inputs: Tensor, grad_output: Tensor) -> None:
        if self._calls[name] > 1:
            return
        try:
            sq = per_example_sq_norms(module, inputs, grad_output, self._workspace)
            sums = per_example_sums(module, inputs, grad_output, self._workspace) if self._coordinates else {}
        except Exception as err:  # noqa: BLE001 - raised into the user's backward, it would end the run
            self._step.failed[name] = f"per-example norms failed: {type(err).__name__}: {err}"
            return
        self._sq = sq if self._sq is None else self._sq + sq
        for local, (total, total_sq) in sums.items():
            qualified = f"{name}.{local}" if name else local
            _add(self._grad_sum, qualified, total)
            _add(self._sum_sq, qualified, total_sq)
        self._step.seen.add(name)

    def _forward_vmap(self, name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                      output: Any) -> None:
        batch = next((a.shape[0] for a in args if isinstance(a, Tensor) and a.dim()), -1)
        if not self._check_call(name, output, batch):
            return
        sub = min(self.sub_batch, batch)
        kept = tuple(a[:sub] if isinstance(a, Tensor) and a.dim() and a.shape[0] == batch else a for a in args)
        output.register_hook(functools.partial(self._backward_vmap, name, module, kept, kwargs, sub))

    def _backward_vmap(self, name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                       sub: int, grad_output: Tensor) -> None:
        if self._calls[name] <= 1:
            self._pending.append((name, module, args, kwargs, grad_output[:sub]))

    def end_micro_batch(self, unit: Tensor | float) -> None:
        """Close a micro-batch: run the fallback, convert to own-loss units and add to the step.

        Args:
            unit: ``()`` tensor or float u with g_i = u × (the back-propagated per-example gradient),
                e.g. (accumulation steps × batch size for a mean loss) / AMP loss scale.
        """
        step = self._step
        unit_sq = unit * unit
        if self._sq is not None:
            sq = self._sq * unit_sq
            step.sq_norm_sum = sq.sum() if step.sq_norm_sum is None else step.sq_norm_sum + sq.sum()
            if self._keep_norms:
                step.sq_norms.append(sq)
        for name, value in self._grad_sum.items():
            _add(step.grad_sum, name, value * unit)
        for name, value in self._sum_sq.items():
            _add(step.sum_sq, name, value * unit_sq)
        self._run_vmap(unit)
        self._reset_micro_batch()

    def _run_vmap(self, unit: Tensor | float) -> None:
        step, sub = self._step, None
        self._replaying = True
        try:
            for name, module, args, kwargs, grad_output in self._pending:
                try:
                    grads = vmap_per_example_grads(module, args, kwargs, grad_output.detach())
                except Exception as err:  # noqa: BLE001 - any failure of torch.func means: not measurable
                    step.failed[name] = f"torch.func failed: {type(err).__name__}: {err}"
                    continue
                step.seen.add(name)
                sub = grad_output.shape[0]
                for local, g in grads.items():
                    g = g.to(_accumulation_dtype(g)) * unit
                    qualified = f"{name}.{local}" if name else local
                    sq = g.flatten(1).square().sum(1).sum()
                    step.sub_sq_norm_sum = sq if step.sub_sq_norm_sum is None else step.sub_sq_norm_sum + sq
                    _add(step.sub_grad_sum, qualified, g.sum(0))
                    _add(step.sub_sum_sq, qualified, g.square().sum(0))
        finally:
            self._replaying = False
        if sub is not None:
            step.num_sub += sub

    def pop(self) -> PerExampleStep:
        """The step's statistics; starts a new step."""
        step, self._step = self._step, PerExampleStep()
        self._reset_micro_batch()
        return step
