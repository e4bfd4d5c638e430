"""Which dimension of a layer's input holds the examples, for a rule that treats every position alike
(:meth:`~trainvitals.per_example.registry.PerExampleRule.feature_dims`: Linear, Embedding, the norm layers).

An input ``(B, T, *)`` is batch-first, ``(T, B, *)`` sequence-first; a first dimension other than the batch B
and a second equal to it says sequence-first. With T = B the shape cannot tell, and the wrong guess gives
per-position norms with no error. The evidence, in this order (:meth:`Layouts.examples`):

1. the ``batch_first`` of the nearest module around the layer that declares one (nn.MultiheadAttention,
   nn.RNN/LSTM/GRU, nn.Transformer; nn.TransformerEncoder/Decoder and their layers, their attention's): it
   determines the input of the layers inside it (an nn.TransformerEncoderLayer's Linear and LayerNorm layers),
   and only theirs. It wins over ``sequence_first``; where that says otherwise, :meth:`Layouts.notes` says so once;
2. ``sequence_first``, the user's word (BatchVarianceProbe's argument), for every other layer;
3. the input is a view of a tensor of the batch (the ids a model takes from its batch, transposed or not):
   the dimension whose stride is that tensor's examples';
4. the layer's own calls this fit whose shape told (T ≠ B: another step, a short last batch);
5. the model's evidence, when all of it says one layout: the layouts the other layers' own evidence (3, 4)
   showed this fit and those the model's ``batch_first`` modules declare (a decoder beside a sequence-first
   LSTM, with ids that show nothing: the declared layouts alone are said once, :attr:`Layouts.inferred`). Mixed
   evidence (a batch-first embedding and head around a ``batch_first=False`` encoder) does not say which a layer
   outside the encoder gets: it fails.

Only the user's steps give evidence: a forward trainvitals runs for its own purpose (the lr advisor's on the batch
twice over, :func:`~trainvitals.plumbing.extra_forward.extra_forward`) gives none. Evidence that disagrees fails the
layer for the step, saying the shape and the fix; without any, the input
is taken batch-first and the layer is listed in :attr:`Layouts.assumed`, to be said once. A layer taken by 5 or
without evidence whose own input later shows the other layout is listed in :attr:`Layouts.refuted`: the steps
measured so far measured per-position gradients (the probe restarts its estimate). A module that declares its
examples on one dimension but is fed the batch size on the other (a loader yielding ``(T, B)`` batches read as
``(B, T)``) is recorded by :meth:`Layouts.see_declared`: the step is not measured (:meth:`Layouts.misread`).
An input with more dimensions before its features, ``(B, H, W, C)`` into a channels-last Linear or LayerNorm
with H = B, is not a sequence: 1 and 5 do not apply, and without 2–4 it is batch-first, unsaid. Square ``(B, B)``
ids of an embedding not shown per example by 2–4 are also compared on the device with relative-position
buckets (T5's bias: constant along each diagonal), which are shared by the batch. Host-side only (shapes,
strides, storages), but for that comparison, read where a logging step decides the step.

A batch given as a list of examples (variable-length sequences for pack_sequence, beside their labels) counts
one example a tensor of the list (:func:`listed_examples`); a layer fed one of them, or two tensors of a list as
long as the batch in one forward, is called per example and is not measured (:data:`ONE_EXAMPLE`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from trainvitals.batch_structure import batch_tensors, listed_examples
from trainvitals.plumbing.extra_forward import in_extra_forward

#: The modules whose layout is that of the attention layers inside them (they pass their input straight in).
_TRANSFORMER_BLOCKS = (
    nn.TransformerEncoder,
    nn.TransformerDecoder,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
)

_LAYOUTS = ("batch-first", "sequence-first")  # indexed by the examples' dimension

#: Why a call whose first two dimensions both equal the batch is not measured.
AMBIGUOUS = (
    "its input {shape} has the batch ({batch}) on both of its first two dimensions, and {why}: which "
    "holds the examples is not known. Say which with BatchVarianceProbe(sequence_first=True or False), or "
    "begin with a step whose sequence length differs from the batch size (its shape shows the layout)"
)

#: Why a call whose second dimension is the batch and whose first a multiple of it is not measured, where nothing
#: else shows the layout.
FOLDED = (
    "its input {shape} has the batch ({batch}) on dimension 1 and a multiple of it on dimension 0 ({first} = "
    "{folds}×{batch}): the examples may be folded into dimension 0 (window attention's windows, heads) as well as "
    "be on dimension 1 (a (T, B) sequence), and nothing in the model shows which. If it is sequence-first, say "
    "BatchVarianceProbe(sequence_first=True)"
)

#: Why a lookup with no dimension of the batch is not measured.
NO_BATCH = (
    "its ids {shape} have no dimension of the batch ({batch}): not one lookup per example but one shared by "
    "the batch (a relative-position bias looked up with (T, T) buckets?), whose gradient arrives summed "
    "over the examples"
)


#: Why a layer called on one example of a batch given as a list of examples is not measured.
ONE_EXAMPLE = (
    "it is called on one example at a time (a tensor of the batch's list of {batch} examples): its rule "
    "reads the examples from a dimension of one call's input. Pad the list (pad_sequence) or pack it "
    "(pack_sequence) before this layer to have it measured"
)


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


def _view_dim(inputs: Tensor, batch: list[tuple[weakref.ref[Tensor], int]]) -> int | None:
    """The dimension (0 or 1) of ``inputs`` that is the examples' dimension of a batch tensor it is a view of."""
    try:
        storage = inputs.untyped_storage().data_ptr()
        for ref, dim in batch:
            t = ref()
            if (
                t is not None
                and t.device == inputs.device
                and t.stride(dim)
                and t.untyped_storage().data_ptr() == storage
            ):
                dims = [d for d in (0, 1) if inputs.stride(d) == t.stride(dim)]
                if len(dims) == 1:
                    return dims[0]
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass, a fake tensor)
        pass
    return None


