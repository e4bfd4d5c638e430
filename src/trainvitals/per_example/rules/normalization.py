"""Normalisation layers with an affine transform y = x̂ ⊙ w + b: the per-example gradients are as small
as one activation row, (g ⊙ x̂) and g summed over the positions the affine parameters are shared by."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from trainvitals.per_example.registry import PerExampleRule, Use, register_per_example_rule
from trainvitals.per_example.tensor_ops import _accumulation_dtype, _trainable


def _standardized(x: Tensor, dims: tuple[int, ...], eps: float) -> Tensor:
    """(x − mean) / sqrt(biased variance + eps) over ``dims``, each example on its own (the biased
    variance as a mean: ``Tensor.var`` warns on an empty batch)."""
    centred = x - x.mean(dims, keepdim=True)
    return centred * (centred.square().mean(dims, keepdim=True) + eps).rsqrt()


def _over_positions(module: nn.Module, t: Tensor) -> Tensor:
    """``(B, *, *normalized_shape)`` → ``(B, *normalized_shape)`` (LayerNorm, RMSNorm)."""
    shape = tuple(module.normalized_shape)
    return t.reshape(t.shape[0], math.prod(t.shape[1 : t.dim() - len(shape)]), *shape).sum(1)


def _per_channel(t: Tensor) -> Tensor:
    """``(B, C, *)`` → ``(B, C)``, summed over the positions (a ``(B, C)`` input has none)."""
    return t.flatten(2).sum(2) if t.dim() > 2 else t


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
    def feature_dims(self, module: nn.Module) -> int | None:
        return len(module.normalized_shape)

    def _normalized(self, module: nn.Module, x: Tensor) -> Tensor:
        return _standardized(x, tuple(range(-len(module.normalized_shape), 0)), module.eps)

    def _to_parameter(self, module: nn.Module, t: Tensor) -> Tensor:
        return _over_positions(module, t)


@register_per_example_rule(nn.GroupNorm)
class GroupNormRule(AffineNormRule):
    """nn.GroupNorm on ``(B, C, *)``: statistics per example and group of C/G channels."""

    def _normalized(self, module: nn.Module, x: Tensor) -> Tensor:
        grouped = x.reshape(x.shape[0], module.num_groups, -1)
        return _standardized(grouped, (2,), module.eps).reshape(x.shape)

    def _to_parameter(self, module: nn.Module, t: Tensor) -> Tensor:
        return _per_channel(t)


@register_per_example_rule(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
class InstanceNormRule(AffineNormRule):
    """nn.InstanceNorm1d/2d/3d with ``affine=True`` on batched ``(B, C, *)``: statistics per example and
    channel, or the running ones in eval mode with ``track_running_stats``."""

    def _normalized(self, module: nn.Module, x: Tensor) -> Tensor:
        if module.training or not module.track_running_stats:
            return _standardized(x, tuple(range(2, x.dim())), module.eps)
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return (x - module.running_mean.view(shape)) * (module.running_var.view(shape) + module.eps).rsqrt()

    def _to_parameter(self, module: nn.Module, t: Tensor) -> Tensor:
        return _per_channel(t)


@register_per_example_rule(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
class BatchNormRule(AffineNormRule):
    """BatchNorm in eval mode, normalising with its running statistics: each example on its own. In
    training mode its batch statistics couple the examples, and it has no per-example gradient."""

    def unsupported(self, module: nn.Module) -> str | None:
        if module.training or module.running_mean is None:
            return "BatchNorm couples the examples (batch statistics: training mode, or no running statistics)"
        return None

    def _normalized(self, module: nn.Module, x: Tensor) -> Tensor:
        if self.unsupported(module):  # put in training mode after the sources were planned
            raise RuntimeError("BatchNorm normalised with batch statistics, which couple the examples")
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return (x - module.running_mean.view(shape)) * (module.running_var.view(shape) + module.eps).rsqrt()

    def _to_parameter(self, module: nn.Module, t: Tensor) -> Tensor:
        return _per_channel(t)


@register_per_example_rule(nn.RMSNorm)
class RMSNormRule(AffineNormRule):
    """nn.RMSNorm: x̂ = x / sqrt(mean(x²) + eps) over ``normalized_shape`` (eps ``None``: the input
    dtype's machine epsilon, as torch does)."""

    def feature_dims(self, module: nn.Module) -> int | None:
        return len(module.normalized_shape)

    def _normalized(self, module: nn.Module, x: Tensor) -> Tensor:
        dims = tuple(range(-len(module.normalized_shape), 0))
        eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
        return x * (x.square().mean(dims, keepdim=True) + eps).rsqrt()

    def _to_parameter(self, module: nn.Module, t: Tensor) -> Tensor:
        return _over_positions(module, t)
