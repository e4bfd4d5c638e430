"""Training-step overhead of UpdateMonitor and ActivationMonitor against a bare run, in one process.

Variants, timed interleaved (bare, updates_idle, activations_idle, ..., bare, ...):

- ``bare``: the module alone;
- ``updates_idle`` / ``activations_idle``: the callback with a cadence never reached after step 0 (which the
  warm-up leaves out): the cost of a step that does not log (target ≤ 1.01); its hooks' own thread CPU
  time per step is given too, which the machine's drift between fits does not blur;
- ``updates_50`` / ``activations_50``: at Lightning's default cadence, every 50 steps (target ≤ 1.02
  amortised). Between fits this machine's speed drifts by more than the 2% to resolve, so these are
  also read as 1 + (paired − 1)/50 + the idle hooks' CPU time / bare step, from the variants below;
- ``updates_even`` / ``activations_even``: measuring on every second optimizer step, read paired within each
  fit: the CPU time of its measured steps against its other ones (medians). For ActivationMonitor this
  is the figure to set against Composer's ActivationMonitor (~5 % throughput on the batches it samples).

Models: (a) the 6M-parameter MLP of ``_common`` (49 Linear layers, ReLU between: 97 leaf modules
hooked), batch 64; (b) the demo CNN on the digits, batch 64. A fit's step time is the median of its
per-iteration times after ``--warmup`` iterations, in wall-clock and process CPU time.

Peak memory of a logging step is stated from the bound (UpdateMonitor: one copy of the parameters the
optimizer steps; ActivationMonitor: two float32 copies of the largest hooked output plus a bool mask of
it) and counted: the bytes of the tensors the callback holds at once, from their shapes.

    python benchmarks/bench_update_activation.py --repetitions 5 --out update_activation.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from _common import (
    StepTimer,
    add_timing_arguments,
    apply_timing_arguments,
    fit_once,
    interleaved,
    machine_line,
    markdown_table,
    median,
    overhead_models,
    ratio_cells,
    ratio_row,
    run_overhead,
    time_hook,
    write_json,
)
from lightning.pytorch.callbacks import Callback

from trainvitals import ActivationMonitor, UpdateMonitor

NEVER = 10**9
HOOKS = ("on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end")
VARIANTS = (
    "bare",
    "updates_idle",
    "activations_idle",
    "updates_50",
    "activations_50",
    "updates_even",
    "activations_even",
)


def _callback(variant: str) -> Callback | None:
    every = {"idle": NEVER, "50": 50, "even": 2}
    if variant == "bare":
        return None
    kind, cadence = variant.split("_")
    if kind == "updates":
        return UpdateMonitor(log_every_n_steps=every[cadence])
    return ActivationMonitor(measure_every_n_steps=every[cadence])


def timed_fit(
    variant: str, make_model: Callable[[], pl.LightningModule], make_data: Callable[[], Any], steps: int, warmup: int
) -> dict[str, float]:
    """One fit of ``warmup + steps`` optimizer steps; its step times (and, for ``*_even``, the paired ratio)."""
    pl.seed_everything(0, verbose=False)
    timer = StepTimer(warmup)
    extra = _callback(variant)
    hooks = [time_hook(extra, hook) for hook in HOOKS if extra is not None and hook in type(extra).__dict__]
    callbacks = [timer] + ([extra] if extra is not None else [])
    model = make_model()
    fit_once(model, make_data(), callbacks, warmup + steps + 1, log_every_n_steps=50)
    result = {
        "wall_median_s": median(timer.seconds),
        "cpu_median_s": median(timer.cpu_seconds),
        "n": len(timer.seconds),
        # thread CPU time of the callback's per-step hooks, summed per step (after the warm-up)
        "hook_cpu_s": sum(median(seconds[warmup:]) for seconds in hooks) if hooks else 0.0,
    }
    if variant.endswith("_even"):
        even = [t for step, t in zip(timer.steps, timer.cpu_seconds) if step % 2 == 0]
        odd = [t for step, t in zip(timer.steps, timer.cpu_seconds) if step % 2]
        result["paired_ratio"] = median(even) / median(odd)
    if variant == "bare":
        result.update(_memory_bounds(model))
    return result


def _memory_bounds(model: pl.LightningModule) -> dict[str, float]:
    """The transient bytes of a logging step, from shapes: UpdateMonitor's copy of the parameters;
    ActivationMonitor's float32 centred values, their squares and the bool mask of the largest hooked output."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = [0]

    def hook(module, inputs, output):
        if hasattr(output, "numel"):
            largest[0] = max(largest[0], output.numel())

    handles = [m.register_forward_hook(hook) for m in model.modules() if next(m.children(), None) is None]
    batch = next(iter(model.trainer.train_dataloader))
    model(batch[0])
    for h in handles:
        h.remove()
    # float32 centred values and their squares, and a bool mask: 4 + 4 + 1 bytes an entry
    return {"update_transient_bytes": params, "activation_transient_bytes": largest[0] * (4 + 4 + 1)}


