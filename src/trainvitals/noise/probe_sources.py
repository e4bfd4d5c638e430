"""BatchVarianceProbe's sources for one plan: which source measures each parameter, the hooks that measure
them, what to say of them, and which parameters' batch gradient each covers (a measured step itself:
:mod:`trainvitals.noise.probe_step`).

A plan is made at fit start and again when layers fail (:func:`~trainvitals.per_example.plan_sources`);
each plan gets a fresh :class:`ProbeSources`, whose hooks are on the model only during a measured step.
"""

from __future__ import annotations

import functools
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from trainvitals.memory import ROOT, compiled_modules
from trainvitals.noise.estimators import MicroBatchSquaredNorms
from trainvitals.noise.outliers import norm_coverage
from trainvitals.per_example import Layouts, PerExampleGradients, plan_sources
from trainvitals.text.prose import by_reason, grouped

SOURCES = ("per_example", "micro_batch", "vmap")  # the plan's, in the order of BatchVarianceProbe's docstring
COUPLED = "per-example gradients through BatchNorm in training mode are not independent draws"
"""The probe's estimate's invalidity under BatchNorm, in brief (:meth:`ProbeSources.coupling_warning` says it fully)."""
BATCHNORM_MIN_VALUES = 8  # below this many values per channel, BatchNorm's batch statistics are mostly noise


