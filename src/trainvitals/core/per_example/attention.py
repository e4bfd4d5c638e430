"""nn.MultiheadAttention: its forward (F.multi_head_attention_forward) projects query, key and value with
blocks of ``in_proj_weight`` and the context with ``out_proj.weight`` without calling a Linear.

Each block is an outer product over positions, Σ_t δ_t a_tᵀ, measured by ghost norms: the q, k, v
blocks against the inputs, and ``out_proj`` against the context. The rule recomputes the attention
core (scores, masks, softmax, the weighted values) from the saved inputs with autograd to get the
gradients w.r.t. the projected q, k, v and the context; its own backward through the core costs about
one attention backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainvitals.core.per_example._common import _accumulation_dtype, _trainable
from trainvitals.core.per_example.factored import Factor, FactoredRule, Outer, _stack_uses
from trainvitals.core.per_example.registry import Call, Use, register_per_example_rule

_ARGUMENTS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights",
              "is_causal")


def _bind(call: Call) -> dict[str, Any]:
    bound = {"key_padding_mask": None, "need_weights": True, "attn_mask": None, "average_attn_weights": True}
    bound.update(zip(_ARGUMENTS, call.args))
    bound.update(call.kwargs)
    return bound


def _additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A boolean mask (True: not attended) as 0/−inf, a float mask as it is."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


@register_per_example_rule(nn.MultiheadAttention)
class MultiheadAttentionRule(FactoredRule):
    """nn.MultiheadAttention, batch-first or not, packed or separate q/k/v weights, with or without
    biases, masks, and attention weights returned (and used by the loss) or not."""

    whole_call = True

    def unsupported(self, module: nn.Module) -> str | None:
        if module.bias_k is not None or module.add_zero_attn:
            return "nn.MultiheadAttention with add_bias_kv or add_zero_attn"
        if module.dropout > 0:
            return "nn.MultiheadAttention with dropout > 0 (its random attention masks cannot be recomputed)"
        return None

    def parameters(self, module: nn.Module) -> dict[str, nn.Parameter]:
        return {**_trainable(module), **{f"out_proj.{n}": p for n, p in _trainable(module.out_proj).items()}}

    def batch_size(self, module: nn.Module, call: Call) -> int:
        query = _bind(call)["query"]
        return query.shape[0 if module.batch_first else 1] if query.dim() == 3 else -1

    def _factors(self, module: nn.Module, uses: Sequence[Use]) -> dict[str, Factor]:
        return _stack_uses([self._use_factors(module, use) for use in uses])

    @torch.no_grad()
    def _use_factors(self, module: nn.Module, use: Use) -> dict[str, Factor]:
        if module.training and module.dropout > 0:
            raise RuntimeError("attention dropout is random: the recomputation would not see its masks")
        bound, grads = _bind(use.inputs), use.grad_output
        dtype = _accumulation_dtype(next(g for g in grads if g is not None))
        xq, xk, xv = (bound[n].to(dtype) for n in ("query", "key", "value"))
        if not module.batch_first:
            xq, xk, xv = (x.transpose(0, 1) for x in (xq, xk, xv))
        batch, length, embed = xq.shape
        heads, head_dim = module.num_heads, module.head_dim
        if module._qkv_same_embed_dim:
            weights = module.in_proj_weight.to(dtype).chunk(3)
        else:
            weights = tuple(w.to(dtype) for w in (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight))
        biases = module.in_proj_bias.to(dtype).chunk(3) if module.in_proj_bias is not None else (None,) * 3
        q, k, v = (F.linear(x, w, b).view(batch, x.shape[1], heads, head_dim).transpose(1, 2).requires_grad_()
                   for x, w, b in zip((xq, xk, xv), weights, biases))
        out_weight = module.out_proj.weight.to(dtype)
        d_out = grads[0] if grads[0] is not None else xq.new_zeros(bound["query"].shape)
        d_out = d_out.to(dtype) if module.batch_first else d_out.to(dtype).transpose(0, 1)
        with torch.enable_grad():
            scores = (q * head_dim**-0.5) @ k.transpose(-2, -1)  # (B, H, L, S)
            mask = _additive(bound["attn_mask"], dtype)
            if mask is not None:
                scores = scores + (mask.view(batch, heads, *mask.shape[-2:]) if mask.dim() == 3 else mask)
            padding = _additive(bound["key_padding_mask"], dtype)
            if padding is not None:
                scores = scores + padding.view(batch, 1, 1, -1)
            probs = scores.softmax(-1)
            context = (probs @ v).transpose(1, 2).reshape(batch, length, embed)
            outputs, seeds = [context], [d_out @ out_weight]
            d_weights = grads[1] if len(grads) > 1 else None
            if d_weights is not None:
                outputs.append(probs.mean(1) if bound["average_attn_weights"] else probs)
                seeds.append(d_weights.to(dtype))
            dq, dk, dv = torch.autograd.grad(outputs, (q, k, v), seeds, allow_unused=True, materialize_grads=True)
        dq, dk, dv = (g.transpose(1, 2).reshape(batch, g.shape[2], embed) for g in (dq, dk, dv))
        trainable, out = self.parameters(module), {}
        blocks = [Outer(xq, dq), Outer(xk, dk), Outer(xv, dv)]
        if "in_proj_weight" in trainable:
            out["in_proj_weight"] = blocks
        for name, block in zip(("q_proj_weight", "k_proj_weight", "v_proj_weight"), blocks):
            if name in trainable:
                out[name] = [block]
        if "in_proj_bias" in trainable:
            out["in_proj_bias"] = torch.cat([dq.sum(1), dk.sum(1), dv.sum(1)], 1)
        if "out_proj.weight" in trainable:
            out["out_proj.weight"] = [Outer(context.detach(), d_out)]
        if "out_proj.bias" in trainable:
            out["out_proj.bias"] = d_out.sum(1)
        return out
