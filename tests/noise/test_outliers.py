"""core.outliers: the largest per-example gradient norms, by dataset row where the rows are known, and which
parameters they cover."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainvitals.noise.outliers import WHOLE, largest_examples, norm_coverage


def test_the_largest_norms_by_dataset_row_with_their_ratio_to_the_median():
    norms = torch.tensor([1.0, 9.0, 2.0, 3.0, 7.0])
    rows = [torch.tensor([40, 41, 42]), torch.tensor([10, 11])]  # two micro-batches
    outliers = largest_examples(norms, rows, 2)
    assert outliers.by_row and outliers.ids == [41, 11] and outliers.norms == [9.0, 7.0]
    assert outliers.ratios == pytest.approx([9.0 / 3.0, 7.0 / 3.0])
    assert "| dataset row | ‖g_i‖ | × median |" in outliers.markdown(5) and "| 41 | 9 | 3 |" in outliers.markdown(5)


def test_without_every_micro_batch_s_rows_the_ids_are_positions():
    norms = torch.tensor([1.0, 9.0, 2.0])
    for rows in ([torch.tensor([4, 5]), None], [], [torch.tensor([4, 5])]):  # unknown, none, or not all rows
        outliers = largest_examples(norms, rows, 5)
        assert not outliers.by_row and outliers.ids == [1, 2, 0]
        assert "`index` entry" in outliers.markdown(0)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wpe = nn.Parameter(torch.zeros(7, 4))
        self.body = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.head = nn.Linear(4, 2)
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.block = nn.Sequential(nn.Linear(4, 4))
        self.block.gamma = nn.Parameter(torch.ones(4))  # a block's layer scale: its own name, not the block's


def test_the_coverage_names_what_the_norms_leave_out_and_counts_batchnorm():
    model = Model()
    linears = [*model.body[0].parameters(), *model.body[2].parameters()]
    total = 7 * 4 + 2 * 20 + 4 * 4 + 10 + 24  # the trainable ones: the frozen layer is no part of the whole
    assert norm_coverage(model, [*linears, *model.block[0].parameters()]) == (
        f"over {60 / total:.1%} of parameters (not: 4 BatchNorm tensors, `wpe`, `head`, `block.gamma`)"
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert norm_coverage(model, trainable) == WHOLE == "over all trainable parameters"
    assert norm_coverage(model, trainable[1:]) == f"over {1 - 28 / total:.1%} of parameters (not: `wpe`)"


def test_a_coverage_short_of_the_whole_never_reads_100_percent():
    big = nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1, 1, bias=False))
    assert norm_coverage(big, big[0].parameters()) == "over >99.9% of parameters (not: `1`)"


def test_the_panel_says_what_it_covers():
    outliers = largest_examples(torch.tensor([1.0, 2.0]), [], 1, "over 50.0% of parameters (not: `wpe`)")
    assert outliers.coverage == "over 50.0% of parameters (not: `wpe`)"
    assert outliers.markdown(3).startswith(
        "**Largest per-example gradient norms at optimizer step 3, over 50.0% of parameters (not: `wpe`).**"
    )
    assert largest_examples(torch.tensor([1.0]), [], 1).coverage == WHOLE
