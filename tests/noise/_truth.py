"""Brute-force truth for the noise statistics on a real fit: the yardstick for the probe's estimates (issue #24).

:class:`TruthCallback` computes, at chosen optimizer steps, every example's own-loss gradient g_i over the WHOLE
training set (``torch.func.vmap(grad)``, in chunks), at the parameters the step's gradient was taken at (in
``on_before_optimizer_step``, before the update), and from them

- ‖G‖², G = (1/N) Σ_i g_i: the full-data gradient, in the units of ``.grad`` for a loss that is a mean over the
  step's examples (the mean of the examples' own losses: every example has as many terms as every other);
- tr Σ = (1/N) Σ_i ‖g_i − G‖²: the population trace, as estimate.py's rule 6 defines it for a batch drawn without
  replacement from N (the estimators' S = N·tr Σ/(N − 1));
- B_simple = tr Σ/‖G‖² and the band ratio B·‖G‖²/(margin·tr Σ) at the step's effective batch B;
- with ``draws`` > 0, the variances and covariance of one step's per-example estimates (‖G‖²_est, S_est) at batch
  B, corrected as rule 6 does: the spread of ``draws`` batches of B drawn without replacement from the N true
  g_i. With the effective number of measurements n the probe's EMA had, they give the relative error the truth's own
  B_simple would have from n such measurements: whether a reliable estimate (relative error ≤ 0.5) is *reachable*;
- with the loader's sampler a :class:`RecordingSampler` (a shuffled epoch whose permutation it keeps), the
  remaining-set truth: ‖G_R‖² over the n_R examples R the epoch has not yet drawn before this step (the step's own
  batch among them), the mean the step's batch is drawn from, and ‖G_R − G‖² (docs/science.md, "Under random
  reshuffling");
- the step's own estimate (:func:`batch_estimate`): the per-step (‖G‖²_est, S_est) of the step's batch from its
  examples' true gradients, rule 6 corrected where the loader draws without replacement from N
  (:func:`~trainvitals.noise.estimate.population_of`): what a per-example source adds to its EMAs at that step. It is
  unbiased for the step's ‖G‖² and tr Σ where the batch does not depend on θ (drawn with replacement, or θ frozen),
  so the mean of step estimate − truth over the steps, with its standard error (the differences are uncorrelated
  from step to step), tells an estimator's bias from the smoothing's lag (:func:`shares`; docs/benchmarks.md, "Why
  the char LM reads high").

What it computes is the training-mode gradient of a deterministic network. Dropout (p > 0) makes g_i random and
BatchNorm in training mode makes it depend on the other examples of the batch (eval mode would be another network's
gradient): both are refused (ValueError naming the layer); vmap's ``randomness="error"`` catches any other random
op. The truth touches no ``.grad``, no buffer (passed to ``functional_call`` as they are, and only read) and no RNG
(the draws have their own generator; the global state is forked around the computation anyway).

:func:`compare` joins the truth with the estimate's logged tags (``grad_noise/*``; the band ratio's is the current
estimate's, the one that claims to cover the truth at its step, not the band window's) as a logger recorded them,
:func:`shares` turns the joined rows into the shares the tests and ``benchmarks/noise_truth.py`` report. The models and data sets
of those runs are here too.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sysconfig
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.utils.data import RandomSampler

from trainvitals.noise.estimate import finite_population, population_of

QUANTITIES = ("grad_sq_norm", "trace_cov", "b_simple", "band_ratio")
MAX_REL_ERR = 0.5
"""The relative error of B_simple at which the estimate calls itself reliable (GradientNoise's default)."""


@dataclass(frozen=True)
class Truth:
    """The exact statistics at one optimizer step, in ``.grad`` units (``()`` floats).

    ``var_grad``, ``var_trace`` and ``cov`` are of one step's per-example estimates at batch ``batch_size``
    (rule 6 corrected); NaN without draws."""

    step: int
    grad_sq_norm: float
    trace_cov: float
    batch_size: int
    population: int
    var_grad: float = math.nan
    var_trace: float = math.nan
    cov: float = math.nan
    draw_means: tuple[float, float] = (math.nan, math.nan)  # the draws' mean (‖G‖², tr Σ): unbiased for the truth
    remaining: int = 0  # n_R, the examples of the epoch not drawn before this step (0: not recorded)
    remaining_grad_sq_norm: float = math.nan  # ‖G_R‖², G_R the mean gradient of those n_R examples
    remaining_excess: float = math.nan  # ‖G_R − G‖²
    step_estimate: tuple[float, float] = (math.nan, math.nan)  # the step's batch's own (‖G‖²_est, tr Σ_est)

    @property
    def b_simple(self) -> float:
        return self.trace_cov / self.grad_sq_norm if self.grad_sq_norm > 0 else math.inf

    def band_ratio(self, margin: float) -> float:
        return self.batch_size * self.grad_sq_norm / (margin * self.trace_cov)

    @property
    def cross_grad_sq_norm(self) -> float:
        """‖G_R‖² − ‖G_R − G‖² = ‖G‖² + 2·G·(G_R − G): what the reshuffled estimate is unbiased for, less a term
        of mean zero (docs/science.md, "Under random reshuffling")."""
        return self.remaining_grad_sq_norm - self.remaining_excess

    def rel_err(self, measurements: float) -> float:
        """B_simple's relative standard error (delta method) from ``measurements`` independent estimates: ``inf``
        where ‖G‖² is within 1.645 of its standard errors of 0 (no upper end: not a point estimate)."""
        if not (measurements > 0 and math.isfinite(self.var_grad)):
            return math.inf
        g, s = self.grad_sq_norm, self.trace_cov
        if g <= 1.6448536269514722 * math.sqrt(self.var_grad / measurements):
            return math.inf
        rel2 = self.var_trace / s**2 + self.var_grad / g**2 - 2 * self.cov / (s * g)
        return math.sqrt(max(rel2, 0.0) / measurements)


def _refuse_random_layers(module: nn.Module) -> None:
    for name, layer in module.named_modules():
        if isinstance(layer, nn.modules.batchnorm._BatchNorm) and layer.training:
            raise ValueError(
                f"layer {name!r} is a BatchNorm in training mode: its per-example gradient depends on the batch, "
                "and in eval mode it is another network's; the truth is not defined"
            )
        if isinstance(layer, nn.modules.dropout._DropoutNd) and layer.p > 0 and layer.training:
            raise ValueError(f"layer {name!r} is a dropout with p = {layer.p}: the per-example gradient is random")


def example_loss(output: Tensor, target: Tensor) -> Tensor:
    """Cross-entropy of one example, the mean over its terms (one label, or one per token)."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def per_example_gradients(
    module: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    loss: Callable[[Tensor, Tensor], Tensor] = example_loss,
    chunk: int = 256,
) -> Tensor:
    """``(N, D)`` float32: row i the gradient of example i's own loss over ``module``'s trainable parameters (in
    ``named_parameters`` order, a tied tensor once), flattened; ``module`` in its current mode."""
    _refuse_random_layers(module)
    params = {k: p.detach() for k, p in module.named_parameters() if p.requires_grad}
    fixed = {k: p.detach() for k, p in module.named_parameters() if not p.requires_grad}
    fixed.update(dict(module.named_buffers()))

    def one(p: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        return loss(functional_call(module, {**p, **fixed}, (x.unsqueeze(0),)), y.unsqueeze(0))

    per_example = vmap(grad(one), in_dims=(None, 0, 0), randomness="error")
    rows = []
    with torch.no_grad():  # torch.func.grad differentiates inside; nothing of the training graph is recorded
        for start in range(0, len(inputs), chunk):
            grads = per_example(params, inputs[start : start + chunk], targets[start : start + chunk])
            rows.append(torch.cat([g.flatten(1) for g in grads.values()], 1).float())
    return torch.cat(rows)


def batch_estimate(rows: Tensor, population: int | None = None) -> tuple[float, float]:
    """The per-example estimators' (‖G‖²_est, S_est) of one step's batch from its ``(B, D)`` per-example gradients
    ``rows`` (McCandlish et al. 2018, Eq. A.2 at b = 1), rule 6 corrected with ``population`` N when the batch was
    drawn without replacement from N (:func:`~trainvitals.noise.estimate.finite_population`)."""
    b = len(rows)
    batch_sq = float((rows.sum(0, dtype=torch.float64) / b).square().sum())
    m = float(rows.square().sum(1, dtype=torch.float64).mean())
    g_est, s_est = (b * batch_sq - m) / (b - 1), b * (m - batch_sq) / (b - 1)
    return finite_population(g_est, s_est, population) if population else (g_est, s_est)


def truth_of(
    rows: Tensor,
    step: int,
    batch_size: int,
    draws: int = 0,
    generator: torch.Generator | None = None,
    remaining: Tensor | None = None,
) -> Truth:
    """The :class:`Truth` of per-example gradients ``rows`` ``(N, D)``; ``draws`` batches of ``batch_size`` drawn
    without replacement for the per-step estimates' spread (McCandlish et al. 2018, Eq. A.2 at b = 1, then rule 6);
    ``remaining``: the indices of the examples the epoch has not drawn before this step, for the remaining-set truth."""
    n = len(rows)  # sums in float64 of the float32 rows, without a float64 copy of them
    mean = rows.sum(0, dtype=torch.float64) / n
    sq = (rows - mean.float()).square().sum(1, dtype=torch.float64)
    grad_sq_norm, trace = float(mean.square().sum()), float(sq.mean())
    left: dict[str, Any] = {}
    if remaining is not None and len(remaining):
        mean_r = rows[remaining].sum(0, dtype=torch.float64) / len(remaining)
        left = {
            "remaining": len(remaining),
            "remaining_grad_sq_norm": float(mean_r.square().sum()),
            "remaining_excess": float((mean_r - mean).square().sum()),
        }
    if draws <= 0:
        return Truth(step, grad_sq_norm, trace, batch_size, n, **left)
    b = batch_size
    estimates = [batch_estimate(rows[torch.randperm(n, generator=generator)[:b]], n) for _ in range(draws)]
    e = torch.tensor(estimates, dtype=torch.float64)
    c = torch.cov(e.T)
    means = e.mean(0).tolist()
    return Truth(
        step, grad_sq_norm, trace, b, n, float(c[0, 0]), float(c[1, 1]), float(c[0, 1]), (means[0], means[1]), **left
    )


class RecordingSampler(RandomSampler):
    """A shuffled epoch (``RandomSampler`` without replacement, so rule 6 applies) that keeps each epoch's
    permutation in :attr:`orders`, for :class:`TruthCallback`'s remaining-set truth."""

    def __init__(self, data_source: Any, seed: int = 0) -> None:
        super().__init__(data_source, generator=torch.Generator().manual_seed(seed))
        self.orders: list[Tensor] = []

    def __iter__(self):  # type: ignore[override]
        order = torch.randperm(len(self.data_source), generator=self.generator)
        self.orders.append(order)
        yield from order.tolist()


class TruthCallback(pl.Callback):
    """Brute-force :class:`Truth` every ``every_n_steps`` optimizer steps of a fit, over ``inputs``/``targets``
    (the whole training set), in :attr:`truths` by step.

    With the train loader's sampler a :class:`RecordingSampler`, each truth also holds the remaining-set truth of
    the step (the examples from the step's first one to the epoch's end, counted from the micro-batches seen). Each
    also holds the step's own estimate (:func:`batch_estimate`) from the micro-batches the step trained on.

    Args:
        inputs, targets: the training set, ``(N, ...)`` each, as the model's forward and ``loss`` take them.
        every_n_steps: measure at the optimizer steps divisible by it (the logging cadence, to meet the logs).
        module: which part of the LightningModule maps a batch to the loss's input (default: itself).
        loss: one example's loss from its output and target (a mean over its terms).
        draws: batches drawn per measured step for the estimates' spread (0: none).
        batch_size: the step's examples (default: the train loader's batch size × accumulate_grad_batches).
        seed: of the draws' own generator.
    """

    def __init__(
        self,
        inputs: Tensor,
        targets: Tensor,
        every_n_steps: int,
        module: Callable[[pl.LightningModule], nn.Module] = lambda m: m,
        loss: Callable[[Tensor, Tensor], Tensor] = example_loss,
        draws: int = 0,
        batch_size: int | None = None,
        seed: int = 0,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"`every_n_steps` must be >= 1, got {every_n_steps}")
        self.inputs, self.targets = inputs, targets
        self.every_n_steps, self.module, self.loss = every_n_steps, module, loss
        self.draws, self.batch_size = draws, batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.truths: dict[int, Truth] = {}
        self._drawn = self._step_start = 0  # examples of this epoch drawn so far, and before this step
        self._batches: list[tuple[Tensor, Tensor]] = []  # the micro-batches of this step

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._drawn = self._step_start = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *_: Any) -> None:
        self._drawn += len(batch[0])
        self._batches.append((batch[0], batch[1]))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        step, start, self._step_start = trainer.global_step, self._step_start, self._drawn
        batches, self._batches = self._batches, []
        if step % self.every_n_steps or step in self.truths:
            return
        sampler = trainer.train_dataloader.sampler
        remaining = sampler.orders[-1][start:] if isinstance(sampler, RecordingSampler) else None
        module = self.module(pl_module)
        device = next(module.parameters()).device
        batch = self.batch_size or trainer.train_dataloader.batch_size * trainer.accumulate_grad_batches
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            rows = per_example_gradients(module, self.inputs.to(device), self.targets.to(device), self.loss)
            own = per_example_gradients(module, *(torch.cat(parts).to(device) for parts in zip(*batches)), self.loss)
        truth = truth_of(rows, step, batch, self.draws, self.generator, remaining)
        own_estimate = batch_estimate(own, population_of(trainer.train_dataloader))
        self.truths[step] = dataclasses.replace(truth, step_estimate=own_estimate)


