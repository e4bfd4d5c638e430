"""MicroBatchMeanCheck: a GRU LM whose length-bucketed micro-batches each average their own tokens under
gradient accumulation is told so, with the counts and the fix; equal counts and a normalisation by the effective
batch's tokens are not. The probe says one thing of the same loss's reduction."""

from __future__ import annotations

import logging
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from conftest import trainer_kwargs
from torch import nn
from torch.utils.data import DataLoader

from trainvitals.integrity.callback import GraphIntegrityCallback
from trainvitals.integrity.checks.accumulation import UNEVEN_MICRO_BATCH_MEANS
from trainvitals.noise.probe import BatchVarianceProbe

V, T, B, A = 12, 10, 4, 4  # vocabulary, longest sequence, examples per micro-batch, micro-batches per step
PAD = -100


def bucketed(lengths: list[list[int]]) -> list[dict[str, torch.Tensor]]:
    """One micro-batch per bucket: B token sequences of the bucket's lengths, the rest padding; ``tokens``: the
    targets the accumulation cycle that holds the micro-batch keeps (what a correct loss divides by)."""
    g = torch.Generator().manual_seed(0)
    batches = []
    for bucket in lengths:
        x = torch.randint(0, V, (B, T), generator=g)
        y = torch.randint(0, V, (B, T), generator=g)
        for b, n in enumerate(bucket):
            y[b, n:] = PAD
        batches.append({"x": x, "y": y})
    for start in range(0, len(batches), A):
        cycle = batches[start : start + A]
        total = sum(int((b["y"] != PAD).sum()) for b in cycle)
        for b in cycle:
            b["tokens"] = torch.tensor(total)
    return batches


LENGTH_BUCKETED = [[2, 2, 3, 3], [9, 9, 10, 10], [4, 5, 5, 5], [7, 7, 8, 8]] * 2  # 10, 38, 19, 30 tokens
EQUAL_TOKENS = [[2, 4, 6, 8], [5, 5, 5, 5], [10, 10, 0, 0], [8, 7, 3, 2]] * 2  # 20 tokens each


class GRULM(pl.LightningModule):
    """A GRU language model; ``loss`` picks how the token losses become the micro-batch's loss."""

    def __init__(self, loss: str = "masked_mean") -> None:
        super().__init__()
        self.loss = loss
        self.embed = nn.Embedding(V, 8)
        self.rnn = nn.GRU(8, 16, batch_first=True)
        self.head = nn.Linear(16, V)

    def training_step(self, batch, batch_idx):
        logits = self.head(self.rnn(self.embed(batch["x"]))[0])
        y = batch["y"]
        mask = y != PAD
        if self.loss == "masked_mean":  # transformers#24725
            return F.cross_entropy(logits[mask], y[mask])
        if self.loss == "ignore_index":
            return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=PAD)
        token_losses = F.cross_entropy(logits.transpose(1, 2), y.clamp(min=0), reduction="none") * mask
        if self.loss == "mask_sum":
            return token_losses.sum() / mask.sum()
        # The fix: the effective batch's tokens, times the accumulate_grad_batches Lightning divides by
        return token_losses.sum() * self.trainer.accumulate_grad_batches / batch["tokens"]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(
    model: GRULM, lengths: list[list[int]], accumulate: int = A, callbacks=None, steps: int = 2, said=None, window=1
):
    """Fit ``steps`` optimizer steps in check windows of ``window`` steps; ``said``: a list the warnings' messages
    are appended to."""
    cb = GraphIntegrityCallback(check_every_n_steps=window, dead_after_steps=window)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pl.Trainer(
            **trainer_kwargs(max_steps=steps, accumulate_grad_batches=accumulate, callbacks=[cb, *(callbacks or [])])
        ).fit(model, DataLoader(bucketed(lengths), batch_size=None))
    if said is not None:
        said += [str(w.message) for w in caught]
    return cb


@pytest.mark.parametrize("loss", ["masked_mean", "ignore_index", "mask_sum"])
def test_micro_batch_token_means_under_accumulation_are_named_with_their_counts_and_the_fix(loss):
    cb = fit(GRULM(loss), LENGTH_BUCKETED)
    (found,) = [f for f in cb.findings if f.kind is UNEVEN_MICRO_BATCH_MEANS]
    counts = [sum(bucket) for bucket in LENGTH_BUCKETED[:A]]  # the hand count of each micro-batch's tokens
    assert counts == [10, 38, 19, 30]
    assert f"({', '.join(map(str, counts))} in optimizer step 0)" in found.message
    assert f"the micro-batch with 10 weighs {38 / 10:.3g}× one of the micro-batch with 38" in found.message
    assert "divide by the total count across the accumulated micro-batches" in found.message
    assert "reduction='sum'" in found.message and "accumulate_grad_batches" in found.message
    assert cb.counts[UNEVEN_MICRO_BATCH_MEANS] == 2  # both steps' windows


