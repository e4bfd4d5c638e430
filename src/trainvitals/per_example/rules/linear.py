"""Layers y_t = W a_t (+ b) at positions t, and nn.Linear.

g_i's weight block is Σ_t δ_{i,t} a_{i,t}ᵀ, where a_{i,t} is the layer input and δ_{i,t} = ∂L/∂y_{i,t}
the output gradient at position t of example i (T = 1 for a plain 2-D input). Its squared norm needs
no per-example gradient (Goodfellow 2015, "Efficient Per-Example Gradient Computations"; the sequence
case: Li et al. 2022, "ghost clipping"; Gray et al. 2023–2024 and CerebrasResearch/nanoGNS):

    ‖Σ_t δ_t a_tᵀ‖²_F = Σ_{t,s} (a_t·a_s)(δ_t·δ_s) = ⟨A Aᵀ, Δ Δᵀ⟩_F            (the "ghost norm")

which costs T²·(I + O) multiply-adds per example against T·I·O for materialising the I×O block; the
form with fewer is used per layer (:func:`~trainvitals.per_example.tensor_ops.gram_is_cheaper`; a
convolution counts the Gram matrices' at 1/1.2: :mod:`.conv`). On GPT-2's MLP over 1024 tokens (I 768,
O 3072) that is the blocks, the Gram matrices 1.6× slower; at 256 tokens the Gram matrices, 2.7× faster.
Over 100 Linear shapes (T 4–1024, I 16–768, O 16–3072, one CPU thread) the form chosen is on average 1.3 %
slower than the faster one, against 12.4 % for the smaller temporaries, 2T² ≤ I·O, chosen before
(``bench_per_example_rules.py --only linear-forms``). Memory does not decide: the examples go in chunks
whose largest temporary stays within ``_SCRATCH_BYTES`` in either form.

A layer used several times in a forward has the positions of all its uses: its per-example gradient is
the sum of theirs, one sum over the positions of all uses, so the ghost norm has the cross terms between
uses.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from trainvitals.per_example import tensor_ops
from trainvitals.per_example.registry import PerExampleRule, Use, register_per_example_rule
from trainvitals.per_example.tensor_ops import (
    Workspace,
    _accumulation_dtype,
    _bmm,
    _by_position,
    _moments,
    _outer_sq_norms,
    _outer_sums,
    _sq_norms,
    _trainable,
)


class OuterProductRule(PerExampleRule):
    """A layer y_t = W a_t (+ b): subclasses say what the positions t, activations a_t and output
    gradients δ_t are, and how a ``(O, I)`` block maps to the weight's shape."""

    def _gradients(self, module: nn.Module, use: Use) -> Tensor:
        """The output gradients ``(B, T, O)`` (a view where it can be)."""
        raise NotImplementedError

    def _activations(
        self, module: nn.Module, use: Use, start: int, stop: int, dtype: torch.dtype, workspace: Workspace | None
    ) -> Tensor:
        """The activations ``(b, T, I)`` of examples ``start:stop``, in ``dtype``."""
        raise NotImplementedError

    def _fan_in(self, module: nn.Module, use: Use) -> int:
        raise NotImplementedError

    def _copies_activations(self, module: nn.Module) -> bool:
        """Whether :meth:`_activations` forms a new tensor (patches), not a view of the input."""
        return False

    def _gram(self, positions: int, fan_in: int, fan_out: int) -> bool | None:
        """Whether :meth:`sq_norms` takes the weight's norms from the ghost Gram matrices, for one group's T
        positions, I input and O output features (``None``: where they cost fewer multiply-adds)."""
        return None

    def _as_weight(self, module: nn.Module, block: Tensor) -> Tensor:
        """A ``(*, O, I)`` block in the shape of ``module.weight``, or of its first O rows."""
        return block.reshape(*block.shape[:-2], -1, *module.weight.shape[1:])

    def _groups(self, module: nn.Module, a: Tensor, g: Tensor) -> list[tuple[Tensor, Tensor]]:
        """A grouped convolution's weight is one block per group, stacked along its first dimension: the
        group's slice of the activations' and of the gradients' features (channel-major)."""
        groups = getattr(module, "groups", 1)
        if groups == 1:
            return [(a, g)]
        return list(zip(a.chunk(groups, -1), g.chunk(groups, -1)))

    def _grouped_sums(
        self, module: nn.Module, a: Tensor, g: Tensor, workspace: Workspace | None
    ) -> tuple[Tensor, Tensor]:
        groups = self._groups(module, a, g)
        if len(groups) == 1:
            return _outer_sums(a, g, workspace)
        total, total_sq = zip(*(_outer_sums(a_j, g_j, workspace) for a_j, g_j in groups))
        return torch.cat(total), torch.cat(total_sq)

    def _chunks(
        self, module: nn.Module, uses: Sequence[Use], workspace: Workspace | None
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """Activations ``(b, T, I)`` and output gradients ``(b, T, O)`` of consecutive chunks of b
        examples, the positions of all ``uses`` side by side.

        A chunk's largest temporary — a convolution's patches (T·I per example), the per-example
        blocks (O·I) or a ghost Gram matrix (T²) — stays within ``_SCRATCH_BYTES`` (a ResNet's first
        stage at 224×224 has ~7 MB of patches per example, a 768→3072 Linear 9 MB blocks).
        """
        dtype = _accumulation_dtype(uses[0].grad_output)
        grads = [self._gradients(module, u) for u in uses]
        batch, fan_in = grads[0].shape[0], self._fan_in(module, uses[0])
        positions, fan_out = sum(g.shape[1] for g in grads), grads[0].shape[2]
        copied = self._copies_activations(module) or len(uses) > 1
        largest = (
            max(positions * fan_in if copied else 0, fan_out * fan_in, positions * positions) if positions > 1 else 1
        )
        chunk = max(1, tensor_ops._SCRATCH_BYTES // (largest * dtype.itemsize))
        # A single use takes the workspace's patch buffer; several are concatenated into a new tensor.
        space = workspace if len(uses) == 1 else None
        for start in range(0, max(batch, 1), chunk):  # an empty batch is one empty chunk
            stop = start + chunk
            a = [self._activations(module, u, start, stop, dtype, space) for u in uses]
            g = [(g if chunk >= batch else g[start:stop]).to(dtype) for g in grads]
            yield (a[0], g[0]) if len(uses) == 1 else (torch.cat(a, 1), torch.cat(g, 1))

    def _bias_grads(self, module: nn.Module, uses: Sequence[Use]) -> Tensor:
        """Per-example bias gradients ``(B, O)``: the output gradients summed over positions and uses."""
        dtype = _accumulation_dtype(uses[0].grad_output)
        return functools.reduce(torch.add, [self._gradients(module, u).to(dtype).sum(1) for u in uses])

    def sq_norms(self, module: nn.Module, uses: Sequence[Use], workspace: Workspace | None = None) -> Tensor:
        # A layer frozen after the sources were planned still gets its (zero) entry.
        trainable = _trainable(module)
        if "weight" in trainable:
            parts = [
                functools.reduce(
                    torch.add,
                    [
                        _outer_sq_norms(a_j, g_j, workspace, self._gram(a_j.shape[1], a_j.shape[2], g_j.shape[2]))
                        for a_j, g_j in self._groups(module, a, g)
                    ],
                )
                for a, g in self._chunks(module, uses, workspace)
            ]
            sq = parts[0] if len(parts) == 1 else torch.cat(parts)
        else:
            g = uses[0].grad_output
            sq = g.new_zeros(self._gradients(module, uses[0]).shape[0], dtype=_accumulation_dtype(g))
        return sq + self._bias_grads(module, uses).square().sum(1) if "bias" in trainable else sq

    def sums(
        self,
        module: nn.Module,
        uses: Sequence[Use],
        workspace: Workspace | None = None,
        rows: Mapping[str, slice] | None = None,
    ) -> dict[str, tuple[Tensor, Tensor]]:
        trainable, out = _trainable(module), {}
        rows = {n: slice(None) for n in trainable} if rows is None else rows
        if "weight" in trainable and "weight" in rows:
            r, total = rows["weight"], None
            ungrouped = getattr(module, "groups", 1) == 1  # the weight's rows are the output features: slice those
            for a, g in self._chunks(module, uses, workspace):  # a running sum: one chunk's sums held at a time
                part = (
                    _outer_sums(a, g[..., r], workspace) if ungrouped else self._grouped_sums(module, a, g, workspace)
                )
                total = part if total is None else (total[0].add_(part[0]), total[1].add_(part[1]))
            assert total is not None, "an empty batch is one empty chunk"
            out["weight"] = tuple(
                self._as_weight(module, t) if ungrouped else self._as_weight(module, t)[r].clone() for t in total
            )
        if "bias" in trainable and "bias" in rows:
            out["bias"] = _moments(self._bias_grads(module, uses)[:, rows["bias"]])
        return out  # type: ignore[return-value]

    def measure(
        self, module: nn.Module, uses: Sequence[Use], workspace: Workspace | None, rows: Mapping[str, slice]
    ) -> tuple[Tensor, dict[str, tuple[Tensor, Tensor]]]:
        """An ungrouped layer at several positions whose weight is summed: the norms from the per-example blocks
        the sums form, whichever form :meth:`sq_norms` would take (their squared norm reads them once)."""
        trainable = _trainable(module)
        positions = sum(self._gradients(module, u).shape[1] for u in uses)
        if (
            "weight" not in rows
            or "weight" not in trainable
            or getattr(module, "groups", 1) != 1
            or positions < 2
            or not self._norms_from_blocks()
        ):
            return super().measure(module, uses, workspace, rows)
        r, parts, total = rows["weight"], [], None
        for a, g in self._chunks(module, uses, workspace):
            blocks = _bmm(g.transpose(1, 2), a, workspace, "blocks")
            parts.append(_sq_norms(blocks))
            part = _moments(blocks[:, r])
            total = part if total is None else (total[0].add_(part[0]), total[1].add_(part[1]))
        assert total is not None, "an empty batch is one empty chunk"
        sq = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self._with_bias(
            module, uses, rows, sq, {"weight": (self._as_weight(module, total[0]), self._as_weight(module, total[1]))}
        )

    def _norms_from_blocks(self) -> bool:
        """Whether :meth:`measure` may take the weight's norms from the blocks (not where a form is forced)."""
        return True

    def _with_bias(
        self,
        module: nn.Module,
        uses: Sequence[Use],
        rows: Mapping[str, slice],
        sq: Tensor,
        sums: dict[str, tuple[Tensor, Tensor]],
    ) -> tuple[Tensor, dict[str, tuple[Tensor, Tensor]]]:
        """The weight's ``sq`` and ``sums`` with the bias's, from its per-example gradients formed once."""
        if "bias" in _trainable(module):
            bias = self._bias_grads(module, uses)
            sq = sq + bias.square().sum(1)
            if "bias" in rows:
                sums["bias"] = _moments(bias[:, rows["bias"]])
        return sq, sums

    def grads(self, module: nn.Module, uses: Sequence[Use]) -> dict[str, Tensor]:
        trainable, out = _trainable(module), {}
        if "weight" in trainable:
            out["weight"] = self._as_weight(
                module,
                torch.cat(
                    [
                        torch.cat(
                            [_bmm(g_j.transpose(1, 2), a_j, None, "blocks") for a_j, g_j in self._groups(module, a, g)],
                            1,
                        )
                        for a, g in self._chunks(module, uses, None)
                    ]
                ),
            )
        if "bias" in trainable:
            out["bias"] = self._bias_grads(module, uses)
        return out


@register_per_example_rule(nn.Linear)
class LinearRule(OuterProductRule):
    """nn.Linear on ``(B, *, I)``: the positions are the middle dimensions."""

    def feature_dims(self, module: nn.Module) -> int | None:
        return 1

    def _gradients(self, module: nn.Module, use: Use) -> Tensor:
        return _by_position(use.grad_output)

    def _activations(
        self, module: nn.Module, use: Use, start: int, stop: int, dtype: torch.dtype, workspace: Workspace | None
    ) -> Tensor:
        return _by_position(use.inputs[start:stop]).to(dtype)

    def _fan_in(self, module: nn.Module, use: Use) -> int:
        return use.inputs.shape[-1]

    def sq_norms(self, module: nn.Module, uses: Sequence[Use], workspace: Workspace | None = None) -> Tensor:
        if len(uses) > 1 or uses[0].inputs.dim() != 2:
            return super().sq_norms(module, uses, workspace)
        # The common case, in as few kernels as possible.
        weight, bias = module.weight.requires_grad, module.bias is not None and module.bias.requires_grad
        inputs, grad_output = uses[0]
        dtype = _accumulation_dtype(grad_output)
        g, a = grad_output.to(dtype), inputs.to(dtype)
        a_sq = torch.linalg.vecdot(a, a) if weight else 0.0
        return torch.linalg.vecdot(g, g) * (a_sq + (1.0 if bias else 0.0))
