"""Which dimension of a layer's input holds the examples, for a rule that treats every position alike
(:meth:`~trainvitals.core.per_example.registry.PerExampleRule.feature_dims`: Linear, Embedding, the norm layers).

An input ``(B, T, *)`` is batch-first, ``(T, B, *)`` sequence-first; a first dimension other than the batch B
and a second equal to it says sequence-first. With T = B the shape cannot tell, and the wrong guess gives
per-position norms with no error. The evidence, in this order (:meth:`Layouts.examples`):

1. ``sequence_first``, the user's word (BatchVarianceProbe's argument);
2. the input is a view of a tensor of the batch (the ids a model takes from its batch, transposed or not):
   the dimension whose stride is that tensor's first;
3. the layer's own calls this fit whose shape told (T ≠ B: another step, a short last batch);
4. the ``batch_first`` of the modules that carry one (nn.MultiheadAttention, nn.RNN/LSTM/GRU, nn.Transformer;
   nn.TransformerEncoder/Decoder and their layers, their attention's) among the layer's nearest enclosing
   module and its children: the Linear and LayerNorm layers of an nn.TransformerEncoderLayer get its
   attention's layout, an embedding and a decoder beside a sequence-first LSTM the LSTM's;
5. what the other layers' own evidence (2, 3) showed this fit, when it agrees.

Evidence that disagrees fails the layer for the step, saying the shape and the fix; without any, the input
is taken batch-first and the layer is listed in :attr:`Layouts.assumed`, to be said once. An input with more
dimensions before its features, ``(B, H, W, C)`` into a channels-last Linear or LayerNorm with H = B, is not a
sequence: 4 and 5 do not apply, and without 1–3 it is batch-first, unsaid. Square ``(B, B)`` ids
of an embedding not shown per example by 1–3 are also compared on the device with relative-position
buckets (T5's bias: constant along each diagonal), which are shared by the batch. Host-side only (shapes,
strides, storages), but for that comparison, read where a logging step decides the step.

A batch given as a list of examples (variable-length sequences for pack_sequence, beside their labels) counts
one example a tensor of the list (:func:`listed_examples`); a layer fed one of them, or two tensors of a list as
long as the batch in one forward, is called per example and is not measured (:data:`ONE_EXAMPLE`).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

#: The modules whose layout is that of the attention layers inside them (they pass their input straight in).
_TRANSFORMER_BLOCKS = (nn.TransformerEncoder, nn.TransformerDecoder, nn.TransformerEncoderLayer,
                       nn.TransformerDecoderLayer)

_LAYOUTS = ("batch-first", "sequence-first")  # indexed by the examples' dimension

#: Why a call whose first two dimensions both equal the batch is not measured.
AMBIGUOUS = ("its input {shape} has the batch ({batch}) on both of its first two dimensions, and {why}: which "
             "holds the examples is not known. Say which with BatchVarianceProbe(sequence_first=True or False), or "
             "begin with a step whose sequence length differs from the batch size (its shape shows the layout)")

#: Why a lookup with no dimension of the batch is not measured.
NO_BATCH = ("its ids {shape} have no dimension of the batch ({batch}): not one lookup per example but one shared by "
            "the batch (a relative-position bias looked up with (T, T) buckets?), whose gradient arrives summed "
            "over the examples")


#: Why a layer called on one example of a batch given as a list of examples is not measured.
ONE_EXAMPLE = ("it is called on one example at a time (a tensor of the batch's list of {batch} examples): its rule "
               "reads the examples from a dimension of one call's input. Pad the list (pad_sequence) or pack it "
               "(pack_sequence) before this layer to have it measured")


@dataclass(frozen=True)
class Examples:
    """Where a call's examples are.

    Attributes:
        dim: the input's dimension that holds them (0 or 1).
        failed: why the call cannot be measured, or ``None``.
        shown: the input itself showed it (its shape, a view of the batch, the layer's own earlier calls).
        relative: for square ``(B, B)`` ids not shown per example, a ``()`` bool on their device: whether they
            look like relative-position buckets (shared by the batch).
    """

    dim: int = 0
    failed: str | None = None
    shown: bool = False
    relative: Tensor | None = None


def _declared(module: nn.Module) -> int | None:
    """The examples' dimension a module declares by its ``batch_first`` (a transformer block: its attention's)."""
    first = getattr(module, "batch_first", None)
    if isinstance(first, bool):
        return 0 if first else 1
    if isinstance(module, _TRANSFORMER_BLOCKS):
        inside = {_declared(m) for m in module.modules() if m is not module and isinstance(m, nn.MultiheadAttention)}
        return inside.pop() if len(inside) == 1 else None
    return None


def _view_dim(inputs: Tensor, batch: list[weakref.ref[Tensor]]) -> int | None:
    """The dimension (0 or 1) of ``inputs`` that is the examples' dimension of a batch tensor it is a view of."""
    try:
        storage = inputs.untyped_storage().data_ptr()
        for ref in batch:
            t = ref()
            if t is not None and t.device == inputs.device and t.stride(0) \
                    and t.untyped_storage().data_ptr() == storage:
                dims = [d for d in (0, 1) if inputs.stride(d) == t.stride(0)]
                if len(dims) == 1:
                    return dims[0]
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass, a fake tensor)
        pass
    return None


