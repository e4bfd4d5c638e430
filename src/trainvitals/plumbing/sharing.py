"""How trainvitals callbacks share a step's measurements: declared, resolved once per fit, searched nowhere else.

Each :class:`~trainvitals.plumbing.base.TrainvitalsCallback` declares, as class attributes, the names of
what it ``provides`` and what it ``reads`` (the constants below). At ``setup(stage="fit")`` the first
callback to set up calls :func:`connect`, which builds the fit's :class:`Vitals` from the Trainer's
callback list — the only place that list is searched — and hands it to every trainvitals callback in
it as ``callback.vitals``. Callbacks then ask the hub, never each other's modules:

- ``vitals.grad_norms.sq_norms(trainer, optimizer, params)``: the ``(P,)`` ‖g‖₂² of this optimizer
  step's gradient (accumulated, averaged over ranks, AMP scale undone, before clipping), taken by one
  fused pass on the first request of the step — whichever callback asks first — and indexed for the
  others (:class:`StepGradNorms`);
- ``vitals.shared(name, factory)``: the fit's one object of a name (the run's ``GradientNoise``, the step's
  micro-batches and their sizes), made on first request;
- ``vitals.provider(name)`` / ``vitals.providers(name)``: the callback(s) declaring ``name``;
  ``vitals.speaker(name)``: the one that logs a tag family several could log (its provider, else its
  first reader).

A new callback that needs the step's gradient norms, e.g. an ``UpdateMonitor``::

    class UpdateMonitor(TrainvitalsCallback):
        reads = (GRAD_SQ_NORMS,)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            params = [p for g in optimizer.param_groups for p in g["params"]]
            sq_norms = self.vitals.grad_norms.sq_norms(trainer, optimizer, params)  # None: no gradient here

Users wire nothing. To tie callbacks together explicitly (two probes that must not share one
estimate, say), pass them to ``Vitals(probe_a, stopper_a)``: those share that hub only; the others
share the fit's default one. Either way a hub's contents last one fit.

Distributed: every rank builds the same hub from the same callback list and requests the same
parameter lists in the same order, so a sharded (FSDP) norm's collective is joined by all ranks or none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from trainvitals.fused_norms import per_tensor_norms
from trainvitals.plumbing.amp import scale_left_in_grads
from trainvitals.plumbing.sharding import holds_shards, reduce_shard_norms

GRAD_SQ_NORMS = "grad_sq_norms"
"""The step's per-parameter ‖g‖₂² (:attr:`Vitals.grad_norms`); read by GradNormMonitor (p = 2), the stopper, the probe."""
GRAD_NORM = "grad_norm"
"""The logged total gradient norm (``last_total``): GradNormMonitor."""
NONFINITE_STEPS = "nonfinite_steps"
"""Who logs ``grad_norm/nonfinite_steps``: GradNormMonitor; without one, the first reader that counts them."""
GRADIENT_NOISE = "gradient_noise"
"""The run's one ``GradientNoise`` (:meth:`Vitals.shared`): fed by the probe and the stopper, read by others."""
NOISE_TAGS = "noise_tags"
"""Who logs the estimate's ``grad_noise/*`` tags: a BatchVarianceProbe that measures, else the stopper."""
NOISE_PROBE = "noise_probe"
"""A per-example noise source is attached (BatchVarianceProbe)."""
NOISE_BAND = "noise_band"
"""The noise band's margin (``margin``): GradNormEarlyStopping."""
NAN_PRODUCER = "nan_producer"
"""The module that made a fit's first inf/NaN (``producer``, a ``norms.producer.Producer`` or ``None``): TrainingGuard."""
LR_FACTORS = "lr_factors"
"""The step's lr multipliers on top of a user's scheduler (:class:`~trainvitals.plumbing.lr_factors.LRFactors`, a
:meth:`Vitals.shared` object): TrainingGuard after a rollback, BandSchedule after a cut."""
STEP_BATCHES = "step_batches"
"""The micro-batches of the step under way and their sizes (:class:`~trainvitals.plumbing.batch.StepBatches`, a
:meth:`Vitals.shared` object): fed by whichever of its readers sees a micro-batch or a backward first; read by
GradNormMonitor, TrainingGuard and UpdateMonitor for a step's noise weight."""
SUMMARY = "summary"
"""An end-of-fit markdown summary (``summary_markdown()``)."""
RESTORED_SUMMARY = "restored_summary"
"""A :data:`SUMMARY` made from the checkpointed state alone, so as true after a fit that ran no step (a relaunch
with none left) as after the fit that measured it: the dashboard writes only these again then."""