def _outermost(names: Iterable[str]) -> list[str]:
    """The modules among ``names`` that are inside none of the others ("": the model), sorted."""
    names = sorted(names)
    return [m for m in names if not any(n != m and (not n or m.startswith(f"{n}.")) for n in names)]


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
            sequence-first / batch-first, outside the modules that declare a layout, and the batch's tensors
            hold the examples on dimension 1 / 0 (:meth:`see_batch`); ``None``: from the evidence.

    Attributes:
        assumed: layers taken batch-first without evidence, with their input's shape and the batch.
        inferred: layers taken as every ``batch_first`` module of the model declares, with nothing shown (no
            module around them, no layer's input), with their input's shape and the batch.
        refuted: layers taken one way without evidence of their own whose input then showed the other, with
            that input's shape; not yet said by :meth:`notes`.
        declaring: the modules that declare a layout, by name, with their examples' dimension.
    """

    def __init__(self, model: nn.Module | None = None, sequence_first: bool | None = None) -> None:
        self.sequence_first = sequence_first
        self.assumed: dict[str, tuple[tuple[int, ...], int]] = {}
        self.inferred: dict[str, tuple[tuple[int, ...], int]] = {}
        self.refuted: dict[str, tuple[int, ...]] = {}
        self.declaring: dict[str, int] = {}
        self._said: set[str] = set()
        self._seen: dict[str, set[int]] = {}  # per layer, the examples' dimensions its own evidence showed
        self._showing: dict[int, dict[str, None]] = {}  # per dimension, the layers whose evidence showed it
        self._taken: dict[str, int] = {}  # layers measured without evidence of their own: the dimension taken
        self._misread: dict[str, tuple[tuple[int, ...], int]] = {}  # see_declared's, until misread() reads it
        self._batch: list[tuple[weakref.ref[Tensor], int]] = []
        self._size, self._other = 0, set()
        self._lists: list[list[weakref.ref[Tensor]]] = []  # the batch's lists of as many tensors as examples
        self._listed = False  # the batch is a list of examples beside their labels (listed_examples)
        self._fed: dict[tuple[str, int], set[int]] = {}  # per layer and list, the tensors of it the layer was fed
        if model is not None:
            self.declare(model)

    def declare(self, model: nn.Module) -> None:
        """Read the layouts ``model``'s modules declare (names as in ``model.named_modules()``)."""
        self.declaring = {name: dim for name, module in model.named_modules() if (dim := _declared(module)) is not None}

    def see_batch(self, batch: Any, size: int) -> None:
        """The coming micro-batch's tensors of ``size`` examples (weakly held): a layer fed a view of one shows
        its layout. Their examples are on dimension 1 under ``sequence_first=True``, else 0. A layer fed a tensor of
        a list of ``size`` of them may be called per example (:meth:`one_example`)."""
        dim, self._size = int(bool(self.sequence_first)), size
        lists = [
            items for items in batch_tensors(batch, lists=True) if not isinstance(items, Tensor) and len(items) == size
        ]
        listed = listed_examples(batch)
        self._listed = listed is not None and listed[0] == size
        self._lists, self._fed = [[weakref.ref(t) for t in items] for items in lists], {}
        examples = {id(t) for items in lists for t in items} if self._listed else set()
        tensors = [t for t in batch_tensors(batch) if t.dim() >= 2 and id(t) not in examples]
        self._batch = [(weakref.ref(t), dim) for t in tensors if t.shape[dim] == size]
        self._other = {t.shape[1 - dim] for t in tensors}  # the sizes a batch read on the wrong dimension would have

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
                    if (
                        t is not None
                        and t.device == inputs.device
                        and t.untyped_storage().data_ptr() == storage
                        and t.data_ptr() <= start < t.data_ptr() + max(t.nbytes, 1)
                    ):
                        fed = self._fed.setdefault((name, k), set())
                        fed.add(i)
                        return self._listed or len(fed) > 1
        except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass, a fake tensor)
            pass
        return False

    def see_declared(self, name: str, inputs: Any) -> None:
        """A declaring module's batched input: with the batch size the probe read on the other dimension than the
        one it declares, and on its own a size that the batch's tensors have on their other dimension, the batch
        was read on the wrong dimension (:meth:`misread`). Not from a forward of trainvitals' own (the lr advisor's
        on the batch twice over): :func:`~trainvitals.plumbing.extra_forward.in_extra_forward`."""
        if in_extra_forward():
            return
        dim = self.declaring.get(name)
        if (
            dim is not None
            and isinstance(inputs, Tensor)
            and inputs.dim() >= 3
            and self._size
            and inputs.shape[1 - dim] == self._size != inputs.shape[dim]
            and inputs.shape[dim] in self._other
        ):
            self._misread.setdefault(name, (tuple(inputs.shape), dim))

    def misread(self) -> str:
        """Why the step's examples are not the batch's dimension the probe read (from :meth:`see_declared`), or
        ""; cleared for the next step."""
        if not self._misread:
            return ""
        name, (shape, dim) = next(iter(self._misread.items()))
        self._misread = {}
        read = int(bool(self.sequence_first))
        fix = (
            "The loader seems to yield batch-first (B, T) batches: drop sequence_first=True, which reads the batch "
            "size from dimension 1"
            if read
            else "The loader seems to yield (T, B) batches: pass "
            "sequence_first=True, which reads the batch size from their dimension 1"
        )
        return (
            f"{name or 'the model'} declares its examples on dimension {dim} (batch_first={not dim}), but its "
            f"input {shape} has the batch size read from dimension {read} of the loader's batches ({self._size}) "
            f"on dimension {1 - dim} and not on {dim}: time steps would be counted as examples. {fix}"
        )

    def _show(self, name: str, dim: int, shape: tuple[int, ...]) -> Examples:
        if self._taken.get(name, dim) != dim:
            self.refuted[name] = shape
        self._taken.pop(name, None)
        self._seen.setdefault(name, set()).add(dim)
        self._showing.setdefault(dim, {})[name] = None
        return Examples(dim, shown=True)

    def _inside(self, name: str) -> tuple[str, int] | None:
        """The nearest module around layer ``name`` (itself first) that declares a layout, and its dimension."""
        while True:
            if name in self.declaring:
                return name, self.declaring[name]
            if not name:
                return None
            name = name.rpartition(".")[0]

    def examples(
        self, name: str, inputs: Tensor, features: int, batch: int, lookup: bool = False, tied: bool = False
    ) -> Examples:
        """Where the examples of layer ``name``'s call on ``inputs`` are, for a batch of ``batch``; ``features``:
        its trailing feature dimensions (at least 2 before them); ``lookup``: an embedding's ids; ``tied``: it
        shares its parameter."""
        first, second = inputs.shape[0] == batch, inputs.shape[1] == batch
        if second and not first and inputs.shape[0] % batch == 0 and not self._shows_sequences(name, inputs):
            folds = inputs.shape[0] // batch
            return Examples(
                failed=FOLDED.format(shape=tuple(inputs.shape), batch=batch, first=inputs.shape[0], folds=folds)
            )
        if first != second:
            return self._show(name, int(second), tuple(inputs.shape))
        if not first:
            return Examples(failed=NO_BATCH.format(shape=tuple(inputs.shape), batch=batch) if lookup else None)
        found = self._ambiguous(name, inputs, batch, sequence=inputs.dim() - features == 2)
        if lookup and not found.shown and not tied and inputs.dim() == 2 and not found.failed:
            return Examples(found.dim, relative=_relative_positions(inputs))
        return found

    def _shows_sequences(self, name: str, inputs: Tensor) -> bool:
        """Whether anything but the shape shows layer ``name``'s examples on dimension 1: the user's
        ``sequence_first``, a module around it or in the model declaring it, a view of the batch, or this or another
        layer's own evidence this fit (a (B·k, B, ·) input is otherwise as much a fold of the examples into
        dimension 0: Swin's windows at B = the window's tokens)."""
        inside = self._inside(name)
        return bool(
            self.sequence_first
            or (inside is not None and inside[1] == 1)
            or 1 in self.declaring.values()
            or _view_dim(inputs, self._batch) == 1
            or 1 in self._showing
        )

    def _ambiguous(self, name: str, inputs: Tensor, batch: int, sequence: bool) -> Examples:
        """Examples for an input with the batch on both of its first two dimensions: the evidence in order
        (``sequence``: ``(·, ·, *features)``, which 1 and 5 may say sequence-first)."""

        def fail(why: str) -> Examples:
            return Examples(failed=AMBIGUOUS.format(shape=tuple(inputs.shape), batch=batch, why=why))

        inside = self._inside(name) if sequence else None
        if inside is not None:
            return Examples(inside[1])
        if self.sequence_first is not None:
            return Examples(int(self.sequence_first))
        view = _view_dim(inputs, self._batch)
        if view is not None:
            return self._show(name, view, tuple(inputs.shape))
        own = self._seen.get(name, set())
        if len(own) > 1:
            return fail("its own calls had the examples first at some steps and second at others")
        if own:
            return Examples(next(iter(own)), shown=True)
        if not sequence:
            return Examples(0)
        dims = set(self._showing) | set(self.declaring.values())
        if len(dims) > 1:
            return fail(f"the model's evidence is mixed and none is the layer's own ({self._evidence()})")
        if not self._showing:  # nothing shown: taken by assumption, or from modules that do not determine its input
            (self.inferred if dims else self.assumed).setdefault(name, (tuple(inputs.shape), batch))
        self._taken[name] = dim = dims.pop() if dims else 0
        return Examples(dim)

    def _evidence(self) -> str:
        """The model's evidence in words: the declared layouts, the layouts the layers' inputs showed."""
        declared = ", ".join(f"{m or 'the model'}: {_LAYOUTS[self.declaring[m]]}" for m in _outermost(self.declaring))
        shown = "; ".join(f"{_LAYOUTS[d]}: {', '.join(list(self._showing[d])[:3])}" for d in sorted(self._showing))
        return "; and ".join(
            ([f"the batch_first modules say {declared}"] if declared else [])
            + ([f"the layers' inputs showed {shown}"] if shown else [])
        )

    def notes(self) -> tuple[list[str], bool]:
        """What the fit's evidence has to say that it has not said yet, each once (:meth:`assumed_note`,
        :attr:`inferred`, the modules whose layout overrules ``sequence_first``, :attr:`refuted`), and whether
        layers were refuted: the steps measured so far measured them wrong."""
        said = [note] if (note := self.assumed_note()) else []
        if inferred := self._unsaid("inferred", self.inferred):
            dim = next(iter(self.declaring.values()))
            outer = _outermost(self.declaring)
            modules = ", ".join(m or "the model" for m in outer) + (" declares" if len(outer) == 1 else " declare")
            said.append(
                f"{inferred}, outside every module that declares its layout and no layer's input showing "
                f"one: they are taken {_LAYOUTS[dim]}, as {modules} (batch_first={not dim}). If they "
                f"are {_LAYOUTS[1 - dim]}, pass sequence_first={not dim}"
            )
        if self.sequence_first is not None and "overruled" not in self._said:
            self._said.add("overruled")
            if outer := _outermost([m for m, d in self.declaring.items() if d != int(self.sequence_first)]):
                said.append(
                    f"sequence_first={self.sequence_first} differs from the batch_first of "
                    f"{', '.join(m or 'the model' for m in outer)}: they and the layers inside them keep their "
                    f"own layout ({_LAYOUTS[1 - int(self.sequence_first)]}), the other layers are taken as "
                    "sequence_first says"
                )
        refuted, self.refuted = self.refuted, {}
        if refuted:
            names = list(refuted)[:5]
            said.append(
                f"{', '.join(names)}{' and more' if len(refuted) > 5 else ''}, taken without evidence of their "
                f"own at earlier steps, showed the other layout since (e.g. {refuted[names[0]]}, a batch of "
                f"{self._size}): the steps measured so far counted positions as examples, and the per-example "
                "estimate restarts from this step"
            )
        return said, bool(refuted)

    def _unsaid(self, kind: str, layers: dict[str, tuple[tuple[int, ...], int]]) -> str:
        """ "the inputs of ... have the batch on both ..." for ``layers`` not yet said as ``kind``, or ""."""
        new = {n: v for n, v in layers.items() if f"{kind} {n}" not in self._said}
        if not new:
            return ""
        self._said.update(f"{kind} {n}" for n in new)
        shown = list(new)[:5]  # in the order of the forward
        more = f" and {len(new) - len(shown)} more" if len(new) > len(shown) else ""
        shape, batch = new[shown[0]]
        return (
            f"the inputs of {', '.join(shown)}{more} have the batch on both of their first two dimensions "
            f"(e.g. {shape}, a batch of {batch})"
        )

    def assumed_note(self) -> str | None:
        """The layers taken batch-first without evidence that no note has named yet, in one sentence; ``None``
        without any. Each is named once."""
        if not (said := self._unsaid("assumed", self.assumed)):
            return None
        return (
            f"{said} and nothing in the model says which holds the examples (no batch_first module, no input "
            "taken from the batch, no step whose sequence length differs from the batch size): they are taken "
            "batch-first (B, T, ...). If they are sequence-first (T, B, ...), pass sequence_first=True"
        )
