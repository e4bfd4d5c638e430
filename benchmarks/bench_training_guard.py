"""Training-step overhead of TrainingGuard with no event, and the one-off costs of a snapshot and a producer search.

Variants, timed interleaved in one process, every one with the same TensorBoardLogger and
``Trainer(log_every_n_steps=1)``:

- ``bare``: the module alone;
- ``guard``: + ``TrainingGuard(snapshot_every_n_steps=0)``: the loss kept at backward, the step's gradient
  norm (the hub's fused pass: the guard is its only reader here), the one host read of the decision, the
  spike rule, the copy of the persistent buffers a skip puts back;
- ``norm``: + one fused ``torch._foreach_norm`` over the gradients per step and nothing else: the pass the
  guard cannot do without (its ‖g‖ and its finiteness read every gradient element once);
- ``monitor`` and ``monitor_guard``: GradNormMonitor alone, and with the guard reading its norm (the
  guard's cost when the norm is shared);
- opt-in ``guard_snapshot_cpu`` / ``guard_snapshot_device``: + a snapshot every ``--snapshot-every`` steps.

Models (``--models``): ``mlp``, the 49-layer MLP at batch 64 (and at each of ``--mlp-batch-sizes`` more,
``mlp-b<size>``: the same model, more rows per step); ``cnn``, a small CNN with BatchNorm (:class:`BNConvNet`,
3 × 32 × 32 random images, batch 64), whose buffers a skip puts back.

Then, on the MLP, one-off costs timed directly (median of ``--repetitions``): a snapshot to the
CPU and on the device (``Snapshot.take``), and the producer search (``find_producer``: one forward and
backward with the finiteness hooks; ``find_producer_by_anomaly``: the same under ``detect_anomaly``) against
a plain forward and backward; and the per-step copy of a ResNet-50's BatchNorm buffers (53 BatchNorm2d in 229
modules) with its kept buffer list and with the module walked each step, as before. Last, the share of that one
norm pass in a plain-torch step (forward, backward, SGD) at each of ``--norm-batch-sizes``: it reads each
gradient once, while the step's work grows with the batch, so its share is that of a model with as many tokens
(rows) per step.

    OMP_NUM_THREADS=1 nice python benchmarks/bench_training_guard.py --repetitions 7 --out training_guard.json
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from _common import (
    MLP_WIDTH,
    StepTimer,
    WideMLP,
    add_timing_arguments,
    apply_timing_arguments,
    fit_once,
    interleaved,
    machine_line,
    markdown_table,
    median,
    random_regression_loader,
    ratio_cells,
    ratio_row,
    run_overhead,
    time_hook,
    write_json,
)
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainvitals.guard.callback import TrainingGuard
from trainvitals.guard.snapshot import BufferCopy, Snapshot
from trainvitals.norms.monitor import GradNormMonitor
from trainvitals.norms.producer import find_producer, find_producer_by_anomaly

GUARD_HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_before_optimizer_step",
    "_before_step",
    "_after_step",
    "on_train_batch_end",
)
"""What TrainingGuard runs in a step: timed each, summed (``guard hooks ms``)."""

VARIANTS = (
    "bare",
    "guard",
    "norm",
    "monitor",
    "monitor_guard",
    "guard_snapshot_cpu",
    "guard_snapshot_device",
)


class BNConvNet(pl.LightningModule):
    """Conv(3→32) → BN → ReLU → Conv(32→64, stride 2) → BN → ReLU → Conv(64→128, stride 2) → BN → ReLU → mean
    pool → Linear(128→10), cross-entropy under plain SGD: a small CNN (≈ 94k parameters) with BatchNorm buffers."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for c_in, c_out, stride in ((3, 32, 1), (32, 64, 2), (64, 128, 2)):
            layers += [nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def image_loader(batches: int, batch_size: int = 64, seed: int = 0) -> DataLoader:
    """``batches`` fixed batches of 3 × 32 × 32 standard-normal images and labels in 0..9."""
    g = torch.Generator().manual_seed(seed)
    n = batches * batch_size
    data = TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
    return DataLoader(data, batch_size=batch_size, shuffle=False)


def resnet50_bn_stack() -> nn.Module:
    """A ResNet-50's BatchNorm layout without its compute: 53 BatchNorm2d, each after a 1×1 conv, in 16 blocks
    (229 modules): what :class:`BufferCopy` walks."""

    def unit(c: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU())

    widths = [64] * 3 + [128] * 4 + [256] * 6 + [512] * 3
    blocks = [nn.Sequential(*[unit(c) for _ in range(3 + (i in (0, 3, 7, 13)))]) for i, c in enumerate(widths)]
    return nn.Sequential(unit(64), *blocks)


def buffer_copy_costs(repetitions: int) -> dict[str, float]:
    """Median seconds of one :meth:`BufferCopy.take` on :func:`resnet50_bn_stack` with its kept list, and with the
    module walked again (the list dropped before each take: what every step cost before the list was kept)."""
    model = resnet50_bn_stack()
    costs = {}
    for name, walk in (("buffer_copy_kept", False), ("buffer_copy_walked", True)):
        copy, times = BufferCopy(), []
        copy.take(model)
        for _ in range(repetitions):
            start = time.perf_counter()
            for _ in range(100):
                if walk:
                    copy.close()
                copy.take(model)
            times.append((time.perf_counter() - start) / 100)
        copy.close()
        costs[name] = median(times)
    return costs


class OneNormPass(Callback):
    """One fused 2-norm over the gradients per optimizer step, its square summed on the device: the guard's
    irreducible pass, alone."""

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.sq_norm = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)).square().sum()