@dataclass
class Row:
    """One logged step: the truth and what the estimate logged (``inf`` for a tag left out as infinite)."""

    truth: Truth
    logged: dict[str, float] = field(default_factory=dict)
    margin: float = 1.0

    def true(self, quantity: str) -> float:
        return self.truth.band_ratio(self.margin) if quantity == "band_ratio" else getattr(self.truth, quantity)

    def interval(self, quantity: str) -> tuple[float, float]:
        return self.logged[f"{quantity}_low"], self.logged.get(f"{quantity}_high", math.inf)

    def covered(self, quantity: str) -> bool:
        low, high = self.interval(quantity)
        return low <= self.true(quantity) <= high

    def ratio(self, quantity: str) -> float:
        """Estimate over truth; ``inf`` where B_simple was not logged (its ‖G‖² ≤ 0)."""
        return self.logged.get(quantity, math.inf) / self.true(quantity)


def compare(
    truths: Mapping[int, Truth], series: Mapping[str, Sequence[tuple[int, float]]], margin: float = 1.0
) -> list[Row]:
    """The steps with a truth and a logged estimate (``grad_noise/grad_sq_norm``), each with every logged tag of
    :data:`QUANTITIES`, its ``_low``/``_high``, ``grad_noise/effective_measurements`` and
    ``grad_noise/b_simple_unreliable``; ``margin`` is the stopper's (the band ratio's)."""
    by_tag = {tag: dict(values) for tag, values in series.items()}
    rows = []
    for step in sorted(truths):
        if step not in by_tag.get("grad_noise/grad_sq_norm", {}):
            continue
        logged = {}
        for quantity in QUANTITIES:
            for suffix in ("", "_low", "_high"):
                value = by_tag.get(f"grad_noise/{quantity}{suffix}", {}).get(step)
                if value is not None:
                    logged[quantity + suffix] = value
        for extra in ("effective_measurements", "b_simple_unreliable"):
            logged[extra] = by_tag[f"grad_noise/{extra}"][step]
        rows.append(Row(truths[step], logged, margin))
    return rows


