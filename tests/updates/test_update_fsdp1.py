"""UpdateMonitor's path over FSDP1's plain-tensor parameter shards (full and hybrid sharding): ‖θ‖, ‖Δθ‖ and
⟨−Δθ, g⟩ of the whole parameters on every rank, from each rank's shards.

As in tests/norms/test_fsdp1_shards.py: Lightning refuses ``FSDPStrategy`` on CPU, so torch's FSDP wraps the
model on gloo processes and the reductions run with a trainer whose strategy is a real ``FSDPStrategy``.
"""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _models import free_port
from torch import nn

from trainvitals.plumbing.sharding import reduce_shard_norms, reduce_shard_sums
from trainvitals.updates.measure import descent_dots, snapshot, step_change

NODES = {"FULL_SHARD": 1, "HYBRID_SHARD": 2}
RANKS_PER_NODE = 2


def _full(model, grads: bool = False) -> list[torch.Tensor]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model, with_grads=grads):
        return [(p.grad if grads else p).detach().clone() for p in model.parameters()]


def _rank(rank: int, mode: str, port: int, out: str) -> None:
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    nodes = NODES[mode]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=nodes * RANKS_PER_NODE)
    mesh = init_device_mesh("cpu", (nodes, RANKS_PER_NODE)) if nodes > 1 else None
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 1))
    model = FSDP(
        net,
        use_orig_params=True,
        sharding_strategy=ShardingStrategy[mode],
        device_id=torch.device("cpu"),
        device_mesh=mesh,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(1)
    for _ in range(2):  # the second step's Δθ is not −lr·g: momentum turns it
        optimizer.zero_grad()
        nn.functional.mse_loss(model(torch.randn(4, 6)), torch.randn(4, 1)).backward()
        before_full, grads_full = _full(model), _full(model, grads=True)
        params = list(model.parameters())
        before = snapshot(params)
        optimizer.step()
    after_full = _full(model)
    # The monitor's path: per-tensor norms and dots of this rank's shards, reduced over the ranks.
    strategy = FSDPStrategy(sharding_strategy=mode, **({"device_mesh": (nodes, RANKS_PER_NODE)} if mesh else {}))
    trainer = types.SimpleNamespace(strategy=strategy, num_nodes=nodes)
    weight, update = step_change(before, params)
    dots = descent_dots(before, [p.grad for p in params])
    result = {
        "present": sum(p.numel() > 0 for p in params),
        "weight": reduce_shard_norms(trainer, weight).tolist(),
        "update": reduce_shard_norms(trainer, update).tolist(),
        "dots": reduce_shard_sums(trainer, dots).tolist(),
        "reference_weight": [b.double().norm().item() for b in before_full],
        "reference_update": [(a - b).double().norm().item() for a, b in zip(after_full, before_full)],
        "reference_dots": [
            ((b - a).double() * g.double()).sum().item() for a, b, g in zip(after_full, before_full, grads_full)
        ],
    }
    Path(out, f"{mode}.{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    os._exit(0)  # as in tests/norms/test_fsdp1_shards.py: gloo's threads can abort the interpreter's shutdown


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["FULL_SHARD", "HYBRID_SHARD"])
def test_shard_updates_reduce_to_the_whole_parameters_on_every_rank(mode, tmp_path):
    world = NODES[mode] * RANKS_PER_NODE
    torch.multiprocessing.spawn(_rank, args=(mode, free_port(), str(tmp_path)), nprocs=world)
    ranks = [json.loads(Path(tmp_path, f"{mode}.{r}.json").read_text()) for r in range(world)]
    assert all(0 < r["present"] < 6 for r in ranks)  # each rank holds only some of the parameters
    for r in ranks:
        for key in ("weight", "update", "dots"):
            assert r[key] == pytest.approx(r[f"reference_{key}"], rel=1e-5, abs=1e-9), key
