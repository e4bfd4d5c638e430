"""The CUDA path of MemoryTopologyProfiler in one go: peaks, temporaries, snapshot, overhead.

For a machine with a CUDA device (CI has none; there the script says so and exits 0). Each check
prints PASS or FAIL with its numbers; the exit status is 1 if any check fails. About a minute.

1. Saved activations on CUDA of the 6M-parameter benchmark MLP (97 modules) equal the hand count, and
   agree with the allocator: ``memory_allocated`` grows over a forward by the saved bytes plus the
   0-d loss (within 10%); module forward times come from CUDA events.
2. In a fit: the logged peaks bound what must coexist (peak allocated ≥ parameters + inputs +
   activations, and ≥ parameters + gradients + optimizer state; reserved ≥ allocated);
   temporaries = peak − the categories; no OOM; the default budget is the device's memory and a
   largest batch is logged.
3. ``snapshot_steps=2`` writes ``memory_snapshot_rank0.pickle``, a dict with ``segments`` and
   ``device_traces``, next to the logs.
4. Overhead on the 6M-parameter MLP: profiled / unprofiled step (paired within one fit of
   ``measure_every_n_steps=2``) ≤ 1.5, and amortised at every 50 steps, 1 + (r − 1)/50, ≤ 1.03.

    python benchmarks/gpu_memory_check.py --out gpu_memory_check.json
"""

from __future__ import annotations

import argparse
import csv
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from _common import (
    MLP_DEPTH,
    MLP_WIDTH,
    StepTimer,
    WideMLP,
    median,
    quiet_lightning,
    random_regression_loader,
    write_json,
)
from lightning.pytorch.loggers import CSVLogger

from trainvitals.memory import SavedTensorRecorder
from trainvitals.memory.profiler import MemoryTopologyProfiler

B = 64  # the batch of random_regression_loader
F32 = 4
# Saved per batch, by hand: each of the 48 ReLUs its output (saved again by the next Linear), and
# mse_loss the last Linear's output (and the target, which is the batch). The first Linear saves only
# the batch; the weights are parameters. 64 · 350 · 4 bytes is a multiple of the allocator's 512.
HAND_COUNT = (MLP_DEPTH - 1 + 1) * B * MLP_WIDTH * F32
RESULTS: list[dict[str, Any]] = []


def check(name: str, ok: bool, **numbers: Any) -> None:
    RESULTS.append({"check": name, "ok": bool(ok), **numbers})
    shown = ", ".join(f"{k}={v:,}" if isinstance(v, int) else f"{k}={v}" for k, v in numbers.items())
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {shown}")


