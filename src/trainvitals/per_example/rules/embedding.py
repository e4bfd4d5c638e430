"""nn.Embedding: the per-example gradient is a segment sum of output-gradient rows over repeated tokens."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from trainvitals.per_example.registry import PerExampleRule, Use, register_per_example_rule
from trainvitals.per_example.tensor_ops import Workspace, _accumulation_dtype, _moments

#: Why a lookup shared by the batch's examples is not measured.
SHARED_LOOKUP = (
    "a lookup shared by the batch's examples (position ids (1, T) or arange(T), relative-position "
    "buckets (T, T)): its output is broadcast against the examples, so its gradient arrives summed "
    "over them"
)


#: Why a lookup with 1-D ids of another length than the batch is not measured (a position table, most often).
POSITION_IDS = (
    "it is looked up with {ids} ids for a batch of {batch}, not one per example: a position table "
    "looked up with arange(T) is shared by all examples in the batch, so its gradient arrives summed "
    "over them"
)


def _shared_by_batch(indices: Tensor, batch: int | None) -> bool | Tensor:
    """Whether a lookup's indices are shared by the ``batch`` examples rather than theirs: one row ``(1, *)``,
    or ``arange(batch)`` (nanoGPT's ``wpe(torch.arange(T))`` with T = B). A 1-D call of B integer indices
    (nanoGPT's with T = B, or a recommender's per-example ids) is compared on the device: the answer is a
    ``()`` bool tensor, read when the step is decided.

    Such a lookup is measured from the gradient of the add that broadcasts its output against the examples
    (:mod:`trainvitals.per_example.broadcast`); a diagnostic never changes the model's outputs."""
    if batch in (None, 1) or indices.is_floating_point():
        return False
    if indices.dim() >= 2:
        return indices.shape[0] == 1
    if indices.dim() != 1 or indices.shape[0] != batch:
        return False
    return (indices == torch.arange(batch, device=indices.device)).all()


def _embedding_rows(module: nn.Embedding, uses: Sequence[Use]) -> tuple[Tensor, Tensor, Tensor]:
    """Rows of the per-example Embedding gradients, repeated tokens (in any of the uses) summed, without a
    host sync.

    Returns ``(rows, example, token)``: ``rows`` ``(N, D)`` with N = B·T (T: the positions of all uses;
    rows beyond the distinct (example, token) pairs are zero), and the example and token index of each
    row, ``(N,)``.
    """
    batch, vocab = uses[0].inputs.shape[0], module.num_embeddings
    idx = torch.cat([u.inputs.reshape(batch, math.prod(u.inputs.shape[1:])) for u in uses], 1)
    dtype = _accumulation_dtype(uses[0].grad_output)
    g = torch.cat(
        [u.grad_output.to(dtype).reshape(batch, math.prod(u.inputs.shape[1:]), module.embedding_dim) for u in uses], 1
    ).reshape(idx.numel(), module.embedding_dim)
    if module.padding_idx is not None:
        g = g * (idx.reshape(-1, 1) != module.padding_idx)
    key = (torch.arange(batch, device=idx.device).unsqueeze(1) * vocab + idx).reshape(-1)
    sorted_key, order = key.sort()
    first = torch.ones_like(sorted_key, dtype=torch.bool)
    first[1:] = sorted_key[1:] != sorted_key[:-1]
    segment = first.long().cumsum(0) - 1
    rows = g.new_zeros(g.shape).index_add_(0, segment, g[order])
    segment_key = torch.zeros_like(sorted_key).scatter_(0, segment, sorted_key)
    return rows, segment_key // vocab, segment_key % vocab


@register_per_example_rule(nn.Embedding)
class EmbeddingRule(PerExampleRule):
    """nn.Embedding (dense, without ``scale_grad_by_freq``, which couples the examples); a position table
    looked up with ids shared by the batch (``(1, T)``, ``arange(T)``) is measured on those ids expanded to the
    batch, with the gradient of the add that broadcasts it (:mod:`trainvitals.per_example.broadcast`)."""

    broadcast_batch = True

    def feature_dims(self, module: nn.Module) -> int | None:
        return 0

    def unsupported(self, module: nn.Module) -> str | None:
        if module.scale_grad_by_freq:
            return "Embedding with scale_grad_by_freq couples the examples"
        return "sparse Embedding" if module.sparse else None

    def sq_norms(self, module: nn.Module, uses: Sequence[Use], workspace: Workspace | None = None) -> Tensor:
        rows, example, _ = _embedding_rows(module, uses)
        return rows.new_zeros(uses[0].inputs.shape[0]).index_add_(0, example, rows.square().sum(1))

    def sums(
        self,
        module: nn.Module,
        uses: Sequence[Use],
        workspace: Workspace | None = None,
        rows: Mapping[str, slice] | None = None,
    ) -> dict[str, tuple[Tensor, Tensor]]:
        if rows is not None and "weight" not in rows:
            return {}
        grad_rows, _, token = _embedding_rows(module, uses)
        start, stop, _ = (slice(None) if rows is None else rows["weight"]).indices(module.num_embeddings)
        inside = (token >= start) & (token < stop)  # the table's rows [start, stop) only
        grad_rows, token = grad_rows * inside.unsqueeze(1), (token - start).clamp(0, max(stop - start - 1, 0))
        return {"weight": _moments(grad_rows, token, stop - start)}

    def grads(self, module: nn.Module, uses: Sequence[Use]) -> dict[str, Tensor]:
        rows, example, token = _embedding_rows(module, uses)
        out = rows.new_zeros(uses[0].inputs.shape[0], *module.weight.shape)
        return {"weight": out.index_put_((example, token), rows, accumulate=True)}
