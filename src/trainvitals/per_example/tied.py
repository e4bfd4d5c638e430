"""Modules that share a parameter: each example's gradient of it is the sum over its owners.

The common case, a token embedding tied to the output layer (GPT-2, T5), has an exact form that forms
no per-example V×D matrix. With E_i = Σ_s e_{tok_s} γ_sᵀ (the embedding's gradient: γ its output
gradient) and L_i = Σ_t δ_t h_tᵀ (the output layer's: δ its output gradient, h its input),

    ⟨E_i, L_i⟩ = Σ_s γ_s · L_i[tok_s],   L_i[tok_s] = Σ_t δ_t[tok_s] h_t,

a ``(B, S, T)`` gather and one batched matmul; Σ_i E_i ⊙ L_i, for the per-coordinate sums, is the same
rows scattered into the table. Other ties add the owners' per-example gradients, formed in full.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from trainvitals.per_example import tensor_ops
from trainvitals.per_example.registry import PerExampleRule, Use
from trainvitals.per_example.rules.embedding import EmbeddingRule
from trainvitals.per_example.rules.linear import LinearRule
from trainvitals.per_example.tensor_ops import Workspace, _accumulation_dtype, _by_position, _moments, _sq_norms

Sums = dict[str, tuple[Tensor, Tensor]]


def measure_tied(
    members: Mapping[str, tuple[nn.Module, PerExampleRule, Sequence[Use]]],
    names: Mapping[int, str],
    coordinates: bool,
    workspace: Workspace | None,
) -> tuple[Tensor, Sums]:
    """``(B,)`` ‖g_i‖² over the members' parameters, and their per-coordinate sums when ``coordinates``.

    Args:
        members: ``{module name: (module, its rule, its uses)}`` of the modules sharing parameters.
        names: a parameter's qualified name by ``id``: the one its sums are reported under.
    """
    pair = _embedding_and_output_layer(members)
    if pair is not None:
        return _embedding_and_linear(*pair, names, coordinates, workspace)
    grads: dict[str, Tensor] = {}
    for module, rule, uses in members.values():
        params = rule.parameters(module)
        for local, g in rule.grads(module, uses).items():
            qualified = names[id(params[local])]
            g = g.to(_accumulation_dtype(g))
            grads[qualified] = g if qualified not in grads else grads[qualified] + g
    sq = sum(_sq_norms(g) for g in grads.values())
    return sq, ({n: _moments(g) for n, g in grads.items()} if coordinates else {})  # type: ignore[return-value]


def _embedding_and_output_layer(members: Mapping[str, tuple[nn.Module, PerExampleRule, Sequence[Use]]]):
    if len(members) != 2:
        return None
    (emb, emb_rule, emb_uses), (lin, lin_rule, lin_uses) = sorted(
        members.values(), key=lambda m: not isinstance(m[1], EmbeddingRule)
    )
    if not (isinstance(emb_rule, EmbeddingRule) and isinstance(lin_rule, LinearRule)) or emb.weight is not lin.weight:
        return None
    return emb, emb_uses, lin, lin_uses


def _embedding_and_linear(
    emb: nn.Embedding,
    emb_uses: Sequence[Use],
    lin: nn.Linear,
    lin_uses: Sequence[Use],
    names: Mapping[int, str],
    coordinates: bool,
    workspace: Workspace | None,
) -> tuple[Tensor, Sums]:
    emb_rule, lin_rule = EmbeddingRule(), LinearRule()
    dtype = _accumulation_dtype(lin_uses[0].grad_output)
    batch = emb_uses[0].inputs.shape[0]
    tokens = torch.cat([u.inputs.reshape(batch, -1) for u in emb_uses], 1)  # (B, S)
    gamma = torch.cat([u.grad_output.to(dtype).reshape(batch, -1, emb.embedding_dim) for u in emb_uses], 1)
    if emb.padding_idx is not None:
        gamma = gamma * (tokens != emb.padding_idx).unsqueeze(-1)
    h = torch.cat([_by_position(u.inputs).to(dtype) for u in lin_uses], 1)  # (B, T, D)
    delta = torch.cat([_by_position(u.grad_output).to(dtype) for u in lin_uses], 1)  # (B, T, V)
    at_tokens = delta.gather(2, tokens.unsqueeze(1).expand(-1, delta.shape[1], -1))  # (B, T, S): δ_t[tok_s]
    rows = torch.bmm(at_tokens.transpose(1, 2), h)  # (B, S, D): L_i[tok_s]
    sq = (
        emb_rule.sq_norms(emb, emb_uses)
        + lin_rule.sq_norms(lin, lin_uses, workspace)
        + 2 * torch.linalg.vecdot(gamma.flatten(1), rows.flatten(1))
    )
    if not coordinates:
        return sq, {}
    emb_sums, lin_sums = emb_rule.sums(emb, emb_uses), lin_rule.sums(lin, lin_uses, workspace)
    (e_sum, e_sq), (l_sum, l_sq) = emb_sums["weight"], lin_sums["weight"]
    # Σ_i E_i ⊙ L_i, the products exact in float64 (as the members' sums), in chunks of rows.
    cross, at = e_sq.new_zeros(emb.weight.shape), tokens.reshape(-1)
    gamma, rows = gamma.flatten(0, 1), rows.flatten(0, 1)
    chunk = max(1, tensor_ops._SCRATCH_BYTES // (8 * emb.embedding_dim))
    for start in range(0, len(at), chunk):
        part = slice(start, start + chunk)
        cross.index_add_(0, at[part], gamma[part].double() * rows[part])
    sums = {names[id(emb.weight)]: (e_sum + l_sum, e_sq + l_sq + 2 * cross)}
    if "bias" in lin_sums:
        sums[names[id(lin.bias)]] = lin_sums["bias"]
    return sq, sums