_MAX_INDICES = 8  # index tensors kept for parameter subsets: a caller that rebuilds its list must not pile them up


class StepGradNorms:
    """Per-parameter gradient norms of the current optimizer step, taken once on first request.

    Keyed by optimizer and ``trainer.global_step``: a request for parameters that a pass of this step
    already covers is served by indexing it (an index tensor cached per pair of lists: no host-to-device
    copy per step); any other takes one fused norm over them (:func:`~trainvitals.fused_norms.per_tensor_norms`),
    reduced over FSDP shards, the loss scale a fused optimizer leaves in ``.grad`` divided out. No host sync.
    """

    def __init__(self) -> None:
        self.passes = 0
        """Fused passes taken over the gradients (what the tests count)."""
        # Per optimizer (by id, the object kept) and norm type: (its step, [(params, (P,) norms)]).
        self._taken: dict[tuple[int, float], tuple[torch.optim.Optimizer, int, list[tuple[list[Any], Tensor]]]] = {}
        self._indices: dict[tuple[int, int], tuple[list[Any], list[Any], Tensor]] = {}
        self._placed: dict[int, tuple[list[Any], tuple[int, ...], Tensor]] = {}

    def norms(
        self,
        trainer: "pl.Trainer",
        optimizer: torch.optim.Optimizer,
        params: list[torch.nn.Parameter],
        norm_type: float = 2.0,
    ) -> Tensor | None:
        """``(P,)`` float64 ‖g‖_p of each of ``params`` at this step (0 for one without gradient), on the
        gradients' device; ``None`` when none has a gradient and this rank holds no shard."""
        if not any(p.grad is not None for p in params) and not holds_shards(trainer):
            return None
        step = trainer.global_step
        key = (id(optimizer), norm_type)
        taken = self._taken.get(key)
        if taken is None or taken[0] is not optimizer or taken[1] != step:
            taken = self._taken[key] = (optimizer, step, [])
        for held, norms in taken[2]:
            if held is params:
                return norms
            index = self._index(params, held)
            if index is not None:
                return norms[index.to(norms.device)]
        norms = self._take(trainer, optimizer, params, norm_type)
        taken[2].append((params, norms))
        return norms

    def sq_norms(
        self, trainer: "pl.Trainer", optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]
    ) -> Tensor | None:
        """``(P,)`` ‖g‖₂² of each of ``params`` (:meth:`norms` squared)."""
        norms = self.norms(trainer, optimizer, params)
        return None if norms is None else norms.square()

    def sq_norm(
        self, trainer: "pl.Trainer", optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]
    ) -> Tensor | None:
        """``()`` ‖g‖₂² over ``params`` (:meth:`sq_norms` summed)."""
        sq_norms = self.sq_norms(trainer, optimizer, params)
        return None if sq_norms is None else sq_norms.sum()

    def _index(self, params: list[Any], held: list[Any]) -> Tensor | None:
        """Where ``params`` sit in ``held``, as a cached index tensor; ``None`` if one of them is not there."""
        key = (id(params), id(held))
        cached = self._indices.get(key)
        if cached is not None and cached[0] is params and cached[1] is held:
            return cached[2]
        where = {id(p): i for i, p in enumerate(held)}
        if not all(id(p) in where for p in params):
            return None
        if len(self._indices) >= _MAX_INDICES:
            self._indices.clear()
        index = torch.tensor([where[id(p)] for p in params], dtype=torch.long, device=held[0].device)
        self._indices[key] = (params, held, index)
        return index

    def _take(
        self, trainer: "pl.Trainer", optimizer: torch.optim.Optimizer, params: list[Any], norm_type: float
    ) -> Tensor:
        self.passes += 1
        present = tuple(i for i, p in enumerate(params) if p.grad is not None)
        norms = per_tensor_norms([params[i].grad for i in present], norm_type) if present else None
        norms = reduce_shard_norms(trainer, self._place(params, present, norms), norm_type)
        scale = scale_left_in_grads(trainer, optimizer)  # an optimizer that unscales in its own step
        return norms if scale is None else norms / scale.to(norms)

    def _place(self, params: list[Any], present: tuple[int, ...], norms: Tensor | None) -> Tensor:
        """The ``present`` parameters' norms in a ``(P,)`` row, 0 for the others (an FSDP rank whose shard holds no
        gradient still joins the all-reduce); the positions' index tensor is cached while they stay the same."""
        if norms is not None and len(present) == len(params):
            return norms
        device = params[0].device if norms is None else norms.device
        row = torch.zeros(len(params), dtype=torch.float64, device=device)
        if norms is None:
            return row
        cached = self._placed.get(id(params))
        if cached is None or cached[0] is not params or cached[1] != present or cached[2].device != device:
            if len(self._placed) >= _MAX_INDICES:
                self._placed.clear()
            cached = self._placed[id(params)] = (params, present, torch.tensor(present, device=device))
        return row.index_copy_(0, cached[2], norms.to(row))


