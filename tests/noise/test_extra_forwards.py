"""Forwards trainvitals runs for its own purpose (LRScalingAdvisor's loss probe: the first batch under ``no_grad``,
then twice over) are invisible to BatchVarianceProbe: not measured, not read as layout evidence."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from conftest import trainer_kwargs
from test_probe import rel
from torch.utils.data import DataLoader, TensorDataset

from trainvitals.lr_scaling.advisor import LRScalingAdvisor
from trainvitals.noise.probe import BatchVarianceProbe

VOCAB, LABELS = 50, 3


class HFBert(pl.LightningModule):
    """A tiny HF BERT classifier from its config, with HF's gradient checkpointing (which makes the word
    embeddings' output require grad, under ``no_grad`` too: their forward hook then sees the advisor's calls)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        config = transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=64,
            num_labels=LABELS,
        )
        self.model = transformers.BertForSequenceClassification(config)
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        return self.model(input_ids=ids, labels=labels).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit_bert(batch: int, tokens: int, reentrant: bool, advisor: bool) -> tuple[BatchVarianceProbe, list[str]]:
    """Three steps of :class:`HFBert` on T = ``tokens``, B = ``batch``; the probe and its messages."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randint(0, VOCAB, (3 * batch, tokens), generator=g), torch.randint(0, LABELS, (3 * batch,), generator=g)
    )
    probe = BatchVarianceProbe(histogram_every_n_steps=0)
    callbacks = [probe, LRScalingAdvisor()] if advisor else [probe]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pl.Trainer(**trainer_kwargs(max_steps=3, callbacks=callbacks)).fit(
            HFBert(reentrant), DataLoader(data, batch_size=batch)
        )
    return probe, [str(w.message) for w in caught if "BatchVarianceProbe" in str(w.message)]


@pytest.mark.parametrize(
    ("batch", "tokens", "reentrant"), [(16, 16, False), (16, 16, True), (8, 16, False), (32, 16, False)]
)
def test_the_advisors_probing_forwards_leave_the_probes_estimate_as_it_is_alone(batch, tokens, reentrant):
    """With T = B, the advisor's forward on the batch twice over, (2B, T), would show the examples on dimension 1,
    against dimension 0 at the step's own forward; at T ≠ B a first dimension of 2B is no batch. Run as its own,
    it changes nothing: the same share measured, the same messages, the same estimate."""
    alone, said_alone = fit_bert(batch, tokens, reentrant, advisor=False)
    probe, said = fit_bert(batch, tokens, reentrant, advisor=True)
    assert int(probe.noise.count) == int(alone.noise.count) == 3
    assert probe.noise_source.param_share == alone.noise_source.param_share > 0.8
    assert said == said_alone
    assert not any("both of their first two" in m or "both of its first two" in m for m in said)
    assert rel(float(probe.noise.trace_cov), float(alone.noise.trace_cov)) < 1e-6
    assert rel(float(probe.noise.grad_sq_norm), float(alone.noise.grad_sq_norm)) < 1e-6