def shares(rows: Sequence[Row], skip: float = 0.1) -> dict[str, Any]:
    """Over the rows after the first ``skip`` of the steps: per quantity logged, the share whose interval covers
    the truth and the median estimate/truth; the shares with a finite lower bound on B_simple (> 0), with a
    reliable point estimate (``reliable_covered``: of those, the share whose B_simple interval covers the truth; NaN
    with none), and where one is reachable (the truth's own relative error at the logged effective
    measurements ≤ 0.5, :meth:`Truth.rel_err`; NaN without draws); ``steps``: the rows counted. Per quantity
    (``grad_sq_norm``, ``trace_cov``) ``step_{q}_ratio``: the steps' own estimates (:attr:`Truth.step_estimate`)
    summed over the truths summed, and ``step_{q}_ratio_se`` its standard error (the differences estimate − truth
    taken as uncorrelated from step to step, as they are where the batch does not depend on θ); NaN without them."""
    last = max(row.truth.step for row in rows)
    kept = [row for row in rows if row.truth.step >= skip * last]
    out: dict[str, Any] = {"steps": len(kept)}
    for quantity in QUANTITIES:
        have = [row for row in kept if f"{quantity}_low" in row.logged]
        if have:
            out[f"{quantity}_covered"] = sum(row.covered(quantity) for row in have) / len(have)
            out[f"{quantity}_ratio"] = statistics.median(row.ratio(quantity) for row in have)
    for k, quantity in enumerate(("grad_sq_norm", "trace_cov")):
        pairs = [(row.truth.step_estimate[k], getattr(row.truth, quantity)) for row in kept]
        pairs = [(est, true) for est, true in pairs if not math.isnan(est)]
        total = sum(true for _, true in pairs)
        spread = statistics.stdev(est - true for est, true in pairs) if len(pairs) > 1 else math.nan
        out[f"step_{quantity}_ratio"] = sum(est for est, _ in pairs) / total if pairs else math.nan
        out[f"step_{quantity}_ratio_se"] = spread * math.sqrt(len(pairs)) / total if pairs else math.nan
    out["b_simple_bounded"] = sum(row.logged["b_simple_low"] > 0 for row in kept) / len(kept)
    reliable = [row for row in kept if row.logged["b_simple_unreliable"] == 0]
    out["reliable"] = len(reliable) / len(kept)
    out["reliable_covered"] = sum(row.covered("b_simple") for row in reliable) / len(reliable) if reliable else math.nan
    reach = [row.truth.rel_err(row.logged["effective_measurements"]) for row in kept]
    out["reachable"] = (
        math.nan
        if all(math.isnan(row.truth.var_grad) for row in kept)
        else sum(r <= MAX_REL_ERR for r in reach) / len(kept)
    )
    return out


