"""Normalisation layers with an affine transform y = x̂ ⊙ w + b: the per-example gradients are as small
as one activation row, (g ⊙ x̂) and g summed over the positions the affine parameters are shared by."""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import Tensor, nn

from trainvitals.core.per_example._common import _accumulation_dtype, _trainable
from trainvitals.core.per_example.registry import PerExampleRule, Use, register_per_example_rule


class AffineNormRule(PerExampleRule):
    """y = x̂ ⊙ w + b: subclasses give x̂ and how to sum ``(B, *)`` to the parameters' shape."""

    def _normalized(self, module: nn.Module, x: Tensor) -> Tensor:
        raise NotImplementedError

    def _to_parameter(self, module: nn.Module, t: Tensor) -> Tensor:
        """``(B, *)`` → ``(B, *parameter shape)``, summing over the dimensions the parameters are shared by."""
        raise NotImplementedError

    def grads(self, module: nn.Module, uses: Sequence[Use]) -> dict[str, Tensor]:
        trainable, out = _trainable(module), {}
        for inputs, grad_output in uses:
            dtype = _accumulation_dtype(grad_output)
            g = grad_output.to(dtype)
            parts = {}
            if "weight" in trainable:
                parts["weight"] = self._to_parameter(module, g * self._normalized(module, inputs.to(dtype)))
            if "bias" in trainable:
                parts["bias"] = self._to_parameter(module, g)
            for name, value in parts.items():
                out[name] = value if name not in out else out[name] + value
        return out


@register_per_example_rule(nn.LayerNorm)
class LayerNormRule(AffineNormRule):
    def _normalized(self, module: nn.Module, x: Tensor) -> Tensor:
        dims = tuple(range(-len(module.normalized_shape), 0))
        centred = x - x.mean(dims, keepdim=True)
        # LayerNorm's biased variance, as a mean: ``Tensor.var`` warns on an empty batch.
        return centred * (centred.square().mean(dims, keepdim=True) + module.eps).rsqrt()

    def _to_parameter(self, module: nn.Module, t: Tensor) -> Tensor:
        shape = tuple(module.normalized_shape)
        return t.reshape(t.shape[0], math.prod(t.shape[1:t.dim() - len(shape)]), *shape).sum(1)
