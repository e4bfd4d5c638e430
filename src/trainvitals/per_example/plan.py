"""Which source measures the per-example spread of each trainable parameter."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from trainvitals.per_example.registry import rule_for, unsupported_reason
from trainvitals.per_example.tensor_ops import _trainable
from trainvitals.text.prose import by_reason, counted, listed


@dataclass(frozen=True)
class SourcePlan:
    """Which source measures the per-example spread of each trainable parameter.

    Attributes:
        per_example: modules (by qualified name) whose parameters get per-example norms in backward (1); one
            without a rule, where its forward broadcasts its own parameters over the batch
            (:class:`~.broadcast.BroadcastParameters`).
        micro_batch: parameters (qualified names) measured from micro-batches and DDP ranks (2).
        vmap: modules whose parameters get ``torch.func`` per-example gradients on a sub-batch (3).
        uncovered: parameters measured by nothing, with the reason.
        coupled: BatchNorm modules: they couple the examples of a (micro-)batch.
    """

    per_example: dict[str, nn.Module]
    micro_batch: dict[str, nn.Parameter]
    vmap: dict[str, nn.Module]
    uncovered: dict[str, str]
    coupled: tuple[str, ...]

    def parameters(self, source: str) -> dict[str, nn.Parameter]:
        """The trainable parameters of ``source`` (``"per_example"`` or ``"vmap"``), by qualified name; a
        tied parameter once, under its first owner's name."""
        return {q: p for params in self.layer_parameters(source).values() for q, p in params.items()}

    def layer_parameters(self, source: str) -> dict[str, dict[str, nn.Parameter]]:
        """:meth:`parameters` by module: each of ``source``'s modules' parameters by qualified name, a tied
        one under its first owner only."""
        out: dict[str, dict[str, nn.Parameter]] = {}
        seen: set[int] = set()
        for m, mod in getattr(self, source).items():
            out[m] = {}
            for n, p in (_measured_parameters(mod) if source == "per_example" else _trainable(mod)).items():
                if id(p) not in seen:
                    seen.add(id(p))
                    out[m][f"{m}.{n}" if m else n] = p
        return out

    def describe(self, model: nn.Module, sub_batch: int | None = None, exact: bool = True) -> str:
        """One line naming each source, its layers and its share of the trainable parameters (with ``sub_batch``,
        the examples per step of the torch.func source: ``exact``, or at most that many, before the batch is
        known)."""
        total = sum(p.numel() for p in model.parameters() if p.requires_grad) or 1

        def share(params: Iterable[nn.Parameter]) -> str:
            unique = {id(p): p for p in params}  # a tied parameter appears under several names
            return f"{sum(p.numel() for p in unique.values()) / total:.1%} of parameters"

        def kinds(modules: Mapping[str, nn.Module], graph: str | None = None) -> str:
            """Each type's count; a module without a rule counted as ``graph`` where one is given."""
            counts = Counter(
                type(m).__name__ if graph is None or rule_for(m) is not None else graph for m in modules.values()
            )
            return ", ".join(f"{k}×{v}" for k, v in counts.items())

        named = dict(model.named_parameters(remove_duplicate=False))
        parts = []
        if self.per_example:
            parts.append(
                f"per-example norms in backward: {kinds(self.per_example, 'parameters broadcast over the batch')} "
                f"({share(self.parameters('per_example').values())})"
            )
        if self.micro_batch:
            parts.append(f"micro-batches/ranks: {len(self.micro_batch)} tensors ({share(self.micro_batch.values())})")
        if self.vmap:
            of = f" of {'' if exact else 'up to '}{sub_batch} examples" if sub_batch else ""
            parts.append(
                f"torch.func vmap on a sub-batch{of}: {kinds(self.vmap)} ({share(self.parameters('vmap').values())})"
            )
        if self.uncovered:  # each reason with the tensors it keeps out, by name (the first few)
            reasons = "; ".join(f"{listed(names)}: {why}" for why, names in sorted(by_reason(self.uncovered).items()))
            tensors = counted(len(self.uncovered), "tensor")
            parts.append(f"not measured: {tensors} ({share(named[n] for n in self.uncovered)}), {reasons}")
        return "; ".join(parts) if parts else "no trainable parameters"


COMPILED_REASON = (
    "runs under torch.compile, where a hook would break the compiled graph; accumulate_grad_batches "
    ">= 2 or >= 2 devices measure it"
)
_CONTAINER_REASON = (
    "a parameter of a module whose forward also runs layers with weight matrices (torch.func would "
    "re-run them all); accumulate_grad_batches >= 2 or >= 2 devices measure it"
)
_NOT_BROADCAST_REASON = (
    "a parameter of a module whose forward also runs layers with weight matrices, which a step found not "
    "measurable where the graph broadcasts it over the examples (that step's warning says why); "
    "accumulate_grad_batches >= 2 or >= 2 devices measure it"
)


def _measured_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """What ``module``'s rule measures (its own trainable parameters, or also a child's that its forward
    uses without calling it); without a rule, its own."""
    rule = rule_for(module)
    return rule.parameters(module) if rule is not None else _trainable(module)


