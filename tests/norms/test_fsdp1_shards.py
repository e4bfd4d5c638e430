"""FSDP1's plain-tensor gradient shards (full, no and hybrid sharding): the norms of the whole
gradients, on every rank.

Lightning refuses ``FSDPStrategy`` on CPU, so torch's own FSDP wraps the model (``use_orig_params=True``,
as Lightning's default) on 2 gloo processes, and the callbacks' code paths run with a trainer whose
strategy is a real ``FSDPStrategy`` (its ``reduce`` is the one used in training).
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

from trainvitals.fused_norms import combine_norms, per_tensor_norms
from trainvitals.plumbing.sharding import reduce_shard_norms

# Hybrid sharding: 2 "nodes" of 2 ranks; each node holds the model once, sharded over its 2 ranks.
NODES = {"FULL_SHARD": 1, "NO_SHARD": 1, "HYBRID_SHARD": 2}
RANKS_PER_NODE = 2


def _rank(rank: int, mode: str, port: int, out: str) -> None:
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    nodes = NODES[mode]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=nodes * RANKS_PER_NODE)
    mesh = init_device_mesh("cpu", (nodes, RANKS_PER_NODE)) if nodes > 1 else None  # (replicate, shard)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 1))
    model = FSDP(
        net,
        use_orig_params=True,
        sharding_strategy=ShardingStrategy[mode],
        device_id=torch.device("cpu"),
        device_mesh=mesh,
    )
    torch.manual_seed(1)
    nn.functional.mse_loss(model(torch.randn(4, 6)), torch.randn(4, 1)).backward()
    params = list(model.parameters())
    with FSDP.summon_full_params(model, with_grads=True):
        full = [torch.linalg.vector_norm(p.grad).item() for p in model.parameters()]
    strategy = FSDPStrategy(sharding_strategy=mode, **({"device_mesh": (nodes, RANKS_PER_NODE)} if mesh else {}))
    trainer = types.SimpleNamespace(strategy=strategy, num_nodes=nodes)
    present = [i for i, p in enumerate(params) if p.grad is not None]
    # The monitor's path: a (P,) row, 0 where this rank holds no slice of the parameter.
    row = torch.zeros(len(params), dtype=torch.float64)
    if present:
        row[present] = per_tensor_norms([params[i].grad for i in present])
    # The stopper's path: this rank's total.
    grads = [params[i].grad for i in present]
    local = combine_norms(per_tensor_norms(grads)) if grads else torch.zeros((), dtype=torch.float64)
    result = {
        "present": len(present),
        "reference": full,
        "per_parameter": reduce_shard_norms(trainer, row).tolist(),
        "total": reduce_shard_norms(trainer, local.reshape(1))[0].item(),
    }
    Path(out, f"{mode}.{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    # FSDP keeps references to gloo's process group, whose threads can abort the interpreter's shutdown
    # ("terminate called without an active exception"); the results are written, so leave at once.
    os._exit(0)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["FULL_SHARD", "NO_SHARD", "HYBRID_SHARD"])
def test_shard_norms_combine_to_the_whole_gradients_on_every_rank(mode, tmp_path):
    world = NODES[mode] * RANKS_PER_NODE
    torch.multiprocessing.spawn(_rank, args=(mode, free_port(), str(tmp_path)), nprocs=world)
    ranks = [json.loads(Path(tmp_path, f"{mode}.{r}.json").read_text()) for r in range(world)]
    if mode != "NO_SHARD":  # the tiny model's parameters fall wholly in one rank's shard or the other's
        assert all(0 < r["present"] < 6 for r in ranks)
    for r in ranks:
        assert r["per_parameter"] == pytest.approx(r["reference"], rel=1e-5)
        assert r["total"] == pytest.approx(sum(v * v for v in r["reference"]) ** 0.5, rel=1e-5)