def _tensors(batch: Any, lists: bool = False) -> Iterator[Any]:
    """The tensors of a batch: in its mappings (a dict, an HF ``BatchEncoding``), sequences and dataclasses;
    ``lists``: a list of examples (:func:`_example_list`) as one item, not its tensors."""
    todo, seen = [batch], set()
    while todo:
        item = todo.pop()
        if isinstance(item, Tensor) or (lists and _example_list(item)):
            yield item
        elif id(item) not in seen and not isinstance(item, (str, bytes)):
            seen.add(id(item))
            if isinstance(item, Mapping):
                todo.extend(item.values())
            elif isinstance(item, (list, tuple)):
                todo.extend(item)
            elif dataclasses.is_dataclass(item) and not isinstance(item, type):
                todo.extend(getattr(item, f.name) for f in dataclasses.fields(item))


def _example_list(item: Any) -> bool:
    """Whether ``item`` may be a list of examples: a list or tuple of two or more tensors with the same dimensions
    after the first (variable-length sequences, for pad_sequence or pack_sequence)."""
    return (isinstance(item, (list, tuple)) and len(item) > 1 and all(isinstance(t, Tensor) and t.dim() for t in item)
            and len({t.shape[1:] for t in item}) == 1)


def listed_examples(batch: Any) -> tuple[int | None, list[Tensor]] | None:
    """A batch whose tensors disagree on their first dimension, read with its lists of examples
    (:func:`_example_list`) counting one example a tensor: where every other tensor has a row per example (the
    labels), their number and the lists' tensors; ``(None, [])`` where nothing beside a list of tensors of differing
    first dimensions says that its length counts the examples (a tuple of batch tensors looks the same). ``None``
    where the first dimensions agree, or no list of examples reads them otherwise."""
    parts = list(_tensors(batch, lists=True))
    lists = [p for p in parts if not isinstance(p, Tensor)]
    others = {p.shape[0] if p.dim() else 1 for p in parts if isinstance(p, Tensor)}
    if not lists or len(others.union(t.shape[0] for items in lists for t in items)) < 2:
        return None
    if others and others == {len(items) for items in lists}:
        return len(lists[0]), [t for items in lists for t in items]
    return (None, []) if any(len({t.shape[0] for t in items}) > 1 for items in lists) else None


def _relative_positions(ids: Tensor) -> Tensor:
    """``()`` bool: whether square 2-D ids are constant along each diagonal and not constant, as buckets of the
    relative position j − i are."""
    return (ids[1:, 1:] == ids[:-1, :-1]).all() & (ids != ids[0, 0]).any()


