"""Tiny LightningModules shared by the callback tests."""

from __future__ import annotations

import math
import random
import socket

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def flat_grad_norm(params) -> float:
    """Brute force: the 2-norm of all gradients flattened into one float64 vector."""
    grads = [p.grad.detach().reshape(-1).double() for p in params if p.grad is not None]
    return torch.linalg.vector_norm(torch.cat(grads)).item()


def regression_data(n: int = 64, d: int = 6, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = x @ torch.randn(d, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def loader(dataset: TensorDataset, batch_size: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False)


def digits_loader(batch_size: int) -> DataLoader:
    """The demo's digits training split (1,437 8×8 images), shuffled, in full batches of ``batch_size``."""
    from trainvitals.demo.data import DigitsDataModule

    data = DigitsDataModule(batch_size=batch_size)
    data.setup()
    return data.train_dataloader()


def warmup_cosine(warmup: int, total: int):
    """A linear warmup over ``warmup`` steps, then a cosine down to 0 at step ``total`` (a LambdaLR's factor)."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))

    return factor


def one_cycle_lr(max_lr: float, total: int, step: int) -> float:
    """OneCycleLR's lr at ``step`` in closed form, torch's defaults: a cosine up from max_lr/25 over 30 % of
    ``total``, then down to max_lr/25/1e4 at its last step."""
    low, peak, end = max_lr / 25, 0.3 * total - 1, max_lr / 25 / 1e4
    start, stop, pct = (low, max_lr, step / peak) if step <= peak else (max_lr, end, (step - peak) / (total - 1 - peak))
    return stop + (start - stop) * (1 + math.cos(math.pi * pct)) / 2


class DigitsMLP(pl.LightningModule):
    """An MLP on the 8×8 digits (64 → 32 → 10) under the mean cross-entropy, ``optimizer`` set at ``lr`` and
    stepped every optimizer step by ``schedule``: ``None``, ``"one_cycle"`` (OneCycleLR, ``max_lr=lr``, over
    ``total_steps``) or ``"warmup_cosine"`` (LambdaLR: :func:`warmup_cosine` over a tenth, then to 0 at
    ``total_steps``). Records each step's brute-force pre-clip gradient norm, as :class:`Regressor`."""

    def __init__(
        self, optimizer: type = torch.optim.SGD, lr: float = 0.1, schedule: str | None = None, total_steps: int = 200
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.optimizer, self.lr, self.schedule, self.total_steps = optimizer, lr, schedule, total_steps
        self.reference_norms: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def on_before_optimizer_step(self, optimizer):
        self.reference_norms.append(flat_grad_norm(self.parameters()))

    def configure_optimizers(self):
        opt = self.optimizer(self.parameters(), lr=self.lr)
        if self.schedule is None:
            return opt
        if self.schedule == "one_cycle":
            scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.lr, total_steps=self.total_steps)
        else:
            factor = warmup_cosine(self.total_steps // 10, self.total_steps)
            scheduler = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Regressor(pl.LightningModule):
    """MLP regressor; records the brute-force pre-clip gradient norm of every optimizer step.

    ``LightningModule.on_before_optimizer_step`` runs after the callbacks' hook and before clipping,
    on the same (accumulated, unscaled) gradient.
    """

    def __init__(self, d: int = 6, lr: float = 0.05, inf_at_step: int | None = None, autocast: bool = True) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 1))
        self.lr = lr
        self.inf_at_step = inf_at_step
        self.autocast = autocast
        self.reference_norms: list[float] = []

    def forward(self, x):
        with torch.autocast("cpu", enabled=self.autocast and torch.is_autocast_enabled("cpu")):
            return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x).float(), y)
        if self.inf_at_step is not None and self.global_step == self.inf_at_step:
            loss = loss * float("inf")
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.reference_norms.append(flat_grad_norm(self.parameters()))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Classifier(pl.LightningModule):
    """``net`` under cross-entropy (``reduction`` over the batch) and plain SGD at ``lr`` (0: the
    parameters stay where they are, so every step measures the same model)."""

    def __init__(self, net: nn.Module, reduction: str = "mean", lr: float = 0.0) -> None:
        super().__init__()
        self.net, self.reduction, self.lr = net, reduction, lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y, reduction=self.reduction)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class NoiseOnly(pl.LightningModule):
    """loss = 10 + mean over the batch of w · x, x ~ N(0, I_d) (``d`` = 32 by default): the gradient is the batch's
    mean x, pure noise with E‖g‖² = tr Σ / b = d / b whatever w, and the loss stays near 10 (w starts at 0, the lr is
    small). The gradient of the optimizer step ``spike_at`` is × ``spike``. ``sizes[step]``, ``norms[step]``: each
    step's micro-batches' rows and its brute-force ‖g‖."""

    def __init__(self, spike_at: int | None = None, spike: float = 1.0, d: int = 32) -> None:
        super().__init__()
        self.lin = nn.Linear(d, 1, bias=False)
        nn.init.zeros_(self.lin.weight)
        self.spike_at, self.spike = spike_at, spike
        self.sizes: dict[int, list[int]] = {}
        self.norms: dict[int, float] = {}

    def on_train_batch_start(self, batch, batch_idx):
        self.sizes.setdefault(self.global_step, []).append(len(batch[0]))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return 10.0 + (self.spike if self.global_step == self.spike_at else 1.0) * self.lin(x).mean()

    def on_before_optimizer_step(self, optimizer):
        self.norms[self.global_step] = flat_grad_norm(self.parameters())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class ReleaseProcessGroup(pl.Callback):
    """Destroys the process group when a ``ddp_spawn`` fit is done, before the worker process exits.

    Left to interpreter shutdown, gloo's process group is destroyed with its threads still joinable,
    and about one spawned worker in ten aborts ("terminate called without an active exception") after
    a fit that succeeded. Lightning runs the ``teardown`` hook after its own strategy teardown.
    """

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def free_port() -> int:
    """A free port below Linux's ephemeral range, so that no connection opened meanwhile takes it
    before rank 0 binds it (the ranks take seconds to start)."""
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(20000, 29000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port in 20000-29000")


class Scale(nn.Module):
    """A layer of one's own, without a per-example rule unless a test registers one: y = x ⊙ s over (B, *, D)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class Clamp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(min=-30.0)


class LogModel(pl.LightningModule):
    """Linear(4→8) with positive weights → softplus → log → clamp → Linear(8→1): finite while the inputs are
    positive; a batch of inputs of -1000 makes the softplus underflow to 0, so layer ``net.2`` (the log)
    makes -inf, which the clamp hides from the loss, and the gradient is NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Softplus(), Log(), Clamp(), nn.Linear(8, 1))
        with torch.no_grad():
            self.net[0].weight.abs_()
            self.net[0].bias.fill_(1.0)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def log_data(bad_batch: int, batch_size: int = 8) -> DataLoader:
    """64 rows for :class:`LogModel`; batch ``bad_batch``'s inputs are -1000 (its log makes -inf)."""
    x, y = torch.rand(64, 4), torch.randn(64, 1)
    x[batch_size * bad_batch : batch_size * (bad_batch + 1)] = -1000.0
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


