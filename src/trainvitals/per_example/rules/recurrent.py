"""nn.RNN, nn.LSTM and nn.GRU: each weight is an outer product over time steps.

For layer l and direction d, ``weight_ih`` gets Σ_t δgi_t x_tᵀ and ``weight_hh`` Σ_t δgh_t h_{t−1}ᵀ, where
gi = W_ih x_t + b_ih and gh = W_hh h_{t−1} + b_hh are the pre-activations the cell equations combine
(torch's documentation of each layer) and δ their gradients; the biases get Σ_t δ; an LSTM's
projection ``weight_hr`` Σ_t δh_t (o_t ⊙ tanh c_t)ᵀ. The rule recomputes
the recurrence from the saved input and initial state with autograd, one time step at a time, for
those gradients (``torch.func.vmap`` does not batch the fused recurrent kernels), and measures each
weight by ghost norms.

A PackedSequence is recomputed padded, batch-first, in the batch's own order (``unsorted_indices``): past
its end a sequence keeps its state, so the forward direction ends and the backward one starts at each
sequence's own last step, and the padding's steps get no gradient.

Dropout between layers (training, ``num_layers > 1``) is recomputed with the forward's own masks on CPU:
torch's CPU recurrence (aten's ``_rnn_impl``, and oneDNN's for float32 LSTMs) draws each of them as
``empty_like(layer_output).bernoulli_(1 - p)`` from the default generator, the layers' outputs time-major
``(T, B, D)``, one after another and nothing else in between. A forward pre-hook keeps the generator's
state (:meth:`RecurrentRule.capture`), and the rule draws the same masks again from a copy of it,
leaving the generator where it is. Should a torch version draw otherwise, the probe's check that the
per-example gradients add up to ``.grad`` fails the layer. cuDNN draws its masks from a state of its own:
not measured on CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from trainvitals.per_example.registry import Call, Capture, Use, register_per_example_rule
from trainvitals.per_example.rules.factored import Factor, FactoredRule, Outer, _stack_uses
from trainvitals.per_example.tensor_ops import _accumulation_dtype

#: Why a recurrent layer with dropout between its layers is not measured on a GPU.
CUDNN_DROPOUT = (
    "dropout between recurrent layers on CUDA: cuDNN draws its masks from a random state of its own, "
    "which the recomputation cannot draw again"
)


def _input(call: Call) -> Any:
    """The call's input sequences: a tensor or a PackedSequence."""
    return call.args[0] if call.args else call.kwargs.get("input")


def _steps(call: Call) -> Any:
    """The tensor of the call's input steps (a PackedSequence's ``data``)."""
    x = _input(call)
    return x.data if isinstance(x, PackedSequence) else x


class _Layout:
    """How a call's sequences lie: ``(B, T, *)``, ``(T, B, *)`` or packed (time-major, the examples sorted by
    length, ``batch_sizes`` of them at each step)."""

    def __init__(self, x: Tensor | PackedSequence, batch_first: bool) -> None:
        self.packed = x if isinstance(x, PackedSequence) else None
        self.batch_first = batch_first

    def batched(self, t: Tensor) -> Tensor:
        """A per-step tensor laid out as the input (a packed one: as its ``data``) as ``(B, T, *)``, in the
        order of the batch's examples, zeros past each sequence's end; no host sync."""
        if self.packed is None:
            return t if self.batch_first else t.transpose(0, 1)
        padded, _ = pad_packed_sequence(PackedSequence(t, self.packed.batch_sizes), batch_first=True)
        order = self.packed.unsorted_indices  # pad_packed_sequence would move it to the host to reorder lengths
        return padded if order is None else padded.index_select(0, order)

    def drawn(self, mask: Tensor) -> Tensor:
        """A dropout mask as ``at::dropout`` drew it for a layer's output (time-major, or packed) as ``(B, T, D)``."""
        return mask.transpose(0, 1) if self.packed is None else self.batched(mask)


def _drops_out(module: nn.Module) -> bool:
    """Whether a call of ``module`` now applies dropout to the outputs of all but its last layer."""
    return module.training and module.dropout > 0 and module.num_layers > 1