class Layouts:
    """The evidence of a fit on which dimension holds each layer's examples (module docstring).

    Kept over the fit's plans (the probe's re-plans keep what calls showed), made again at a new fit.

    Args:
        model: the model whose ``batch_first`` modules declare a layout (:meth:`declare`); ``None``: none.
        sequence_first: ``True``/``False``: an input with the batch on both of its first two dimensions is
            sequence-first / batch-first; ``None``: from the evidence.

    Attributes:
        assumed: layers taken batch-first without evidence, with their input's shape and the batch.
    """

    def __init__(self, model: nn.Module | None = None, sequence_first: bool | None = None) -> None:
        self.sequence_first = sequence_first
        self.assumed: dict[str, tuple[tuple[int, ...], int]] = {}
        self._said: set[str] = set()
        self._seen: dict[str, set[int]] = {}  # per layer, the examples' dimensions its own evidence showed
        self._showing: dict[int, dict[str, None]] = {}  # per dimension, the layers whose evidence showed it
        self._batch: list[weakref.ref[Tensor]] = []
        self._lists: list[list[weakref.ref[Tensor]]] = []  # the batch's lists of as many tensors as examples
        self._listed = False  # the batch is a list of examples beside their labels (listed_examples)
        self._fed: dict[tuple[str, int], set[int]] = {}  # per layer and list, the tensors of it the layer was fed
        self._scopes: dict[str, dict[str, int]] = {}  # per module: it and its children that declare, their dim
        if model is not None:
            self.declare(model)

    def declare(self, model: nn.Module) -> None:
        """Read the layouts ``model``'s modules declare (names as in ``model.named_modules()``)."""
        self._scopes = {}
        for name, module in model.named_modules():
            dim = _declared(module)
            if dim is not None:
                for scope in {name, name.rpartition(".")[0]}:  # itself, and its parent's children ("a": the model's)
                    self._scopes.setdefault(scope, {})[name] = dim

    def see_batch(self, batch: Any, size: int) -> None:
        """The coming micro-batch's tensors of ``size`` examples (weakly held): a layer fed a view of one shows
        its layout; one fed a tensor of a list of ``size`` of them may be called per example (:meth:`one_example`)."""
        lists = [items for items in _tensors(batch, lists=True) if not isinstance(items, Tensor) and len(items) == size]
        listed = listed_examples(batch)
        self._listed = listed is not None and listed[0] == size
        self._lists = [[weakref.ref(t) for t in items] for items in lists]
        self._fed = {}
        examples = {id(t) for items in lists for t in items} if self._listed else set()
        self._batch = [weakref.ref(t) for t in _tensors(batch)
                       if t.dim() >= 2 and t.shape[0] == size and id(t) not in examples]

    def one_example(self, name: str, inputs: Tensor) -> bool:
        """Whether layer ``name`` is called per example (:data:`ONE_EXAMPLE`), its rule taking positions for
        examples: fed (a view of) a tensor of a batch given as a list of examples (:func:`listed_examples`), or
        fed two tensors of one list of the batch's size in a forward (the list's tensors hold as many rows as
        there are examples: a list of examples, or of the batch's tensors, each fed to a layer of its own)."""
        if not self._lists:
            return False
        try:
            storage, start = inputs.untyped_storage().data_ptr(), inputs.data_ptr()
            for k, refs in enumerate(self._lists):
                for i, ref in enumerate(refs):  # the tensor whose memory the input begins in (one storage split?)
                    t = ref()
                    if t is not None and t.device == inputs.device and t.untyped_storage().data_ptr() == storage \
                            and t.data_ptr() <= start < t.data_ptr() + max(t.nbytes, 1):
                        fed = self._fed.setdefault((name, k), set())
                        fed.add(i)
                        return self._listed or len(fed) > 1
        except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass, a fake tensor)
            pass
        return False

    def _show(self, name: str, dim: int) -> Examples:
        self._seen.setdefault(name, set()).add(dim)
        self._showing.setdefault(dim, {})[name] = None
        return Examples(dim, shown=True)

    def _scope(self, name: str) -> dict[str, int]:
        """The declaring modules of ``name``'s nearest enclosing module (itself first) that has any."""
        while True:
            if name in self._scopes:
                return self._scopes[name]
            if not name:
                return {}
            name = name.rpartition(".")[0]

    def examples(self, name: str, inputs: Tensor, features: int, batch: int, lookup: bool = False,
                 tied: bool = False) -> Examples:
        """Where the examples of layer ``name``'s call on ``inputs`` are, for a batch of ``batch``; ``features``:
        its trailing feature dimensions (at least 2 before them); ``lookup``: an embedding's ids; ``tied``: it
        shares its parameter."""
        first, second = inputs.shape[0] == batch, inputs.shape[1] == batch
        if first != second:
            return self._show(name, int(second))
        if not first:
            return Examples(failed=NO_BATCH.format(shape=tuple(inputs.shape), batch=batch) if lookup else None)
        found = self._ambiguous(name, inputs, batch, sequence=inputs.dim() - features == 2)
        if lookup and not found.shown and not tied and inputs.dim() == 2 and not found.failed:
            return Examples(found.dim, relative=_relative_positions(inputs))
        return found

    def _ambiguous(self, name: str, inputs: Tensor, batch: int, sequence: bool) -> Examples:
        """Examples for an input with the batch on both of its first two dimensions: the evidence in order
        (``sequence``: ``(·, ·, *features)``, which 4 and 5 may say sequence-first)."""
        def fail(why: str) -> Examples:
            return Examples(failed=AMBIGUOUS.format(shape=tuple(inputs.shape), batch=batch, why=why))

        if self.sequence_first is not None:
            return Examples(int(self.sequence_first))
        view = _view_dim(inputs, self._batch)
        if view is not None:
            return self._show(name, view)
        own = self._seen.get(name, set())
        if len(own) > 1:
            return fail("its own calls had the examples first at some steps and second at others")
        if own:
            return Examples(next(iter(own)), shown=True)
        if not sequence:
            return Examples(0)
        declared = self._scope(name)
        if len(set(declared.values())) == 1:
            return Examples(next(iter(declared.values())))
        others = self._showing
        if len(others) == 1:
            return Examples(next(iter(others)))
        if others:
            return fail("the other layers' inputs showed both layouts (" + "; ".join(
                f"{_LAYOUTS[d]}: {', '.join(list(others[d])[:3])}" for d in sorted(others)) + ")")
        if declared:
            return fail("the batch_first modules around it disagree (" + ", ".join(
                f"{m or 'the model'}: {_LAYOUTS[d]}" for m, d in sorted(declared.items())) + ")")
        self.assumed.setdefault(name, (tuple(inputs.shape), batch))
        return Examples(0)

    def assumed_note(self) -> str | None:
        """The layers taken batch-first without evidence that no note has named yet, in one sentence; ``None``
        without any. Each is named once."""
        new = {n: v for n, v in self.assumed.items() if n not in self._said}
        if not new:
            return None
        self._said.update(new)
        shown = list(new)[:5]  # in the order of the forward
        more = f" and {len(new) - len(shown)} more" if len(new) > len(shown) else ""
        shape, batch = new[shown[0]]
        return (f"the inputs of {', '.join(shown)}{more} have the batch on both of their first two dimensions "
                f"(e.g. {shape}, a batch of {batch}) and nothing in the model says which holds the examples (no "
                "batch_first module, no input taken from the batch, no step whose sequence length differs from "
                "the batch size): they are taken batch-first (B, T, ...). If they are sequence-first (T, B, ...), "
                "pass sequence_first=True")