class ProbeSources:
    """The sources of one plan over ``pl_module`` and their hooks.

    Args:
        pl_module: the model.
        groups: whether a step has at least two micro-batches or ranks.
        fallback: allow torch.func per-example gradients (source 3).
        excluded: layers measured another way (they failed per example).
        fallback_sub_batch: examples per step for source 3.
        layouts: the fit's evidence on which dimension holds the examples where T = B (kept over its plans).
        batch: examples per micro-batch once known (0 before the first step): source 3 measures at most that many.

    Attributes:
        plan: the :class:`~trainvitals.per_example.SourcePlan`.
        params: each source's parameters (a tied one once).
        description: the sources line, with what BatchNorm and torch.compile change.
        param_share: the measured parameters' share of the trainable ones.
        layers: the modules of sources 1 and 3, in that order (a step's failures and set-aside layers index them).
        layer_params: each of those modules' parameters by qualified name (a tied one under its first owner).
        norm_coverage: which parameters the kept per-example norms are over (sources 1 and 3).
        bn_values: values per channel of each BatchNorm in training mode at this step's forwards.
    """

    def __init__(
        self,
        pl_module: "pl.LightningModule",
        groups: bool,
        fallback: bool,
        excluded: set[str],
        fallback_sub_batch: int,
        layouts: Layouts,
        batch: int = 0,
    ) -> None:
        regions, hooked = compiled_modules(pl_module)
        compiled = ["" if c == ROOT else c for c in regions]
        self.plan = plan_sources(pl_module, groups, fallback, excluded, compiled)
        if self.plan.coupled and groups:  # independent micro-batches instead of coupled examples
            self.plan = plan_sources(
                pl_module, groups, fallback, {*excluded, *self.plan.per_example, *self.plan.vmap}, compiled
            )
        plan = self.plan
        layouts.declare(pl_module)
        self.collector = PerExampleGradients(plan.per_example, plan.vmap, fallback_sub_batch, layouts)
        self.micro = MicroBatchSquaredNorms()
        # A forward pre-hook counts a BatchNorm's values; inside a compiled region its mode is read instead.
        hookable = {id(m) for m in hooked}
        coupled = {n: m for n, m in pl_module.named_modules() if n in plan.coupled}
        self._batchnorms = {n: m for n, m in coupled.items() if id(m) in hookable}
        self._compiled_batchnorms = {n: m for n, m in coupled.items() if id(m) not in hookable}
        # The modules that declare a layout see whether the batch was read on their examples' dimension.
        self._declaring = {n: m for n, m in pl_module.named_modules() if n in layouts.declaring and id(m) in hookable}
        self._hooks: list[Any] = []
        self.bn_values: dict[str, int] = {}
        self.layer_params = {**plan.layer_parameters("per_example"), **plan.layer_parameters("vmap")}
        self.layers = list(self.layer_params)
        self.params = {
            "per_example": list(plan.parameters("per_example").values()),
            "micro_batch": list(plan.micro_batch.values()),
            "vmap": list(plan.parameters("vmap").values()),
        }
        # The optimizer and its parameter count, and :meth:`norm_layout` for them.
        self._norm_layout: (
            tuple[torch.optim.Optimizer, int, list[torch.nn.Parameter], Tensor, str | None, Tensor] | None
        ) = None
        trainable = {id(p): p for p in pl_module.parameters() if p.requires_grad}
        measured = {id(p): p for ps in self.params.values() for p in ps}
        self.param_share = sum(p.numel() for p in measured.values()) / max(
            sum(p.numel() for p in trainable.values()), 1
        )
        self.norm_coverage = norm_coverage(pl_module, [*self.params["per_example"], *self.params["vmap"]])
        # The sub-batch as it is measured: all of a smaller micro-batch; before the first step, an upper bound.
        self.sub_batch_shown = min(fallback_sub_batch, batch) if batch else fallback_sub_batch
        self.description = plan.describe(pl_module, self.sub_batch_shown, exact=bool(batch))
        if plan.coupled:
            layers = ", ".join(plan.coupled)  # the plan's coverage line gives the reason once, for its own tensors
            self.description += (
                f". BatchNorm ({layers}) couples the examples, so every parameter is measured from "
                "micro-batches and ranks"
                if plan.micro_batch
                else f". Because of BatchNorm ({layers}), the per-example estimate is invalid in training "
                "mode: a warning at the first such step says what would measure it"
            )
        if regions:
            what = "the training step" if ROOT in regions else ", ".join(f"`{c}`" for c in regions)
            self.description += (
                f". {what} runs under torch.compile: the probe puts no hook inside it, since a "
                "hook there breaks the compiled graph"
            )

    @property
    def measures(self) -> bool:
        """Whether any parameter has a source."""
        return bool(self.plan.per_example or self.plan.micro_batch or self.plan.vmap)

    def unmeasured_reason(self) -> str:
        """Why no parameter has a source."""
        reasons = sorted(set(self.plan.uncovered.values())) or ["the model has no trainable parameters"]
        return "no parameter has a source (one micro-batch per step on one device): " + "; ".join(reasons)

    # ------------------------------------------------------------------ hooks of a measured step
    def attach(self, coordinates: dict[str, slice], keep_norms: bool) -> None:
        self.collector.attach(coordinates=coordinates, keep_norms=keep_norms)
        self.micro.attach(self.plan.micro_batch.values())
        self.bn_values = {}
        self._hooks = [
            m.register_forward_pre_hook(functools.partial(self._record_batchnorm, name))
            for name, m in self._batchnorms.items()
        ]
        self._hooks += [
            m.register_forward_pre_hook(functools.partial(self._record_declared, name), with_kwargs=True)
            for name, m in self._declaring.items()
        ]

    def detach(self) -> None:
        self.collector.detach()
        self.micro.detach()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _record_batchnorm(self, name: str, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if module.training:
            self.bn_values[name] = args[0].numel() // max(args[0].shape[1], 1)

    def _record_declared(
        self, name: str, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        self.collector.layouts.see_declared(name, args[0] if args else next(iter(kwargs.values()), None))

    # ------------------------------------------------------------------ what a step's measurement lacks
    def coupling(self) -> list[str]:
        """The BatchNorms in training mode at this step, through which per-example gradients are measured (they
        are then not independent draws: :meth:`coupling_warning`), or none."""
        training = [*self.bn_values, *(n for n, m in self._compiled_batchnorms.items() if m.training)]
        return training if self.plan.per_example or self.plan.vmap else []

    def norms_invalid(self) -> str:
        """Why this step's kept ‖g_i‖ are not the examples' gradient norms over :attr:`norm_coverage`, or "" (a
        step a layer failed in is said with the failure: :meth:`moved`)."""
        if coupled := self.coupling():
            return (
                f"BatchNorm is in training mode ({', '.join(coupled)}), which couples the examples: none has a "
                "gradient of its own"
            )
        return ""

    def notes(self, coordinates: bool, norms: bool) -> str:
        """What the plan will not log for want of per-example gradients, of the per-coordinate statistics (when
        ``coordinates``) and the per-example norms (when ``norms``: histograms are on), or ""."""
        lacking = not (self.plan.per_example or self.plan.vmap)
        said = [
            self.coordinates_note() if coordinates else "",
            "no per-example gradient norms (grad_noise/per_example_grad_norm, grad_noise/outliers), as no parameter "
            "is measured per example"
            if norms and lacking
            else "",
        ]
        return "; ".join(n for n in said if n)

    def coordinates_note(self) -> str:
        """Why the plan will log no per-layer GSNR nor EB criterion (they need independent per-example
        gradients), or ""."""
        what = "grad_noise/gsnr/* and grad_noise/eb_criterion"
        if not (self.plan.per_example or self.plan.vmap):
            return f"{what}, which need per-example gradients, are not logged"
        if self.plan.coupled:
            return f"{what}, which need independent per-example gradients, are not logged while BatchNorm is in training mode"
        return ""

    @staticmethod
    def coupling_warning(batchnorms: list[str]) -> str:
        """The one full explanation of a per-example estimate through BatchNorm in training mode, with the fix."""
        return (
            f"per-example gradients through BatchNorm in training mode ({', '.join(batchnorms)}) are not "
            "independent draws: BatchNorm normalises each example with its micro-batch's statistics, which couples "
            "the examples, and their addends of the batch gradient cancel. The probe's estimate is invalid from "
            "here on (no B_simple, noise level, noise band, GSNR or EB criterion from it); accumulate_grad_batches "
            ">= 2 or >= 2 devices measure the noise (micro-batches and ranks are independent draws whatever the "
            "layers), and so does GroupNorm or LayerNorm instead of BatchNorm"
        )

    def moved(self, reasons: dict[str, str], aside: set[str], ranks: int) -> str:
        """What to say of layers that failed per example (``reasons``: why each) once this plan excludes them:
        why, what became of the steps they failed in (``aside``: those this one was measured without, on this
        rank of ``ranks``), where each is measured from the next step on, and what the sources now cover; the
        layers that share all three are said together, each reason once (a ViT's 24 in-place layer-scales)."""
        sub_batch = self.sub_batch_shown

        def fate(name: str, one: bool) -> str:
            """What became of the steps ``name`` failed in, and where it is measured from the next step on (``one``:
            in the words of one layer, else of several)."""
            it, its, is_ = ("it", "its", "it is") if one else ("they", "their", "they are")
            if name not in aside:
                then = f"the steps {it} failed in are left out"
            else:
                then = (
                    f"the steps {it} failed in are measured over the other layers, {its} parameters counted as not "
                    "measured" + (f", where {it} failed so on every rank (else left out)" if ranks > 1 else "")
                )
            if name in self.plan.vmap:
                where = f"{is_} measured by torch.func on a sub-batch of {sub_batch} examples"
            elif any(not name or p == name or p.startswith(f"{name}.") for p in self.plan.micro_batch):
                where = f"{is_} measured from micro-batches and ranks"
            else:
                where = (
                    f"{is_} left to micro-batches and ranks, which this run does not have (accumulate_grad_batches "
                    ">= 2 or >= 2 devices)"
                )
            return f"{then}. From the next step on {where}"

        groups = by_reason({name: (why, fate(name, True)) for name, why in reasons.items()})
        said = "; ".join(
            f"{grouped([n or '(root)' for n in names], 'module')}{'' if len(names) == 1 else ', each'}: "
            f"{why}; {fate(names[0], len(names) == 1)}"
            for (why, _), names in groups.items()
        )
        return f"cannot measure per example: {said}; the sources now are {self.description}."

    # ------------------------------------------------------------------ the batch gradient
    def norm_layout(
        self, optimizer: torch.optim.Optimizer
    ) -> tuple[list[torch.nn.Parameter], Tensor, str | None, Tensor]:
        """The parameters whose ‖.grad‖² a step reads — the optimizer's, in its order (the list the stopper
        asks for, so that both read one pass), then measured ones it does not hold —, the position in
        ``(*SOURCES, "other")`` of each, on their device (built once per optimizer and parameter count: no
        host-to-device copy per step), the one source measuring all of them, if one does, and the position
        of each in :attr:`layers` (``len(layers)`` for a parameter of source 2 or of none)."""
        count = sum(len(group["params"]) for group in optimizer.param_groups)
        if self._norm_layout is None or self._norm_layout[:2] != (optimizer, count):
            source_of = {id(p): i for i, source in enumerate(SOURCES) for p in self.params[source]}
            layer_of = {id(p): i for i, layer in enumerate(self.layers) for p in self.layer_params[layer].values()}
            params = [p for group in optimizer.param_groups for p in group["params"]]
            held = {id(p) for p in params}
            params += [p for source in SOURCES for p in self.params[source] if id(p) not in held]
            where = [source_of.get(id(p), len(SOURCES)) for p in params]
            layers = [layer_of.get(id(p), len(self.layers)) for p in params]
            device = params[0].device if params else None
            whole = SOURCES[where[0]] if where and where[0] < len(SOURCES) and len(set(where)) == 1 else None
            self._norm_layout = (
                optimizer,
                count,
                params,
                torch.tensor(where, dtype=torch.long, device=device),
                whole,
                torch.tensor(layers, dtype=torch.long, device=device),
            )
        return self._norm_layout[2:]

    def params_of(self, layers: set[str]) -> set[str]:
        """The qualified names of the parameters of ``layers`` and of the layers they share a parameter with."""
        return {
            q for name in layers for member in self.collector.group(name) for q in self.layer_params.get(member, {})
        }