# ---------------------------------------------------------------------- data and models of the truth runs
def digits_train() -> tuple[Tensor, Tensor]:
    """The demo's digits training split (its fixed 80 %): images ``(N, 1, 8, 8)`` in [0, 1], labels ``(N,)``."""
    from trainvitals.demo.data import DigitsDataModule

    data = DigitsDataModule()
    data.setup()
    return data.train_set.tensors


def char_windows(name: str = "textwrap.py", context: int = 32) -> tuple[Tensor, Tensor, int]:
    """Non-overlapping windows of a standard-library module's characters: inputs ``(N, context)``, the next
    characters as targets, and the vocabulary's size."""
    text = (Path(sysconfig.get_paths()["stdlib"]) / name).read_text(encoding="utf-8")
    vocab = {c: i for i, c in enumerate(sorted(set(text)))}
    ids = torch.tensor([vocab[c] for c in text], dtype=torch.long)
    n = (len(ids) - 1) // context
    return ids[: n * context].view(n, context), ids[1 : n * context + 1].view(n, context), len(vocab)


class Classifier(pl.LightningModule):
    """``net`` under the mean cross-entropy of its batch (one label, or one per token), Adam at ``lr``."""

    def __init__(self, net: nn.Module, lr: float = 1e-3) -> None:
        super().__init__()
        self.net, self.lr = net, lr

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        out = self(x)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def layernorm_mlp(hidden: int = 64) -> nn.Module:
    """Flatten → Linear(64 → hidden) → LayerNorm → ReLU → Linear(hidden → 10), for 8×8 digits."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.LayerNorm(hidden), nn.ReLU(), nn.Linear(hidden, 10))


class Block(nn.Module):
    """nanoGPT's pre-LN block: causal self-attention (one Linear for q, k, v; its math path, which vmap batches
    without a fallback) and a GELU MLP, no dropout."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.c_attn, self.c_proj = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ln_2, self.fc, self.proj = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.heads = heads

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)  # nanoGPT's own path without flash
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        y = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class CharGPT(nn.Module):
    """A nanoGPT-style character LM: token and ``arange(T)`` position embeddings, pre-LN blocks, a final LayerNorm
    and an output layer tied to the token embedding; logits ``(B, T, vocab)``."""

    def __init__(self, vocab: int, context: int = 32, dim: int = 32, layers: int = 2, heads: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        self.h = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: Tensor) -> Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def fit_with_truth(
    model: pl.LightningModule,
    data: tuple[Tensor, Tensor],
    callbacks: Sequence[pl.Callback],
    batch_size: int,
    accumulate: int = 1,
    max_steps: int = 200,
    log_every_n_steps: int = 5,
    draws: int = 0,
    replacement: bool = False,
) -> list[Row]:
    """Fit ``model`` on ``data`` (shuffled, every batch of ``batch_size``) for ``max_steps`` optimizer steps with
    ``callbacks`` and a :class:`TruthCallback` at the logging cadence on CPU; the rows of :func:`compare` (the band
    ratio at the margin of a callback that has one, the stopper's). With ``replacement`` each batch is drawn with
    replacement from all of ``data`` instead of from the epoch's examples not drawn yet: the estimate's batches are
    then uniform draws at every step, as the truth assumes (issue #24's diagnosis of the epoch-order bias)."""
    from conftest import RecordingLogger, trainer_kwargs
    from torch.utils.data import DataLoader, RandomSampler, TensorDataset

    truth = TruthCallback(*data, every_n_steps=log_every_n_steps, draws=draws)
    logger = RecordingLogger()
    trainer = pl.Trainer(
        **trainer_kwargs(
            logger=logger,
            callbacks=[*callbacks, truth],
            max_steps=max_steps,
            max_epochs=-1,
            accumulate_grad_batches=accumulate,
            log_every_n_steps=log_every_n_steps,
        )
    )
    dataset = TensorDataset(*data)
    sampler = RandomSampler(dataset, replacement=replacement)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
    trainer.fit(model, loader)
    margin = next((cb.margin for cb in callbacks if hasattr(cb, "margin")), 1.0)
    return compare(truth.truths, logger.series, margin)
