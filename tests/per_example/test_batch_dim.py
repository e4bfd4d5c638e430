"""Which dimension holds the examples when a layer's input has the batch on both of its first two (T = B):
sequence-first models at T = B against a brute-force loop over the examples, each alone through the model and
every trainable parameter, in float64 (core.per_example.layout)."""

from __future__ import annotations

import warnings
from collections import UserDict
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from conftest import HostReads, RecordingLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainvitals.noise.probe import BatchVarianceProbe
from trainvitals.per_example import Layouts, PerExampleGradients, plan_sources

B, V, D = 5, 11, 8


class SequenceFirstEncoder(nn.Module):
    """PyTorch's transformer tutorial: (B, T) ids transposed to (T, B), nn.TransformerEncoder at its default
    batch_first=False, a classifier on the mean over positions. ``batch_first=True``: the same, batch-first."""

    def __init__(self, batch_first: bool = False) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(V, D)
        layer = nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=batch_first)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(D, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.batch_first:
            return self.head(self.enc(self.emb(ids)).mean(1))
        return self.head(self.enc(self.emb(ids.t())).mean(0))


class WordLM(nn.Module):
    """PyTorch's word_language_model: Embedding → LSTM (batch_first=False) → Linear on (T, B); logits (B, T, V)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Embedding(V, D)
        self.rnn = nn.LSTM(D, 6)
        self.decoder = nn.Linear(6, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.rnn(self.encoder(ids.t()))[0]).transpose(0, 1)


class TinySequenceFirst(nn.Module):
    """Embedding → Linear on (T, B) ids, with nothing in the model that says it is sequence-first; ``copy``:
    the ids copied after the transposition (no longer a view of the batch)."""

    def __init__(self, copy: bool = False) -> None:
        super().__init__()
        self.copy = copy
        self.emb = nn.Embedding(V, D)
        self.dec = nn.Linear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.t().contiguous() if self.copy else ids.t()
        return self.dec(torch.tanh(self.emb(ids))).transpose(0, 1)


class GPT(nn.Module):
    """nanoGPT, batch-first and tiny: token and position tables (wpe looked up with arange(T)), one block of
    LayerNorm, a q/k/v Linear, causal attention, an output Linear and an MLP, a final LayerNorm and the head."""

    def __init__(self, block: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(block, D)
        self.ln1, self.qkv, self.proj = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.ln2, self.fc, self.out = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        q, k, v = self.qkv(self.ln1(x)).split(D, -1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        x = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return self.head(self.ln_f(x))


class RelativeBias(nn.Module):
    """T5's attention bias, batch-first: a (T, T) table of relative-position buckets looked up in an Embedding
    and broadcast over the batch; the token embedding and the projections are per example."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.bias = nn.Embedding(V, D), nn.Embedding(7, 1)
        self.q, self.k, self.head = nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False), nn.Linear(D, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x, t = self.tokens(ids), ids.shape[1]
        buckets = (torch.arange(t)[None, :] - torch.arange(t)[:, None]).clamp(-3, 3) + 3
        scores = self.q(x) @ self.k(x).transpose(1, 2) + self.bias(buckets)[..., 0]
        return self.head(scores.softmax(-1) @ x).mean(1)


def per_example_losses(model: nn.Module, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each example's own loss: cross-entropy of its classes, or its tokens' mean for a language model."""
    out = model(ids)
    if out.dim() == 3:
        return F.cross_entropy(out.transpose(1, 2), y, reduction="none").mean(1)
    return F.cross_entropy(out, y, reduction="none")


def brute_force(model: nn.Module, ids: torch.Tensor, y: torch.Tensor, skip: tuple[str, ...] = ()) -> torch.Tensor:
    """``(B, P)``: each example's gradient alone through the model, over every trainable parameter not under
    ``skip``."""
    params = [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith(skip)]
    return torch.stack(
        [
            torch.cat(
                [
                    g.flatten()
                    for g in torch.autograd.grad(per_example_losses(model, ids[i : i + 1], y[i : i + 1])[0], params)
                ]
            )
            for i in range(ids.shape[0])
        ]
    )


def collect(model: nn.Module, ids: torch.Tensor, y: torch.Tensor, layouts: Layouts, batch: Any = None):
    """One backward of the summed losses with every layer of the plan hooked; ``batch``: told to the collector."""
    plan = plan_sources(model, groups_available=False, fallback=False)
    assert set(plan.parameters("per_example")) == {n for n, p in model.named_parameters() if p.requires_grad}
    collector = PerExampleGradients(plan.per_example, {}, 2, layouts)
    collector.attach(keep_norms=True)
    collector.begin_micro_batch()
    collector.expect_batch(ids.shape[0], batch)
    per_example_losses(model, ids, y).sum().backward()
    collector.end_micro_batch(1.0)
    collector.detach()
    model.zero_grad()
    return collector.pop()


def data(model: nn.Module, t: int, b: int = B) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    ids = torch.randint(0, V, (b, t), generator=g)
    return ids, torch.randint(0, V if isinstance(model, (WordLM, TinySequenceFirst, GPT)) else 3, (b, t), generator=g)


def make(cls: type[nn.Module], *args: Any) -> nn.Module:
    torch.manual_seed(0)
    return cls(*args).double()


def targets(model: nn.Module, y: torch.Tensor) -> torch.Tensor:
    return y if isinstance(model, (WordLM, TinySequenceFirst, GPT)) else y[:, 0] % 3


def assert_exact(step, truth: torch.Tensor) -> None:
    assert not step.failed
    ours = step.sq_norms[0]
    assert torch.allclose(ours, truth.square().sum(1), rtol=1e-9, atol=0), (ours, truth.square().sum(1))


@pytest.mark.parametrize("t", [B, B + 2])
@pytest.mark.parametrize(
    "cls, args",
    [(SequenceFirstEncoder, ()), (SequenceFirstEncoder, (True,)), (WordLM, ())],
    ids=["transformer-sequence-first", "transformer-batch-first", "word-lm"],
)
def test_the_model_s_batch_first_modules_give_the_layout_at_T_equal_B(cls, args, t):
    """nn.TransformerEncoder (its Linear and LayerNorm layers get its attention's layout, the embedding beside it
    too) and an embedding and decoder beside an LSTM, sequence-first or not, exact at T = B as at T ≠ B, with no
    input told: the modules' batch_first says it."""
    model = make(cls, *args)
    ids, y = data(model, t)
    y = targets(model, y)
    layouts = Layouts(model)
    assert_exact(collect(model, ids, y, layouts), brute_force(model, ids, y))
    assert not layouts.assumed


def test_a_layer_with_no_evidence_is_taken_batch_first_and_named():
    """Embedding → Linear on (T, B) with T = B, nothing told: the inputs are taken batch-first, listed with their
    shape, and the note (said once) names them and the override."""
    model = make(TinySequenceFirst, True)
    ids, y = data(model, B)
    layouts = Layouts(model)
    step = collect(model, ids, y, layouts, batch=(ids, y))  # copied ids: not a view of the batch
    assert not step.failed and set(layouts.assumed) == {"emb", "dec"}
    assert layouts.assumed["emb"] == ((B, B), B)
    note = layouts.assumed_note()
    assert "emb, dec" in note and "(5, 5)" in note and "sequence_first=True" in note
    assert layouts.assumed_note() is None  # once
    truth = brute_force(model, ids, y).square().sum(1)
    assert not torch.allclose(step.sq_norms[0], truth)  # per-position norms: why it is said


@pytest.mark.parametrize("how", ["override", "batch-view", "earlier-call"])
def test_a_sequence_first_model_at_T_equal_B_is_exact_with_evidence(how):
    """The same model is exact with ``sequence_first=True``, with ids that are a view of the batch (the model
    transposes them), and after a call whose shape told (T ≠ B), kept over collectors (the probe's re-plans)."""
    model = make(TinySequenceFirst, how != "batch-view")
    ids, y = data(model, B)
    layouts = Layouts(model, sequence_first=True if how == "override" else None)
    if how == "earlier-call":
        longer, y_longer = data(model, B + 1)
        assert_exact(collect(model, longer, y_longer, layouts), brute_force(model, longer, y_longer))
    assert_exact(collect(model, ids, y, layouts, batch=(ids, y)), brute_force(model, ids, y))
    assert not layouts.assumed


def test_a_batch_first_gpt_at_T_equal_B_is_shown_by_its_token_ids_in_any_batch_container():
    """nanoGPT with block = batch: the token ids are the batch's (here in a ``UserDict``, as an HF
    ``BatchEncoding``), which shows every other layer batch-first; exact, nothing assumed."""
    model = make(GPT, B)
    ids, y = data(model, B)
    layouts = Layouts(model)
    step = collect(model, ids, y, layouts, batch=UserDict(input_ids=ids, labels=y))
    assert set(step.failed) == {"wpe"}  # looked up with arange(T): shared by the batch
    step.failed.clear()
    assert_exact(step, brute_force(model, ids, y, skip=("wpe",)))
    assert not layouts.assumed and layouts._seen == {"wte": {0}}


def test_a_channels_last_layer_with_H_equal_B_is_not_taken_for_a_sequence():
    """ConvNeXt's block: LayerNorm and Linear on (B, H, W, C) with H = B, beside a sequence-first LSTM that
    declares the other layout: batch-first, exact, nothing assumed."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.norm, self.fc = nn.Conv2d(2, D, 3, padding=1), nn.LayerNorm(D), nn.Linear(D, 3)
            self.rnn = nn.LSTM(3, 3)  # unused by the forward: its batch_first=False is all it says

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.norm(self.conv(x).permute(0, 2, 3, 1))).mean((1, 2))

    model = make(Block)
    x, y = torch.randn(B, 2, B, 3, dtype=torch.float64), torch.randint(0, 3, (B,))
    layouts = Layouts(model)
    plan = plan_sources(model, groups_available=False, fallback=False)
    collector = PerExampleGradients({n: m for n, m in plan.per_example.items() if n != "rnn"}, {}, 2, layouts)
    collector.attach(keep_norms=True)
    collector.begin_micro_batch()
    collector.expect_batch(B)
    F.cross_entropy(model(x), y, reduction="sum").backward()
    collector.end_micro_batch(1.0)
    collector.detach()
    step = collector.pop()
    params = [p for n, p in model.named_parameters() if not n.startswith("rnn")]
    truth = torch.stack(
        [
            torch.cat(
                [g.flatten() for g in torch.autograd.grad(F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), params)]
            )
            for i in range(B)
        ]
    )
    assert_exact(step, truth)
    assert not layouts.assumed


def test_layouts_that_disagree_fail_the_layer_with_the_fix():
    """An embedding beside a batch-first LSTM and a sequence-first attention, at T = B, nothing else told: not
    measured, and the reason says the shape and what would tell."""

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(V, D)
            self.rnn = nn.LSTM(D, D, batch_first=True)
            self.attn = nn.MultiheadAttention(D, 2)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.rnn(self.emb(ids))[0].transpose(0, 1)
            return self.attn(h, h, h, need_weights=False)[0].mean(0)

    model = make(Mixed)
    ids, y = data(model, B)
    step = collect(model, ids, y[:, 0] % 3, Layouts(model))
    why = step.failed["emb"]
    assert "(5, 5)" in why and "rnn: batch-first" in why and "attn: sequence-first" in why
    assert "sequence_first=True or False" in why and "sequence length differs from the batch size" in why


@pytest.mark.parametrize("sequence_first", [None, False])
def test_a_relative_position_bias_at_T_equal_B_is_named_as_shared(sequence_first):
    """T5's (T, T) buckets with T = B: not measured (their gradient arrives summed over the examples), with the
    batch told and with the override; the other layers exact."""
    model = make(RelativeBias)
    ids, y = data(model, B)
    y = targets(model, y)
    step = collect(model, ids, y, Layouts(model, sequence_first), batch=(ids, y))
    assert set(step.failed) == {"bias"} and "relative-position buckets" in step.failed["bias"]
    step.failed.clear()
    assert_exact(step, brute_force(model, ids, y, skip=("bias",)))


def test_a_relative_position_bias_at_T_other_than_B_is_named_as_shared():
    model = make(RelativeBias)
    ids, y = data(model, B + 2)
    step = collect(model, ids, targets(model, y), Layouts(model))
    assert set(step.failed) == {"bias"}
    assert "ids (7, 7) have no dimension of the batch (5)" in step.failed["bias"]
    assert "relative-position bias" in step.failed["bias"]


# ------------------------------------------------------------------ in training
class LM(pl.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return per_example_losses(self.net, *batch).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def probe_fit(net: nn.Module, ids: torch.Tensor, y: torch.Tensor, steps: int = 1, **options: Any):
    probe = BatchVarianceProbe(histogram_every_n_steps=0, **options)
    trainer = pl.Trainer(
        max_steps=steps,
        callbacks=[probe],
        logger=RecordingLogger(),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        num_sanity_val_steps=0,
        precision="64-true",
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(LM(net), DataLoader(TensorDataset(ids, y), batch_size=ids.shape[0] // steps))
    return probe, trainer, [str(w.message) for w in record if "trainvitals" in str(w.message)]


def true_trace(net: nn.Module, ids: torch.Tensor, y: torch.Tensor, skip: tuple[str, ...] = ()) -> float:
    g = brute_force(net, ids, y, skip)
    return float((g - g.mean(0)).square().sum() / (g.shape[0] - 1))


@pytest.mark.parametrize(
    "copy, sequence_first", [(False, None), (True, True), (True, None)], ids=["batch-view", "override", "no-evidence"]
)
def test_the_probe_measures_a_sequence_first_model_at_T_equal_B(copy, sequence_first):
    """tr(Σ) of Embedding → Linear on (T, B), T = B, against brute force: exact when the ids are the batch's,
    transposed, or with ``sequence_first=True``; without either, taken batch-first and said once."""
    net = make(TinySequenceFirst, copy)
    ids, y = data(net, B)
    probe, _, said = probe_fit(net, ids, y, sequence_first=sequence_first)
    assumed = [m for m in said if "taken batch-first" in m]
    if copy and sequence_first is None:
        assert len(assumed) == 1 and "net.emb, net.dec" in assumed[0] and "sequence_first=True" in assumed[0]
    else:
        assert not assumed
        assert abs(float(probe.noise.trace_cov) / true_trace(net, ids, y) - 1) < 1e-5


def test_a_batch_first_gpt_at_T_equal_B_is_measured_without_a_warning_or_host_read(monkeypatch):
    """nanoGPT with block = batch: its token ids are the batch's, which shows every layer batch-first. Exact over
    every parameter (the position table's ids, arange(B), told from the examples' own on the device), no layout
    warning, and no host read but at logging steps (every 2nd)."""
    net = make(GPT, B)
    ids, y = data(net, B, b=2 * B)
    truth = true_trace(net, ids[B:], y[B:])  # the second step
    probe = BatchVarianceProbe(histogram_every_n_steps=0, log_every_n_steps=2, ema_beta=0.0)
    host = HostReads(monkeypatch)
    host.watch(probe, ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step"))
    trainer = pl.Trainer(
        max_steps=2,
        callbacks=[probe],
        logger=RecordingLogger(),
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        num_sanity_val_steps=0,
        precision="64-true",
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(LM(net), DataLoader(TensorDataset(ids, y), batch_size=B))
    monkeypatch.undo()
    assert {step for step, _ in host.reads} <= {0}
    said = [str(w.message) for w in record if "trainvitals" in str(w.message)]
    assert not [m for m in said if "batch-first" in m or "sequence_first" in m], said
    assert not probe._excluded and "not measured" not in probe.sources
    assert not probe._layouts.assumed
    assert abs(float(probe.noise.trace_cov) / truth - 1) < 1e-5  # ema_beta 0: the last step's


def test_the_probe_keeps_its_layouts_over_re_plans_and_starts_afresh_each_fit():
    net = make(TinySequenceFirst)
    ids, y = data(net, B)
    probe, trainer, _ = probe_fit(net, ids, y)
    layouts = probe._layouts
    assert probe._sources.collector.layouts is layouts and layouts._seen == {"net.emb": {1}}
    probe._make_plan(trainer, trainer.lightning_module)
    assert probe._sources.collector.layouts is layouts and layouts._seen == {"net.emb": {1}}
    probe.setup(trainer, trainer.lightning_module, "fit")
    assert probe._layouts is not layouts and probe._sources.collector.layouts is probe._layouts
    assert not probe._layouts._seen


# ------------------------------------------------------------------ layouts mixed in one model
class Tagger(nn.Module):
    """A tagger whose embedding, projection, LayerNorm and head are batch-first around a ``batch_first=False``
    encoder (``encoder``: ``"transformer"``, ``"lstm"``), transposed in and out; ``outside_first``: the
    embedding and head run sequence-first around a ``batch_first=True`` encoder instead."""

    def __init__(self, encoder: str = "transformer", outside_first: bool = False) -> None:
        super().__init__()
        self.encoder, self.outside_first = encoder, outside_first
        self.emb, self.proj = nn.Embedding(V, D), nn.Linear(D, D)
        if encoder == "lstm":
            self.enc = nn.LSTM(D, D, batch_first=outside_first)
        else:
            layer = nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=outside_first)
            self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.proj(self.emb(ids.t() if self.outside_first else ids)).permute(1, 0, 2)
        x = self.enc(x)[0] if self.encoder == "lstm" else self.enc(x)
        x = x.permute(1, 0, 2).cumsum(int(not self.outside_first))  # back to the outside layout, mixed in time
        out = self.head(self.norm(x))
        return out.transpose(0, 1) if self.outside_first else out


@pytest.mark.parametrize("encoder", ["transformer", "lstm"])
def test_a_batch_first_tagger_around_a_sequence_first_encoder_fails_its_outside_layers_at_T_equal_B(encoder):
    """The encoder's batch_first speaks for the layers inside it only: the projection, LayerNorm and head beside
    it (no evidence of their own, the embedding shown batch-first, the encoder sequence-first) are not measured,
    with the mixed evidence named; the embedding and the encoder are exact."""
    model = make(Tagger, encoder)
    ids, y = data(model, B)
    layouts = Layouts(model)
    step = collect(model, ids, y, layouts, batch=(ids, y))
    assert set(step.failed) == {"proj", "norm", "head"}, step.failed
    why = step.failed["head"]
    assert "mixed" in why and "enc: sequence-first" in why and "batch-first: emb" in why and "(5, 5, 8)" in why
    step.failed.clear()
    assert_exact(step, brute_force(model, ids, y, skip=("proj", "norm", "head")))
    assert not layouts.assumed


@pytest.mark.parametrize("encoder", ["transformer", "lstm"])
def test_sequence_first_false_measures_the_mixed_tagger_exactly_inside_and_out(encoder):
    """``sequence_first=False`` says the layout outside the encoder; the layers inside a transformer encoder keep
    its own (sequence-first), said once: every layer exact."""
    model = make(Tagger, encoder)
    ids, y = data(model, B)
    layouts = Layouts(model, sequence_first=False)
    assert_exact(collect(model, ids, y, layouts, batch=(ids, y)), brute_force(model, ids, y))
    notes, refuted = layouts.notes()
    assert not refuted and len(notes) == 1
    assert "sequence_first=False differs from the batch_first of enc:" in notes[0] and "(sequence-first)" in notes[0]
    assert layouts.notes() == ([], False)  # once


def test_layers_taken_from_the_declared_modules_alone_are_said_once_and_not_with_the_batch_s_ids():
    """Embedding and decoder beside a sequence-first LSTM, at T = B: with no input showing a layout they are taken
    as the LSTM declares (exact here), said once with the override that would say otherwise; with the ids a view of
    the batch (transposed), shown, and nothing said, in training too."""
    model = make(WordLM)
    ids, y = data(model, B)
    layouts = Layouts(model)
    assert_exact(collect(model, ids, y, layouts), brute_force(model, ids, y))
    notes, _ = layouts.notes()
    assert len(notes) == 1 and "encoder, decoder" in notes[0] and "taken sequence-first" in notes[0]
    assert "as rnn declares (batch_first=False)" in notes[0]
    assert "sequence_first=False" in notes[0] and layouts.notes() == ([], False)
    layouts = Layouts(model)
    assert_exact(collect(model, ids, y, layouts, batch=(ids, y)), brute_force(model, ids, y))
    assert layouts.notes() == ([], False)
    probe, _, said = probe_fit(model, ids, y)
    assert not [m for m in said if "taken" in m or "sequence_first" in m], said
    assert abs(float(probe.noise.trace_cov) / true_trace(model, ids, y) - 1) < 1e-6


def test_a_declared_batch_first_encoder_keeps_its_layout_under_sequence_first_true():
    """Sequence-first embedding and head around a ``batch_first=True`` encoder with ``sequence_first=True``: the
    override holds outside, the encoder's own layout inside (not the override's), exact, and the difference
    said once."""
    model = make(Tagger, "transformer", True)
    ids, y = data(model, B)
    layouts = Layouts(model, sequence_first=True)
    assert_exact(collect(model, ids, y, layouts, batch=(ids, y)), brute_force(model, ids, y))
    notes, _ = layouts.notes()
    assert len(notes) == 1 and "sequence_first=True differs from the batch_first of enc:" in notes[0]
    assert "keep their own layout (batch-first)" in notes[0]


def test_the_probe_measures_the_mixed_tagger_over_the_layers_it_can_and_says_which_it_cannot():
    """In training: tr(Σ) over the embedding and encoder against brute force, the three outside layers excluded
    and said; with ``sequence_first=False``, every parameter, exact."""
    net = make(Tagger)
    ids, y = data(net, B)
    probe, _, said = probe_fit(net, ids, y)
    assert probe._excluded == {"net.proj", "net.norm", "net.head"}
    assert [m for m in said if "mixed" in m and "net.head" in m]
    assert abs(float(probe.noise.trace_cov) / true_trace(net, ids, y, skip=("proj", "norm", "head")) - 1) < 1e-6
    probe, _, said = probe_fit(net, ids, y, sequence_first=False)
    assert not probe._excluded and len([m for m in said if "differs from the batch_first" in m]) == 1
    assert abs(float(probe.noise.trace_cov) / true_trace(net, ids, y) - 1) < 1e-6


def test_a_layout_assumed_at_T_equal_B_and_refuted_later_restarts_the_estimate():
    """Steps of T = B (taken batch-first, said), then T = B + 2 (the shape shows sequence-first): said once, the
    first step's per-position numbers dropped; the estimate is the second step's, exact."""
    net = make(TinySequenceFirst, True)
    ids, y = data(net, B + 2, b=2 * B)
    cut = iter([B, B + 2])

    def collate(rows):
        t = next(cut)
        return torch.stack([r[0][:t] for r in rows]), torch.stack([r[1][:t] for r in rows])

    probe = BatchVarianceProbe(histogram_every_n_steps=0, ema_beta=0.5)
    trainer = pl.Trainer(
        max_steps=2,
        callbacks=[probe],
        logger=RecordingLogger(),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        num_sanity_val_steps=0,
        precision="64-true",
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(LM(net), DataLoader(TensorDataset(ids, y), batch_size=B, collate_fn=collate))
    said = [str(w.message) for w in record if "trainvitals" in str(w.message)]
    restarts = [m for m in said if "restarts" in m]
    assert len(restarts) == 1 and "net.emb, net.dec" in restarts[0] and "(7, 5)" in restarts[0]
    assert int(probe.noise.count) == 1
    assert abs(float(probe.noise.trace_cov) / true_trace(net, ids[B:], y[B:]) - 1) < 1e-6


# ------------------------------------------------------------------ a loader yielding (T, B) batches
class TimeMajorLM(pl.LightningModule):
    """word_language_model's training on batchify's ``(T, B)`` batches: Embedding → LSTM (batch_first=False) →
    Linear, the loss the mean over every token."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.rnn, self.dec = nn.Embedding(V, D), nn.LSTM(D, 6), nn.Linear(6, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dec(self.rnn(self.emb(ids))[0])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, y = batch
        return F.cross_entropy(self(ids).flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def time_major_fit(t: int, **options: Any):
    lm = TimeMajorLM().double()
    g = torch.Generator().manual_seed(1)
    ids, y = torch.randint(0, V, (B, t), generator=g), torch.randint(0, V, (B, t), generator=g)
    loader = DataLoader(
        TensorDataset(ids, y),
        batch_size=B,
        collate_fn=lambda rows: tuple(torch.stack(c).t().contiguous() for c in zip(*rows)),
    )
    probe = BatchVarianceProbe(histogram_every_n_steps=0, **options)
    trainer = pl.Trainer(
        max_steps=1,
        callbacks=[probe],
        logger=RecordingLogger(),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        num_sanity_val_steps=0,
        precision="64-true",
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(lm, loader)
    params = [p for p in lm.parameters()]
    g = torch.stack(
        [
            torch.cat(
                [
                    d.flatten()
                    for d in torch.autograd.grad(
                        F.cross_entropy(lm(ids[i : i + 1].t()).flatten(0, 1), y[i : i + 1].t().flatten()), params
                    )
                ]
            )
            for i in range(B)
        ]
    )
    truth = float((g - g.mean(0)).square().sum() / (B - 1))
    return probe, truth, [str(w.message) for w in record if "trainvitals" in str(w.message)]


@pytest.mark.parametrize("t", [B, B + 2])
def test_a_loader_of_T_B_batches_is_measured_with_sequence_first_true(t):
    """``sequence_first=True`` reads the batch size from dimension 1 of the batch: B examples, exact."""
    probe, truth, _ = time_major_fit(t, sequence_first=True)
    assert probe.effective_batch_size == B and not probe._excluded
    assert abs(float(probe.noise.trace_cov) / truth - 1) < 1e-6


def test_a_loader_of_T_B_batches_without_the_flag_leaves_the_step_out_and_says_the_fix():
    """Without it, the LSTM (batch_first=False) sees the batch size read from dimension 0 on its dimension 0:
    time steps would be counted as examples. The step is left out, nothing excluded, the fix said."""
    probe, _, said = time_major_fit(B + 2)
    assert int(probe.noise.count) == 0 and not probe._excluded
    fix = [m for m in said if "(T, B) batches" in m]
    assert len(fix) == 1 and "rnn declares its examples on dimension 1" in fix[0] and "sequence_first=True" in fix[0]


def test_the_batch_size_of_a_sequence_first_batch_is_its_dimension_1():
    from trainvitals.plumbing.batch import batch_size

    ids, lengths = torch.zeros(7, 3), torch.zeros(3)
    assert batch_size((ids, lengths), True) == 3 and batch_size((ids, lengths)) == 7
    assert batch_size({"lengths": lengths, "ids": ids}, True) == 3 and batch_size([lengths], True) == 3


class WindowAttention(nn.Module):
    """Swin's layout: an image's (B, H, W, C) tokens cut into windows of 2×2, the windows folded into the batch's
    dimension, ``(B·windows, 4, C)``, and a Linear run on them: at B = 4, (16, 4, C) reads as a (T, B) sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.qkv, self.head = nn.Linear(3, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 4, 4, 3)
        b = x.shape[0]
        h = self.embed(x).reshape(b, 2, 2, 2, 2, 8).transpose(2, 3).reshape(b * 4, 4, 8)  # (B·windows, tokens, C)
        h = torch.tanh(self.qkv(h)).reshape(b, 16, 8)
        return self.head(h.mean(1))


@pytest.mark.parametrize("b", [3, 4])
def test_examples_folded_into_the_first_dimension_are_not_taken_for_a_sequence(b):
    """Main took Swin's (B·windows, tokens, C) for a (T, B) sequence where the window's tokens equal the batch, and
    gave per-token norms with no error (47–139 % off on HF's Swin): such an input, with nothing else showing the
    layout, is named as not measured, with the fix; at any other batch it fails as before; the rest is exact."""
    torch.manual_seed(0)
    model = WindowAttention().double()
    x, y = torch.randn(b, 4, 4, 3, dtype=torch.float64), torch.randint(0, 3, (b,))
    plan = plan_sources(model, groups_available=False, fallback=False)
    collector = PerExampleGradients(plan.per_example, {}, 2, Layouts(model))
    collector.attach(keep_norms=True)
    collector.begin_micro_batch()
    collector.expect_batch(b, (x, y))
    F.cross_entropy(model(x), y, reduction="sum").backward()
    collector.end_micro_batch(1.0)
    step = collector.pop()
    assert set(step.failed) == {"qkv"}
    if b == 4:
        assert "folded into dimension 0" in step.failed["qkv"] and "sequence_first=True" in step.failed["qkv"]
    params = [model.embed.weight, model.embed.bias, model.head.weight, model.head.bias]
    truth = torch.stack(
        [
            torch.cat(
                [g.flatten() for g in torch.autograd.grad(F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), params)]
            )
            for i in range(b)
        ]
    )
    assert torch.allclose(step.sq_norms[0], truth.square().sum(1), rtol=1e-9, atol=0)
