"""core.outliers: the largest per-example gradient norms, by dataset row where the rows are known."""

from __future__ import annotations

import pytest
import torch

from trainvitals.core.outliers import largest_examples


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
