"""Peak memory and logging-step time of each callback at its defaults, on a ~50M-parameter MLP.

Each variant runs in a fresh process, so that its peak resident set (``ru_maxrss``) is its own:
``bare`` (the module alone), each trainvitals callback alone at its defaults, and all of them together
— every variant with the same ``TensorBoardLogger`` and ``Trainer(log_every_n_steps=1)``, so that every
step is a logging step (the worst case). GradNormEarlyStopping alone has no noise source at batch 1
per micro-batch step, so its variant and ``all`` use ``accumulate_grad_batches=2`` in every variant.

Targets (issue 17): every callback at its defaults adds at most 10 % to the peak memory of a bare run,
and a logging step costs at most 1.5 × a bare step. With a GPU, ``torch.cuda.max_memory_allocated``
is reported too (``--device cuda``).

Step time is the median wall time of an optimizer step (its two micro-batch iterations, after the first
``--warmup`` iterations; StepTimer of ``_common``), one torch thread, and the median process CPU time
of the same steps: on a shared machine the wall-clock ratios swing with the other processes' load,
the CPU-time ratios much less.

    python benchmarks/bench_memory_overhead.py              # ~2-4 min on 2 CPU cores
    python benchmarks/bench_memory_overhead.py --width 1024 --depth 6 --steps 6   # smoke run
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable

import lightning.pytorch as pl
import torch
from _common import StepTimer, WideMLP, machine_line, markdown_table, median, quiet_lightning, write_json
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

from trainvitals import (
    BatchVarianceProbe,
    GradNormEarlyStopping,
    GradNormMonitor,
    GraphIntegrityCallback,
    LRScalingAdvisor,
    MemoryTopologyProfiler,
    TrainvitalsDashboard,
)

CALLBACKS: dict[str, Callable[[], list[pl.Callback]]] = {
    "bare": lambda: [],
    "GradNormMonitor": lambda: [GradNormMonitor()],
    "GradNormEarlyStopping": lambda: [GradNormEarlyStopping()],
    "BatchVarianceProbe": lambda: [BatchVarianceProbe()],
    "LRScalingAdvisor": lambda: [LRScalingAdvisor()],
    "GraphIntegrityCallback": lambda: [GraphIntegrityCallback()],
    "MemoryTopologyProfiler": lambda: [MemoryTopologyProfiler()],
    "TrainvitalsDashboard": lambda: [TrainvitalsDashboard()],
    "all": lambda: [
        GraphIntegrityCallback(),
        GradNormMonitor(),
        BatchVarianceProbe(),
        GradNormEarlyStopping(),
        LRScalingAdvisor(),
        MemoryTopologyProfiler(),
        TrainvitalsDashboard(),
    ],
}


def per_step_seconds(timer: StepTimer, cpu: bool = False) -> list[float]:
    """Wall (or process CPU) seconds of each whole optimizer step (its micro-batch iterations added up),
    complete ones only."""
    steps: dict[int, list[float]] = {}
    for step, seconds in zip(timer.steps, timer.cpu_seconds if cpu else timer.seconds):
        steps.setdefault(step, []).append(seconds)
    return [sum(s) for s in steps.values() if len(s) == 2]


def child(args: argparse.Namespace) -> None:
    """Run one variant and print its figures as one JSON line."""
    torch.set_num_threads(1)
    quiet_lightning()
    warnings.filterwarnings("ignore")
    device = torch.device(args.device)
    model = WideMLP(depth=args.depth, width=args.width)
    n = 2 * args.steps * args.batch_size
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, args.width, generator=g), torch.randn(n, args.width, generator=g))
    timer = StepTimer(warmup=args.warmup)
    with tempfile.TemporaryDirectory() as logdir:
        trainer = pl.Trainer(
            accelerator="cuda" if device.type == "cuda" else "cpu",
            devices=1,
            max_steps=args.steps,
            accumulate_grad_batches=2,
            logger=TensorBoardLogger(logdir),
            log_every_n_steps=1,
            callbacks=[timer, *CALLBACKS[args.child]()],
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        trainer.fit(model, DataLoader(data, batch_size=args.batch_size))
    result = {
        "variant": args.child,
        "parameters": sum(p.numel() for p in model.parameters()),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step_s": median(per_step_seconds(timer)),
        "cpu_step_s": median(per_step_seconds(timer, cpu=True)),
    }
    if device.type == "cuda":
        result["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--width", type=int, default=2900, help="features of each Linear (default ~50.5M parameters at depth 6)"
    )
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per variant")
    parser.add_argument("--warmup", type=int, default=4, help="iterations left out of the step time")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--variants", nargs="+", default=list(CALLBACKS), choices=list(CALLBACKS))
    parser.add_argument("--out", help="write the results as JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.child:
        child(args)
        return
    results = []
    for variant in args.variants:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            variant,
            "--width",
            str(args.width),
            "--depth",
            str(args.depth),
            "--batch-size",
            str(args.batch_size),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--device",
            args.device,
        ]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{variant}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
            continue
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"{variant}: {results[-1]}", file=sys.stderr, flush=True)
    bare = next((r for r in results if r["variant"] == "bare"), None)
    headers = ["variant", "peak RSS (MB)", "vs bare", "logging step (s)", "vs bare", "CPU s", "vs bare"]
    if args.device != "cpu":
        headers += ["CUDA peak (MB)", "vs bare"]
    rows = []
    for r in results:
        row = [
            r["variant"],
            f"{r['peak_rss_mb']:,.0f}",
            f"{r['peak_rss_mb'] / bare['peak_rss_mb']:.3f}" if bare else "",
            f"{r['step_s']:.3f}",
            f"{r['step_s'] / bare['step_s']:.2f}" if bare else "",
            f"{r['cpu_step_s']:.3f}",
            f"{r['cpu_step_s'] / bare['cpu_step_s']:.2f}" if bare else "",
        ]
        if "cuda_peak_mb" in r:
            row += [f"{r['cuda_peak_mb']:,.0f}", f"{r['cuda_peak_mb'] / bare['cuda_peak_mb']:.3f}" if bare else ""]
        rows.append(row)
    params = results[0]["parameters"] if results else 0
    print(
        f"\n{params / 1e6:.1f}M parameters, batch {args.batch_size} × 2 micro-batches, every step logged; {machine_line()}\n"
    )
    print(markdown_table(headers, rows))
    write_json(args.out, {"machine": machine_line(), "results": results})


if __name__ == "__main__":
    main()