def _callbacks(variant: str, snapshot_every: int) -> list[Callback]:
    callbacks: list[Callback] = []
    if variant == "norm":
        callbacks.append(OneNormPass())
    if variant.startswith("monitor"):
        callbacks.append(GradNormMonitor(log_every_n_steps=1, histogram_every_n_steps=0))
    if "guard" in variant:
        every = snapshot_every if "snapshot" in variant else 0
        where = "device" if variant.endswith("device") else "cpu"
        callbacks.append(TrainingGuard(snapshot_every_n_steps=every, snapshot_on=where))
    return callbacks


def timed_fit(
    variant: str, make_model: Callable[[], pl.LightningModule], make_data: Callable[[], Any], args: argparse.Namespace
) -> dict[str, float]:
    """One fit of ``warmup + steps`` optimizer steps; its median step times and the guard's hook time: the sum over
    its hooks (the Trainer's and the optimizer's step pre- and post-hook) of each one's median thread time per
    call, one call each per step here (no accumulation)."""
    pl.seed_everything(0, verbose=False)
    timer = StepTimer(args.warmup)
    extra = _callbacks(variant, args.snapshot_every)
    guards = [cb for cb in extra if isinstance(cb, TrainingGuard)]
    hook_seconds = [time_hook(guards[0], hook) for hook in GUARD_HOOKS] if guards else []
    with tempfile.TemporaryDirectory() as logdir:
        fit_once(make_model(), make_data(), [timer, *extra], args.warmup + args.steps["mlp"] + 1, logdir, name=variant)
    return {
        "wall_median_s": median(timer.seconds),
        "cpu_median_s": median(timer.cpu_seconds),
        "hook_cpu_median_s": sum(median(seconds[args.warmup :]) for seconds in hook_seconds),
        "n": len(timer.seconds),
    }


