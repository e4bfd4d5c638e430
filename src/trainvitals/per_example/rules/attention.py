"""nn.MultiheadAttention: its forward (F.multi_head_attention_forward) projects query, key and value with
blocks of ``in_proj_weight`` (or ``q/k/v_proj_weight``) and the context with ``out_proj.weight``, each an
``F.linear`` of its own, without calling a Linear.

Each block's per-example gradient is an outer product over positions, Σ_t δ_t a_tᵀ, measured by ghost
norms. The rule captures what the forward computed (:class:`_Projections`): each projection's input a
and, in backward, the gradient δ of its output, whatever came between (attention dropout's masks,
masks, the softmax), so no part of the attention is recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from trainvitals.per_example.registry import Call, Capture, Use, register_per_example_rule
from trainvitals.per_example.rules.factored import Factor, FactoredRule, Outer, _stack_uses
from trainvitals.per_example.tensor_ops import _accumulation_dtype, _trainable

_redispatch = getattr(torch.overrides, "redispatch_function", None)
_WEIGHTS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "out_proj.weight")
_BIASES = ("in_proj_bias", "out_proj.bias")


class _Projection(NamedTuple):
    """One ``F.linear`` of the forward: the parameters it used (a weight's rows from ``start``, a bias's
    entries from ``bias_start``), its input ``a`` as ``(T, B, I)`` (the forward's are sequence-first, the
    context flattened to ``(T·B, I)``), and its output features."""

    weight: str
    start: int
    bias: str | None
    bias_start: int
    a: Tensor
    features: int


def _rows(t: Tensor | None, params: dict[int, str]) -> tuple[str, int] | None:
    """Which parameter ``t`` is, or the rows of one it is a view of (``chunk``/``split`` along dimension 0),
    with the first row; ``None`` for any other tensor."""
    if t is None:
        return None
    if id(t) in params:
        return params[id(t)], 0
    base = t._base
    if base is None or id(base) not in params or t.stride() != base.stride() or t.shape[1:] != base.shape[1:]:
        return None
    row, within = divmod(t.storage_offset() - base.storage_offset(), base.stride(0))
    return (params[id(base)], row) if within == 0 else None


class _Projections(TorchFunctionMode, Capture):
    """From the forward pre-hook to the forward hook of one call: every ``F.linear`` whose weight is one of
    the layer's projection weights (or a block of rows of one) is kept as a :class:`_Projection`
    (:attr:`inputs`) with its output (:attr:`tensors`), whose gradient the rule reads in backward.

    F.multi_head_attention_forward is a Python function that a torch-function mode receives whole, with
    the mode popped while it runs; the mode runs it again with itself pushed (``redispatch_function``
    skips the dispatch that would come back here), so that the linears inside it are seen."""

    def __init__(self, module: nn.MultiheadAttention, batch: int) -> None:
        super().__init__()
        named = {
            **dict(module.named_parameters(recurse=False)),
            "out_proj.weight": module.out_proj.weight,
            "out_proj.bias": module.out_proj.bias,
        }
        self._weights = {id(p): n for n in _WEIGHTS if (p := named.get(n)) is not None}
        self._biases = {id(p): n for n in _BIASES if (p := named.get(n)) is not None}
        self._batch = batch
        self.inputs: list[_Projection] = []
        self.tensors: tuple[Tensor | None, ...] = ()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.multi_head_attention_forward:
            with self:
                return _redispatch(func, types, args, kwargs)
        out = func(*args, **kwargs)
        if func is F.linear:
            weight = kwargs.get("weight", args[1] if len(args) > 1 else None)
            bias = kwargs.get("bias", args[2] if len(args) > 2 else None)
            rows = _rows(weight, self._weights)
            if rows is not None:
                bias_rows = _rows(bias, self._biases) or (None, 0)
                a = kwargs.get("input", args[0] if args else None)
                self.inputs.append(
                    _Projection(*rows, *bias_rows, a.reshape(-1, self._batch, a.shape[-1]), out.shape[-1])
                )
                self.tensors = (*self.tensors, out)
        return out


@register_per_example_rule(nn.MultiheadAttention)
class MultiheadAttentionRule(FactoredRule):
    """nn.MultiheadAttention, batch-first or not, packed or separate q/k/v weights, with or without
    biases, masks, attention dropout (in training mode), ``add_zero_attn``, and attention weights
    returned (and used by the loss) or not."""

    whole_call = True

    def unsupported(self, module: nn.Module) -> str | None:
        if module.bias_k is not None:
            return "nn.MultiheadAttention with add_bias_kv"
        if _redispatch is None:
            return (
                "this torch has no torch.overrides.redispatch_function, which the rule needs to see the "
                "projections inside F.multi_head_attention_forward"
            )
        return None

    def parameters(self, module: nn.Module) -> dict[str, nn.Parameter]:
        return {**_trainable(module), **{f"out_proj.{n}": p for n, p in _trainable(module.out_proj).items()}}

    def batch_size(self, module: nn.Module, call: Call) -> int:
        query = call.kwargs.get("query", call.args[0] if call.args else None)
        return query.shape[0 if module.batch_first else 1] if isinstance(query, Tensor) and query.dim() == 3 else -1

    def capture(self, module: nn.Module, call: Call) -> Capture | None:
        batch = self.batch_size(module, call)
        return _Projections(module, batch) if batch > 0 else None

    def _factors(self, module: nn.Module, uses: Sequence[Use]) -> dict[str, Factor]:
        return _stack_uses(_common_blocks([self._use_factors(module, use) for use in uses]))

    @torch.no_grad()
    def _use_factors(self, module: nn.Module, use: Use) -> dict[str, Factor]:
        """The blocks of one call: ``{weight: [(first row, Outer)]}`` in row order, ``{bias: (B, n)}``."""
        projections, grads = use.inputs, use.grad_output
        dtype = _accumulation_dtype(next(g for g in grads if g is not None))
        trainable, blocks, biases = self.parameters(module), {}, {}
        for p, g in zip(projections, grads):
            a = p.a.transpose(0, 1).to(dtype)  # (B, T, I)
            g = (
                a.new_zeros(*a.shape[:2], p.features)
                if g is None
                else g.reshape(-1, a.shape[0], p.features).transpose(0, 1).to(dtype)
            )
            if p.weight in trainable:
                blocks.setdefault(p.weight, []).append((p.start, Outer(a, g)))
            if p.bias in trainable:
                biases.setdefault(p.bias, []).append((p.bias_start, g.sum(1)))
        out: dict[str, Any] = {name: sorted(b, key=lambda s: s[0]) for name, b in blocks.items()}
        out.update({name: torch.cat([v for _, v in sorted(b, key=lambda s: s[0])], 1) for name, b in biases.items()})
        missing = set(trainable) - set(out)
        if missing:
            raise RuntimeError(f"the forward used {sorted(missing)} outside the F.linear calls the rule sees")
        return out


def _common_blocks(per_use: list[dict[str, Any]]) -> list[dict[str, Factor]]:
    """The uses' blocks of each weight split at the same rows (self-attention projects q, k, v with one
    ``F.linear``, cross-attention with two or three), as :func:`_stack_uses` sets them side by side."""
    for name in [n for n, v in per_use[0].items() if isinstance(v, list)]:
        starts = sorted({s for use in per_use for s, _ in use[name]})
        for use in per_use:
            split = []
            for s, block in use[name]:
                cuts = [c for c in starts if s <= c < s + block.g.shape[-1]] + [s + block.g.shape[-1]]
                split += [Outer(block.a, block.g[..., lo - s : hi - s]) for lo, hi in zip(cuts, cuts[1:])]
            use[name] = split
    return per_use
