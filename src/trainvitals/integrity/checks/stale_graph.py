"""A graph carried across steps: the loss reaches autograd nodes created in an earlier step."""

from __future__ import annotations

import lightning.pytorch as pl
from torch import Tensor

from trainvitals.integrity.checks.base import Check, Fit
from trainvitals.integrity.diagnoses import describe_stale_graph
from trainvitals.integrity.findings import FindingKind
from trainvitals.integrity.graph import GraphWalk


class StaleGraphCheck(Check):
    """On a walk: nodes numbered before the step's mark (state carried across steps), named by the
    module attribute that carries them. Logs ``graph/leaked_graphs``, the walked losses that did."""

    kinds = (FindingKind.STALE_GRAPH,)

    def __init__(self) -> None:
        self._leaked = 0

    def on_window_open(self, fit: Fit, trainer: "pl.Trainer") -> None:
        self._leaked = 0

    def on_walk(
        self, fit: Fit, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Tensor, walk: GraphWalk
    ) -> None:
        if walk.stale:
            self._leaked += 1
            fit.record(FindingKind.STALE_GRAPH, *describe_stale_graph(pl_module, walk.stale, fit.mark))

    def on_window_close(self, fit: Fit, trainer: "pl.Trainer", complete: bool) -> dict[str, float]:
        return {FindingKind.STALE_GRAPH.window_tag: float(self._leaked)}
