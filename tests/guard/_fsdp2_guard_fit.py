"""Run by tests/guard/test_fsdp2_producer.py as a script: Lightning's ModelParallelStrategy re-launches it per rank.

FSDP2 (``fully_shard`` on each Linear and on the whole) on 2 CPU processes with gloo: LogModel, whose layer
``net.2`` (a log) makes -inf when its inputs are -1000. Rank 1's batch of optimizer step 3 is made of such
inputs (in ``training_step``, so that a re-run of that batch on that rank makes them again), so the gradient,
averaged over ranks, is NaN on both ranks and only rank 1's re-run finds the producer.
Usage: ``_fsdp2_guard_fit.py OUT guard|anomaly|monitor``: TrainingGuard(on_nonfinite="skip") alone (with
``producer_search="anomaly"``), or GradNormMonitor(log_every_n_steps=1) alone. Each rank writes
``<OUT>.<rank>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))

import lightning.pytorch as pl  # noqa: E402
from _models import LogModel  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from trainvitals import GradNormMonitor, TrainingGuard  # noqa: E402

BAD_STEP = 3


class ShardedLogModel(LogModel):
    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step == BAD_STEP and self.global_rank == 1:
            x = torch.full_like(x, -1000.0)
        return super().training_step((x, y), batch_idx)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def main(out: str, which: str) -> None:
    torch.manual_seed(0)
    x, y = torch.rand(64, 4), torch.randn(64, 1)
    callback = {
        "guard": lambda: TrainingGuard(on_nonfinite="skip"),
        "anomaly": lambda: TrainingGuard(on_nonfinite="skip", producer_search="anomaly"),
        "monitor": lambda: GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0),
    }[which]()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=6,
        logger=False,
        default_root_dir=str(Path(out).parent),  # skip_batches.json beside OUT, not in the working directory
        callbacks=[callback],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(ShardedLogModel(), DataLoader(TensorDataset(x, y), batch_size=4))
    search = callback.search
    producer = search.producer
    result = {
        "global_step": trainer.global_step,
        "producer": None if producer is None else [producer.where, producer.module, producer.op],
        "rerun": search.rerun,
        "events": [[e["global_step"], e["action"]] for e in getattr(callback, "events", [])],
        "warnings": [str(w.message) for w in caught if "trainvitals" in str(w.message)],
        "hooks_left": sum(  # the search's own, not FSDP's
            hook.__module__.startswith("trainvitals")
            for m in trainer.lightning_module.modules()
            for hook in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())
        ),
    }
    Path(f"{out}.{trainer.global_rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()  # both files exist before rank 0, the test's child, returns
    # gloo's threads can abort the interpreter's shutdown; the results are written, so leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