class AdamMLP(WideMLP):
    """The benchmark MLP with Adam, whose state (2 × parameter bytes) makes the peak bounds telling."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


def check_saved_bytes_against_the_allocator(device: torch.device) -> None:
    model = AdamMLP().to(device)
    x, y = torch.randn(B, MLP_WIDTH, device=device), torch.randn(B, MLP_WIDTH, device=device)
    F.mse_loss(model(x), y).backward()  # cuBLAS allocates its workspace at the first matmul
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    with SavedTensorRecorder(model, exclude=[x, y], time_modules=True) as recorder:
        loss = F.mse_loss(model(x), y)
    report = recorder.report()
    grown = torch.cuda.memory_allocated(device) - before
    check(
        "saved activations on CUDA = hand count",
        report.total_bytes == HAND_COUNT,
        measured=report.total_bytes,
        hand_count=HAND_COUNT,
    )
    # Left allocated by the forward: the saved tensors and the 0-d loss (a 512-byte block); the
    # Linear outputs that a ReLU consumed are not saved, so already freed.
    check(
        "allocator growth over the forward ≈ saved bytes (10%)",
        abs(grown - report.total_bytes) <= 0.10 * grown,
        allocator_growth=grown,
        saved=report.total_bytes,
    )
    check(
        "CUDA-event module times",
        report.forward_seconds.get("net", 0.0) > 0,
        net_forward_ms=round(1e3 * report.forward_seconds.get("net", 0.0), 4),
    )
    del loss


def metrics_rows(logger: CSVLogger) -> list[dict[str, float]]:
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def check_fit(device: torch.device, logdir: str) -> None:
    profiler = MemoryTopologyProfiler(measure_every_n_steps=1, snapshot_steps=2)
    logger = CSVLogger(logdir, name="fit")
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=[device.index or 0],
        max_steps=4,
        logger=logger,
        callbacks=[profiler],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(AdamMLP(), random_regression_loader(8))
    rows = [r for r in metrics_rows(logger) if "memory/activations_bytes" in r]
    steps = [int(r["step"]) for r in rows]
    check("one row per profiled step", steps == [0, 1, 2, 3], steps=steps)
    for r in rows:
        step = int(r["step"])
        params, grads = r["memory/parameters_bytes"], r["memory/gradients_bytes"]
        state = r["memory/optimizer_state_bytes"]
        inputs, acts, peak = r["memory/inputs_bytes"], r["memory/activations_bytes"], r["memory/peak_allocated_bytes"]
        check(f"step {step}: activations = hand count", acts == HAND_COUNT, activations=int(acts))
        check(
            f"step {step}: peak ≥ what coexists",
            peak >= params + inputs + acts and peak >= params + grads + state,
            peak=int(peak),
            forward_end=int(params + inputs + acts),
            optimizer_step=int(params + grads + state),
        )
        check(
            f"step {step}: reserved ≥ allocated",
            r["memory/peak_reserved_bytes"] >= peak,
            reserved=int(r["memory/peak_reserved_bytes"]),
        )
        known = params + grads + state + inputs + acts
        check(
            f"step {step}: temporaries = peak − categories",
            r["memory/temporaries_bytes"] == peak - known,
            temporaries=int(r["memory/temporaries_bytes"]),
        )
        check(
            f"step {step}: no OOM",
            r["memory/ooms"] == 0,
            ooms=int(r["memory/ooms"]),
            alloc_retries=int(r["memory/alloc_retries"]),
        )
    total = torch.cuda.get_device_properties(device).total_memory
    check(
        "default budget = device memory, largest batch logged",
        profiler.last is not None and profiler.last.budget_bytes == total and "memory/largest_batch" in rows[-1],
        budget=total,
        largest_batch=int(rows[-1].get("memory/largest_batch", -1)),
    )
    snapshot = Path(trainer.log_dir or logdir) / "memory_snapshot_rank0.pickle"
    content = pickle.loads(snapshot.read_bytes()) if snapshot.exists() else {}
    check(
        "snapshot written and readable",
        isinstance(content, dict) and {"segments", "device_traces"} <= set(content),
        path=str(snapshot),
        size_bytes=snapshot.stat().st_size if snapshot.exists() else 0,
    )
    print("\n" + profiler.summary_markdown() + "\n")


def check_overhead(device: torch.device, steps: int, warmup: int) -> None:
    timer = StepTimer(warmup)
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=[device.index or 0],
        max_steps=warmup + steps + 1,
        logger=False,
        callbacks=[timer, MemoryTopologyProfiler(measure_every_n_steps=2, first_steps=0)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(WideMLP(), random_regression_loader(warmup + steps + 2))
    # StepTimer's interval j is optimizer step warmup + j; the even steps are profiled.
    profiled = [t for j, t in enumerate(timer.seconds) if (warmup + j) % 2 == 0]
    others = [t for j, t in enumerate(timer.seconds) if (warmup + j) % 2 == 1]
    ratio = median(profiled) / median(others)
    check(
        "profiled / unprofiled step ≤ 1.5",
        ratio <= 1.5,
        ratio=round(ratio, 3),
        profiled_ms=round(1e3 * median(profiled), 3),
        unprofiled_ms=round(1e3 * median(others), 3),
    )
    amortised = 1 + (ratio - 1) / 50
    check("amortised at every 50 steps ≤ 1.03", amortised <= 1.03, amortised=round(amortised, 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", type=int, default=0, help="CUDA device index")
    parser.add_argument("--steps", type=int, default=60, help="timed steps of the overhead fit")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps of the overhead fit")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing checked (this script is for a CUDA machine)")
        return
    quiet_lightning()
    device = torch.device("cuda", args.device)
    torch.cuda.set_device(device)
    print(f"# MemoryTopologyProfiler on {torch.cuda.get_device_name(device)} (torch {torch.__version__})\n")
    check_saved_bytes_against_the_allocator(device)
    with tempfile.TemporaryDirectory() as logdir:
        check_fit(device, logdir)
    check_overhead(device, args.steps, args.warmup)
    failed = [r["check"] for r in RESULTS if not r["ok"]]
    print(f"\n{len(RESULTS) - len(failed)} of {len(RESULTS)} checks passed" + (f"; failed: {failed}" if failed else ""))
    write_json(args.out, {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "checks": RESULTS})
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