def bench_model(
    label: str, make_model: Callable[[], pl.LightningModule], make_data: Callable[[], Any], args: argparse.Namespace
) -> dict[str, Any]:
    variants = {v: (lambda v=v: timed_fit(v, make_model, make_data, args.steps[label], args.warmup)) for v in VARIANTS}
    runs = interleaved(variants, args.repetitions)
    rows = [ratio_row(runs, v, key="{clock}_median_s") for v in VARIANTS]
    for row in rows:
        row["hook_cpu_us"] = 1e6 * median([r["hook_cpu_s"] for r in runs[row["variant"]]])
    paired = {v: [r["paired_ratio"] for r in runs[v]] for v in VARIANTS if v.endswith("_even")}
    bare_cpu = median([r["cpu_median_s"] for r in runs["bare"]])
    idle = {row["variant"]: row["hook_cpu_us"] * 1e-6 / bare_cpu for row in rows}  # idle hooks / bare step
    amortised = {
        kind: 1 + (median(paired[f"{kind}_even"]) - 1) / 50 + idle[f"{kind}_idle"]
        for kind in ("updates", "activations")
    }
    return {
        "model": label,
        "runs": runs,
        "rows": rows,
        "paired": paired,
        "amortised_50": amortised,
        "memory": {k: v for k, v in runs["bare"][0].items() if k.endswith("_bytes")},
    }


def format_rows(result: dict[str, Any]) -> str:
    table = markdown_table(
        [
            "variant",
            "wall ms/step",
            "wall ratio",
            "wall range",
            "CPU ms/step",
            "CPU ratio",
            "CPU range",
            "hooks CPU µs/step (median)",
            "steps",
        ],
        [
            [r["variant"], *ratio_cells(r, "wall"), *ratio_cells(r, "cpu"), f"{r['hook_cpu_us']:.1f}", r["steps_timed"]]
            for r in result["rows"]
        ],
    )
    lines = [table, ""]
    for variant, ratios in result["paired"].items():
        lines.append(
            f"{variant}, paired within each fit: measured step / other step {median(ratios):.3f} "
            f"[{min(ratios):.3f}–{max(ratios):.3f}]"
        )
    for kind, value in result["amortised_50"].items():
        lines.append(f"{kind} every 50 steps, amortised (paired and idle hooks): {value:.4f}")
    memory = result["memory"]
    lines.append(
        f"transient memory of a logging step: UpdateMonitor {memory['update_transient_bytes'] / 2**20:.1f} MiB "
        f"(the parameters' bytes), ActivationMonitor {memory['activation_transient_bytes'] / 2**20:.2f} MiB "
        "(largest output: two float32 copies + mask)"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_timing_arguments(parser, repetitions=5)
    args = parser.parse_args()
    apply_timing_arguments(args)
    print(f"# UpdateMonitor and ActivationMonitor overhead ({machine_line()}; {args.repetitions} repetitions)")
    results = run_overhead(args, overhead_models(args), bench_model, format_rows)
    write_json(args.out, {"machine": machine_line(), "repetitions": args.repetitions, "results": results})


if __name__ == "__main__":
    main()
