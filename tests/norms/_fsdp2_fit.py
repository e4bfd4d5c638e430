"""Run by tests/test_fsdp2.py as a script: Lightning's ModelParallelStrategy re-launches it once per rank.

FSDP2 (``fully_shard``) on 2 CPU processes with gloo: every parameter and gradient is a DTensor
sharded across the ranks, unevenly: the last layer's (1, 8) weight leaves rank 1 an empty shard.
Usage: ``_fsdp2_fit.py OUT NORM_TYPE``. Each rank writes ``<OUT>.<rank>.json`` with what the callbacks
logged and measured, and the brute-force norm of the full gradient (gathered with ``full_tensor()``).
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
from _models import Regressor, loader, regression_data  # noqa: E402
from conftest import RecordingLogger  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402

from trainvitals import GradNormEarlyStopping, GradNormMonitor, UpdateMonitor  # noqa: E402


class ShardedRegressor(Regressor):
    def __init__(self, norm_type: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.norm_type = norm_type

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        flat = torch.cat([p.grad.full_tensor().reshape(-1).double() for p in self.parameters()])
        self.reference_norms.append(torch.linalg.vector_norm(flat, self.norm_type).item())
        self._before = [p.full_tensor().detach().double().clone() for p in self.parameters()]

    def on_train_batch_end(self, *_) -> None:
        after = [p.full_tensor().detach().double() for p in self.parameters()]
        delta = torch.cat([(a - b).reshape(-1) for a, b in zip(after, self._before)])
        self.reference_updates.append(torch.linalg.vector_norm(delta).item())
        self.reference_ratios.append(
            self.reference_updates[-1]
            / torch.linalg.vector_norm(torch.cat([b.reshape(-1) for b in self._before])).item()
        )


def main(out: str, norm_type: float) -> None:
    torch.manual_seed(0)
    model, logger = ShardedRegressor(norm_type, lr=0.05), RecordingLogger()
    model.reference_updates, model.reference_ratios = [], []
    updates = UpdateMonitor(log_every_n_steps=1)
    monitor = GradNormMonitor(norm_type=norm_type, log_every_n_steps=1, histogram_every_n_steps=4)
    stopper = GradNormEarlyStopping(mode="threshold", threshold=1e9, patience=3, min_steps=0, check_every_n_steps=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=8,
        logger=logger,
        callbacks=[monitor, stopper, updates],
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer.fit(model, loader(regression_data(64), 4))
    result = {
        "series": dict(logger.series),
        "reference": model.reference_norms,
        "reference_updates": model.reference_updates,
        "reference_ratios": model.reference_ratios,
        "global_step": trainer.global_step,
        "last_total": float(monitor.last_total[0]),
        "stopped_step": stopper.stopped_step,
        "norm_type": sys.argv[2],
        "histogram_notices": sum("histograms of sharded" in str(w.message) for w in said),
    }
    Path(f"{out}.{trainer.global_rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()  # both files exist before rank 0, the test's child, returns
    # gloo's threads can abort the interpreter's shutdown ("terminate called without an active
    # exception"); the results are written, so leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
