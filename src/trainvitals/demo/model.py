"""The demo's model: a small CNN for 8×8 digits, as a LightningModule."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn


class DigitsCNN(pl.LightningModule):
    """Conv(1→16) → Conv(16→32) → Linear(512→64) → Linear(64→10), about 40k parameters, no BatchNorm.

    Args:
        lr: learning rate.
        optimizer: ``"adam"`` or ``"sgd"`` (SGD with momentum 0.9).
    """

    def __init__(self, lr: float = 1e-3, optimizer: str = "adam") -> None:
        super().__init__()
        if lr <= 0:
            raise ValueError(f"`lr` must be > 0, got {lr}")
        if optimizer not in ("adam", "sgd"):
            raise ValueError(f"`optimizer` must be 'adam' or 'sgd', got {optimizer!r}")
        self.save_hyperparameters()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val/loss", F.cross_entropy(logits, y), prog_bar=True)
        self.log("val/acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self):
        if self.hparams.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
