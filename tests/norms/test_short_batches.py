"""GradNormMonitor's spike rule on an epoch's short last batch, in fits: the allowance √(B / b), kept over a resume,
the same on every rank; checked against the rule replayed by hand over each step's brute-force norm."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from _models import NoiseOnly, ReleaseProcessGroup
from _spike_rule import spike_ratios
from conftest import HostReads, RecordingLogger, trainer_kwargs
from torch.utils.data import DataLoader, TensorDataset

from trainvitals import GradNormMonitor

BATCH, D = 16, 2
"""Batches of 16 rows of x ~ N(0, I₂): a 1-row batch's gradient norm is χ₂-distributed about 4× a full one's, above
the default 5× rule often enough to fire at some epoch ends, and below 4 × 5 = 20× but for about 1 in 10⁸."""


def _flagged(norms: list[float], allowances: list[float] | None = None) -> list[int]:
    """The steps the monitor's default rule (5×, β 0.98, 20 warm-up steps) flags, each threshold × its allowance."""
    return [s for s, ratio in enumerate(spike_ratios(norms, 5.0, 0.98, 20, allowances)) if ratio is not None]


def _allowances(batches: list[float], usual: float) -> list[float]:
    """√(B / b) for a step of b examples below the usual B, else 1."""
    return [math.sqrt(usual / b) if b < usual else 1.0 for b in batches]


def _fit(model: NoiseOnly, monitor: GradNormMonitor, data: DataLoader, **kwargs) -> RecordingLogger:
    logger = RecordingLogger()
    pl.Trainer(**trainer_kwargs(callbacks=[monitor], logger=logger, **kwargs)).fit(model, data)
    return logger


def _counts_at(logger: RecordingLogger, flagged: list[int]) -> tuple[list[float], list[int]]:
    """The logged ``grad_norm/spike_steps`` and, at the same steps, the count of ``flagged`` steps up to each."""
    series = logger.series["grad_norm/spike_steps"]
    return [count for _, count in series], [sum(s <= step for s in flagged) for step, _ in series]


