"""A graph carried across steps: the loss reaches autograd nodes created in an earlier step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from trainvitals.integrity.checks.base import Check, Fit, register_check
from trainvitals.integrity.diagnoses import describe_stale_graph
from trainvitals.integrity.findings import FindingKind
from trainvitals.integrity.graph import GraphWalk

if TYPE_CHECKING:
    import lightning.pytorch as pl

STALE_GRAPH = FindingKind(
    "stale_graph",
    metric="leaked_graphs",
    label="losses reaching an earlier step's graph",
    critical="the loss reached autograd nodes of an earlier step ({n} walk(s)): a graph kept alive across steps "
    "(total += loss, a hidden state not detached)",
)


@register_check(order=30)
class StaleGraphCheck(Check):
    """On a walk: nodes numbered before the step's mark (state carried across steps), named by the
    module attribute that carries them. Logs ``graph/leaked_graphs``, the walked losses that did."""

    kinds = (STALE_GRAPH,)

    def __init__(self) -> None:
        self._leaked = 0

    def on_window_open(self, fit: Fit, trainer: "pl.Trainer") -> None:
        self._leaked = 0

    def on_walk(
        self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Tensor, walk: GraphWalk
    ) -> None:
        if walk.stale:
            self._leaked += 1
            fit.record(STALE_GRAPH, *describe_stale_graph(pl_module, walk.stale, fit.mark))

    def on_window_close(self, fit: Fit, trainer: "pl.Trainer", complete: bool) -> dict[str, float]:
        return {STALE_GRAPH.window_tag: float(self._leaked)}
