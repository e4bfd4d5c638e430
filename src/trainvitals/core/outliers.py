"""The examples with the largest per-example gradient norms: the first to look at, since a mislabelled,
corrupt or duplicated example has a gradient far larger than the others' (BatchVarianceProbe's
``grad_noise/outliers`` panel)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trainvitals._markdown import markdown_table


@dataclass(frozen=True)
class Outliers:
    """The ``top_k`` largest ‖g_i‖ of a step, largest first.

    Attributes:
        ids: dataset rows where :attr:`by_row`, else positions in this process's batch of the step.
        norms: their ‖g_i‖.
        ratios: ‖g_i‖ over the step's median.
        by_row: whether :attr:`ids` are dataset rows.
    """

    ids: list[int]
    norms: list[float]
    ratios: list[float]
    by_row: bool

    def markdown(self, step: int) -> str:
        """The text panel: what to look at, and the table."""
        column = "dataset row" if self.by_row else "position in this process's batch of the step"
        how = ("" if self.by_row else " The dataset rows are unknown (a shuffled or distributed sampler): give the "
               "batch an `index` entry (a dict batch) to see them.")
        table = markdown_table((column, "‖g_i‖", "× median"),
                               [(i, f"{v:.4g}", f"{r:.3g}") for i, v, r in zip(self.ids, self.norms, self.ratios)],
                               align="rrr")
        return (f"**Largest per-example gradient norms at optimizer step {step}.** Look at these examples first: a "
                f"mislabelled, corrupt or duplicated example has a gradient far larger than the others'.{how}\n\n"
                + "\n".join(table))


def largest_examples(norms: Tensor, rows: list[Tensor | None], top_k: int) -> Outliers:
    """The ``top_k`` ≥ 1 largest of ``norms`` (``(N,)`` ‖g_i‖ of a step's examples, in order), by dataset
    row when ``rows`` (each micro-batch's rows, ``None`` where unknown) cover all N; one host transfer."""
    top = torch.topk(norms, min(top_k, norms.numel()))
    known = rows and all(r is not None for r in rows)
    rows_all = torch.cat([r.to(norms.device) for r in rows]) if known else None  # type: ignore[union-attr]
    by_row = rows_all is not None and rows_all.numel() == norms.numel()
    which = rows_all[top.indices] if by_row else top.indices  # type: ignore[index]
    ratio = top.values / norms.median().clamp_min(1e-30)
    ids, values, ratios = torch.stack([which.to(torch.float64), top.values.double(), ratio.double()]).cpu().tolist()
    return Outliers([int(i) for i in ids], values, ratios, bool(by_row))  # float64 holds ids exactly below 2**53
