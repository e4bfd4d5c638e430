"""A character-level transformer on Python's own source code, with trainvitals attached.

The text ships with Python: a few modules of the standard library, read from ``sysconfig``'s stdlib
folder (no download). The model is a two-layer causal transformer written with plain ``nn.Linear``,
``nn.Embedding`` and ``nn.LayerNorm`` layers, so BatchVarianceProbe measures exact per-example
gradient norms of every parameter in the same backward, on a sequence model whose "example" is a
whole window of characters (its loss is the mean over the window's tokens). The attention scores
are computed explicitly, so MemoryTopologyProfiler shows what attention costs: the ``B·H·T·T``
probabilities saved for backward next to the ``B·T·d`` activations of everything else.

    python examples/char_transformer.py --logdir runs/examples
    tensorboard --logdir runs/examples

Runs in about a minute on two CPU cores.
"""

from __future__ import annotations

import math
import sys
import sysconfig
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from _common import fit_example, run_example
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STDLIB_MODULES = ("argparse.py", "textwrap.py", "fractions.py")
"""Pure-Python standard-library modules, about 150 kB of text together."""


def load_text() -> str:
    """The source of :data:`STDLIB_MODULES`, concatenated."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return "\n".join((stdlib / name).read_text(encoding="utf-8") for name in STDLIB_MODULES)


class CharData(pl.LightningDataModule):
    """Non-overlapping windows of ``context + 1`` characters: inputs are the first ``context``, targets the last.

    The last tenth of the text is held out for validation; the vocabulary is every character of the text.
    """

    def __init__(self, context: int = 64, batch_size: int = 32) -> None:
        super().__init__()
        self.context = context
        self.batch_size = batch_size
        text = load_text()
        self.vocab = sorted(set(text))
        index = {c: i for i, c in enumerate(self.vocab)}
        self.ids = torch.tensor([index[c] for c in text], dtype=torch.long)

    def _windows(self, ids: torch.Tensor) -> TensorDataset:
        n = (len(ids) - 1) // self.context
        x = ids[: n * self.context].view(n, self.context)
        y = ids[1 : n * self.context + 1].view(n, self.context)
        return TensorDataset(x, y)

    def setup(self, stage: str | None = None) -> None:
        split = int(0.9 * len(self.ids))
        self.train_set, self.val_set = self._windows(self.ids[:split]), self._windows(self.ids[split:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention, with the ``(B, H, T, T)`` probabilities computed explicitly."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
        return self.out((probs @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharTransformer(pl.LightningModule):
    """Token and position embeddings, ``layers`` blocks, a final LayerNorm and a linear head.

    Args:
        vocab: number of distinct characters.
        context: window length T.
        d_model, heads, layers: width, attention heads, depth.
        lr: AdamW learning rate.
    """

    def __init__(
        self, vocab: int, context: int = 64, d_model: int = 64, heads: int = 4, layers: int = 2, lr: float = 3e-3
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(context, d_model)
        self.blocks = nn.Sequential(*(Block(d_model, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.head(self.ln(self.blocks(self.tokens(ids) + self.positions(positions))))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self._loss(batch), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)


def train(
    logdir: str, max_steps: int = 300, batch_size: int = 32, context: int = 64, seed: int = 0, quiet: bool = True
) -> str:
    """Train the character transformer with trainvitals attached; returns the run's log folder."""
    pl.seed_everything(seed, workers=True, verbose=False)
    data = CharData(context=context, batch_size=batch_size)
    return fit_example(
        CharTransformer(len(data.vocab), context=context),
        data,
        logdir,
        "char_transformer",
        every_n_steps=50,
        min_steps=150,
        quiet=quiet,
        max_steps=max_steps,
        log_every_n_steps=5,
        limit_val_batches=2,
    )


def main(argv: list[str] | None = None) -> int:
    return run_example(__doc__, argv, train, "--max-steps", 300)


if __name__ == "__main__":
    sys.exit(main())
