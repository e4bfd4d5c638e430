"""Rules for layers whose parameters are blocks of outer products: attention's projections and the
recurrent layers' input and hidden-state weights, each Σ_t δ_t a_tᵀ over positions t (time steps)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from trainvitals.per_example.registry import PerExampleRule, Use
from trainvitals.per_example.tensor_ops import (
    Workspace,
    _bmm,
    _moments,
    _outer_sq_norms,
    _outer_sums,
    _sq_norms,
)


class Outer(NamedTuple):
    """A block Σ_t g_t a_tᵀ of a parameter: activations ``a`` ``(B, T, I)``, gradients ``g`` ``(B, T, O)``."""

    a: Tensor
    g: Tensor


Factor = list[Outer] | Tensor  # blocks stacked along the parameter's first dimension, or (B, *shape)


class FactoredRule(PerExampleRule):
    """Subclasses give each parameter's per-example gradient as :class:`Outer` blocks stacked along its
    first dimension (ghost norms, no per-example matrix), or as a ``(B, *shape)`` tensor."""

    def _factors(self, module: nn.Module, uses: Sequence[Use]) -> dict[str, Factor]:
        raise NotImplementedError

    def sq_norms(self, module: nn.Module, uses: Sequence[Use], workspace: Workspace | None = None) -> Tensor:
        total = None
        for factor in self._factors(module, uses).values():
            parts = (
                [_outer_sq_norms(o.a, o.g, workspace) for o in factor]
                if isinstance(factor, list)
                else [_sq_norms(factor)]
            )
            for part in parts:
                total = part if total is None else total + part
        assert total is not None, "a factored rule measures at least one parameter"
        return total

    def sums(
        self,
        module: nn.Module,
        uses: Sequence[Use],
        workspace: Workspace | None = None,
        rows: Mapping[str, slice] | None = None,
    ) -> dict[str, tuple[Tensor, Tensor]]:
        params, out = self.parameters(module), {}
        for name, factor in self._factors(module, uses).items():
            if rows is not None and name not in rows:
                continue
            if isinstance(factor, list):
                total, total_sq = zip(*(_outer_sums(o.a, o.g, workspace) for o in factor))
                out[name] = (torch.cat(total).view(params[name].shape), torch.cat(total_sq).view(params[name].shape))
            else:
                out[name] = _moments(factor)
            if rows is not None:  # all rows computed, the selected ones kept
                out[name] = (out[name][0][rows[name]].clone(), out[name][1][rows[name]].clone())
        return out

    def grads(self, module: nn.Module, uses: Sequence[Use]) -> dict[str, Tensor]:
        params, out = self.parameters(module), {}
        for name, factor in self._factors(module, uses).items():
            if isinstance(factor, list):
                blocks = torch.cat([_bmm(o.g.transpose(1, 2), o.a, None, "blocks") for o in factor], 1)
                out[name] = blocks.view(blocks.shape[0], *params[name].shape)
            else:
                out[name] = factor
        return out


def _stack_uses(per_use: list[dict[str, Factor]]) -> dict[str, Factor]:
    """Factors of several uses of one module: blocks side by side along positions, tensors added."""
    out: dict[str, Factor] = {}
    for name in per_use[0]:
        first = per_use[0][name]
        if isinstance(first, list):
            out[name] = [
                Outer(
                    torch.cat([u[name][i].a for u in per_use], 1),  # type: ignore[index]
                    torch.cat([u[name][i].g for u in per_use], 1),
                )  # type: ignore[index]
                for i in range(len(first))
            ]
        else:
            out[name] = sum(u[name] for u in per_use)  # type: ignore[assignment]
    return out
