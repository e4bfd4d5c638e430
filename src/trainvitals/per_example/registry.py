"""The registry of per-example rules: which computation gives a layer type's per-example gradient
statistics in the same backward, looked up by the module's type (as Opacus' ``register_grad_sampler``).

A rule sees what the hooks captured of each call (a *use*) of its module in one forward: the input and
the gradient of the back-propagated loss w.r.t. the output, batch first. A module called several times
in a forward has several uses; its per-example gradient is the sum of theirs, so its squared norm
has cross terms, which the rules compute exactly.

Register a rule for a layer of your own with :func:`register_per_example_rule`: a function
``(module, inputs, grad_output) -> {parameter name: (B, *parameter shape)}`` giving one use's
per-example gradients is enough; a :class:`PerExampleRule` subclass can give the squared norms and
per-coordinate sums more cheaply than from per-example gradients, and, with a :class:`Capture`, measure
from tensors inside the module's forward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from torch import Tensor, nn

from trainvitals.per_example.tensor_ops import Workspace, _accumulation_dtype, _moments, _sq_norms, _trainable


class Call(NamedTuple):
    """A module call's positional and keyword arguments, for rules with ``whole_call``, and what its rule's
    :class:`Capture` kept from just before it (``state``: the random generator's, for recurrent dropout)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    state: Any = None


class Use(NamedTuple):
    """One call of a module in a forward, as its rule sees it.

    Attributes:
        inputs: the first positional argument, batch first; for a rule with ``whole_call``, the :class:`Call`;
            for one with a :meth:`PerExampleRule.capture`, its :attr:`Capture.inputs`.
        grad_output: the gradient of the back-propagated loss w.r.t. the output, batch first; for a rule
            with ``whole_call``, a tuple over the output's tensors (``None`` where the loss does not use one);
            for one with a capture, over its :attr:`Capture.tensors`.
    """

    inputs: Any
    grad_output: Any


class Capture:
    """What a rule keeps of one call of its module from inside the module's forward
    (:meth:`PerExampleRule.capture`): the hooks enter it in the module's forward pre-hook and leave it in
    its forward hook (also when the forward raises), on the thread that runs the forward.

    Attributes (read after it is left):
        inputs: the call's :attr:`Use.inputs` for the rule; ``None``: the :class:`Call`.
        tensors: tensors the forward computed whose gradients the rule needs, in place of the call's
            outputs: :attr:`Use.grad_output` is the tuple of their gradients (``None`` for one that does not
            require grad or that the loss does not reach). They arrive during backward, after the
            gradients of the module's outputs, when the last of them is computed. ``None``: the outputs'.
    """

    inputs: Any = None
    tensors: tuple[Tensor | None, ...] | None = None

    def __enter__(self) -> Capture:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class PerExampleRule:
    """How to get a layer type's per-example gradient statistics from its uses in one forward.

    Subclasses implement :meth:`grads`, and may override :meth:`sq_norms` and :meth:`sums` with forms that
    form no per-example gradient (ghost norms). :meth:`grads` and :meth:`sq_norms` return float32 (float64
    for float64 operands), :meth:`sums` float64 (:func:`~trainvitals.per_example.tensor_ops._moments`: the per-example values, formed
    in float32, summed and squared exactly), all in the units of the output gradients.

    Attributes:
        whole_call: the rule needs every argument and every output gradient of a call (attention,
            recurrent layers: tuple outputs), not the first input and the output's gradient.
        broadcast_batch: a call on indices shared by the batch's B > 1 examples (one row ``(1, *)`` of
            position ids, or ``arange(B)``) is a lookup whose output is broadcast against the examples:
            its gradient arrives summed over them, so the hooks measure it from the gradient of the add that
            broadcasts it (:mod:`.broadcast`), or report it as not measured.
    """

    whole_call = False
    broadcast_batch = False

    def unsupported(self, module: nn.Module) -> str | None:
        """Why this ``module`` (its configuration) has no exact rule; ``None`` if it has."""
        return None

    def parameters(self, module: nn.Module) -> dict[str, nn.Parameter]:
        """The trainable parameters the rule measures, by name relative to ``module`` (its own, by default;
        a rule may cover a child that its module's forward uses without calling it)."""
        return _trainable(module)

    def feature_dims(self, module: nn.Module) -> int | None:
        """For a layer that treats every position alike, the trailing dimensions of its input that are
        features (Linear: 1, Embedding: 0): a call on a sequence-first ``(T, B, *)`` input, B examples
        on dimension 1, is measured with the examples moved first. ``None``: dimension 0 only.

        With T = B the shape cannot tell: the dimension comes from evidence (:mod:`.layout`: the user's
        ``sequence_first``, a view of the batch, the layer's calls with T ≠ B, the model's ``batch_first``
        modules), else batch-first, said once."""
        return None

    def batch_size(self, module: nn.Module, call: Call) -> int:
        """The examples of a ``whole_call`` rule's call (the first tensor argument's first dimension)."""
        first = next((a for a in call.args if isinstance(a, Tensor)), None)
        return first.shape[0] if first is not None and first.dim() else -1

    def capture(self, module: nn.Module, call: Call) -> Capture | None:
        """For a ``whole_call`` rule that measures from tensors inside its module's forward (attention's
        projections, whose inputs and output gradients its outputs do not show): a :class:`Capture` of
        this ``call``; ``None`` (the default): the call's arguments and output gradients."""
        return None

    def grads(self, module: nn.Module, uses: Sequence[Use]) -> dict[str, Tensor]:
        """Per-example gradients ``{name: (B, *shape)}`` of :meth:`parameters`, summed over ``uses``."""
        raise NotImplementedError

    def sq_norms(self, module: nn.Module, uses: Sequence[Use], workspace: Workspace | None = None) -> Tensor:
        """``(B,)``: Σ over :meth:`parameters` of ‖g_i‖², g_i summed over ``uses``."""
        grads = self.grads(module, uses)
        if not grads:
            return _batch_zeros(uses)
        return sum(_sq_norms(g.to(_accumulation_dtype(g))) for g in grads.values())  # type: ignore[return-value]

    def measure(
        self, module: nn.Module, uses: Sequence[Use], workspace: Workspace | None, rows: Mapping[str, slice]
    ) -> tuple[Tensor, dict[str, tuple[Tensor, Tensor]]]:
        """:meth:`sq_norms` and, with ``rows``, :meth:`sums` of the same uses (a logging step's pair): a rule
        that forms per-example blocks for the sums may take the norms from them (one batched matmul, not two)."""
        return self.sq_norms(module, uses, workspace), self.sums(module, uses, workspace, rows) if rows else {}

    def sums(
        self,
        module: nn.Module,
        uses: Sequence[Use],
        workspace: Workspace | None = None,
        rows: Mapping[str, slice] | None = None,
    ) -> dict[str, tuple[Tensor, Tensor]]:
        """``{name: (Σ_i g_i, Σ_i g_i²)}``, elementwise, float64, each of the parameter's shape; with ``rows``, only
        the parameters it names, each only the rows ``rows[name]`` of its dimension 0 (a bounded share of
        a large layer; a rule that cannot compute fewer rows computes all and keeps those)."""
        out = {}
        for name, g in self.grads(module, uses).items():
            if rows is not None and name not in rows:
                continue
            out[name] = _moments(g if g.dim() == 1 else g[:, slice(None) if rows is None else rows[name]])  # 0-d: g
        return out


def _batch_zeros(uses: Sequence[Use]) -> Tensor:
    grad = next(g for g in _output_grads(uses[0]) if g is not None)
    return grad.new_zeros(grad.shape[0], dtype=_accumulation_dtype(grad))


def _output_grads(use: Use) -> tuple[Tensor | None, ...]:
    return use.grad_output if isinstance(use.grad_output, tuple) else (use.grad_output,)


GradsFunction = Callable[[nn.Module, Any, Any], dict[str, Tensor]]


class _FunctionRule(PerExampleRule):
    """A rule from a function giving one use's per-example gradients."""

    def __init__(self, function: GradsFunction, whole_call: bool) -> None:
        self.function, self.whole_call = function, whole_call

    def grads(self, module: nn.Module, uses: Sequence[Use]) -> dict[str, Tensor]:
        total: dict[str, Tensor] = {}
        for use in uses:
            for name, g in self.function(module, use.inputs, use.grad_output).items():
                total[name] = g if name not in total else total[name] + g
        if set(total) != set(self.parameters(module)):
            raise ValueError(
                f"the rule gives gradients of {sorted(total)}, but {type(module).__name__}'s trainable "
                f"parameters are {sorted(self.parameters(module))}"
            )
        return total


_RULES: dict[type[nn.Module], PerExampleRule] = {}


def register_per_example_rule(*module_types: type[nn.Module], whole_call: bool = False) -> Callable[[Any], Any]:
    """Register a rule for ``module_types``: a decorator for a :class:`PerExampleRule` subclass or
    instance, or for a function ``(module, inputs, grad_output) -> {name: (B, *shape)}``.

    The rule also serves subclasses of those types that keep their ``forward``. A later registration
    for a type replaces the earlier one.

    Example::

        @register_per_example_rule(Scale)
        def scale_grads(module, inputs, grad_output):  # y = x * s over (B, *, D)
            return {"scale": (inputs * grad_output).reshape(len(inputs), -1, inputs.shape[-1]).sum(1)}

    Args:
        module_types: ``nn.Module`` subclasses.
        whole_call: a function rule gets a :class:`Call` of every argument and a tuple of the output
            tensors' gradients instead of the first input and the output's gradient. A
            :class:`PerExampleRule` says it with its own ``whole_call`` attribute.

    Raises:
        TypeError: for a type that is not an ``nn.Module`` subclass, a rule of no accepted kind, or
            ``whole_call=True`` with a :class:`PerExampleRule` whose ``whole_call`` is False.
    """
    for t in module_types:
        if not (isinstance(t, type) and issubclass(t, nn.Module)):
            raise TypeError(f"`module_types` must be nn.Module subclasses, got {t!r}")

    def decorator(rule: Any) -> Any:
        if isinstance(rule, type) and issubclass(rule, PerExampleRule):
            instance = rule()
        elif isinstance(rule, PerExampleRule):
            instance = rule
        elif callable(rule):
            instance = _FunctionRule(rule, whole_call)
        else:
            raise TypeError(f"a per-example rule must be a PerExampleRule or a function, got {rule!r}")
        if whole_call and not instance.whole_call:  # a rule class says it itself; the argument is the function's
            raise TypeError(
                f"`whole_call`: {type(instance).__name__} is a PerExampleRule with whole_call = False; "
                "set `whole_call = True` on the class instead"
            )
        for t in module_types:
            _RULES[t] = instance
        return rule

    return decorator


def unregister_per_example_rule(*module_types: type[nn.Module]) -> None:
    """Remove the rules registered for ``module_types`` (a type without one is ignored): its layers then
    fall back to ``torch.func`` per-example gradients, or to a rule registered for a base type."""
    for t in module_types:
        _RULES.pop(t, None)


def registered_types() -> tuple[type[nn.Module], ...]:
    """The module types that have a registered rule, in registration order."""
    return tuple(_RULES)


_FORWARD_PATH = ("forward", "_conv_forward")  # the methods a built-in layer's forward computes through


def rule_for(module: nn.Module) -> PerExampleRule | None:
    """The rule registered for ``module``'s type, or for the nearest base type whose forward path
    (``forward``, a convolution's ``_conv_forward``) it keeps: a subclass overriding one computes something
    else (weight standardisation); ``None`` if there is none."""
    kind = type(module)
    for base in kind.__mro__:
        rule = _RULES.get(base)
        if rule is not None:
            keeps = all(getattr(kind, m) is getattr(base, m) for m in _FORWARD_PATH if hasattr(base, m))
            return rule if base is kind or keeps else None
    return None


def _reparametrised(module: nn.Module) -> str | None:
    """The torch.nn.utils reparametrisation a forward pre-hook of ``module`` applies (its parameters are then
    ``weight_g``/``weight_v`` or ``weight_orig``, the weight a function of them), else ``None``."""
    from torch.nn.utils.prune import BasePruningMethod
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    kinds = {WeightNorm: "weight_norm", SpectralNorm: "spectral_norm", BasePruningMethod: "pruning"}
    for hook in module._forward_pre_hooks.values():
        for kind, what in kinds.items():
            if isinstance(hook, kind):
                return what
    return None


def unsupported_reason(module: nn.Module) -> str | None:
    """Why ``module``'s parameters have no same-backward per-example rule here; ``None`` if they have."""
    rule = rule_for(module)
    if rule is None:
        return f"{type(module).__name__} has no per-example identity"
    reparametrisation = _reparametrised(module)
    if reparametrisation is not None:
        return (
            f"{type(module).__name__} reparametrised by torch.nn.utils' {reparametrisation} (a forward "
            "pre-hook): its rule differentiates the weight, not the parameters it is computed from"
        )
    return rule.unsupported(module)


def per_example_sq_norms(
    module: nn.Module, inputs: Tensor, grad_output: Tensor, workspace: Workspace | None = None
) -> Tensor:
    """Σ over ``module``'s measured trainable parameters of ‖g_i‖², per example, from one backward pass.

    Args:
        module: a layer for which :func:`unsupported_reason` is ``None``.
        inputs: its input, batch first: ``(B, *, I)`` (Linear), ``(B, C, *spatial)`` (Conv),
            ``(B, *)`` indices (Embedding), ``(B, *, *normalized_shape)`` (LayerNorm); a :class:`Call`
            for a rule with ``whole_call``.
        grad_output: the gradient of the back-propagated loss w.r.t. its output, batch first.
        workspace: buffers for the largest temporaries, kept between calls (none: fresh tensors).

    Returns:
        ``(B,)`` in float32 (float64 for float64 inputs), in the units of ``grad_output`` squared.
    """
    return _rule(module).sq_norms(module, [Use(inputs, grad_output)], workspace)


def per_example_sums(
    module: nn.Module,
    inputs: Tensor,
    grad_output: Tensor,
    workspace: Workspace | None = None,
    rows: Mapping[str, slice] | None = None,
) -> dict[str, tuple[Tensor, Tensor]]:
    """(Σ_i g_i, Σ_i g_i²), elementwise, for each of ``module``'s measured trainable parameters (each of
    the parameter's shape): the per-coordinate mean and variance of the per-example gradients.

    Both sums come from the same operands, in float32 or wider, and are float64: under bf16/fp16
    autocast the ``.grad`` that autograd computes is rounded differently, and its ḡ² against these Σg²,
    or float32 sums, would make the variance of high-SNR coordinates (a difference of two nearly equal
    terms) rounding noise.

    The arguments as in :func:`per_example_sq_norms`; ``rows`` as in :meth:`PerExampleRule.sums`.
    Linear with 2-D inputs: ΔᵀA and (Δ²)ᵀ(A²), no
    per-example tensor; Embedding: a segment sum; the other layers: their per-example gradients
    ``(B, *shape)``, formed (in chunks of examples for convolutions) and summed (BackPACK's
    BatchGrad / SumGradSquared).
    """
    return _rule(module).sums(module, [Use(inputs, grad_output)], workspace, rows)


def _rule(module: nn.Module) -> PerExampleRule:
    rule = rule_for(module)
    if rule is None:
        raise TypeError(f"no per-example rule is registered for {type(module).__name__}")
    return rule
