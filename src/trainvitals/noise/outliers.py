"""The examples with the largest per-example gradient norms: the first to look at, since a mislabelled,
corrupt or duplicated example has a gradient far larger than the others' (BatchVarianceProbe's
``grad_noise/outliers`` panel), and which parameters their norms are over."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from trainvitals.text.markdown import markdown_table
from trainvitals.text.prose import counted, listed

WHOLE = "over all trainable parameters"
"""What :func:`norm_coverage` says of norms over every trainable parameter."""


def norm_coverage(model: nn.Module, measured: Iterable[nn.Parameter]) -> str:
    """What per-example norms over ``measured`` cover of ``model``'s trainable parameters: :data:`WHOLE`, else
    ``"over 9.7% of parameters (not: 12 BatchNorm tensors, `wpe`)"``: the share of the parameter count, and
    the others by layer (a module without parameterised children), else by name, BatchNorm's counted."""
    trainable = {id(p): p for p in model.parameters() if p.requires_grad}
    missing = trainable.keys() - {id(p) for p in measured}
    if not missing:
        return WHOLE
    share = 1 - sum(trainable[i].numel() for i in missing) / sum(p.numel() for p in trainable.values())
    batchnorm, names = 0, []
    for name, module in model.named_modules():
        layer = name and not any(True for child in module.children() for _ in child.parameters())
        for qualified, p in module.named_parameters(prefix=name, recurse=False):
            if id(p) not in missing:
                continue
            missing.discard(id(p))  # a tied parameter under its first owner
            if isinstance(module, _BatchNorm):
                batchnorm += 1
            elif (name if layer else qualified) not in names:
                names.append(name if layer else qualified)
    percent = f"{share:.1%}"
    parts = [counted(batchnorm, "BatchNorm tensor")] if batchnorm else []
    parts += [listed(names)] if names else []
    return f"over {'>99.9%' if percent == '100.0%' else percent} of parameters (not: {', '.join(parts)})"


@dataclass(frozen=True)
class Outliers:
    """The ``top_k`` largest ‖g_i‖ of a step, largest first.

    Attributes:
        ids: dataset rows where :attr:`by_row`, else positions in this process's batch of the step.
        norms: their ‖g_i‖.
        ratios: ‖g_i‖ over the step's median.
        by_row: whether :attr:`ids` are dataset rows.
        coverage: which parameters the norms are over (:func:`norm_coverage`).
    """

    ids: list[int]
    norms: list[float]
    ratios: list[float]
    by_row: bool
    coverage: str = WHOLE

    def markdown(self, step: int) -> str:
        """The text panel: what to look at, and the table."""
        column = "dataset row" if self.by_row else "position in this process's batch of the step"
        how = (
            ""
            if self.by_row
            else " The dataset rows are unknown (a shuffled or distributed sampler): give the "
            "batch an `index` entry (a dict batch) to see them."
        )
        table = markdown_table(
            (column, "‖g_i‖", "× median"),
            [(i, f"{v:.4g}", f"{r:.3g}") for i, v, r in zip(self.ids, self.norms, self.ratios)],
            align="rrr",
        )
        return (
            f"**Largest per-example gradient norms at optimizer step {step}, {self.coverage}.** Look at these "
            "examples first: a mislabelled, corrupt or duplicated example has a gradient far larger than the "
            f"others'.{how}\n\n" + "\n".join(table)
        )


def largest_examples(norms: Tensor, rows: list[Tensor | None], top_k: int, coverage: str = WHOLE) -> Outliers:
    """The ``top_k`` ≥ 1 largest of ``norms`` (``(N,)`` ‖g_i‖ of a step's examples, in order, over the
    parameters ``coverage`` says), by dataset row when ``rows`` (each micro-batch's rows, ``None`` where
    unknown) cover all N; one host transfer."""
    top = torch.topk(norms, min(top_k, norms.numel()))
    known = rows and all(r is not None for r in rows)
    rows_all = torch.cat([r.to(norms.device) for r in rows]) if known else None  # type: ignore[union-attr]
    by_row = rows_all is not None and rows_all.numel() == norms.numel()
    which = rows_all[top.indices] if by_row else top.indices  # type: ignore[index]
    ratio = top.values / norms.median().clamp_min(1e-30)
    ids, values, ratios = torch.stack([which.to(torch.float64), top.values.double(), ratio.double()]).cpu().tolist()
    return Outliers(
        [int(i) for i in ids], values, ratios, bool(by_row), coverage
    )  # float64 holds ids exactly below 2**53
