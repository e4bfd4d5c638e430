"""nn.RNN, nn.LSTM and nn.GRU: each weight is an outer product over time steps.

For layer l and direction d, ``weight_ih`` gets Σ_t δgi_t x_tᵀ and ``weight_hh`` Σ_t δgh_t h_{t−1}ᵀ, where
gi = W_ih x_t + b_ih and gh = W_hh h_{t−1} + b_hh are the pre-activations the cell equations combine
(torch's documentation of each layer) and δ their gradients; the biases get Σ_t δ. The rule recomputes
the recurrence from the saved input and initial state with autograd, one time step at a time, for
those gradients (``torch.func.vmap`` does not batch the fused recurrent kernels), and measures each
weight by ghost norms.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainvitals.core.per_example._common import _accumulation_dtype
from trainvitals.core.per_example.factored import Factor, FactoredRule, Outer, _stack_uses
from trainvitals.core.per_example.registry import Call, Use, register_per_example_rule


def _cell(module: nn.Module, gi: Tensor, gh: Tensor, h: Tensor, c: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """One time step from the pre-activations: the new hidden state (and cell state, for an LSTM)."""
    if isinstance(module, nn.LSTM):
        i, f, g, o = (gi + gh).chunk(4, -1)
        c = f.sigmoid() * c + i.sigmoid() * g.tanh()
        return o.sigmoid() * c.tanh(), c
    if isinstance(module, nn.GRU):
        ir, iz, in_ = gi.chunk(3, -1)
        hr, hz, hn = gh.chunk(3, -1)
        r, z = (ir + hr).sigmoid(), (iz + hz).sigmoid()
        n = (in_ + r * hn).tanh()
        return (1 - z) * n + z * h, None
    pre = gi + gh
    return (pre.tanh() if module.nonlinearity == "tanh" else pre.relu()), None


@register_per_example_rule(nn.RNN, nn.LSTM, nn.GRU)
class RecurrentRule(FactoredRule):
    """nn.RNN (tanh or relu), nn.LSTM and nn.GRU: any number of layers, bidirectional, batch-first or
    not, with or without biases and an initial state, the output and final states used by the loss
    or not. Not: PackedSequence inputs, an LSTM's ``proj_size``, dropout between layers."""

    whole_call = True

    def unsupported(self, module: nn.Module) -> str | None:
        if getattr(module, "proj_size", 0):
            return "LSTM with proj_size"
        if module.dropout > 0 and module.num_layers > 1:
            return "dropout between recurrent layers (its random masks cannot be recomputed)"
        return None

    def batch_size(self, module: nn.Module, call: Call) -> int:
        x = call.args[0] if call.args else call.kwargs.get("input")
        if not isinstance(x, Tensor) or x.dim() != 3:
            return -1  # a PackedSequence, an unbatched sequence: not batch-first examples
        return x.shape[0 if module.batch_first else 1]

    def _factors(self, module: nn.Module, uses: Sequence[Use]) -> dict[str, Factor]:
        return _stack_uses([self._use_factors(module, use) for use in uses])

    @torch.no_grad()
    def _use_factors(self, module: nn.Module, use: Use) -> dict[str, Factor]:
        if module.training and module.dropout > 0 and module.num_layers > 1:
            raise RuntimeError("dropout between recurrent layers is random: the recomputation would not see its masks")
        args, kwargs = use.inputs
        grads = use.grad_output
        dtype = _accumulation_dtype(next(g for g in grads if g is not None))
        x = args[0].to(dtype)
        x = x if module.batch_first else x.transpose(0, 1)  # (B, T, I)
        batch, steps = x.shape[:2]
        directions, hidden = 2 if module.bidirectional else 1, module.hidden_size
        hx = args[1] if len(args) > 1 else kwargs.get("hx")
        lstm = isinstance(module, nn.LSTM)
        if hx is None:
            zeros = x.new_zeros(module.num_layers * directions, batch, hidden)
            h0, c0 = zeros, zeros if lstm else None
        else:
            h0, c0 = (hx[0].to(dtype), hx[1].to(dtype)) if lstm else (hx.to(dtype), None)
        pieces = []  # per layer and direction: (suffix, layer input, gi, previous hidden states, gh)
        finals_h, finals_c = [], []
        with torch.enable_grad():
            layer_input = x
            for layer in range(module.num_layers):
                outputs = []
                for direction in range(directions):
                    suffix = f"_l{layer}" + ("_reverse" if direction else "")
                    weight_ih, weight_hh = (getattr(module, f"weight_{k}{suffix}").to(dtype) for k in ("ih", "hh"))
                    bias_ih, bias_hh = ((getattr(module, f"bias_{k}{suffix}").to(dtype) if module.bias else None)
                                        for k in ("ih", "hh"))
                    gi = F.linear(layer_input, weight_ih, bias_ih)  # (B, T, G·H), all steps at once
                    state = layer * directions + direction
                    h, c = h0[state], c0[state] if lstm else None
                    order = range(steps - 1, -1, -1) if direction else range(steps)
                    hs: list[Tensor | None] = [None] * steps
                    previous, gh_steps = [], []
                    for t in order:
                        gh = F.linear(h, weight_hh, bias_hh)
                        previous.append(h)
                        gh_steps.append(gh)
                        h, c = _cell(module, gi[:, t], gh, h, c)
                        hs[t] = h
                    finals_h.append(h)
                    finals_c.append(c)
                    outputs.append(torch.stack(hs, 1))  # type: ignore[arg-type]
                    pieces.append((suffix, layer_input, gi, previous, gh_steps))
                layer_input = torch.cat(outputs, -1)
            results = [layer_input, torch.stack(finals_h)] + ([torch.stack(finals_c)] if lstm else [])
            seeds = [g.to(dtype) if g is not None else None for g in grads]
            if seeds[0] is not None and not module.batch_first:
                seeds[0] = seeds[0].transpose(0, 1)
            used = [(r, s) for r, s in zip(results, seeds) if s is not None]
            wrt = [t for _, _, gi, _, gh_steps in pieces for t in (gi, *gh_steps)]
            d_wrt = torch.autograd.grad([r for r, _ in used], wrt, [s for _, s in used],
                                        allow_unused=True, materialize_grads=True)
        out: dict[str, Factor] = {}
        trainable = self.parameters(module)
        position = 0
        for suffix, layer_input, _, previous, gh_steps in pieces:
            d_gi = d_wrt[position]
            d_gh = torch.stack(d_wrt[position + 1:position + 1 + len(gh_steps)], 1)  # (B, T, G·H), in `previous`' order
            position += 1 + len(gh_steps)
            factors: dict[str, Factor] = {
                f"weight_ih{suffix}": [Outer(layer_input.detach(), d_gi)],
                f"weight_hh{suffix}": [Outer(torch.stack(previous, 1).detach(), d_gh)],
                f"bias_ih{suffix}": d_gi.sum(1),
                f"bias_hh{suffix}": d_gh.sum(1),
            }
            out.update({n: f for n, f in factors.items() if n in trainable})
        return out
