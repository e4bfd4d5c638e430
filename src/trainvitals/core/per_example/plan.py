"""Which source measures the per-example spread of each trainable parameter."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from trainvitals.core.per_example._common import _trainable
from trainvitals.core.per_example.registry import unsupported_reason


@dataclass(frozen=True)
class SourcePlan:
    """Which source measures the per-example spread of each trainable parameter.

    Attributes:
        per_example: modules (by qualified name) whose parameters get per-example norms in backward (1).
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
        """The trainable parameters of ``source`` (``"per_example"`` or ``"vmap"``), by qualified name."""
        modules = getattr(self, source)
        return {f"{m}.{n}" if m else n: p for m, mod in modules.items() for n, p in _trainable(mod).items()}

    def describe(self, model: nn.Module) -> str:
        """One line naming each source, its layers and its share of the trainable parameters."""
        total = sum(p.numel() for p in model.parameters() if p.requires_grad) or 1

        def share(params: Iterable[nn.Parameter]) -> str:
            unique = {id(p): p for p in params}  # a tied parameter appears under several names
            return f"{sum(p.numel() for p in unique.values()) / total:.1%} of parameters"

        def kinds(modules: Mapping[str, nn.Module]) -> str:
            counts = Counter(type(m).__name__ for m in modules.values())
            return ", ".join(f"{k}×{v}" for k, v in counts.items())

        named = dict(model.named_parameters(remove_duplicate=False))
        parts = []
        if self.per_example:
            parts.append(f"per-example norms in backward: {kinds(self.per_example)} "
                         f"({share(self.parameters('per_example').values())})")
        if self.micro_batch:
            parts.append(f"micro-batches/ranks: {len(self.micro_batch)} tensors ({share(self.micro_batch.values())})")
        if self.vmap:
            parts.append(f"torch.func vmap on a sub-batch: {kinds(self.vmap)} "
                         f"({share(self.parameters('vmap').values())})")
        if self.uncovered:
            reasons = sorted(set(self.uncovered.values()))
            parts.append(f"not measured: {len(self.uncovered)} tensors "
                         f"({share(named[n] for n in self.uncovered)}; {'; '.join(reasons)})")
        return "; ".join(parts) if parts else "no trainable parameters"


# nn.MultiheadAttention's functional forward uses out_proj's weight without calling out_proj, and
# returns a tuple: neither the per-example hooks nor the torch.func fallback see its parameters.
_ATTENTION_REASON = ("nn.MultiheadAttention (its forward uses out_proj's weight without calling out_proj; "
                     "attention written with nn.Linear projections gets per-example norms)")


_CONTAINER_REASON = ("a parameter of a module whose forward also runs layers with weight matrices (torch.func would "
                     "re-run them all); accumulate_grad_batches >= 2 or >= 2 devices measure it")


def plan_sources(model: nn.Module, groups_available: bool, fallback: bool, exclude: Iterable[str] = ()) -> SourcePlan:
    """Assign each trainable parameter to a source: (1) per-example norms, else (2) micro-batches/ranks
    when there are at least two gradient groups per step, else (3) ``torch.func`` when ``fallback``.

    Args:
        model: the model; each module's own parameters (``recurse=False``) are assigned together.
        groups_available: more than one micro-batch or rank per optimizer step.
        fallback: allow (3).
        exclude: module names that showed they cannot use (1) or (3) (called twice per forward,
            parameters used outside their forward); they go to (2) or are not measured.
    """
    excluded = set(exclude)
    owners: Counter[int] = Counter(id(p) for _, m in model.named_modules() for p in _trainable(m).values())
    per_example, vmap, micro, uncovered = {}, {}, {}, {}
    coupled = tuple(n for n, m in model.named_modules() if isinstance(m, _BatchNorm) and unsupported_reason(m))
    attention = {n: m for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)}
    attention.update({f"{n}.out_proj" if n else "out_proj": m.out_proj for n, m in list(attention.items())})
    for name, module in model.named_modules():
        params = _trainable(module)
        if not params:
            continue
        qualified = {f"{name}.{n}" if name else n: p for n, p in params.items()}
        tied = any(owners[id(p)] > 1 for p in params.values())
        # What rules out torch.func as well as the identities; a layer type without an identity does not.
        barred = "tied parameter" if tied else (
            "excluded after a failed step" if name in excluded else _ATTENTION_REASON if name in attention else None)
        reason = barred or unsupported_reason(module)
        if reason is None:
            per_example[name] = module
        elif groups_available:
            known = {id(p) for p in micro.values()}
            micro.update({n: p for n, p in qualified.items() if id(p) not in known})
        elif fallback and barred is None and not isinstance(module, _BatchNorm):
            # A model's own position table, a block's layer-scale: torch.func would re-run the whole
            # subtree (the whole model, for the root) on every measured step. Weight matrices stand for
            # its compute: a LayerNorm child is cheap to re-run, a Linear or a convolution is not.
            if any(p.dim() >= 2 for child in module.children() for p in child.parameters()):
                uncovered.update(dict.fromkeys(qualified, _CONTAINER_REASON))
            else:
                vmap[name] = module
        else:
            why = reason if not isinstance(module, _BatchNorm) else "BatchNorm couples the examples"
            uncovered.update(dict.fromkeys(qualified, why if fallback else f"{why}, fallback off"))
    return SourcePlan(per_example, micro, vmap, uncovered, coupled)
