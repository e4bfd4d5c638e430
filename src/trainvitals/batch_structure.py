"""What a batch holds, whatever its structure: its tensors in order (in mappings, sequences and dataclasses), and a
batch given as a list of examples (variable-length sequences for ``pad_sequence``/``pack_sequence``).

Torch-only; the per-example layout and Lightning's batch size both read batches through it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from torch import Tensor


def batch_tensors(batch: Any, lists: bool = False) -> Iterator[Any]:
    """The tensors of a batch, in order: in its mappings (a dict, an HF ``BatchEncoding``), sequences and
    dataclasses; ``lists``: a list of examples (:func:`_example_list`) as one item, not its tensors."""
    todo, seen = [batch], set()
    while todo:
        item = todo.pop()
        if isinstance(item, Tensor) or (lists and _example_list(item)):
            yield item
        elif id(item) not in seen and not isinstance(item, (str, bytes)):
            seen.add(id(item))
            if isinstance(item, Mapping):
                todo.extend(reversed(list(item.values())))
            elif isinstance(item, (list, tuple)):
                todo.extend(reversed(item))
            elif dataclasses.is_dataclass(item) and not isinstance(item, type):
                todo.extend(getattr(item, f.name) for f in reversed(dataclasses.fields(item)))


def _example_list(item: Any) -> bool:
    """Whether ``item`` may be a list of examples: a list or tuple of two or more tensors with the same dimensions
    after the first (variable-length sequences, for pad_sequence or pack_sequence)."""
    return (
        isinstance(item, (list, tuple))
        and len(item) > 1
        and all(isinstance(t, Tensor) and t.dim() for t in item)
        and len({t.shape[1:] for t in item}) == 1
    )


def listed_examples(batch: Any) -> tuple[int | None, list[Tensor]] | None:
    """A batch whose tensors disagree on their first dimension, read with its lists of examples
    (:func:`_example_list`) counting one example a tensor: where every other tensor has a row per example (the
    labels), their number and the lists' tensors; ``(None, [])`` where nothing beside a list of tensors of differing
    first dimensions says that its length counts the examples (a tuple of batch tensors looks the same). ``None``
    where the first dimensions agree, or no list of examples reads them otherwise."""
    parts = list(batch_tensors(batch, lists=True))
    lists = [p for p in parts if not isinstance(p, Tensor)]
    others = {p.shape[0] if p.dim() else 1 for p in parts if isinstance(p, Tensor)}
    if not lists or len(others.union(t.shape[0] for items in lists for t in items)) < 2:
        return None
    if others and others == {len(items) for items in lists}:
        return len(lists[0]), [t for items in lists for t in items]
    return (None, []) if any(len({t.shape[0] for t in items}) > 1 for items in lists) else None