def test_the_counts_are_those_of_the_step_they_are_said_to_be_from():
    """A window of three optimizer steps closes at step 2, but reads the counts at step 0: the finding names step 0
    with step 0's counts, not step 2's (whose micro-batches hold other counts)."""
    lengths = [[2, 2, 3, 3], [9, 9, 10, 10], [4, 5, 5, 5], [7, 7, 8, 8]]  # step 0: 10, 38, 19, 30 tokens
    lengths += [[1, 1, 1, 1], [3, 3, 3, 3], [6, 6, 6, 6], [2, 2, 2, 2]] * 2  # steps 1 and 2: 4, 12, 24, 8
    cb = fit(GRULM("masked_mean"), lengths, steps=3, window=3)
    (found,) = [f for f in cb.findings if f.kind is UNEVEN_MICRO_BATCH_MEANS]
    at_step = {step: [sum(bucket) for bucket in lengths[A * step : A * step + A]] for step in range(3)}
    assert at_step[0] == [10, 38, 19, 30] and at_step[2] == [4, 12, 24, 8]  # the hand count of each micro-batch
    assert found.step == 0
    assert "(10, 38, 19, 30 in optimizer step 0)" in found.message
    assert "step 2" not in found.message and "4, 12, 24, 8" not in found.message
    assert cb.counts[UNEVEN_MICRO_BATCH_MEANS] == 1  # one window


@pytest.mark.parametrize(
    ("loss", "lengths", "accumulate"),
    [
        ("masked_mean", EQUAL_TOKENS, A),  # every micro-batch averages 20 tokens: equal weights
        ("ignore_index", EQUAL_TOKENS, A),
        ("effective_batch", LENGTH_BUCKETED, A),  # normalised by the effective batch's tokens
        ("masked_mean", LENGTH_BUCKETED, 1),  # no accumulation: one mean per step
    ],
)
def test_equal_counts_a_normalisation_by_the_effective_batch_or_no_accumulation_are_clean(loss, lengths, accumulate):
    cb = fit(GRULM(loss), lengths, accumulate)
    assert UNEVEN_MICRO_BATCH_MEANS not in cb.counts
    assert cb.findings == []


def test_a_smaller_last_micro_batch_of_a_mean_over_examples_is_lightnings_own_averaging():
    """An epoch of 10 examples in micro-batches of 4, 4 and 2: the last one's examples weigh twice as much, but
    the mean's count per example is the same: not this check's finding."""

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(3, 2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(10, 3), torch.randint(0, 2, (10,)))
    cb = GraphIntegrityCallback(check_every_n_steps=1, dead_after_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Trainer's warnings of a tiny run
        pl.Trainer(**trainer_kwargs(max_epochs=1, accumulate_grad_batches=3, callbacks=[cb])).fit(
            Classifier(), DataLoader(data, batch_size=4)
        )
    assert cb.findings == []


def test_the_probe_says_one_thing_of_the_reduction_of_a_token_mean_over_a_mask(caplog):
    """A token mean over a padding mask keeps a number of tokens that is no multiple of the examples: read from
    the graph as a mean over the examples, said once, and never also "could not tell"."""
    probe, warned = BatchVarianceProbe(log_every_n_steps=1, histogram_every_n_steps=0), []
    with caplog.at_level(logging.INFO):
        fit(GRULM("masked_mean"), LENGTH_BUCKETED, callbacks=[probe], said=warned)
    said = caplog.text + "\n".join(warned)
    assert said.count("the loss is a mean over the examples (read from the loss's graph)") == 1
    assert "could not tell" not in said


def test_the_probe_that_cannot_read_the_reduction_says_it_assumes_one_and_nothing_else(caplog):
    """A loss whose graph says nothing (a logsumexp over the batch): the warning that a mean is assumed, once,
    and no "read from the loss's graph" however many micro-batches."""

    class Unreadable(GRULM):
        def training_step(self, batch, batch_idx):
            logits = self.head(self.rnn(self.embed(batch["x"]))[0])
            return torch.logsumexp(logits.flatten(), 0) / 100

    probe, warned = BatchVarianceProbe(log_every_n_steps=1, histogram_every_n_steps=0), []
    with caplog.at_level(logging.INFO):
        fit(Unreadable(), LENGTH_BUCKETED, callbacks=[probe], said=warned)
    said = caplog.text + "\n".join(warned)
    assert said.count("could not tell from the loss's graph whether it is a mean or a sum") == 1
    assert "read from the loss's graph" not in said