def one_off_costs(make_model: Callable[[], pl.LightningModule], args: argparse.Namespace) -> dict[str, float]:
    """Median seconds of a snapshot (CPU, device), a producer search and a plain forward + backward."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    x, y = torch.randn(64, model.net[0].in_features), torch.randn(64, model.net[-1].out_features)

    def forward_backward() -> None:
        opt.zero_grad()
        F.mse_loss(model.net(x), y).backward()

    forward_backward()
    opt.step()  # momentum buffers exist: the snapshot copies them too
    timings: dict[str, list[float]] = {
        "snapshot_cpu": [],
        "snapshot_device": [],
        "search": [],
        "search_anomaly": [],
        "forward_backward": [],
    }
    snapshots = {"snapshot_cpu": Snapshot("cpu"), "snapshot_device": Snapshot("device")}
    for rep in range(args.repetitions + 1):
        for name, snapshot in snapshots.items():
            start = time.perf_counter()
            snapshot.take(rep, model, [opt])
            timings[name].append(time.perf_counter() - start)
        start = time.perf_counter()
        forward_backward()
        timings["forward_backward"].append(time.perf_counter() - start)
        start = time.perf_counter()
        find_producer(model.net, lambda: F.mse_loss(model.net(x), y))
        timings["search"].append(time.perf_counter() - start)
        start = time.perf_counter()
        find_producer_by_anomaly(model.net, lambda: F.mse_loss(model.net(x), y))
        timings["search_anomaly"].append(time.perf_counter() - start)
    # The first snapshot allocates its copies; later ones copy into them (what a run pays every N steps).
    costs = {name: median(values[1:]) for name, values in timings.items()}
    costs["snapshot_mib"] = snapshots["snapshot_cpu"].nbytes / 2**20
    return {**costs, **buffer_copy_costs(args.repetitions)}


def bench_model(
    label: str, make_model: Callable[[], pl.LightningModule], make_data: Callable[[], Any], args: argparse.Namespace
) -> dict[str, Any]:
    variants = {v: (lambda v=v: timed_fit(v, make_model, make_data, args)) for v in args.variants}
    runs = interleaved(variants, args.repetitions)
    rows = [ratio_row(runs, v, key="{clock}_median_s") for v in args.variants]
    for row in rows:
        row["hook_cpu_ms"] = 1e3 * median([r["hook_cpu_median_s"] for r in runs[row["variant"]]])
    result = {"model": label, "runs": runs, "rows": rows}
    if label == "mlp":  # the one-off costs and the norm's share need the MLP's layers
        result.update(one_off=one_off_costs(make_model, args), norm_share=norm_share(make_model, args))
    return result


def norm_share(make_model: Callable[[], pl.LightningModule], args: argparse.Namespace) -> list[dict[str, float]]:
    """Per batch size of ``--norm-batch-sizes``: the median process CPU time of a plain-torch step (forward,
    backward, SGD) and of one fused norm over its gradients, over ``--repetitions`` × 3 steps after 3 untimed."""
    rows = []
    for batch_size in args.norm_batch_sizes:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        x, y = torch.randn(batch_size, model.net[0].in_features), torch.randn(batch_size, model.net[-1].out_features)
        steps, norms = [], []
        for _ in range(3 + 3 * args.repetitions):
            start = time.process_time()
            opt.zero_grad()
            F.mse_loss(model.net(x), y).backward()
            opt.step()
            steps.append(time.process_time() - start)
            grads = [p.grad for p in model.parameters()]
            start = time.process_time()
            torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)).square().sum()
            norms.append(time.process_time() - start)
        step, norm = median(steps[3:]), median(norms[3:])
        rows.append({"batch_size": batch_size, "step_s": step, "norm_s": norm, "share": norm / step})
    return rows


def format_rows(result: dict[str, Any]) -> str:
    bare = next(r["cpu_ms_per_step"] for r in result["rows"] if r["variant"] == "bare")
    table = markdown_table(
        [
            "variant",
            "wall ms/step",
            "wall ratio",
            "wall range",
            "CPU ms/step",
            "CPU ratio",
            "CPU range",
            "guard hooks ms",
            "their share of a bare step",
        ],
        [
            [
                r["variant"],
                *ratio_cells(r, "wall"),
                *ratio_cells(r, "cpu"),
                f"{r['hook_cpu_ms']:.3f}",
                f"{100 * r['hook_cpu_ms'] / bare:.2f} %",
            ]
            for r in result["rows"]
        ],
    )
    if "one_off" not in result:
        return table
    c = result["one_off"]
    shares = markdown_table(
        ["batch size", "plain step CPU ms", "one norm pass CPU ms", "its share"],
        [
            [r["batch_size"], f"{1e3 * r['step_s']:.2f}", f"{1e3 * r['norm_s']:.3f}", f"{100 * r['share']:.2f} %"]
            for r in result["norm_share"]
        ],
    )
    return (
        f"{table}\n\none-off, wall ms (median): snapshot of {c['snapshot_mib']:.1f} MiB to the CPU "
        f"{1e3 * c['snapshot_cpu']:.2f}, on the device {1e3 * c['snapshot_device']:.2f}; producer search "
        f"{1e3 * c['search']:.2f} (flags), {1e3 * c['search_anomaly']:.2f} (detect_anomaly) against a plain "
        f"forward + backward {1e3 * c['forward_backward']:.2f}; a ResNet-50's BatchNorm buffers copied at a step's "
        f"start {1e3 * c['buffer_copy_kept']:.3f} with the kept list, {1e3 * c['buffer_copy_walked']:.3f} walked "
        f"each step\n\n{shares}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_timing_arguments(parser)
    parser.add_argument(
        "--variants", nargs="+", choices=VARIANTS, default=["bare", "guard", "norm", "monitor", "monitor_guard"]
    )
    parser.add_argument(
        "--norm-batch-sizes", nargs="+", type=int, default=[64, 512, 2048], help="batch sizes of the norm's share"
    )
    parser.add_argument("--snapshot-every", type=int, default=10, help="snapshot cadence of the snapshot variants")
    parser.add_argument(
        "--mlp-batch-sizes", nargs="+", type=int, default=[], help="the MLP also at these batch sizes (mlp-b<size>)"
    )
    parser.set_defaults(models=["mlp"])
    args = parser.parse_args()
    if "bare" not in args.variants:
        args.variants = ["bare"] + args.variants
    apply_timing_arguments(args)
    batches = args.warmup + args.mlp_steps + 2
    models: dict[str, tuple[Callable[[], pl.LightningModule], Callable[[], Any]]] = {
        "mlp": (WideMLP, lambda: random_regression_loader(batches)),
        "cnn": (BNConvNet, lambda: image_loader(batches)),
    }
    for size in args.mlp_batch_sizes:
        models[f"mlp-b{size}"] = (WideMLP, lambda size=size: random_regression_loader(batches, size, MLP_WIDTH))
    args.models = [*args.models, *(f"mlp-b{size}" for size in args.mlp_batch_sizes)]
    print(f"# TrainingGuard overhead ({machine_line()}; {args.repetitions} repetitions, interleaved)")
    results = run_overhead(args, models, bench_model, format_rows)
    write_json(args.out, {"machine": machine_line(), "repetitions": args.repetitions, "results": results})


if __name__ == "__main__":
    main()