class Vitals:
    """One fit's shared measurements and who provides them (module docstring).

    ``Vitals(*callbacks)`` ties ``callbacks`` to this hub explicitly; without it, :func:`connect` builds one
    for the fit. Its contents (:attr:`grad_norms`, the shared objects) are renewed at each fit.

    Attributes:
        callbacks: the member callbacks, in the Trainer's order.
        grad_norms: the step's gradient norms (:class:`StepGradNorms`).
    """

    def __init__(self, *callbacks: Any) -> None:
        self.callbacks: list[Any] = list(callbacks)
        self.grad_norms = StepGradNorms()
        self._objects: dict[str, Any] = {}
        self._waiting: set[int] = set()  # members not yet set up in this fit
        for callback in callbacks:
            callback._given_vitals = self

    def _start_fit(self, members: list[Any]) -> None:
        self.callbacks = members
        self.grad_norms = StepGradNorms()
        self._objects = {}
        self._waiting = {id(cb) for cb in members}
        for callback in members:
            callback.vitals = self

    def providers(self, name: str) -> list[Any]:
        """The members that declare ``name`` in ``provides`` (and offer it now: ``offers(name)``), in order."""
        return [cb for cb in self.callbacks if name in getattr(cb, "provides", ()) and _offers(cb, name)]

    def provider(self, name: str) -> Any:
        """The first of :meth:`providers`, or ``None``."""
        found = self.providers(name)
        return found[0] if found else None

    def speaker(self, name: str) -> Any:
        """The one member that logs ``name``'s tags: its first provider, else its first reader, else ``None``."""
        readers = [cb for cb in self.callbacks if name in getattr(cb, "reads", ())]
        return self.provider(name) or (readers[0] if readers else None)

    def shared(self, name: str, factory: Callable[[], Any] | None = None) -> Any:
        """The fit's one object called ``name``, made by ``factory`` on the first request that passes one;
        ``None`` while none was made."""
        if name not in self._objects and factory is not None:
            self._objects[name] = factory()
        return self._objects.get(name)


def connect(trainer: "pl.Trainer", callback: Any) -> Vitals:
    """The fit's hub of ``callback``, at its ``setup(stage="fit")``: the first trainvitals callback to set up
    in a fit builds the hubs of all of them (the Trainer's list, in order; ``callback`` itself if a test
    sets it up alone), the others find theirs ready."""
    hub = getattr(callback, "vitals", None)
    if hub is not None and id(callback) in hub._waiting:
        hub._waiting.discard(id(callback))
        return hub
    members = [cb for cb in (trainer.callbacks if hasattr(trainer, "callbacks") else []) if _shares(cb)]
    if not any(cb is callback for cb in members):
        members.append(callback)
    default = Vitals()
    hubs: dict[int, tuple[Vitals, list[Any]]] = {}
    for cb in members:
        given = getattr(cb, "_given_vitals", None) or default
        hubs.setdefault(id(given), (given, []))[1].append(cb)
    for hub, its in hubs.values():
        hub._start_fit(its)
    callback.vitals._waiting.discard(id(callback))
    return callback.vitals


def _shares(callback: Any) -> bool:
    return isinstance(getattr(type(callback), "provides", None), tuple)


def _offers(callback: Any, name: str) -> bool:
    offers = getattr(callback, "offers", None)
    return True if offers is None else bool(offers(name))