class _GeneratorState(Capture):
    """The call, with the default generator's state as it entered the forward."""

    def __init__(self, call: Call) -> None:
        self._call = call

    def __enter__(self) -> Capture:
        self.inputs = self._call._replace(state=torch.get_rng_state())
        return self


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
    or not, PackedSequence inputs (sorted or not), an LSTM's ``proj_size``, dropout between layers on
    CPU (not on CUDA: :data:`CUDNN_DROPOUT`)."""

    whole_call = True

    def capture(self, module: nn.Module, call: Call) -> Capture | None:
        """The CPU generator's state before the call, which its dropout masks between layers are drawn from."""
        x = _steps(call)
        if not _drops_out(module) or not isinstance(x, Tensor) or x.device.type != "cpu":
            return None
        return _GeneratorState(call)

    def batch_size(self, module: nn.Module, call: Call) -> int:
        x = _input(call)
        if isinstance(x, PackedSequence):
            return int(x.batch_sizes[0])  # the longest sequences' step has them all; batch_sizes lives on the CPU
        if not isinstance(x, Tensor) or x.dim() != 3:
            return -1  # an unbatched sequence
        return x.shape[0 if module.batch_first else 1]

    def _factors(self, module: nn.Module, uses: Sequence[Use]) -> dict[str, Factor]:
        return _stack_uses([self._use_factors(module, use) for use in uses])

    @staticmethod
    def _masks(module: nn.Module, call: Call, shape: tuple[int, ...], dtype: torch.dtype) -> list[Tensor]:
        """The forward's dropout masks of the outputs of all but the last layer, each ``shape`` (time-major,
        as drawn) in the forward's ``dtype``, scaled by 1 / (1 − p) as ``at::dropout`` scales them."""
        if call.state is None:
            x = _steps(call)
            raise RuntimeError(
                CUDNN_DROPOUT
                if isinstance(x, Tensor) and x.is_cuda
                else "dropout between recurrent layers: the random generator's state before the forward "
                "was not kept, so its masks cannot be drawn again"
            )
        keep = 1 - module.dropout
        if keep == 0:  # at::dropout draws nothing at p = 1
            return [torch.zeros(shape, dtype=dtype) for _ in range(module.num_layers - 1)]
        generator = torch.Generator()
        generator.set_state(call.state)
        return [
            torch.empty(shape, dtype=dtype).bernoulli_(keep, generator=generator).div_(keep)
            for _ in range(module.num_layers - 1)
        ]

    @torch.no_grad()
    def _use_factors(self, module: nn.Module, use: Use) -> dict[str, Factor]:
        call: Call = use.inputs
        lstm = isinstance(module, nn.LSTM)
        grads = use.grad_output  # the output's (a PackedSequence's: its data's), then the final states'
        grad_output, grad_finals = grads[0], grads[-2:] if lstm else grads[-1:]
        first = next(g for g in grads if g is not None)
        dtype = _accumulation_dtype(first)
        layout = _Layout(_input(call), module.batch_first)
        data = _steps(call).to(dtype)
        x = layout.batched(data)  # (B, T, I)
        batch, steps = x.shape[:2]
        valid = layout.batched(data.new_ones(data.shape[0])) > 0 if layout.packed is not None else None  # (B, T)
        directions, hidden = 2 if module.bidirectional else 1, module.hidden_size
        projected = getattr(module, "proj_size", 0)  # an LSTM's h_t = W_hr (o_t ⊙ tanh c_t), of that size
        state_size = projected or hidden
        masks = []
        if _drops_out(module):
            shape = data.shape[:1] if layout.packed is not None else (steps, batch)
            drawn = self._masks(module, call, (*shape, directions * state_size), first.dtype)
            masks = [layout.drawn(m.to(dtype)) for m in drawn]
        args, kwargs = call.args, call.kwargs
        hx = args[1] if len(args) > 1 else kwargs.get("hx")
        if hx is None:
            h0 = x.new_zeros(module.num_layers * directions, batch, state_size)
            c0 = x.new_zeros(module.num_layers * directions, batch, hidden) if lstm else None
        else:
            h0, c0 = (hx[0].to(dtype), hx[1].to(dtype)) if lstm else (hx.to(dtype), None)
        pieces = []  # per layer and direction: suffix, layer input, gi, previous hidden states, gh, cells, projections
        finals_h, finals_c = [], []
        with torch.enable_grad():
            layer_input = x
            for layer in range(module.num_layers):
                outputs = []
                for direction in range(directions):
                    suffix = f"_l{layer}" + ("_reverse" if direction else "")
                    weight_ih, weight_hh = (getattr(module, f"weight_{k}{suffix}").to(dtype) for k in ("ih", "hh"))
                    bias_ih, bias_hh = (
                        (getattr(module, f"bias_{k}{suffix}").to(dtype) if module.bias else None) for k in ("ih", "hh")
                    )
                    gi = F.linear(layer_input, weight_ih, bias_ih)  # (B, T, G·H), all steps at once
                    state = layer * directions + direction
                    h, c = h0[state], c0[state] if lstm else None
                    order = range(steps - 1, -1, -1) if direction else range(steps)
                    hs: list[Tensor | None] = [None] * steps
                    previous, gh_steps, cells, projections = [], [], [], []
                    weight_hr = getattr(module, f"weight_hr{suffix}").to(dtype) if projected else None
                    for t in order:
                        gh = F.linear(h, weight_hh, bias_hh)
                        previous.append(h)
                        gh_steps.append(gh)
                        new_h, new_c = _cell(module, gi[:, t], gh, h, c)
                        if weight_hr is not None:
                            cells.append(new_h)
                            new_h = F.linear(new_h, weight_hr)
                            projections.append(new_h)
                        if valid is not None:  # past its end a sequence keeps its state: its last, or the initial one
                            inside = valid[:, t, None]
                            new_h = torch.where(inside, new_h, h)
                            new_c = torch.where(inside, new_c, c) if lstm else None
                        h, c = new_h, new_c
                        hs[t] = h
                    finals_h.append(h)
                    finals_c.append(c)
                    outputs.append(torch.stack(hs, 1))  # type: ignore[arg-type]
                    pieces.append((suffix, layer_input, gi, previous, gh_steps, cells, projections))
                layer_input = torch.cat(outputs, -1)
                if layer < len(masks):
                    layer_input = layer_input * masks[layer]
            results = [layer_input, torch.stack(finals_h)] + ([torch.stack(finals_c)] if lstm else [])
            seeds = [layout.batched(grad_output) if grad_output is not None else None]
            seeds += [g.to(dtype) if g is not None else None for g in grad_finals]
            used = [(r, s.to(dtype)) for r, s in zip(results, seeds) if s is not None]
            wrt = [t for _, _, gi, _, gh_steps, _, projections in pieces for t in (gi, *gh_steps, *projections)]
            d_wrt = torch.autograd.grad(
                [r for r, _ in used], wrt, [s for _, s in used], allow_unused=True, materialize_grads=True
            )
        out: dict[str, Factor] = {}
        trainable = self.parameters(module)
        position = 0
        for suffix, layer_input, _, previous, gh_steps, cells, projections in pieces:
            d_gi = d_wrt[position]
            steps_at = position + 1  # the per-step gradients, each list in `previous`' order
            d_gh = torch.stack(d_wrt[steps_at : steps_at + len(gh_steps)], 1)  # (B, T, G·H)
            position = steps_at + len(gh_steps) + len(projections)
            factors: dict[str, Factor] = {
                f"weight_ih{suffix}": [Outer(layer_input.detach(), d_gi)],
                f"weight_hh{suffix}": [Outer(torch.stack(previous, 1).detach(), d_gh)],
                f"bias_ih{suffix}": d_gi.sum(1),
                f"bias_hh{suffix}": d_gh.sum(1),
            }
            if projections:
                d_projections = torch.stack(d_wrt[steps_at + len(gh_steps) : position], 1)  # (B, T, P)
                factors[f"weight_hr{suffix}"] = [Outer(torch.stack(cells, 1).detach(), d_projections)]
            out.update({n: f for n, f in factors.items() if n in trainable})
        return out