@pytest.mark.parametrize(("accumulate", "epochs"), [(1, 12), (2, 40)])
def test_an_epochs_one_row_batch_is_no_spike_and_a_20x_spike_on_it_still_is(caplog, accumulate, epochs):
    """321 rows at batch 16, shuffled: 20 full batches and a last one of 1 row each epoch (``drop_last=False``),
    read back every 7 steps; under accumulation of 2 the last step is that row alone, halved, signal and noise alike
    (weighted as that row: b = 1 against B = 32; more epochs, for the plain rule to show). The plain rule (allowance
    1, the monitor's before) flags epoch ends and nothing else; the rule with the short steps' thresholds × √(B / b)
    flags none of them, nor does the monitor; the last step of epoch 5 × 20 is flagged, said with its batch."""
    data = DataLoader(TensorDataset(torch.randn(20 * BATCH + 1, D)), batch_size=BATCH, shuffle=True)
    per_epoch = -(-21 // accumulate)
    spike_at, usual = 6 * per_epoch - 1, BATCH * accumulate
    for spike, expected in ((1.0, []), (20.0, [spike_at])):
        model = NoiseOnly(spike_at=spike_at, spike=spike, d=D)
        monitor = GradNormMonitor(log_every_n_steps=7, histogram_every_n_steps=0)
        with caplog.at_level("INFO"):
            logger = _fit(model, monitor, data, max_epochs=epochs, accumulate_grad_batches=accumulate)
        steps = sorted(model.norms)
        assert len(steps) == per_epoch * epochs and model.sizes[spike_at] == [1]
        norms = [model.norms[s] for s in steps]
        # The mean of the n micro-batches that ran: n² / Σ 1/b_k.
        batches = [1.0 / sum(1.0 / (len(model.sizes[s]) ** 2 * b) for b in model.sizes[s]) for s in steps]
        ends = [s for s in steps if batches[s] < usual]
        plain = _flagged(norms)
        assert plain and set(plain) <= set(ends)
        assert _flagged(norms, _allowances(batches, usual)) == expected
        logged, replayed = _counts_at(logger, expected)
        assert logged == replayed and logged[-1] == len(expected)
        said = [r.message for r in caplog.records if "spike at optimizer step" in r.message]
        caplog.clear()
        assert len(said) == len(expected)
        if expected:
            short = f"(a batch of 1 examples against the usual {usual}: "
            assert f"step {spike_at}: " in said[0] and short in said[0]


def test_the_batch_sizes_cost_no_host_read_between_logging_steps(monkeypatch):
    """The micro-batches are sized from their tensors' shapes and their weights kept as host floats: the monitor's
    hooks read the host at its logging steps only (every 3rd, one transfer each): none at the epoch's short step 20."""
    monitor = GradNormMonitor(log_every_n_steps=3, histogram_every_n_steps=0)
    host = HostReads(monkeypatch)
    host.watch(monitor, ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step"))
    data = DataLoader(TensorDataset(torch.randn(20 * BATCH + 1, D)), batch_size=BATCH)
    pl.Trainer(**trainer_kwargs(callbacks=[monitor], max_steps=23)).fit(NoiseOnly(d=D), data)
    assert host.reads == [(s, "tolist") for s in range(0, 23, 3)]


def _short_first() -> DataLoader:
    """321 rows, each epoch's 1-row batch first: a resume at an epoch's end starts on it."""
    order = [[0]] + [list(range(1 + BATCH * k, 1 + BATCH * (k + 1))) for k in range(20)]
    return DataLoader(TensorDataset(torch.randn(20 * BATCH + 1, D)), batch_sampler=order)


def test_a_resume_keeps_the_usual_batch_its_next_short_batch_is_judged_against(tmp_path):
    """Two epochs, a checkpoint, a third resumed from it whose first step is the 1-row batch, its gradient scaled to
    about 10× a full batch's RMS norm: above 5× the restored average (what a monitor that forgot the usual batch
    would flag: UsualBatch has nothing usual, so allowance 1), below 20×. The resumed monitor restores the usual 16
    from the checkpoint and flags nothing, as the rule replayed over both fits' norms."""
    data = _short_first()
    first, monitor = NoiseOnly(d=D), GradNormMonitor(log_every_n_steps=5, histogram_every_n_steps=0)
    trainer = pl.Trainer(**trainer_kwargs(callbacks=[monitor], max_epochs=2))
    trainer.fit(first, data)
    trainer.save_checkpoint(tmp_path / "two.ckpt")
    saved = torch.load(tmp_path / "two.ckpt", weights_only=False)["callbacks"][monitor.state_key]["tracks"]["0"]
    assert saved["usual_batch"]["current"] == BATCH or saved["usual_batch"]["previous"] == BATCH

    spike = 10.0 * math.sqrt(D / BATCH) / data.dataset.tensors[0][0].norm().item()  # the 1-row batch's row
    resumed = NoiseOnly(spike_at=42, spike=spike, d=D)
    restored = GradNormMonitor(log_every_n_steps=5, histogram_every_n_steps=0)
    trainer = pl.Trainer(**trainer_kwargs(callbacks=[restored], max_epochs=3))
    trainer.fit(resumed, data, ckpt_path=tmp_path / "two.ckpt")
    model_norms = {**first.norms, **resumed.norms}
    sizes = {**first.sizes, **resumed.sizes}
    assert sorted(model_norms) == list(range(63)) and sizes[42] == [1]
    norms, batches = [model_norms[s] for s in range(63)], [float(sum(sizes[s])) for s in range(63)]
    forgot = _allowances(batches, BATCH)
    forgot[42] = 1.0  # a usual batch lost at the resume: the step after it is allowed nothing
    assert 42 in _flagged(norms, forgot)
    assert _flagged(norms, _allowances(batches, BATCH)) == []
    assert restored._tracks[0].counts["spike_steps"] == 0 and restored._tracks[0].steps == 63


class PerRankRows(NoiseOnly):
    """NoiseOnly on rank 0's 321 rows and rank 1's 328, each its own loader (no DistributedSampler): 21 batches an
    epoch on both, the last of 1 row on rank 0 and of 8 on rank 1."""

    def train_dataloader(self) -> DataLoader:
        rows = 20 * BATCH + (1 if self.global_rank == 0 else 8)
        x = torch.randn(rows, D, generator=torch.Generator().manual_seed(self.global_rank))
        return DataLoader(TensorDataset(x), batch_size=BATCH, shuffle=False)


class _RecordPerRank(pl.Callback):
    """After GradNormMonitor in the callback list: its spike count after each step, and at the end its track's state,
    the model's norms and this rank's batch sizes, to ``rank<r>.json``."""

    def __init__(self, folder: str) -> None:
        self.folder, self.counts = folder, []

    def on_train_batch_end(self, trainer, pl_module, *_):
        monitor = next(cb for cb in trainer.callbacks if isinstance(cb, GradNormMonitor))
        self.counts.append(monitor._tracks[0].counts["spike_steps"])

    def on_train_end(self, trainer, pl_module):
        monitor = next(cb for cb in trainer.callbacks if isinstance(cb, GradNormMonitor))
        record = {
            "counts": self.counts,
            "state": monitor._tracks[0].state.state_dict(),
            "norms": [pl_module.norms[s] for s in sorted(pl_module.norms)],
            "sizes": [sum(pl_module.sizes[s]) for s in sorted(pl_module.sizes)],
        }
        Path(self.folder, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


@pytest.mark.slow
def test_ddp_ranks_with_different_short_batches_flag_the_same_steps(tmp_path):
    """2 gloo CPU ranks whose epochs end in batches of 1 and 8 rows: the averaged gradient's effective batch there is
    4 / (1/1 + 1/8) = 3.6 against the usual 4 / (2/16) = 32, what the rule replayed allows (√(32 / 3.6) = 3.0); each
    rank judging by its own batch (√16 = 4 on rank 0, √2 on rank 1) would decide differently on the last step of epoch
    3 with its gradient × 10, which the rule flags. Both ranks count the same spikes after every step (read back
    every 5 steps, the weights summed over the ranks then) and keep the same state."""
    epochs, spike_at = 4, 3 * 21 - 1
    monitor = GradNormMonitor(log_every_n_steps=5, histogram_every_n_steps=0)
    callbacks = [monitor, _RecordPerRank(str(tmp_path)), ReleaseProcessGroup()]
    kwargs = trainer_kwargs(
        strategy="ddp_spawn", devices=2, callbacks=callbacks, max_epochs=epochs, use_distributed_sampler=False
    )
    pl.Trainer(**kwargs).fit(PerRankRows(spike_at=spike_at, spike=10.0, d=D))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    norms = ranks[0]["norms"]
    assert norms == ranks[1]["norms"] and len(norms) == 21 * epochs  # the averaged gradient: the same on both
    b0, b1 = ranks[0]["sizes"], ranks[1]["sizes"]
    batches = [4.0 / (1.0 / x + 1.0 / y) for x, y in zip(b0, b1)]
    expected = _flagged(norms, _allowances(batches, 2.0 * BATCH))
    own = [_flagged(norms, _allowances([float(b) for b in sizes], BATCH)) for sizes in (b0, b1)]
    assert expected == [spike_at] and own == [[], [spike_at]]  # by its own batch, each rank would decide otherwise
    assert ranks[0]["counts"] == ranks[1]["counts"] and ranks[0]["state"] == ranks[1]["state"]
    assert ranks[0]["counts"][-1] == ranks[0]["state"]["counts"]["spike_steps"] == len(expected)
    assert ranks[0]["state"]["usual_batch"]["previous"] == pytest.approx(2.0 * BATCH)