def _qualified(name: str, params: dict[str, nn.Parameter]) -> dict[str, nn.Parameter]:
    return {f"{name}.{n}" if name else n: p for n, p in params.items()}


def _units(model: nn.Module) -> list[tuple[str, nn.Module, dict[str, nn.Parameter]]]:
    """``(name, module, {qualified name: parameter})`` of each module that owns what it measures; a child
    whose parameters its parent's rule measures is no unit of its own."""
    units, covered = [], set()
    for name, module in model.named_modules():
        if name in covered:
            continue
        params = _measured_parameters(module)
        covered.update(f"{name}.{local}".lstrip(".").rpartition(".")[0] for local in params if "." in local)
        if params:
            units.append((name, module, _qualified(name, params)))
    return units


def _runs_weight_layers(module: nn.Module) -> bool:
    """Whether ``module``'s forward also runs layers with weight matrices (a Linear, a convolution): re-running
    it (torch.func) would re-run them all."""
    return any(p.dim() >= 2 for child in module.children() for p in child.parameters())


def plan_sources(
    model: nn.Module, groups_available: bool, fallback: bool, exclude: Iterable[str] = (), compiled: Iterable[str] = ()
) -> SourcePlan:
    """Assign each trainable parameter to a source: (1) per-example norms, else (2) micro-batches/ranks
    when there are at least two gradient groups per step, else (3) ``torch.func`` when ``fallback``.

    A module without a rule whose forward also runs layers with weight matrices (a ViT with its ``pos_embed``)
    has its own parameters measured by (1) where the loss's graph broadcasts them over the batch
    (:class:`~.broadcast.BroadcastParameters`); one whose graph shows another use fails its step, and is then
    excluded.

    Modules that share a parameter (an embedding tied to the output layer) are measured together by (1)
    when every one of them has a rule, else none of them by (1) or (3).

    Args:
        model: the model; each module's own parameters (``recurse=False``; with its rule's, also a
            child's its forward uses without calling it) are assigned together.
        groups_available: more than one micro-batch or rank per optimizer step.
        fallback: allow (3).
        exclude: module names that showed they cannot use (1) or (3) (parameters used outside their
            forward, a failed rule); they go to (2) or are not measured.
        compiled: modules (``""``: the model) whose calls run under ``torch.compile``, with everything inside
            them: (1) and (3) would hook inside their compiled graphs, so they go to (2) or are not measured.
    """
    excluded = set(exclude)
    regions = tuple(compiled)

    def inside(name: str) -> bool:
        return any(c == "" or name == c or name.startswith(c + ".") for c in regions)

    units = _units(model)
    coupled = tuple(n for n, m in model.named_modules() if isinstance(m, _BatchNorm) and unsupported_reason(m))
    # What rules out torch.func as well as the rules; a layer type without a rule does not. Nor does a
    # rule's unsupported configuration, except where the rule takes whole calls (tuple outputs, which
    # the fallback does not follow) or measures a child (which the fallback would not see).
    barred: dict[str, str | None] = {}
    for name, module, params in units:
        rule = rule_for(module)
        whole = rule is not None and (rule.whole_call or set(params) != set(_qualified(name, _trainable(module))))
        barred[name] = (
            (_NOT_BROADCAST_REASON if rule is None and _runs_weight_layers(module) else "excluded after a failed step")
            if name in excluded
            else COMPILED_REASON
            if inside(name)
            else unsupported_reason(module)
            if whole
            else None
        )
    reasons = {name: barred[name] or unsupported_reason(module) for name, module, _ in units}
    owners: dict[int, list[str]] = {}
    for name, _, params in units:
        for p in params.values():
            owners.setdefault(id(p), []).append(name)
    tied = [names for names in owners.values() if len(names) > 1]
    changed = True
    while changed:  # a group of tied modules is measured by its rules together, or not by them at all
        changed = False
        for names in tied:
            if any(reasons[n] for n in names) and not all(barred[n] for n in names):
                for n in names:
                    barred[n] = reasons[n] = "tied parameter"
                changed = True
    per_example, vmap, micro, uncovered = {}, {}, {}, {}
    for name, module, qualified in units:
        reason = reasons[name]
        if reason is None or (barred[name] is None and rule_for(module) is None and _runs_weight_layers(module)):
            per_example[name] = module
        elif groups_available:
            known = {id(p) for p in micro.values()}
            micro.update({n: p for n, p in qualified.items() if id(p) not in known})
        elif reason == COMPILED_REASON:
            uncovered.update(dict.fromkeys(qualified, reason))
        elif fallback and barred[name] is None and not isinstance(module, _BatchNorm):
            # A model's own position table, a block's layer-scale: torch.func would re-run the whole
            # subtree (the whole model, for the root) on every measured step. Weight matrices stand for
            # its compute: a LayerNorm child is cheap to re-run, a Linear or a convolution is not.
            if _runs_weight_layers(module):
                uncovered.update(dict.fromkeys(qualified, _CONTAINER_REASON))
            else:
                vmap[name] = module
        else:
            why = reason if not isinstance(module, _BatchNorm) else "BatchNorm couples the examples"
            uncovered.update(dict.fromkeys(qualified, why if fallback else f"{why}, fallback off"))
    return SourcePlan(per_example, micro, vmap, uncovered, coupled)