class GAN(pl.LightningModule):
    """GAN-shaped manual optimization: a generator and a discriminator, each with its own optimizer.

    The generator's loss goes through the discriminator. ``zero_disc=False`` leaves the
    discriminator's gradient of its own loss in ``.grad`` when the generator's backward adds to it;
    ``detach_fake=False`` sends the discriminator's loss back into the generator. ``reference[k]``
    holds the brute-force gradient norm optimizer k stepped on, one per step.
    """

    def __init__(self, d: int = 4, zero_disc: bool = True, detach_fake: bool = True) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.zero_disc, self.detach_fake = zero_disc, detach_fake
        self.gen = nn.Sequential(nn.Linear(d, d))
        self.disc = nn.Sequential(nn.Linear(d, 1))
        self.reference: dict[int, list[float]] = {0: [], 1: []}

    def training_step(self, batch, batch_idx):
        x, _ = batch
        opt_g, opt_d = self.optimizers()
        fake = self.gen(x)
        d_fake = self.disc(fake.detach() if self.detach_fake else fake)
        d_loss = F.softplus(-self.disc(x)).mean() + F.softplus(d_fake).mean()
        if self.zero_disc:
            opt_d.zero_grad()
        self.manual_backward(d_loss)
        self.reference[1].append(flat_grad_norm(self.disc.parameters()))
        opt_d.step()
        g_loss = F.softplus(-self.disc(fake)).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        self.reference[0].append(flat_grad_norm(self.gen.parameters()))
        opt_g.step()

    def configure_optimizers(self):
        return (torch.optim.SGD(self.gen.parameters(), lr=0.01), torch.optim.SGD(self.disc.parameters(), lr=0.01))
