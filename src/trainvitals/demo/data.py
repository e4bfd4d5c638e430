"""Real data without downloads: scikit-learn's bundled ``load_digits`` (1,797 8×8 images, 10 classes)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

VALIDATION_FRACTION = 0.2
SPLIT_SEED = 0  # the split is fixed; --seed changes initialisation and shuffling only


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """Images ``(1797, 1, 8, 8)`` float32 scaled to [0, 1], labels ``(1797,)`` int64.

    Raises:
        ImportError: with the install hint, when scikit-learn (the ``examples`` extra) is missing.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("the digits demo needs scikit-learn: pip install 'trainvitals[examples]'") from err
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    return images, labels


class DigitsDataModule(pl.LightningDataModule):
    """A fixed 80/20 train/validation split of the digits; batches of ``batch_size`` examples."""

    def __init__(self, batch_size: int = 64, num_workers: int = 0) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"`batch_size` must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.num_workers = num_workers

    def setup(self, stage: str | None = None) -> None:
        images, labels = load_digits_tensors()
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SPLIT_SEED))
        n_val = int(len(labels) * VALIDATION_FRACTION)
        val, train = order[:n_val], order[n_val:]
        self.train_set = TensorDataset(images[train], labels[train])
        self.val_set = TensorDataset(images[val], labels[val])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True, num_workers=self.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256, num_workers=self.num_workers)
